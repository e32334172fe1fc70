"""Chunked prefill and the latency trade-off (chapter 8): long prompts arriving among running decodes.

:func:`chunked_trace` builds a trace of real prompts with *arrival steps*: a few short requests
with long outputs start at step 0 and keep decoding; long documents to summarise arrive later, one
at a time, while they decode. :func:`arrival_run` drives a real :class:`~workbench.engine.LLMEngine`
(the bundled model) step by step and adds each request before the step it arrives at, so which
tokens run in which step depends on the engine's decisions only — it is the same on every machine —
while the times (TTFT, inter-token latency) are measured on the wall clock.

Arrivals are counted in engine steps rather than seconds so that the schedule is deterministic: with
arrivals in seconds a slower machine would see a different mix of requests in each step.

The figures (:func:`tradeoff_row`): ``ttft_p50_s`` / ``ttft_p99_s`` and ``itl_p50_s`` / ``itl_p99_s``
(all requests, from :func:`workbench.viz.report.summary_table`; timings), and the deterministic
ones from the step records: ``max_step_tokens`` (the largest step, in tokens, that a decoding request
waited through — its inter-token gap grows with it), ``long_ttft_steps`` (steps from a long prompt's
arrival to its first token, the longest of them), ``long_chunks`` (prefill chunks of each long
prompt) and ``steps``.

:class:`TradeoffPanel`: a slider for ``max_num_batched_tokens`` and a checkbox for
``enable_chunked_prefill``; each Run is a real run whose (TTFT p99, ITL p99) joins a live plotly
``FigureWidget``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import plotly.graph_objects as go

from workbench.bench.datasets import PromptRecord, default_prompts
from workbench.labs.exercise_registry import _number, _register
from workbench.labs.panel import RunButtonThread, _accepts
from workbench.labs.runs import LAB_ENGINE_DEFAULTS, check_engine_arg_names, check_engine_args
from workbench.viz.common import LEGEND_ABOVE, LEGEND_ABOVE_MARGIN

__all__ = [
    "CHUNKED_ENGINE_DEFAULTS",
    "MEMORY_ENGINE_ARGS",
    "ArrivalResult",
    "TradeoffPanel",
    "arrival_run",
    "chunked_trace",
    "trace_table",
    "exercise_prefills",
    "gpu_memory_rows",
    "gpu_memory_table",
    "memory_row",
    "memory_runs",
    "memory_table",
    "memory_verdict",
    "prefill_measurements",
    "tradeoff_figure",
    "tradeoff_row",
    "tradeoff_runs",
    "tradeoff_table",
]

#: engine arguments of this chapter's runs (over the lab defaults): room for the long documents
CHUNKED_ENGINE_DEFAULTS: dict[str, Any] = {"max_model_len": 1024, "num_gpu_blocks_override": 256}


def chunked_trace(
    num_decodes: int = 3,
    decode_tokens: int = 64,
    num_long: int = 2,
    long_output: int = 4,
    first_arrival: int = 4,
    every: int = 26,
    min_long_chars: int = 1800,
    max_long_chars: int = 2300,
) -> list[tuple[int, PromptRecord]]:
    """``[(arrival step, record)]``: ``num_decodes`` short questions decoding ``decode_tokens`` tokens
    each from step 0, and ``num_long`` long documents (``min_long_chars`` to ``max_long_chars``
    characters, a few hundred tokens) producing ``long_output`` tokens each, arriving at steps
    ``first_arrival``, ``first_arrival + every``, ... (prompts in the project set's order).

    Raises:
        ValueError: non-positive counts, or too few prompts of the asked lengths.
    """
    if num_decodes < 0 or num_long < 1 or decode_tokens < 1 or long_output < 1 or every < 1 or first_arrival < 0:
        raise ValueError("counts must be positive (num_long, decode_tokens, long_output, every) and steps >= 0")
    prompts = [r for r in default_prompts() if isinstance(r.prompt, str)]
    short = [r for r in prompts if len(r.prompt) <= 100][:num_decodes]
    long = [r for r in prompts if min_long_chars <= len(r.prompt) <= max_long_chars][:num_long]
    if len(short) < num_decodes or len(long) < num_long:
        raise ValueError(
            f"the prompt set has {len(short)} short and {len(long)} long prompts of the asked lengths; "
            f"ask for fewer or widen min_long_chars / max_long_chars"
        )
    out = [
        (0, replace(r, id=f"decode-{i}", max_tokens=decode_tokens, output_len=decode_tokens))
        for i, r in enumerate(short)
    ]
    out += [
        (first_arrival + i * every, replace(r, id=f"long-{i}", max_tokens=long_output, output_len=long_output))
        for i, r in enumerate(long)
    ]
    return out


@dataclass
class ArrivalResult:
    """A run with arrivals: what :class:`~workbench.bench.run.JobResult` holds, and the schedule.

    Attributes:
        recorder: every ``StepStats`` and request record.
        summary: :func:`workbench.viz.report.summary_table` of the run.
        memory: the engine's memory budget (``MemoryBudget.to_dict()``).
        arrivals: ``{request id: arrival step}``.
        prompt_tokens: ``{request id: prompt tokens}``.
        schedule: per step, ``{request id: (tokens computed in it, was a prefill chunk)}`` — read from
            the engine's requests before and after each step.
        engine_args: the engine arguments of the run.
        max_num_batched_tokens: the engine's token budget per step (resolved default included).
    """

    recorder: Any
    summary: dict
    memory: dict
    wall_time_s: float
    arrivals: dict[str, int]
    prompt_tokens: dict[str, int]
    schedule: list[dict[str, tuple[int, bool]]]
    engine_args: dict
    max_num_batched_tokens: int


def arrival_run(
    trace: Sequence[tuple[int, PromptRecord]] | None = None,
    *,
    sinks: Iterable | None = None,
    **engine_args: Any,
) -> ArrivalResult:
    """A real engine run of ``trace`` (default :func:`chunked_trace`), each request added before the
    step it arrives at (EOS ignored: each produces exactly its ``max_tokens``).

    Args:
        trace: ``[(arrival step, record)]``.
        sinks: extra recorder sinks (e.g. a live monitor's).
        **engine_args: engine arguments over :data:`~workbench.labs.runs.LAB_ENGINE_DEFAULTS` and
            :data:`CHUNKED_ENGINE_DEFAULTS`.

    Raises:
        ValueError: bad engine arguments (before the model loads).
    """
    from workbench.bench.run import to_engine_prompt
    from workbench.entrypoints.llm import LLM
    from workbench.metrics import Recorder
    from workbench.sampling import SamplingParams
    from workbench.viz.report import summary_table

    trace = sorted(trace if trace is not None else chunked_trace(), key=lambda a: a[0])
    args = LAB_ENGINE_DEFAULTS | CHUNKED_ENGINE_DEFAULTS | engine_args
    check_engine_args(args)
    recorder = Recorder(list(sinks or []))
    llm = LLM(recorder=recorder, **args)
    eng = llm.llm_engine
    tokenized = [eng.tokenize(to_engine_prompt(r)) for _, r in trace]
    pending = list(zip(trace, tokenized))
    tracked = {}
    arrivals, prompt_tokens = {}, {}
    schedule: list[dict[str, tuple[int, bool]]] = []
    step = 0
    t0 = time.perf_counter()
    while pending or eng.has_unfinished_requests():
        if not eng.has_unfinished_requests() and pending[0][0][0] > step:
            step = pending[0][0][0]  # idle: the next arrival comes now
        while pending and pending[0][0][0] <= step:
            (at, rec), tok = pending.pop(0)
            sp = SamplingParams(temperature=0.0, max_tokens=rec.max_tokens, ignore_eos=True)
            eng.add_request(rec.id, to_engine_prompt(rec), sp, tokenized=tok)
            tracked[rec.id] = eng.requests[rec.id]
            arrivals[rec.id] = step
            prompt_tokens[rec.id] = len(tok[0])
        before = {rid: (r.num_computed_tokens, r.num_output_tokens == 0) for rid, r in tracked.items()}
        eng.step()
        done = {}
        for rid, r in tracked.items():
            c0, prefill = before[rid]
            n = r.num_computed_tokens - c0
            if n > 0:
                done[rid] = (n, prefill)
        schedule.append(done)
        tracked = {rid: r for rid, r in tracked.items() if not r.is_finished}
        step += 1
    wall = time.perf_counter() - t0
    recorder.close()
    steps = [s.to_dict() for s in recorder.steps]
    reqs = [r.to_dict() for r in recorder.requests]
    return ArrivalResult(
        recorder=recorder,
        summary=summary_table(steps, reqs, wall),
        memory=eng.memory.to_dict(),
        wall_time_s=wall,
        arrivals=arrivals,
        prompt_tokens=prompt_tokens,
        schedule=schedule,
        engine_args=args,
        max_num_batched_tokens=eng.max_num_batched_tokens,
    )


def prefill_measurements(res: ArrivalResult, prefix: str = "long-") -> list[dict]:
    """How the engine split each long prompt (request ids starting with ``prefix``) into chunks.

    Returns rows ``{"request_id", "prompt_tokens", "budget", "chunked", "arrival_step",
    "first_token_step", "ttft_steps", "chunks", "chunk_tokens", "decodes", "alone"}``: ``chunks`` is
    the number of steps that computed part of its prompt (from the schedule; equal to the request
    record's ``num_prefill_chunks``), ``decodes`` the decoding requests in those steps when it was the
    same in all of them (else ``None``), ``alone`` whether it was the only prefill in each of them.
    """
    rows = []
    for rid, arrival in res.arrivals.items():
        if not rid.startswith(prefix):
            continue
        chunk_steps = [i for i, s in enumerate(res.schedule) if rid in s and s[rid][1]]
        decodes = {sum(1 for r, (n, pf) in res.schedule[i].items() if not pf) for i in chunk_steps}
        alone = all(sum(1 for _, pf in res.schedule[i].values() if pf) == 1 for i in chunk_steps)
        last = chunk_steps[-1] if chunk_steps else None
        rows.append(
            {
                "request_id": rid,
                "prompt_tokens": res.prompt_tokens[rid],
                "budget": res.max_num_batched_tokens,
                "chunked": bool(res.engine_args.get("enable_chunked_prefill", True)),
                "arrival_step": arrival,
                "first_token_step": last,
                "ttft_steps": None if last is None else last - arrival + 1,
                "chunks": len(chunk_steps),
                "chunk_tokens": [res.schedule[i][rid][0] for i in chunk_steps],
                "decodes": decodes.pop() if len(decodes) == 1 else None,
                "alone": alone,
            }
        )
    return rows


def tradeoff_row(res: ArrivalResult) -> dict[str, Any]:
    """One run's point of the trade-off (module docstring): the engine arguments, timings, and the
    deterministic step figures."""
    steps = res.recorder.steps
    with_decodes = [s.num_prefill_tokens + s.num_decode_tokens for s in steps if s.num_decode_reqs > 0]
    longs = prefill_measurements(res)
    s = res.summary
    chunked = bool(res.engine_args.get("enable_chunked_prefill", True))
    budget = res.max_num_batched_tokens
    # chunked prefill off, but a prompt longer than the budget: the scheduler splits it anyway
    forced = not chunked and any(m["chunks"] > 1 for m in longs)
    kind = "chunked" if chunked else ("off, split anyway" if forced else "whole")
    return {
        "label": f"B={budget} {kind}",
        "max_num_batched_tokens": budget,
        "enable_chunked_prefill": chunked,
        "steps": len(steps),
        "max_step_tokens": max(with_decodes, default=0),
        "long_chunks": [m["chunks"] for m in longs],
        "long_ttft_steps": max((m["ttft_steps"] for m in longs if m["ttft_steps"] is not None), default=None),
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p99_s": s["ttft_p99_s"],
        "itl_p50_s": s["itl_p50_s"],
        "itl_p99_s": s["itl_p99_s"],
        "output_throughput_tok_s": s["output_throughput_tok_s"],
    }


def tradeoff_runs(runs: Sequence[tuple[int, bool]], *, trace=None, **engine_args: Any) -> dict[str, ArrivalResult]:
    """:func:`arrival_run` for each ``(max_num_batched_tokens, enable_chunked_prefill)`` of ``runs``;
    ``{label: result}`` in that order (labels as :func:`tradeoff_row`'s: ``"B=128 chunked"``).

    With chunked prefill off, a prompt longer than the budget is still split (the scheduler's fallback:
    it could never run otherwise), so such a run is not a "whole prompt" run; give off-runs a budget of
    at least the longest prompt plus the running decodes.
    """
    for name in ("max_num_batched_tokens", "enable_chunked_prefill"):
        if name in engine_args:
            raise ValueError(
                f"{name} is set per run: give (max_num_batched_tokens, enable_chunked_prefill) pairs in runs"
            )
    for budget, on in runs:
        if isinstance(budget, bool) or not isinstance(budget, int) or not isinstance(on, bool):
            raise ValueError(
                f"each run is (max_num_batched_tokens: int, enable_chunked_prefill: bool), got ({budget!r}, {on!r})"
            )
    trace = trace if trace is not None else chunked_trace()
    out = {}
    for budget, on in runs:
        res = arrival_run(trace, max_num_batched_tokens=budget, enable_chunked_prefill=on, **engine_args)
        out[tradeoff_row(res)["label"]] = res
    return out


#: engine arguments of the memory comparison (over the chapter's): the KV pool sized from a memory budget, as on a
#: GPU (capacity x gpu_memory_utilization - weights - profiled activation peak), instead of a fixed block count,
#: so that what the token budget does to the activation workspace shows in the pool
MEMORY_ENGINE_ARGS: dict[str, Any] = {"num_gpu_blocks_override": None, "device_memory": 1 << 30}


def memory_runs(
    runs: Sequence[tuple[int, bool]] = ((256, True), (1024, False)),
    *,
    trace=None,
    progress: Callable[[str], Any] = print,
    **engine_args: Any,
) -> dict[str, ArrivalResult]:
    """:func:`tradeoff_runs` with the pool sized from memory (:data:`MEMORY_ENGINE_ARGS`: 1 GiB of "device"
    memory): chunked prefill at a small budget against whole prompts at ``max_model_len``'s budget, vLLM's
    default without chunking. ``progress`` gets a line as each run starts."""
    out = {}
    for i, run in enumerate(runs):
        progress(f"[{i + 1}/{len(runs)}] max_num_batched_tokens={run[0]}, enable_chunked_prefill={run[1]} ...")
        out |= tradeoff_runs([run], trace=trace, **(MEMORY_ENGINE_ARGS | engine_args))
    return out


def memory_row(res: ArrivalResult) -> dict[str, Any]:
    """What a run's token budget did to memory, all deterministic: the profiled activation peak (MiB) of one
    forward at the budget, the KV pool it left (blocks, tokens), the peak share of blocks in use, the fragmentation
    rate (occupied slots holding no token state) as a mean over the steps that held memory and at its highest, and
    preemptions."""
    steps = [s for s in res.recorder.steps if s.blocks_used > 0]
    rates = [s.fragmentation_rate for s in steps]
    return {
        "label": tradeoff_row(res)["label"],
        "activation_mib": res.memory["activation_bytes"] / 2**20,
        "num_blocks": res.memory["num_blocks"],
        "kv_pool_tokens": res.memory["kv_pool_tokens"],
        "peak_kv_usage": max((s.blocks_used / s.num_blocks for s in steps), default=0.0),
        "frag_mean": float(np.mean(rates)) if rates else 0.0,
        "frag_max": max(rates, default=0.0),
        "preemptions": sum(s.num_preemptions for s in res.recorder.steps),
    }


def memory_table(rows: Sequence[dict]):
    """:func:`memory_row` rows as a table."""
    from workbench.viz.table import Column, Table

    def pct(v):
        return f"{100 * v:.1f}%"

    return Table(
        [
            Column("label", "run", str, align="left"),
            Column("activation_mib", "activation peak (MiB)", lambda v: f"{v:,.1f}"),
            Column("num_blocks", "KV blocks", lambda v: f"{v:,}"),
            Column("kv_pool_tokens", "KV pool (tokens)", lambda v: f"{v:,}"),
            Column("peak_kv_usage", "peak KV in use", pct),
            Column("frag_mean", "fragmentation rate, mean", pct),
            Column("frag_max", "fragmentation rate, max", pct),
            Column("preemptions", "preemptions"),
        ],
        list(rows),
    )


#: the GPU-scale comparison: (model, GPU, max_model_len) and the budgets compared (chunked, and whole prompts at
#: max_model_len as vLLM's default without chunking)
GPU_MEMORY_CASE = ("qwen2.5-7b", "H100-80GB", 32768)
GPU_MEMORY_BUDGETS = ((2048, True), (8192, True), (32768, False))


def gpu_memory_rows(
    model: str = GPU_MEMORY_CASE[0], gpu: str = GPU_MEMORY_CASE[1], max_model_len: int = GPU_MEMORY_CASE[2],
    budgets: Sequence[tuple[int, bool]] = GPU_MEMORY_BUDGETS, max_num_seqs: int = 256,
) -> list[dict[str, Any]]:  # fmt: skip
    """The same question at GPU scale, from ``workbench kv-calc``'s analytical activation estimate
    (:func:`workbench.kvcalc.kv_calc` with ``activation_reserve="estimate"``, bfloat16, vLLM's
    ``max_num_seqs`` 256): per budget, the activation reserve (GiB), the KV pool (GiB and tokens) and the
    ``max_model_len`` sequences that fit. Whole prompts need a budget of at least ``max_model_len``."""
    from workbench.kvcalc import kv_calc

    rows = []
    for budget, chunked in budgets:
        if not chunked and budget < max_model_len:
            raise ValueError(
                f"whole prompts need max_num_batched_tokens >= max_model_len={max_model_len}, got {budget}"
            )
        r = kv_calc(model, dtype="bfloat16", gpu=gpu, activation_reserve="estimate", seq_len=max_model_len,
                    max_num_batched_tokens=budget, max_num_seqs=max_num_seqs)  # fmt: skip
        rows.append({
            "label": f"B={budget} {'chunked' if chunked else 'whole'}",
            "activation_gib": r.activation_reserve_bytes / 2**30,
            "kv_gib": r.kv_budget_bytes / 2**30,
            "kv_tokens": r.kv_tokens,
            "max_sequences": r.max_sequences,
        })  # fmt: skip
    return rows


def gpu_memory_table(rows: Sequence[dict]):
    """:func:`gpu_memory_rows` as a table."""
    from workbench.viz.table import Column, Table

    return Table(
        [
            Column("label", "budget", str, align="left"),
            Column("activation_gib", "activation reserve (GiB)", lambda v: f"{v:,.2f}"),
            Column("kv_gib", "KV pool (GiB)", lambda v: f"{v:,.2f}"),
            Column("kv_tokens", "KV pool (tokens)", lambda v: f"{v:,}"),
            Column("max_sequences", "sequences of max_model_len", lambda v: f"{v:,}"),
        ],
        list(rows),
    )


def memory_verdict(rows: Sequence[dict]) -> str:
    """The outline's claim "chunked prefill suppresses fragmentation", judged from :func:`memory_row` rows of a
    chunked and a whole-prompt run: what the budget did to the activation peak and the KV pool, and to the
    fragmentation rate (a change under one percentage point counts as none)."""
    chunked = next(r for r in rows if r["label"].endswith("chunked"))
    whole = next(r for r in rows if not r["label"].endswith("chunked"))
    more = chunked["kv_pool_tokens"] / whole["kv_pool_tokens"] - 1
    d = 100 * (chunked["frag_mean"] - whole["frag_mean"])
    frag = "none (under one point)" if abs(d) < 1 else f"{d:+.1f} points"
    return "\n".join([
        f"activation peak: {chunked['activation_mib']:,.1f} MiB chunked vs {whole['activation_mib']:,.1f} MiB whole",
        f"KV pool: {more:+.1%} tokens with chunked prefill",
        f"fragmentation rate (mean) change from chunking: {frag}",
        "verdict: chunked prefill leaves memory to the KV pool; "
        + ("it does not suppress fragmentation on a paged pool" if abs(d) < 1 else
           ("it lowers the fragmentation rate" if d < 0 else "it raises the fragmentation rate")),
    ])  # fmt: skip


def exercise_prefills(results: dict[str, ArrivalResult]) -> list[dict]:
    """The long prompts of every chunked run whose prefill ran beside a constant number of decodes and
    no other prefill — the cases exercise 8.1 predicts — as ``{"run", "prompt_tokens", "budget",
    "decodes", "chunks"}``."""
    out = []
    for label, res in results.items():
        for m in prefill_measurements(res):
            if m["chunked"] and m["decodes"] is not None and m["alone"]:
                out.append({"run": label} | {k: m[k] for k in ("prompt_tokens", "budget", "decodes", "chunks")})
    return out


def trace_table(trace: Sequence[tuple[int, PromptRecord]]):
    """One row per request: arrival step, id, prompt characters, output tokens
    (a :class:`~workbench.viz.table.Table`; rows ``{"arrives_at_step", "request", "prompt_chars", "output_tokens"}``)."""
    from workbench.viz.table import Column, Table

    rows = [
        {"arrives_at_step": at, "request": r.id, "prompt_chars": len(r.prompt), "output_tokens": r.max_tokens}
        for at, r in trace
    ]
    return Table(
        [
            Column("arrives_at_step", "arrives at step"),
            Column("request", "request", align="left"),
            Column("prompt_chars", "prompt (characters)", "{:,}".format),
            Column("output_tokens", "output (tokens)"),
        ],
        rows,
    )


#: headers (with units) of :func:`tradeoff_row` keys in :func:`tradeoff_table`
TRADEOFF_HEADERS = {
    "max_num_batched_tokens": "max_num_batched_tokens",
    "steps": "steps",
    "max_step_tokens": "largest step with decodes (tokens)",
    "long_chunks": "long prompts' chunks",
    "long_ttft_steps": "long prompts' TTFT (steps)",
    "ttft_p50_s": "TTFT p50 (ms)",
    "ttft_p99_s": "TTFT p99 (ms)",
    "itl_p50_s": "ITL p50 (ms)",
    "itl_p99_s": "ITL p99 (ms)",
    "output_throughput_tok_s": "output throughput (tok/s)",
}


def _tradeoff_cell(key: str):
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, list):
            return "/".join(str(x) for x in v)
        if key.endswith("_s"):
            return f"{1000 * v:,.0f}"
        if isinstance(v, float):
            return f"{v:,.1f}"
        return str(v)

    return fmt


def tradeoff_table(rows: Sequence[dict], columns: Sequence[str]):
    """A :class:`~workbench.viz.table.Table` of :func:`tradeoff_row` rows: the run's label, then
    ``columns`` (lists joined by ``/``, seconds shown in ms; headers with units from :data:`TRADEOFF_HEADERS`)."""
    from workbench.viz.table import Column, Table

    cols = [Column("label", "run", str, align="left")]
    cols += [Column(k, TRADEOFF_HEADERS.get(k, k), _tradeoff_cell(k)) for k in columns]
    return Table(cols, rows)


def tradeoff_figure(rows: Sequence[dict], *, widget: bool = False):
    """ITL p99 against TTFT (p50 and p99) of each run, one point per token budget: chunked prefill
    (circles, joined in budget order) and whole prompts (squares). Milliseconds."""
    fig = (go.FigureWidget if widget else go.Figure)()
    for on, symbol, name in ((True, "circle", "chunked prefill"), (False, "square", "whole prompts")):
        rs = sorted((r for r in rows if r["enable_chunked_prefill"] == on), key=lambda r: r["max_num_batched_tokens"])
        for pct, dash in (("p99", "solid"), ("p50", "dot")):
            fig.add_scatter(
                x=[1000 * r[f"ttft_{pct}_s"] for r in rs],
                y=[1000 * r["itl_p99_s"] for r in rs],
                text=[r["label"] for r in rs],
                mode="lines+markers+text" if pct == "p99" else "lines+markers",
                textposition="middle right",
                cliponaxis=False,
                marker=dict(symbol=symbol, size=10 if pct == "p99" else 7),
                line=dict(dash=dash),
                name=f"{name}: TTFT {pct}",
                hovertemplate="%{text}<br>TTFT %{x:,.0f} ms<br>ITL p99 %{y:,.0f} ms<extra></extra>",
            )
    fig.update_layout(
        title="The token budget moves latency between first tokens and the tokens after",
        xaxis={"title": {"text": "TTFT (ms)"}, "rangemode": "tozero"},
        yaxis={"title": {"text": "inter-token latency p99 (ms)"}, "rangemode": "tozero"},
        height=460,
        legend=LEGEND_ABOVE,
        margin={"t": LEGEND_ABOVE_MARGIN, "r": 90},
    )
    return fig


def steps_figure(results: dict[str, ArrivalResult], title: str = "Tokens per step") -> go.Figure:
    """Prefill and decode tokens of every step, one row of bars per run (deterministic)."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=len(results), cols=1, shared_xaxes=True, subplot_titles=list(results))
    for i, res in enumerate(results.values(), 1):
        steps = res.recorder.steps
        x = [s.step for s in steps]
        for name, field, color in (
            ("decode", "num_decode_tokens", "#1f77b4"),
            ("prefill", "num_prefill_tokens", "#ff7f0e"),
        ):
            y = [getattr(s, field) for s in steps]
            fig.add_bar(x=x, y=y, name=name, marker_color=color, showlegend=i == 1, row=i, col=1)
    fig.update_layout(barmode="stack", title=title, height=160 * len(results) + 80, bargap=0)
    fig.update_xaxes(title_text="engine step", row=len(results), col=1)
    fig.update_yaxes(tickformat=",d", rangemode="tozero")
    return fig


class TradeoffPanel(RunButtonThread):
    """A ``max_num_batched_tokens`` slider and an ``enable_chunked_prefill`` checkbox over real runs.

    Each Run (or :meth:`run`) is an :func:`arrival_run` of ``trace``; its (TTFT, ITL p99) joins the
    plot (:func:`tradeoff_figure`, a ``FigureWidget``) and its row the table in the status line.

    Attributes:
        rows: :func:`tradeoff_row` of every run, in order.
        result: the latest :class:`ArrivalResult`.
        error: the latest refused run's message, or ``None``.

    Raises:
        ImportError: ipywidgets / anywidget missing (``pip install 'workbench[lab]'``).
        ValueError: an engine argument's name that is not one.
    """

    def __init__(
        self, trace=None, *, max_num_batched_tokens: int = 128, enable_chunked_prefill: bool = True, **engine_args: Any
    ) -> None:
        from workbench.viz.live import _require_widgets

        widgets = _require_widgets()
        check_engine_arg_names(engine_args)  # a misspelled name is refused now, not at the first click
        self.trace = trace if trace is not None else chunked_trace()
        self.engine_args = engine_args
        self.rows: list[dict] = []
        self.result: ArrivalResult | None = None
        self._init_button(widgets)
        self.status.value = "<code>ready: move the slider and press Run</code>"
        style = {"description_width": "initial"}
        self.controls = {
            "max_num_batched_tokens": widgets.IntSlider(
                min=16,
                max=2048,
                step=16,
                value=max_num_batched_tokens,
                description="max_num_batched_tokens",
                style=style,
                layout=widgets.Layout(width="60%"),
            ),
            "enable_chunked_prefill": widgets.Checkbox(
                value=enable_chunked_prefill, description="enable_chunked_prefill", style=style
            ),
        }
        self.figure = tradeoff_figure([], widget=True)
        self.widget = widgets.VBox(
            [widgets.HBox(list(self.controls.values())), widgets.HBox([self.button, self.status]), self.figure]
        )

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def run(self, **values: Any) -> ArrivalResult:
        """One run with the widgets' values (``values`` override them and move them); the Run
        button's code path, in the calling thread.

        Raises:
            ValueError: bad engine arguments (also shown in the status line).
        """
        for k, v in values.items():
            why = None
            if k not in self.controls:
                why = f"{k!r} is not one of this panel's controls ({', '.join(self.controls)})"
            elif k == "enable_chunked_prefill" and not isinstance(v, bool):
                why = f"enable_chunked_prefill={v!r}: give True or False"
            elif k == "max_num_batched_tokens" and (isinstance(v, bool) or not isinstance(v, int)):
                why = f"max_num_batched_tokens={v!r}: give a number of tokens (an int)"
            if why is not None:
                self._show_error(f"ValueError: {why}")
                raise ValueError(why)
        cur = self.current_values() | values
        return self._locked(cur, {k: v for k, v in values.items() if _accepts(self.controls[k], v)})

    def current_values(self) -> dict[str, Any]:
        """``max_num_batched_tokens`` and ``enable_chunked_prefill`` as the widgets show them."""
        return {k: w.value for k, w in self.controls.items()}

    def _execute(self, values: dict) -> ArrivalResult:
        with self._busy():
            res = arrival_run(self.trace, **(self.engine_args | values))
        self.result = res
        self.rows.append(tradeoff_row(res))
        new = tradeoff_figure(self.rows)
        with self.figure.batch_update():
            for tr, nt in zip(self.figure.data, new.data):
                tr.x, tr.y, tr.text = nt.x, nt.y, nt.text
        table = tradeoff_table(self.rows, ["max_step_tokens", "long_chunks", "ttft_p99_s", "itl_p99_s"])
        self.status.value = table.to_html()
        return res


def itl_percentile(res: ArrivalResult, q: float, prefix: str = "decode-") -> float | None:
    """The ``q``-th percentile of the inter-token gaps (s) of the requests whose id starts with ``prefix``."""
    gaps = [g for r in res.recorder.requests if r.request_id.startswith(prefix) for g in r.itl_s]
    return float(np.percentile(gaps, q)) if gaps else None


# ---------------------------------------------------------------- exercises
def reference_prefill_chunks(prompt_tokens: int, budget: int, decodes: int) -> int:
    """Steps a prompt of ``prompt_tokens`` tokens takes under chunked prefill, when ``decodes`` running
    requests take one token each of every step's ``budget`` first: ``ceil(P / (B - D))``."""
    return math.ceil(prompt_tokens / (budget - decodes))


def scheduler_prefill_chunks(prompt_tokens: int, budget: int, decodes: int, block_size: int = 16) -> int:
    """Steps the engine's own :class:`~workbench.scheduler.Scheduler` (chunked prefill, no model)
    takes to prefill a ``prompt_tokens``-token prompt that arrives while ``decodes`` requests decode
    under a token budget of ``budget``: the ground truth exercise 8.1 is checked against, besides
    the chapter's measured runs (so that a learner's trace that cannot tell answers apart does not
    make every answer pass).

    Raises:
        ValueError: ``budget <= decodes`` (the prompt would never be scheduled).
    """
    from workbench.kv.manager import KVCacheManager
    from workbench.request import Request
    from workbench.sampling import SamplingParams
    from workbench.scheduler import Scheduler

    if budget <= decodes:
        raise ValueError(f"budget={budget} leaves no token for the prompt beside {decodes} decodes")
    total = prompt_tokens + decodes * 2 + 64
    kv = KVCacheManager(-(-total // block_size) + decodes + 2, block_size)
    sched = Scheduler(kv, decodes + 1, budget, enable_chunked_prefill=True)
    step = 0

    def run_step():
        nonlocal step
        out = sched.schedule()
        sched.update(out, {s.request.request_id: 5 for s in out.scheduled if s.samples}, float(step))
        step += 1
        return out

    for i in range(decodes):  # one-token prompts that keep decoding through the whole prefill
        sp = SamplingParams(max_tokens=prompt_tokens + 8, ignore_eos=True)
        sched.add_request(Request(f"d{i}", [3], sp, 0.0, max_total_len=total))
    if decodes:
        run_step()  # their prompts: from the next step on, each decodes one token per step
    long = Request("long", [4] * prompt_tokens, SamplingParams(max_tokens=1, ignore_eos=True), 1.0, max_total_len=total)
    sched.add_request(long)
    chunks = 0
    while long.num_computed_tokens < prompt_tokens:
        out = run_step()
        chunks += any(s.request is long for s in out.scheduled)
    return chunks


#: (P, B, D) cases exercise 8.1 also checks against the scheduler (they tell B from B - D apart)
SCHEDULER_CASES_8_1 = ((573, 64, 3), (100, 16, 5), (50, 64, 2), (257, 128, 0))


@_register(
    "8.1",
    "With chunked prefill, a prompt of P tokens arrives while D requests are decoding; the token budget is "
    "B (max_num_batched_tokens). Write prefill_chunks(P, B, D): how many steps (chunks) its prefill takes. "
    "It is checked against the engine's step records of every run.",
    "each step the D decodes take one token each from the budget first; the prompt gets what is left.",
)
class _PrefillChunks:
    @staticmethod
    def solution(measured: list) -> Callable:
        return reference_prefill_chunks

    @staticmethod
    def judge(answer, measured: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        cases = [(m["prompt_tokens"], m["budget"], m["decodes"], m["chunks"], "your runs") for m in measured]
        cases += [(p, b, d, scheduler_prefill_chunks(p, b, d), "the scheduler") for p, b, d in SCHEDULER_CASES_8_1]
        for p, b, d, chunks, source in cases:
            got = answer(p, b, d)
            if _number(got) != chunks:
                hint = ""
                if got == math.ceil(p / b):
                    hint = " (the decodes take part of every step's budget)"
                return False, f"P={p}, B={b}, D={d}: yours {got!r}, {source} took {chunks} steps{hint}"
        n = len(measured)
        return True, (
            f"equal to the engine's chunk count in {n} measured prefill{'s' if n != 1 else ''} of your runs "
            f"and {len(SCHEDULER_CASES_8_1)} cases run through the scheduler"
        )
