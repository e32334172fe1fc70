"""Tests for workbench.viz.report (HTML run report built with plotly)."""

from __future__ import annotations

import math

import numpy as np
import plotly.graph_objects as go
import pytest

from workbench.memory import MemoryBudget
from workbench.viz.budget import budget_rows, budget_table_rows
from workbench.viz.report import (
    MEMORY_CATEGORIES,
    batch_composition_figure,
    format_value,
    kv_blocks_figure,
    latency_figure,
    step_time_figure,
    summary_label,
    summary_table,
    write_report,
)

NUM_BLOCKS = 64
BLOCK_SIZE = 16
BYTES_PER_TOKEN = 65536  # 16 tokens/block -> 1 MiB per block
POOL = NUM_BLOCKS * BLOCK_SIZE
PREEMPT_STEPS = {5, 12}

PLOTLY_MARKER = "* plotly.js v"  # header comment of the inlined bundle

#: a run's memory budget as the run records it (config.json's "memory"): 2 GiB x 0.9, the pool of NUM_BLOCKS
MEMORY = MemoryBudget(
    capacity_bytes=2 << 30,
    gpu_memory_utilization=0.9,
    weights_bytes=538_060_032,
    activation_bytes=64_487_424,
    comm_buffer_bytes=0,
    kv_budget_bytes=int((2 << 30) * 0.9) - 538_060_032 - 64_487_424,
    kv_bytes_per_token=BYTES_PER_TOKEN,
    block_size=BLOCK_SIZE,
    num_blocks=NUM_BLOCKS,
    max_model_len=512,
    source="cpu device_memory",
).to_dict()


def make_step(i: int) -> dict:
    """A self-consistent step record for step ``i``."""
    blocks_used = i + 2
    used = blocks_used * BLOCK_SIZE
    reservation = 4
    internal = 3
    token_states = used - reservation - internal
    external = BLOCK_SIZE if i % 2 else 0
    free = POOL - used - external
    assert token_states + reservation + internal + external + free == POOL
    return {
        "step": i,
        "time_s": 0.01 * i,
        "wall_time_s": 0.01,
        "schedule_time_s": 0.001,
        "model_time_s": 0.008,
        "sample_time_s": 0.0005,
        "num_prefill_tokens": 32 if i % 5 == 0 else 0,
        "num_decode_tokens": i % 4 + 1,
        "num_prefill_reqs": 1 if i % 5 == 0 else 0,
        "num_decode_reqs": i % 4 + 1,
        "num_running": i % 4 + 1,
        "num_waiting": 3 - i % 4,
        "num_preemptions": 1 if i in PREEMPT_STEPS else 0,
        "num_finished": 1 if i % 7 == 6 else 0,
        "num_blocks": NUM_BLOCKS,
        "blocks_used": blocks_used,
        "blocks_free": NUM_BLOCKS - blocks_used,
        "block_size": BLOCK_SIZE,
        "kv_bytes_per_token": BYTES_PER_TOKEN,
        "token_states": token_states,
        "reservation": reservation,
        "internal_fragmentation": internal,
        "external_fragmentation": external,
        "free": free,
        "kv_utilization": token_states / POOL,
        "fragmentation_rate": (reservation + internal + external) / (POOL - free),
    }


def make_request(
    rid: str,
    *,
    prompt: int,
    output: int,
    ttft: float | None,
    tpot: float | None,
    e2e: float | None,
    itl: list[float],
    finish_reason: str = "stop",
    error: str | None = None,
) -> dict:
    arrival = 0.0
    return {
        "request_id": rid,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "finish_reason": finish_reason,
        "error": error,
        "arrival_time_s": arrival,
        "first_scheduled_time_s": None if ttft is None else arrival + 0.001,
        "first_token_time_s": None if ttft is None else arrival + ttft,
        "finish_time_s": None if e2e is None else arrival + e2e,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "e2e_s": e2e,
        "queue_time_s": None if ttft is None else 0.001,
        "itl_s": itl,
        "num_preemptions": 0,
    }


@pytest.fixture
def steps() -> list[dict]:
    return [make_step(i) for i in range(20)]


