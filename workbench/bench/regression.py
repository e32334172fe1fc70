"""A performance regression check between two sets of benchmark results: ``workbench bench compare BASELINE NEW``.

Each side is one or more *repeats* of the same benchmark: ``workbench bench serve --save-result`` JSON files (vLLM's
result keys) or ``workbench run`` summaries (``summary.json`` of a run folder). A side is given as a file (one result,
a JSON list of results, or JSON Lines with one result per line), a run folder, or a folder of such files/folders.

Per metric the check takes the **median over the repeats** of each side, their min and max, and the ratio
new median / baseline median, then gives a verdict with the thresholds of the PyTorch / vLLM performance dashboards'
style of gating:

* a **latency** (TTFT, TPOT, ITL, end-to-end; mean and median) *regressed* when the ratio is above
  :data:`LATENCY_LIMIT` (1.20x the baseline), *improved* when below ``1 / 1.20``;
* a **throughput** (requests/s, output and total tokens/s) *regressed* when the ratio is below
  :data:`THROUGHPUT_LIMIT` (0.80x), *improved* when above ``1 / 0.80``;
* tail percentiles (``p99`` and the like) are reported with their ratio but **not gated**: over a few hundred requests a
  p99 is one or two requests, and it moves more than the limits between identical runs.

The check passes when no gated metric regressed; :func:`compare_results` returns a :class:`RegressionReport` with the
rows, a :class:`~workbench.viz.table.Table`, a plotly figure of the ratios (with the new side's min-max as error bars
and the limits as lines) and a self-contained HTML page.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from workbench.viz.table import Column, Table

__all__ = [
    "LATENCY_LIMIT",
    "THROUGHPUT_LIMIT",
    "Metric",
    "RegressionReport",
    "compare_results",
    "load_results",
    "metrics_of",
]

#: a latency regressed above this many times the baseline median
LATENCY_LIMIT = 1.20
#: a throughput regressed below this many times the baseline median
THROUGHPUT_LIMIT = 0.80
#: what must match for the two sides to be like for like (a warning names each that differs)
WORKLOAD_KEYS = (
    "model_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "total_input_tokens",
    "requests_total",
    "prompt_tokens_total",
)
_LATENCIES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2EL"}


@dataclass(frozen=True)
class Metric:
    """One compared figure: its ``key`` in the result, a ``label``, the ``unit``, whether higher is better, and
    whether it is gated (``False``: reported only)."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    gated: bool = True


def metrics_of(result: dict[str, Any]) -> list[Metric]:
    """The metrics a result holds, in report order: throughputs, then per latency the mean, median and (not gated)
    the other percentiles.

    Raises:
        ValueError: a result that is neither a ``bench serve`` result nor a ``workbench run`` summary.
    """
    if "request_throughput" in result:  # bench serve (vLLM's keys)
        out = [
            Metric("request_throughput", "request throughput", "req/s", True),
            Metric("output_throughput", "output throughput", "tok/s", True),
            Metric("total_token_throughput", "total throughput", "tok/s", True),
        ]
        for m, name in _LATENCIES.items():
            for k in sorted(k for k in result if k.endswith(f"_{m}_ms") and not k.startswith("std_")):
                stat = k.removesuffix(f"_{m}_ms")
                out.append(Metric(k, f"{name} {stat}", "ms", False, gated=stat in ("mean", "median")))
        return out
    if "output_throughput_tok_s" in result:  # workbench run's summary.json
        out = [
            Metric("output_throughput_tok_s", "output throughput", "tok/s", True),
            Metric("total_throughput_tok_s", "total throughput", "tok/s", True),
        ]
        for m, name in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2EL")):
            out.append(Metric(f"{m}_p50_s", f"{name} median", "s", False))
            out.append(Metric(f"{m}_p99_s", f"{name} p99", "s", False, gated=False))
        return out
    raise ValueError(
        "a result with neither 'request_throughput' (workbench bench serve --save-result) nor "
        "'output_throughput_tok_s' (a workbench run summary.json); give one of those"
    )


def _unfinished_run(path: Path) -> bool:
    """A ``workbench run`` folder (it has ``config.json`` or ``steps.jsonl``) that never wrote its ``summary.json``."""
    return not (path / "summary.json").is_file() and any((path / f).is_file() for f in ("config.json", "steps.jsonl"))


