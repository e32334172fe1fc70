"""Chapter 16: a case study investigated as an incident, in the simulator.

The report: Llama-2-70B on 4 x A100-80GB (``tensor_parallel_size`` 4), ``gpu_memory_utilization`` 0.9,
``max_num_seqs`` 256; after two hours TTFT went from about 180 ms to about 650 ms and throughput from 12 to
7 requests/s, and 12 GB per GPU showed as "allocated but unused" (:data:`CASE`). The chapter replays the
deployment on the simulated server (:mod:`workbench.sim`: the real scheduler and KV managers on a simulated
clock, uncalibrated A100 cost model), reads the per-window timeline and the step records, and tests each
hypothesis with its own replay (:func:`hypothesis_rows`):

- fragmentation of the paged pool, a contiguous allocator (``kv_allocator="orca-max"``), preemption,
  queueing above capacity, output-length drift, NCCL buffers;
- "allocated but unused" of a pool preallocated at startup: ``pool bytes x (1 - KV utilization)`` per GPU,
  split into free slots and slots held without a token state (:func:`unused_rows`).

Everything here is deterministic: seeded traces, simulated time (only ``replay_wall_s`` varies).
The long two-hour replays are in ``docs/benchmarks.md`` (section "The case study: 70B on 4×A100-80GB";
``benchmarks/simulate.py case-study``); the chapter's replays are minutes long.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.labs.exercise_registry import _number, _register
from workbench.labs.multigpu_common import _Panel
from workbench.viz.table import Column, Table

GiB = 1 << 30
MiB = 1 << 20

#: what the incident report says (the symptoms the diagnosis must explain)
CASE: dict[str, Any] = {
    "model": "llama-2-70b",
    "gpu": "A100-80GB",
    "tensor_parallel_size": 4,
    "gpu_memory_utilization": 0.9,
    "max_num_seqs": 256,
    "ttft_before_ms": 180,
    "ttft_after_ms": 650,
    "throughput_before_req_s": 12.0,
    "throughput_after_req_s": 7.0,
    "hours": 2,
    "unused_gb_per_gpu": 12,
}

#: the hypotheses, in the order the chapter tests them
HYPOTHESES = (
    "fragmentation",
    "contiguous_allocator",
    "preemption",
    "queueing",
    "output_length_drift",
    "nccl_buffers",
)


def case_spec(nccl_nchannels: int | None = None):
    """The simulated deployment: :data:`CASE`'s model on 4 of its GPUs (float16 weights and KV).

    Returns:
        a :class:`workbench.sim.SimSpec`.
    """
    from workbench.catalog import MODELS
    from workbench.sim import SimSpec, find_hardware

    return SimSpec(
        MODELS[CASE["model"]],
        find_hardware(CASE["gpu"]),
        CASE["tensor_parallel_size"],
        nccl_nchannels=nccl_nchannels,
    )


def case_trace(rate: float, duration_s: float, *, seed: int = 0, output_scale: float = 1.0, drift_at_s: float = 0.0):
    """ShareGPT-like requests (:func:`workbench.sim.make_trace`) arriving as a Poisson process at ``rate``
    requests/s for ``duration_s`` simulated seconds; requests arriving at or after ``drift_at_s`` have their
    output lengths multiplied by ``output_scale`` (output-length drift: the same users, longer answers).

    Raises:
        ValueError: ``output_scale <= 0``, or what :func:`workbench.sim.make_trace` raises.
    """
    from workbench.sim import make_trace

    if isinstance(output_scale, bool) or not isinstance(output_scale, (int, float)) or not output_scale > 0:
        raise ValueError(f"output_scale={output_scale!r} must be a number > 0 (1.0 = no drift)")
    if not 0 <= drift_at_s < duration_s:
        raise ValueError(
            f"drift_at_s={drift_at_s!r} must lie in [0, duration_s={duration_s!r}) seconds: later, no request drifts"
        )
    trace = make_trace(rate, duration_s, "sharegpt", "poisson", seed)
    if output_scale == 1.0:
        return trace
    return [
        replace(r, output_len=max(1, round(r.output_len * output_scale))) if r.arrival_s >= drift_at_s else r
        for r in trace
    ]


@dataclass
class CaseRun:
    """One replay: its settings, the summary (:func:`workbench.sim.run.simulate_job`), per-window rows
    (:func:`window_rows`) and the memory budget per GPU (``MemoryBudget.to_dict()``)."""

    label: str
    rate: float
    duration_s: float
    engine_args: dict[str, Any]
    summary: dict[str, Any]
    windows: list[dict[str, Any]]
    memory: dict[str, Any]
    num_requests: int
    replay_wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def window_rows(steps: Sequence[Any], timeline: Sequence[dict], window_s: float) -> list[dict[str, Any]]:
    """The simulator's timeline (:func:`workbench.sim.run.timeline`: arrivals, finishes, TTFT per window) with
    the engine's state averaged over the steps that started in each window: ``running``, ``waiting``,
    ``kv_utilization``, ``fragmentation_rate``, ``free_frac`` / ``waste_frac`` (free slots / slots held without
    a token state, shares of the pool), ``preemptions`` (sum) and ``step_ms`` (median step time)."""
    rows = []
    for w in timeline:
        ss = [s for s in steps if w["t_start_s"] <= s.time_s < w["t_start_s"] + window_s]
        n = max(1, len(ss))
        pool = [s.num_blocks * s.block_size for s in ss]
        rows.append(
            dict(w)
            | {
                "arrived_req_s": w["arrived"] / max(w["t_end_s"] - w["t_start_s"], 1e-9),
                "running": sum(s.num_running for s in ss) / n,
                "waiting": sum(s.num_waiting for s in ss) / n,
                "kv_utilization": sum(s.kv_utilization for s in ss) / n,
                "fragmentation_rate": sum(s.fragmentation_rate for s in ss) / n,
                "free_frac": sum(s.free / p for s, p in zip(ss, pool)) / n,
                "waste_frac": sum(
                    (s.reservation + s.internal_fragmentation + s.external_fragmentation) / p for s, p in zip(ss, pool)
                )
                / n,
                "preemptions": sum(s.num_preemptions for s in ss),
                "step_ms": statistics.median(s.wall_time_s for s in ss) * 1e3 if ss else None,
                "steps": len(ss),
            }
        )
    return rows


def replay(
    rate: float,
    duration_s: float = 300.0,
    *,
    label: str | None = None,
    seed: int = 0,
    window_s: float = 60.0,
    output_scale: float = 1.0,
    drift_at_s: float = 0.0,
    nccl_nchannels: int | None = None,
    **engine_args: Any,
) -> CaseRun:
    """Replay :data:`CASE`'s deployment at ``rate`` requests/s for ``duration_s`` simulated seconds (the queue
    then drains), ``window_s``-second windows. ``engine_args`` override :data:`CASE`'s
    (``gpu_memory_utilization`` 0.9, ``max_num_seqs`` 256; e.g. ``kv_allocator="orca-max"``).

    Raises:
        ValueError: bad engine arguments, a rate or duration that is not positive, bad drift settings.
    """
    from workbench.sim.run import simulate_job

    for name, v in (("rate", rate), ("duration_s", duration_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
            raise ValueError(f"{name}={v!r} must be a finite number > 0 ({'req/s' if name == 'rate' else 'seconds'})")
    if nccl_nchannels is not None and (not isinstance(nccl_nchannels, int) or nccl_nchannels < 1):
        raise ValueError(
            f"nccl_nchannels={nccl_nchannels!r} must be a whole number of channels >= 1 (None: NCCL's default)"
        )
    args = {"gpu_memory_utilization": CASE["gpu_memory_utilization"], "max_num_seqs": CASE["max_num_seqs"]}
    args |= engine_args
    trace = case_trace(rate, duration_s, seed=seed, output_scale=output_scale, drift_at_s=drift_at_s)
    res = simulate_job(case_spec(nccl_nchannels), trace, output_dir=None, record_itl=False, window_s=window_s, **args)
    eng = res.engine
    steps = eng.recorder.steps
    return CaseRun(
        label=label or f"{rate:g} req/s",
        rate=rate,
        duration_s=duration_s,
        engine_args=args,
        summary=res.summary,
        windows=window_rows(steps, res.timeline, window_s),
        memory=eng.memory.to_dict(),
        num_requests=len(trace),
        replay_wall_s=res.replay_wall_s,
        extra={
            "max_running": max((s.num_running for s in steps), default=0),
            "blocks_used_peak": max((s.blocks_used for s in steps), default=0),
            "output_scale": output_scale,
            "drift_at_s": drift_at_s,
        },
    )


def arrival_windows(run: CaseRun) -> list[dict[str, Any]]:
    """The windows during which requests still arrived (the drain after the trace's end left out)."""
    return [w for w in run.windows if w["t_start_s"] < run.duration_s - 1e-9]


def mean_kv_utilization(run: CaseRun) -> float:
    """KV utilization (token states / pool slots) averaged over the arrival windows."""
    return statistics.fmean(w["kv_utilization"] for w in arrival_windows(run))


def capacity_req_s(run: CaseRun) -> float:
    """Finished requests/s over the arrival windows after the first (the first one fills the batch).

    For a replay above capacity this is the server's capacity; below it, the offered rate."""
    ws = arrival_windows(run)[1:] or arrival_windows(run)
    span = sum(w["t_end_s"] - w["t_start_s"] for w in ws)
    return sum(w["finished"] for w in ws) / span


# ---------------------------------------------------------------- tables and figures
def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1e3:,.0f} ms" if v < 10 else f"{v:,.0f} s"


