"""Chapter 17: load testing a real ``workbench serve`` with ``workbench bench serve``.

- :func:`start_server` — :class:`workbench.server.launcher.ServerProcess` (a child process on 127.0.0.1, a free
  port, ``/health`` awaited, stopped by PID) with the chapter's small engine, registered so that it is stopped
  when the kernel exits even if a later cell fails (:func:`stop_all` stops every one now);
- :func:`bench` — one ``bench serve`` run (vLLM's result dict, with the per-request ``ttfts`` / ``itls`` lists);
- :class:`LiveSweep` — a capacity sweep over offered request rates, plotted live in a plotly ``FigureWidget``:
  achieved throughput and TTFT per rate as each rate finishes, and the server's waiting / running queue polled
  from ``/metrics`` while the load runs;
- :func:`knee`, :func:`completion_rate`, :func:`request_tpots`, :func:`goodput_fraction` — the rules the exercises check;
- tables (:func:`sweep_table`, :func:`compare_table`) and figures.

Numbers here are seconds and milliseconds measured on whatever CPU runs the notebook: they vary run to run.
"""

from __future__ import annotations

import atexit
import math
import re
import threading
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.labs.exercise_registry import _number, _register
from workbench.viz.table import Column, Table

#: the chapter's server: a small context and one thread (2 shared CPU cores)
SERVER_DEFAULTS: dict[str, Any] = {"max_model_len": 256, "threads": 1}
#: the chapter's load: short random prompts and outputs, seeded
LOAD_DEFAULTS: dict[str, Any] = {
    "dataset_name": "random",
    "random_input_len": 32,
    "random_output_len": 16,
    "seed": 0,
    "temperature": 0.0,
    "save_detailed": True,
    "disable_tqdm": True,
    "print_result": False,
}

_SERVERS: list = []


def start_server(**engine_args: Any):
    """Start ``workbench serve`` on 127.0.0.1 (a free port) and wait for ``/health``.

    Args:
        **engine_args: engine arguments (``max_num_seqs=2``...) over :data:`SERVER_DEFAULTS`.

    Returns:
        the started :class:`~workbench.server.launcher.ServerProcess` (``.base_url``, ``.pid``, ``.stop()``).

    Raises:
        RuntimeError: the server exited or did not answer ``/health`` (the message has the end of its log).
    """
    from workbench.server.launcher import ServerProcess

    srv = ServerProcess(**(SERVER_DEFAULTS | engine_args))
    _SERVERS.append(srv)  # registered before it starts: stop_all / atexit stop it even if start fails half-way
    try:
        srv.start()
    except BaseException:
        _SERVERS.remove(srv)  # start() already stopped what it had started; stop_all counts running servers only
        srv.stop()
        raise
    return srv


def stop_all() -> list[int | None]:
    """Stop every server :func:`start_server` started (SIGTERM, then SIGKILL); their exit codes."""
    codes = []
    while _SERVERS:
        srv = _SERVERS.pop()
        try:
            codes.append(srv.stop())
        except Exception:  # noqa: BLE001 - stop the others anyway
            codes.append(None)
    return codes


atexit.register(stop_all)


