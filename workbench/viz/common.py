"""What the run report (:mod:`workbench.viz.report`) and the figures (:mod:`workbench.viz.figures`)
share: the five KV memory categories, latency extraction from request records, percentiles and the
"no data" figure. Both import it; it imports neither, so the two do not import each other.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go

#: ``(step-record key, legend label, colour)`` of the five KV memory categories,
#: bottom to top of the stacked area plot.
MEMORY_CATEGORIES: tuple[tuple[str, str, str], ...] = (
    ("token_states", "token states", "#2ca02c"),
    ("reservation", "reservation", "#ff7f0e"),
    ("internal_fragmentation", "internal fragmentation", "#d62728"),
    ("external_fragmentation", "external fragmentation", "#9467bd"),
    ("free", "free", "#c7c7c7"),
)

#: Colours of the parts of a device's memory budget (chapter 1's bar, the run report), in the
#: order they fill the device: what the engine must hold, the KV pool, then what is left over.
BUDGET_COLOURS: dict[str, str] = {
    "weights": "#4c78a8",
    "activations": "#f58518",
    "communication buffers": "#e45756",
    "outside PyTorch": "#b279a2",
    "KV pool": "#2ca02c",
    "left": "#bab0ac",
    "held back": "#e0e0e0",
}


def budget_colour(part: str) -> str:
    """The :data:`BUDGET_COLOURS` entry whose name starts ``part`` (``"KV pool (whole blocks)"``
    → the KV pool's colour)."""
    for name, colour in BUDGET_COLOURS.items():
        if part.startswith(name):
            return colour
    raise KeyError(f"no budget colour for {part!r}; known parts: {', '.join(BUDGET_COLOURS)}")


_NO_DATA = "no data"


def _is_error(req: Mapping[str, Any]) -> bool:
    """True for a request that failed (``error`` set or ``finish_reason == "error"``)."""
    return req.get("error") is not None or req.get("finish_reason") == "error"


def _finite(value: Any) -> float | None:
    """``value`` as a float, or ``None`` when missing / not a finite number."""
    if value is None or isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _latency_values(requests: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Latencies in seconds of the non-error requests, ``None``/non-finite dropped."""
    out: dict[str, list[float]] = {"ttft": [], "tpot": [], "itl": [], "e2e": []}
    for req in requests:
        if _is_error(req):
            continue
        for name in ("ttft", "tpot", "e2e"):
            v = _finite(req.get(f"{name}_s"))
            if v is not None:
                out[name].append(v)
        for itl in req.get("itl_s") or ():
            v = _finite(itl)
            if v is not None:
                out["itl"].append(v)
    return out


def _percentile(values: Sequence[float], q: float) -> float | None:
    """``numpy.percentile`` (linear method) of ``values``; ``None`` when empty."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _no_data_figure(title: str) -> go.Figure:
    fig = go.Figure()
    fig.update_layout(
        title={"text": title},
        xaxis={"visible": False},
        yaxis={"visible": False},
        height=300,
        annotations=[
            {
                "text": _NO_DATA,
                "xref": "paper",
                "yref": "paper",
                "x": 0.5,
                "y": 0.5,
                "showarrow": False,
                "font": {"size": 20},
            }
        ],
    )
    return fig


# --------------------------------------------------------------------------- #
# conventions every figure follows: units in titles, integer axes for counts,
# percentage axes with a stated range, legends clear of the axes, one colour per category
# --------------------------------------------------------------------------- #

#: A horizontal legend above the plot area, left-aligned: it never collides with a right-hand
#: axis title or the x-axis title. Give the figure a top margin of at least ``LEGEND_ABOVE_MARGIN``.
LEGEND_ABOVE: dict[str, Any] = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0}
LEGEND_ABOVE_MARGIN = 100


def title_above_legend(text: str, **font: Any) -> dict[str, Any]:
    """A figure title pinned to the top-left of the figure, above a :data:`LEGEND_ABOVE` legend.

    Plotly centres an automatic title in the top margin, where a legend that wraps onto a third row
    (a narrow notebook column) covers it; pinned to the top it stays clear. Give such a figure a top
    margin of ``LEGEND_ABOVE_MARGIN + 30``."""
    title: dict[str, Any] = {
        "text": text,
        "x": 0,
        "xref": "paper",
        "xanchor": "left",
        "y": 1,
        "yref": "container",
        "yanchor": "top",
        "pad": {"t": 10},
    }
    if font:
        title["font"] = font
    return title


#: Top margin for a title above a :data:`LEGEND_ABOVE` legend of up to four rows (seven entries on
#: a 700 px wide page).
TITLE_AND_LEGEND_MARGIN = LEGEND_ABOVE_MARGIN + 30


def title_and_legend_above(title: str, height: int, margin_top: int = TITLE_AND_LEGEND_MARGIN, margin_bottom: int = 80):
    """Layout of a ``height`` px figure whose title sits at the very top and whose legend
    (:data:`LEGEND_ABOVE`) sits between the title and the plot area, however many rows the page's
    width wraps it into (up to what ``margin_top`` holds): the legend is lifted 14 px above the plot
    area, clear of the top tick labels, and transparent. Pass it to ``fig.update_layout``.

    Raises:
        ValueError: a ``height`` that leaves no plot area between the margins.
    """
    plot = height - margin_top - margin_bottom
    if plot <= 0:
        raise ValueError(f"height={height} leaves no plot area under margins {margin_top} + {margin_bottom} px")
    return {
        "title": {"text": title, "y": 1, "yanchor": "top", "pad": {"t": 14}},
        "height": height,
        "legend": LEGEND_ABOVE | {"y": 1 + 14 / plot, "traceorder": "normal", "bgcolor": "rgba(0,0,0,0)"},
        "margin": {"t": margin_top, "b": margin_bottom},
    }


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """``"1 request"``, ``"2 requests"``: ``n`` with ``noun`` in the right number."""
    return f"{n:,} {noun if n == 1 else (plural_form or noun + 's')}"


def nice_step(span: float, target: int = 5, integer: bool = False) -> float:
    """A tick step of 1, 2, 2.5 or 5 × 10^k giving about ``target`` ticks over ``span``.

    With ``integer`` the step is a whole number (at least 1), for axes of counts.
    """
    if not span > 0 or not math.isfinite(span):
        return 1.0
    raw = span / max(1, target)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1, round(step)) if step >= 1 else 1
        if step == 2.5:
            step = 2
    return float(step)