@pytest.fixture
def requests() -> list[dict]:
    reqs = [
        make_request(
            f"r{k}",
            prompt=10 * (k + 1),
            output=5 + k,
            ttft=0.1 * (k + 1),  # 0.1 .. 0.5
            tpot=0.01 * (k + 1),  # 0.01 .. 0.05
            e2e=1.0 + k,  # 1 .. 5
            itl=[0.01 * (k + 1), 0.02 * (k + 1)],
            finish_reason="length" if k == 4 else "stop",
        )
        for k in range(5)
    ]
    # An errored request: its (absurd) latencies must be ignored everywhere.
    reqs.append(
        make_request(
            "err",
            prompt=7,
            output=0,
            ttft=100.0,
            tpot=100.0,
            e2e=100.0,
            itl=[100.0],
            finish_reason="error",
            error="boom",
        )
    )
    # A refused/aborted request without timings: None values are skipped.
    reqs.append(
        make_request(
            "abort",
            prompt=3,
            output=0,
            ttft=None,
            tpot=None,
            e2e=None,
            itl=[],
            finish_reason="abort",
        )
    )
    return reqs


# --------------------------------------------------------------------------- #
# summary
# --------------------------------------------------------------------------- #


def test_summary_counts_and_throughput(steps, requests):
    s = summary_table(steps, requests, wall_time_s=2.0)
    assert s["requests_total"] == 7
    assert s["requests_finished"] == 5
    assert s["requests_errored"] == 1
    assert s["requests_aborted"] == 1
    prompt = 10 + 20 + 30 + 40 + 50 + 3  # 153: the refused ("error") request's 7 were never processed
    output = 5 + 6 + 7 + 8 + 9  # 35
    assert s["prompt_tokens_total"] == prompt
    assert s["output_tokens_total"] == output
    assert s["wall_time_s"] == 2.0
    assert s["output_throughput_tok_s"] == pytest.approx(35 / 2.0)
    assert s["total_throughput_tok_s"] == pytest.approx((153 + 35) / 2.0)


def test_summary_percentiles_hand_computed(steps, requests):
    s = summary_table(steps, requests, wall_time_s=2.0)
    # ttft = [0.1 .. 0.5]; linear p99 index = 0.99 * 4 = 3.96
    assert s["ttft_p50_s"] == pytest.approx(0.3)
    assert s["ttft_p99_s"] == pytest.approx(0.4 + 0.96 * 0.1)
    assert s["tpot_p50_s"] == pytest.approx(0.03)
    assert s["tpot_p99_s"] == pytest.approx(0.04 + 0.96 * 0.01)
    assert s["e2e_p50_s"] == pytest.approx(3.0)
    assert s["e2e_p99_s"] == pytest.approx(4.96)
    # itl pooled and sorted: [.01, .02, .02, .03, .04, .04, .05, .06, .08, .10];
    # linear p50 index 4.5, p99 index 8.91
    assert s["itl_p50_s"] == pytest.approx(0.04)
    assert s["itl_p99_s"] == pytest.approx(0.08 + 0.91 * 0.02)
    itl = [0.01 * (k + 1) * m for k in range(5) for m in (1, 2)]
    assert s["itl_p99_s"] == pytest.approx(float(np.percentile(itl, 99)))


def test_summary_step_aggregates(steps, requests):
    s = summary_table(steps, requests, wall_time_s=2.0)
    assert s["num_steps"] == 20
    assert s["blocks_used_peak"] == 21
    assert s["preemptions_total"] == len(PREEMPT_STEPS)
    # token_states = 16 * (i + 2) - 7
    util = [(16 * (i + 2) - 7) / POOL for i in range(20)]
    assert s["kv_utilization_mean_frac"] == pytest.approx(sum(util) / 20)
    frag = [(7 + (16 if i % 2 else 0)) / (16 * (i + 2) + (16 if i % 2 else 0)) for i in range(20)]
    assert s["fragmentation_rate_mean_frac"] == pytest.approx(sum(frag) / 20)
    # num_running = i % 4 + 1 -> 1,2,3,4 repeated five times
    assert s["running_reqs_mean"] == pytest.approx(2.5)
    assert all("-" not in k and k == k.lower() for k in s)