def _results_in(path: Path) -> list[dict[str, Any]]:
    if path.is_dir():
        if (path / "summary.json").is_file():  # a run folder
            return _results_in(path / "summary.json")
        unfinished = sorted(p.name for p in path.iterdir() if p.is_dir() and _unfinished_run(p))
        if _unfinished_run(path) or unfinished:
            where = path if _unfinished_run(path) else f"{path}/{{{', '.join(unfinished)}}}"
            raise ValueError(
                f"{where}: a run folder without summary.json (the run did not finish); rerun it or remove the folder, "
                "so that every repeat recorded is compared"
            )
        found = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") or (p / "summary.json").is_file())
        if not found:
            raise ValueError(f"{path} holds no result: give bench serve JSON files or workbench run folders")
        return [r for p in found for r in _results_in(p)]
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is neither JSON nor JSON Lines ({e}); give a result file") from None
    data = data if isinstance(data, list) else [data]
    if not data or not all(isinstance(d, dict) for d in data):
        raise ValueError(f"{path} holds no result objects; give a result, a list of results or JSON Lines of them")
    for d in data:
        try:
            metrics_of(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        if d.get("completed", d.get("requests_finished")) == 0:
            raise ValueError(f"{path}: no request finished in this run; it measures nothing to compare (drop it)")
    return data


def load_results(paths: str | Path | Sequence[str | Path]) -> list[dict[str, Any]]:
    """Every result (repeat) in ``paths``: files with one result, a JSON list or JSON Lines of them, run folders
    (their ``summary.json``), or folders of those.

    Raises:
        FileNotFoundError: a path that does not exist.
        ValueError: a file that holds no result object, or results of different kinds.
    """
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist; give a bench serve result file or a workbench run folder")
        out += _results_in(p)
    kinds = {tuple(m.key for m in metrics_of(r))[0] for r in out}
    if len(kinds) > 1:
        raise ValueError(f"{', '.join(map(str, paths))}: bench serve results and run summaries mixed; give one kind")
    return out


def _num(v: float) -> str:
    """Four significant figures, never in scientific notation (``15,600``, not ``1.56e+04``)."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class RegressionReport:
    """What :func:`compare_results` found: one row per metric, ``passed`` (no gated metric regressed), the limits,
    how many repeats each side had and warnings (workloads that differ)."""

    rows: list[dict[str, Any]]
    latency_limit: float
    throughput_limit: float
    baseline_repeats: int
    new_repeats: int
    warnings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.regressions

    @property
    def regressions(self) -> list[dict[str, Any]]:
        """The gated rows whose verdict is ``"regressed"``."""
        return [r for r in self.rows if r["verdict"] == "regressed"]

    def table(self) -> Table:
        """The rows as a table: baseline and new median [min-max], the ratio and the verdict."""

        def span(prefix):
            def fmt(row):
                med, lo, hi = row[f"{prefix}_median"], row[f"{prefix}_min"], row[f"{prefix}_max"]
                if med is None:
                    return "-"
                return _num(med) + ("" if lo == hi else f" [{_num(lo)}-{_num(hi)}]")

            return fmt

        rows = [r | {"baseline": span("baseline")(r), "new": span("new")(r)} for r in self.rows]
        cols = [
            Column("metric", "metric", align="left"),
            Column("unit", "unit", align="left"),
            Column("baseline", f"baseline median [min-max], {self.baseline_repeats} run(s)"),
            Column("new", f"new median [min-max], {self.new_repeats} run(s)"),
            Column("ratio", "new / baseline", lambda v: "-" if v is None else f"{v:.3f}x"),
            Column("verdict", "verdict", align="left"),
        ]
        notes = [
            f"gated: latency regressed above {self.latency_limit:.2f}x the baseline median, throughput below "
            f"{self.throughput_limit:.2f}x; tail percentiles reported, not gated",
            *self.warnings,
        ]
        return Table(cols, rows, title="PASSED" if self.passed else "REGRESSED", notes=notes)

    def figure(self) -> go.Figure:
        """The ratio of every metric (bars, coloured by verdict) with the new side's min-max over the baseline median
        as error bars, and the two limits as dashed lines."""
        colours = {"regressed": "#d62728", "improved": "#2ca02c", "ok": "#1f77b4", "not gated": "#9e9e9e"}
        rows = [r for r in self.rows if r["ratio"] is not None]
        fig = go.Figure()
        for verdict, colour in colours.items():
            rs = [r for r in rows if r["verdict"] == verdict]
            if not rs:
                continue
            fig.add_bar(
                x=[r["metric"] for r in rs],
                y=[r["ratio"] for r in rs],
                name=verdict,
                marker_color=colour,
                error_y={
                    "type": "data",
                    "symmetric": False,
                    "array": [r["new_max"] / r["baseline_median"] - r["ratio"] for r in rs],
                    "arrayminus": [r["ratio"] - r["new_min"] / r["baseline_median"] for r in rs],
                },
                hovertemplate="%{x}: %{y:.3f}x the baseline median<extra>" + verdict + "</extra>",
            )
        for y, text, where in (
            (self.latency_limit, "latency limit", "top right"),
            (self.throughput_limit, "throughput limit", "bottom right"),  # below its line: the two never overlap
        ):
            fig.add_hline(y=y, line_dash="dash", line_color="#555", annotation_text=f"{text} {y:.2f}x",
                          annotation_position=where)  # fmt: skip
        fig.add_hline(y=1.0, line_color="#000", line_width=1)
        fig.update_layout(
            title={"text": f"New / baseline, median over repeats: {'PASSED' if self.passed else 'REGRESSED'}"},
            yaxis_title="new median / baseline median",
            height=460,
            legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0},
            margin={"t": 110},
        )
        return fig

    def write_html(self, path: str | Path) -> Path:
        """A self-contained page: the verdict, the table and the figure (plotly inlined; no network needed)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = self.figure().to_html(full_html=False, include_plotlyjs=True)
        page = (
            "<!doctype html><html><head><meta charset='utf-8'><title>workbench bench compare</title></head>"
            "<body style='font-family:system-ui,sans-serif;max-width:1100px;margin:1em auto'>"
            f"<h1>workbench bench compare: {'PASSED' if self.passed else 'REGRESSED'}</h1>"
            f"{self.table()._repr_html_()}{body}</body></html>"
        )
        path.write_text(page)
        return path

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "latency_limit": self.latency_limit,
            "throughput_limit": self.throughput_limit,
            "baseline_repeats": self.baseline_repeats,
            "new_repeats": self.new_repeats,
            "warnings": self.warnings,
            "rows": self.rows,
        }


