"""Figures of KV-cache memory: block map, memory timeline, waste bars, latency CDFs.

Inputs are plain data, so nothing here imports the engine:

* *step records*: ``StepStats`` objects or their ``to_dict()`` dicts (one per engine step; the
  KV pool split in token slots -- ``token_states``, ``reservation``,
  ``internal_fragmentation``, ``external_fragmentation``, ``free`` -- sums to
  ``num_blocks * block_size``; ``kv_bytes_per_token`` converts slots to bytes);
* *request records*: ``RequestRecord`` dicts, latencies in seconds (``ttft_s``, ``tpot_s``,
  ``itl_s``, ``e2e_s``);
* *block-map snapshots*: dicts produced by the KV manager's ``block_map(...)``::

      {"step": int, "allocator": str, "block_size": int,
       "owner": [int, ...],      # per physical block: index into owner_ids, -1 when free
       "owner_ids": [str, ...],  # request ids
       "filled": [int, ...],     # per block: slots holding token states (0..block_size)
       "state": [str, ...]}      # per block: "free" | "external" | "cached" | "used"

The categories and their definitions are those of docs/architecture.md §3, after the vLLM paper
(Kwon et al., *Efficient Memory Management for Large Language Model Serving with
PagedAttention*, SOSP 2023, §2.3 and Fig. 2). Category colours are defined once, in
:data:`workbench.viz.common.MEMORY_CATEGORIES`, and used by every figure here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.metrics.waste import USED_CATEGORIES, waste_breakdown
from workbench.viz.common import (
    MEMORY_CATEGORIES,
    _latency_values,
    _no_data_figure,
    _percentile,
    count_axis,
    percent_axis,
    plural,
    title_and_legend_above,
)

__all__ = [
    "BLOCK_STATE_COLOURS",
    "CATEGORY_COLOURS",
    "CATEGORY_LABELS",
    "LATENCY_METRICS",
    "OWNER_PALETTE",
    "PAD_CODE",
    "block_map_cells",
    "block_map_colorscale",
    "row_start_axis",
    "block_map_figure",
    "latency_cdf_figure",
    "memory_timeline_figure",
    "waste_bars_figure",
]

#: ``{step-record key: colour}`` of the five KV-pool categories (from ``MEMORY_CATEGORIES``).
CATEGORY_COLOURS: dict[str, str] = {key: colour for key, _, colour in MEMORY_CATEGORIES}
#: ``{step-record key: legend label}`` of the five KV-pool categories.
CATEGORY_LABELS: dict[str, str] = {key: label for key, label, _ in MEMORY_CATEGORIES}

#: Colours of blocks that no request owns. "free" and "external" reuse the memory categories'
#: colours, so the block map reads like the timeline.
BLOCK_STATE_COLOURS: dict[str, str] = {
    "free": CATEGORY_COLOURS["free"],
    "external": CATEGORY_COLOURS["external_fragmentation"],
    "cached": "#4d4d4d",
}
#: Qualitative palette cycled over a snapshot's owners (no greys or purples, which mean
#: free / external / cached blocks). A used block is drawn in its owner's colour when full,
#: 50% lighter when partly filled, 80% lighter when it holds no token yet (reserved).
OWNER_PALETTE: tuple[str, ...] = (
    "#1f77b4",
    "#44aa99",
    "#117733",
    "#999933",
    "#ddcc77",
    "#cc6677",
    "#882255",
    "#88ccee",
    "#8c564b",
    "#e377c2",
)
_SHADES = (0.0, 0.5, 0.8)  # mix with white: full, partly filled, empty (reserved)
_SHADE_NAMES = ("full", "partly filled", "empty (reserved)")
_STATE_CODES = {"free": 0, "external": 1, "cached": 2}
_STATE_TEXT = {
    "free": "free",
    "external": "free, external fragmentation (hole too small for the next waiting request)",
    "cached": "free, holds a prefix-cached block",
}
#: code of a grid cell past the last block (drawn transparent); the live widget uses it instead of
#: NaN, which a kernel cannot send as JSON
PAD_CODE = 3 + len(OWNER_PALETTE) * len(_SHADES)
_NUM_CODES = PAD_CODE + 1

#: Latency metrics of a request record (seconds), with their labels.
LATENCY_METRICS: dict[str, str] = {
    "ttft_s": "TTFT (time to first token)",
    "tpot_s": "TPOT (time per output token)",
    "itl_s": "ITL (inter-token latency, all gaps pooled)",
    "e2e_s": "end-to-end latency",
}

_UNITS: dict[str, float | None] = {"tokens": None, "bytes": 1.0, "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30}


def _get(rec: Any, key: str) -> Any:
    return rec[key] if isinstance(rec, Mapping) else getattr(rec, key)


def _as_dict(rec: Any) -> Mapping[str, Any]:
    if isinstance(rec, Mapping):
        return rec
    if hasattr(rec, "to_dict"):
        return rec.to_dict()
    raise TypeError(f"expected a dict or an object with to_dict(), got {type(rec).__name__}")


def _mix_white(colour: str, frac: float) -> str:
    """``colour`` (``#rrggbb``) mixed with white: ``frac=0`` unchanged, ``1`` white."""
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * frac) for c in (r, g, b))
    return f"#{r:02x}{g:02x}{b:02x}"


