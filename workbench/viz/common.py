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
