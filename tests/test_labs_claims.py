"""Chapter 2's verdicts on the course outline's figures: the simulator's rows at GPU scale (deterministic), the
claims judged against them, and the target as a before/after check that takes any two runs' summaries."""

from __future__ import annotations

import pytest

from workbench.labs import ch02_fragmentation_live as ch


def test_gpu_scale_rows_order_the_allocators_and_the_claims_are_judged():
    rows = ch.gpu_scale_rows(("paged", "orca-max"), rate=16.0, duration_s=30.0)
    paged, worst = rows
    assert paged["fragmentation_rate_mean_frac"] < 0.05 < worst["fragmentation_rate_mean_frac"]
    assert worst["request_throughput_req_s"] <= paged["request_throughput_req_s"]
    assert rows == ch.gpu_scale_rows(("paged", "orca-max"), rate=16.0, duration_s=30.0)  # a deterministic replay
    lines = ch.claims_verdict(rows).splitlines()
    assert lines[0].startswith("paged: fragmentation rate") and len(lines) == 4
    assert all("the claimed range" in line for line in lines[1:])
    assert "TTFT p99 vs paged" in ch.gpu_scale_table(rows).to_html()


def _summary(req_s, ttft, frag):
    return {"request_throughput_req_s": req_s, "ttft_p50_s": ttft, "fragmentation_rate_mean_frac": frag}


def test_target_verdict_checks_both_parts_and_reads_a_runs_summary():
    assert ch.target_verdict(_summary(5.0, 2.0, 0.4), _summary(7.0, 0.1, 0.02)).splitlines() == [
        "requests/s: +40% (target at least +30%): met",
        "fragmentation rate after: 2.0% (target below 5%): met",
        "TTFT p50: 2,000 ms before, 100 ms after",
    ]
    low = ch.target_verdict(_summary(5.0, 2.0, 0.4), _summary(5.5, 0.1, 0.08)).splitlines()
    assert low[0].endswith("not met") and low[1].endswith("not met")
    run = {"requests_finished": 64, "wall_time_s": 8.0, "ttft_p50_s": 0.5, "fragmentation_rate_mean_frac": 0.03}
    assert ch.target_verdict(run, run | {"wall_time_s": 4.0}).startswith("requests/s: +100%")  # workbench run's keys
    with pytest.raises(KeyError, match="after has no 'fragmentation_rate_mean_frac'"):
        ch.target_verdict(run, {"request_throughput_req_s": 1.0, "ttft_p50_s": 0.1})