def _code_colours() -> list[str]:
    colours = [BLOCK_STATE_COLOURS["free"], BLOCK_STATE_COLOURS["external"], BLOCK_STATE_COLOURS["cached"]]
    for colour in OWNER_PALETTE:
        colours.extend(_mix_white(colour, f) for f in _SHADES)
    return colours


# --------------------------------------------------------------------------- #
# block map
# --------------------------------------------------------------------------- #


def block_map_colorscale() -> list[list[Any]]:
    """The discrete heatmap colour scale of :func:`block_map_cells`' codes (use with
    ``zmin=-0.5``, ``zmax=number of codes - 0.5``): 0 free, 1 external, 2 cached,
    ``3 + 3 * (owner % len(OWNER_PALETTE)) + shade`` for used blocks, shade 0 full, 1 partly
    filled, 2 empty (reserved); :data:`PAD_CODE` (the last) transparent."""
    colours = [*_code_colours(), "rgba(0,0,0,0)"]
    n = len(colours)
    scale: list[list[Any]] = []
    for k, c in enumerate(colours):
        scale.append([k / n, c])
        scale.append([(k + 1) / n, c])
    return scale


def _validate_snapshot(snap: Mapping[str, Any]) -> None:
    owner, filled, state = snap["owner"], snap["filled"], snap["state"]
    if not (len(owner) == len(filled) == len(state)):
        raise ValueError(
            f"block-map snapshot of step {snap.get('step')}: owner, filled and state must have one entry per "
            f"block, got {len(owner)}, {len(filled)}, {len(state)}"
        )
    n_owners = len(snap["owner_ids"])
    bs = int(snap["block_size"])
    for b, (o, f, st) in enumerate(zip(owner, filled, state)):
        if st not in _STATE_CODES and st != "used":
            raise ValueError(
                f"block-map snapshot of step {snap.get('step')}: block {b} has state {st!r}; "
                "expected 'free', 'external', 'cached' or 'used'"
            )
        if st == "used" and not 0 <= o < n_owners:
            raise ValueError(
                f"block-map snapshot of step {snap.get('step')}: used block {b} has owner {o}, "
                f"not an index into owner_ids (0..{n_owners - 1})"
            )
        if not 0 <= f <= bs:
            raise ValueError(
                f"block-map snapshot of step {snap.get('step')}: block {b} has filled={f}, outside 0..{bs}"
            )


