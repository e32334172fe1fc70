"""Prefix-cache eviction policies on the multi-tenant prefix-repetition trace, with and without a scan.

The engine, scheduler and KV manager are the real ones; the model is the simulator's cost model
(:mod:`workbench.sim`, Llama-2-7B on one A100-80GB by default), so hundreds of requests replay in seconds and TTFT
is simulated time (indicative: it follows the cost model, not this CPU). The KV pool is set small
(``--num-blocks``) so that cached blocks must be evicted. Prompts are token ids from
:func:`workbench.bench.samples.prefix_repetition_records`: ``--tenants`` system prompts of ``--prefix-len``
tokens, Zipf popularity ``--zipf``, each request with its own suffix; the ``scan`` rows make every
``--scan-every``-th request a one-off prompt of ``--scan-len`` tokens. Requests arrive at a constant
``--rate`` (simulated requests/s).

Per policy and trace: prefix-cache hit rate (prompt tokens served from the cache / looked up), prefill tokens
saved (= hit tokens), evictions (blocks) and the mean / median age of evicted blocks (engine steps from free to
eviction), TTFT mean and p90 (simulated ms), and the replay's wall time here.

    python benchmarks/prefix_eviction.py
    python benchmarks/prefix_eviction.py --zipf 0.8 --num-blocks 384 --json out.json
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the plug-in example lives in tests/fixtures

POLICIES = ("lru", "fifo", "lfu", "tests.fixtures.scan_resistant:ProtectedLRUPolicy")


def replay(policy: str, records, *, num_blocks: int, rate: float, output_len: int, model: str, gpu: str) -> dict:
    """Run ``records`` (token-id prompts) through a simulated engine with ``prefix_cache_eviction=policy``
    (:func:`workbench.labs.ch13_eviction_policies.sim_replay`, which chapter 13 runs too); return the run's figures (see the
    module docstring)."""
    from workbench.labs.ch13_eviction_policies import sim_replay
    from workbench.metrics.stats import prefix_cache_summary

    steps, requests, wall = sim_replay(
        policy, records, num_blocks=num_blocks, rate=rate, output_len=output_len, model=model, gpu=gpu
    )
    summary = prefix_cache_summary(steps)
    ttft = sorted(r["ttft_s"] for r in requests if r["ttft_s"] is not None)
    return {
        "policy": policy.rsplit(":", 1)[-1],
        "hit_rate": summary["prefix_cache_hit_rate_frac"],
        "saved_tokens": summary["prefix_cache_hits_total"],
        "queried_tokens": summary["prefix_cache_queries_total"],
        "evictions": summary["prefix_cache_evictions_total"],
        "age_mean": summary["evicted_block_age_mean_steps"],
        "age_p50": summary["evicted_block_age_p50_steps"],
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "ttft_p90_ms": 1e3 * ttft[int(0.9 * (len(ttft) - 1))],
        "requests": len(requests),
        "steps": len(steps),
        "wall_s": wall,
    }


@click.command()
@click.option("--num-prompts", default=600, show_default=True, help="requests per trace")
@click.option("--tenants", default=12, show_default=True, help="distinct system prompts")
@click.option("--prefix-len", default=320, show_default=True, help="tokens of each system prompt")
@click.option("--suffix-len", default=48, show_default=True, help="tokens of each request's own suffix")
@click.option("--output-len", default=16, show_default=True, help="output tokens per request")
@click.option("--zipf", default=1.1, show_default=True, help="Zipf exponent of tenant popularity")
@click.option("--scan-every", default=3, show_default=True, help="scan trace: every N-th request is a scan prompt")
@click.option("--scan-len", default=1536, show_default=True, help="tokens of a scan prompt")
@click.option("--num-blocks", default=256, show_default=True, help="KV pool (blocks of 16 tokens)")
@click.option("--rate", default=8.0, show_default=True, help="arrivals per simulated second")
@click.option("--model", default="llama-2-7b", show_default=True, help="simulated model (workbench.catalog)")
@click.option("--gpu", default="A100-80GB", show_default=True, help="simulated device")
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", default=None, help="also write the rows here")
def main(num_prompts, tenants, prefix_len, suffix_len, output_len, zipf, scan_every, scan_len, num_blocks, rate, model, gpu, seed, json_path):  # fmt: skip
    from workbench.bench.samples import prefix_repetition_records

    common = dict(prefix_len=prefix_len, suffix_len=suffix_len, num_prefixes=tenants, zipf=zipf, seed=seed)
    traces = {
        "tenants": prefix_repetition_records(num_prompts, **common),
        "tenants+scan": prefix_repetition_records(num_prompts, scan_every=scan_every, scan_len=scan_len, **common),
    }
    print(
        f"{num_prompts} requests, {tenants} tenants x {prefix_len}-token system prompt (zipf {zipf}) + {suffix_len}"
        f"-token suffix, {output_len} output tokens; scan: one request in {scan_every} is a one-off prompt of {scan_len} tokens; "
        f"pool {num_blocks} blocks x 16 tokens; {model} on {gpu} (simulated), {rate} req/s"
    )
    head = (
        f"{'trace':13s} {'policy':18s} {'hit rate':>8s} {'saved tok':>10s} {'evictions':>9s} "
        f"{'age mean':>8s} {'age p50':>7s} {'TTFT mean':>9s} {'TTFT p90':>8s} {'wall':>6s}"
    )
    print(head)
    rows = []
    for trace, records in traces.items():
        for policy in POLICIES:
            r = replay(policy, records, num_blocks=num_blocks, rate=rate, output_len=output_len, model=model, gpu=gpu)
            r["trace"] = trace
            rows.append(r)
            age = "-" if r["age_mean"] is None else f"{r['age_mean']:8.1f} {r['age_p50']:7.1f}"
            print(
                f"{trace:13s} {r['policy']:18s} {r['hit_rate']:8.1%} {r['saved_tokens']:10,d} {r['evictions']:9,d} "
                f"{age:>16s} {r['ttft_mean_ms']:7.1f}ms {r['ttft_p90_ms']:6.1f}ms {r['wall_s']:5.1f}s"
            )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