def test_summary_empty_inputs():
    s = summary_table([], [], wall_time_s=0.0)
    assert s["requests_total"] == 0
    assert s["output_tokens_total"] == 0
    assert s["output_throughput_tok_s"] == 0.0
    assert s["total_throughput_tok_s"] == 0.0
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert s[f"{name}_p50_s"] is None
        assert s[f"{name}_p99_s"] is None
    assert s["kv_utilization_mean_frac"] == 0.0
    assert s["blocks_used_peak"] == 0
    assert s["preemptions_total"] == 0
    assert s["fragmentation_rate_mean_frac"] == 0.0
    assert s["running_reqs_mean"] == 0.0


def test_summary_rejects_bad_wall_time():
    with pytest.raises(ValueError):
        summary_table([], [], wall_time_s=-1.0)
    with pytest.raises(ValueError):
        summary_table([], [], wall_time_s=math.nan)


# --------------------------------------------------------------------------- #
# figures
# --------------------------------------------------------------------------- #


def _names(fig: go.Figure) -> list[str]:
    return [t.name for t in fig.data]


def _has_no_data(fig: go.Figure) -> bool:
    return any(a.text == "no data" for a in fig.layout.annotations)


def test_kv_blocks_figure(steps):
    fig = kv_blocks_figure(list(reversed(steps)))  # order must not matter
    labels = [label for _, label, _ in MEMORY_CATEGORIES]
    assert _names(fig) == [*labels, "blocks used"]
    areas = fig.data[:5]
    assert all(t.stackgroup == "kv" for t in areas)
    assert list(areas[0].x) == list(range(20))
    # stacked areas add up to the pool size in MiB at every step
    pool_mib = POOL * BYTES_PER_TOKEN / 2**20
    totals = np.sum([np.asarray(t.y) for t in areas], axis=0)
    np.testing.assert_allclose(totals, pool_mib)
    # token states in MiB: (16 * (i + 2) - 7) slots * 64 KiB
    assert areas[0].y[0] == pytest.approx((32 - 7) * BYTES_PER_TOKEN / 2**20)
    assert list(fig.data[5].y) == [i + 2 for i in range(20)]
    assert fig.data[5].yaxis == "y2"
    assert "MiB" in fig.layout.yaxis.title.text
    assert "customdata[0]" in fig.data[0].hovertemplate
    assert fig.data[0].customdata[3][0] == pytest.approx(0.03)
    # the right axis counts blocks at round values (not 64/5 = 12.8, 25.6, ...), over the same range
    y2 = fig.layout.yaxis2
    assert list(y2.range) == [0, NUM_BLOCKS] and y2.tickformat == ",d" and y2.dtick == 20 and y2.tick0 == 0
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y > 1  # above the plot, clear of the axis


def test_batch_composition_figure(steps):
    fig = batch_composition_figure(steps)
    assert _names(fig) == [
        "prefill tokens",
        "decode tokens",
        "running",
        "waiting",
        "preemptions",
    ]
    assert fig.layout.barmode == "stack"
    assert isinstance(fig.data[0], go.Bar) and isinstance(fig.data[1], go.Bar)
    assert fig.data[0].y[0] == 32 and fig.data[0].y[1] == 0
    assert fig.data[2].yaxis == "y2" and fig.data[3].yaxis == "y2"
    assert sorted(fig.data[4].x) == sorted(PREEMPT_STEPS)
    assert fig.data[4].mode == "markers"
    # both axes count, at round whole values: tokens (up to 36 per step) and requests (up to 4)
    assert (fig.layout.yaxis.tickformat, fig.layout.yaxis.dtick) == (",d", 10)
    assert (fig.layout.yaxis2.tickformat, fig.layout.yaxis2.dtick, fig.layout.yaxis2.rangemode) == (",d", 1, "tozero")
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y > 1


def test_step_time_figure(steps):
    fig = step_time_figure(steps)
    assert _names(fig) == ["schedule", "model", "sample", "wall"]
    assert fig.layout.barmode == "stack"
    assert fig.data[1].y[0] == pytest.approx(8.0)  # ms
    assert fig.data[3].y[0] == pytest.approx(10.0)
    assert "ms" in fig.layout.yaxis.title.text


def test_latency_figure(requests):
    fig = latency_figure(requests)
    assert _names(fig) == ["TTFT", "TPOT", "ITL", "end-to-end latency"]
    ttft = fig.data[0]
    # errored request (100 s) excluded, None skipped, converted to ms
    assert list(ttft.x) == pytest.approx([100.0, 200.0, 300.0, 400.0, 500.0])
    assert list(ttft.y) == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert len(fig.data[2].x) == 10  # pooled ITL gaps
    assert max(fig.data[3].x) == pytest.approx(5000.0)
    assert not _has_no_data(fig)


