"""Chapter 19: a performance regression baseline, and ``workbench bench compare`` catching a regression.

A baseline is not one run: it is several *repeats* of the same benchmark, compared by their medians, with the
repeats of the two sides *interleaved* so that a drift of the machine's speed falls on both. This module records
such repeats on the bundled model — real ``workbench run`` folders (:func:`workbench.bench.run.run_job`) on a
shared-prefix trace — for a baseline configuration, a rerun of the same configuration (noise only) and a change
(prefix caching off), and hands the folders to the real comparison (:mod:`workbench.bench.regression`: ratios of
medians, latency regressed above 1.20x, throughput below 0.80x, p99 reported but not gated) and to the real CLI
(:func:`cli_compare`: its exit code is what a CI job reads).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from workbench.bench.regression import compare_results, load_results
from workbench.labs.exercise_registry import _register
from workbench.viz.table import Column, Table

#: the shared-prefix trace (``workbench run --dataset prefix-repetition``): one 256-token system prompt,
#: 8 requests with their own 8-token suffix, 8 output tokens each (EOS ignored)
TRACE: dict[str, Any] = {"prefix_len": 256, "suffix_len": 8, "num_prefixes": 1, "output_len": 8, "vocab_size": 2000}
#: the job every repeat runs (``run_job`` arguments besides the engine's)
JOB: dict[str, Any] = {
    "dataset": "prefix-repetition",
    "dataset_options": TRACE,
    "num_prompts": 8,
    "max_tokens": 8,
    "ignore_eos": True,
    "progress": False,
}
#: the engine arguments of the three sides: the baseline, a rerun of it, the change under test
SIDES: dict[str, dict[str, Any]] = {
    "baseline": {"enable_prefix_caching": True, "max_num_seqs": 4},
    "rerun": {"enable_prefix_caching": True, "max_num_seqs": 4},
    "no_prefix_caching": {"enable_prefix_caching": False, "max_num_seqs": 4},
}
#: the summary figures the chapter's tables show per repeat: key, header, format
SHOWN = (
    ("output_throughput_tok_s", "output (tok/s)", "{:,.1f}"),
    ("ttft_p50_s", "TTFT p50 (s)", "{:.3f}"),
    ("tpot_p50_s", "TPOT p50 (s)", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 (s)", "{:.3f}"),
)


@dataclass
class Repeats:
    """The recorded repeats: ``folders[side]`` (run folders in the order run), ``order`` (``(side, repeat)`` in
    the order they ran) and the wall time of the whole recording."""

    root: Path
    folders: dict[str, list[Path]]
    order: list[tuple[str, int]]
    wall_s: float

    def summaries(self, side: str) -> list[dict[str, Any]]:
        """The side's ``summary.json`` of every repeat (:func:`workbench.bench.regression.load_results`)."""
        return load_results(self.folders[side])


def record_repeats(
    root: str | Path,
    sides: dict[str, dict[str, Any]] | None = None,
    repeats: int = 3,
    on_repeat: Callable[[str, int, dict[str, Any]], None] | None = None,
    job: dict[str, Any] | None = None,
) -> Repeats:
    """Run every side ``repeats`` times, interleaved (side A, B, C, then A, B, C again, ...), after one warm-up run
    that is not kept (a process's first run pays one-off costs). Each side keeps one engine for all its repeats
    (built once; the prefix cache, where on, is warm after the warm-up like a server's).

    Args:
        root: the folder the run folders go to (``root/side/side-N``).
        sides: side name -> engine arguments (default :data:`SIDES`).
        repeats: repeats per side (>= 1; 3 or more for a median that ignores one outlier).
        on_repeat: called after each repeat with the side, the repeat number and its summary (a live plot).
        job: ``run_job`` arguments that replace :data:`JOB`'s (e.g. ``{"num_prompts": 2}``).

    Raises:
        ValueError: ``repeats < 1`` or no side; what the engine raises for bad engine arguments.
    """
    from workbench.bench.run import run_job
    from workbench.entrypoints.llm import LLM

    sides = dict(SIDES if sides is None else sides)
    if repeats < 1 or not sides:
        raise ValueError(f"repeats={repeats} must be >= 1 and sides ({list(sides)}) not empty")
    root = Path(root)
    job = JOB | (job or {})
    t0 = time.perf_counter()
    engines = {name: LLM(**args) for name, args in sides.items()}
    for llm in engines.values():  # warm-up, not kept: one request (it also warms the prefix cache)
        run_job(**(job | {"num_prompts": 1}), llm=llm, output_dir=None)
    folders: dict[str, list[Path]] = {name: [] for name in sides}
    order = []
    for i in range(repeats):
        for name, llm in engines.items():
            res = run_job(**job, llm=llm, output_dir=root / name, run_name=f"{name}-{i}")
            folders[name].append(res.run_dir)
            order.append((name, i))
            if on_repeat is not None:
                on_repeat(name, i, res.summary)
    return Repeats(root, folders, order, time.perf_counter() - t0)


