"""Chapters 7 and 8: the parameter sweep (real and simulated), its panel and heatmaps; runs with arrivals
and chunked prefill, checked against the engine's own step records (tiny random-weight model)."""

from __future__ import annotations

import math

import pytest

from workbench import labs
from workbench.bench.datasets import PromptRecord
from workbench.labs import ch07_parameter_matrix as sweep
from workbench.labs import ch08_chunked_prefill as chunked
from workbench.labs.ch07_parameter_matrix import best_under_target
from workbench.labs.ch08_chunked_prefill import reference_prefill_chunks


def _records(n: int = 4, prompt: int = 30, out: int = 10) -> list[PromptRecord]:
    return [PromptRecord(list(range(3, 3 + prompt + 5 * i)), False, f"r{i}", out + i, out + i) for i in range(n)]


def test_grid_points_parse_text_and_name_bad_values():
    assert sweep.grid_points({"block_size": "8, 16", "enable_chunked_prefill": "on"}) == [
        {"block_size": 8, "enable_chunked_prefill": True},
        {"block_size": 16, "enable_chunked_prefill": True},
    ]
    assert sweep.normalize_grid({"device_memory": "640MiB, 1GiB", "gpu_memory_utilization": [0.8, "0.9", 0.8]}) == {
        "device_memory": [640 << 20, 1 << 30],
        "gpu_memory_utilization": [0.8, 0.9],
    }
    with pytest.raises(ValueError, match="'kv_allocator' cannot be swept"):
        sweep.grid_points({"kv_allocator": ["paged"]})
    with pytest.raises(ValueError, match="max_num_seqs: 'four' is not a whole number"):
        sweep.grid_points({"max_num_seqs": "four"})
    with pytest.raises(ValueError, match="no value given"):
        sweep.grid_points({"block_size": ""})
    with pytest.raises(ValueError, match="grid is empty"):
        sweep.grid_points({})


def test_run_sweep_rows_are_the_engines_own_figures(tiny_model):
    records = _records()
    base = dict(model=str(tiny_model), max_model_len=128)
    grid = {"block_size": [8, 16], "num_gpu_blocks_override": [10, 40]}
    seen = []
    rows = sweep.run_sweep(grid, records=records, on_row=lambda i, r: seen.append(i), **base)
    assert seen == [0, 1, 2, 3] and [r["config"] for r in rows] == sweep.grid_points(grid)
    # block_size 8 with 10 blocks (80 tokens) cannot hold one 128-token sequence: refused, the sweep goes on
    assert rows[0]["error"] and "max_model_len" in rows[0]["error"] and rows[0]["ttft_p99_s"] is None
    for cfg, row in zip(sweep.grid_points(grid)[1:], rows[1:]):
        direct = labs.lab_run(records, **base, **cfg)
        steps = direct.recorder.steps
        assert row["error"] is None
        assert row["pool_blocks"] == cfg["num_gpu_blocks_override"] == direct.memory["num_blocks"]
        assert row["preemptions"] == sum(s.num_preemptions for s in steps)
        assert row["steps"] == len(steps)
        assert row["peak_running"] == max(s.num_running for s in steps)
        assert row["kv_utilization"] == pytest.approx(sum(s.kv_utilization for s in steps) / len(steps))
        assert row["fragmentation_rate"] == pytest.approx(sum(s.fragmentation_rate for s in steps) / len(steps))
        assert row["output_tokens"] == sum(r.max_tokens for r in records)
        assert row["output_throughput_tok_s"] > 0 and row["ttft_p99_s"] > 0
    # a small pool holds fewer requests at once, each step's pool fuller
    small, large = rows[2], rows[3]  # block_size 16: 10 and 40 blocks
    assert small["peak_running"] < large["peak_running"] and large["preemptions"] == 0
    assert small["kv_utilization"] > large["kv_utilization"]
    with pytest.raises(ValueError, match="grid point block_size=12"):
        sweep.run_sweep({"block_size": [16, 12]}, records=records, **base)  # refused before any run