def count_axis(max_value: float, title: str | None = None) -> dict[str, Any]:
    """Axis settings for a count (requests, blocks, tokens): from 0, integer ticks with
    thousands separators, never 15.6 requests or 284 / 569 / 853 blocks."""
    top = max(1.0, float(max_value or 0))
    out: dict[str, Any] = {
        "rangemode": "tozero",
        "tickformat": ",d",
        "tick0": 0,
        "dtick": nice_step(top, integer=True),
    }
    if title is not None:
        out["title"] = {"text": title}
    return out


def percent_axis(lo: float = 0.0, hi: float = 1.0, title: str | None = None) -> dict[str, Any]:
    """Axis settings for a share stored as a fraction: a stated range (0–100% by default),
    ticks at round percentages."""
    out: dict[str, Any] = {
        "range": [lo, hi],
        "tickformat": ".0%" if hi - lo >= 0.05 else ".1%",
        "tick0": 0,
        "dtick": nice_step(hi - lo),
    }
    if title is not None:
        out["title"] = {"text": title}
    return out


def share_colour_range(values: Sequence[float]) -> tuple[float, float]:
    """``(zmin, zmax)`` for a colour scale of shares (fractions): from 0 to the data's maximum
    rounded up to a round percentage, so 7.3% and 7.7% sit close together, not at opposite
    ends. All zeros give ``(0, 0.01)``, never a −0.5…0.5 scale."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    top = max(finite, default=0.0)
    if top <= 0:
        return 0.0, 0.01
    step = nice_step(top, target=4)
    hi = math.ceil(top / step - 1e-9) * step
    return 0.0, min(1.0, hi) if top <= 1 else hi


def count_colour_range(values: Sequence[float]) -> tuple[float, float]:
    """``(zmin, zmax)`` for a colour scale of counts: from 0 to at least 1 (an all-zero grid
    shows one colour and a 0…1 bar, not −0.5…0.5)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return 0.0, max(1.0, max(finite, default=0.0))
