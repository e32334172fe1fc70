"""Chapter 6, sharing and preemption: prefix sharing, parallel sampling with copy-on-write, recompute vs swap.

The notebook ``labs/06_sharing_and_preemption.ipynb`` calls these, one call per cell; its exercises are at the end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from workbench.labs.exercise_registry import _number, _register

# the notebook calls these too (ch.memory_timeline)
from workbench.labs.runs import (
    lab_engine,
    lab_run,
    lab_trace,
    memory_timeline,  # noqa: F401
)
from workbench.viz.table import Column, Table


def prefix_sharing_runs(
    n_values: Sequence[int] = (2, 4), prefix_tokens: int = 40, block_size: int = 16, suffix_tokens: int = 6
) -> list[dict[str, Any]]:
    """Measured prefix-cache savings: for each N, N requests = one shared prefix of ``prefix_tokens``
    token ids + a distinct suffix, each generating 16 tokens, run without and with
    ``enable_prefix_caching``. Requests are admitted one per step (no chunked prefill, and a token
    budget, ``max_num_batched_tokens`` = ``max_model_len`` = 64, that holds one prompt), so each
    later request finds the earlier ones' full prompt blocks in the cache; all N run at once at the
    peak. ``blocks_saved`` = blocks served from the cache (prefix-hit tokens / ``block_size``);
    ``blocks_without`` / ``blocks_with`` = peak blocks used."""
    from workbench.bench.datasets import PromptRecord

    out = []
    prefix = [100 + (i % 50) for i in range(prefix_tokens)]
    for n in n_values:
        records = [
            PromptRecord(prefix + [300 + 7 * j + k for k in range(suffix_tokens)], False, f"s{j}", 16, 16)
            for j in range(n)
        ]
        peak = {}
        hits = 0
        for cache in (False, True):
            res = lab_run(
                records,
                enable_prefix_caching=cache,
                block_size=block_size,
                num_gpu_blocks_override=256,
                max_num_seqs=n,
                max_model_len=64,
                max_num_batched_tokens=64,
                enable_chunked_prefill=False,
            )
            steps = res.recorder.steps
            peak[cache] = max(s.blocks_used for s in steps)
            if cache:
                hits = sum(s.prefix_cache_hits for s in steps)
        out.append(
            {
                "n": n,
                "prefix_tokens": prefix_tokens,
                "block_size": block_size,
                "blocks_without": peak[False],
                "blocks_with": peak[True],
                "blocks_saved": hits // block_size,
                "prefix_hit_tokens": hits,
            }
        )
    return out


def preemption_runs(records=None, **engine_args) -> dict[str, Any]:
    """The same requests on a pool too small for all of them: preemption by recompute vs swap."""
    records = list(records) if records is not None else lab_trace(8, mean_output=40, max_output=96)
    args = {"num_gpu_blocks_override": 20, "max_num_seqs": 8} | engine_args
    return {
        "recompute": lab_run(records, preemption_mode="recompute", **args),
        "swap": lab_run(records, preemption_mode="swap", swap_space=0.25, **args),
    }


def rows_table(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> Table:
    """A table of ``keys`` over ``rows`` (values as ``str``, right-aligned)."""
    return Table([Column(k, k, str) for k in keys], rows)


def parallel_sampling_run(n: int = 4, max_tokens: int = 12, block_size: int = 16, **engine_args) -> dict[str, Any]:
    """One prompt sampled ``n`` times (seeded) vs ``n`` separate copies of it: peak blocks, and the
    copy-on-write block copies the shared run made."""
    from workbench.bench.run import to_engine_prompt
    from workbench.sampling import SamplingParams

    rec = lab_trace(1)[0]
    out = {"n": n}
    for shared in (True, False):
        llm = lab_engine(block_size=block_size, num_gpu_blocks_override=128, **engine_args)
        eng = llm.llm_engine
        params = SamplingParams(n=n if shared else 1, temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
        prompts = [to_engine_prompt(rec)] * (1 if shared else n)
        llm.generate(prompts, params, use_tqdm=False)
        steps = eng.recorder.steps
        out["prompt_tokens"] = eng.recorder.requests[0].prompt_tokens
        key = "peak_blocks_shared" if shared else "peak_blocks_unshared"
        out[key] = max(s.blocks_used for s in steps)
        if shared:
            out["cow_block_copies"] = sum(s.cow_block_copies for s in steps)
    return out


def preemption_table(runs: dict[str, Any]) -> Table:
    """Preemptions, prefill (recomputed prompt) tokens and swapped blocks of each preemption mode's run.

    Rows ``{"mode", "steps", "preempted", "prefill_tokens", "swap_out_blocks", "swap_in_blocks", "output_tokens"}``."""
    rows = []
    for mode, r in runs.items():
        st = r.recorder.steps
        rows.append(
            {
                "mode": mode,
                "steps": len(st),
                "preempted": sum(s.num_preemptions for s in st),
                "prefill_tokens": sum(s.num_prefill_tokens for s in st),
                "swap_out_blocks": sum(s.swap_out_blocks for s in st),
                "swap_in_blocks": sum(s.swap_in_blocks for s in st),
                "output_tokens": r.summary["output_tokens_total"],
            }
        )
    return Table(
        [
            Column("mode", "mode", align="left"),
            Column("steps", "steps"),
            Column("preempted", "preempted"),
            Column("prefill_tokens", "prefill (tokens)"),
            Column("swap_out_blocks", "swap out (blocks)"),
            Column("swap_in_blocks", "swap in (blocks)"),
            Column("output_tokens", "output (tokens)"),
        ],
        rows,
    )


# ---------------------------------------------------------------- exercises
@_register(
    "6.1",
    "N requests share a system prompt of P tokens; with prefix caching and block size B, how many KV blocks "
    "does sharing save? Write blocks_saved(N, P, B); checked against the engine's own runs.",
    "only whole blocks are shared: each of the N - 1 later requests reuses P // B blocks.",
)
class _PrefixSaving:
    @staticmethod
    def solution(runs: list) -> Callable:
        return lambda n, p, b: (n - 1) * (p // b)

    @staticmethod
    def judge(answer, runs: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        for r in runs:
            got = answer(r["n"], r["prefix_tokens"], r["block_size"])
            if got != r["blocks_saved"]:
                return False, (
                    f"N={r['n']}, P={r['prefix_tokens']}, B={r['block_size']}: yours {got!r}, "
                    f"the engine saved {r['blocks_saved']} blocks"
                )
        return True, f"equal to the engine's saving in all {len(runs)} measured runs"


@_register(
    "6.2",
    "How many bytes did swapping move between device and host memory in the swap run (out and in together)?",
    "sum the steps' swap_out_blocks + swap_in_blocks, times the block's bytes (block_size x kv_bytes_per_token).",
)
class _SwapBytes:
    @staticmethod
    def solution(steps: list) -> int:
        return sum(
            (s["swap_out_blocks"] + s["swap_in_blocks"]) * s["block_size"] * s["kv_bytes_per_token"] for s in steps
        )

    @staticmethod
    def judge(answer, steps: list) -> tuple[bool, str]:
        ref = _SwapBytes.solution(steps)
        x = _number(answer)
        if x is None:
            return False, f"give bytes as a number, got {answer!r}"
        if x == ref:
            return True, f"{ref:,} B moved ({ref / 2**20:.2f} MiB)"
        blocks = sum(s["swap_out_blocks"] + s["swap_in_blocks"] for s in steps)
        if x == blocks:
            return False, "that is the number of blocks; multiply by the bytes of one block"
        return False, f"{x:,.0f} B is not it"
