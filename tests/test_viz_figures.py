"""Tests for workbench.viz.figures, workbench.viz.live and workbench.metrics.waste.

Figures are built from synthetic step records / snapshots whose numbers the tests control;
the LiveMonitor runs headless (FigureWidget without a front end) with an injected clock.
"""

from __future__ import annotations

import sys

import numpy as np
import plotly.graph_objects as go
import pytest

from workbench.metrics import CallbackSink, Recorder, StepStats, flatten_breakdown, waste_breakdown
from workbench.metrics.waste import USED_CATEGORIES, WASTE_CATEGORIES
from workbench.viz.figures import (
    CATEGORY_COLOURS,
    OWNER_PALETTE,
    PAD_CODE,
    block_map_cells,
    block_map_figure,
    latency_cdf_figure,
    memory_timeline_figure,
    waste_bars_figure,
)
from workbench.viz.report import MEMORY_CATEGORIES, summary_table, write_report

NUM_BLOCKS = 8
BLOCK_SIZE = 4
POOL = NUM_BLOCKS * BLOCK_SIZE  # 32 slots
BPT = 3 * 2**18  # bytes per token: one slot = 0.75 MiB


def make_step(i: int, ts: int, res: int, internal: int, ext: int, **kw) -> dict:
    """A consistent step record: the pool is split as given, free is the rest."""
    free = POOL - ts - res - internal - ext
    assert free >= 0
    used = POOL - free
    rec = dict(
        step=i,
        time_s=0.1 * i,
        wall_time_s=0.1,
        schedule_time_s=0.001,
        model_time_s=0.09,
        sample_time_s=0.001,
        num_prefill_tokens=0,
        num_decode_tokens=1,
        num_prefill_reqs=0,
        num_decode_reqs=1,
        num_running=kw.pop("running", 2),
        num_waiting=kw.pop("waiting", 1),
        num_preemptions=0,
        num_finished=0,
        num_blocks=NUM_BLOCKS,
        blocks_used=(ts + res + internal + BLOCK_SIZE - 1) // BLOCK_SIZE,
        blocks_free=NUM_BLOCKS - (ts + res + internal + BLOCK_SIZE - 1) // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        kv_bytes_per_token=BPT,
        token_states=ts,
        reservation=res,
        internal_fragmentation=internal,
        external_fragmentation=ext,
        free=free,
        kv_utilization=ts / POOL,
        fragmentation_rate=(res + internal + ext) / used if used else 0.0,
    )
    rec.update(kw)
    return rec


# (token states, reservation, internal, external) per step
SPLITS = [(0, 0, 0, 0), (8, 12, 2, 4), (16, 8, 2, 0), (24, 0, 4, 4)]


@pytest.fixture
def steps() -> list[dict]:
    return [make_step(i, *sp, running=i, waiting=3 - i) for i, sp in enumerate(SPLITS)]


# --------------------------------------------------------------------------- #
# waste_breakdown
# --------------------------------------------------------------------------- #


def test_waste_breakdown_hand_computed(steps):
    b = waste_breakdown(steps)
    assert b["num_steps"] == 4
    assert b["pool_slots_mean"] == POOL
    assert b["pool_bytes_mean"] == POOL * BPT
    # slots: token states (0+8+16+24)/4 = 12, reservation (0+12+8+0)/4 = 5, internal 8/4 = 2,
    # external 8/4 = 2, free (32+6+6+0)/4 = 11
    assert b["slots_mean"] == {
        "token_states": 12.0,
        "reservation": 5.0,
        "internal_fragmentation": 2.0,
        "external_fragmentation": 2.0,
        "free": 11.0,
    }
    assert b["bytes_mean"]["token_states"] == 12.0 * BPT
    assert b["pool_share"]["token_states"] == pytest.approx(12 / 32)
    assert b["pool_share"]["free"] == pytest.approx(11 / 32)
    assert sum(b["pool_share"].values()) == pytest.approx(1.0)
    # occupied slots: 0 + 26 + 26 + 32 = 84 -> used_slots_mean 21
    assert b["used_slots_mean"] == 21.0
    assert b["used_share"] == pytest.approx(
        {
            "token_states": 48 / 84,
            "reservation": 20 / 84,
            "internal_fragmentation": 8 / 84,
            "external_fragmentation": 8 / 84,
        }
    )
    assert sum(b["used_share"].values()) == pytest.approx(1.0)
    assert b["kv_utilization_mean"] == pytest.approx((0 + 8 + 16 + 24) / 32 / 4)
    # fragmentation rate per step: 0, 18/26, 10/26, 8/32 -> mean of the four
    assert b["fragmentation_rate_mean"] == pytest.approx((0 + 18 / 26 + 10 / 26 + 8 / 32) / 4)
    assert b["num_running_mean"] == 1.5
    assert b["num_waiting_mean"] == 1.5
    assert b["blocks_used_peak"] == 7


