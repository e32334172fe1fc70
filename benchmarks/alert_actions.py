"""Which action answers an overload: chapter 18's overload with no action, with ``max_num_seqs`` halved, and with
load shedding (vLLM's ``--max-num-queued-reqs``), on one real ``workbench serve``.

The stack is chapter 18's (:class:`workbench.labs.ch18_monitoring_and_alerting.MonitoringStack`: the bundled model,
``max_num_seqs=4``, a pool of 24 blocks, one thread, a real Prometheus and the alert receiver). The server's capacity
is measured first (:func:`~workbench.labs.ch18_monitoring_and_alerting.measure_capacity`), then the same seeded
overload (``--factor`` times that capacity for ``--arrivals`` seconds) runs once per action, the action in force
from the start (:func:`~workbench.labs.ch18_monitoring_and_alerting.compare_actions`). Per run: requests sent,
completed and refused with 503, completed requests/s, TTFT p50 / p99 of the completed ones, and goodput (completed
requests/s whose TTFT met ``--slo-ttft-ms``, by default four times a lone request's TTFT measured first). Latencies depend on this machine and its load; the comparison between
rows of one run is what the receiver's defaults follow.

    python benchmarks/alert_actions.py
    python benchmarks/alert_actions.py --factor 1.5 --arrivals 10 --json out.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--factor", default=3.0, show_default=True, help="the overload's rate over the measured capacity")
@click.option("--arrivals", default=10.0, show_default=True, help="seconds of arrivals")
@click.option("--slo-ttft-ms", type=float, help="the TTFT SLO of goodput [default: 4 x a lone request's TTFT now]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="also write the rows here")
def main(factor: float, arrivals: float, slo_ttft_ms: float | None, json_path: str | None) -> None:
    import workbench
    from workbench.labs import ch18_monitoring_and_alerting as mon

    print(f"# workbench from {workbench.__file__}")
    rules = mon.tmp_rules_dir()
    demo = mon.demo_rules(Path(rules.name) / "demo.yml", scale=1 / 150, min_window_s=3)
    t0 = time.perf_counter()
    with mon.MonitoringStack([demo], max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=24) as stack:
        capacity = mon.measure_capacity(stack)
        print(f"capacity {capacity:.2f} requests/s")
        rows = mon.compare_actions(stack, capacity, factor=factor, arrivals_s=arrivals, slo_ttft_ms=slo_ttft_ms)
    rules.cleanup()
    print()
    print(mon.actions_effect_table(rows))
    print()
    print(mon.action_verdict(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")
    if json_path:
        Path(json_path).write_text(json.dumps({"capacity": capacity, "factor": factor, "arrivals_s": arrivals,
                                               "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
