"""The parameter matrix (chapter 7): a grid of engine arguments, one real run per point, heatmaps.

A *grid* maps engine-argument names (vLLM's: ``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``gpu_memory_utilization``, ``device_memory``,
``num_gpu_blocks_override``, ``enable_chunked_prefill``) to the values to try; the sweep runs every
combination (:func:`grid_points`, in ``itertools.product`` order, the first argument varying
slowest). Each point is a real :func:`~workbench.labs.runs.lab_run` of the bundled model
(:func:`run_sweep`) or a simulated server replaying a trace (:func:`sim_sweep`,
:mod:`workbench.sim`), and becomes one *row* (:func:`sweep_row`) of figures taken from the
engine's own records:

* ``output_throughput_tok_s`` — output tokens / wall time of the run (simulated seconds in a
  simulated run), from the run's summary (:func:`workbench.viz.report.summary_table`); a timing;
* ``ttft_p99_s`` — 99th percentile of the requests' time to first token (s); a timing;
* ``kv_utilization`` — mean over steps of token states / KV pool (each step's ``kv_utilization``);
* ``preemptions`` — sum of the steps' ``num_preemptions``;
* ``fragmentation_rate`` — mean over steps of each step's ``fragmentation_rate`` (the share of
  occupied KV memory holding no token state, docs/architecture.md §3);

and, for the chapter's tables: ``pool_blocks`` (the memory budget's blocks), ``pool_tokens``,
``peak_running`` (most requests running after a step: the batch size the pool allowed),
``mean_running``, ``steps``, ``internal_fragmentation`` (share of used memory, occupancy-weighted
as in :func:`~workbench.labs.runs.run_summary`), ``output_tokens``, ``memory`` (the engine's
memory budget, ``MemoryBudget.to_dict()``).

Timings vary from run to run and machine to machine; every other figure of a real run is
deterministic (the lab trace fixes each request's output length), and a simulated run is
deterministic altogether (seeded trace, simulated clock).

:class:`SweepPanel` puts this behind widgets: one value list per swept argument, a Run button, a
progress bar and one plotly ``FigureWidget`` heatmap per metric, filled cell by cell as each run
ends. ``SweepPanel.run()`` is the same code path without a click.
"""

from __future__ import annotations

import html
import itertools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.labs.exercise_registry import _register
from workbench.labs.panel import RunButtonThread
from workbench.labs.runs import LAB_ENGINE_DEFAULTS, check_engine_arg_names, check_engine_args, lab_run, lab_trace
from workbench.viz.common import count_colour_range, nice_step, share_colour_range

__all__ = [
    "METRICS",
    "SWEEPABLE",
    "SweepPanel",
    "sweep_table",
    "grid_points",
    "heatmap_figure",
    "median_ttft_p99",
    "point_label",
    "run_sweep",
    "sim_sweep",
    "sweep_row",
]

MiB = 1 << 20

#: engine arguments a sweep can vary, and the type of their values
SWEEPABLE: dict[str, type] = {
    "block_size": int,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "gpu_memory_utilization": float,
    "device_memory": int,
    "num_gpu_blocks_override": int,
    "enable_chunked_prefill": bool,
}

#: metric key -> (title, unit, is a timing (varies run to run), higher is better)
METRICS: dict[str, tuple[str, str, bool, bool]] = {
    "output_throughput_tok_s": ("output throughput", "tok/s", True, True),
    "ttft_p99_s": ("TTFT p99", "s", True, False),
    "kv_utilization": ("KV utilization", "token states / pool", False, True),
    "preemptions": ("preemptions", "count", False, False),
    "fragmentation_rate": ("fragmentation rate", "wasted / occupied", False, False),
}

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": MiB}
_SIZE_UNITS |= {"g": 10**9, "gb": 10**9, "gib": 1 << 30}


