"""A control panel for the chapter notebooks: widgets named like the engine arguments, a Run button
that starts a real engine run, and a live plot of the KV pool while it runs.

``RunPanel.run()`` is the same run without a click, so CI and nbval exercise exactly what the
button does. ipywidgets and anywidget are imported when a panel is built (``workbench[lab]``).
"""

from __future__ import annotations

import html
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

from workbench.labs.runs import (
    LAB_ENGINE_DEFAULTS,
    SUMMARY_COLUMNS,
    check_engine_arg_names,
    check_engine_args,
    lab_run,
    lab_trace,
    run_summary,
)

__all__ = ["RunPanel", "CONTROLS", "summary_card"]


def summary_card(name: str, summary: dict[str, Any], per_line: int = 2):
    """One run's :func:`~workbench.labs.runs.run_summary` as labelled values, ``per_line`` pairs to a
    line (label, value, label, value): steps, mean batch, peak blocks, preemptions and where the used
    KV memory went (% of used). A :class:`~workbench.viz.table.Table` without a header line, whose
    cells never wrap (it sits beside the Run button, where a one-line table would not fit)."""
    from workbench.viz.table import Column, Table

    pairs = [(header, fmt(summary[key])) for key, header, fmt in SUMMARY_COLUMNS]
    rows = []
    for i in range(0, len(pairs), per_line):
        row = {}
        for j, (label, value) in enumerate(pairs[i : i + per_line]):
            row[f"label{j}"], row[f"value{j}"] = label, value
        rows.append(row)
    cols = []
    for j in range(per_line):
        cols += [Column(f"label{j}", fmt=lambda v: v or "", align="left"), Column(f"value{j}", fmt=lambda v: v or "")]
    return Table(cols, rows, title=f"run: {name}", header=False)


def _control(name: str, value: Any, widgets) -> Any:
    """The widget of one engine argument (or trace parameter); its ``description`` is the argument's name."""
    from workbench.config import BATCHING_POLICIES, PREEMPTION_MODES

    style = {"description_width": "initial"}
    d = dict(description=name, style=style)
    if name == "kv_allocator":  # a plug-in ("package.module:ClassName") joins the built-in names
        return widgets.Dropdown(options=_allocator_options(value), value=value, **d)
    if name == "batching_policy":
        return widgets.Dropdown(options=list(BATCHING_POLICIES), value=value, **d)
    if name == "preemption_mode":
        return widgets.Dropdown(options=list(PREEMPTION_MODES), value=value, **d)
    if name == "block_size":
        return widgets.Dropdown(options=[8, 16, 32, 64], value=value, **d)
    if name in ("enable_prefix_caching", "enable_chunked_prefill"):
        return widgets.Checkbox(value=bool(value), **d)
    if name == "gpu_memory_utilization":
        return widgets.FloatSlider(min=0.05, max=1.0, step=0.05, value=value, **d)
    limits = {
        "max_num_seqs": (1, 64, 1),
        "max_num_batched_tokens": (64, 4096, 64),
        "num_gpu_blocks_override": (8, 1024, 8),
        "num_requests": (1, 64, 1),
        "mean_output": (2, 256, 2),
        "max_output": (2, 512, 2),
    }
    if name in limits:
        lo, hi, step = limits[name]
        return widgets.IntSlider(min=lo, max=max(hi, int(value)), step=step, value=int(value), **d)
    raise ValueError(f"no widget for {name!r}; known controls: {', '.join(CONTROLS)}")


def _allocator_options(*extra: Any) -> list[str]:
    """The ``kv_allocator`` dropdown's options: the built-in names, then plug-in names given (in order)."""
    from workbench.config import KV_ALLOCATORS
    from workbench.plugins import is_plugin_name

    return list(KV_ALLOCATORS) + [v for v in dict.fromkeys(extra) if v not in KV_ALLOCATORS and is_plugin_name(v)]


#: the arguments a panel can show (engine arguments, then the trace's)
CONTROLS = (
    "kv_allocator",
    "batching_policy",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_gpu_blocks_override",
    "gpu_memory_utilization",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "preemption_mode",
    "num_requests",
    "mean_output",
    "max_output",
)
_TRACE_ARGS = ("num_requests", "mean_output", "max_output")