def test_latency_figure_only_errors_has_empty_panels():
    reqs = [
        make_request(
            "e",
            prompt=1,
            output=0,
            ttft=1.0,
            tpot=1.0,
            e2e=1.0,
            itl=[1.0],
            finish_reason="error",
            error="x",
        )
    ]
    fig = latency_figure(reqs)
    assert len(fig.data) == 0
    assert sum(a.text == "no data" for a in fig.layout.annotations) == 4


def test_figures_empty_inputs():
    for fig in (
        kv_blocks_figure([]),
        batch_composition_figure([]),
        step_time_figure([]),
        latency_figure([]),
    ):
        assert isinstance(fig, go.Figure)
        assert len(fig.data) == 0
        assert _has_no_data(fig)


# --------------------------------------------------------------------------- #
# HTML report
# --------------------------------------------------------------------------- #


def test_format_value():
    assert format_value(None) == "n/a"
    assert format_value(0.0) == "0"
    assert format_value(12345.678) == "12,345.7"
    assert format_value(3.14159) == "3.142"
    assert format_value(0.0123456) == "0.01235"
    assert format_value(1234) == "1,234"
    assert format_value(True) == "True"
    assert format_value({"a": 1}) == '{"a": 1}'


def test_summary_labels_are_readable_with_units():
    assert (
        summary_label("ttft_p50_s") == "TTFT p50 (ms)" and summary_label("e2e_p99_s") == "end-to-end latency p99 (ms)"
    )
    assert summary_label("waste_token_states_pool_frac") == "token states (share of pool)"
    assert (
        summary_label("waste_internal_fragmentation_used_frac") == "internal fragmentation (share of occupied memory)"
    )
    assert summary_label("kv_utilization_mean_frac") == "KV utilization (mean over steps)"
    assert summary_label("output_throughput_tok_s") == "output throughput (tok/s)"
    # keys it does not know keep their name, with the unit their suffix says
    assert summary_label("queue_p50_s") == "queue p50 (s)" and summary_label("hit_rate_frac") == "hit rate (share)"


def test_budget_rows_follow_the_memory_figures():
    rows = dict(budget_rows(MEMORY))
    usable = int(MEMORY["capacity_bytes"] * 0.9)
    assert rows["weights"] == MEMORY["weights_bytes"] and rows["KV pool (whole blocks)"] == NUM_BLOCKS * 16 * 65536
    assert sum(rows.values()) == MEMORY["capacity_bytes"]  # the parts fill the device exactly
    assert rows["held back: 1 - gpu_memory_utilization"] == MEMORY["capacity_bytes"] - usable
    assert 0 <= rows["left: part of a block"] < MEMORY["kv_budget_bytes"] - NUM_BLOCKS * MEMORY["block_bytes"] + 1
    # a bypass that set the pool leaves memory unused, not "part of a block"
    set_by_override = dict(budget_rows(MEMORY | {"source": "num_gpu_blocks_override"}))
    assert "left: unused" in set_by_override and "left: part of a block" not in set_by_override
    table = {r[0]: r for r in budget_table_rows(MEMORY)}
    assert table["capacity"][2] == "2,048.0" and table["capacity"][3] == "100.0%"
    assert table["x gpu_memory_utilization"][1].startswith("0.9 (usable: 1,932,735,283 B)")
    assert table["KV blocks"][1] == "64" and table["block size (tokens)"][1] == "16"
    assert table["KV bytes per token"][1] == "65,536 B" and table["block bytes"][1] == "1,048,576 B"
    assert table["sequences of max_model_len=512"][1] == "2.00 at once (max concurrency)"


