"""KV defragmentation by block copies: cost against benefit (issue 18, chapter 14).

Part ``contiguous`` (simulator: the real scheduler and contiguous KV manager, a cost model for time): Llama-2-7B
on one A100-80GB with a deliberately tight KV pool, ``orca-max`` (first-fit, each request reserves prompt +
``max_tokens``), ShareGPT-like long-tailed lengths arriving faster than they are served, so the head of the queue
often finds enough free blocks but no hole large enough. One row per ``kv_defrag_trigger`` (none, fragmentation,
waiting, highest-block): requests finished, simulated time to finish them all, request throughput, mean queueing
time, compaction passes, blocks and bytes moved, modelled copy time (each moved block read and written once through
HBM) and its share of the run, and requests admitted in the step after a pass that no hole held before it. Counts
are exact (deterministic replays); times are the cost model's, indicative.

Part ``paged``: the same trace with paged allocation, no trigger vs ``highest-block`` (Intel Gaudi's rule) and
``waiting``: requests and time identical (any free block serves: external fragmentation is zero every step, so the
``waiting`` trigger never fires), and what compaction does change — the highest used block id (its gap above the
used-block count), mean and peak over steps.

Part ``copy``: the bundled model's real KV cache on this CPU: seconds to move 16..256 blocks through the
executor's copy path (``LLMEngine.compact`` uses it), disjoint moves (one round) and a region sliding down by a
quarter of its length (dst = earlier src), median of ``--repeats``; times on a shared CPU are indicative.

    python benchmarks/defrag.py all            # the three parts (a few minutes on 2 cores)
    python benchmarks/defrag.py contiguous --num-blocks 700
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click

TRIGGERS = ("none", "fragmentation", "waiting", "highest-block")


def _sim(allocator: str, trigger: str, rate: float, duration: float, num_blocks: int, max_tokens: int, seed: int):
    from workbench.labs.ch14_defragmentation import sim_trigger_row  # chapter 14 shows the same rows

    return sim_trigger_row(allocator, trigger, rate, duration, num_blocks, max_tokens, seed)


def _table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


@click.group()
def cli():
    """Defragmentation benchmarks (a markdown table on stdout; JSON with --out)."""


def _contiguous(rate, duration, num_blocks, max_tokens, seed):
    rows = [_sim("orca-max", t, rate, duration, num_blocks, max_tokens, seed) for t in TRIGGERS]
    cols = ["trigger", "finished", "sim_duration_s", "req_per_s", "mean_queue_s", "steps_external_frag", "passes"]
    cols += ["blocks_moved", "gib_moved", "copy_s", "copy_share", "unblocked"]
    print(f"\ncontiguous (orca-max, first-fit): {num_blocks} blocks of 16 tokens, max_tokens {max_tokens}")
    print(_table(rows, cols))
    return rows


def _paged(rate, duration, num_blocks, max_tokens, seed):
    rows = [
        _sim("paged", t, rate, duration, num_blocks, max_tokens, seed) for t in ("none", "waiting", "highest-block")
    ]
    cols = ["trigger", "finished", "sim_duration_s", "mean_queue_s", "steps_external_frag", "passes", "blocks_moved"]
    cols += ["gib_moved", "copy_share", "gap_mean", "gap_max", "highest_used_mean", "highest_used_max"]
    print(f"\npaged: {num_blocks} blocks of 16 tokens")
    print(_table(rows, cols))
    return rows


def _copy(repeats: int):
    import torch

    from workbench import LLMEngine
    from workbench.config import EngineConfig

    eng = LLMEngine(EngineConfig(num_gpu_blocks_override=1024, max_model_len=2048))
    bb = eng.memory.block_bytes
    rows = []
    for n in (16, 64, 256):
        cases = {
            "disjoint": [(1023 - i, i) for i in range(n)],  # highest into lowest (Gaudi): one round
            "slide": [(n // 4 + i, i) for i in range(n)],  # a region slides down by n/4: dst = earlier src
        }
        for kind, pairs in cases.items():
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                eng.executor.copy_blocks([], pairs, [])
                times.append(time.perf_counter() - t0)
            t = statistics.median(times)
            rows.append(
                {
                    "blocks": n,
                    "moves": kind,
                    "mib": round(n * bb / 2**20, 2),
                    "ms": round(t * 1e3, 2),
                    "gib_per_s": round(n * bb / t / 2**30, 2),
                }
            )
    print(f"\ncopy on this CPU: bundled model, block {bb} bytes, {torch.get_num_threads()} threads (indicative)")
    print(_table(rows, ["blocks", "moves", "mib", "ms", "gib_per_s"]))
    return {"block_bytes": bb, "rows": rows}


_OPTS = [
    click.option("--rate", default=6.0, show_default=True, help="requests per second"),
    click.option("--duration", default=60.0, show_default=True, help="seconds of arrivals"),
    click.option("--num-blocks", default=500, show_default=True, help="KV blocks (16 tokens each)"),
    click.option("--max-tokens", default=512, show_default=True, help="output cap (orca-max reserves it)"),
    click.option("--seed", default=0, show_default=True),
]


def _with_opts(f):
    for o in reversed(_OPTS):
        f = o(f)
    return f


@cli.command()
@_with_opts
def contiguous(rate, duration, num_blocks, max_tokens, seed):
    """orca-max under each trigger (simulator)."""
    _contiguous(rate, duration, num_blocks, max_tokens, seed)


@cli.command()
@_with_opts
def paged(rate, duration, num_blocks, max_tokens, seed):
    """Paged with and without compaction (simulator)."""
    _paged(rate, duration, num_blocks, max_tokens, seed)


@cli.command()
@click.option("--repeats", default=5, show_default=True)
def copy(repeats):
    """Block-move time on the bundled model's KV cache (this CPU)."""
    _copy(repeats)


@cli.command(name="all")
@_with_opts
@click.option("--repeats", default=5, show_default=True)
@click.option("--out", default=None, help="write the results as JSON here")
def all_parts(rate, duration, num_blocks, max_tokens, seed, repeats, out):
    """The three parts."""
    res = {
        "contiguous": _contiguous(rate, duration, num_blocks, max_tokens, seed),
        "paged": _paged(rate, duration, num_blocks, max_tokens, seed),
        "copy": _copy(repeats),
    }
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    cli()