def test_gpu_memory_utilization_takes_memory_from_the_kv_pool_only(tiny_model):
    records = _records(2)
    rows = sweep.run_sweep(
        {"gpu_memory_utilization": [0.5, 0.9]},
        records=records,
        model=str(tiny_model),
        max_model_len=128,
        device_memory=8 << 20,
        max_num_batched_tokens=128,
    )
    lo, hi = (r["memory"] for r in rows)
    assert lo["weights_bytes"] == hi["weights_bytes"] and lo["activation_bytes"] == hi["activation_bytes"]
    usable = int(hi["capacity_bytes"] * 0.9) - int(lo["capacity_bytes"] * 0.5)
    assert hi["kv_budget_bytes"] - lo["kv_budget_bytes"] == usable
    assert hi["num_blocks"] > lo["num_blocks"]
    table = str(sweep.utilization_table(rows))
    assert "(100%)" in table and f"{hi['num_blocks'] - lo['num_blocks']:,} of {hi['num_blocks']:,} blocks" in table


def test_heatmap_cells_follow_the_grid_order():
    grid = {"block_size": [8, 16, 32], "max_num_seqs": [4, 8]}
    rows = [None] * 6
    rows[3] = {"label": "x", "config": {}, "error": None, "preemptions": 7}  # block_size=16, max_num_seqs=8
    rows[4] = {"label": "y", "config": {}, "error": "refused", "preemptions": None}
    fig = sweep.heatmap_figure(grid, rows, "preemptions")
    z, text = fig.data[0].z, fig.data[0].text
    assert list(fig.data[0].x) == ["8", "16", "32"] and list(fig.data[0].y) == ["max_num_seqs=4", "max_num_seqs=8"]
    assert z[1][1] == 7 and sum(v is not None for row in z for v in row) == 1
    assert text[0][2] == "refused"
    with pytest.raises(ValueError, match="metric="):
        sweep.heatmap_figure(grid, rows, "nope")


def test_sweep_panel_fills_heatmaps_and_survives_bad_input(tiny_model):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    records = _records(3)
    panel = sweep.SweepPanel(
        {"block_size": [16], "num_gpu_blocks_override": [8, 32]},
        records=records,
        model=str(tiny_model),
        max_model_len=128,
    )
    assert set(panel.controls) == {"block_size", "num_gpu_blocks_override"}
    assert all(v is None for f in panel.figures.values() for row in f.data[0].z for v in row)
    rows = panel.run()
    assert len(rows) == 2 and all(r["error"] is None for r in rows)
    assert panel.progress.value == 2 and panel.progress.description == "runs 2/2"
    for m, fig in panel.figures.items():  # block_size across (one column), the pool sizes down (two rows)
        assert [row[0] is not None for row in fig.data[0].z] == [True, True], m
    assert [row[0] for row in panel.figures["preemptions"].data[0].z] == [float(r["preemptions"]) for r in rows]
    assert "2 of 2 run(s) done" in panel.status.value
    # the same runs as the library call
    direct = sweep.run_sweep(panel.grid, records=records, model=str(tiny_model), max_model_len=128)
    keys = ("pool_blocks", "preemptions", "steps", "kv_utilization", "fragmentation_rate", "peak_running")
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in direct]
    # bad text: a clear error in the status line; the panel keeps working
    panel.controls["block_size"].value = "16, sixteen"
    with pytest.raises(ValueError, match="block_size: 'sixteen'"):
        panel.run()
    assert "sixteen" in panel.error and "sixteen" in panel.status.value
    panel._clicked()  # the button's path: the error is shown, nothing raised
    assert "sixteen" in panel.status.value
    shown = list(panel.plot_box.children)
    rows = panel.run(block_size=[32], num_gpu_blocks_override="8")
    assert panel.controls["block_size"].value == "32" and len(rows) == 1 and rows[0]["pool_blocks"] == 8
    # a new grid refills the widgets on the page (new ones can reach the browser empty): one cell each now
    assert list(panel.plot_box.children) == shown and list(panel.figures.values()) == shown
    for m, fig in panel.figures.items():
        assert len(fig.data[0].z) == 1 and len(fig.data[0].z[0]) == 1 and fig.data[0].z[0][0] is not None, m
        assert list(fig.data[0].x) == ["32"] and len(fig.data[0].y) == 1, m
    assert panel.figures["preemptions"].data[0].z[0][0] == float(rows[0]["preemptions"])
    # a grid refused before any point ran keeps the last sweep on show
    with pytest.raises(ValueError, match="grid point"):
        panel.run(num_gpu_blocks_override=[0])
    assert panel.rows == rows and panel.progress.description == "runs 1/1"
    assert panel.controls["num_gpu_blocks_override"].value == "8"  # the text boxes show the last sweep again
    assert panel.figures["preemptions"].data[0].z[0][0] == float(rows[0]["preemptions"])