def _accepts(widget, value) -> bool:
    """Whether a widget can show ``value`` without clamping or refusing it."""
    options = getattr(widget, "options", None)
    if options is not None:
        return value in options
    lo, hi = getattr(widget, "min", None), getattr(widget, "max", None)
    if lo is not None and hi is not None:
        kinds = int if isinstance(widget.value, int) else int | float  # an IntSlider would truncate 2.7
        return isinstance(value, kinds) and not isinstance(value, bool) and lo <= value <= hi
    return isinstance(value, type(widget.value))


class RunButtonThread(ABC):
    """The Run button and status line shared by the chapters' panels.

    A click runs :meth:`_execute` with :meth:`current_values` in a daemon thread (one at a time),
    so that the kernel stays free to redraw the live plots while the run goes on; :meth:`wait`
    joins it. ``run()`` calls :meth:`_locked` in the caller's thread: one run at a time either
    way. Errors go to the status line (:meth:`_show_error`). A panel calls :meth:`_init_button`
    and implements ``current_values`` and ``_execute``.
    """

    _thread: threading.Thread | None = None

    def _init_button(self, widgets) -> None:
        """The Run button, the status line, the lock; ``error`` is the latest failed run's message."""
        self.error: str | None = None
        self._lock = threading.Lock()
        self._thread = None
        self.button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.button.on_click(lambda _b: self._start_thread())
        self.status = widgets.HTML(value="<code>ready: press Run</code>")

    @abstractmethod
    def current_values(self) -> Any:
        """What the widgets describe now (the argument of :meth:`_execute`)."""

    @abstractmethod
    def _execute(self, values: Any) -> Any:
        """One run (called under the lock)."""

    def _locked(self, values: Any, shown: dict[str, Any] | None = None) -> Any:
        """:meth:`_execute` under the lock. ``shown``: widget values (by control name) to display
        for this run; the widgets go back to what they showed if the run is refused or fails."""
        before = {k: self.controls[k].value for k in shown or {}}
        for k, v in (shown or {}).items():
            self.controls[k].value = v
        try:
            with self._lock:
                return self._execute(values)
        except Exception:
            for k, v in before.items():
                self.controls[k].value = v
            raise

    def _start_thread(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._clicked, daemon=True)
        self._thread.start()

    def _clicked(self) -> None:
        try:
            self._locked(self.current_values())
        except Exception as e:  # shown in the status line (the thread has no caller); the kernel stays usable
            self._show_error(e)

    def _show_error(self, error: BaseException | str) -> None:
        self.error = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.status.value = f"<code style='color:#b00'>{html.escape(self.error)}</code>"

    @contextmanager
    def _busy(self, label: str = "running…"):
        """Button disabled and ``label`` shown while the block runs; an error is shown and re-raised."""
        self.button.disabled = True
        self.status.value = f"<code>{html.escape(label)}</code>"
        self.error = None
        try:
            yield
        except Exception as e:
            self._show_error(e)
            raise
        finally:
            self.button.disabled = False

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a run started by the Run button to end."""
        if self._thread is not None:
            self._thread.join(timeout)


class RunPanel(RunButtonThread):
    """Widgets + Run button + live KV-pool plot, over real engine runs.

    Args:
        controls: which arguments get a widget (names from :data:`CONTROLS`); others keep their
            value from ``defaults``.
        records: a fixed request list; ``None`` builds :func:`~workbench.labs.runs.lab_trace` from
            the trace controls (``num_requests``, ``mean_output``, ``max_output``).
        live: follow each run with a :class:`~workbench.viz.live.LiveMonitor` (a plotly
            ``FigureWidget`` redrawn at most every ``refresh_s`` seconds, and the block map).
        on_result: called with ``(values, result)`` after each successful run.
        **defaults: starting values (engine arguments over
            :data:`~workbench.labs.runs.LAB_ENGINE_DEFAULTS`; trace arguments).

    Attributes:
        widget: the ``ipywidgets.VBox`` to display (or display the panel itself).
        result: the latest :class:`~workbench.bench.run.JobResult`, or ``None``.
        history: ``[(values, run_summary)]`` of every run, in order.
        error: the message of the latest failed run (bad arguments), or ``None``.

    Raises:
        ImportError: ipywidgets / anywidget missing (``pip install 'workbench[lab]'``).
        ValueError: an unknown control.
    """

    def __init__(
        self,
        controls: Sequence[str] = ("kv_allocator", "block_size", "max_num_seqs", "num_gpu_blocks_override"),
        *,
        records=None,
        live: bool = True,
        refresh_s: float = 0.25,
        on_result: Callable[[dict, Any], None] | None = None,
        **defaults: Any,
    ) -> None:
        from workbench.viz.live import _require_widgets

        widgets = _require_widgets()
        check_engine_arg_names(defaults, also=_TRACE_ARGS)
        self._widgets_mod = widgets
        self.values: dict[str, Any] = (
            LAB_ENGINE_DEFAULTS
            | {"kv_allocator": "paged", "num_gpu_blocks_override": 48}
            | {"num_requests": 10, "mean_output": 16, "max_output": 48}
            | defaults
        )
        for c in controls:
            if c not in CONTROLS:
                raise ValueError(f"no widget for {c!r}; known controls: {', '.join(CONTROLS)}")
        self.controls = {c: _control(c, self.values.get(c), widgets) for c in controls}
        self.records = records
        self.live = live
        self.refresh_s = refresh_s
        self.on_result = on_result
        self.result = None
        self.history: list[tuple[dict, dict]] = []
        self.monitor = None
        self._init_button(widgets)
        self.plot_box = widgets.VBox([])
        grid = widgets.GridBox(
            list(self.controls.values()), layout=widgets.Layout(grid_template_columns="repeat(2, 50%)")
        )
        self.widget = widgets.VBox([grid, widgets.HBox([self.button, self.status]), self.plot_box])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    # ------------------------------------------------------------------ runs
    def current_values(self) -> dict[str, Any]:
        """The values the next run uses: the widgets' over the defaults."""
        return self.values | {k: w.value for k, w in self.controls.items()}

    def run(self, **overrides: Any):
        """Run once with the widgets' values (and ``overrides``, which also move the widgets).

        The same code path as the Run button, in the calling thread.

        Returns:
            The :class:`~workbench.bench.run.JobResult`.

        Values are used as given, also outside a slider's range or a dropdown's options (the engine
        then validates them, as it would from Python); the widgets move to the values they can show, and
        back if the run is refused or fails.

        Raises:
            ValueError: bad arguments (also shown in the panel's status line).
        """
        try:
            check_engine_arg_names((k for k in overrides if k not in self.controls), also=_TRACE_ARGS)
            fixed = [k for k in overrides if k in _TRACE_ARGS and self.records is not None]
            if fixed:
                raise ValueError(
                    f"{fixed[0]} has no effect: this panel runs the request list it was given (records=); "
                    "make a panel without records to size the trace"
                )
        except ValueError as e:
            self._show_error(e)
            raise
        values = self.current_values() | overrides  # as given: a widget's range never clamps them
        alloc = self.controls.get("kv_allocator")
        if alloc is not None and overrides.get("kv_allocator") not in (None, *alloc.options):
            alloc.options = _allocator_options(*alloc.options, overrides["kv_allocator"])  # a plug-in by name
        shown = {k: v for k, v in overrides.items() if k in self.controls and _accepts(self.controls[k], v)}
        res = self._locked(values, shown)
        self.values |= {k: v for k, v in overrides.items() if k not in self.controls}  # kept once they ran
        return res

    def _execute(self, values: dict[str, Any]):
        engine_args = {k: v for k, v in values.items() if k not in _TRACE_ARGS}
        with self._busy():
            check_engine_args(LAB_ENGINE_DEFAULTS | engine_args)  # refused before the last run's plot goes
            records = self.records
            if records is None:
                records = lab_trace(
                    values["num_requests"], mean_output=values["mean_output"], max_output=values["max_output"]
                )
            sinks = []
            if self.live:
                from workbench.viz.live import LiveMonitor

                self.monitor = LiveMonitor(None, refresh_s=self.refresh_s, block_map=True, unit="tokens")
                self.plot_box.children = [self.monitor.widget]
                sinks.append(self.monitor.sink)
                engine_args.setdefault("block_map_every", 4)
            try:
                res = lab_run(records, sinks=sinks, **engine_args)
            finally:
                if self.monitor is not None:
                    self.monitor.close()
        self.result = res
        summ = run_summary(res)
        self.history.append((values, summ))
        self.status.value = summary_card(values.get("kv_allocator", "run"), summ).to_html()
        if self.on_result is not None:
            self.on_result(values, res)
        return res