def queue_depth(base_url: str) -> tuple[float, float]:
    """``(waiting, running)`` requests now, from the server's Prometheus ``/metrics``
    (``vllm:num_requests_waiting`` / ``vllm:num_requests_running``). Raises ``OSError`` when unreachable."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for name in ("waiting", "running"):
        m = re.search(rf"^vllm:num_requests_{name}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else float("nan")
    return out["waiting"], out["running"]


def bench(base_url: str, request_rate: float, num_prompts: int = 10, burstiness: float = 1.0, **kw: Any) -> dict:
    """One ``workbench bench serve`` run against ``base_url`` (:data:`LOAD_DEFAULTS` unless given in ``kw``).

    Returns:
        vLLM's result dict (``request_throughput`` req/s, ``median_ttft_ms``, ``p99_ttft_ms``, ``ttfts`` s per
        request, ``itls`` s per token per request, ``duration`` s, ...).
    """
    from workbench.bench.serve import run_bench_serve

    args = LOAD_DEFAULTS | {"num_prompts": num_prompts, "request_rate": request_rate, "burstiness": burstiness} | kw
    return run_bench_serve(base_url=base_url, **args)


# ---------------------------------------------------------------- per-request rules (the exercises')
def request_tpots(itls: Sequence[Sequence[float]]) -> list[float | None]:
    """Time per output token of each request in seconds: the mean of its inter-token latencies (``None`` for a
    request with one token or fewer)."""
    return [float(np.mean(x)) if len(x) else None for x in itls]


def goodput_fraction(ttfts: Sequence[float | None], tpots: Sequence[float | None], slo_ttft_s: float,
                     slo_tpot_s: float) -> float:  # fmt: skip
    """Fraction of requests that met both SLOs: ``ttft <= slo_ttft_s`` and ``tpot <= slo_tpot_s`` (seconds; a
    failed request, ``None`` TTFT, misses; a ``None`` TPOT — one output token — meets the TPOT SLO).
    Goodput in req/s is this fraction × completed / duration (what ``bench serve --goodput`` reports)."""
    if not ttfts:
        return 0.0
    good = sum(1 for a, b in zip(ttfts, tpots) if a is not None and a <= slo_ttft_s and (b is None or b <= slo_tpot_s))
    return good / len(ttfts)


def completion_rate(start_times: Sequence[float], latencies: Sequence[float | None]) -> float | None:
    """Requests per second a server completed while the load ran: (completed − 1) / the time from the first
    completion to the last (a completion = send + E2EL). A server that keeps up completes requests as they
    arrive, so this matches the rate they were sent at; one that falls behind completes them at its capacity
    however fast they arrive. Unlike completed / duration, the rate does not fall because the last requests
    take their latency to finish after the last send. ``None`` with fewer than two completed requests."""
    ends = sorted(t + e for t, e in zip(start_times, latencies) if e is not None)
    if len(ends) < 2 or ends[-1] <= ends[0]:
        return None
    return (len(ends) - 1) / (ends[-1] - ends[0])


def peak_in_flight(start_times: Sequence[float], latencies: Sequence[float | None]) -> int:
    """The most completed requests whose [send, send + E2EL) intervals overlap (vLLM's
    ``max_concurrent_requests`` counts requests per one-second bucket instead, which overstates it)."""
    ev = sorted([(t, 1) for t, e in zip(start_times, latencies) if e is not None]
                + [(t + e, -1) for t, e in zip(start_times, latencies) if e is not None])  # fmt: skip
    peak = cur = 0
    for _, d in ev:  # an end sorts before a start at the same time
        cur += d
        peak = max(peak, cur)
    return peak


def knee(rows: Sequence[dict], frac: float = 0.8) -> float | None:
    """The knee of a capacity sweep: the lowest ``offered`` rate whose ``achieved`` completion rate is below
    ``frac`` of it — from there the server completes fewer requests per second than arrive and the waiting
    queue grows. ``None`` when the server kept up at every rate. Rows need ``offered`` and ``achieved`` (req/s;
    :func:`summarize` computes ``achieved`` with :func:`completion_rate`)."""
    for r in sorted(rows, key=lambda r: r["offered"]):
        if r["achieved"] < frac * r["offered"]:
            return r["offered"]
    return None


def summarize(res: dict, offered: float, slo: dict | None = None, label: str = "") -> dict:
    """One row from a ``bench serve`` result kept with ``save_detailed``: offered rate and ``achieved``
    completion rate (req/s, :func:`completion_rate`; ``throughput`` is vLLM's completed / duration), TTFT
    p50/p99 (ms), TPOT p50 (ms), the most requests in flight (:func:`peak_in_flight`), and goodput (req/s, when ``slo`` =
    ``{"ttft_s", "tpot_s"}`` is given)."""
    achieved = completion_rate(res["start_times"], res["latencies"])
    row = {"label": label, "offered": offered,
           "achieved": res["request_throughput"] if achieved is None else achieved,
           "throughput": res["request_throughput"],
           "output_tps": res["output_throughput"], "ttft_p50": res["median_ttft_ms"], "ttft_p99": res["p99_ttft_ms"],
           "tpot_p50": res["median_tpot_ms"], "max_inflight": peak_in_flight(res["start_times"], res["latencies"]),
           "completed": res["completed"], "duration": res["duration"],
           "ttfts": list(res["ttfts"]), "tpots": request_tpots(res["itls"])}  # fmt: skip
    if slo:
        f = goodput_fraction(row["ttfts"], row["tpots"], slo["ttft_s"], slo["tpot_s"])
        row["good_frac"], row["goodput"] = f, f * len(row["ttfts"]) / res["duration"]
    return row


# ---------------------------------------------------------------- the live sweep
class LiveSweep:
    """A capacity sweep with a live ``FigureWidget``: three panels — achieved vs offered rate, TTFT p50 / p99 vs
    offered rate (a point per rate as it finishes), and the server's waiting / running requests over time
    (polled from ``/metrics`` every ``poll_s`` seconds while the load runs).

    Raises:
        ImportError: (constructing) ipywidgets / anywidget missing.
    """

    def __init__(self, base_url: str, poll_s: float = 0.5):
        self.base_url, self.poll_s = base_url, poll_s
        self.rows: list[dict] = []
        self.samples: list[dict] = []  # {"t", "rate", "waiting", "running"}
        self.t0 = time.monotonic()
        fig = make_subplots(rows=3, cols=1, vertical_spacing=0.11,
                            subplot_titles=("achieved vs offered rate", "TTFT vs offered rate",
                                            "server queue while the load runs (from /metrics)"))  # fmt: skip
        self.figure = go.FigureWidget(fig)
        f = self.figure
        f.add_scatter(x=[], y=[], mode="lines", name="offered = achieved", line={"dash": "dot", "color": "grey"},
                      row=1, col=1)  # fmt: skip
        f.add_scatter(x=[], y=[], mode="lines+markers", name="achieved (req/s)", row=1, col=1)
        f.add_scatter(x=[], y=[], mode="lines+markers", name="TTFT p50 (ms)", row=2, col=1)
        f.add_scatter(x=[], y=[], mode="lines+markers", name="TTFT p99 (ms)", row=2, col=1)
        f.add_scatter(x=[], y=[], mode="lines", name="waiting", row=3, col=1)
        f.add_scatter(x=[], y=[], mode="lines", name="running", row=3, col=1)
        f.update_layout(height=800, title={"text": "Capacity sweep, live", "y": 0.985, "yanchor": "top"},
                        hovermode="x unified", margin={"t": 130},
                        legend={"orientation": "h", "y": 1.045, "yanchor": "bottom", "x": 0})  # fmt: skip
        f.update_xaxes(title="offered rate (req/s)", row=1, col=1)
        f.update_xaxes(title="offered rate (req/s)", row=2, col=1)
        f.update_xaxes(title="seconds since the sweep started", row=3, col=1)
        f.update_yaxes(title="req/s", rangemode="tozero", row=1, col=1)
        f.update_yaxes(title="ms", rangemode="tozero", row=2, col=1)
        f.update_yaxes(title="requests", rangemode="tozero", row=3, col=1)

    def run_rate(self, rate: float, num_prompts: int = 10, **kw: Any) -> dict:
        """Run ``bench serve`` at ``rate`` in a thread, poll the queue meanwhile, add the point; the row
        (:func:`summarize`). Raises what the load raised."""
        box: dict = {}

        def load() -> None:
            try:
                box["res"] = bench(self.base_url, rate, num_prompts, **kw)
            except Exception as e:  # noqa: BLE001 - raised below, in the notebook's thread
                box["err"] = e

        th = threading.Thread(target=load, name=f"load-{rate}", daemon=True)
        th.start()
        while th.is_alive():
            self._poll(rate)
            th.join(self.poll_s)
        self._poll(rate)
        if "err" in box:
            raise box["err"]
        row = summarize(box["res"], rate, label=f"{rate:.2f} req/s")
        row["max_waiting"] = max((s["waiting"] for s in self.samples if s["rate"] == rate), default=0.0)
        self.rows.append(row)
        self._add_point()
        return row

    def _poll(self, rate: float) -> None:
        try:
            w, r = queue_depth(self.base_url)
        except OSError:
            return
        t = time.monotonic() - self.t0
        self.samples.append({"t": t, "rate": rate, "waiting": w, "running": r})
        with self.figure.batch_update():
            for i, v in ((4, w), (5, r)):
                tr = self.figure.data[i]
                tr.x, tr.y = (*tr.x, t), (*tr.y, v)

    def _add_point(self) -> None:
        rows = sorted(self.rows, key=lambda r: r["offered"])
        xs = [r["offered"] for r in rows]
        with self.figure.batch_update():
            d = self.figure.data
            d[0].x, d[0].y = (0, max(xs)), (0, max(xs))
            d[1].x, d[1].y = xs, [r["achieved"] for r in rows]
            d[2].x, d[2].y = xs, [r["ttft_p50"] for r in rows]
            d[3].x, d[3].y = xs, [r["ttft_p99"] for r in rows]

    def mark_knee(self, rate: float | None) -> None:
        """A dashed line at the knee's offered rate on the first two panels."""
        if rate is None:
            return
        for yref, xref in (("y domain", "x"), ("y2 domain", "x2")):
            self.figure.add_shape(type="line", x0=rate, x1=rate, xref=xref, yref=yref, y0=0, y1=1,
                                  line={"color": "red", "dash": "dash", "width": 1.5})  # fmt: skip
        self.figure.add_annotation(x=rate, xref="x", yref="y domain", y=0.95, xanchor="left", yanchor="top",
                                   showarrow=False, text=f" knee ≈ {rate:.2f} req/s", font={"color": "red"})  # fmt: skip

    def static(self) -> go.Figure:
        """The figure as a plain ``go.Figure`` (stored in the notebook; a widget's state is not)."""
        return go.Figure(self.figure)


# ---------------------------------------------------------------- tables and figures
def _f(n: int):
    return lambda v: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{n}f}"


