"""Self-contained HTML report of one engine run, built with plotly.

The inputs are plain dicts as read back from the engine's JSONL logs, so this
module deliberately does not import the engine:

* a *step record* (one per engine step) carries timings in seconds, batch
  composition counts, and the KV-pool accounting in token slots
  (``token_states``, ``reservation``, ``internal_fragmentation``,
  ``external_fragmentation``, ``free``; they sum to ``num_blocks * block_size``);
* a *request record* carries per-request token counts, the finish reason, and
  latencies in seconds (``ttft_s``, ``tpot_s``, ``e2e_s``, ``itl_s``...).

Public API:

* :func:`kv_blocks_figure`, :func:`batch_composition_figure`,
  :func:`latency_figure`, :func:`step_time_figure` build ``plotly`` figures;
* :func:`summary_table` reduces a run to a flat ``dict`` of numbers;
* :func:`write_report` writes everything into one HTML file with plotly.js
  inlined exactly once.

Empty inputs never raise: figures get a "no data" annotation and the summary
holds zeros (counts, means, throughput) or ``None`` (percentiles).
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.viz.budget import budget_figure, budget_section_html
from workbench.viz.common import (
    _NO_DATA,
    MEMORY_CATEGORIES,
    _is_error,
    _latency_values,
    _no_data_figure,
    _percentile,
    count_axis,
    title_and_legend_above,
)
from workbench.viz.figures import block_map_figure, memory_timeline_figure, waste_bars_figure

__all__ = [
    "MEMORY_CATEGORIES",
    "batch_composition_figure",
    "format_value",
    "kv_blocks_figure",
    "latency_figure",
    "step_time_figure",
    "summary_label",
    "summary_table",
    "write_report",
]

_MIB = float(2**20)

# --------------------------------------------------------------------------- #
# helpers
# --------------------------------------------------------------------------- #


def _sorted_steps(steps: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return sorted(steps, key=lambda s: s["step"])


def _mean(values: Sequence[float]) -> float:
    """Arithmetic mean, ``0.0`` for an empty sequence."""
    return float(sum(values) / len(values)) if values else 0.0


# --------------------------------------------------------------------------- #
# figures
# --------------------------------------------------------------------------- #


def kv_blocks_figure(steps: Sequence[Mapping[str, Any]]) -> go.Figure:
    """KV-pool occupancy over engine steps.

    Stacked areas (left y axis, MiB) of the five memory categories -- token
    states, reservation, internal fragmentation, external fragmentation and
    free -- each converted from token slots to bytes with the step's
    ``kv_bytes_per_token`` and then to MiB (2**20 bytes). A line of
    ``blocks_used`` (in blocks) is drawn on the right y axis; when the pool size
    is constant both axes are scaled so the line tracks the used/free boundary,
    and the right axis ticks at round block counts (:func:`count_axis`). The
    legend sits above the plot, clear of the right axis.
    The x axis is the step index; ``time_s`` (seconds since engine start) is in
    the hover text.

    Args:
        steps: step records (dicts); order does not matter, they are sorted by
            ``step``.

    Returns:
        A ``plotly.graph_objects.Figure`` with five stacked ``Scatter`` traces
        and one ``blocks used`` line, or an empty figure annotated "no data"
        when ``steps`` is empty.

    Raises:
        KeyError: if a step record lacks one of the keys used here.
        TypeError, ValueError: if a value is not numeric.
    """
    title = "KV cache memory over time"
    if not steps:
        return _no_data_figure(title)
    rows = _sorted_steps(steps)
    x = [int(s["step"]) for s in rows]
    t = [float(s["time_s"]) for s in rows]
    bpt = [float(s["kv_bytes_per_token"]) for s in rows]

    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for key, label, colour in MEMORY_CATEGORIES:
        mib = [float(s[key]) * b / _MIB for s, b in zip(rows, bpt, strict=True)]
        slots = [int(s[key]) for s in rows]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=mib,
                name=label,
                mode="lines",
                stackgroup="kv",
                line={"width": 0.5, "color": colour},
                customdata=list(zip(t, slots, strict=True)),
                hovertemplate=(
                    f"{label}<br>step %{{x}} (t=%{{customdata[0]:.3f}} s)"
                    "<br>%{y:.3f} MiB (%{customdata[1]} token slots)<extra></extra>"
                ),
            ),
            secondary_y=False,
        )
    blocks_used = [int(s["blocks_used"]) for s in rows]
    num_blocks = [int(s["num_blocks"]) for s in rows]
    fig.add_trace(
        go.Scatter(
            x=x,
            y=blocks_used,
            name="blocks used",
            mode="lines",
            line={"color": "black", "width": 1.5, "dash": "dot"},
            customdata=list(zip(t, num_blocks, strict=True)),
            hovertemplate=(
                "blocks used<br>step %{x} (t=%{customdata[0]:.3f} s)<br>%{y} / %{customdata[1]} blocks<extra></extra>"
            ),
        ),
        secondary_y=True,
    )
    pool_mib = [int(s["num_blocks"]) * int(s["block_size"]) * b / _MIB for s, b in zip(rows, bpt, strict=True)]
    max_blocks = max(num_blocks)
    fig.update_yaxes(count_axis(max(max_blocks, max(blocks_used))), secondary_y=True)
    if max_blocks > 0 and max(pool_mib) > 0:
        # Same relative scale on both axes: the line sits on the used/free edge.
        fig.update_yaxes(range=[0, max(pool_mib)], secondary_y=False)
        fig.update_yaxes(range=[0, max_blocks], secondary_y=True)
    fig.update_layout(hovermode="x unified", **title_and_legend_above(title, 480))
    fig.update_xaxes(title_text="engine step")
    fig.update_yaxes(title_text="KV memory (MiB)", secondary_y=False)
    fig.update_yaxes(title_text="KV blocks used", secondary_y=True, showgrid=False)
    return fig


def batch_composition_figure(steps: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Per-step batch composition.

    Stacked bars (left y axis, tokens) of ``num_prefill_tokens`` and
    ``num_decode_tokens``; lines (right y axis, requests) of ``num_running`` and
    ``num_waiting``; ``x`` markers on the right axis at steps where preemptions
    happened (y = preemptions in that step). x is the step index, ``time_s``
    (seconds) is in the hover text.

    Args:
        steps: step records (dicts); sorted by ``step`` internally.

    Returns:
        A figure with traces ``prefill tokens``, ``decode tokens`` (bars),
        ``running``, ``waiting`` (lines) and ``preemptions`` (markers; empty when
        no step preempted), or a "no data" figure when ``steps`` is empty. Both
        axes are counts: whole, round ticks (:func:`count_axis`); the legend is
        above the plot.

    Raises:
        KeyError: if a step record lacks one of the keys used here.
        TypeError, ValueError: if a value is not numeric.
    """
    title = "Batch composition per step"
    if not steps:
        return _no_data_figure(title)
    rows = _sorted_steps(steps)
    x = [int(s["step"]) for s in rows]
    t = [float(s["time_s"]) for s in rows]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for key, label, colour in (
        ("num_prefill_tokens", "prefill tokens", "#1f77b4"),
        ("num_decode_tokens", "decode tokens", "#aec7e8"),
    ):
        fig.add_trace(
            go.Bar(
                x=x,
                y=[int(s[key]) for s in rows],
                name=label,
                marker={"color": colour},
                customdata=t,
                hovertemplate=(f"{label}: %{{y}}<br>step %{{x}} (t=%{{customdata:.3f}} s)<extra></extra>"),
            ),
            secondary_y=False,
        )
    for key, label, colour in (
        ("num_running", "running", "#2ca02c"),
        ("num_waiting", "waiting", "#ff7f0e"),
    ):
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[int(s[key]) for s in rows],
                name=label,
                mode="lines",
                line={"color": colour, "shape": "hv"},
                hovertemplate=f"{label} requests: %{{y}}<extra></extra>",
            ),
            secondary_y=True,
        )
    pre = [(xi, ti, int(s["num_preemptions"])) for xi, ti, s in zip(x, t, rows, strict=True)]
    pre = [p for p in pre if p[2] > 0]
    fig.add_trace(
        go.Scatter(
            x=[p[0] for p in pre],
            y=[p[2] for p in pre],
            customdata=[p[1] for p in pre],
            name="preemptions",
            mode="markers",
            marker={"symbol": "x", "size": 9, "color": "#d62728"},
            hovertemplate=("preemptions: %{y}<br>step %{x} (t=%{customdata:.3f} s)<extra></extra>"),
        ),
        secondary_y=True,
    )
    fig.update_layout(barmode="stack", bargap=0.1, **title_and_legend_above(title, 480))
    fig.update_xaxes(title_text="engine step")
    top_tokens = max(int(s["num_prefill_tokens"]) + int(s["num_decode_tokens"]) for s in rows)
    fig.update_yaxes(count_axis(top_tokens, "tokens in batch (tokens)"), secondary_y=False)
    top_requests = max(max(int(s["num_running"]), int(s["num_waiting"]), int(s["num_preemptions"])) for s in rows)
    fig.update_yaxes(count_axis(top_requests, "requests (count) / preemptions"), secondary_y=True, showgrid=False)
    return fig


