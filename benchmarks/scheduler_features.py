"""Scheduler and KV-manager mechanisms, each on vs off in the same run (issue 4).

1. prefix caching on a trace whose requests share a long system prompt: throughput, TTFT;
2. chunked prefill: p99 inter-token latency of running decodes while long prompts arrive;
3. preemption by recompute vs swap under memory pressure: throughput and end-to-end latency.

The bundled SmolLM2-135M-Instruct, float32, greedy, EOS ignored; each configuration runs
``--repeats`` times (interleaved) and the table reports medians. Results: docs/benchmarks.md.

    python benchmarks/scheduler_features.py            # all three, 3 repeats
    python benchmarks/scheduler_features.py --only prefix --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from workbench import LLM, SamplingParams
from workbench.bench.datasets import default_prompts

REPO = Path(__file__).resolve().parents[1]


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def user_questions(n: int) -> list[str]:
    return [r.prompt for r in default_prompts() if isinstance(r.prompt, str) and len(r.prompt) < 200][:n]


def long_documents(n: int) -> list[str]:
    return [r.prompt for r in default_prompts() if isinstance(r.prompt, str) and len(r.prompt) > 3000][:n]


def run_prefix(model_args: dict, n: int, max_tokens: int) -> dict:
    system = long_documents(1)[0]
    msgs = [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in user_questions(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for name, caching in (("prefix caching off", False), ("prefix caching on", True)):
        llm = LLM(**model_args, enable_prefix_caching=caching)  # a cold cache for every run
        eng = llm.llm_engine
        t = time.perf_counter()
        outs = llm.generate(msgs, sp)
        wall = time.perf_counter() - t
        steps = eng.recorder.steps
        toks = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)
        q = sum(s.prefix_cache_queries for s in steps)
        out[name] = {
            "wall_s": wall,
            "total_tok_s": toks / wall,
            "ttft_p50_s": pct([o.metrics["ttft_s"] for o in outs], 50),
            "ttft_p99_s": pct([o.metrics["ttft_s"] for o in outs], 99),
            "prefill_tokens_computed": sum(s.num_prefill_tokens for s in steps),
            "hit_rate": sum(s.prefix_cache_hits for s in steps) / q if q else 0.0,
        }
    return out


def run_chunked(model_args: dict, n_short: int, n_long: int, budget: int, max_tokens: int) -> dict:
    shorts = [[{"role": "user", "content": q}] for q in user_questions(n_short)]
    longs = [[{"role": "user", "content": d}] for d in long_documents(n_long)]
    out = {}
    for name, args in (
        ("chunked prefill off", {"enable_chunked_prefill": False}),
        (f"chunked prefill on (budget {budget})", {"enable_chunked_prefill": True, "max_num_batched_tokens": budget}),
    ):
        llm = LLM(**model_args, **args)
        eng = llm.llm_engine
        sp_short = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp_long = SamplingParams(max_tokens=8, ignore_eos=True)
        for i, m in enumerate(shorts):
            eng.add_request(f"s{i}", m, sp_short)
        t = time.perf_counter()
        done = {}
        step = 0
        arrivals = {8 + 12 * k: k for k in range(len(longs))}  # a long prompt every 12 steps
        while eng.has_unfinished_requests() or arrivals:
            if step in arrivals:
                k = arrivals.pop(step)
                eng.add_request(f"l{k}", longs[k], sp_long)
            for o in eng.step():
                done[o.request_id] = o
            step += 1
        wall = time.perf_counter() - t
        itl = [x for rid, o in done.items() if rid.startswith("s") for x in o.metrics["itl_s"]]
        ttft_long = [o.metrics["ttft_s"] for rid, o in done.items() if rid.startswith("l")]
        toks = sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in done.values())
        out[name] = {
            "wall_s": wall,
            "total_tok_s": toks / wall,
            "decode_itl_p50_s": pct(itl, 50),
            "decode_itl_p99_s": pct(itl, 99),
            "decode_itl_max_s": max(itl),
            "long_prompt_ttft_p50_s": pct(ttft_long, 50),
        }
    return out


def run_preemption(model_args: dict, n: int, max_tokens: int, blocks: int) -> dict:
    msgs = [[{"role": "user", "content": q}] for q in user_questions(n)]
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = {}
    for mode in ("recompute", "swap"):
        llm = LLM(
            **(model_args | {"max_model_len": blocks * 16}),
            num_gpu_blocks_override=blocks,
            preemption_mode=mode,
            swap_space=1.0,
        )
        t = time.perf_counter()
        outs = llm.generate(msgs, sp)
        wall = time.perf_counter() - t
        steps = llm.llm_engine.recorder.steps
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        out[f"preemption by {mode}"] = {
            "wall_s": wall,
            "output_tok_s": toks / wall,
            "e2e_mean_s": statistics.mean(o.metrics["e2e_s"] for o in outs),
            "preemptions": sum(s.num_preemptions for s in steps),
            "recomputed_prefill_tokens": sum(s.num_prefill_tokens for s in steps)
            - sum(len(o.prompt_token_ids) for o in outs),
            "swapped_blocks": sum(s.swap_out_blocks + s.swap_in_blocks for s in steps),
        }
    return out


def median_of(runs: list[dict]) -> dict:
    keys = runs[0].keys()
    return {k: {m: statistics.median(r[k][m] for r in runs) for m in runs[0][k]} for k in keys}


def table(title: str, res: dict) -> str:
    metrics = list(next(iter(res.values())).keys())
    lines = [f"### {title}", "", "| config | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for name, vals in res.items():
        lines.append(f"| {name} | " + " | ".join(f"{vals[m]:.4g}" for m in metrics) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", choices=["prefix", "chunked", "preemption"], default=None)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench" / "scheduler_features.json"))
    args = ap.parse_args(argv)
    model_args = dict(dtype="float32", max_num_seqs=16, max_model_len=2048)
    print(
        f"# {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results = {}
    if args.only in (None, "prefix"):
        results["prefix"] = median_of(
            [run_prefix(model_args | {"max_num_seqs": 4}, 16, 16) for _ in range(args.repeats)]
        )
        print(
            table(
                "Prefix caching: 16 requests sharing a long system prompt, max_num_seqs 4, 16 new tokens",
                results["prefix"],
            ),
            flush=True,
        )
    if args.only in (None, "chunked"):
        results["chunked"] = median_of([run_chunked(model_args, 8, 4, 256, 96) for _ in range(args.repeats)])
        print(
            table("Chunked prefill: 8 decoding requests (96 tokens) while 4 long prompts arrive", results["chunked"]),
            flush=True,
        )
    if args.only in (None, "preemption"):
        results["preemption"] = median_of([run_preemption(model_args, 16, 96, 24) for _ in range(args.repeats)])
        print(
            table(
                "Preemption under memory pressure: 16 requests x 96 tokens, 24 blocks (384 tokens)",
                results["preemption"],
            ),
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": "python benchmarks/scheduler_features.py", **results}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