def test_waste_breakdown_takes_stepstats_objects(steps):
    objs = [StepStats(**s) for s in steps]
    assert waste_breakdown(objs) == waste_breakdown(steps)
    assert waste_breakdown(reversed(objs)) == waste_breakdown(steps)


def test_waste_breakdown_empty_and_flat():
    b = waste_breakdown([])
    assert b["num_steps"] == 0
    assert set(b["pool_share"]) == set(WASTE_CATEGORIES) and not any(b["pool_share"].values())
    assert set(b["used_share"]) == set(USED_CATEGORIES) and not any(b["used_share"].values())
    flat = flatten_breakdown(b)
    assert flat["num_steps"] == 0
    assert "token_states_pool_frac" in flat and "external_fragmentation_used_frac" in flat
    assert "free_used_frac" not in flat
    assert all(not isinstance(v, dict) for v in flat.values())


def test_waste_breakdown_rejects_inconsistent_step(steps):
    steps[2]["free"] += 1
    with pytest.raises(ValueError, match="step 2.*sum to 33"):
        waste_breakdown(steps)


def test_waste_breakdown_matches_summary_table_means(steps):
    b = waste_breakdown(steps)
    s = summary_table(steps, [], wall_time_s=1.0)
    assert b["kv_utilization_mean"] == pytest.approx(s["kv_utilization_mean_frac"])
    assert b["fragmentation_rate_mean"] == pytest.approx(s["fragmentation_rate_mean_frac"])
    assert b["num_running_mean"] == pytest.approx(s["running_reqs_mean"])


# --------------------------------------------------------------------------- #
# memory timeline
# --------------------------------------------------------------------------- #


def test_memory_timeline_stacks_to_the_pool(steps):
    fig = memory_timeline_figure(list(reversed(steps)), unit="MiB")
    areas = fig.data[:5]
    assert [t.name for t in areas] == [label for _, label, _ in MEMORY_CATEGORIES]
    assert all(t.stackgroup == "kv" for t in areas)
    assert [t.line.color for t in areas] == [CATEGORY_COLOURS[k] for k, _, _ in MEMORY_CATEGORIES]
    assert list(areas[0].x) == [0, 1, 2, 3]  # sorted by step
    pool_mib = POOL * BPT / 2**20
    for j in range(len(steps)):
        assert sum(t.y[j] for t in areas) == pytest.approx(pool_mib)
    assert areas[0].y[1] == pytest.approx(8 * 0.75)
    util = fig.data[5]
    assert util.name == "KV utilization" and util.yaxis == "y2"
    assert list(util.y) == pytest.approx([0, 0.25, 0.5, 0.75])
    assert fig.data[6].name == "fragmentation rate" and fig.data[6].visible == "legendonly"
    assert tuple(fig.layout.yaxis.range) == pytest.approx((0, pool_mib))


def test_memory_timeline_tokens_over_time(steps):
    fig = memory_timeline_figure(steps, unit="tokens", x="time", show_utilization=False)
    assert len(fig.data) == 5
    assert list(fig.data[0].x) == pytest.approx([0.0, 0.1, 0.2, 0.3])
    for j in range(len(steps)):
        assert sum(t.y[j] for t in fig.data) == POOL
    assert fig.data[1].customdata[1][1] == pytest.approx(12 / 32)  # reservation share of the pool


def test_memory_timeline_bad_args_and_empty(steps):
    with pytest.raises(ValueError, match="unit"):
        memory_timeline_figure(steps, unit="MB")
    with pytest.raises(ValueError, match="x="):
        memory_timeline_figure(steps, x="wall")
    assert len(memory_timeline_figure([]).data) == 0


# --------------------------------------------------------------------------- #
# waste bars
# --------------------------------------------------------------------------- #