def repeat_rows(rep: Repeats) -> list[dict[str, Any]]:
    """One row per repeat, in the order they ran: side, repeat, and the :data:`SHOWN` figures."""
    rows = []
    for name, i in rep.order:
        s = load_results(rep.folders[name][i])[0]
        rows.append({"side": name, "repeat": i} | {k: s[k] for k, _, _ in SHOWN})
    return rows


def repeat_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`repeat_rows` as a table."""
    cols = [Column("side", "side", align="left"), Column("repeat", "repeat")]
    cols += [Column(k, header, fmt.format) for k, header, fmt in SHOWN]
    return Table(cols, list(rows), title="every repeat, in the order it ran")


def repeats_figure(rows: Sequence[dict[str, Any]], key: str = "ttft_p50_s", title: str | None = None) -> go.Figure:
    """Each side's repeats of one figure as dots, its median as a bar: the spread the verdict must see through."""
    import statistics

    header = dict((k, h) for k, h, _ in SHOWN).get(key, key)
    fig = go.Figure()
    sides = list(dict.fromkeys(r["side"] for r in rows))
    fig.add_bar(
        x=sides,
        y=[statistics.median(r[key] for r in rows if r["side"] == s) for s in sides],
        name="median",
        marker_color="#c6dbef",
    )
    fig.add_scatter(
        x=[r["side"] for r in rows],
        y=[r[key] for r in rows],
        mode="markers",
        name="repeats",
        marker={"color": "#08519c", "size": 10},
        hovertemplate="%{x}: %{y:.3f}<extra>repeat</extra>",
    )
    fig.update_layout(
        title=title or f"{header}: repeats and their median",
        yaxis={"title": header, "rangemode": "tozero"},
        height=380,
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0},
        margin={"t": 90},
    )
    return fig


class RepeatsMonitor:
    """A live plot of the repeats as they finish: one figure (``key``, default TTFT p50) per repeat, a trace per
    side. Pass :meth:`add` as ``on_repeat`` of :func:`record_repeats`; show :attr:`figure` in the notebook.

    Raises:
        ImportError: ipywidgets / anywidget missing (a ``FigureWidget`` needs them).
    """

    def __init__(self, sides: Sequence[str] = tuple(SIDES), key: str = "ttft_p50_s"):
        header = dict((k, h) for k, h, _ in SHOWN).get(key, key)
        self.key = key
        self.figure = go.FigureWidget()
        for s in sides:
            self.figure.add_scatter(x=[], y=[], mode="lines+markers", name=s)
        self.figure.update_layout(
            title=f"{header} of each repeat, live (interleaved: one repeat of every side per round)",
            xaxis={"title": "repeat", "dtick": 1},
            yaxis={"title": header, "rangemode": "tozero"},
            height=360,
            legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 0},
            margin={"t": 90},
        )
        self._index = {s: i for i, s in enumerate(sides)}

    def add(self, side: str, repeat: int, summary: dict[str, Any]) -> None:
        tr = self.figure.data[self._index[side]]
        tr.x = (*tr.x, repeat)
        tr.y = (*tr.y, summary[self.key])


def compare_sides(rep: Repeats, baseline: str, new: str):
    """The real comparison (:func:`workbench.bench.regression.compare_results`) of two sides' repeats."""
    return compare_results(rep.summaries(baseline), rep.summaries(new))


