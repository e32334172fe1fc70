"""The figure conventions of ``workbench.viz.common`` and the figures that follow them:
integer ticks for counts, percentage axes with a stated range, legends clear of right-hand axes,
colour scales chosen for the data, the five memory categories in one colour order."""

from __future__ import annotations

import pytest

from workbench.viz.common import (
    LEGEND_ABOVE,
    MEMORY_CATEGORIES,
    budget_colour,
    count_axis,
    count_colour_range,
    nice_step,
    percent_axis,
    plural,
    share_colour_range,
    title_and_legend_above,
)
from workbench.viz.figures import CATEGORY_COLOURS, block_map_cells, block_map_figure, memory_timeline_figure


@pytest.mark.parametrize(
    ("span", "integer", "step"),
    [(853, True, 200), (31.2, True, 10), (3, True, 1), (0.4, True, 1), (1.0, False, 0.2), (0.077, False, 0.02)],
)
def test_nice_step(span, integer, step):
    assert nice_step(span, integer=integer) == step


def test_count_axis_ticks_whole_numbers():
    # report.html ticked a 853-block axis at 284 / 569 / 853 and a requests axis at 15.6 / 31.2
    ax = count_axis(853)
    assert ax["tickformat"] == ",d" and ax["dtick"] == 200 and ax["rangemode"] == "tozero"
    assert count_axis(31.2)["dtick"] == 10
    assert count_axis(0)["dtick"] == 1  # an empty run still ticks at whole requests


def test_percent_axis_states_its_range():
    ax = percent_axis()
    assert ax["range"] == [0, 1] and ax["tickformat"] == ".0%" and ax["dtick"] == pytest.approx(0.2)
    assert percent_axis(0, 0.04)["tickformat"] == ".1%"


def test_share_colour_scale_starts_at_zero():
    # chapter 7 stretched 0.074..0.076 over the whole colour scale; 7.3% and 7.7% now sit together
    assert share_colour_range([0.073, 0.077]) == (0.0, pytest.approx(0.08))
    assert share_colour_range([0.0, 0.0]) == (0.0, 0.01)
    assert share_colour_range([0.4, 0.93]) == (0.0, 1.0)
    # an all-zero count grid: one colour and a 0..1 bar, not -0.5..0.5
    assert count_colour_range([0, 0, 0]) == (0.0, 1.0)
    assert count_colour_range([0, 3, None]) == (0.0, 3.0)


def test_title_and_legend_above():
    lay = title_and_legend_above("t", 400, margin_top=130, margin_bottom=80)
    assert lay["legend"]["orientation"] == LEGEND_ABOVE["orientation"] and lay["legend"]["y"] == 1 + 14 / 190
    assert lay["title"] == {"text": "t", "y": 1, "yanchor": "top", "pad": {"t": 14}}
    assert lay["margin"] == {"t": 130, "b": 80} and lay["height"] == 400
    with pytest.raises(ValueError, match="height=200 leaves no plot area"):
        title_and_legend_above("t", 200)


def test_plural_and_budget_colours():
    assert plural(1, "request") == "1 request" and plural(2, "request") == "2 requests"
    assert budget_colour("KV pool (whole blocks)") == budget_colour("KV pool")
    with pytest.raises(KeyError, match="known parts"):
        budget_colour("mystery")


def test_memory_categories_one_colour_order():
    keys = [k for k, _, _ in MEMORY_CATEGORIES]
    assert keys == ["token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free"]
    assert list(CATEGORY_COLOURS) == keys
    assert len(set(CATEGORY_COLOURS.values())) == 5


def _snapshot(n: int, owners: int) -> dict:
    return {
        "step": 7,
        "allocator": "paged",
        "block_size": 4,
        "owner": [i % owners for i in range(n)],
        "owner_ids": [f"r{i}" for i in range(owners)],
        "filled": [4] * n,
        "state": ["used"] * n,
    }