def test_waste_bars_shares_sum_to_one(steps):
    paged = [make_step(i, 20 + i, 0, 3, 0) for i in range(4)]
    runs = {"orca-max": steps, "paged": waste_breakdown(paged)}
    fig = waste_bars_figure(runs)
    pool_bars = [t for t in fig.data if t.xaxis == "x"]
    used_bars = [t for t in fig.data if t.xaxis == "x2"]
    assert [t.legendgroup for t in pool_bars] == list(WASTE_CATEGORIES)
    assert [t.legendgroup for t in used_bars] == list(USED_CATEGORIES)
    assert all(list(t.x) == ["orca-max", "paged"] for t in fig.data)
    for j in range(2):
        assert sum(t.y[j] for t in pool_bars) == pytest.approx(1.0)
        assert sum(t.y[j] for t in used_bars) == pytest.approx(1.0)
    # the values are the breakdown's
    assert pool_bars[1].y[0] == pytest.approx(5 / 32)  # orca-max reservation share of the pool
    assert used_bars[0].y[0] == pytest.approx(48 / 84)
    assert used_bars[2].y[1] == pytest.approx(12 / (12 + sum(20 + i for i in range(4))))
    # one legend entry per category
    assert sum(1 for t in fig.data if t.showlegend) == 5
    assert fig.layout.barmode == "stack"


def test_waste_bars_single_basis_and_errors(steps):
    fig = waste_bars_figure({"a": steps}, basis="used")
    assert len(fig.data) == 4
    assert sum(t.y[0] for t in fig.data) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="basis"):
        waste_bars_figure({"a": steps}, basis="slots")
    with pytest.raises(TypeError):
        waste_bars_figure({"a": {"not": "a breakdown"}})
    assert len(waste_bars_figure({}).data) == 0


# --------------------------------------------------------------------------- #
# latency CDFs
# --------------------------------------------------------------------------- #


def req(rid, ttft, tpot=0.01, e2e=1.0, itl=(0.01, 0.02), **kw):
    return dict(
        request_id=rid,
        prompt_tokens=10,
        output_tokens=3,
        finish_reason=kw.get("finish_reason", "length"),
        error=kw.get("error"),
        ttft_s=ttft,
        tpot_s=tpot,
        e2e_s=e2e,
        itl_s=list(itl),
    )


def test_latency_cdf_sorted_and_ends_at_one():
    a = [req("a0", 0.3), req("a1", 0.1), req("a2", None), req("a3", 0.2), req("bad", 0.0, error="too long")]
    b = [req("b0", 0.5, finish_reason="error"), req("b1", 0.05)]
    fig = latency_cdf_figure({"paged": a, "static": b})
    assert len(fig.data) == 2
    t = fig.data[0]
    assert list(t.x) == pytest.approx([100.0, 200.0, 300.0])  # ms, sorted, None and error skipped
    assert list(t.y) == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert t.name.startswith("paged (n=3")
    assert list(fig.data[1].x) == pytest.approx([50.0]) and fig.data[1].y[-1] == 1.0


def test_latency_cdf_dropdown_over_metrics():
    runs = {"x": [req("a", 0.1, itl=(0.03, 0.01)), req("b", 0.2, itl=(0.02,))], "y": []}
    fig = latency_cdf_figure(runs, metric="all")
    assert len(fig.data) == 8  # 4 metrics x 2 runs
    assert [t.visible for t in fig.data] == [True, True] + [False] * 6
    itl = fig.data[4]
    assert list(itl.x) == pytest.approx([10.0, 20.0, 30.0]) and itl.y[-1] == 1.0
    assert fig.data[1].name == "y (no data)" and len(fig.data[1].x) == 0
    buttons = fig.layout.updatemenus[0].buttons
    assert [bt.label for bt in buttons] == ["TTFT", "TPOT", "ITL", "E2E"]
    assert buttons[2].args[0]["visible"] == [False] * 4 + [True, True] + [False] * 2