def sweep_table(rows: Sequence[dict], slo: dict | None = None) -> Table:
    """The sweep, one row per offered rate (req/s, ms); goodput columns when rows carry them."""
    cols = [Column("offered", "offered (req/s)", _f(2)), Column("achieved", "achieved (req/s)", _f(2)),
            Column("ttft_p50", "TTFT p50 (ms)", _f(0)), Column("ttft_p99", "TTFT p99 (ms)", _f(0)),
            Column("tpot_p50", "TPOT p50 (ms)", _f(0)), Column("max_inflight", "most in flight"),
            Column("max_waiting", "most waiting (polled)", _f(0))]  # fmt: skip
    if rows and "goodput" in rows[0]:
        cols += [Column("good_frac", "met SLO (%)", lambda v: f"{100 * v:.0f}"),
                 Column("goodput", "goodput (req/s)", _f(2))]  # fmt: skip
    return Table(cols, sorted(rows, key=lambda r: r["offered"]))


def goodput_figure(rows: Sequence[dict], slo: dict) -> go.Figure:
    """Throughput and goodput (req/s) against offered rate, with the line offered = achieved."""
    rows = sorted(rows, key=lambda r: r["offered"])
    xs = [r["offered"] for r in rows]
    fig = go.Figure()
    fig.add_scatter(x=[0, max(xs)], y=[0, max(xs)], mode="lines", name="offered", line={"dash": "dot", "color": "grey"})
    fig.add_scatter(x=xs, y=[r["achieved"] for r in rows], mode="lines+markers", name="throughput")
    fig.add_scatter(x=xs, y=[r["goodput"] for r in rows], mode="lines+markers", name="goodput")
    fig.update_layout(title=f"Goodput under the SLO TTFT ≤ {1000 * slo['ttft_s']:.0f} ms, TPOT ≤ "
                      f"{1000 * slo['tpot_s']:.0f} ms", hovermode="x unified", height=400,
                      xaxis_title="offered rate (req/s)", yaxis_title="requests per second",
                      legend={"orientation": "h", "y": -0.25})  # fmt: skip
    return fig