def report_table() -> Table:
    """The incident report's symptoms beside what a replay can measure for each."""
    rows = [
        {"symptom": "TTFT", "reported": f"{CASE['ttft_before_ms']} ms → {CASE['ttft_after_ms']} ms after "
         f"{CASE['hours']} h", "measured_by": "TTFT p50 / p99 per window (requests arriving in it)"},
        {"symptom": "throughput", "reported": f"{CASE['throughput_before_req_s']:g} → "
         f"{CASE['throughput_after_req_s']:g} req/s", "measured_by": "finished requests per second per window"},
        {"symptom": "memory", "reported": f"{CASE['unused_gb_per_gpu']} GB per GPU allocated but unused",
         "measured_by": "KV pool per GPU × (1 − KV utilization), per window"},
    ]  # fmt: skip
    return Table(
        [
            Column("symptom", "symptom", align="left"),
            Column("reported", "reported", align="left"),
            Column("measured_by", "what the replay measures", align="left"),
        ],
        rows,
        title=f"{CASE['model']} on {CASE['tensor_parallel_size']}× {CASE['gpu']}, gpu_memory_utilization "
        f"{CASE['gpu_memory_utilization']}, max_num_seqs {CASE['max_num_seqs']}",
    )


_IN = "\u00a0\u00a0\u00a0"  # an indent that HTML keeps (a part of the line above)