def _parse_value(name: str, text: Any) -> Any:
    """One value of a swept argument, from Python or from a widget's text.

    Raises:
        ValueError: a value of the wrong kind, naming the argument and an example.
    """
    kind = SWEEPABLE[name]
    if kind is bool:
        if isinstance(text, bool):
            return text
        t = str(text).strip().lower()
        if t in ("true", "on", "1", "yes"):
            return True
        if t in ("false", "off", "0", "no"):
            return False
        raise ValueError(f"{name}: {text!r} is not on/off; write e.g. 'True, False'")
    if isinstance(text, bool):
        raise ValueError(f"{name}: {text!r} is not a number")
    if kind is float:
        try:
            return float(text)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: {text!r} is not a number; write e.g. '0.8, 0.9'") from None
    if isinstance(text, int):
        return text
    if isinstance(text, float) and text.is_integer():
        return int(text)
    if name == "device_memory":
        m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(text))
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
        raise ValueError(f"device_memory: {text!r} is not a size; write e.g. '640MiB, 768MiB' or bytes")
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"{name}: {text!r} is not a whole number; write e.g. '4, 16'") from None


def normalize_grid(grid: Mapping[str, Any]) -> dict[str, list]:
    """``{argument: [values]}`` with parsed, de-duplicated values (order kept).

    A value list may be given as a list or as text (``"8, 16, 32"``; sizes such as ``"768MiB"`` for
    ``device_memory``).

    Raises:
        ValueError: an argument that cannot be swept, an empty value list, or a bad value.
    """
    if not grid:
        raise ValueError(f"the grid is empty; give at least one argument of {', '.join(SWEEPABLE)}")
    out: dict[str, list] = {}
    for name, values in grid.items():
        if name not in SWEEPABLE:
            raise ValueError(f"{name!r} cannot be swept; use one of {', '.join(SWEEPABLE)}")
        if isinstance(values, str):
            values = [v for v in re.split(r"[,\s]+", values.strip()) if v]
        elif not isinstance(values, (list, tuple)):
            values = [values]
        parsed = []
        for v in values:
            p = _parse_value(name, v)
            if p not in parsed:
                parsed.append(p)
        if not parsed:
            raise ValueError(f"{name}: no value given; write e.g. {name}='{_EXAMPLES[name]}'")
        out[name] = parsed
    return out


_EXAMPLES = {
    "block_size": "8, 16, 32",
    "max_num_seqs": "4, 16",
    "max_num_batched_tokens": "256, 512",
    "gpu_memory_utilization": "0.8, 0.9",
    "device_memory": "640MiB, 768MiB",
    "num_gpu_blocks_override": "32, 64",
    "enable_chunked_prefill": "True, False",
}