def ttft_cdf_figure(rows: Sequence[dict], title: str) -> go.Figure:
    """The empirical CDF of per-request TTFT (ms) of each row (``label`` names the curve)."""
    fig = go.Figure()
    for r in rows:
        x = sorted(1000 * t for t in r["ttfts"] if t is not None)
        fig.add_scatter(x=x, y=[(i + 1) / len(x) for i in range(len(x))], mode="lines+markers",
                        line={"shape": "hv"}, name=r["label"])  # fmt: skip
    fig.update_layout(title=title, xaxis_title="TTFT (ms)", yaxis_title="fraction of requests", height=400,
                      hovermode="closest", legend={"orientation": "h", "y": -0.25})  # fmt: skip
    return fig


def compare_table(rows: Sequence[dict]) -> Table:
    """Runs side by side (``label`` first): offered and achieved rate, completed / duration, TTFT p50 / p99,
    TPOT p50, most in flight, SLO met."""
    cols = [Column("label", "run", align="left"), Column("offered", "offered (req/s)", _f(2)),
            Column("achieved", "achieved (req/s)", _f(2)), Column("throughput", "completed / duration", _f(2)),
            Column("ttft_p50", "TTFT p50 (ms)", _f(0)),
            Column("ttft_p99", "TTFT p99 (ms)", _f(0)), Column("tpot_p50", "TPOT p50 (ms)", _f(0)),
            Column("max_inflight", "most in flight")]  # fmt: skip
    if rows and "good_frac" in rows[0]:
        cols.append(Column("good_frac", "met SLO (%)", lambda v: f"{100 * v:.0f}"))
    return Table(cols, list(rows))