def budget_rows(run: CaseRun) -> list[dict[str, Any]]:
    """One GPU's memory in the replay: what the engine allocates at startup (``capacity x utilization``)
    and where it goes; the KV pool's used and unused parts at the mean KV utilization of the arrival
    windows. Rows ``{"part", "bytes", "how"}``."""
    m = run.memory
    util = mean_kv_utilization(run)
    pool = m["kv_pool_bytes"]
    return [
        {"part": "capacity", "bytes": m["capacity_bytes"], "how": f"one {CASE['gpu']}"},
        {
            "part": "allocated at startup",
            "bytes": round(m["capacity_bytes"] * m["gpu_memory_utilization"]),
            "how": f"capacity × gpu_memory_utilization {m['gpu_memory_utilization']}: what nvidia-smi shows from the "
            "first second",
        },
        {"part": _IN + "weights (shard)", "bytes": m["weights_bytes"], "how": "float16 parameters / 4 ranks"},
        {
            "part": _IN + "activations",
            "bytes": m["activation_bytes"],
            "how": "one forward of max_num_batched_tokens (estimate)",
        },
        {
            "part": _IN + "NCCL buffers",
            "bytes": m["comm_buffer_bytes"],
            "how": "ring, NCCL's default channels (chapter 10)",
        },
        {
            "part": _IN + "KV pool",
            "bytes": pool,
            "how": f"{m['num_blocks']:,} blocks × {m['block_size']} tokens × {m['kv_bytes_per_token']:,} B/token",
        },  # fmt: skip
        {
            "part": _IN * 2 + "holding token states",
            "bytes": round(pool * util),
            "how": f"KV utilization {util:.1%} (mean)",
        },
        {
            "part": _IN * 2 + "allocated but unused",
            "bytes": round(pool * (1 - util)),
            "how": "free blocks + slots of used blocks with no token state",
        },  # fmt: skip
    ]


def budget_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`budget_rows` as a table (GiB and GB)."""
    return Table(
        [
            Column("part", "per GPU", align="left"),
            Column("gib", "GiB", "{:,.2f}".format),
            Column("gb", "GB", "{:,.1f}".format),
            Column("how", "where the figure comes from", align="left", prose=True),
        ],
        [dict(r) | {"gib": r["bytes"] / GiB, "gb": r["bytes"] / 1e9} for r in rows],
    )


def window_table(runs: Sequence[CaseRun]) -> Table:
    """Every replay's arrival windows (the drain after the trace's end left out): arrivals, finishes, TTFT, the
    batch, the queue, KV use, preemptions, step time."""
    rows = [w | {"run": run.label.replace(", paged", "")} for run in runs for w in arrival_windows(run)]
    return Table(
        [
            Column("run", "replay", align="left"),
            Column("t_start_s", "window from (s)", "{:,.0f}".format),
            Column("arrived_req_s", "arrived/s", "{:.2f}".format),
            Column("finished_req_s", "finished/s", "{:.2f}".format),
            Column("ttft_p50_s", "TTFT p50", _ms),
            Column("ttft_p99_s", "TTFT p99", _ms),
            Column("running", "running", "{:.0f}".format),
            Column("waiting", "waiting", "{:,.0f}".format),
            Column("kv_utilization", "KV util", "{:.1%}".format),
            Column("fragmentation_rate", "frag. rate", "{:.1%}".format),
            Column("preemptions", "preempt."),
            Column("step_ms", "step (ms)", lambda v: "-" if v is None else f"{v:.1f}"),
        ],
        rows,
    )


_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def timeline_figure(runs: Sequence[CaseRun], title: str = "The replays, window by window") -> go.Figure:
    """TTFT p50 (log scale), finished requests/s and the waiting queue per window, one colour per replay;
    the report's before/after values as dotted lines."""
    fig = make_subplots(
        rows=3,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.07,
        subplot_titles=("TTFT p50 of the requests arriving in the window", "finished requests per second",
                        "waiting requests (mean over the window's steps)"),
    )  # fmt: skip
    for i, run in enumerate(runs):
        ws = [w for w in run.windows if w["t_start_s"] < run.duration_s - 1e-9]
        x = [w["t_start_s"] for w in ws]
        c = _COLOURS[i % len(_COLOURS)]
        common = dict(mode="lines+markers", line={"color": c}, legendgroup=run.label)
        fig.add_trace(go.Scatter(x=x, y=[w["ttft_p50_s"] for w in ws], name=run.label, **common), 1, 1)
        fig.add_trace(go.Scatter(x=x, y=[w["finished_req_s"] for w in ws], showlegend=False, name=run.label,
                                 **common), 2, 1)  # fmt: skip
        fig.add_trace(go.Scatter(x=x, y=[w["waiting"] for w in ws], showlegend=False, name=run.label, **common), 3, 1)
    xs = [w["t_start_s"] for run in runs for w in arrival_windows(run)] or [0.0]
    for i, (y, row) in enumerate(
        (
            (CASE["ttft_before_ms"] / 1e3, 1),
            (CASE["ttft_after_ms"] / 1e3, 1),
            (CASE["throughput_before_req_s"], 2),
            (CASE["throughput_after_req_s"], 2),
        )
    ):  # the report's before / after values, dotted (a trace: hline labels land wrong on a log axis)
        fig.add_trace(
            go.Scatter(x=[min(xs), max(xs)], y=[y, y], mode="lines", line={"dash": "dot", "color": "grey"},
                       name="the report: before, after", legendgroup="report", showlegend=i == 0,
                       hovertemplate=f"reported: {y:g}<extra></extra>"),
            row, 1,
        )  # fmt: skip
    fig.update_yaxes(type="log", title="s", row=1, col=1)
    fig.update_yaxes(title="req/s", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title="requests", rangemode="tozero", row=3, col=1)
    fig.update_xaxes(title="simulated time (s), window start", row=3, col=1)
    fig.update_layout(title=title, height=720, hovermode="x unified", margin={"t": 110},
                      legend={"orientation": "h", "y": 1.06, "yanchor": "bottom", "x": 0})  # fmt: skip
    return fig


