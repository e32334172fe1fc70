"""``workbench simulate``: replay a trace on a simulated server and write a run folder.

The folder has the files of ``workbench run`` (:mod:`workbench.bench.run`): ``steps.jsonl``,
``requests.jsonl``, ``summary.json``, ``config.json`` and ``report.html`` — so every figure and
lab that reads a real run reads a simulated one. Times in them are simulated seconds;
``summary.json`` adds ``replay_wall_s`` (how long the replay took on this machine) and the
simulated request throughput, and ``timeline`` gives TTFT and throughput per time window.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from workbench.config import EngineConfig
from workbench.metrics import JsonlSink, Recorder
from workbench.metrics.stats import prefix_cache_summary
from workbench.metrics.waste import flatten_breakdown, waste_breakdown
from workbench.sim.engine import SimEngine, SimSpec
from workbench.sim.trace import TraceRequest

#: most steps drawn in report.html (a two-hour replay has over a hundred thousand; every k-th is kept): a few points
#: per pixel of a figure's width already, and plotly's validation of every point is most of the report's time
REPORT_MAX_STEPS = 5_000
#: most requests drawn in report.html's latency figure (percentiles of every request are in summary.json)
REPORT_MAX_REQUESTS = 5_000


@dataclass
class SimResult:
    """A simulated run: the engine (scheduler, KV manager, recorder), summary, timeline and folder."""

    engine: SimEngine
    summary: dict
    timeline: list[dict]
    run_dir: Path | None
    replay_wall_s: float


def timeline(requests: list[dict], window_s: float, end_s: float | None = None) -> list[dict]:
    """TTFT and throughput per window of simulated time.

    Each row: ``t_start_s`` and ``t_end_s`` (the last window ends at ``end_s``), ``arrived`` and
    ``finished`` requests in the window, ``finished_req_s`` (finished / the window's length),
    ``output_tok_s`` (output tokens of the requests finished in it / the window's length), ``ttft_p50_s`` / ``ttft_p99_s`` / ``queue_p50_s`` of the requests
    that *arrived* in it (``None`` when none), ``preempted`` (requests arrived in it that were
    preempted at least once).

    Raises:
        ValueError: ``window_s <= 0``.
    """
    if not window_s > 0:
        raise ValueError(f"window_s={window_s} must be a positive number of seconds")
    ok = [r for r in requests if not r.get("error")]
    if end_s is None:
        end_s = max((r["finish_time_s"] or 0.0 for r in ok), default=0.0)
    n = max(1, math.ceil(end_s / window_s))
    rows = [
        {"t_start_s": i * window_s, "arrived": 0, "finished": 0, "output_tokens": 0, "ttft": [], "queue": [], "pre": 0}
        for i in range(n)
    ]
    for r in ok:
        a = min(n - 1, int(r["arrival_time_s"] // window_s))
        rows[a]["arrived"] += 1
        if r["ttft_s"] is not None:
            rows[a]["ttft"].append(r["ttft_s"])
        if r["queue_time_s"] is not None:
            rows[a]["queue"].append(r["queue_time_s"])
        rows[a]["pre"] += r["num_preemptions"] > 0
        if r["finish_time_s"] is not None:
            f = min(n - 1, int(r["finish_time_s"] // window_s))
            rows[f]["finished"] += 1
            rows[f]["output_tokens"] += r["output_tokens"]
    out = []
    for row in rows:
        t, q = row.pop("ttft"), row.pop("queue")
        t_end = min(row["t_start_s"] + window_s, max(end_s, row["t_start_s"]))
        length = t_end - row["t_start_s"] or window_s  # a zero-length run: divide by the window
        out.append(
            {
                "t_start_s": row["t_start_s"],
                "t_end_s": t_end,
                "arrived": row["arrived"],
                "finished": row["finished"],
                "finished_req_s": row["finished"] / length,
                "output_tok_s": row["output_tokens"] / length,
                "ttft_p50_s": float(np.percentile(t, 50)) if t else None,
                "ttft_p99_s": float(np.percentile(t, 99)) if t else None,
                "queue_p50_s": float(np.percentile(q, 50)) if q else None,
                "preempted": row["pre"],
            }
        )
    return out


def goodput(requests: list[dict], duration_s: float, ttft_slo_s: float | None, tpot_slo_s: float | None) -> float:
    """Good requests per second of ``duration_s``: finished requests (no error) whose TTFT <= ``ttft_slo_s``
    and TPOT <= ``tpot_slo_s`` (seconds; ``None``: no objective on that metric). A request with one
    output token has TPOT 0, as in ``workbench bench serve --goodput`` (vLLM's ``request_goodput``).
    0.0 when ``duration_s`` is 0."""
    good = 0
    for r in requests:
        if r.get("error") or r.get("finish_reason") not in ("stop", "length") or r.get("ttft_s") is None:
            continue
        tpot = r.get("tpot_s") or 0.0
        good += (ttft_slo_s is None or r["ttft_s"] <= ttft_slo_s) and (tpot_slo_s is None or tpot <= tpot_slo_s)
    return good / duration_s if duration_s > 0 else 0.0


def new_engine(spec: SimSpec, run_dir: Path | None, **engine_args) -> SimEngine:
    """A :class:`SimEngine` with a :class:`Recorder` that writes ``steps.jsonl`` / ``requests.jsonl`` into
    ``run_dir`` (``None``: nothing). The folder is made only once the engine accepted its arguments.

    Raises:
        ValueError: bad engine arguments or a memory budget without room for one sequence.
    """
    recorder = Recorder()
    eng = SimEngine(EngineConfig(**engine_args), spec, recorder=recorder)
    if run_dir is not None:
        recorder.add_sink(JsonlSink(run_dir, live_steps=False))  # a replay is read when it has finished
    return eng


def run_folder(output_dir: str | Path | None, run_name: str | None) -> Path | None:
    """``output_dir / run_name`` (default name: ``sim-`` + a timestamp); ``None`` when ``output_dir`` is."""
    if output_dir is None:
        return None
    return Path(output_dir) / (run_name or ("sim-" + datetime.now().strftime("%Y%m%d-%H%M%S-%f")))


def finish_run(
    eng: SimEngine,
    run_dir: Path | None,
    wall_s: float,
    window_s: float,
    trace_info: dict,
    goodput_slo: tuple[float | None, float | None] | None = None,
) -> SimResult:
    """Close a replayed engine's recorder, reduce its records to the summary and timeline, and write the
    run folder (``summary.json``, ``timeline.json``, ``config.json``, ``report.html``) when ``run_dir`` is
    set. The simulated duration is the engine's clock; ``wall_s`` is the replay's wall time on this
    machine; ``goodput_slo`` = ``(ttft_slo_s, tpot_slo_s)`` adds ``request_goodput_req_s``.
    """
    recorder = eng.recorder
    recorder.close()
    steps = [s.to_dict() for s in recorder.steps]
    reqs = [r.to_dict() for r in recorder.requests]
    duration = eng.now
    summary = _summary(eng, steps, reqs, duration, wall_s)
    if goodput_slo is not None:
        summary["request_goodput_req_s"] = goodput(reqs, duration, *goodput_slo)
    tl = timeline(reqs, window_s, duration)
    if run_dir is not None:
        _write_folder(eng, run_dir, steps, reqs, summary, tl, trace_info)
    return SimResult(eng, summary, tl, run_dir, wall_s)


def _summary(eng: SimEngine, steps: list[dict], reqs: list[dict], duration: float, wall: float) -> dict:
    from workbench.viz.report import summary_table

    summary = summary_table(steps, reqs, duration)
    summary["simulated_duration_s"] = duration
    summary["replay_wall_s"] = wall
    summary["request_throughput_req_s"] = summary["requests_finished"] / duration if duration > 0 else 0.0
    summary.update(
        {
            f"waste_{k}": v
            for k, v in flatten_breakdown(waste_breakdown(steps)).items()
            if k.endswith(("_pool_frac", "_used_frac"))
        }
    )
    if eng.config.enable_prefix_caching:
        summary.update(prefix_cache_summary(steps))
    return summary


def run_config(eng: SimEngine, trace_info: dict) -> dict:
    """``config.json`` of a simulated run: the engine arguments, model, hardware, layout and trace."""
    spec = eng.spec
    config = eng.config.to_dict() | {
        "simulated": True,
        "model": spec.arch.name,
        "hardware": spec.hardware.to_dict(),
        "tensor_parallel_size": spec.tensor_parallel_size,
        "dtype": spec.dtype,
        "kv_cache_dtype": spec.kv_cache_dtype,
        "efficiency": spec.efficiency.to_dict(),
        "max_model_len": eng.max_model_len,
        "max_num_batched_tokens": eng.max_num_batched_tokens,
        "num_blocks": eng.memory.num_blocks,
        "kv_bytes_per_token": eng.memory.kv_bytes_per_token,
        "trace": trace_info,
    }
    for k in ("device", "attention_backend", "tokenizer", "cache_dir"):
        config.pop(k, None)
    return config


def _write_folder(eng, run_dir: Path, steps, reqs, summary, tl, trace_info) -> None:
    from workbench.viz.report import write_report

    config = run_config(eng, trace_info)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "timeline.json").write_text(json.dumps(tl, indent=2))
    (run_dir / "config.json").write_text(json.dumps(config | {"memory": eng.memory.to_dict()}, indent=2, default=str))
    rs, rr = steps, reqs
    shown = {}
    if len(steps) > REPORT_MAX_STEPS:
        k = math.ceil(len(steps) / REPORT_MAX_STEPS)
        rs = steps[::k]
        shown["report_steps_drawn"] = f"every {k}th of {len(steps):,} steps"
    if len(reqs) > REPORT_MAX_REQUESTS:
        k = math.ceil(len(reqs) / REPORT_MAX_REQUESTS)
        rr = reqs[::k]
        shown["report_requests_drawn"] = f"every {k}th of {len(reqs):,} requests"
    write_report(
        run_dir / "report.html",
        rs,
        rr,
        summary,
        config | shown,
        title=f"workbench simulate: {eng.spec.arch.name} on {eng.memory.device_name}",
        block_maps=eng.recorder.block_maps,
        memory=eng.memory.to_dict(),
    )


def _progress_hook(end: float):
    """A tqdm bar of simulated seconds up to ``end`` and the ``(engine) -> None`` hook that moves it."""
    from tqdm.auto import tqdm

    bar = tqdm(total=round(end), desc="simulated s", unit="s")
    calls = [0]

    def hook(e):
        calls[0] += 1
        if calls[0] % 200 == 0:
            t = min(round(e.now), bar.total)
            bar.update(t - bar.n)
            bar.set_postfix(running=len(e.scheduler.running), waiting=len(e.scheduler.waiting), refresh=False)

    return bar, hook


def simulate_job(
    spec: SimSpec,
    trace: list[TraceRequest],
    *,
    output_dir: str | Path | None = "runs",
    run_name: str | None = None,
    progress: bool = False,
    record_itl: bool = True,
    window_s: float = 600.0,
    trace_info: dict | None = None,
    max_tokens: int | None = None,
    goodput_slo: tuple[float | None, float | None] | None = None,
    **engine_args,
) -> SimResult:
    """Replay ``trace`` on the simulated server ``spec`` with the engine arguments ``engine_args``.

    Args:
        spec: model, hardware, tensor-parallel size, dtypes, cost-model parameters.
        trace: requests in arrival order (:func:`workbench.sim.trace.make_trace`).
        output_dir: parent of the run folder; ``None`` writes nothing.
        run_name: the folder's name (default: ``sim-`` + a timestamp).
        progress: a tqdm bar of simulated time.
        record_itl: keep every inter-token gap in the request records (a two-hour replay has tens
            of millions; ``False`` leaves ``itl_s`` empty, TPOT and TTFT stay).
        window_s: window of the TTFT / throughput timeline (simulated s).
        trace_info: how the trace was made (written to ``config.json``).
        max_tokens: output cap of requests that end with EOS (``None`` = ``max_model_len``).
        goodput_slo: ``(ttft_slo_s, tpot_slo_s)``: adds ``request_goodput_req_s`` (:func:`goodput`) to the summary.
        **engine_args: :class:`~workbench.config.EngineConfig` fields (``block_size``,
            ``gpu_memory_utilization``, ``max_num_seqs``, ...).

    Raises:
        ValueError: bad engine arguments or a memory budget without room for one sequence.
    """
    run_dir = run_folder(output_dir, run_name)
    eng = new_engine(spec, run_dir, **engine_args)
    eng.record_itl = record_itl
    eng.add_trace(trace, max_tokens=max_tokens)
    end = trace[-1].arrival_s if trace else 0.0
    bar, hook = _progress_hook(end) if progress else (None, None)
    t0 = time.perf_counter()
    eng.run(progress=hook)
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.update(bar.total - bar.n)
        bar.close()
    return finish_run(eng, run_dir, wall, window_s, trace_info or {"num_requests": len(trace)}, goodput_slo)