def block_map_cells(snapshot: Mapping[str, Any], max_cols: int = 64) -> dict[str, Any]:
    """Lay one block-map snapshot out as a grid of colour codes and hover texts.

    Block ``b`` sits in row ``b // cols``, column ``b % cols`` with ``cols = min(max_cols,
    number of blocks)``; the last row is padded with ``None``.

    Args:
        snapshot: a block-map snapshot (see the module docstring).
        max_cols: blocks per grid row (>= 1).

    Returns:
        ``{"z": a rows × cols float array of codes (see :func:`block_map_colorscale`; NaN where
        the last row has no block), "text": an object array of hover texts,
        "x": column offsets, "y": first block id of each row, "counts": {"used", "full",
        "partly_filled", "empty", "free", "external", "cached", "blocks", "owners",
        "filled_slots"}, "title": a one-line summary}``.

    Raises:
        KeyError: the snapshot lacks a field.
        ValueError: ``max_cols < 1``, per-block lists of different lengths, an unknown state,
            a used block without a valid owner, or ``filled`` outside ``0..block_size``.
    """
    if max_cols < 1:
        raise ValueError(f"max_cols={max_cols} must be >= 1")
    _validate_snapshot(snapshot)
    owner, filled, state = snapshot["owner"], snapshot["filled"], snapshot["state"]
    owner_ids = snapshot["owner_ids"]
    bs = int(snapshot["block_size"])
    n = len(owner)
    cols = max(1, min(max_cols, n))
    rows = max(1, math.ceil(n / cols))
    z = np.full((rows, cols), np.nan)  # NaN: no block (padding of the last row), drawn blank
    text = np.full((rows, cols), "", dtype=object)
    counts = dict.fromkeys(("used", "full", "partly_filled", "empty", "free", "external", "cached"), 0)
    filled_slots = 0
    npal = len(OWNER_PALETTE)
    for b in range(n):
        r, c = divmod(b, cols)
        st = state[b]
        f = int(filled[b])
        if st == "used":
            o = int(owner[b])
            shade = 0 if f == bs else (1 if f > 0 else 2)
            counts["used"] += 1
            counts[("full", "partly_filled", "empty")[shade]] += 1
            filled_slots += f
            z[r, c] = 3 + 3 * (o % npal) + shade
            text[r, c] = f"block {b}: used by {owner_ids[o]}<br>{f}/{bs} slots filled ({_SHADE_NAMES[shade]})"
        else:
            counts[st] += 1
            z[r, c] = _STATE_CODES[st]
            text[r, c] = f"block {b}: {_STATE_TEXT[st]}"
    counts["blocks"] = n
    counts["owners"] = len(owner_ids)
    counts["filled_slots"] = filled_slots
    title = (
        f"KV block map, step {snapshot['step']} ({snapshot.get('allocator', '?')}): "
        f"{counts['used']}/{n} blocks used ({counts['partly_filled']} partly filled, {counts['empty']} empty), "
        f"{counts['external']} external, {counts['cached']} cached, {plural(len(owner_ids), 'request')}"
    )
    return {
        "z": z,
        "text": text,
        "x": list(range(cols)),
        "y": [r * cols for r in range(rows)],
        "counts": counts,
        "title": title,
    }


def _block_heatmap(cells: Mapping[str, Any], name: str) -> dict[str, Any]:
    # a plain dict (validated once, where it lands) with numpy arrays: fast for many blocks
    small = len(cells["x"]) <= 64 and len(cells["y"]) <= 64
    return {
        "type": "heatmap",
        "z": cells["z"],
        "x": cells["x"],
        "y": cells["y"],
        "text": cells["text"],
        "name": name,
        "hovertemplate": "%{text}<extra></extra>",
        "colorscale": block_map_colorscale(),
        "zmin": -0.5,
        "zmax": _NUM_CODES - 0.5,
        "showscale": False,
        "xgap": 1 if small else 0,
        "ygap": 1 if small else 0,
    }


def _block_legend_traces() -> list[go.Scatter]:
    """Empty marker traces that give the heatmap's colours a legend."""
    entries = [
        ("free", BLOCK_STATE_COLOURS["free"]),
        ("external fragmentation", BLOCK_STATE_COLOURS["external"]),
        ("cached (free)", BLOCK_STATE_COLOURS["cached"]),
    ]
    for name, frac in zip(_SHADE_NAMES, _SHADES):
        entries.append((f"used, {name}", _mix_white(OWNER_PALETTE[0], frac)))
    return [
        go.Scatter(
            x=[None],
            y=[None],
            mode="markers",
            name=name,
            marker={"symbol": "square", "size": 12, "color": colour, "line": {"width": 1, "color": "#888"}},
            hoverinfo="skip",
        )
        for name, colour in entries
    ]