def unused_rows(run: CaseRun) -> list[dict[str, Any]]:
    """Per arrival window, one GPU's KV pool in GiB: ``used`` (token states), ``waste`` (held by requests
    without a token state: reservation and fragmentation), ``free`` (free blocks), ``unused`` = waste + free
    = pool x (1 - KV utilization)."""
    pool = run.memory["kv_pool_bytes"] / GiB
    return [
        {
            "t_start_s": w["t_start_s"],
            "used_gib": pool * w["kv_utilization"],
            "waste_gib": pool * w["waste_frac"],
            "free_gib": pool * w["free_frac"],
            "unused_gib": pool * (1 - w["kv_utilization"]),
        }
        for w in arrival_windows(run)
    ]


def unused_figure(runs: Sequence[CaseRun]) -> go.Figure:
    """One GPU's KV pool per window (stacked GiB: token states, held without a token state, free) for each
    replay side by side, with the reported 12 GB (11.2 GiB) unused as a line above the used part."""
    fig = make_subplots(rows=1, cols=len(runs), shared_yaxes=True, subplot_titles=[r.label for r in runs])
    for i, run in enumerate(runs, start=1):
        rows = unused_rows(run)
        x = [r["t_start_s"] for r in rows]
        for key, name, colour in (
            ("used_gib", "token states", "#1f77b4"),
            ("waste_gib", "held, no token state", "#d62728"),
            ("free_gib", "free blocks", "#c7c7c7"),
        ):
            fig.add_trace(
                go.Bar(x=x, y=[r[key] for r in rows], name=name, marker_color=colour, legendgroup=name,
                       showlegend=i == 1),
                1, i,
            )  # fmt: skip
        pool = run.memory["kv_pool_bytes"] / GiB
        label = {"annotation_text": "12 GB unused", "annotation_position": "top left", "annotation_font_size": 10}
        fig.add_hline(y=pool - CASE["unused_gb_per_gpu"] * 1e9 / GiB, row=1, col=i,
                      line={"dash": "dot", "color": "black"}, **(label if i == 1 else {}))  # fmt: skip
        fig.update_xaxes(title="window start (s)", row=1, col=i)
    fig.update_yaxes(title="GiB per GPU", row=1, col=1)
    fig.update_layout(barmode="stack", title="One GPU's KV pool, preallocated at startup: what holds token states",
                      height=460, margin={"t": 110}, hovermode="x unified",
                      legend={"orientation": "h", "y": 1.1, "yanchor": "bottom", "x": 0})  # fmt: skip
    return fig


# ---------------------------------------------------------------- hypotheses
def nccl_rows(channels: Sequence[int] = (2, 4, 8, 16, 32)) -> list[dict[str, Any]]:
    """One rank's NCCL buffers (ring, 4 ranks) at each channel count, in bytes (:func:`workbench.sim.engine.
    comm_buffer_bytes`)."""
    from workbench.sim.engine import comm_buffer_bytes

    n = CASE["tensor_parallel_size"]
    return [{"nchannels": c, "bytes": comm_buffer_bytes(n, c)} for c in channels]


def hypothesis_runs(duration_s: float = 300.0, seed: int = 0) -> dict[str, CaseRun]:
    """The replays the hypotheses need: the case at 12 and 9 req/s (paged), a contiguous allocator
    (``orca-max``) at 12 req/s, and output-length drift (outputs x1.8 from half-way) at 7 req/s."""
    return {
        "paged_12": replay(12, duration_s, label="12 req/s, paged", seed=seed),
        "paged_9": replay(9, duration_s, label="9 req/s, paged", seed=seed),
        "orca_12": replay(12, duration_s, label="12 req/s, orca-max", seed=seed, kv_allocator="orca-max"),
        "drift_7": replay(7, duration_s, label="7 req/s, outputs ×1.8 from half-way", seed=seed, output_scale=1.8,
                          drift_at_s=duration_s / 2),
    }  # fmt: skip