def test_sim_sweep_is_deterministic_and_sizes_the_pool_from_utilization():
    grid = {"gpu_memory_utilization": [0.45, 0.9]}
    a = sweep.sim_sweep(grid, request_rate=5, duration_s=4)
    b = sweep.sim_sweep(grid, request_rate=5, duration_s=4)
    drop = ("memory",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b
    ]
    assert a[0]["pool_blocks"] < a[1]["pool_blocks"]
    assert all(r["output_throughput_tok_s"] > 0 and r["ttft_p99_s"] > 0 for r in a)
    with pytest.raises(ValueError, match="not in the catalogue"):
        sweep.sim_sweep(grid, model="gpt-5")


def test_best_under_target_and_median():
    rows = [
        {"label": "a", "config": {"x": 1}, "error": None, "output_throughput_tok_s": 5.0, "ttft_p99_s": 1.0},
        {"label": "b", "config": {"x": 2}, "error": None, "output_throughput_tok_s": 9.0, "ttft_p99_s": 2.0},
        {"label": "c", "config": {"x": 3}, "error": None, "output_throughput_tok_s": 12.0, "ttft_p99_s": 4.0},
    ]
    assert sweep.median_ttft_p99(rows) == 2.0
    assert best_under_target(rows, 2.0)["label"] == "b"
    assert best_under_target(rows, 0.5) is None
    assert labs.check("7.1", None, rows=rows, ttft_p99_target_s=0.5)
    assert labs.check("7.1", "b", rows=rows, ttft_p99_target_s=2.0)


# ---------------------------------------------------------------- chapter 8
def _arrival_trace():
    decodes = [(0, PromptRecord(list(range(5, 13 + i)), False, f"decode-{i}", 40, 40)) for i in range(3)]
    longs = [
        (4, PromptRecord(list(range(3, 3 + 150)), False, "long-0", 2, 2)),
        (24, PromptRecord(list(range(7, 7 + 97)), False, "long-1", 2, 2)),
    ]
    return decodes + longs


@pytest.mark.parametrize("budget", [16, 32, 64])
def test_chunk_counts_match_the_engines_step_records(tiny_model, budget):
    res = chunked.arrival_run(_arrival_trace(), model=str(tiny_model), max_model_len=256, max_num_batched_tokens=budget)
    rows = chunked.prefill_measurements(res)
    assert [r["request_id"] for r in rows] == ["long-0", "long-1"]
    recs = {r.request_id: r for r in res.recorder.requests}
    for r in rows:
        assert r["arrival_step"] == {"long-0": 4, "long-1": 24}[r["request_id"]]
        assert r["chunks"] == recs[r["request_id"]].num_prefill_chunks
        assert sum(r["chunk_tokens"]) == r["prompt_tokens"] and max(r["chunk_tokens"]) <= budget
        assert r["decodes"] == 3 and r["alone"]
        assert r["chunks"] == reference_prefill_chunks(r["prompt_tokens"], budget, r["decodes"])
    assert labs.check("8.1", reference_prefill_chunks, measured=rows)
    # every step stays within the budget; the schedule agrees with the step records
    for st, sched in zip(res.recorder.steps, res.schedule):
        assert st.num_prefill_tokens + st.num_decode_tokens == sum(n for n, _ in sched.values()) <= budget
    row = chunked.tradeoff_row(res)
    assert row["max_num_batched_tokens"] == budget and row["enable_chunked_prefill"]
    assert row["max_step_tokens"] == budget and row["long_chunks"] == [r["chunks"] for r in rows]


