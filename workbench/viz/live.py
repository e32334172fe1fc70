"""A live view of a running engine for JupyterLab: ipywidgets + plotly ``FigureWidget``.

:class:`LiveMonitor` attaches a sink to an engine's :class:`~workbench.metrics.Recorder` and
redraws, at most every ``refresh_s`` seconds, the KV pool split of docs/architecture.md §3 (stacked
areas, with the KV utilization), the running / waiting requests, the latest block map and a
status line. Each step only appends its record to a list; redraws are batched
(``FigureWidget.batch_update``) and throttled by time, so watching a run costs little (``benchmarks/live_monitor.py``;
see docs/benchmarks.md, section "Live monitor overhead").

ipywidgets and anywidget (which plotly's ``FigureWidget`` needs) are optional: they are imported
when a monitor is built, and a missing one raises ``ImportError`` naming
``pip install 'workbench[lab]'``.
"""

from __future__ import annotations

import html
import math
import operator
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.metrics.recorder import CallbackSink
from workbench.viz.common import (
    LEGEND_ABOVE,
    LEGEND_ABOVE_MARGIN,
    MEMORY_CATEGORIES,
    count_axis,
    percent_axis,
    title_above_legend,
)
from workbench.viz.figures import (
    _UNITS,
    CATEGORY_COLOURS,
    CATEGORY_LABELS,
    PAD_CODE,
    _block_heatmap,
    _block_legend_traces,
    block_map_cells,
    row_start_axis,
)

__all__ = ["LiveMonitor"]

_FIELDS = (
    "step",
    "kv_bytes_per_token",
    "num_blocks",
    "block_size",
    *(k for k, _, _ in MEMORY_CATEGORIES),
    "kv_utilization",
    "num_running",
    "num_waiting",
)
_ATTRS = operator.attrgetter(*_FIELDS)
_ITEMS = operator.itemgetter(*_FIELDS)
_INSTALL_HINT = "pip install 'workbench[lab]'  (ipywidgets>=8 and anywidget>=0.9)"
_CATS = tuple(k for k, _, _ in MEMORY_CATEGORIES)


def _require_widgets():
    """Import ipywidgets and check that plotly's FigureWidget can be built (needs anywidget)."""
    try:
        import ipywidgets
    except ImportError as e:
        raise ImportError(f"LiveMonitor needs ipywidgets: {_INSTALL_HINT}") from e
    try:
        import anywidget  # noqa: F401
    except ImportError as e:
        raise ImportError(f"LiveMonitor needs anywidget (plotly's FigureWidget uses it): {_INSTALL_HINT}") from e
    return ipywidgets


def _z_for_widget(z: np.ndarray) -> np.ndarray:
    """The block map's code grid with :data:`PAD_CODE` (transparent) for NaN: the widget sends 2-D
    arrays as JSON lists, and a kernel refuses NaN in JSON (``allow_nan=False``)."""
    return np.where(np.isnan(z), PAD_CODE, z).astype(np.int32)


def _get(rec: Any, key: str, default: Any = None) -> Any:
    if isinstance(rec, Mapping):
        return rec.get(key, default)
    return getattr(rec, key, default)


class _MonitorSink(CallbackSink):
    """A ``CallbackSink`` that also takes block-map snapshots (``on_block_map``)."""

    def __init__(self, monitor: LiveMonitor) -> None:
        super().__init__(monitor.on_step, on_request=monitor.on_request)
        self._monitor = monitor

    def on_block_map(self, snapshot: Mapping[str, Any]) -> None:
        self._monitor.on_block_map(snapshot)