def _first_last(run: CaseRun, key: str) -> tuple[Any, Any]:
    ws = arrival_windows(run)
    return ws[1 if len(ws) > 2 else 0][key], ws[-1][key]


def hypothesis_rows(runs: dict[str, CaseRun]) -> list[dict[str, Any]]:
    """Each hypothesis with what it predicts, what its replay measured, and a verdict: ``"can"`` (the mechanism
    produces both a TTFT rise and a drop in finished requests/s), ``"partly"`` (one of them, or only in a way
    the report does not show) or ``"cannot"``.

    Rules (applied to the measurements, so the verdicts follow them):
    fragmentation cannot when its bytes per GPU are under a tenth of the reported 12 GB and its rate does not grow
    from the second window to the last; preemption cannot when no
    step preempted; NCCL buffers cannot when even 32 channels are under 1 GiB per GPU; queueing is partly (TTFT
    rises without bound while finished/s stays at capacity, it does not fall); the contiguous allocator is
    partly when its capacity is below the paged one (but from the first minute, not after two hours); output
    drift can when finished/s falls and TTFT rises after the drift.
    """
    p12, p9, orca, drift = runs["paged_12"], runs["paged_9"], runs["orca_12"], runs["drift_7"]
    pool = p12.memory["kv_pool_bytes"]
    frag = statistics.fmean(w["fragmentation_rate"] for w in arrival_windows(p12))
    f0, f1 = _first_last(p12, "fragmentation_rate")
    used = mean_kv_utilization(p12) * pool
    frag_bytes = frag * used / max(1 - frag, 1e-9)  # waste over the used blocks: rate x (token states + waste)
    preempt = sum(r.summary["preemptions_total"] for r in runs.values())
    nccl = nccl_rows()
    t0, t1 = _first_last(p12, "ttft_p50_s")
    n0, n1 = _first_last(p9, "ttft_p50_s")
    cap_p, cap_o = capacity_req_s(p12), capacity_req_s(orca)
    half = [w for w in arrival_windows(drift)]
    before = [w for w in half if w["t_end_s"] <= drift.extra["drift_at_s"]]
    after = [w for w in half if w["t_start_s"] >= drift.extra["drift_at_s"]][1:] or half[-1:]
    f_b, f_a = statistics.fmean(w["finished_req_s"] for w in before[1:] or before), after[-1]["finished_req_s"]
    ttft_b, ttft_a = before[-1]["ttft_p50_s"], after[-1]["ttft_p50_s"]
    reported = CASE["unused_gb_per_gpu"] * 1e9
    return [
        {
            "hypothesis": "fragmentation",
            "predicts": "memory lost to partly filled blocks grows over hours until the pool binds",
            "measured": f"fragmentation rate {frag:.1%} of used KV memory = {frag_bytes / MiB:,.0f} MiB per GPU at "
            f"12 req/s; rate {f0:.1%} in the second window, {f1:.1%} in the last",
            "verdict": "cannot" if frag_bytes < reported / 10 and f1 <= f0 * 1.1 else "partly",
        },
        {
            "hypothesis": "contiguous_allocator",
            "predicts": "each sequence reserves max_model_len: fewer fit, capacity falls, reserved slots idle",
            "measured": f"orca-max at 12 req/s: {orca.extra['max_running']} running at most (paged "
            f"{p12.extra['max_running']}), capacity {cap_o:.2f} req/s (paged {cap_p:.2f})",
            "verdict": "partly" if cap_o < cap_p else "cannot",
        },
        {
            "hypothesis": "preemption",
            "predicts": "the pool runs out, requests are evicted and recomputed: TTFT and throughput suffer",
            "measured": f"{preempt} preemptions in all four replays; peak {p12.extra['blocks_used_peak']:,} of "
            f"{p12.memory['num_blocks']:,} blocks used at 12 req/s",
            "verdict": "cannot" if preempt == 0 else "partly",
        },
        {
            "hypothesis": "queueing",
            "predicts": "above capacity the waiting queue and TTFT grow; completions stay at capacity",
            "measured": f"12 req/s (capacity {cap_p:.2f}): TTFT p50 {_ms(t0)} → {_ms(t1)}, waiting "
            f"{arrival_windows(p12)[-1]['waiting']:,.0f} at the end; 9 req/s: TTFT p50 {_ms(n0)} → {_ms(n1)}",
            "verdict": "partly" if t1 > t0 else "cannot",
        },
        {
            "hypothesis": "output_length_drift",
            "predicts": "longer answers: more decode steps per request, fewer requests/s, a queue forms",
            "measured": f"7 req/s, outputs ×{drift.extra['output_scale']:g} from {drift.extra['drift_at_s']:,.0f} s: "
            f"finished/s {f_b:.2f} → {f_a:.2f}, TTFT p50 {_ms(ttft_b)} → {_ms(ttft_a)}",
            "verdict": "can" if f_a < f_b and ttft_a > ttft_b else "cannot",
        },
        {
            "hypothesis": "nccl_buffers",
            "predicts": "communication buffers hold memory the KV pool cannot use",
            "measured": f"{nccl[0]['bytes'] / MiB:,.1f} MiB per GPU at {nccl[0]['nchannels']} channels, "
            f"{nccl[-1]['bytes'] / MiB:,.1f} MiB at {nccl[-1]['nchannels']}",
            "verdict": "cannot" if nccl[-1]["bytes"] < GiB else "partly",
        },
    ]