def _verdict(m: Metric, ratio: float | None, latency_limit: float, throughput_limit: float) -> str:
    if ratio is None:
        return "n/a"
    if not m.gated:
        return "not gated"
    if m.higher_is_better:
        return "regressed" if ratio < throughput_limit else "improved" if ratio > 1 / throughput_limit else "ok"
    return "regressed" if ratio > latency_limit else "improved" if ratio < 1 / latency_limit else "ok"


def compare_results(
    baseline: Sequence[dict[str, Any]],
    new: Sequence[dict[str, Any]],
    latency_limit: float = LATENCY_LIMIT,
    throughput_limit: float = THROUGHPUT_LIMIT,
    allow_workload_mismatch: bool = False,
) -> RegressionReport:
    """Compare ``new`` repeats against ``baseline`` repeats metric by metric (see the module docstring).

    Args:
        baseline, new: results of one kind (``bench serve`` results or ``workbench run`` summaries), one per repeat.
        latency_limit: a latency regressed above this ratio (> 1).
        throughput_limit: a throughput regressed below this ratio (in (0, 1)).
        allow_workload_mismatch: compare although the sides differ in :data:`WORKLOAD_KEYS` (then a warning each).

    Returns:
        A :class:`RegressionReport`; ``ratio`` is ``None`` (verdict ``"n/a"``) where a side lacks the metric or the
        baseline median is 0.

    Raises:
        ValueError: an empty side, results of different kinds, limits out of range, or workloads that differ
            (unless ``allow_workload_mismatch``).
    """
    if not baseline or not new:
        raise ValueError(f"baseline has {len(baseline)} result(s) and new {len(new)}: each side needs at least one")
    if not latency_limit > 1:
        raise ValueError(
            f"latency_limit={latency_limit} (--latency-threshold) must be > 1 (e.g. 1.2: regressed above 1.2x the "
            "baseline)"
        )
    if not 0 < throughput_limit < 1:
        raise ValueError(
            f"throughput_limit={throughput_limit} (--throughput-threshold) must be in (0, 1) (e.g. 0.8: regressed "
            "below 0.8x)"
        )
    metrics = metrics_of(baseline[0])
    if metrics_of(new[0])[0].key != metrics[0].key:
        raise ValueError("baseline and new are results of different kinds (bench serve vs workbench run); compare like")
    rows = []
    for m in metrics:
        b = [float(r[m.key]) for r in baseline if r.get(m.key) is not None]
        n = [float(r[m.key]) for r in new if r.get(m.key) is not None]
        bm, nm = _median(b), _median(n)
        ratio = nm / bm if bm and nm is not None else None
        rows.append(
            {
                "metric": m.label,
                "key": m.key,
                "unit": m.unit,
                "higher_is_better": m.higher_is_better,
                "gated": m.gated,
                "baseline_median": bm,
                "baseline_min": min(b, default=None),
                "baseline_max": max(b, default=None),
                "new_median": nm,
                "new_min": min(n, default=None),
                "new_max": max(n, default=None),
                "ratio": ratio,
                "verdict": _verdict(m, ratio, latency_limit, throughput_limit),
            }
        )
    compared = [r for r in rows if r["gated"] and r["ratio"] is not None]
    if not compared:
        raise ValueError(
            "no gated metric is present (and non-zero) on both sides, so there is nothing to gate on; give complete "
            "results (bench serve --save-result files or workbench run folders)"
        )
    warnings = [
        f"{r['metric']} ({r['key']}) is missing on one side or 0 in the baseline: not compared"
        for r in rows
        if r["gated"] and r["ratio"] is None
    ]
    for k in WORKLOAD_KEYS:
        bv, nv = {json.dumps(r.get(k)) for r in baseline}, {json.dumps(r.get(k)) for r in new}
        if bv != nv:
            warnings.append(
                f"the workloads differ in {k}: baseline {', '.join(sorted(bv))}, new {', '.join(sorted(nv))}"
            )
    mismatched = [w for w in warnings if w.startswith("the workloads differ")]
    if mismatched and not allow_workload_mismatch:
        raise ValueError(
            "; ".join(mismatched) + ": the ratios would not measure the change alone; rerun on the same workload, or "
            "give --allow-workload-mismatch (allow_workload_mismatch=True) to compare anyway"
        )
    return RegressionReport(rows, latency_limit, throughput_limit, len(baseline), len(new), warnings)