__all__ = [
    "LOAD_DEFAULTS",
    "SERVER_DEFAULTS",
    "LiveSweep",
    "apply_slo",
    "slo_from",
    "bench",
    "compare_table",
    "goodput_figure",
    "goodput_fraction",
    "completion_rate",
    "knee",
    "peak_in_flight",
    "queue_depth",
    "request_tpots",
    "start_server",
    "stop_all",
    "summarize",
    "sweep_table",
    "ttft_cdf_figure",
]


def apply_slo(rows: Sequence[dict], slo: dict) -> list[dict]:
    """Add ``good_frac`` (:func:`goodput_fraction`) and ``goodput`` (good requests / duration, req/s) to each row
    under ``slo`` = ``{"ttft_s", "tpot_s"}`` (seconds); the same rows."""
    for r in rows:
        r["good_frac"] = goodput_fraction(r["ttfts"], r["tpots"], slo["ttft_s"], slo["tpot_s"])
        r["goodput"] = r["good_frac"] * len(r["ttfts"]) / r["duration"]
    return list(rows)


def slo_from(row: dict, ttft_factor: float = 3.0, tpot_factor: float = 1.5) -> dict:
    """An SLO relative to what this machine measures: TTFT ≤ ``ttft_factor`` × the row's median TTFT and
    TPOT ≤ ``tpot_factor`` × its median TPOT, rounded up to 10 ms (``{"ttft_s", "tpot_s"}`` in seconds)."""
    up = lambda ms: math.ceil(ms / 10) * 10 / 1000  # noqa: E731
    return {"ttft_s": up(ttft_factor * row["ttft_p50"]), "tpot_s": up(tpot_factor * row["tpot_p50"])}


# ---------------------------------------------------------------- exercises
def _knee17(rows: list, frac: float) -> float | None:

    return knee(rows, frac)