def hypothesis_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`hypothesis_rows` as a table."""
    return Table(
        [
            Column("hypothesis", "hypothesis", lambda s: s.replace("_", " "), align="left"),
            Column("predicts", "if it were the cause", align="left", prose=True),
            Column("measured", "measured in the replay", align="left", prose=True),
            Column("verdict", "can it produce the symptoms?", align="left"),
        ],
        rows,
    )


# ---------------------------------------------------------------- the healthy baseline
#: what the replay assumes, varied one at a time, to find what reproduces the report's healthy state (12 req/s
#: served at a 180 ms TTFT): label -> :func:`replay` keyword arguments
BASELINE_VARIANTS: dict[str, dict[str, Any]] = {
    "as replayed (ShareGPT-like outputs)": {},
    "max_num_batched_tokens 16384": {"max_num_batched_tokens": 16384},
    "prefix caching on": {"enable_prefix_caching": True},
    "max_num_seqs 512": {"max_num_seqs": 512},
    "gpu_memory_utilization 0.95": {"gpu_memory_utilization": 0.95},
    "outputs 0.9x as long": {"output_scale": 0.9},
    "outputs 0.8x as long": {"output_scale": 0.8},
    "outputs 0.7x as long": {"output_scale": 0.7},
}


def baseline_rows(
    rate: float = CASE["throughput_before_req_s"],
    duration_s: float = 300.0,
    variants: dict[str, dict[str, Any]] | None = None,
    progress=None,
) -> list[dict[str, Any]]:
    """Each of ``variants`` (default :data:`BASELINE_VARIANTS`) replayed at the report's healthy ``rate``: the
    completions per second while requests arrive (:func:`capacity_req_s`), TTFT p50 / p99 (ms), mean output tokens
    per request, and ``reproduces``: whether the replay matches the report's healthy state — completions within 5% of
    ``rate`` and TTFT p50 within half again of the report's 180 ms either way (90..270 ms). Deterministic."""
    rows = []
    for i, (label, kw) in enumerate((variants or BASELINE_VARIANTS).items()):
        if progress:
            progress(f"[{i + 1}/{len(variants or BASELINE_VARIANTS)}] {label} ...")
        r = replay(rate, duration_s, label=label, **kw)
        s, cap = r.summary, capacity_req_s(r)
        ttft = 1000 * s["ttft_p50_s"]
        target = CASE["ttft_before_ms"]
        rows.append({
            "assumption": label,
            "capacity_req_s": cap,
            "ttft_p50_ms": ttft,
            "ttft_p99_ms": 1000 * s["ttft_p99_s"],
            "output_tokens_mean": s["output_tokens_total"] / max(1, s["requests_finished"]),
            "reproduces": cap >= 0.95 * rate and target / 2 <= ttft <= target * 1.5,
        })  # fmt: skip
    return rows


def baseline_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`baseline_rows` as a table."""
    return Table(
        [
            Column("assumption", "assumption", align="left"),
            Column("output_tokens_mean", "output tokens (mean)", lambda v: f"{v:,.0f}"),
            Column("capacity_req_s", "completed req/s at 12 offered", lambda v: f"{v:.2f}"),
            Column("ttft_p50_ms", "TTFT p50 (ms)", _ms_value),
            Column("ttft_p99_ms", "TTFT p99 (ms)", _ms_value),
            Column("reproduces", "12 req/s at ~180 ms?", lambda v: "yes" if v else "no"),
        ],
        list(rows),
    )


def _ms_value(v: float) -> str:
    return f"{v:,.0f}"


#: the memory share the deployment gives the engine, and the values the course's advice proposed
GMU_VALUES = (0.6, 0.7, 0.9)


def gmu_rows(rate: float = CASE["throughput_before_req_s"], duration_s: float = 300.0, values=GMU_VALUES,
             **engine_args: Any) -> list[dict[str, Any]]:  # fmt: skip
    """The case at ``rate`` with each ``gpu_memory_utilization`` of ``values``: the KV pool per GPU (GiB, blocks),
    its peak share in use, preemptions, completions per second and TTFT p50 (ms). Deterministic."""
    rows = []
    for v in values:
        r = replay(rate, duration_s, label=f"gpu_memory_utilization {v:g}", gpu_memory_utilization=v, **engine_args)
        s = r.summary
        rows.append({
            "gpu_memory_utilization": v,
            "kv_pool_gib": r.memory["kv_pool_bytes"] / GiB,
            "num_blocks": r.memory["num_blocks"],
            "peak_kv_used": r.extra["blocks_used_peak"] / r.memory["num_blocks"],
            "preemptions": s["preemptions_total"],
            "capacity_req_s": capacity_req_s(r),
            "ttft_p50_ms": 1000 * s["ttft_p50_s"],
        })  # fmt: skip
    return rows


def gmu_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`gmu_rows` as a table."""
    return Table(
        [
            Column("gpu_memory_utilization", "gpu_memory_utilization", lambda v: f"{v:g}"),
            Column("kv_pool_gib", "KV pool per GPU (GiB)", lambda v: f"{v:.1f}"),
            Column("num_blocks", "KV blocks", lambda v: f"{v:,}"),
            Column("peak_kv_used", "peak KV in use", lambda v: f"{100 * v:.0f}%"),
            Column("preemptions", "preemptions", lambda v: f"{v:,}"),
            Column("capacity_req_s", "completed req/s", lambda v: f"{v:.2f}"),
            Column("ttft_p50_ms", "TTFT p50 (ms)", _ms_value),
        ],
        list(rows),
    )