def test_block_map_single_row_and_one_request():
    fig = block_map_figure(_snapshot(6, 1), max_cols=16)
    assert "1 request" in fig.layout.title.text and "1 requests" not in fig.layout.title.text
    assert list(fig.layout.yaxis.tickvals) == [0]  # one row: one tick, not -0.5 / 0 / 0.5
    cells = block_map_cells(_snapshot(64 * 40, 3), max_cols=64)
    fig = block_map_figure(_snapshot(64 * 40, 3), max_cols=64)
    ticks = list(fig.layout.yaxis.tickvals)
    assert len(ticks) <= 13 and set(ticks) <= set(cells["y"]) and ticks[0] == 0


def _step(i: int) -> dict:
    return {
        "step": i,
        "time_s": 0.1 * i,
        "num_blocks": 8,
        "block_size": 4,
        "kv_bytes_per_token": 1024,
        "token_states": 10,
        "reservation": 4,
        "internal_fragmentation": 2,
        "external_fragmentation": 4,
        "free": 12,
        "kv_utilization": 10 / 32,
        "fragmentation_rate": 10 / 20,
    }


def test_memory_timeline_legend_clear_of_the_right_axis():
    fig = memory_timeline_figure([_step(i) for i in range(5)], unit="tokens")
    lay = fig.layout
    plot = lay.height - lay.margin.t - lay.margin.b
    assert lay.legend.orientation == "h" and lay.legend.yanchor == "bottom" and lay.legend.xanchor == "left"
    assert (lay.legend.y - 1) * plot == pytest.approx(14)  # 14 px above the plot: clear of the 100% tick label
    assert lay.margin.t >= 100 and lay.title.yanchor == "top" and lay.title.y == 1  # title above the legend's rows
    # the plot area is taller than the right axis' title (about 7.5 px a character at 14 px), so the
    # title cannot run into the legend or past the tick labels (compare.html's short timelines did)
    assert plot >= 7.5 * len(lay.yaxis2.title.text) and lay.yaxis2.automargin
    assert fig.layout.yaxis2.tickformat == ".0%" and list(fig.layout.yaxis2.range) == [0, 1]
    assert fig.layout.yaxis2.dtick == pytest.approx(0.2)  # 0, 20, ..., 100%: not 13 / 26 / 39%
    assert fig.layout.yaxis.tickformat == ",d"  # token slots are whole


def test_sweep_heatmap_colour_ranges():
    from workbench.labs.ch07_parameter_matrix import heatmap_figure

    grid = {"max_num_seqs": [4, 8]}
    rows = [
        {"fragmentation_rate": 0.073, "preemptions": 0, "kv_utilization": 0.5},
        {"fragmentation_rate": 0.077, "preemptions": 0, "kv_utilization": 0.6},
    ]
    frag = heatmap_figure(grid, rows, "fragmentation_rate").data[0]
    assert (frag.zmin, frag.zmax) == (0, pytest.approx(0.08)) and frag.colorbar.tickformat == ".0%"
    pre = heatmap_figure(grid, rows, "preemptions").data[0]
    assert (pre.zmin, pre.zmax) == (0, 1) and pre.colorbar.tickformat == ",d"
    assert (pre.colorbar.tick0, pre.colorbar.dtick) == (0, 1)  # 0 and 1 on the bar, not 0, "1" (0.5), 1
    assert pre.colorbar.title.text == "count"  # the unit survives the merge with the range's colour bar
    assert "(" in heatmap_figure(grid, rows, "kv_utilization").layout.title.text  # the unit is in the title


def test_live_monitor_counts_tick_at_whole_requests():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    from workbench.metrics import Recorder, StepStats
    from workbench.viz.live import LiveMonitor

    rec = Recorder()
    mon = LiveMonitor(rec, refresh_s=0.0)
    fig = mon.memory_figure
    assert fig.layout.legend.orientation == "h"
    fields = set(StepStats.__dataclass_fields__)
    base = {k: 0 for k in fields if k not in ("allocator",)}
    rec.record_step(StepStats(**(base | _step(0) | {"num_running": 3, "num_waiting": 1})))
    mon.flush()
    assert fig.layout.yaxis3.dtick == 1 and fig.layout.yaxis3.tickformat == ",d"
    mon.close()