_LATENCY_PANELS = (
    ("ttft", "TTFT"),
    ("tpot", "TPOT"),
    ("itl", "ITL"),
    ("e2e", "end-to-end latency"),
)


def latency_figure(requests: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Empirical CDFs of request latencies, in milliseconds, on a 2x2 grid.

    Panels: TTFT (time to first token), TPOT (time per output token), ITL
    (inter-token latency, all gaps of all requests pooled) and end-to-end
    latency. Requests with an error (``error`` not ``None`` or
    ``finish_reason == "error"``) are skipped, as are ``None`` or non-finite
    values. Each panel with data holds one step-shaped ``Scatter`` trace named
    after the metric; a panel without values is annotated "no data".

    Args:
        requests: request records (dicts); latencies are read in seconds.

    Returns:
        A ``plotly.graph_objects.Figure`` (a "no data" figure when ``requests``
        is empty).

    Raises:
        TypeError: if ``itl_s`` is neither ``None`` nor iterable. Missing or
            non-numeric latency values are skipped, never raised on.
    """
    title = "Request latency CDFs"
    if not requests:
        return _no_data_figure(title)
    values = _latency_values(requests)
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=[f"{label} (ms)" for _, label in _LATENCY_PANELS],
        horizontal_spacing=0.1,
        vertical_spacing=0.15,
    )
    for i, (key, label) in enumerate(_LATENCY_PANELS):
        row, col = divmod(i, 2)
        row, col = row + 1, col + 1
        vals = sorted(v * 1e3 for v in values[key])
        if vals:
            n = len(vals)
            fig.add_trace(
                go.Scatter(
                    x=vals,
                    y=[(k + 1) / n for k in range(n)],
                    name=label,
                    mode="lines",
                    line={"shape": "hv"},
                    hovertemplate=(f"{label}: %{{x:.2f}} ms<br>P(X ≤ x) = %{{y:.3f}}<extra></extra>"),
                ),
                row=row,
                col=col,
            )
        else:
            axis = "" if i == 0 else str(i + 1)
            fig.add_annotation(
                text=_NO_DATA,
                xref=f"x{axis} domain",
                yref=f"y{axis} domain",
                x=0.5,
                y=0.5,
                showarrow=False,
            )
        fig.update_xaxes(title_text=f"{label} (ms)", row=row, col=col)
        fig.update_yaxes(title_text="fraction of requests", range=[0, 1.02], row=row, col=col)
    fig.update_layout(title={"text": title}, height=650, showlegend=False)
    return fig


def step_time_figure(steps: Sequence[Mapping[str, Any]]) -> go.Figure:
    """Per-step time breakdown in milliseconds.

    Stacked bars of ``schedule_time_s``, ``model_time_s`` and ``sample_time_s``
    (converted to ms) per step, plus a ``wall`` line of ``wall_time_s`` so the
    unaccounted overhead is visible. x is the step index, ``time_s`` in hover.

    Args:
        steps: step records (dicts); sorted by ``step`` internally.

    Returns:
        A figure with traces ``schedule``, ``model``, ``sample`` (bars) and
        ``wall`` (line), or a "no data" figure when ``steps`` is empty.

    Raises:
        KeyError: if a step record lacks one of the keys used here.
        TypeError, ValueError: if a value is not numeric.
    """
    title = "Step time breakdown"
    if not steps:
        return _no_data_figure(title)
    rows = _sorted_steps(steps)
    x = [int(s["step"]) for s in rows]
    t = [float(s["time_s"]) for s in rows]
    fig = go.Figure()
    for key, label, colour in (
        ("schedule_time_s", "schedule", "#8c564b"),
        ("model_time_s", "model", "#1f77b4"),
        ("sample_time_s", "sample", "#17becf"),
    ):
        fig.add_trace(
            go.Bar(
                x=x,
                y=[float(s[key]) * 1e3 for s in rows],
                name=label,
                marker={"color": colour},
                customdata=t,
                hovertemplate=(f"{label}: %{{y:.3f}} ms<br>step %{{x}} (t=%{{customdata:.3f}} s)<extra></extra>"),
            )
        )
    fig.add_trace(
        go.Scatter(
            x=x,
            y=[float(s["wall_time_s"]) * 1e3 for s in rows],
            name="wall",
            mode="lines",
            line={"color": "black", "width": 1},
            hovertemplate="wall: %{y:.3f} ms<extra></extra>",
        )
    )
    fig.update_layout(
        title={"text": title},
        barmode="stack",
        bargap=0.1,
        height=400,
        xaxis={"title": {"text": "engine step"}},
        yaxis={"title": {"text": "time per step (ms)"}},
    )
    return fig


# --------------------------------------------------------------------------- #
# summary
# --------------------------------------------------------------------------- #


def summary_table(
    steps: Sequence[Mapping[str, Any]],
    requests: Sequence[Mapping[str, Any]],
    wall_time_s: float,
) -> dict[str, float | int | None]:
    """Reduce one run to a flat dict of numbers (units in the key names).

    Keys (in order):

    * ``requests_total``, ``requests_finished`` (``finish_reason`` "stop" or
      "length" without error), ``requests_errored`` (``error`` set or
      ``finish_reason == "error"``), ``requests_aborted`` (the rest with
      ``finish_reason == "abort"``) -- counts;
    * ``prompt_tokens_total``, ``output_tokens_total`` -- summed over the
      requests that ran (refused ones excluded: their prompts were never processed) (tokens);
    * ``wall_time_s`` -- as given (s);
    * ``output_throughput_tok_s`` = output tokens / wall time and
      ``total_throughput_tok_s`` = (prompt + output tokens) / wall time
      (tokens/s; ``0.0`` when ``wall_time_s`` is 0);
    * ``ttft_p50_s``, ``ttft_p99_s``, ``tpot_p50_s``, ``tpot_p99_s``,
      ``itl_p50_s``, ``itl_p99_s`` (all inter-token gaps pooled),
      ``e2e_p50_s``, ``e2e_p99_s`` -- ``numpy.percentile`` with the default
      linear method over non-error requests, ``None`` values skipped (s;
      ``None`` when there are no values);
    * ``num_steps`` -- count;
    * ``kv_utilization_mean_frac`` -- mean of ``kv_utilization`` over steps,
      each step weighted equally (0..1);
    * ``blocks_used_peak`` -- max ``blocks_used`` (blocks);
    * ``preemptions_total`` -- sum of per-step ``num_preemptions``;
    * ``fragmentation_rate_mean_frac`` -- mean ``fragmentation_rate`` over
      steps (0..1);
    * ``running_reqs_mean`` -- mean ``num_running`` over steps (requests still running after each step);
    * ``batched_reqs_mean`` -- mean requests scheduled in a step (``num_prefill_reqs + num_decode_reqs``);
    * only when KV compaction ran: ``defrag_passes``, ``defrag_blocks_moved``, ``defrag_bytes_moved`` (sums),
      ``defrag_copy_time_s`` (``copy_time_s`` of the steps with a pass: every block copy of those steps, s),
      ``defrag_unblocked_reqs`` (requests admitted in the step after a pass that no free run held before it).

    Means over zero steps are ``0.0``; nothing divides by zero.

    Args:
        steps: step records.
        requests: request records.
        wall_time_s: wall-clock duration of the run in seconds (>= 0).

    Returns:
        The summary dict (ints for counts, floats or ``None`` otherwise).

    Raises:
        ValueError: if ``wall_time_s`` is negative or not finite.
        KeyError: if a step record lacks ``kv_utilization``, ``blocks_used``,
            ``num_preemptions``, ``fragmentation_rate`` or ``num_running``.
    """
    wall = float(wall_time_s)
    if not math.isfinite(wall) or wall < 0:
        raise ValueError(f"wall_time_s must be finite and >= 0, got {wall_time_s!r}")

    n_err = sum(1 for r in requests if _is_error(r))
    n_fin = sum(1 for r in requests if not _is_error(r) and r.get("finish_reason") in ("stop", "length"))
    n_abort = sum(1 for r in requests if not _is_error(r) and r.get("finish_reason") == "abort")
    ran = [r for r in requests if not _is_error(r)]
    prompt_tokens = int(sum(int(r.get("prompt_tokens") or 0) for r in ran))
    output_tokens = int(sum(int(r.get("output_tokens") or 0) for r in ran))

    lat = _latency_values(requests)
    out: dict[str, float | int | None] = {
        "requests_total": len(requests),
        "requests_finished": n_fin,
        "requests_errored": n_err,
        "requests_aborted": n_abort,
        "prompt_tokens_total": prompt_tokens,
        "output_tokens_total": output_tokens,
        "wall_time_s": wall,
        "output_throughput_tok_s": output_tokens / wall if wall > 0 else 0.0,
        "total_throughput_tok_s": (prompt_tokens + output_tokens) / wall if wall > 0 else 0.0,
    }
    for name in ("ttft", "tpot", "itl", "e2e"):
        out[f"{name}_p50_s"] = _percentile(lat[name], 50)
        out[f"{name}_p99_s"] = _percentile(lat[name], 99)
    out["num_steps"] = len(steps)
    out["kv_utilization_mean_frac"] = _mean([float(s["kv_utilization"]) for s in steps])
    out["blocks_used_peak"] = max((int(s["blocks_used"]) for s in steps), default=0)
    out["preemptions_total"] = int(sum(int(s["num_preemptions"]) for s in steps))
    out["fragmentation_rate_mean_frac"] = _mean([float(s["fragmentation_rate"]) for s in steps])
    out["running_reqs_mean"] = _mean([float(s["num_running"]) for s in steps])
    out["batched_reqs_mean"] = _mean([float(s.get("num_prefill_reqs", 0) + s.get("num_decode_reqs", 0)) for s in steps])
    moved = [s for s in steps if s.get("defrag_passes")]
    if moved:  # KV compaction ran (workbench.kv.defrag); copy time: all copies of those steps
        out["defrag_passes"] = int(sum(s["defrag_passes"] for s in moved))
        out["defrag_blocks_moved"] = int(sum(s["defrag_blocks_moved"] for s in moved))
        out["defrag_bytes_moved"] = int(sum(s["defrag_bytes_moved"] for s in moved))
        out["defrag_copy_time_s"] = float(sum(s.get("copy_time_s", 0.0) for s in moved))
        out["defrag_unblocked_reqs"] = int(sum(s.get("defrag_unblocked", 0) for s in steps))
    return out


# --------------------------------------------------------------------------- #
# HTML report
# --------------------------------------------------------------------------- #


def format_value(value: Any) -> str:
    """Human-readable (unescaped) text for a table cell.

    ``None`` -> ``"n/a"``; bools and ints as is (ints with thousands
    separators); floats: ``0``, ``1,234.5`` (>= 1000), ``12.346`` (>= 1),
    4 significant digits below 1 (``0.01235``); NaN/inf via ``str``; dicts and
    lists as compact JSON; anything else via ``str``. Never raises.
    """
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | np.integer):
        return f"{int(value):,}"
    if isinstance(value, float | np.floating):
        v = float(value)
        if not math.isfinite(v):
            return str(v)
        if v == 0:
            return "0"
        if abs(v) >= 1000:
            return f"{v:,.1f}"
        if abs(v) >= 1:
            return f"{v:.3f}"
        return f"{v:.4g}"
    if isinstance(value, Mapping | list | tuple):
        try:
            return json.dumps(value, default=str, sort_keys=False)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def _kv_table(data: Mapping[str, Any], caption: str, css_class: str) -> str:
    rows = "\n".join(
        f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(format_value(v))}</td></tr>" for k, v in data.items()
    )
    if not rows:
        rows = '<tr><td colspan="2"><em>empty</em></td></tr>'
    return (
        f'<table class="{css_class}"><caption>{html.escape(caption)}</caption>\n'
        f"<thead><tr><th>key</th><th>value</th></tr></thead>\n<tbody>\n{rows}\n</tbody></table>"
    )


#: Readable names (with units) of the summary's keys, in the words of the course and ``workbench run``'s
#: table; ``summary.json`` keeps the keys. Waste shares are named by :func:`summary_label`.
SUMMARY_LABELS: dict[str, str] = {
    "requests_total": "requests",
    "requests_finished": "requests finished",
    "requests_errored": "requests refused (errors)",
    "requests_aborted": "requests aborted",
    "prompt_tokens_total": "prompt tokens",
    "output_tokens_total": "output tokens",
    "wall_time_s": "wall time (s)",
    "output_throughput_tok_s": "output throughput (tok/s)",
    "total_throughput_tok_s": "total throughput (tok/s)",
    "num_steps": "engine steps",
    "kv_utilization_mean_frac": "KV utilization (mean over steps)",
    "blocks_used_peak": "KV blocks used (peak)",
    "preemptions_total": "preemptions",
    "fragmentation_rate_mean_frac": "fragmentation rate (mean over steps)",
    "running_reqs_mean": "requests running (mean per step)",
    "batched_reqs_mean": "requests batched (mean per step)",
    "defrag_passes": "KV compaction passes",
    "defrag_blocks_moved": "KV blocks moved by compaction",
    "defrag_bytes_moved": "KV bytes moved by compaction",
    "defrag_copy_time_s": "block copy time in steps with compaction (s)",
    "defrag_unblocked_reqs": "requests admitted after a compaction pass",
    "startup_s": "startup: engine build, not in wall time (s)",
    "model_load_s": "model load (s)",
    "simulated_duration_s": "simulated duration (s)",
    "replay_wall_s": "replay took, this machine (s)",
    "request_throughput_req_s": "request throughput (req/s)",
    "prefix_cache_queries_total": "prefix-cache queries (prompt tokens)",
    "prefix_cache_hits_total": "prefix-cache hits (prompt tokens)",
    "prefix_cache_hit_rate_frac": "prefix-cache hit rate (share of prompt tokens)",
    "prefix_cache_evictions_total": "prefix-cache evictions (blocks)",
    "evicted_block_age_mean_steps": "evicted block age, mean (engine steps)",
    "evicted_block_age_p50_steps": "evicted block age, median (engine steps)",
}
_LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "end-to-end latency"}
_CATEGORY_NAMES = {key: label for key, label, _ in MEMORY_CATEGORIES}


def summary_label(key: str) -> str:
    """The readable name, with its unit, of a summary key: ``"ttft_p50_s"`` → ``"TTFT p50 (ms)"``,
    ``"waste_token_states_pool_frac"`` → ``"token states (share of pool)"``, ``"..._used_frac"`` →
    ``"(share of occupied memory)"`` (pool − free, as the fragmentation rate). Keys it does not know
    keep their name, with the unit their suffix says (``_s``: seconds, ``_frac``: a share)."""
    if key in SUMMARY_LABELS:
        return SUMMARY_LABELS[key]
    name, _, rest = key.partition("_")
    if name in _LATENCY_NAMES and rest in ("p50_s", "p99_s"):
        return f"{_LATENCY_NAMES[name]} {rest[:3]} (ms)"
    for basis, words in (("_pool_frac", "share of pool"), ("_used_frac", "share of occupied memory")):
        if key.startswith("waste_") and key.endswith(basis):
            cat = key.removeprefix("waste_").removesuffix(basis)
            return f"{_CATEGORY_NAMES.get(cat, cat.replace('_', ' '))} ({words})"
    for suffix, unit in (("_tok_s", "tok/s"), ("_frac", "share"), ("_bytes", "bytes"), ("_s", "s")):
        if key.endswith(suffix):
            return f"{key.removesuffix(suffix).replace('_', ' ')} ({unit})"
    return key.replace("_", " ")


def summary_text(key: str, value: Any) -> str:
    """A summary value as :func:`summary_label` names it: shares in percent, latencies in ms."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return format_value(value)
    if key.endswith("_frac"):
        return f"{float(value):.1%}"
    if summary_label(key).endswith("(ms)"):
        return f"{float(value) * 1e3:,.1f}"
    return format_value(value)


def _summary_html(summary: Mapping[str, Any]) -> str:
    """The summary as a table of readable names (the key in each row's tooltip) and values."""
    rows = "\n".join(
        f'<tr><th title="{html.escape(str(k))}">{html.escape(summary_label(str(k)))}</th>'
        f"<td>{html.escape(summary_text(str(k), v))}</td></tr>"
        for k, v in summary.items()
    )
    if not rows:
        rows = '<tr><td colspan="2"><em>empty</em></td></tr>'
    return (
        '<table class="summary"><caption>summary</caption>\n'
        f"<thead><tr><th>figure</th><th>value</th></tr></thead>\n<tbody>\n{rows}\n</tbody></table>"
    )


_LEGEND_HTML = """\
<section class="legend">
<h2>KV memory categories</h2>
<p>The KV-cache pool (<code>num_blocks &times; block_size</code> token slots) is split
into five categories, following the vLLM paper (Kwon et al., <em>Efficient Memory
Management for Large Language Model Serving with PagedAttention</em>, SOSP 2023,
&sect;2.3 and Fig.&nbsp;2):</p>
<ul>
<li><b>token states</b> &ndash; slots holding the key/value vectors of tokens that
have actually been processed (prompt and generated tokens). This is the only useful
memory.</li>
<li><b>reservation</b> &ndash; slots allocated to a request for tokens it will
generate later; they will be used eventually but hold nothing yet, so no other
request can use them in the meantime.</li>
<li><b>internal fragmentation</b> &ndash; slots inside a request's allocation that
will never be used, e.g. the unused tail of its last block or space provisioned for
a maximum length the request never reaches.</li>
<li><b>external fragmentation</b> &ndash; unallocated slots that cannot be used to
serve a request (e.g. gaps between allocations that are too small or not
allocatable).</li>
<li><b>free</b> &ndash; unallocated slots available for new allocations.</li>
</ul>
<p><b>KV utilization</b> = token states / pool; <b>fragmentation rate</b> =
(reservation + internal + external fragmentation) / (pool &minus; free), 0 when
nothing is allocated.</p>
</section>"""

_CSS = """\
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em;
       color: #222; max-width: 1400px; }
h1 { margin-bottom: 0.2em; }
.meta { color: #666; margin-top: 0; }
.tables { display: flex; flex-wrap: wrap; gap: 2em; align-items: flex-start; }
table { border-collapse: collapse; font-size: 0.9em; }
caption { text-align: left; font-weight: bold; padding-bottom: 0.3em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; }
td { font-family: ui-monospace, monospace; }
table.summary td { text-align: right; white-space: nowrap; }
table.summary td:first-child { text-align: left; }
table.budget td:nth-child(3), table.budget td:nth-child(4) { text-align: right; }
section.budget p { color: #444; margin: 0.3em 0 0.6em; }
thead th { background: #f3f3f3; }
.figure { margin: 1.5em 0; }
"""


def write_report(
    path: str | Path,
    steps: Sequence[Mapping[str, Any]],
    requests: Sequence[Mapping[str, Any]],
    summary: Mapping[str, Any],
    config: Mapping[str, Any],
    title: str = "workbench run",
    block_maps: Sequence[Mapping[str, Any]] | None = None,
    memory: Mapping[str, Any] | None = None,
) -> Path:
    """Write a single self-contained HTML report of one run.

    The page holds the (escaped) title, the "Memory budget" section when the
    run's budget is given (:mod:`workbench.viz.budget`: capacity,
    gpu_memory_utilization, weights, activations, buffers, the KV pool, blocks,
    block size, bytes per token; and chapter 1's stacked bar), a table of
    ``summary`` (e.g. from :func:`summary_table`; readable names with units,
    :func:`summary_label`), a table of ``config``, the figures (KV blocks, the KV pool in token slots
    over time with the KV utilization, the run's waste breakdown bars, the block
    map when ``block_maps`` are given, batch composition, latency CDFs, step
    times; the new ones from :mod:`workbench.viz.figures`) and a legend defining
    the five KV memory categories. plotly.js is inlined exactly once (with the first figure), so
    the file works offline; it is several MB large. Parent directories are
    created. The file is written as UTF-8 and overwritten if present.

    Args:
        path: output file path.
        steps: step records (may be empty).
        requests: request records (may be empty).
        summary: flat mapping shown in the summary table.
        config: run configuration shown in the config table (nested values are
            rendered as JSON).
        title: page title and heading.
        block_maps: block-map snapshots (``Recorder.block_maps``); ``None`` or
            empty leaves the block map out.
        memory: the run's memory budget (``MemoryBudget.to_dict()``; default:
            ``config["memory"]`` when present); ``None`` leaves the section out.

    Returns:
        The path written, as a ``Path``.

    Raises:
        OSError: if the directory cannot be created or the file written.
        KeyError, TypeError, ValueError: propagated from the figure builders for
            malformed step records.
    """

    out = Path(path)
    if memory is None and isinstance(config.get("memory"), Mapping):
        memory = config["memory"]
    figures = [
        *([budget_figure(memory, "Where the device memory goes")] if memory else []),
        kv_blocks_figure(steps),
        memory_timeline_figure(steps, unit="tokens", x="time"),
        waste_bars_figure({"this run": steps} if steps else {}),
        *([block_map_figure(block_maps)] if block_maps else []),
        batch_composition_figure(steps),
        latency_figure(requests),
        step_time_figure(steps),
    ]
    fig_html = []
    for i, fig in enumerate(figures):
        div = fig.to_html(
            full_html=False,
            include_plotlyjs=(i == 0),
            default_width="100%",
            default_height=f"{fig.layout.height or 450}px",
            config={"displaylogo": False, "responsive": True},
        )
        fig_html.append(f'<div class="figure">{div}</div>')

    esc_title = html.escape(str(title))
    generated = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    body = "\n".join(
        [
            f"<h1>{esc_title}</h1>",
            (
                f'<p class="meta">generated {html.escape(generated)} &middot; '
                f"{len(steps)} steps &middot; {len(requests)} requests</p>"
            ),
            budget_section_html(memory),
            *fig_html[: 1 if memory else 0],
            '<div class="tables">',
            _summary_html(summary),
            _kv_table({k: v for k, v in config.items() if k != "memory"}, "configuration", "config"),
            "</div>",
            *fig_html[1 if memory else 0 :],
            _LEGEND_HTML,
        ]
    )
    doc = (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{esc_title}</title>\n<style>\n{_CSS}</style>\n</head>\n<body>\n"
        f"{body}\n</body>\n</html>\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc, encoding="utf-8")
    return out