def test_without_chunked_prefill_a_long_prompt_runs_whole_or_waits(tiny_model):
    args = dict(model=str(tiny_model), max_model_len=256, enable_chunked_prefill=False)
    whole = chunked.arrival_run(_arrival_trace(), max_num_batched_tokens=256, **args)
    m = chunked.prefill_measurements(whole)
    assert [r["chunks"] for r in m] == [1, 1] and [r["ttft_steps"] for r in m] == [1, 1]
    assert chunked.tradeoff_row(whole)["max_step_tokens"] == 150 + 3
    # a budget the prompt fits but not beside the decodes: it waits until they end
    tight = chunked.arrival_run(_arrival_trace(), max_num_batched_tokens=152, **args)
    m = chunked.prefill_measurements(tight)
    assert m[0]["chunks"] == 1 and m[0]["ttft_steps"] > 20


def test_tradeoff_panel_runs_and_plots(tiny_model):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    panel = chunked.TradeoffPanel(_arrival_trace(), model=str(tiny_model), max_model_len=256)
    res = panel.run(max_num_batched_tokens=32)
    assert panel.controls["max_num_batched_tokens"].value == 32 and res.max_num_batched_tokens == 32
    panel.run(max_num_batched_tokens=256, enable_chunked_prefill=False)
    assert [r["label"] for r in panel.rows] == ["B=32 chunked", "B=256 whole"]
    xs = [len(tr.x) for tr in panel.figure.data]
    assert sum(xs) == 4 and "B=256 whole" in panel.status.value  # p50 and p99 points of both runs
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 is smaller than max_num_seqs"):
        panel.run(max_num_batched_tokens=4)
    assert "max_num_seqs" in panel.error and "max_num_seqs" in panel.status.value
    assert math.isfinite(panel.rows[0]["itl_p99_s"])


def test_exercise_8_1_is_checked_against_the_scheduler_even_without_measurements(capsys):
    """A trace whose runs cannot tell answers apart (or no measured prefill at all) must not make any
    function pass: the check also runs fixed (P, B, D) cases through the real scheduler."""
    from workbench.labs.ch08_chunked_prefill import SCHEDULER_CASES_8_1, scheduler_prefill_chunks

    for p, b, d in SCHEDULER_CASES_8_1:
        assert scheduler_prefill_chunks(p, b, d) == reference_prefill_chunks(p, b, d)
    assert not labs.check("8.1", lambda p, b, d: 1, measured=[])
    assert not labs.check("8.1", lambda p, b, d: math.ceil(p / b), measured=[])
    assert "the decodes take part" in " ".join(capsys.readouterr().out.split())  # verdicts wrap at 88 columns
    assert labs.check("8.1", reference_prefill_chunks, measured=[])
    with pytest.raises(ValueError, match="leaves no token"):
        scheduler_prefill_chunks(10, 3, 3)


def test_bad_arguments_are_named_before_any_run(tiny_model):
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        sweep.run_sweep({"block_size": [16]}, model=str(tiny_model), max_num_seq=4)
    with pytest.raises(ValueError, match="device_memory is the memory of a CPU device"):
        sweep.sim_sweep({"device_memory": [40 << 30, 80 << 30]}, duration_s=2)
    with pytest.raises(ValueError, match="set per run"):
        chunked.tradeoff_runs([(64, True)], max_num_batched_tokens=-5)
    with pytest.raises(ValueError, match="enable_chunked_prefill: bool"):
        chunked.tradeoff_runs([(64, "yes")])