def block_map_figure(
    snapshots: Sequence[Mapping[str, Any]] | Mapping[str, Any], max_cols: int = 64, active: int = 0
) -> go.Figure:
    """Physical KV blocks as a grid, one heatmap per snapshot, with a slider over steps.

    Each cell is one physical block (block ``b`` at row ``b // cols``, column ``b % cols``).
    Used blocks take their owner request's colour (:data:`OWNER_PALETTE`, cycled over the
    snapshot's ``owner_ids``): full, 50% lighter when partly filled (the rest of the block is
    internal fragmentation for paged, reservation for contiguous allocators), 80% lighter when
    it holds no token yet (reserved). Free blocks are grey, free blocks in holes too small for
    the next waiting request purple (external fragmentation), free blocks holding a
    prefix-cached block dark grey. Hover shows the block id, the owner's request id and the
    filled slots. A slider (plotly frames, one heatmap each) and a play button step through
    the snapshots; the title summarises the shown step. Thousands of blocks are fine: one
    heatmap trace per snapshot, no shapes.

    Args:
        snapshots: block-map snapshots (see the module docstring), in any order (sorted by
            ``step``); a single snapshot dict is accepted.
        max_cols: blocks per grid row.
        active: index (after sorting; negative counts from the end) of the snapshot shown first.

    Returns:
        A figure whose ``data[0]`` is the heatmap of the active snapshot (followed by six
        empty legend traces), one frame per snapshot named by its index, and one slider step
        per snapshot labelled with its engine step; a "no data" figure when there are none.

    Raises:
        KeyError, ValueError: a malformed snapshot (see :func:`block_map_cells`).
        IndexError: ``active`` out of range.
    """
    title = "KV block map"
    if isinstance(snapshots, Mapping):
        snapshots = [snapshots]
    if not snapshots:
        return _no_data_figure(title)
    snaps = sorted(snapshots, key=lambda s: int(s["step"]))
    cells = [block_map_cells(s, max_cols) for s in snaps]
    if not -len(snaps) <= active < len(snaps):
        raise IndexError(f"active={active} is out of range for {len(snaps)} snapshots")
    active %= len(snaps)
    heatmaps = [_block_heatmap(c, f"step {s['step']}") for c, s in zip(cells, snaps)]
    fig = go.Figure(data=[heatmaps[active], *_block_legend_traces()])
    fig.frames = [
        go.Frame(name=str(i), data=[h], traces=[0], layout={"title": {"text": c["title"]}})
        for i, (h, c) in enumerate(zip(heatmaps, cells))
    ]
    anim = {"mode": "immediate", "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}
    slider_steps = [
        {"label": str(s["step"]), "method": "animate", "args": [[str(i)], anim]} for i, s in enumerate(snaps)
    ]
    rows = max(len(c["y"]) for c in cells)
    cols = max(len(c["x"]) for c in cells)
    fig.update_layout(
        title={"text": cells[active]["title"], "font": {"size": 14}},
        height=int(min(900, max(320, 170 + rows * max(6.0, 900 / cols)))),
        sliders=[
            {
                "active": active,
                "currentvalue": {"prefix": "engine step "},
                "x": 0.1,
                "len": 0.9,
                "y": 0,
                "pad": {"t": 50},
                "steps": slider_steps,
            }
        ],
        updatemenus=[
            {
                "type": "buttons",
                "direction": "left",
                "x": 0.1,
                "y": 0,
                "xanchor": "right",
                "yanchor": "top",
                "pad": {"t": 60, "r": 10},
                "buttons": [
                    {
                        "label": "▶",
                        "method": "animate",
                        "args": [None, {"frame": {"duration": 400, "redraw": True}, "fromcurrent": True}],
                    },
                    {"label": "❚❚", "method": "animate", "args": [[None], anim]},
                ],
            }
        ],
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
        plot_bgcolor="white",
        margin={"t": 110},
    )
    fig.update_xaxes(title_text=f"block id − row start (0..{cols - 1})", showgrid=False, zeroline=False)
    fig.update_yaxes(row_start_axis(cells[active]["y"]), autorange="reversed", showgrid=False, zeroline=False)
    return fig


def row_start_axis(row_starts: Sequence[int]) -> dict[str, Any]:
    """The block map's y axis: one tick per grid row, labelled with its first block id (at most
    about 12 labels), never −0.5 / 0 / 0.5 for a single row."""
    every = max(1, math.ceil(len(row_starts) / 12))
    ticks = list(row_starts[::every])
    return {
        "title": {"text": "row start (block id)"},
        "tickmode": "array",
        "tickvals": ticks,
        "ticktext": [f"{t:,}" for t in ticks],
    }


# --------------------------------------------------------------------------- #
# memory timeline
# --------------------------------------------------------------------------- #


#: Height (px) of :func:`memory_timeline_figure`. Its plot area (height less the margins of
#: :func:`title_and_legend_above`) must stay taller than the right axis' title, "utilization,
#: fragmentation rate" (about 230 px at plotly's 14 px font), or that title runs past the plot into
#: the legend and the tick labels.
TIMELINE_HEIGHT = 510


def memory_timeline_figure(
    steps: Sequence[Any], unit: str = "MiB", x: str = "step", show_utilization: bool = True
) -> go.Figure:
    """Stacked areas of the five KV-pool categories over the run (docs/architecture.md §3).

    Bottom to top: token states, reservation, internal fragmentation, external fragmentation,
    free; at every step the stack's top is the pool (``num_blocks * block_size`` slots, or that
    times ``kv_bytes_per_token`` in bytes). On a right axis (0..100%), a line of KV utilization
    (token states / pool, so it runs along the top of the token-states area while the pool is
    constant) and, hidden until clicked in the legend, the fragmentation rate ((reservation +
    internal + external) / (pool - free)).

    Args:
        steps: step records (``StepStats`` or dicts), any order (sorted by ``step``).
        unit: ``"tokens"`` (token slots), ``"bytes"``, ``"KiB"``, ``"MiB"`` or ``"GiB"``
            (powers of 2; slots × ``kv_bytes_per_token``).
        x: ``"step"`` (engine step index) or ``"time"`` (``time_s``, seconds since the engine
            started).
        show_utilization: draw the right-axis lines.

    Returns:
        A figure with five stacked ``Scatter`` traces (named by the categories' labels) and,
        when ``show_utilization``, ``KV utilization`` and ``fragmentation rate`` lines on
        ``y2``; a "no data" figure when ``steps`` is empty.

    Raises:
        ValueError: an unknown ``unit`` or ``x``.
        KeyError / AttributeError: a step record lacks a field.
    """
    if unit not in _UNITS:
        raise ValueError(f"unit={unit!r}; expected one of {sorted(_UNITS)}")
    if x not in ("step", "time"):
        raise ValueError(f"x={x!r}; expected 'step' or 'time'")
    title = "KV pool over the run"
    if not steps:
        return _no_data_figure(title)
    rows = sorted(steps, key=lambda s: int(_get(s, "step")))
    xs = [int(_get(s, "step")) for s in rows] if x == "step" else [float(_get(s, "time_s")) for s in rows]
    div = _UNITS[unit]
    scale = [1.0 if div is None else float(_get(s, "kv_bytes_per_token")) / div for s in rows]
    pools = [int(_get(s, "num_blocks")) * int(_get(s, "block_size")) for s in rows]
    fmt = ",.0f" if unit in ("tokens", "bytes") else ",.3f"
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for key, label, colour in MEMORY_CATEGORIES:
        slots = [int(_get(s, key)) for s in rows]
        share = [v / p if p else 0.0 for v, p in zip(slots, pools)]
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[v * k for v, k in zip(slots, scale)],
                name=label,
                mode="lines",
                stackgroup="kv",
                line={"width": 0.5, "color": colour},
                fillcolor=colour,
                customdata=list(zip(slots, share)),
                hovertemplate=(
                    f"{label}: %{{y:{fmt}}} {unit} (%{{customdata[0]:,}} slots, "
                    "%{customdata[1]:.1%} of the pool)<extra></extra>"
                ),
            ),
            secondary_y=False,
        )
    if show_utilization:
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[float(_get(s, "kv_utilization")) for s in rows],
                name="KV utilization",
                mode="lines",
                line={"color": "black", "width": 1.5},
                hovertemplate="KV utilization: %{y:.1%}<extra></extra>",
            ),
            secondary_y=True,
        )
        fig.add_trace(
            go.Scatter(
                x=xs,
                y=[float(_get(s, "fragmentation_rate")) for s in rows],
                name="fragmentation rate",
                mode="lines",
                visible="legendonly",
                line={"color": "black", "width": 1, "dash": "dot"},
                hovertemplate="fragmentation rate: %{y:.1%}<extra></extra>",
            ),
            secondary_y=True,
        )
        fig.update_yaxes(
            percent_axis(title="utilization, fragmentation rate"), showgrid=False, automargin=True, secondary_y=True
        )
    top = max(p * k for p, k in zip(pools, scale))
    if unit in ("tokens", "bytes"):
        fig.update_yaxes(count_axis(top), secondary_y=False)
    if top > 0:
        fig.update_yaxes(range=[0, top], secondary_y=False)
    fig.update_yaxes(
        title_text=f"KV pool ({'token slots' if unit == 'tokens' else unit})", automargin=True, secondary_y=False
    )
    fig.update_xaxes(title_text="engine step" if x == "step" else "time since engine start (s)")
    fig.update_layout(hovermode="x unified", **title_and_legend_above(title, TIMELINE_HEIGHT))
    return fig