def grid_points(grid: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every combination of the grid's values, the first argument varying slowest.

    >>> grid_points({"block_size": [8, 16], "max_num_seqs": [4]})
    [{'block_size': 8, 'max_num_seqs': 4}, {'block_size': 16, 'max_num_seqs': 4}]

    Raises:
        ValueError: see :func:`normalize_grid`.
    """
    g = normalize_grid(grid)
    return [dict(zip(g, combo)) for combo in itertools.product(*g.values())]


def _fmt_value(name: str, v: Any) -> str:
    if name == "device_memory" and isinstance(v, int) and v % MiB == 0:
        return f"{v // MiB}MiB"
    return str(v)


def point_label(config: Mapping[str, Any]) -> str:
    """A short label of a grid point: ``"block_size=16, max_num_seqs=4"``."""
    return ", ".join(f"{k}={_fmt_value(k, v)}" for k, v in config.items())


def sweep_row(config: Mapping[str, Any], result: Any = None, error: str | None = None) -> dict[str, Any]:
    """One grid point's figures (module docstring) from a real or simulated run.

    Args:
        config: the swept arguments' values at this point.
        result: a :class:`~workbench.bench.run.JobResult` or :class:`~workbench.sim.run.SimResult`.
        error: the message of a point the engine refused (its metrics are then ``None``).
    """
    row: dict[str, Any] = {"label": point_label(config), "config": dict(config), "error": error}
    if result is None:
        return row | {k: None for k in METRICS}
    from workbench.metrics.waste import waste_breakdown

    recorder = result.recorder if hasattr(result, "recorder") else result.engine.recorder
    steps = recorder.steps
    summ = result.summary
    memory = result.memory if hasattr(result, "memory") else result.engine.memory.to_dict()
    running = [s.num_running for s in steps]
    wb = waste_breakdown([s.to_dict() for s in steps])
    return row | {
        "output_throughput_tok_s": summ["output_throughput_tok_s"],
        "ttft_p99_s": summ["ttft_p99_s"],
        "kv_utilization": summ["kv_utilization_mean_frac"],
        "preemptions": summ["preemptions_total"],
        "fragmentation_rate": summ["fragmentation_rate_mean_frac"],
        "pool_blocks": memory["num_blocks"],
        "pool_tokens": memory["num_blocks"] * memory["block_size"],
        "peak_running": max(running, default=0),
        "mean_running": sum(running) / len(running) if running else 0.0,
        "steps": len(steps),
        "internal_fragmentation": wb["used_share"]["internal_fragmentation"],
        "output_tokens": summ["output_tokens_total"],
        "requests_finished": summ["requests_finished"],
        "memory": dict(memory),
    }


def _run_points(
    points: Sequence[dict],
    run_one: Callable[[dict], Any],
    on_row: Callable[[int, dict], None] | None,
    progress: bool | Callable,
) -> list[dict]:
    rows = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = (progress if callable(progress) else tqdm)(total=len(points), desc="sweep", unit="run")
    try:
        for i, config in enumerate(points):
            try:
                row = sweep_row(config, run_one(config))
            except ValueError as e:  # the engine refused this point (e.g. no memory left for KV)
                row = sweep_row(config, error=str(e))
            rows.append(row)
            if bar is not None:
                bar.update(1)
            if on_row is not None:
                on_row(i, row)
    finally:
        if bar is not None:
            bar.close()
    return rows


def _check_points(points: Sequence[dict], base: Mapping[str, Any]) -> None:
    """Validate every point's engine arguments before the first run (no model loads)."""
    check_engine_arg_names(base)
    for p in points:
        try:
            check_engine_args(dict(base) | p)
        except ValueError as e:
            raise ValueError(f"grid point {point_label(p)}: {e}") from None


def run_sweep(
    grid: Mapping[str, Any],
    *,
    records=None,
    on_row: Callable[[int, dict], None] | None = None,
    progress: bool | Callable = False,
    **engine_args: Any,
) -> list[dict]:
    """One real engine run (:func:`~workbench.labs.runs.lab_run`) per grid point; its rows.

    Args:
        grid: ``{argument: values}`` (:func:`grid_points`).
        records: the requests of every run (default: :func:`~workbench.labs.runs.lab_trace`).
        on_row: called with ``(index, row)`` as each run ends (a panel fills a heatmap cell).
        progress: a tqdm bar of runs (or a tqdm-like factory).
        **engine_args: fixed engine arguments under the grid's (over the lab defaults).

    Returns:
        The rows of :func:`sweep_row`, in :func:`grid_points` order; a point the engine refused
        (e.g. a ``gpu_memory_utilization`` that leaves no memory for KV) has its ``error`` set.

    Raises:
        ValueError: a bad grid, or a point with an invalid argument (checked before any run).
    """
    points = grid_points(grid)
    _check_points(points, LAB_ENGINE_DEFAULTS | engine_args)
    recs = list(records) if records is not None else lab_trace()
    return _run_points(points, lambda p: lab_run(recs, **(engine_args | p)), on_row, progress)


def sim_sweep(
    grid: Mapping[str, Any],
    *,
    model: str = "llama-2-70b",
    hardware: str = "A100-80GB",
    tensor_parallel_size: int = 4,
    request_rate: float = 10.0,
    duration_s: float = 20.0,
    dataset: str = "sharegpt",
    seed: int = 0,
    on_row: Callable[[int, dict], None] | None = None,
    progress: bool | Callable = False,
    **engine_args: Any,
) -> list[dict]:
    """The same sweep on a simulated production server (:func:`workbench.sim.run.simulate_job`).

    Every point replays one seeded trace (:func:`workbench.sim.trace.make_trace`: Poisson arrivals
    at ``request_rate`` req/s for ``duration_s`` s, ``dataset`` lengths) on ``tensor_parallel_size``
    simulated ``hardware`` devices serving ``model`` (a :data:`workbench.catalog.MODELS` name); the
    real scheduler and KV manager run, the step times come from the cost model. Deterministic.

    Args:
        grid, on_row, progress: as :func:`run_sweep`.
        **engine_args: fixed engine arguments (``max_model_len``, ...).

    Returns:
        Rows as :func:`run_sweep`'s; times (throughput, TTFT) are simulated seconds.

    Raises:
        ValueError: a bad grid or engine argument; an unknown model or hardware.
    """
    from workbench.catalog import MODELS
    from workbench.sim import SimSpec, find_hardware, make_trace
    from workbench.sim.run import simulate_job

    if model not in MODELS:
        raise ValueError(f"model={model!r} is not in the catalogue; use one of {', '.join(MODELS)}")
    if "device_memory" in grid or "device_memory" in engine_args:
        raise ValueError(
            "device_memory is the memory of a CPU device; a simulated GPU's memory is its catalogue's "
            f"({hardware!r}): sweep gpu_memory_utilization or kv_cache_memory_bytes, or choose another hardware"
        )
    points = grid_points(grid)
    _check_points(points, engine_args)
    spec = SimSpec(MODELS[model], find_hardware(hardware), tensor_parallel_size)
    trace = make_trace(request_rate, duration_s, dataset, "poisson", seed)

    def one(p):
        return simulate_job(spec, trace, output_dir=None, record_itl=False, **(engine_args | p))

    return _run_points(points, one, on_row, progress)


#: headers (with units) of the sweep row keys :func:`sweep_table` shows; other keys are their own header
SWEEP_HEADERS = {
    "pool_blocks": "pool (blocks)",
    "pool_tokens": "pool (tokens)",
    "peak_running": "peak running (requests)",
    "preemptions": "preemptions",
    "steps": "steps",
    "kv_utilization": "KV utilization (% of pool)",
    "fragmentation_rate": "fragmentation rate (% of occupied)",
    "internal_fragmentation": "internal frag. (% of used)",
    "output_throughput_tok_s": "output throughput (tok/s)",
    "ttft_p99_s": "TTFT p99 (s)",
    "ttft_p50_s": "TTFT p50 (s)",
}
_SHARES = ("kv_utilization", "fragmentation_rate", "internal_fragmentation")


def _sweep_cell(key: str):
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if key in _SHARES and not isinstance(v, str):
            return f"{100 * v:.1f}%"
        if isinstance(v, float):
            return f"{v:,.2f}"
        if isinstance(v, int) and not isinstance(v, bool):
            return f"{v:,}"
        return str(v)

    return fmt


def sweep_table(rows: Sequence[dict], columns: Sequence[str], first: str = "label"):
    """A :class:`~workbench.viz.table.Table` of sweep rows: ``first`` (the point's label), then
    ``columns`` (row keys; headers with units from :data:`SWEEP_HEADERS`; ``None`` shown as ``-``,
    shares as percentages). A point the engine refused shows ``refused`` and its error below the table."""
    from workbench.viz.table import Column, Table

    body, notes = [], []
    for r in rows:
        if r.get("error"):
            body.append({first: r[first]} | {k: "refused" if i == 0 else None for i, k in enumerate(columns)})
            notes.append(f"{r[first]}: {r['error']}")
        else:
            body.append({first: r[first]} | {k: r.get(k) for k in columns})
    cols = [Column(first, first, str, align="left")] + [
        Column(k, SWEEP_HEADERS.get(k, k), _sweep_cell(k)) for k in columns
    ]
    return Table(cols, body, notes=notes)


def median_ttft_p99(rows: Sequence[dict]) -> float:
    """The median of the rows' ``ttft_p99_s`` (s; refused points skipped): a target half of them meet.

    Raises:
        ValueError: no row has a TTFT.
    """
    import statistics

    ts = [r["ttft_p99_s"] for r in rows if not r.get("error") and r.get("ttft_p99_s") is not None]
    if not ts:
        raise ValueError("no row of the sweep has a TTFT p99")
    return float(statistics.median(ts))


def utilization_table(rows: Sequence[dict], **where: Any):
    """What each ``gpu_memory_utilization`` of a sweep left for the KV pool, from the engine's own budgets.

    A :class:`~workbench.viz.table.Table`, one row per sweep row (those whose config matches ``where``,
    e.g. ``max_num_seqs=8``): the share, the usable memory (capacity x share), weights, profiled
    activations, KV budget (MiB), pool blocks, the batch size reached (``peak_running``) and
    preemptions; then a note: how many MiB and blocks the lowest share gave up against the highest,
    and where they came from. Rows: ``gpu_memory_utilization``, ``usable_bytes``, ``weights_bytes``,
    ``activation_bytes``, ``kv_budget_bytes``, ``num_blocks``, ``peak_running``, ``preemptions``.
    """
    from workbench.viz.table import Column, Table

    sel = [r for r in rows if not r.get("error") and all(r["config"].get(k) == v for k, v in where.items())]
    sel.sort(key=lambda r: r["memory"]["gpu_memory_utilization"])
    body = []
    for r in sel:
        m = r["memory"]
        body.append(
            {
                "gpu_memory_utilization": m["gpu_memory_utilization"],
                "usable_bytes": int(m["capacity_bytes"] * m["gpu_memory_utilization"]),
                "weights_bytes": m["weights_bytes"],
                "activation_bytes": m["activation_bytes"],
                "kv_budget_bytes": m["kv_budget_bytes"],
                "num_blocks": m["num_blocks"],
                "peak_running": r["peak_running"],
                "preemptions": r["preemptions"],
            }
        )
    notes = []
    if len(sel) >= 2:
        lo, hi = sel[0]["memory"], sel[-1]["memory"]
        d_usable = int(hi["capacity_bytes"] * hi["gpu_memory_utilization"]) - int(
            lo["capacity_bytes"] * lo["gpu_memory_utilization"]
        )
        d_kv = hi["kv_budget_bytes"] - lo["kv_budget_bytes"]
        d_blocks = hi["num_blocks"] - lo["num_blocks"]
        notes.append(
            f"from {hi['gpu_memory_utilization']:g} down to {lo['gpu_memory_utilization']:g}: {d_usable / MiB:,.1f} MiB "
            f"less usable memory, {d_kv / MiB:,.1f} MiB of it from the KV budget "
            f"({100 * d_kv / d_usable:.0f}%): {d_blocks:,} of {hi['num_blocks']:,} blocks "
            f"({100 * d_blocks / hi['num_blocks']:.0f}% of the pool)"
        )
    mib = lambda v: f"{v / MiB:,.1f}"  # noqa: E731
    cols = [
        Column("gpu_memory_utilization", "gpu_memory_utilization", "{:g}".format),
        Column("usable_bytes", "usable (MiB)", mib),
        Column("weights_bytes", "weights (MiB)", mib),
        Column("activation_bytes", "activations (MiB)", mib),
        Column("kv_budget_bytes", "KV budget (MiB)", mib),
        Column("num_blocks", "pool (blocks)", "{:,}".format),
        Column("peak_running", "peak running (requests)", str),
        Column("preemptions", "preempted", str),
    ]
    return Table(cols, body, notes=notes)


# ---------------------------------------------------------------- heatmaps
def _axes(grid: Mapping[str, list]) -> tuple[str, list, str, list]:
    """(x name, x values, y name, y labels): the first argument across, the others' combinations down."""
    names = list(grid)
    xname, xs = names[0], list(grid[names[0]])
    rest = names[1:]
    if not rest:
        return xname, xs, "", [""]
    ys = [point_label(dict(zip(rest, c))) for c in itertools.product(*(grid[n] for n in rest))]
    return xname, xs, " × ".join(rest), ys


def _cell(grid: Mapping[str, list], index: int) -> tuple[int, int]:
    """(y, x) of the ``index``-th grid point in :func:`grid_points` order."""
    names = list(grid)
    sizes = [len(grid[n]) for n in names]
    inner = math.prod(sizes[1:])
    return index % inner, index // inner


def _z_text(grid, rows: Sequence[dict | None], metric: str):
    xname, xs, _, ys = _axes(grid)
    n = math.prod(len(v) for v in grid.values())
    if len(rows) > n:
        raise ValueError(
            f"{len(rows)} rows for a grid of {n} points; give one row per point of grid_points(grid), in its order"
        )
    z = [[None] * len(xs) for _ in ys]
    text = [[""] * len(xs) for _ in ys]
    for i, r in enumerate(rows):
        if r is None:
            continue
        y, x = _cell(grid, i)
        if r.get("error"):
            text[y][x] = "refused"
            continue
        v = r.get(metric)
        if v is None:
            continue
        z[y][x] = float(v)
        text[y][x] = _short(metric, v)
    return z, text


def _short(metric: str, v: float) -> str:
    if metric in ("kv_utilization", "fragmentation_rate"):
        return f"{100 * v:.1f}%"
    if metric == "preemptions":
        return str(int(v))
    if metric == "ttft_p99_s":
        return f"{v:.2f}"
    return f"{v:,.1f}"


def _colour_range(metric: str, z: Sequence[Sequence[float | None]]) -> dict[str, Any]:
    """``zmin``/``zmax`` for a metric's heatmap: shares from 0% to their rounded maximum, counts
    from 0 (at least 0…1, so an all-zero grid is one colour), timings and rates from the data."""
    values = [v for row in z for v in row if v is not None]
    if metric in ("kv_utilization", "fragmentation_rate"):
        lo, hi = share_colour_range(values)
    elif metric == "preemptions":
        lo, hi = count_colour_range(values)
        # whole counts on the colour bar: 0, 1 for an all-zero grid (not 0, 0.5 -> "1", 1)
        step = nice_step(hi - lo, integer=True)
        return {"zmin": lo, "zmax": hi, "zauto": False, "colorbar": {"tick0": 0, "dtick": step}}
    else:
        return {"zauto": True}
    return {"zmin": lo, "zmax": hi, "zauto": False}


def _colorbar(metric: str) -> dict[str, Any]:
    unit = METRICS[metric][1]
    bar: dict[str, Any] = {"title": {"text": unit, "side": "right"}, "thickness": 10}
    if metric in ("kv_utilization", "fragmentation_rate"):
        bar["tickformat"] = ".0%"
    elif metric == "preemptions":
        bar["tickformat"] = ",d"
    return bar


def heatmap_figure(grid: Mapping[str, Any], rows: Sequence[dict | None], metric: str, *, widget: bool = False):
    """A heatmap of one metric over the grid: the first argument across, the others down.

    Cells of points not run yet are empty; refused points read "refused".

    Args:
        grid: the sweep's grid.
        rows: rows in :func:`grid_points` order (``None`` for points not run yet).
        metric: a key of :data:`METRICS`.
        widget: a ``go.FigureWidget`` (for live filling) instead of a ``go.Figure``.

    Raises:
        ValueError: an unknown metric, or more rows than the grid has points.
    """
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r}; use one of {', '.join(METRICS)}")
    g = normalize_grid(grid)
    title, unit, _, higher = METRICS[metric]
    xname, xs, yname, ys = _axes(g)
    z, text = _z_text(g, rows, metric)
    fig = (go.FigureWidget if widget else go.Figure)()
    fig.add_heatmap(
        z=z,
        x=[_fmt_value(xname, v) for v in xs],
        y=ys,
        text=text,
        texttemplate="%{text}",
        colorscale="Viridis" if higher else "Viridis_r",
        **_colour_range(metric, z) | {"colorbar": _colorbar(metric) | _colour_range(metric, z).get("colorbar", {})},
        hovertemplate=f"{xname}=%{{x}}<br>%{{y}}<br>{title}: %{{text}}<extra></extra>",
        xgap=2,
        ygap=2,
        name=metric,
    )
    fig.update_layout(
        title=dict(text=f"{title} ({unit})", font_size=13),
        xaxis=dict(title=xname, type="category"),
        yaxis=dict(title=yname, type="category", autorange="reversed"),
        height=max(220, 90 + 45 * len(ys)),
        margin=dict(l=10, r=10, t=40, b=40),
    )
    if widget:  # the panel lays them out in columns of this width: a fixed width keeps the colorbar in view
        fig.update_layout(width=PANEL_FIGURE_WIDTH)
    return fig