def test_chunked_prefill_off_with_a_budget_below_the_prompt_is_labelled_so(tiny_model):
    off = chunked.arrival_run(
        _arrival_trace(),
        model=str(tiny_model),
        max_model_len=256,
        max_num_batched_tokens=64,
        enable_chunked_prefill=False,
    )
    row = chunked.tradeoff_row(off)
    assert max(row["long_chunks"]) > 1 and row["label"] == "B=64 off, split anyway"


def test_panels_show_refused_values_in_their_status_line(tiny_model):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    panel = chunked.TradeoffPanel(_arrival_trace(), model=str(tiny_model), max_model_len=256)
    with pytest.raises(ValueError, match="give a number of tokens"):
        panel.run(max_num_batched_tokens="abc")
    assert "give a number of tokens" in panel.status.value and panel.error
    sp = sweep.SweepPanel({"block_size": [16]}, model=str(tiny_model), max_model_len=128)
    with pytest.raises(ValueError, match="not one of this panel's arguments"):
        sp.run(gpu_memory_utilization="1.5")
    assert "not one of this panel" in sp.status.value
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):  # refused when made, not at a click
        chunked.TradeoffPanel(_arrival_trace(), max_num_seq=4)


def test_chapter_modules_are_reached_from_the_package():
    import importlib
    from pathlib import Path

    from workbench import labs

    chapters = sorted(p.stem for p in Path(labs.__file__).parent.glob("ch[0-9][0-9]_*.py"))
    assert len(chapters) == 19
    for name in (*chapters, "multigpu_common", "panel"):
        assert getattr(labs, name) is importlib.import_module(f"workbench.labs.{name}")
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        labs.nope  # noqa: B018


def test_heatmap_refuses_more_rows_than_grid_points():
    grid = {"block_size": [8, 16], "max_num_seqs": [2, 4]}
    rows = [{"output_throughput_tok_s": 1.0}] * 5
    with pytest.raises(ValueError, match="5 rows for a grid of 4 points"):
        sweep.heatmap_figure(grid, rows, "output_throughput_tok_s")
    sweep.heatmap_figure(grid, rows[:2], "output_throughput_tok_s")  # fewer: the rest not run yet


def test_memory_runs_size_the_pool_from_memory_and_judge_the_fragmentation_claim(tiny_model):
    """Chunked prefill's smaller budget profiles a smaller activation peak and so leaves a larger KV pool from the
    same memory; the verdict reads the fragmentation rates of both runs."""
    mem = chunked.memory_runs([(32, True), (256, False)], trace=_arrival_trace(), progress=lambda s: None,
                              model=str(tiny_model), max_model_len=256, device_memory=64 << 20)  # fmt: skip
    rows = [chunked.memory_row(r) for r in mem.values()]
    assert [r["label"] for r in rows] == ["B=32 chunked", "B=256 whole"]
    small, whole = rows
    assert 0 < small["activation_mib"] < whole["activation_mib"]
    assert small["kv_pool_tokens"] > whole["kv_pool_tokens"] and small["num_blocks"] > whole["num_blocks"]
    for r in rows:
        assert 0 <= r["frag_mean"] <= r["frag_max"] <= 1 and 0 < r["peak_kv_usage"] <= 1
    verdict = chunked.memory_verdict(rows).splitlines()
    assert verdict[1].startswith("KV pool: +") and verdict[-1].startswith("verdict: chunked prefill leaves memory")
    assert [c.header for c in chunked.memory_table(rows).columns][:3] == ["run", "activation peak (MiB)", "KV blocks"]


def test_gpu_memory_rows_grow_the_reserve_with_the_budget():
    rows = chunked.gpu_memory_rows()
    assert [r["label"] for r in rows] == ["B=2048 chunked", "B=8192 chunked", "B=32768 whole"]
    acts, kv = [r["activation_gib"] for r in rows], [r["kv_tokens"] for r in rows]
    assert acts == sorted(acts) and kv == sorted(kv, reverse=True) and acts[0] < acts[-1]
    with pytest.raises(ValueError, match="whole prompts need max_num_batched_tokens >= max_model_len=32768"):
        chunked.gpu_memory_rows(budgets=[(8192, False)])