# --------------------------------------------------------------------------- #
# waste bars
# --------------------------------------------------------------------------- #


def _breakdown_of(run: Any) -> Mapping[str, Any]:
    if isinstance(run, Mapping) and "pool_share" in run and "used_share" in run:
        return run
    if isinstance(run, Mapping):
        raise TypeError("a run must be a waste_breakdown() dict or a sequence of step records, got another dict")
    return waste_breakdown(run)


def waste_bars_figure(runs: Mapping[str, Any], basis: str = "both") -> go.Figure:
    """One 100%-stacked bar per run label: where its KV memory went, on average.

    ``basis="pool"``: the run-mean share of the KV pool of each of the five categories
    (``waste_breakdown(...)["pool_share"]``; sums to 1). ``basis="used"``: the share of
    *occupied* memory (pool - free) of token states, reservation, internal and external
    fragmentation (``["used_share"]``, occupancy-weighted; sums to 1), as in the vLLM paper
    (Kwon et al., SOSP 2023, Fig. 2). ``"both"``: the two side by side. Hover adds the mean
    slots and MiB of the category, and the run's mean KV utilization, fragmentation rate and
    running requests.

    Args:
        runs: ``{label: summary}``, where a summary is the dict returned by
            :func:`workbench.metrics.waste.waste_breakdown` or the run's step records (from
            which it is computed). Labels are e.g. allocator or batching-policy names; bars
            keep the mapping's order.
        basis: ``"pool"``, ``"used"`` or ``"both"``.

    Returns:
        A figure with one stacked ``Bar`` trace per (panel, category), ``x`` = labels, ``y`` =
        shares (0..1, axis formatted in %); a "no data" figure when ``runs`` is empty.

    Raises:
        ValueError: an unknown ``basis``, or inconsistent step records (see
            :func:`waste_breakdown`).
        TypeError: a summary that is neither a breakdown dict nor a sequence of steps.
    """
    if basis not in ("pool", "used", "both"):
        raise ValueError(f"basis={basis!r}; expected 'pool', 'used' or 'both'")
    title = "Where the KV memory went (run means)"
    if not runs:
        return _no_data_figure(title)
    labels = [str(k) for k in runs]
    bds = [_breakdown_of(v) for v in runs.values()]
    panels = []
    if basis in ("pool", "both"):
        panels.append(("pool_share", [k for k, _, _ in MEMORY_CATEGORIES], "share of the KV pool"))
    if basis in ("used", "both"):
        panels.append(("used_share", list(USED_CATEGORIES), "share of occupied memory (pool − free)"))
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[p[2] for p in panels], shared_yaxes=True)
    shown: set[str] = set()
    for col, (share_key, cats, _) in enumerate(panels, start=1):
        for cat in cats:
            ys = [float(bd[share_key][cat]) for bd in bds]
            custom = [
                [
                    float(bd["slots_mean"][cat]),
                    float(bd["bytes_mean"][cat]) / 2**20,
                    float(bd["kv_utilization_mean"]),
                    float(bd["fragmentation_rate_mean"]),
                    float(bd["num_running_mean"]),
                    int(bd["num_steps"]),
                ]
                for bd in bds
            ]
            fig.add_trace(
                go.Bar(
                    x=labels,
                    y=ys,
                    name=CATEGORY_LABELS[cat],
                    legendgroup=cat,
                    showlegend=cat not in shown,
                    marker={"color": CATEGORY_COLOURS[cat]},
                    text=[f"{v:.0%}" if v >= 0.04 else "" for v in ys],
                    textposition="inside",
                    customdata=custom,
                    hovertemplate=(
                        f"%{{x}}: {CATEGORY_LABELS[cat]} %{{y:.1%}}<br>"
                        "mean %{customdata[0]:,.1f} slots = %{customdata[1]:,.2f} MiB<br>"
                        "KV utilization %{customdata[2]:.1%}, fragmentation rate %{customdata[3]:.1%}, "
                        "%{customdata[4]:.1f} running (%{customdata[5]} steps)<extra></extra>"
                    ),
                ),
                row=1,
                col=col,
            )
            shown.add(cat)
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    fig.update_yaxes(title_text="share (run mean)", row=1, col=1)
    fig.update_layout(
        title={"text": title},
        barmode="stack",
        height=450,
        legend={"traceorder": "normal"},
    )
    return fig


