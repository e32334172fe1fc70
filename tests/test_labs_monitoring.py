"""Chapter 18's library (``workbench.labs.ch18_monitoring_and_alerting``): the shipped rules parsed into the table, the demo copy with
short windows (and promtool accepting it), and the whole stack on loopback — an overload makes the demo
``WaitingQueueGrowing`` fire, Prometheus pushes it to the receiver, the receiver halves ``max_num_seqs``, and the
dashboard's queries return data; every process stopped by PID afterwards, also on failure."""

from __future__ import annotations

import os
import shutil

import pytest

from workbench.labs import ch18_monitoring_and_alerting as mon

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None and os.environ.get("WORKBENCH_REQUIRE_PROMETHEUS") != "1",
    reason="no promtool (apt-get install prometheus)",
)
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None and os.environ.get("WORKBENCH_REQUIRE_PROMETHEUS") != "1",
    reason="no prometheus (apt-get install prometheus)",
)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped) counts as stopped
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_rules_table_has_every_shipped_alert_with_its_metric_and_reason():
    t = mon.rules_table()
    names = t.column("alert")
    # the vLLM file first, then workbench's
    assert names == ["KVCacheUsageHigh", "Preempting", "TTFTp99AboveSLO", "WaitingQueueGrowing", "KVFragmentationHigh"]
    assert t.column("works_on") == ["any vLLM"] * 4 + ["workbench only"]
    for row in t:
        assert row["reads"] and row["why"] and row["for"].endswith("m"), row
    by = {r["alert"]: r for r in t}
    assert by["KVFragmentationHigh"]["reads"] == "workbench:fragmentation_rate, vllm:kv_cache_usage_perc"
    assert by["TTFTp99AboveSLO"]["reads"] == "vllm:time_to_first_token_seconds"  # _bucket dropped
    assert "<table" in t._repr_html_()


def test_metrics_read_and_seconds():
    assert mon.metrics_read("rate(vllm:num_preemptions_total[5m]) > 0 and vllm:x > 1") == [
        "vllm:num_preemptions_total",
        "vllm:x",
    ]
    assert mon._seconds("5m") == 300 and mon._seconds("1h30m") == 5400 and mon._seconds("250ms") == 0.25


def test_demo_rules_shorten_windows_and_keep_thresholds(tmp_path):
    out = mon.demo_rules(tmp_path / "demo.yml", scale=1 / 150, min_window_s=3)
    shipped = {r["alert"]: r for r in mon.load_rules()}
    demo = {r["alert"]: r for r in mon.load_rules(out)}
    assert demo.keys() == shipped.keys()
    assert demo["WaitingQueueGrowing"]["for"] == "4s"  # 10 m / 150
    assert demo["Preempting"]["for"] == "3s"  # 5 m / 150 = 2 s, raised to the 3 s floor
    assert "[4s]" in demo["WaitingQueueGrowing"]["expr"] and "[10m]" not in demo["WaitingQueueGrowing"]["expr"]
    for name, r in shipped.items():  # thresholds and labels unchanged
        assert r["labels"] == demo[name]["labels"]
        for threshold in ("> 0.95", "> 0.3", "> 0.5", "> 0"):
            assert (threshold in " ".join(r["expr"].split())) == (threshold in " ".join(demo[name]["expr"].split()))
    assert [r["alert"] for r in mon.demo_rules_table(out)] == list(shipped)


def test_load_rules_refuses_a_file_without_groups(tmp_path):
    p = tmp_path / "x.yml"
    p.write_text("foo: 1\n")
    with pytest.raises(ValueError, match="no 'groups'"):
        mon.load_rules(p)


@needs_promtool
def test_promtool_accepts_shipped_and_demo_rules(tmp_path):
    rc, out = mon.promtool(
        "check", "rules", "deploy/prometheus/vllm_alerts.yml", "deploy/prometheus/workbench_alerts.yml"
    )
    assert rc == 0 and "SUCCESS: 4 rules found" in out and "SUCCESS: 1 rules found" in out, out
    rc, out = mon.promtool("test", "rules", *(str(p.relative_to(mon.DEPLOY.parent)) for p in mon.RULE_TESTS))
    assert rc == 0 and out.count("SUCCESS") == 2, out
    rc, out = mon.promtool("check", "rules", str(mon.demo_rules(tmp_path / "demo.yml", scale=1 / 150, min_window_s=3)))
    assert rc == 0 and "SUCCESS: 5 rules found" in out, out