def test_latency_cdf_single_run_list_and_errors():
    from workbench.metrics import RequestRecord

    recs = [
        RequestRecord(f"r{i}", 5, 4, "length", None, 0.0, 0.0, 0.1, 1.0, 0.1 * (i + 1), 0.02, 1.0, 0.0)
        for i in range(3)
    ]
    fig = latency_cdf_figure(recs, metric="ttft_s", log_x=True)
    assert fig.data[0].name.startswith("run (n=3")
    assert fig.layout.xaxis.type == "log"
    with pytest.raises(ValueError, match="metric"):
        latency_cdf_figure(recs, metric="ttft")
    assert len(latency_cdf_figure({}).data) == 0


# --------------------------------------------------------------------------- #
# block map
# --------------------------------------------------------------------------- #


def snapshot(step: int, n: int = 10, allocator: str = "orca-max") -> dict:
    """Blocks 0-2 owned by r0 (full, full, partly), 3-5 by r1 (partly, empty, empty), 6 external,
    7 cached, the rest free."""
    owner = [0, 0, 0, 1, 1, 1] + [-1] * (n - 6)
    filled = [4, 4, 2, 1, 0, 0] + [0] * (n - 6)
    state = ["used"] * 6 + ["external", "cached"] + ["free"] * (n - 8)
    return {
        "step": step,
        "allocator": allocator,
        "block_size": 4,
        "owner": owner,
        "owner_ids": ["r0", "r1"],
        "filled": filled,
        "state": state,
    }


def test_block_map_cells_codes_and_hover():
    cells = block_map_cells(snapshot(3, n=10), max_cols=4)
    assert cells["z"].shape == (3, 4)
    flat = cells["z"].ravel()
    assert np.isfinite(flat).sum() == 10 and np.isnan(flat[10:]).all()
    # r0 is owner 0: codes 3 (full), 4 (partly); r1 is owner 1: 6 + shade
    assert flat[:10].tolist() == [3, 3, 4, 7, 8, 8, 1, 2, 0, 0]
    assert cells["y"] == [0, 4, 8]
    assert "r1" in cells["text"][0, 3] and "1/4" in cells["text"][0, 3]
    assert "block 6" in cells["text"][1, 2] and "external" in cells["text"][1, 2]
    c = cells["counts"]
    assert (c["used"], c["full"], c["partly_filled"], c["empty"]) == (6, 2, 2, 2)
    assert (c["external"], c["cached"], c["free"], c["filled_slots"]) == (1, 1, 2, 11)


def test_block_map_owner_colours_cycle():
    n_owners = len(OWNER_PALETTE) + 2
    snap = {
        "step": 0,
        "allocator": "paged",
        "block_size": 2,
        "owner": list(range(n_owners)),
        "owner_ids": [f"r{i}" for i in range(n_owners)],
        "filled": [2] * n_owners,
        "state": ["used"] * n_owners,
    }
    z = block_map_cells(snap)["z"][0].tolist()
    assert z[0] == z[len(OWNER_PALETTE)] == 3 and z[1] == z[len(OWNER_PALETTE) + 1] == 6


def test_block_map_figure_slider_and_frames():
    snaps = [snapshot(s, n=10) for s in (20, 0, 10)]
    fig = block_map_figure(snaps, max_cols=4)
    heat = fig.data[0]
    assert isinstance(heat, go.Heatmap)
    assert np.isfinite(heat.z).sum() == 10
    steps = fig.layout.sliders[0].steps
    assert [s.label for s in steps] == ["0", "10", "20"]
    assert len(fig.frames) == 3 and all(len(f.data) == 1 for f in fig.frames)
    assert "step 0" in fig.layout.title.text and "orca-max" in fig.layout.title.text
    assert "step 20" in fig.frames[2].layout.title.text
    assert heat.zmin == -0.5 and heat.showscale is False