# ---------------------------------------------------------------- the panel
class CaseStudyPanel(_Panel):
    """Replay the case with your own settings: ``rate`` (req/s), ``max_num_seqs``, ``gpu_memory_utilization``,
    ``kv_allocator`` (``paged`` or the contiguous ``orca-max``), an output-length drift (``output_scale`` from
    half-way) and ``duration_s`` (simulated). Each Run adds the replay's TTFT p50 and finished/s per window to
    the plot and says the capacity, the peak batch, preemptions and the unused GiB per GPU.

    Raises:
        ImportError: ipywidgets / anywidget missing.
    """

    def __init__(self):
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        st = {"description_width": "initial"}
        controls = {
            "rate": w.FloatSlider(min=2, max=16, step=0.5, value=12, description="rate (req/s)", style=st),
            "max_num_seqs": w.Dropdown(options=[64, 128, 256, 512], value=256, description="max_num_seqs", style=st),
            "gpu_memory_utilization": w.FloatSlider(
                min=0.5, max=0.95, step=0.05, value=0.9, description="gpu_memory_utilization", style=st
            ),
            "kv_allocator": w.Dropdown(
                options=["paged", "orca-max"], value="paged", description="kv_allocator", style=st
            ),  # fmt: skip
            "output_scale": w.FloatSlider(
                min=0.5, max=2.5, step=0.1, value=1.0, description="output_scale (from half-way)", style=st
            ),  # fmt: skip
            "duration_s": w.Dropdown(
                options=[120, 300, 600], value=300, description="duration (simulated s)", style=st
            ),  # fmt: skip
        }
        self.figure = go.FigureWidget(make_subplots(rows=1, cols=2, subplot_titles=("TTFT p50 (s)", "finished/s")))
        self.figure.update_layout(height=380, title="Your replays", hovermode="x unified", margin={"t": 90},
                                  legend={"orientation": "h", "y": -0.25, "yanchor": "top"})  # fmt: skip
        self.figure.update_yaxes(type="log", row=1, col=1)
        self.figure.update_xaxes(title="simulated time (s)")
        self._build(controls, self.figure)

    def _run(self, values):
        v = dict(values)
        scale, duration = float(v.pop("output_scale")), float(v.pop("duration_s"))
        rate = float(v.pop("rate"))
        label = (f"{rate:g} req/s, {v['kv_allocator']}, seqs {v['max_num_seqs']}, util "
                 f"{float(v['gpu_memory_utilization']):.2f}" + (f", out ×{scale:g}" if scale != 1 else ""))  # fmt: skip
        v["gpu_memory_utilization"] = round(float(v["gpu_memory_utilization"]), 2)
        run = replay(rate, duration, label=label, output_scale=scale, drift_at_s=duration / 2, **v)
        ws = arrival_windows(run)
        x = [w["t_start_s"] for w in ws]
        c = _COLOURS[len(self.history) % len(_COLOURS)]
        with self.figure.batch_update():
            self.figure.add_scatter(x=x, y=[w["ttft_p50_s"] for w in ws], name=label, line={"color": c},
                                    legendgroup=label, row=1, col=1)  # fmt: skip
            self.figure.add_scatter(x=x, y=[w["finished_req_s"] for w in ws], name=label, line={"color": c},
                                    legendgroup=label, showlegend=False, row=1, col=2)  # fmt: skip
        return run

    def _describe(self, values, run: CaseRun) -> str:
        unused = statistics.fmean(r["unused_gib"] for r in unused_rows(run))
        last = arrival_windows(run)[-1]
        which = "after the first window" if len(arrival_windows(run)) > 1 else "one window only: lengthen duration_s"
        return (
            f"{run.label}: finished {capacity_req_s(run):.2f} req/s ({which}), TTFT p50 "
            f"{_ms(last['ttft_p50_s'])} and {last['waiting']:,.0f} waiting in the last window, at most "
            f"{run.extra['max_running']} running, step {last['step_ms']:.0f} ms, "
            f"{run.summary['preemptions_total']} preemptions, KV pool {run.memory['kv_pool_bytes'] / GiB:,.1f} GiB "
            f"per GPU of which {unused:,.1f} GiB unused on average"
        )