@pytest.mark.slow
@needs_prometheus
@pytest.mark.server
def test_an_overload_fires_the_demo_alert_and_the_receiver_sheds_load(tmp_path):
    demo = mon.demo_rules(tmp_path / "demo.yml", scale=1 / 150, min_window_s=3)
    stack = mon.MonitoringStack([demo], max_model_len=256, max_num_seqs=4, num_gpu_blocks_override=24)
    try:
        stack.start()
        pids = stack.pids()
        assert all(_alive(p) for p in pids.values()), pids
        capacity = mon.measure_capacity(stack)
        assert capacity > 0
        live = mon.LivePlot(stack)
        load = mon.Overload.above(stack, capacity).start()  # 3x the capacity measured now, 10 s of arrivals
        assert load.request_rate == pytest.approx(3 * capacity) and load.num_prompts >= 8
        live.follow(load, interval=1.0, after_s=2.0, limit_s=240)
        result = load.join(60)
        assert result["completed"] >= 1 and result["completed"] + result["failed"] == load.num_prompts
        outcome = mon.alert_outcome(stack, load, timeout_s=30)
        assert outcome.splitlines() == [
            "the receiver acted 1 time(s); first: WaitingQueueGrowing -> shed_load",
            "max_num_seqs: configured 4, now 4",
            "max_num_queued_reqs: configured None, now 4",
            "every request answered (completed, or refused with 503 once shedding): True",
        ], outcome
        taken = stack.receiver.actions_taken()
        assert [(a["alertname"], a["action"]) for a in taken] == [("WaitingQueueGrowing", "shed_load")]
        assert taken[0]["result"] == {"max_num_queued_reqs": 4, "previous": None}
        assert stack.admin_state()["max_num_queued_reqs"] == 4
        assert max(mon.waiting_samples(live)) > 4  # the queue really grew
        assert live.actions and len(live.figure.layout.shapes) == 1  # the action marked on the live figure
        assert any(s["KV cache usage (0..1)"] for s in live.samples)
        rows = mon.dashboard_rows(stack)
        assert rows and not [r for r in rows if r["error"]], rows
        buckets = mon.ttft_buckets(stack)
        # the capacity probe's requests and the overload's
        assert buckets[-1][0] == float("inf") and buckets[-1][1] == 8 + result["completed"]
        fig = mon.range_figure(stack, live.t0, live.t0 + live.samples[-1]["t"])
        assert {tr.name for tr in fig.data} >= {"waiting", "running", "TTFT p99", "WaitingQueueGrowing"}
        assert [r["alert"] for r in mon.actions_table(live) if r["action"] == "shed_load"] == ["WaitingQueueGrowing"]
    finally:
        stack.stop()
    assert not any(_alive(p) for p in pids.values()), pids


@needs_prometheus  # the check asks for the binary first
def test_the_stack_refuses_what_it_can_before_starting_anything(tmp_path):
    demo = mon.demo_rules(tmp_path / "demo.yml", scale=1 / 100)
    stack = mon.MonitoringStack([demo], actions={"KVFragmentationHihg": "compact"})  # a typo: would never act
    with pytest.raises(ValueError, match=r"actions for \['KVFragmentationHihg'\], which no rule file defines"):
        stack.start()
    assert stack.server is None  # nothing was started
    with pytest.raises(FileNotFoundError, match="does not exist"):
        mon.MonitoringStack([tmp_path / "nope.yml"]).start()
    for bad in (0, -1, 2, "1/100"):
        with pytest.raises(ValueError, match="scale="):
            mon.demo_rules(tmp_path / "x.yml", scale=bad)
    assert all(r["annotations"]["description"].startswith("[demo copy") for r in mon.load_rules(demo))


def _row(action, completed, refused, goodput, p99):
    return {"action": action, "sent": 30, "completed": completed, "refused": refused, "request_throughput": 2.0,
            "median_ttft_ms": p99 / 2, "p99_ttft_ms": p99, "request_goodput": goodput, "slo_ttft_ms": 480.0,
            "duration": 15.0}  # fmt: skip


def test_the_actions_comparison_states_its_verdicts_and_refuses_unknown_actions():
    rows = [_row("none", 30, 0, 0.4, 9000.0), _row("lower_admission", 30, 0, 0.2, 14000.0),
            _row("shed_load", 12, 18, 1.1, 800.0)]  # fmt: skip
    assert mon.action_verdict(rows).splitlines() == [
        "shed_load raises goodput over no action: True",
        "shed_load lowers the TTFT p99 of the requests it serves: True",
        "lower_admission raises goodput over no action: False",
    ]
    table = mon.actions_effect_table(rows)
    assert [r["action"] for r in table] == ["none", "lower_admission", "shed_load"]
    assert "9,000" in table.to_html() and "refused (503)" in table.to_html() and "TTFT ≤ 480 ms" in table.to_html()
    with pytest.raises(ValueError, match="action='reboot' must be one of none, lower_admission, shed_load"):
        mon.compare_actions(None, 1.0, actions=["none", "reboot"])
    with pytest.raises(ValueError, match="action='x'"):
        mon.set_action(None, "x")