def test_write_report(tmp_path, steps, requests):
    summary = summary_table(steps, requests, wall_time_s=2.0) | {"waste_token_states_pool_frac": 0.5}
    config = {
        "model": "tiny",
        "num_blocks": NUM_BLOCKS,
        "note": "<i>zz-evil-zz</i>",
        "sched": {"max_batch": 8},
    }
    out = write_report(
        tmp_path / "nested" / "dir" / "report.html",
        steps,
        requests,
        summary,
        config | {"memory": MEMORY},  # as run_job's config.json: the budget is read from it
        title="run <&> 1",
    )
    assert out == tmp_path / "nested" / "dir" / "report.html"
    files = list((tmp_path / "nested" / "dir").iterdir())
    assert files == [out]
    doc = out.read_text(encoding="utf-8")
    assert doc.startswith("<!DOCTYPE html>")
    assert doc.count(PLOTLY_MARKER) == 1
    assert doc.count("Plotly.newPlot(") == 7  # budget + 4 + memory timeline + waste bars (no block maps given)
    assert "<script src=" not in doc  # nothing loaded from a CDN
    # title and config strings are escaped
    assert "<title>run &lt;&amp;&gt; 1</title>" in doc
    assert "<i>zz-evil-zz" not in doc
    assert "&lt;i&gt;zz-evil-zz&lt;/i&gt;" in doc
    assert "max_batch" in doc
    # the memory budget comes first, under docs/architecture.md §3's names, with bytes and MiB
    budget = doc.index("<h2>Memory budget</h2>")
    assert budget < doc.index("<caption>summary</caption>") < doc.index("KV cache memory over time")
    section = doc[budget : doc.index("</section>", budget)]
    for name, value in (
        ("capacity", "2,147,483,648 B (device_memory declared for the CPU)"),
        ("x gpu_memory_utilization", "0.9 (usable: 1,932,735,283 B)"),
        ("weights", "538,060,032 B"),
        ("activations (profiled peak)", "64,487,424 B"),
        ("communication buffers", "0 B"),
        ("KV pool (whole blocks)", "67,108,864 B (64 blocks x 1,048,576 B)"),
        ("KV blocks", "64"),
        ("block size (tokens)", "16"),
        ("KV bytes per token", "65,536 B"),
    ):
        assert f"<th>{name}</th><td>{value}" in section, name
    assert "<td>513.1</td><td>25.1%</td>" in section  # weights in MiB and share of capacity
    assert "Where the device memory goes" in doc
    assert '"memory"' not in doc and "<th>memory</th>" not in doc  # not dumped as JSON in the config table
    # the summary: readable names with units (each key in its row's tooltip), shares in %, latencies in ms
    for key, label, value in (
        ("ttft_p99_s", "TTFT p99 (ms)", "496.0"),
        ("output_throughput_tok_s", "output throughput (tok/s)", "17.500"),
        ("total_throughput_tok_s", "total throughput (tok/s)", "94.000"),
        ("preemptions_total", "preemptions", "2"),
        ("waste_token_states_pool_frac", "token states (share of pool)", "50.0%"),
        ("kv_utilization_mean_frac", "KV utilization (mean over steps)", f"{summary['kv_utilization_mean_frac']:.1%}"),
    ):
        assert f'<th title="{key}">{label}</th><td>{value}</td>' in doc, key
    assert "<th>ttft_p50_s</th>" not in doc and "waste_token_states_pool_frac</th>" not in doc
    # figure titles and the legend of the memory categories
    for text in (
        "KV cache memory over time",
        "Batch composition per step",
        "Request latency CDFs",
        "Step time breakdown",
        "external fragmentation",
        "Kwon et al.",
    ):
        assert text in doc


@pytest.mark.slow
@pytest.mark.browser
def test_report_figures_are_not_cut_or_covered_in_a_browser(tmp_path, steps, requests):
    """Rendered in Chromium at a narrow and a wide page: no title, axis title or legend is cut by its
    figure's edge or covered by the legend, and no right-axis title is taller than its plot."""
    from browser_support import page_layout_problems

    summary = summary_table(steps, requests, wall_time_s=2.0)
    out = write_report(tmp_path / "report.html", steps, requests, summary, {"model": "tiny"}, memory=MEMORY)
    assert page_layout_problems(out, widths=(700, 1400)) == []


def test_write_report_empty_inputs(tmp_path):
    summary = summary_table([], [], wall_time_s=0.0)
    out = write_report(tmp_path / "empty.html", [], [], summary, {})
    doc = out.read_text(encoding="utf-8")
    assert doc.count(PLOTLY_MARKER) == 1
    assert doc.count("Plotly.newPlot(") == 6  # 4 + memory timeline + waste bars (no block maps given)
    assert "no data" in doc and "Memory budget" not in doc  # no budget given: no section
    assert "<td>n/a</td>" in doc
    assert "<title>workbench run</title>" in doc