def cli_compare(baseline: str | Path, new: str | Path, html: str | Path | None = None) -> tuple[int, str]:
    """Run ``workbench bench compare BASELINE NEW`` as a CI job would (a child process); return its exit code
    (0 passed, 1 regressed, 2 bad input) and its output."""
    cmd = [sys.executable, "-m", "workbench.cli", "bench", "compare", str(baseline), str(new)]
    if html is not None:
        cmd += ["--html", str(html)]
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "CLICOLOR_FORCE")} | {"NO_COLOR": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    return p.returncode, p.stdout + p.stderr


def verdict_cases(rep: Repeats, baseline: str = "baseline", new: str = "no_prefix_caching") -> list[dict[str, Any]]:
    """Exercise 19.1's cases from the measured repeats: per gated metric of a ``workbench run`` summary, the two
    sides' repeats and whether higher is better."""
    from workbench.bench.regression import metrics_of

    b, n = rep.summaries(baseline), rep.summaries(new)
    return [
        {"baseline": [r[m.key] for r in b], "new": [r[m.key] for r in n], "higher_is_better": m.higher_is_better}
        for m in metrics_of(b[0])
        if m.gated
    ]


def gated_verdicts(report) -> dict[str, str]:
    """``{metric key: verdict}`` of the report's gated metrics."""
    return {r["key"]: r["verdict"] for r in report.rows if r["gated"]}


def rerun_verdict(report, exit_code: int) -> str:
    """What the noise-only comparison found, in words that hold on any machine.

    A rerun of the baseline's configuration differs from it by the machine's noise alone, so it passes unless the
    machine's speed moved by more than the gate while the repeats ran (another program busy beside the kernel, a
    CPU changing its clock). When that happened this says so, with each regressed metric's ratio, instead of leaving
    a failed gate unexplained.

    Args:
        report: :func:`compare_sides` of the baseline and the rerun.
        exit_code: ``workbench bench compare``'s exit code on the same folders (:func:`cli_compare`).
    """
    line = f"passed: {report.passed} | exit code: {exit_code}"
    if report.passed:
        return line
    moved = ", ".join(f"{r['key']} {r['ratio']:.2f}x" for r in report.regressions)
    return (
        f"{line}\nThe same configuration 'regressed' ({moved}): this machine's speed changed by more than the gate "
        "allows while the repeats ran, so the gate saw noise. Record the repeats again on a quieter machine, or with "
        "more of them (record_repeats(..., repeats=5)): the median then sees through more of it."
    )


# ---------------------------------------------------------------- exercises
def _verdict19(baseline: list, new: list, higher_is_better: bool) -> str:
    import statistics

    ratio = statistics.median(new) / statistics.median(baseline)
    if higher_is_better:
        return "regressed" if ratio < 0.80 else "improved" if ratio > 1 / 0.80 else "ok"
    return "regressed" if ratio > 1.20 else "improved" if ratio < 1 / 1.20 else "ok"


@_register(
    "19.1",
    "Write verdict(baseline, new, higher_is_better) -> 'regressed' | 'improved' | 'ok' for one metric: baseline and "
    "new are lists of repeats; compare their medians with the dashboard's limits (a latency regressed above 1.20x "
    "the baseline, a throughput below 0.80x; improved beyond the inverse limits). The answer is the function.",
    "ratio = median(new) / median(baseline); for a latency (higher_is_better False) above 1.20 is regressed, below "
    "1/1.20 improved; for a throughput below 0.80 is regressed, above 1/0.80 improved.",
)
class _Verdict:
    @staticmethod
    def solution(cases: list):
        return _verdict19

    @staticmethod
    def judge(answer, cases: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function verdict(baseline, new, higher_is_better), got {answer!r}"
        for c in cases:
            want = _verdict19(c["baseline"], c["new"], c["higher_is_better"])
            try:
                got = answer(list(c["baseline"]), list(c["new"]), c["higher_is_better"])
            except Exception as e:  # noqa: BLE001 - the learner's code: any error is a wrong answer
                return False, f"verdict raised {type(e).__name__}: {e} on {c}"
            if got != want:
                return False, (
                    f"on baseline {c['baseline']}, new {c['new']}, higher_is_better={c['higher_is_better']}: got "
                    f"{got!r}, want {want!r} (medians, not means: one outlier repeat must not move the verdict)"
                )
        return True, f"all {len(cases)} cases right: medians over repeats, limits 1.20x / 0.80x"


def _regressed19(rows: list) -> set:
    return {r["key"] for r in rows if r["gated"] and r["verdict"] == "regressed"}


@_register(
    "19.2",
    "From this comparison's rows, which gated metrics regressed? (a set of metric keys, e.g. {'ttft_p50_s'})",
    "look at the rows whose 'gated' is True and whose 'verdict' is 'regressed'; tail percentiles are not gated.",
)
class _WhichRegressed:
    @staticmethod
    def solution(rows: list) -> set:
        return _regressed19(rows)

    @staticmethod
    def judge(answer, rows: list) -> tuple[bool, str]:
        if isinstance(answer, str):
            answer = {answer}
        try:
            got = {str(a) for a in answer}
        except TypeError:
            return False, f"give a set of metric keys, got {answer!r}"
        labels = {r["metric"]: r["key"] for r in rows}
        got = {labels.get(a, a) for a in got}  # a label ('TTFT median') counts as its key
        keys = {r["key"] for r in rows}
        if got - keys:
            return False, f"{sorted(got - keys)} are not metrics of this report; its keys are {sorted(keys)}"
        want = _regressed19(rows)
        if got == want:
            return True, f"{sorted(want)}: the gated metrics past their limit"
        ungated = {r["key"] for r in rows if not r["gated"]} & got
        if ungated:
            return False, f"{sorted(ungated)} are tail percentiles: reported, not gated"
        return False, f"not quite: {len(want)} gated metric(s) regressed; compare each ratio with its limit"