#: Width (px) of each live heatmap in :class:`SweepPanel`.
PANEL_FIGURE_WIDTH = 420


def heatmaps(grid, rows, metrics: Sequence[str] = tuple(METRICS)) -> list[go.Figure]:
    """:func:`heatmap_figure` of each metric."""
    return [heatmap_figure(grid, rows, m) for m in metrics]


# ---------------------------------------------------------------- the panel
class SweepPanel(RunButtonThread):
    """Widgets + Run button + progress bar + live heatmaps, over a grid of real engine runs.

    Args:
        grid: the starting grid ``{argument: values}``; each argument gets a text widget holding
            its values (``"8, 16, 32"``), named like the argument.
        metrics: which heatmaps to show (keys of :data:`METRICS`), one ``go.FigureWidget`` each.
        runner: ``runner(grid, on_row=..., **fixed)`` → rows; default :func:`run_sweep` (real runs);
            :func:`sim_sweep` makes it a simulator panel.
        **fixed: fixed arguments passed to the runner (``records=``, engine arguments, or the
            simulator's ``model`` / ``hardware`` / ...).

    Attributes:
        widget: the ``ipywidgets.VBox`` to display (or display the panel itself).
        rows: the latest sweep's rows (filled as its runs end).
        figures: ``{metric: go.FigureWidget}``.
        error: the message of the latest refused grid, or ``None``.

    Raises:
        ImportError: ipywidgets / anywidget missing (``pip install 'workbench[lab]'``).
        ValueError: a bad starting grid or metric.
    """

    def __init__(
        self,
        grid: Mapping[str, Any],
        *,
        metrics: Sequence[str] = tuple(METRICS),
        runner: Callable[..., list[dict]] = run_sweep,
        **fixed: Any,
    ) -> None:
        from workbench.viz.live import _require_widgets

        widgets = _require_widgets()
        for m in metrics:
            if m not in METRICS:
                raise ValueError(f"metric={m!r}; use one of {', '.join(METRICS)}")
        self.grid = normalize_grid(grid)
        self.metrics = list(metrics)
        self.runner = runner
        self.fixed = dict(fixed)
        self.rows: list[dict | None] = []
        self._init_button(widgets)
        style = {"description_width": "initial"}
        self.controls = {
            name: widgets.Text(
                value=", ".join(_fmt_value(name, v) for v in values),
                description=name,
                style=style,
                layout=widgets.Layout(width="95%"),
            )
            for name, values in self.grid.items()
        }
        self.progress = widgets.IntProgress(value=0, min=0, max=1, description="runs 0/0", style=style)
        self.figures: dict[str, Any] = {}
        self.plot_box = widgets.GridBox(  # as many columns as fit, each as wide as a figure
            [],
            layout=widgets.Layout(grid_template_columns=f"repeat(auto-fill, minmax({PANEL_FIGURE_WIDTH + 10}px, 1fr))"),
        )
        self._build_figures()
        grid_box = widgets.GridBox(
            list(self.controls.values()), layout=widgets.Layout(grid_template_columns="repeat(2, 50%)")
        )
        self.widget = widgets.VBox([grid_box, widgets.HBox([self.button, self.progress]), self.status, self.plot_box])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def _build_figures(self) -> None:
        """Empty heatmaps of ``self.grid``. Once shown, the same ``FigureWidget`` objects are refilled in place (a
        new grid's axes, cells and height): a widget made while a run starts can reach the browser with no data, so
        the views on the page are kept and only their contents change."""
        if getattr(self, "figures", None) and list(self.figures) == list(self.metrics):
            for m, fig in self.figures.items():
                new = heatmap_figure(self.grid, [], m)
                trace = new.data[0].to_plotly_json()
                trace.pop("type", None)
                with fig.batch_update():
                    fig.data[0].update(trace, overwrite=True)
                    fig.layout.update(new.layout.to_plotly_json() | {"width": PANEL_FIGURE_WIDTH}, overwrite=True)
            return
        self.figures = {m: heatmap_figure(self.grid, [], m, widget=True) for m in self.metrics}
        self.plot_box.children = list(self.figures.values())

    def current_grid(self) -> dict[str, list]:
        """The grid the widgets describe.

        Raises:
            ValueError: a widget's text that is not a list of values of its argument.
        """
        return normalize_grid({k: w.value for k, w in self.controls.items()})

    def run(self, **grid: Any) -> list[dict]:
        """Run the sweep the widgets describe (``grid`` values, if given, replace theirs and move them).

        The same code path as the Run button, in the calling thread.

        Returns:
            The rows (:func:`sweep_row`).

        Raises:
            ValueError: a bad grid (also shown in the status line; the panel keeps working).
        """
        try:
            for k in grid:
                if k not in self.controls:
                    raise ValueError(
                        f"{k!r} is not one of this panel's arguments ({', '.join(self.controls)}); the swept "
                        "arguments are fixed when the panel is made: make a SweepPanel with it in its grid"
                    )
            g = normalize_grid({k: self.controls[k].value for k in self.controls} | grid)
        except ValueError as e:
            self._show_error(e)
            raise
        return self._locked(g, {k: ", ".join(_fmt_value(k, x) for x in v) for k, v in g.items()})

    def current_values(self) -> dict[str, list]:
        """:meth:`current_grid` (what a click runs)."""
        return self.current_grid()

    def _execute(self, grid: dict[str, list]) -> list[dict]:
        n = math.prod(len(v) for v in grid.values())
        before = (self.grid, self.rows)
        self.grid, self.rows = grid, [None] * n
        self._build_figures()
        self._show_rows()
        try:
            with self._busy(f"running {n} point(s)…"):
                rows = self.runner(grid, on_row=self._on_row, **self.fixed)
        except Exception:
            if all(r is None for r in self.rows):  # refused before any point ran: show the last sweep again
                self.grid, self.rows = before
                self._build_figures()
                self._show_rows()
            raise
        self.rows = rows
        refused = [r for r in rows if r.get("error")]
        done = f"{n - len(refused)} of {n} run(s) done"
        if refused:
            done += "; refused: " + "; ".join(f"{r['label']}: {r['error']}" for r in refused)
        self.status.value = f"<code>{html.escape(done)}</code>"
        return rows

    def _on_row(self, index: int, row: dict) -> None:
        self.rows[index] = row
        self._show_rows()

    def _show_rows(self) -> None:
        """The progress bar and the heatmaps show ``self.rows``."""
        done = sum(r is not None for r in self.rows)
        self.progress.max = max(1, len(self.rows))  # before the value: a value above the max is clamped
        self.progress.value = done
        self.progress.description = f"runs {done}/{len(self.rows)}"
        for m, fig in self.figures.items():
            z, text = _z_text(self.grid, self.rows, m)
            with fig.batch_update():
                fig.data[0].z = z
                fig.data[0].text = text
                fig.data[0].update(_colour_range(m, z))


