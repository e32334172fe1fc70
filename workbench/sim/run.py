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
        **engine_args: :class:`~workbench.config.EngineConfig` fields (``block_size``,
            ``gpu_memory_utilization``, ``max_num_seqs``, ...).

    Raises:
        ValueError: bad engine arguments or a memory budget without room for one sequence.
    """
    from workbench.viz.report import summary_table, write_report

    run_dir = None
    recorder = Recorder()
    eng = SimEngine(EngineConfig(**engine_args), spec, recorder=recorder)
    if output_dir is not None:  # only once the engine accepted its arguments: a refusal leaves no folder
        run_dir = Path(output_dir) / (run_name or ("sim-" + datetime.now().strftime("%Y%m%d-%H%M%S-%f")))
        recorder.add_sink(JsonlSink(run_dir, live_steps=False))  # a replay is read when it has finished
    eng.record_itl = record_itl
    eng.add_trace(trace, max_tokens=max_tokens)
    end = trace[-1].arrival_s if trace else 0.0
    bar = None
    hook = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=round(end), desc="simulated s", unit="s")
        calls = [0]

        def hook(e):
            calls[0] += 1
            if calls[0] % 200 == 0:
                t = min(round(e.now), bar.total)
                bar.update(t - bar.n)
                bar.set_postfix(running=len(e.scheduler.running), waiting=len(e.scheduler.waiting), refresh=False)

    t0 = time.perf_counter()
    eng.run(progress=hook)
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.update(bar.total - bar.n)
        bar.close()
    recorder.close()
    steps = [s.to_dict() for s in recorder.steps]
    reqs = [r.to_dict() for r in recorder.requests]
    duration = eng.now
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
    tl = timeline(reqs, window_s, duration)
    if run_dir is not None:
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
            "trace": trace_info or {"num_requests": len(trace)},
        }
        for k in ("device", "attention_backend", "tokenizer", "cache_dir"):
            config.pop(k, None)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (run_dir / "timeline.json").write_text(json.dumps(tl, indent=2))
        (run_dir / "config.json").write_text(
            json.dumps(config | {"memory": eng.memory.to_dict()}, indent=2, default=str)
        )
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
            title=f"workbench simulate: {spec.arch.name} on {eng.memory.device_name}",
            block_maps=recorder.block_maps,
            memory=eng.memory.to_dict(),
        )
    return SimResult(eng, summary, tl, run_dir, wall)