class LiveMonitor:
    """Follow a running engine step by step in a notebook, throttled.

    Shows (an ipywidgets ``VBox``, :attr:`widget`): a status line (step, running, waiting,
    KV utilization, fragmentation rate, blocks used, finished requests); one ``FigureWidget``
    with the five KV-pool categories as stacked areas (token states, reservation, internal
    fragmentation, external fragmentation, free; docs/architecture.md §3, after Kwon et al., SOSP 2023,
    Fig. 2) in ``unit`` over the engine step, the KV utilization (token states / pool) on a
    right axis, and the running / waiting requests below; and, with ``block_map=True``, one
    ``FigureWidget`` with the latest block-map snapshot (see
    :func:`workbench.viz.figures.block_map_figure`).

    Snapshots arrive through the sink's ``on_block_map`` hook, or are read from
    ``recorder.block_maps`` at each redraw when the recorder keeps them.

    Throttling: every step appends its record to a list (microseconds); the figures are redrawn
    when ``refresh_s`` seconds (of ``clock``) have passed since the last redraw (or since the
    first step), always when the engine has no unfinished request left (the run's last step),
    and on :meth:`flush` / :meth:`close`. Each redraw sends at most ``max_points`` points per
    trace (evenly strided, the last step always kept), so its cost stays bounded on long runs.
    Values are read from the step records at redraw time: the engine moves never-written slots
    from reservation to internal fragmentation in past records once a request releases its
    blocks, so the live picture is provisional and the final redraw (:meth:`close`) is settled.

    Usage::

        mon = LiveMonitor(llm)      # LLM, LLMEngine, or a Recorder
        mon                         # display it (last expression of a cell), or display(mon.widget)
        llm.generate(prompts, params)
        mon.close()                 # final redraw, detach from the recorder

    Args:
        source: an ``LLM`` (its ``llm_engine.recorder`` is used), an ``LLMEngine`` (its
            ``recorder``), a ``Recorder``, or ``None`` (feed :attr:`sink` yourself).
        refresh_s: minimal seconds between two redraws (>= 0; 0 redraws every step).
        block_map: show the block-map panel.
        unit: y unit of the memory panel: ``"tokens"``, ``"bytes"``, ``"KiB"``, ``"MiB"``,
            ``"GiB"``.
        max_points: most points per trace sent in one redraw (>= 2).
        max_cols: blocks per row of the block map.
        clock: seconds, monotonic (``time.perf_counter``); tests inject a fake one.

    Attributes:
        widget: the ``ipywidgets.VBox`` to display.
        sink: the sink attached to the recorder (``on_step``, ``on_request``, ``on_block_map``).
        memory_figure: the ``FigureWidget`` of the KV pool and the request counts.
        block_map_figure: the block-map ``FigureWidget`` (``None`` without ``block_map``).
        num_steps, num_redraws: steps received and redraws done.
        redraw_time_s, callback_time_s: seconds spent redrawing, and in the sink's callbacks
            in total (redraws included).

    Raises:
        ImportError: ipywidgets or anywidget is missing (the message names the install command).
        ValueError: a bad ``refresh_s``, ``unit``, ``max_points`` or ``max_cols``.
        TypeError: ``source`` is none of the accepted kinds.
    """

    def __init__(
        self,
        source: Any = None,
        refresh_s: float = 0.25,
        block_map: bool = True,
        unit: str = "MiB",
        max_points: int = 1000,
        max_cols: int = 64,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        widgets = _require_widgets()
        if not (isinstance(refresh_s, int | float) and math.isfinite(refresh_s) and refresh_s >= 0):
            raise ValueError(f"refresh_s={refresh_s!r} must be a finite number of seconds >= 0")
        if unit not in _UNITS:
            raise ValueError(f"unit={unit!r}; expected one of {sorted(_UNITS)}")
        if max_points < 2:
            raise ValueError(f"max_points={max_points} must be >= 2")
        if max_cols < 1:
            raise ValueError(f"max_cols={max_cols} must be >= 1")
        self.refresh_s = float(refresh_s)
        self.unit = unit
        self.max_points = int(max_points)
        self.max_cols = int(max_cols)
        self._clock = clock
        self._engine, self._recorder = self._resolve(source)

        # the step records themselves (read at redraw: the engine settles reservation vs internal
        # fragmentation in past records when a request releases its blocks)
        self._rows: list[Any] = []
        self._last_step: Any = None
        self._snapshot: Mapping[str, Any] | None = None
        self._shown_snapshot: Mapping[str, Any] | None = None
        self._last_draw: float | None = None
        self._dirty = False
        self.num_steps = 0
        self.num_requests = 0
        self.num_errors = 0
        self.num_redraws = 0
        self.redraw_time_s = 0.0
        self.callback_time_s = 0.0

        self.memory_figure = go.FigureWidget(self._memory_layout())
        self.block_map_figure = go.FigureWidget(self._block_map_layout()) if block_map else None
        self._status = widgets.HTML(value="<code>waiting for the first engine step…</code>")
        children = [self._status, self.memory_figure]
        if self.block_map_figure is not None:
            children.append(self.block_map_figure)
        self.widget = widgets.VBox(children)

        self.sink = _MonitorSink(self)
        if self._recorder is not None:
            self._recorder.add_sink(self.sink)

    # ------------------------------------------------------------------ setup
    @staticmethod
    def _resolve(source: Any) -> tuple[Any, Any]:
        """``(engine or None, recorder or None)`` of an LLM, an LLMEngine or a Recorder."""
        if source is None:
            return None, None
        engine = getattr(source, "llm_engine", None)
        if engine is not None:
            return engine, engine.recorder
        if hasattr(source, "recorder") and hasattr(source.recorder, "add_sink"):
            return source, source.recorder
        if hasattr(source, "add_sink"):
            return None, source
        raise TypeError(
            f"LiveMonitor follows an LLM, an LLMEngine or a Recorder, got {type(source).__name__}; "
            "pass None and feed monitor.sink yourself otherwise"
        )

    def _memory_layout(self) -> go.Figure:
        fig = make_subplots(
            rows=2,
            cols=1,
            shared_xaxes=True,
            row_heights=[0.7, 0.3],
            vertical_spacing=0.06,
            specs=[[{"secondary_y": True}], [{}]],
        )
        unit_label = "token slots" if self.unit == "tokens" else self.unit
        for key in _CATS:
            colour = CATEGORY_COLOURS[key]
            fig.add_trace(
                go.Scatter(
                    x=[],
                    y=[],
                    name=CATEGORY_LABELS[key],
                    mode="lines",
                    stackgroup="kv",
                    line={"width": 0.5, "color": colour},
                    fillcolor=colour,
                    hovertemplate=f"{CATEGORY_LABELS[key]}: %{{y:,.3f}} {unit_label}<extra></extra>",
                ),
                row=1,
                col=1,
                secondary_y=False,
            )
        fig.add_trace(
            go.Scatter(
                x=[],
                y=[],
                name="KV utilization",
                mode="lines",
                line={"color": "black", "width": 1.5},
                hovertemplate="KV utilization: %{y:.1%}<extra></extra>",
            ),
            row=1,
            col=1,
            secondary_y=True,
        )
        for name, colour in (("running", "#1f77b4"), ("waiting", "#ff7f0e")):
            fig.add_trace(
                go.Scatter(
                    x=[],
                    y=[],
                    name=f"{name} requests",
                    mode="lines",
                    line={"color": colour, "shape": "hv"},
                    hovertemplate=f"{name}: %{{y}}<extra></extra>",
                ),
                row=2,
                col=1,
            )
        fig.update_yaxes(title_text=f"KV pool ({unit_label})", row=1, col=1, secondary_y=False)
        fig.update_yaxes(percent_axis(title="KV utilization"), showgrid=False, row=1, col=1, secondary_y=True)
        fig.update_yaxes(count_axis(1, title="requests"), row=2, col=1)
        fig.update_xaxes(title_text="engine step", row=2, col=1)
        fig.update_layout(
            title=title_above_legend("KV pool, live"),
            height=590,
            hovermode="x unified",
            legend=LEGEND_ABOVE,
            margin={"t": LEGEND_ABOVE_MARGIN + 30, "b": 40},
        )
        return fig

    def _block_map_layout(self) -> go.Figure:
        cells = block_map_cells(
            {"step": -1, "block_size": 1, "owner": [], "owner_ids": [], "filled": [], "state": []}, self.max_cols
        )
        heat = _block_heatmap(cells, "blocks")
        heat["z"] = _z_for_widget(heat["z"])
        fig = go.Figure(data=[heat, *_block_legend_traces()])
        fig.update_layout(
            title={"text": "KV block map: no snapshot yet", "font": {"size": 13}},
            height=360,
            legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0},
            plot_bgcolor="white",
            margin={"t": 90},
        )
        fig.update_xaxes(showgrid=False, zeroline=False)
        fig.update_yaxes(row_start_axis([0]), autorange="reversed", showgrid=False, zeroline=False)
        return fig

    # ------------------------------------------------------------------ sink callbacks
    def on_step(self, s: Any) -> None:
        """Take one step record (``StepStats`` or its dict); redraw when the throttle allows."""
        t0 = time.perf_counter()
        self._rows.append(s)
        self._last_step = s
        self.num_steps += 1
        self._dirty = True
        eng = self._engine
        final = eng is not None and hasattr(eng, "has_unfinished_requests") and not eng.has_unfinished_requests()
        self._maybe_redraw(final)
        self.callback_time_s += time.perf_counter() - t0

    def on_request(self, r: Any) -> None:
        """Count one finished request (errors separately); no redraw."""
        self.num_requests += 1
        if _get(r, "error") is not None or _get(r, "finish_reason") == "error":
            self.num_errors += 1

    def on_block_map(self, snapshot: Mapping[str, Any]) -> None:
        """Keep the latest block-map snapshot; it is drawn at the next redraw."""
        self._snapshot = snapshot
        self._dirty = True

    # ------------------------------------------------------------------ drawing
    def _maybe_redraw(self, force: bool = False) -> None:
        now = self._clock()
        if self._last_draw is None and not force:
            self._last_draw = now  # the throttle starts at the first step: a short run redraws once, at its end
            return
        if force or now - self._last_draw >= self.refresh_s:
            self._redraw()
            self._last_draw = now

    def _latest_snapshot(self) -> Mapping[str, Any] | None:
        kept = getattr(self._recorder, "block_maps", None) if self._recorder is not None else None
        if kept:
            last = kept[-1]
            if self._snapshot is None or int(last["step"]) > int(self._snapshot["step"]):
                self._snapshot = last
        return self._snapshot

    def _redraw(self) -> None:
        t0 = time.perf_counter()
        n = len(self._rows)
        stride = max(1, math.ceil(n / self.max_points))
        rows = self._rows[::stride]
        if n and (n - 1) % stride:
            rows.append(self._rows[-1])
        div = _UNITS[self.unit]
        # one C-level getter call per record; float64 1-D arrays travel to the front end as binary
        # buffers, not JSON
        table = np.array([_ITEMS(r) if type(r) is dict else _ATTRS(r) for r in rows], dtype=np.float64).reshape(
            len(rows), len(_FIELDS)
        )

        def column(key: str) -> np.ndarray:
            return table[:, _FIELDS.index(key)]

        scale = np.ones(len(rows)) if div is None else column("kv_bytes_per_token") / div
        xs = column("step")
        pool = column("num_blocks") * column("block_size") * scale
        fig = self.memory_figure
        with fig.batch_update():
            for i, key in enumerate(_CATS):
                fig.data[i].x = xs
                fig.data[i].y = column(key) * scale
            for i, key in ((5, "kv_utilization"), (6, "num_running"), (7, "num_waiting")):
                fig.data[i].x = xs
                fig.data[i].y = column(key)
            if len(pool) and pool.max() > 0:
                fig.layout.yaxis.range = [0, float(pool.max())]
            if len(xs):
                busiest = max(column("num_running").max(), column("num_waiting").max())
                fig.layout.yaxis3.dtick = count_axis(busiest)["dtick"]
        snap = self._latest_snapshot() if self.block_map_figure is not None else None
        if snap is not None and snap is not self._shown_snapshot:
            cells = block_map_cells(snap, self.max_cols)
            bm = self.block_map_figure
            rows = len(cells["y"])
            with bm.batch_update():
                h = bm.data[0]
                h.z, h.text, h.x, h.y = _z_for_widget(cells["z"]), cells["text"], cells["x"], cells["y"]
                small = len(cells["x"]) <= 64 and rows <= 64
                h.xgap = h.ygap = 1 if small else 0
                bm.layout.title.text = cells["title"]
                bm.layout.yaxis.update(row_start_axis(cells["y"]))
                bm.layout.height = int(min(700, max(300, 150 + rows * max(6.0, 900 / len(cells["x"])))))
            self._shown_snapshot = snap
        self._status.value = self.status_html()
        self._dirty = False
        self.num_redraws += 1
        self.redraw_time_s += time.perf_counter() - t0

    def status_html(self) -> str:
        """The status line (HTML) for the latest step."""
        s = self._last_step
        if s is None:
            return "<code>waiting for the first engine step…</code>"
        pool_blocks = int(_get(s, "num_blocks"))
        parts = [
            f"step {_get(s, 'step')}",
            f"running {_get(s, 'num_running')}",
            f"waiting {_get(s, 'num_waiting')}",
            f"KV utilization {float(_get(s, 'kv_utilization')):.1%}",
            f"fragmentation rate {float(_get(s, 'fragmentation_rate')):.1%}",
            f"blocks {_get(s, 'blocks_used')}/{pool_blocks}",
            f"finished {self.num_requests} requests" + (f" ({self.num_errors} errors)" if self.num_errors else ""),
        ]
        return "<code>" + html.escape(" · ".join(parts)) + "</code>"

    # ------------------------------------------------------------------ control
    def flush(self) -> None:
        """Redraw now if anything arrived since the last redraw."""
        if self._dirty or (self.block_map_figure is not None and self._latest_snapshot() is not self._shown_snapshot):
            self._redraw()
            self._last_draw = self._clock()

    def close(self) -> None:
        """Final redraw, then detach the sink from the recorder (idempotent)."""
        self.flush()
        rec = self._recorder
        if rec is not None:
            if hasattr(rec, "remove_sink"):
                rec.remove_sink(self.sink)
            elif self.sink in rec.sinks:
                rec.sinks.remove(self.sink)
            self._recorder = None
        self._engine = None

    def __enter__(self) -> LiveMonitor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)
