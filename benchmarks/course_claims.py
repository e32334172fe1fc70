"""The course outline's figures, each put to a measurement where its chapter measures it (every figure here is
deterministic: the simulator's replays and the buffer model; the same on any machine).

* Chapter 2 (:func:`workbench.labs.ch02_fragmentation_live.gpu_scale_rows`): fragmentation 15-40%, throughput 20-50%
  lower and TTFT jitter 2-5x for serving without paging, and the target (fragmentation below 5%, throughput +30%) as a
  before/after check; Llama-2-7B on one A100-80GB, ShareGPT-like, 16 req/s for 120 simulated seconds.
* Chapter 10 (:func:`workbench.labs.ch10_nccl_buffers.comm_share_rows`): "about 15% of memory for communication
  buffers" on 2- to 8-GPU layouts.
* Chapter 16 (:func:`workbench.labs.ch16_case_study.baseline_rows`, :func:`~workbench.labs.ch16_case_study.gmu_rows`):
  which assumption reproduces the case's healthy baseline (12 req/s at 180 ms), and ``gpu_memory_utilization``
  0.6-0.7 against 0.9 on it.

Chapter 8's claim (chunked prefill and fragmentation) has its own script, ``chunked_memory.py``.

    python benchmarks/course_claims.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@click.command(help=__doc__.split("\n\n")[0])
def main() -> None:
    import workbench
    from workbench.labs import ch02_fragmentation_live as ch02
    from workbench.labs import ch10_nccl_buffers as ch10
    from workbench.labs import ch16_case_study as ch16

    print(f"# workbench from {workbench.__file__}")
    t0 = time.perf_counter()
    print("\n## chapter 2: serving without paging, at GPU scale")
    rows = ch02.gpu_scale_rows(progress=print)
    print(ch02.gpu_scale_table(rows))
    print(ch02.claims_verdict(rows))
    by = {r["allocator"]: r for r in rows}
    for before in ("orca-max", "orca-oracle"):
        print(f"\ntarget, {before} -> paged:")
        print(ch02.target_verdict(by[before], by["paged"]))
    print("\n## chapter 10: communication buffers per rank")
    share = ch10.comm_share_rows()
    print(ch10.comm_share_table(share))
    print(ch10.comm_share_verdict(share))
    print("\n## chapter 16: the healthy baseline, and gpu_memory_utilization on it")
    print(ch16.baseline_table(ch16.baseline_rows(progress=print)))
    print(ch16.gmu_table(ch16.gmu_rows(output_scale=0.7)))
    print(f"\n{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