# --------------------------------------------------------------------------- #
# latency CDFs
# --------------------------------------------------------------------------- #

_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")


def latency_cdf_figure(
    runs: Mapping[str, Sequence[Any]] | Sequence[Any],
    metric: str | Sequence[str] = "ttft_s",
    log_x: bool = False,
) -> go.Figure:
    """Empirical CDFs of request latencies, one line per run, in milliseconds.

    For each run and metric the values of the non-error requests (``error`` set or
    ``finish_reason == "error"`` are skipped, as are missing / non-finite values) are sorted;
    the k-th smallest of n is drawn at ``y = k / n`` (a step function ending at 1). ITL pools
    every gap of every request. Metric definitions: :mod:`workbench.metrics.stats` (after
    vLLM's ``benchmark_serving.py``).

    Args:
        runs: ``{label: request records}`` (dicts or ``RequestRecord``), or one run's list of
            records (labelled ``"run"``).
        metric: one of ``"ttft_s"``, ``"tpot_s"``, ``"itl_s"``, ``"e2e_s"``; a list of them, or
            ``"all"``, adds a dropdown that switches between the metrics.
        log_x: logarithmic x axis.

    Returns:
        A figure with one ``Scatter`` per (metric, run), in metric-major order; only the first
        metric's traces are visible at first. A run without values for a metric gets an empty
        trace named "... (no data)". A "no data" figure when there are no runs.

    Raises:
        ValueError: an unknown metric.
        TypeError: a request record that is neither a dict nor has ``to_dict()``.
    """
    metrics = list(LATENCY_METRICS) if metric == "all" else ([metric] if isinstance(metric, str) else list(metric))
    bad = [m for m in metrics if m not in LATENCY_METRICS]
    if bad or not metrics:
        raise ValueError(f"metric={metric!r}; expected one of {list(LATENCY_METRICS)}, a list of them, or 'all'")
    title = "Request latency CDFs"
    if not isinstance(runs, Mapping):
        runs = {"run": runs}
    if not runs:
        return _no_data_figure(title)
    values = {
        label: _latency_values([_as_dict(r) for r in reqs])
        for label, reqs in runs.items()  # skips error requests
    }
    fig = go.Figure()
    for mi, m in enumerate(metrics):
        short = m[:-2]
        for ri, label in enumerate(runs):
            vals = sorted(v * 1e3 for v in values[label][short])
            n = len(vals)
            if n:
                name = f"{label} (n={n}, median {_percentile(vals, 50):.1f} ms)"
            else:
                name = f"{label} (no data)"
            fig.add_trace(
                go.Scatter(
                    x=vals,
                    y=[(k + 1) / n for k in range(n)],
                    name=name,
                    legendgroup=str(label),
                    mode="lines",
                    line={"shape": "hv", "color": _PALETTE[ri % len(_PALETTE)]},
                    visible=mi == 0,
                    hovertemplate=(f"{label}<br>{short.upper()} %{{x:.2f}} ms<br>P(X ≤ x) = %{{y:.1%}}<extra></extra>"),
                )
            )
    nr = len(runs)

    def axis_title(m: str) -> str:
        return f"{LATENCY_METRICS[m]} (ms)"

    layout: dict[str, Any] = {
        "title": {"text": title},
        "height": 450,
        "xaxis": {"title": {"text": axis_title(metrics[0])}, "type": "log" if log_x else "linear"},
        "yaxis": percent_axis(0, 1.02, title="requests at or under x (%)") | {"dtick": 0.25},
    }
    if len(metrics) > 1:
        layout["updatemenus"] = [
            {
                "type": "dropdown",
                "x": 1.0,
                "y": 1.15,
                "xanchor": "right",
                "buttons": [
                    {
                        "label": m[:-2].upper(),
                        "method": "update",
                        "args": [
                            {"visible": [j // nr == mi for j in range(len(metrics) * nr)]},
                            {"xaxis.title.text": axis_title(m)},
                        ],
                    }
                    for mi, m in enumerate(metrics)
                ],
            }
        ]
    fig.update_layout(**layout)
    return fig
