"""Router policies side by side: real replicas behind vLLM's router, and data x tensor parallel layouts simulated.

Real runs: ``--replicas`` replicas of ``workbench serve`` (the bundled model, one thread each, the small pool of
chapter 11: :data:`workbench.labs.ch11_load_balancing.REPLICA_DEFAULTS`) behind ``vllm-router``; each of the three
workloads of chapter 11 (multi-tenant, skewed, multi-turn; ``--requests`` each, new texts per run so no run finds
another's prompts cached) goes through each policy at ``--rate`` requests/s (Poisson, seeded) with ``bench serve``,
every replica's ``/metrics`` read every half second. Per run: requests/s, TTFT p50 / p99 (ms), prefix-cache hit rate,
prefill tokens computed, preemptions, the KV imbalance's time-mean and the requests per replica. Latencies depend on
this machine and its load; hit rates, prefill tokens and splits depend on the policy, the workload and, under
concurrency, on timing.

Simulated: :func:`workbench.labs.ch11_load_balancing.gpu_layouts` (70B as 1 x TP8 and 2 x TP4, 8B as 4 x TP2 and
8 x TP1 on H100-80GB; simulated seconds, the same on every machine).

    python benchmarks/routing_policies.py
    python benchmarks/routing_policies.py --replicas 3 --rate 4 --json out.json
    python benchmarks/routing_policies.py --no-real        # the simulator's table only
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROW_KEYS = ("policy", "workload", "throughput", "ttft_p50", "ttft_p99", "hit_rate", "prefill_computed",
            "preemptions", "imbalance_mean", "split")  # fmt: skip


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, list):
        return " / ".join(map(str, v))
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 10 else f"{v:,.0f}"
    return str(v)


@click.command()
@click.option("--replicas", default=2, show_default=True, type=int, help="replicas behind the router")
@click.option("--rate", default=3.0, show_default=True, type=float, help="requests per second")
@click.option("--requests", "num_requests", default=24, show_default=True, type=int, help="requests per run")
@click.option("--real/--no-real", default=True, show_default=True, help="the real runs (needs vllm-router)")
@click.option("--sim/--no-sim", default=True, show_default=True, help="the simulator's layouts")
@click.option("--json", "json_path", default=None, help="write every row here")
def main(replicas: int, rate: float, num_requests: int, real: bool, sim: bool, json_path: str | None) -> None:
    import workbench
    from workbench.labs import ch11_load_balancing as lb

    print(f"workbench imported from {workbench.__file__}")
    out: dict = {"real": [], "sim": []}
    if real:
        rs = lb.start_replicas(replicas)
        try:
            runs = lb.PolicyRuns(rs, request_rate=rate, num_requests=num_requests, widget=False)
            for workload in lb.WORKLOADS:
                for policy in lb.POLICIES:
                    row = runs.run(policy, workload)
                    print(" | ".join(_fmt(row[k]) for k in ROW_KEYS), flush=True)
            out["real"] = [{k: r[k] for k in (*ROW_KEYS, "goodput", "peak_kv")} for r in runs.rows]
            print("\n| " + " | ".join(ROW_KEYS) + " |\n|" + "---|" * len(ROW_KEYS))
            for r in runs.rows:
                print("| " + " | ".join(_fmt(r[k]) for k in ROW_KEYS) + " |")
        finally:
            lb.stop_all()
    if sim:
        rows = lb.gpu_layouts(progress=lambda label: print("replaying", label, flush=True))
        out["sim"] = rows
        keys = ("layout", "weights_gib", "kv_gib", "throughput", "ttft_p50", "ttft_p99", "prefill_computed",
                "hit_rate", "imbalance_mean", "split")  # fmt: skip
        print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for r in rows:
            print("| " + " | ".join(_fmt(r[k]) for k in keys) + " |")
    if json_path:
        Path(json_path).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
