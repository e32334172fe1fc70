"""Are the engine's step and request records the same before and after a change?

Runs a fixed set of engine configurations (real runs of the bundled model, and simulator
replays) and writes each one's settled step records and request records as JSON, with the
wall-clock fields dropped (they differ from run to run; the simulator's simulated times are
kept, they are deterministic). Run it on the old code and on the new, then compare:

    python benchmarks/records_identical.py dump /tmp/records-before      # at the old commit
    python benchmarks/records_identical.py dump /tmp/records-after       # at the new one
    python benchmarks/records_identical.py compare /tmp/records-before /tmp/records-after

``compare`` exits 1 and names the first difference when any configuration differs.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import click

#: wall-clock fields of real runs: measured, not decided, so they differ between any two runs
WALL_FIELDS = {
    "time_s",
    "wall_time_s",
    "schedule_time_s",
    "model_time_s",
    "sample_time_s",
    "comm_time_s",
    "copy_time_s",
    "arrival_time_s",
    "first_scheduled_time_s",
    "first_token_time_s",
    "finish_time_s",
    "ttft_s",
    "tpot_s",
    "e2e_s",
    "queue_time_s",
    "itl_s",
}

#: name -> engine arguments of a real run of the bundled model (float32: exact on every CPU)
REAL = {
    "paged": dict(max_num_seqs=8),
    "paged-prefix-chunked": dict(
        max_num_seqs=8, enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=96
    ),
    "recompute-tight": dict(max_num_seqs=8, num_gpu_blocks_override=16, max_model_len=256, preemption_mode="recompute"),
    "swap-tight": dict(
        max_num_seqs=8, num_gpu_blocks_override=16, max_model_len=256, preemption_mode="swap", swap_space=0.05
    ),
    "orca-max": dict(max_num_seqs=8, kv_allocator="orca-max", num_gpu_blocks_override=64, max_model_len=1024),
    "static-batching": dict(max_num_seqs=4, batching_policy="static"),
    "parallel-sampling-priority": dict(
        max_num_seqs=8, scheduling_policy="priority", num_gpu_blocks_override=40, max_model_len=640
    ),
}

#: name -> (engine arguments, request rate, duration s) of a simulator replay of Llama-2-70B on 4 x A100-80GB
SIM = {
    "sim-70b": (dict(gpu_memory_utilization=0.9, max_num_seqs=256), 12.0, 60.0),
    "sim-70b-tight-swap": (
        dict(gpu_memory_utilization=0.9, max_num_seqs=64, num_gpu_blocks_override=600, preemption_mode="swap"),
        8.0,
        30.0,
    ),
    "sim-70b-orca-max": (dict(gpu_memory_utilization=0.9, max_num_seqs=64, kv_allocator="orca-max"), 4.0, 30.0),
}


def _prompts() -> list[str]:
    from workbench.bench.datasets import default_prompts

    shared = "You are a careful assistant. Answer in one short paragraph, and name your sources. " * 3
    recs = default_prompts()[:10]
    return [r.prompt for r in recs] + [shared + q for q in ("What is a KV cache?", "What is paged attention?")]


def _clean(d: dict, drop: set[str]) -> dict:
    return {k: v for k, v in d.items() if k not in drop}


def _real(name: str, args: dict) -> dict:
    from workbench import LLM, SamplingParams

    llm = LLM(dtype="float32", block_size=16, seed=0, **args)
    sps = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    kw = {}
    if name == "parallel-sampling-priority":
        sps = [
            SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True, n=2 if i % 3 == 0 else 1)
            for i in range(len(prompts))
        ]
        kw["priority"] = [i % 3 for i in range(len(prompts))]
    llm.generate(prompts, sps, **kw)
    rec = llm.llm_engine.recorder
    llm.shutdown()
    return {
        "steps": [_clean(s.to_dict(), WALL_FIELDS) for s in rec.steps],
        "requests": [_clean(r.to_dict(), WALL_FIELDS) for r in rec.requests],
    }


def _sim(args: dict, rate: float, duration: float) -> dict:
    from workbench.catalog import MODELS
    from workbench.config import EngineConfig
    from workbench.sim import SimEngine, SimSpec, find_hardware, make_trace

    spec = SimSpec(MODELS["llama-2-70b"], find_hardware("A100-80GB"), 4)
    eng = SimEngine(EngineConfig(**args), spec)
    eng.add_trace(make_trace(rate, duration, "sharegpt", "poisson", 0))
    eng.run()
    return {
        "steps": [s.to_dict() for s in eng.recorder.steps],
        "requests": [r.to_dict() for r in eng.recorder.requests],
    }


@click.group()
def cli():
    """Dump the records of fixed configurations, or compare two dumps."""


@cli.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--only", multiple=True, help="run only these configurations (default: all)")
def dump(out: Path, only: tuple[str, ...]):
    """Run every configuration and write OUT/<name>.json."""
    out.mkdir(parents=True, exist_ok=True)
    names = list(REAL) + list(SIM)
    for name in only or names:
        data = _real(name, REAL[name]) if name in REAL else _sim(*SIM[name])
        text = json.dumps(data, sort_keys=True)
        (out / f"{name}.json").write_text(text)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        print(f"{name:28s} {len(data['steps']):6d} steps {len(data['requests']):5d} requests  sha256 {digest}")


@cli.command()
@click.argument("before", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("after", type=click.Path(exists=True, file_okay=False, path_type=Path))
def compare(before: Path, after: Path):
    """Compare two dumps configuration by configuration; exit 1 on any difference."""
    bad = 0
    for f in sorted(before.glob("*.json")):
        g = after / f.name
        if not g.exists():
            print(f"{f.stem:28s} MISSING in {after}")
            bad += 1
            continue
        a, b = json.loads(f.read_text()), json.loads(g.read_text())
        if not f.stem.startswith("sim-"):  # wall-clock fields a dump of an older version of this script kept
            a, b = ({k: [_clean(r, WALL_FIELDS) for r in d[k]] for k in ("steps", "requests")} for d in (a, b))
        if a == b:
            print(f"{f.stem:28s} identical ({len(a['steps'])} steps, {len(a['requests'])} requests)")
            continue
        bad += 1
        for kind in ("steps", "requests"):
            for i, (x, y) in enumerate(zip(a[kind], b[kind])):
                if x != y:
                    diff = {k: (x.get(k), y.get(k)) for k in set(x) | set(y) if x.get(k) != y.get(k)}
                    print(f"{f.stem:28s} DIFFERS: {kind}[{i}]: {diff}")
                    break
            else:
                if len(a[kind]) != len(b[kind]):
                    print(f"{f.stem:28s} DIFFERS: {len(a[kind])} vs {len(b[kind])} {kind}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    cli()