# ---------------------------------------------------------------- exercises
def _gib_unused(budget: dict, kv_utilization: float) -> float:
    return budget["kv_pool_bytes"] * (1 - kv_utilization) / 2**30


@_register(
    "16.3",
    "How many GiB of one GPU's KV pool are allocated but unused at this KV utilization? (a number in GiB)",
    "the pool is preallocated at startup (kv_pool_bytes); KV utilization is token states / pool slots, so the "
    "rest of the pool holds no token state — free blocks and the empty slots of used ones.",
)
class _UnusedGiB:
    @staticmethod
    def solution(budget: dict, kv_utilization: float) -> float:
        return _gib_unused(budget, kv_utilization)

    @staticmethod
    def judge(answer, budget: dict, kv_utilization: float) -> tuple[bool, str]:
        want = _gib_unused(budget, kv_utilization)
        x = _number(answer)
        if x is None:
            return False, f"give a number of GiB, got {answer!r}"
        if abs(x - want) <= 0.01 * want:
            return True, (
                f"{want:,.1f} GiB of the {budget['kv_pool_bytes'] / 2**30:,.1f} GiB pool hold no token state: "
                "allocated at startup, unused now"
            )
        if abs(x - want * 2**30 / 1e9) <= 0.01 * want * 2**30 / 1e9:
            return False, "that is in GB (10^9 bytes); the question asks GiB (2^30 bytes)"
        used = budget["kv_pool_bytes"] * kv_utilization / 2**30
        if abs(x - used) <= 0.01 * max(used, 1e-9):
            return False, "that is the part holding token states; the question asks for the rest of the pool"
        if abs(x - want * 2**30) <= 0.01 * want * 2**30:
            return False, "that is in bytes; divide by 2**30 for GiB"
        return False, f"{answer!r} is {'too much' if x > want else 'too little'}: pool bytes × (1 − KV utilization)"


def _queue_after(rate: float, capacity: float, seconds: float) -> float:
    return max(0.0, (rate - capacity) * seconds)


@_register(
    "16.1",
    "Requests arrive at `rate` req/s and the server completes `capacity` req/s. How many requests are waiting "
    "after `seconds` seconds, starting from an empty queue? (a number of requests)",
    "every second, rate requests arrive and capacity leave; the difference piles up in the waiting queue "
    "(it cannot go below zero).",
)
class _QueueGrowth:
    @staticmethod
    def solution(rate: float, capacity: float, seconds: float) -> float:
        return _queue_after(rate, capacity, seconds)

    @staticmethod
    def judge(answer, rate: float, capacity: float, seconds: float) -> tuple[bool, str]:
        want = _queue_after(rate, capacity, seconds)
        x = _number(answer)
        if x is None:
            return False, f"give a number of requests, got {answer!r}"
        if abs(x - want) <= max(1.0, 0.02 * want):
            if want == 0:
                return True, "0: below capacity the queue does not grow; TTFT stays near the prefill time"
            return True, (
                f"about {want:,.0f} requests waiting; the last of them waits about {want / capacity:,.0f} s — "
                "TTFT grows with time, without bound, while completions stay at capacity"
            )
        if abs(x - rate * seconds) <= 0.02 * rate * seconds:
            return False, "that is every arrival; the server completes capacity requests per second meanwhile"
        if abs(x - (rate - capacity)) <= 0.02 * abs(rate - capacity) + 1e-9:
            return False, "that is the growth per second; multiply by the seconds"
        if want == 0 and x < 0:
            return False, "a queue cannot be negative: below capacity it stays empty"
        return (
            False,
            f"{answer!r} is {'too many' if x > want else 'too few'}: (arrivals − completions) per second × seconds",
        )


def _can_both(rows: list) -> set:
    return {r["hypothesis"] for r in rows if r["verdict"] == "can"}


@_register(
    "16.2",
    "From the hypothesis table's measurements, which hypotheses can produce both symptoms — TTFT rising and "
    "fewer requests finishing per second? (a set of the hypothesis names, e.g. {'preemption'})",
    "a mechanism explains the report only if its replay shows both; one that shows neither, or only one, or "
    "shows them from the first minute rather than after two hours, is not the diagnosis.",
)
class _WhichHypotheses:
    @staticmethod
    def solution(rows: list) -> set:
        return _can_both(rows)

    @staticmethod
    def judge(answer, rows: list) -> tuple[bool, str]:
        names = {r["hypothesis"] for r in rows}
        if isinstance(answer, str):
            answer = {answer}
        try:
            got = {str(a).strip().replace(" ", "_") for a in answer}
        except TypeError:
            return False, f"give a set of hypothesis names, got {answer!r}"
        unknown = got - names
        if unknown:
            return False, f"{sorted(unknown)} are not hypotheses here; the names are {sorted(names)}"
        want = _can_both(rows)
        if got == want:
            return True, f"{sorted(want)}: the only mechanism whose replay shows both symptoms"
        extra, missing = got - want, want - got
        why = {r["hypothesis"]: r["measured"] for r in rows}
        if extra:
            e = sorted(extra)[0]
            return False, f"{e} does not show both symptoms — measured: {why[e]}"
        return False, f"one is missing; look again at {sorted(missing)[0]}: {why[sorted(missing)[0]]}"
