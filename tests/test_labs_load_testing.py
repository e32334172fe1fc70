"""Chapter 17's library (workbench.labs.ch17_load_testing): the rules the exercises check on synthetic rows, and one
real run — a server started by the chapter's helper, a two-rate live sweep with /metrics polled, stopped by PID."""

from __future__ import annotations

import math
import os

import pytest

from workbench.labs import ch17_load_testing as lt


def test_knee_is_the_lowest_rate_below_the_fraction():
    rows = [{"offered": 3.0, "achieved": 1.5}, {"offered": 1.0, "achieved": 0.95}, {"offered": 2.0, "achieved": 1.5}]
    assert lt.knee(rows, 0.8) == 2.0  # 1.5 < 1.6; 3.0 is past it too but not the lowest
    assert lt.knee(rows, 0.7) == 3.0
    assert lt.knee(rows[1:2], 0.8) is None


def test_completion_rate_ignores_the_tail_of_a_server_that_keeps_up():
    # 10 requests sent 0.5 s apart (2 req/s), each taking 3 s: completed / duration = 10 / 7.5 = 1.33 req/s
    # would put the knee at 2 req/s although nothing queued; the completions come 0.5 s apart, as sent
    starts = [0.5 * i for i in range(10)]
    assert lt.completion_rate(starts, [3.0] * 10) == pytest.approx(2.0)
    # a server that falls behind completes one request per second however fast they were sent
    assert lt.completion_rate([0.0] * 10, [1.0 + i for i in range(10)]) == pytest.approx(1.0)
    assert lt.completion_rate([0.0, 1.0], [None, 2.0]) is None  # one completion: no rate
    res = {"start_times": starts, "latencies": [3.0] * 10, "request_throughput": 10 / 7.5, "output_throughput": 1,
           "median_ttft_ms": 1, "p99_ttft_ms": 1, "median_tpot_ms": 1, "max_concurrent_requests": 7, "completed": 10,
           "duration": 7.5, "ttfts": [0.1] * 10, "itls": [[0.1]] * 10}  # fmt: skip
    row = lt.summarize(res, 2.0)
    assert row["achieved"] == pytest.approx(2.0) and row["throughput"] == pytest.approx(10 / 7.5)
    assert lt.knee([row], 0.8) is None


def test_goodput_fraction_needs_both_targets():
    ttfts = [0.1, 0.6, 0.1, None, 0.2]
    tpots = [0.05, 0.05, 0.5, None, None]
    # good: #0 (both met) and #4 (one token: no TPOT); #1 misses TTFT, #2 misses TPOT, #3 failed
    assert lt.goodput_fraction(ttfts, tpots, 0.5, 0.1) == pytest.approx(2 / 5)
    assert lt.goodput_fraction([], [], 0.5, 0.1) == 0.0


def test_request_tpots_and_slo_from():
    assert lt.request_tpots([[0.1, 0.3], []]) == [pytest.approx(0.2), None]
    slo = lt.slo_from({"ttft_p50": 101.0, "tpot_p50": 40.0}, ttft_factor=3.0, tpot_factor=1.5)
    assert slo == {"ttft_s": pytest.approx(0.31), "tpot_s": pytest.approx(0.06)}


def test_apply_slo_adds_goodput_per_second():
    rows = [{"ttfts": [0.1, 0.9], "tpots": [0.01, 0.01], "duration": 4.0}]
    lt.apply_slo(rows, {"ttft_s": 0.5, "tpot_s": 0.1})
    assert rows[0]["good_frac"] == 0.5 and rows[0]["goodput"] == pytest.approx(0.25)
    html = lt.sweep_table([{**rows[0], "offered": 1.0, "achieved": 0.5, "ttft_p50": 1.0, "ttft_p99": 2.0,
                            "tpot_p50": 3.0, "max_inflight": 2, "max_waiting": 0.0}])._repr_html_()  # fmt: skip
    assert "goodput (req/s)" in html and "<table" in html


@pytest.mark.timeout(300)
@pytest.mark.slow
@pytest.mark.server
def test_real_server_sweep_and_stop():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    srv = lt.start_server(max_num_seqs=2)
    try:
        assert srv.base_url.startswith("http://127.0.0.1:")
        waiting, running = lt.queue_depth(srv.base_url)
        assert (waiting, running) == (0.0, 0.0)
        live = lt.LiveSweep(srv.base_url, poll_s=0.2)
        for rate in (1.0, math.inf):
            row = live.run_rate(rate, num_prompts=4, random_input_len=16, random_output_len=4)
            assert row["completed"] == 4 and len(row["ttfts"]) == 4 and row["achieved"] > 0
        assert len(live.figure.data[1].x) == 2  # one point per rate
        assert live.samples and all(s["waiting"] >= 0 for s in live.samples)
        # the flood with max_num_seqs=2: more than two requests in flight at once, so some waited
        assert live.rows[1]["max_inflight"] > 2
        assert len(live.static().data) == 6
    finally:
        codes = lt.stop_all()
    assert srv.proc.poll() is not None and codes
    assert lt.stop_all() == []