@_register(
    "17.1",
    "From the sweep's rows (offered and achieved req/s), which offered rate is the knee — the lowest offered rate "
    "whose achieved throughput is below `frac` of it? (a rate in req/s, or None if the server kept up everywhere)",
    "sort the rows by offered rate; the first one with achieved < frac × offered is where completions stop "
    "keeping up with arrivals and the waiting queue grows.",
)
class _Knee:
    @staticmethod
    def solution(rows: list, frac: float) -> float | None:
        return _knee17(rows, frac)

    @staticmethod
    def judge(answer, rows: list, frac: float) -> tuple[bool, str]:
        want = _knee17(rows, frac)
        if want is None:
            if answer is None:
                return True, "None: the server kept up at every offered rate; sweep higher to find the knee"
            return False, f"at every rate achieved ≥ {frac} × offered: the answer is None"
        if answer is None:
            return False, "one row has achieved below frac × offered: look again"
        x = _number(answer)
        if x is None:
            return False, f"give an offered rate in req/s, got {answer!r}"
        if abs(x - want) <= 0.01 * want:
            r = next(r for r in rows if r["offered"] == want)
            return True, (
                f"{want:.2f} req/s offered, {r['achieved']:.2f} req/s achieved: from here on requests arrive "
                "faster than they finish"
            )
        for r in rows:
            if abs(x - r["achieved"]) <= 0.01 * max(r["achieved"], 1e-9):
                return False, "that is an achieved rate; the question asks for the offered rate at the knee"
        if any(abs(x - r["offered"]) <= 0.01 * r["offered"] for r in rows):
            if x > want:
                return False, "a lower offered rate already falls below frac × offered: take the lowest"
            return False, f"at {x:.2f} req/s the server still achieves at least {frac} × offered"
        return False, f"{answer!r} is not one of the offered rates {sorted(r['offered'] for r in rows)}"


def _good17(ttfts: list, tpots: list, slo_ttft_s: float, slo_tpot_s: float) -> float:

    return goodput_fraction(ttfts, tpots, slo_ttft_s, slo_tpot_s)


@_register(
    "17.2",
    "Per-request TTFT and TPOT (seconds) and an SLO: what fraction of the requests met it? (a number from 0 to 1)",
    "a request is good only if its TTFT ≤ slo_ttft_s AND its TPOT ≤ slo_tpot_s (a TPOT of None — one output "
    "token — meets the TPOT part; a TTFT of None is a failed request); divide the good ones by all requests.",
)
class _GoodFraction:
    @staticmethod
    def solution(ttfts: list, tpots: list, slo_ttft_s: float, slo_tpot_s: float) -> float:
        return _good17(ttfts, tpots, slo_ttft_s, slo_tpot_s)

    @staticmethod
    def judge(answer, ttfts: list, tpots: list, slo_ttft_s: float, slo_tpot_s: float) -> tuple[bool, str]:
        want = _good17(ttfts, tpots, slo_ttft_s, slo_tpot_s)
        n = len(ttfts)
        x = _number(answer)
        if x is None:
            return False, f"give a fraction from 0 to 1, got {answer!r}"
        if abs(x - want) <= 0.005:
            return True, f"{want:.3f}: {round(want * n)} of {n} requests met both the TTFT and the TPOT target"
        if abs(x - 100 * want) <= 0.5 and want > 0.01:
            return False, "that is a percentage; give the fraction (0 to 1)"
        if abs(x - want * n) <= 0.5 and n > 1:
            return False, "that is the number of good requests; divide by all requests"
        only_ttft = sum(1 for a in ttfts if a is not None and a <= slo_ttft_s) / max(n, 1)
        only_tpot = sum(1 for a, b in zip(ttfts, tpots) if a is not None and (b is None or b <= slo_tpot_s)) / max(n, 1)
        if abs(x - only_ttft) <= 0.005:
            return False, "that counts TTFT only; a good request must also meet the TPOT target"
        if abs(x - only_tpot) <= 0.005:
            return False, "that counts TPOT only; a good request must also meet the TTFT target"
        return False, f"{answer!r} is {'too high' if x > want else 'too low'}: good = both targets met"