def test_block_map_figure_thousands_of_blocks():
    n = 4096
    snaps = []
    for step in range(3):
        used = 1000 * (step + 1)
        snaps.append(
            {
                "step": step,
                "allocator": "paged",
                "block_size": 16,
                "owner": [b // 10 for b in range(used)] + [-1] * (n - used),
                "owner_ids": [f"req-{i}" for i in range(used // 10)],
                "filled": [16 if b % 10 else 7 for b in range(used)] + [0] * (n - used),
                "state": ["used"] * used + ["free"] * (n - used),
            }
        )
    fig = block_map_figure(snaps, active=-1)
    assert len(fig.data) == 7  # one heatmap + six legend entries, no shapes
    assert not fig.layout.shapes
    assert fig.data[0].z.shape == (64, 64) and np.isfinite(fig.data[0].z).all()
    assert fig.layout.sliders[0].active == 2
    assert "3000/4096 blocks used" in fig.layout.title.text


def test_block_map_rejects_malformed():
    bad = snapshot(0)
    bad["state"][0] = "busy"
    with pytest.raises(ValueError, match="busy"):
        block_map_figure([bad])
    bad = snapshot(0)
    bad["filled"].pop()
    with pytest.raises(ValueError, match="one entry per block"):
        block_map_figure([bad])
    bad = snapshot(0)
    bad["owner"][0] = 5
    with pytest.raises(ValueError, match="owner 5"):
        block_map_figure([bad])
    with pytest.raises(IndexError):
        block_map_figure([snapshot(0)], active=3)
    assert len(block_map_figure([]).data) == 0


def test_report_has_new_figures(tmp_path, steps):
    out = write_report(tmp_path / "r.html", steps, [], summary_table(steps, [], 1.0), {}, block_maps=[snapshot(0)])
    doc = out.read_text(encoding="utf-8")
    assert doc.count("Plotly.newPlot(") == 7
    for text in ("KV pool over the run", "Where the KV memory went", "KV block map, step 0"):
        assert text in doc


# --------------------------------------------------------------------------- #
# LiveMonitor (headless)
# --------------------------------------------------------------------------- #


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def stats(i: int, ts: int = 8, res: int = 4) -> StepStats:
    return StepStats(**make_step(i, ts, res, 0, 0, running=i % 3, waiting=2))


def test_live_monitor_updates_figures_and_throttles():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    from workbench.viz.live import LiveMonitor

    rec = Recorder()
    clock = FakeClock()
    mon = LiveMonitor(rec, refresh_s=0.25, clock=clock)
    assert isinstance(mon.sink, CallbackSink) and mon.sink in rec.sinks
    assert isinstance(mon.memory_figure, go.FigureWidget)
    assert len(mon.memory_figure.data[0].x) == 0
    for i in range(100):  # 10 ms per step: 1 s in all
        rec.record_step(stats(i))
        clock.t += 0.01
    assert mon.num_steps == 100
    # once per 0.25 s of the fake clock, counted from the first step: steps 25, 50, 75
    assert mon.num_redraws == 3
    fig = mon.memory_figure
    assert list(fig.data[0].x) == list(range(76))
    mib = BPT / 2**20
    assert fig.data[0].y[-1] == pytest.approx(8 * mib) and fig.data[1].y[-1] == pytest.approx(4 * mib)
    assert sum(fig.data[k].y[10] for k in range(5)) == pytest.approx(POOL * mib)
    assert fig.data[5].y[-1] == pytest.approx(0.25)  # KV utilization
    assert list(fig.data[6].y[:4]) == [0, 1, 2, 0]  # running
    mon.close()  # final flush, detached
    assert mon.num_redraws == 4
    assert list(fig.data[0].x) == list(range(100))
    assert "step 99" in mon._status.value and "running 0" in mon._status.value
    assert mon.sink not in rec.sinks
    mon.close()  # idempotent
    assert mon.num_redraws == 4


def test_live_monitor_reads_settled_values_and_strides():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    from workbench.viz.live import LiveMonitor

    rec = Recorder()
    clock = FakeClock()
    mon = LiveMonitor(rec, refresh_s=1.0, clock=clock, max_points=10, unit="tokens", block_map=False)
    assert mon.block_map_figure is None
    for i in range(35):
        rec.record_step(stats(i))
    first = rec.steps[0]
    first.reservation -= 3  # the engine settles unwritten slots as internal fragmentation later
    first.internal_fragmentation += 3
    mon.flush()
    fig = mon.memory_figure
    assert list(fig.data[0].x) == [0, 4, 8, 12, 16, 20, 24, 28, 32, 34]  # stride 4, last kept
    assert fig.data[1].y[0] == 1 and fig.data[2].y[0] == 3  # tokens, settled
    assert tuple(fig.layout.yaxis.range) == (0, POOL)


def test_live_monitor_block_maps_and_final_step():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    from workbench.viz.live import LiveMonitor

    class FakeEngine:
        def __init__(self) -> None:
            self.recorder = Recorder()
            self.left = 3

        def has_unfinished_requests(self) -> bool:
            return self.left > 0

    eng = FakeEngine()
    clock = FakeClock()
    mon = LiveMonitor(eng, refresh_s=10.0, clock=clock, max_cols=4)
    rec = eng.recorder
    rec.record_block_map(snapshot(0, n=10))
    rec.record_step(stats(0))  # first step: starts the throttle, no redraw
    assert mon.num_redraws == 0
    clock.t = 10.0
    rec.record_step(stats(1))  # refresh_s has passed: redraw, block map drawn
    assert mon.num_redraws == 1
    heat = mon.block_map_figure.data[0]
    assert (heat.z != PAD_CODE).sum() == 10  # padding code, not NaN: the widget sends JSON
    assert "step 0" in mon.block_map_figure.layout.title.text
    rec.block_maps.append(snapshot(1, n=12))  # kept by the recorder without the hook: polled
    eng.left = 1
    rec.record_step(stats(2))  # throttled
    assert mon.num_redraws == 1
    eng.left = 0
    rec.record_step(stats(3))  # the run's last step: drawn at once
    assert mon.num_redraws == 2
    assert (mon.block_map_figure.data[0].z != PAD_CODE).sum() == 12
    assert list(mon.memory_figure.data[0].x) == [0, 1, 2, 3]
    rec.record_request({"error": "too long", "finish_reason": "error"})
    assert mon.num_requests == 1 and mon.num_errors == 1
    assert isinstance(mon._repr_mimebundle_(), dict)
    mon.close()


def test_live_monitor_missing_ipywidgets(monkeypatch):
    from workbench.viz import live

    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    with pytest.raises(ImportError, match=r"pip install 'workbench\[lab\]'"):
        live.LiveMonitor(None)


def test_live_monitor_rejects_bad_args():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    from workbench.viz.live import LiveMonitor

    with pytest.raises(ValueError, match="refresh_s"):
        LiveMonitor(None, refresh_s=-1)
    with pytest.raises(TypeError, match="LLM, an LLMEngine or a Recorder"):
        LiveMonitor(object())


def test_live_monitor_follows_a_real_engine(tiny_model):
    """The tiny random-weight model: the monitor sees every step and the final one is drawn."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    from workbench import LLM, SamplingParams
    from workbench.viz.live import LiveMonitor

    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        max_num_seqs=4,
        max_model_len=128,
        num_gpu_blocks_override=64,  # a small pool: snapshots of 64 blocks
        block_map_every=2,
    )
    with LiveMonitor(llm, refresh_s=3600.0) as mon:
        llm.generate([[1, 5, 9, 3, 4, 7]] * 6, SamplingParams(max_tokens=12, ignore_eos=True))
        rec = llm.llm_engine.recorder
        assert mon.num_steps == len(rec.steps) > 1
        assert mon.num_redraws == 1  # the last step (no unfinished request left)
        assert mon.memory_figure.data[0].x[-1] == rec.steps[-1].step
        assert mon.num_requests == 6
    assert rec.block_maps, "block_map_every=2 should have kept snapshots"
    fig = block_map_figure(rec.block_maps)
    assert len(fig.layout.sliders[0].steps) == len(rec.block_maps)
    b = waste_breakdown(rec.steps)
    assert sum(b["pool_share"].values()) == pytest.approx(1.0)


def test_live_monitor_messages_are_strict_json(monkeypatch):
    """A kernel encodes widget messages with allow_nan=False: no NaN may reach the comm."""
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    import json

    import comm

    from workbench.viz.live import LiveMonitor

    sent = []

    class StrictComm(comm.DummyComm):
        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            sent.append(json.dumps({"data": data, "metadata": metadata}, allow_nan=False, default=str))

    monkeypatch.setattr(comm, "create_comm", lambda *a, **kw: StrictComm(*a, **kw))
    rec = Recorder()
    mon = LiveMonitor(rec, refresh_s=0.0, max_cols=4)
    rec.record_block_map(snapshot(0, n=10))  # 10 blocks in rows of 4: two padding cells
    rec.record_step(stats(0))
    mon.sink.on_step(make_step(1, 8, 4, 0, 0))  # a dict record (as read back from steps.jsonl)
    mon.close()
    assert mon.num_redraws == 1
    assert any('"z"' in m for m in sent)
    assert list(mon.memory_figure.data[0].x) == [0, 1]