# ---------------------------------------------------------------- exercises
def best_under_target(rows: list, ttft_p99_target_s: float) -> dict | None:
    """The row of highest ``output_throughput_tok_s`` among those whose ``ttft_p99_s`` is at most the
    target (refused points, ``error`` set, excluded); ``None`` when no row meets the target."""
    ok = [
        r
        for r in rows
        if not r.get("error") and r.get("ttft_p99_s") is not None and r["ttft_p99_s"] <= ttft_p99_target_s
    ]
    return max(ok, key=lambda r: r["output_throughput_tok_s"]) if ok else None


def _which_row(answer, rows: list):
    """The row an answer names: its config dict (the swept arguments, exactly), its index, or its label."""
    if isinstance(answer, dict):
        return next((r for r in rows if r["config"] == answer), None)
    if isinstance(answer, int) and not isinstance(answer, bool):
        return rows[answer] if 0 <= answer < len(rows) else None
    if isinstance(answer, str):
        return next((r for r in rows if r["label"] == answer.strip()), None)
    return None


@_register(
    "7.1",
    "Which configuration of the sweep gives the highest output throughput while its TTFT p99 stays at or "
    "under the target? Give its config dict (e.g. rows[3]['config']), its index in rows, or its label; "
    "None if no configuration meets the target.",
    "keep the rows with ttft_p99_s <= ttft_p99_target_s (and no error), then take the largest output_throughput_tok_s.",
)
class _BestConfig:
    @staticmethod
    def solution(rows: list, ttft_p99_target_s: float):
        best = best_under_target(rows, ttft_p99_target_s)
        return None if best is None else dict(best["config"])

    @staticmethod
    def judge(answer, rows: list, ttft_p99_target_s: float) -> tuple[bool, str]:
        best = best_under_target(rows, ttft_p99_target_s)
        if best is None:
            if answer is None:
                return True, f"no configuration meets TTFT p99 <= {ttft_p99_target_s:g} s"
            return False, f"no configuration meets TTFT p99 <= {ttft_p99_target_s:g} s: the answer is None"
        if answer is None:
            return False, f"{best['label']} meets the target; look again at the ttft_p99_s column"
        row = _which_row(answer, rows)
        if row is None:
            return False, f"{answer!r} names no row of the sweep: give rows[i]['config'], an index i or a label"
        t, x = row["ttft_p99_s"], row["output_throughput_tok_s"]
        if row is best:
            return True, (f"{row['label']}: {x:,.1f} tok/s at TTFT p99 {t:.2f} s (target {ttft_p99_target_s:g} s)")
        if row.get("error"):
            return False, f"{row['label']} did not run: {row['error']}"
        if t is None or t > ttft_p99_target_s:
            return False, f"{row['label']} misses the target: TTFT p99 {t:.2f} s > {ttft_p99_target_s:g} s"
        return False, (
            f"{row['label']} meets the target but another configuration that meets it has more throughput "
            f"than its {x:,.1f} tok/s"
        )
