"""Chapters 9 and 10 of the labs: tensor parallelism for real, and NCCL buffer tuning.

Chapter 9 runs the bundled model at ``tensor_parallel_size`` 1 and 3 (worker processes over
gloo, :mod:`workbench.executor.tensor_parallel`) and reads what each engine reports about
itself: its memory budget (one rank's weights, KV bytes per token, KV pool, communication
buffers), every step's ``StepStats`` (bytes all-reduced and all-gathered, collectives, seconds
in them) and the greedy tokens. Then the simulator (:mod:`workbench.sim`) prices the same
Megatron-style split for a 70B model on 2 / 4 / 8 GPUs with NVLink and with PCIe links.

Chapter 10 uses the NCCL buffer model (:func:`workbench.comm.nccl_buffer_bytes`) and the
simulated engine's memory budget (the same arithmetic as ``workbench kv-calc``) to show what
``NCCL_BUFFSIZE``, the channel counts and the protocols cost in KV blocks and concurrency, and
what that does to the simulator's throughput and latency.

Panels (:class:`TPRunPanel`, :class:`TPSimPanel`, :class:`BufferPanel`) are ipywidgets named
like the engine arguments; their ``run()`` is the Run button's code path, without a click.

From a script (not a notebook), put the tensor-parallel runs under ``if __name__ == "__main__":``:
the worker processes are spawned, and each re-imports the script (Python's multiprocessing rule).
"""

from __future__ import annotations

import html
import math
import threading
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.labs.panel import RunButtonThread, _accepts
from workbench.labs.runs import LAB_ENGINE_DEFAULTS, lab_run, lab_trace

MiB = 1 << 20

__all__ = [
    "BUFFER_CONFIGS",
    "BufferPanel",
    "TPRunPanel",
    "TPSimPanel",
    "burst_trace",
    "buffer_exercise",
    "buffer_figure",
    "buffer_findings",
    "buffer_rows",
    "close_engines",
    "comm_rows",
    "expected_allreduce_bytes",
    "kv_cost_rows",
    "measured_buffer_lines",
    "memory_rows",
    "sim_buffer_figure",
    "sim_buffer_grid",
    "sim_hardware",
    "sim_run_row",
    "sim_tp_figure",
    "sim_tp_grid",
    "time_split_figure",
    "time_split_rows",
    "tp_engine",
    "tp_run",
    "tp_runs",
    "tp_trace",
]


# ====================================================================== chapter 9: real runs
def tp_trace(num_requests: int = 4, max_output: int = 8, seed: int = 0):
    """The chapter's small trace: ``num_requests`` short real prompts (at most 200 characters),
    seeded output lengths of at most ``max_output`` tokens (:func:`~workbench.labs.runs.lab_trace`).

    Small on purpose: a TP=3 engine runs three processes on this machine's cores, and every
    step is 64 collectives."""
    return lab_trace(num_requests, mean_output=max_output / 2, max_output=max_output, seed=seed, max_prompt_chars=200)


_ENGINES: dict[int, tuple[dict, Any]] = {}
_ENGINES_LOCK = threading.Lock()


def tp_engine(tensor_parallel_size: int, **engine_args: Any):
    """A real engine (``LLM``) at ``tensor_parallel_size``, built once and kept for the session.

    The same arguments return the same engine (a TP=3 engine's two worker processes each load
    the model: building one costs tens of seconds on a 2-core machine). Only one
    tensor-parallel group can exist in a process, so building a TP > 1 engine with other
    arguments shuts the previous TP > 1 engine down first. :func:`close_engines` stops them all.

    Args:
        tensor_parallel_size: ranks (the bundled model takes 1 or 3: 9 heads, 3 KV heads).
        **engine_args: :class:`~workbench.config.EngineConfig` fields over the lab defaults.

    Raises:
        ValueError: a size that does not split the model (names the valid sizes), bad arguments.
    """
    from workbench.engine import LLM

    args = LAB_ENGINE_DEFAULTS | engine_args | {"tensor_parallel_size": tensor_parallel_size}
    with _ENGINES_LOCK:
        held = _ENGINES.get(tensor_parallel_size)
        if held is not None and held[0] == args and _alive(held[1]):
            return held[1]
        if held is not None:
            held[1].shutdown()
            del _ENGINES[tensor_parallel_size]
        if tensor_parallel_size > 1:  # one process group per process
            for tp in [t for t in _ENGINES if t > 1]:
                _ENGINES.pop(tp)[1].shutdown()
        llm = LLM(**args)
        _ENGINES[tensor_parallel_size] = (args, llm)
        return llm


def _alive(llm) -> bool:
    tp = getattr(llm.llm_engine, "_tp", None)
    return tp is None or tp.is_alive


def close_engines() -> None:
    """Shut down every engine :func:`tp_engine` keeps (stops the worker processes)."""
    with _ENGINES_LOCK:
        for _, llm in _ENGINES.values():
            llm.shutdown()
        _ENGINES.clear()


def tp_runs(sizes: Sequence[int] = (1, 3), records=None, **engine_args) -> dict[int, Any]:
    """The same requests at each tensor-parallel size (greedy, EOS ignored); ``{tp: JobResult}``.

    Each size's engine comes from :func:`tp_engine` (built once, reused by later calls). Every
    process computes with the same number of torch threads — what a rank of the largest size gets,
    ``cores // max(sizes)``, at least 1 (:func:`tp_run`) — so the sizes are compared process for
    process (``docs/benchmarks.md``, tensor parallelism, table 1)."""
    records = list(records) if records is not None else tp_trace()
    threads = _threads_per_rank(max(sizes))
    return {tp: tp_run(tp, records, threads=threads, **engine_args) for tp in sizes}


def _threads_per_rank(n: int) -> int:
    import os

    return max(1, (os.cpu_count() or 1) // n)


def tp_run(tensor_parallel_size: int, records, threads: int | None = None, **engine_args):
    """One real run of ``records`` on :func:`tp_engine`'s engine at this size.

    Args:
        threads: torch threads of this process during the run (``None``: leave them); the TP
            workers keep their own (``cores // tensor_parallel_size``, at least 1).
    """
    import torch

    llm = tp_engine(tensor_parallel_size, **engine_args)
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return lab_run(records, llm=llm)
    finally:
        torch.set_num_threads(saved)


def memory_rows(runs: dict[int, Any]) -> list[dict[str, Any]]:
    """One rank's memory budget at each size (``MemoryBudget`` of the run's engine), bytes.

    Keys: ``tensor_parallel_size``, ``weights_bytes``, ``activation_bytes`` (profiled peak, largest
    over the ranks), ``comm_buffer_bytes`` (modelled on CPU: gloo has no NCCL buffers),
    ``kv_bytes_per_token``, ``block_bytes``, ``num_blocks``, ``kv_pool_bytes``, ``kv_pool_tokens``.
    """
    keys = (
        "weights_bytes",
        "activation_bytes",
        "comm_buffer_bytes",
        "kv_bytes_per_token",
        "block_bytes",
        "num_blocks",
        "kv_pool_bytes",
        "kv_pool_tokens",
    )
    return [{"tensor_parallel_size": tp} | {k: r.memory[k] for k in keys} for tp, r in runs.items()]


def print_memory(rows: Sequence[dict[str, Any]]) -> None:
    """:func:`memory_rows` as a table (MiB and counts), with each figure's ratio to TP=1's."""
    base = rows[0]
    print(f"{'per rank':<34}" + "".join(f"{'TP=' + str(r['tensor_parallel_size']):>16}" for r in rows))
    spec = (
        ("weights (MiB)", "weights_bytes", True),
        ("activations, profiled peak (MiB)", "activation_bytes", True),
        ("communication buffers (MiB)", "comm_buffer_bytes", True),
        ("KV bytes per token", "kv_bytes_per_token", False),
        ("KV pool (blocks)", "num_blocks", False),
        ("KV pool (MiB)", "kv_pool_bytes", True),
        ("KV pool (tokens)", "kv_pool_tokens", False),
    )
    for label, k, mib in spec:
        cells = []
        for r in rows:
            v = r[k] / MiB if mib else r[k]
            txt = f"{v:,.1f}" if mib else f"{v:,}"
            if r is not base and base[k]:
                txt += f" ({r[k] / base[k]:.2f}x)"
            cells.append(f"{txt:>16}")
        print(f"{label:<34}" + "".join(cells))


def print_tokens(runs: dict[int, Any], records=None) -> None:
    """Each request's greedy token ids at the first size, and whether every size produced the same."""
    first_tp, first = next(iter(runs.items()))
    for i, o in enumerate(first.outputs):
        print(f"request {i}: {len(o.outputs[0].token_ids)} tokens {o.outputs[0].token_ids}")
    for tp, same in same_tokens(runs).items():
        if tp != first_tp:
            print(f"TP={tp} produced the same greedy tokens as TP={first_tp}: {same}")


def explain_memory(rows: Sequence[dict[str, Any]], hidden_size: int, num_hidden_layers: int, dtype_bytes: int) -> None:
    """Sentences computed from :func:`memory_rows`: why the weights are not exactly 1/N, the KV
    bytes per token, and how much larger the pool gets."""
    base = rows[0]
    for r in rows[1:]:
        n = r["tensor_parallel_size"]
        extra = r["weights_bytes"] - base["weights_bytes"] / n
        norms = (2 * num_hidden_layers + 1) * hidden_size * dtype_bytes  # input, post-attention, final RMSNorm
        print(
            f"TP={n}: weights per rank = TP=1's / {n} + {extra:,.0f} B; the RMSNorm weights ({norms:,} B) are kept "
            f"whole on every rank, so {n - 1} of {n} copies are extra: {norms * (n - 1) / n:,.0f} B"
        )
        print(
            f"TP={n}: KV bytes per token per rank {r['kv_bytes_per_token']:,} = TP=1's "
            f"{base['kv_bytes_per_token']:,} / {base['kv_bytes_per_token'] // r['kv_bytes_per_token']} "
            f"(each rank holds its own KV heads)"
        )
        print(
            f"TP={n}: the same device_memory per rank holds "
            f"{r['num_blocks'] / base['num_blocks']:.2f}x the blocks of TP=1 ({r['num_blocks']:,} vs "
            f"{base['num_blocks']:,}): smaller blocks, and less memory taken by weights and activations"
        )


def expected_allreduce_bytes(num_tokens: int, hidden_size: int, num_hidden_layers: int, dtype_bytes: int) -> int:
    """Bytes one rank hands to all-reduces in a step of ``num_tokens`` tokens (tensor parallel).

    ``(1 + 2 L) x tokens x hidden x dtype bytes``: the vocab-parallel embedding's output (each
    rank looks up its slice of the vocabulary, zeros elsewhere) and, per layer, the row-parallel
    outputs of attention (``o_proj``) and of the MLP (``down_proj``) — Megatron-LM (Shoeybi et
    al. 2019, §3) counts the two per layer. Payload per rank, not bytes on the wire (a ring
    all-reduce sends ``2 (N - 1) / N`` of it; :mod:`workbench.comm`)."""
    return (1 + 2 * num_hidden_layers) * num_tokens * hidden_size * dtype_bytes


def model_dims(llm) -> dict[str, int]:
    """``{"hidden_size", "num_hidden_layers", "dtype_bytes"}`` of a running engine's model."""
    eng = llm.llm_engine
    cfg = eng.hf_config
    import torch

    elem = torch.empty((), dtype=eng.config.torch_dtype).element_size()
    return {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers, "dtype_bytes": elem}


def comm_rows(run, dims: dict[str, int]) -> list[dict[str, Any]]:
    """Per step of a run: tokens, the engine's measured bytes all-reduced and all-gathered, the
    collectives issued, and :func:`expected_allreduce_bytes` for the step's tokens."""
    out = []
    for s in run.recorder.steps:
        tokens = s.num_prefill_tokens + s.num_decode_tokens
        out.append(
            {
                "step": s.step,
                "tokens": tokens,
                "sampling": s.num_prefill_reqs + s.num_decode_reqs,
                "allreduce_bytes": s.allreduce_bytes,
                "formula_bytes": expected_allreduce_bytes(tokens, **dims),
                "allgather_bytes": s.allgather_bytes,
                "collectives": s.num_collectives,
            }
        )
    return out


def print_comm(rows: Sequence[dict[str, Any]], every: int = 1) -> None:
    """:func:`comm_rows` as a table, and whether every step's all-reduce bytes equal the formula."""
    print(
        f"{'step':>4} {'tokens':>6} {'all-reduced (B)':>16} {'(1+2L)·T·h·b':>14} {'all-gathered (B)':>17} {'collectives':>11}"
    )
    for i, r in enumerate(rows):
        if i % every == 0 or i == len(rows) - 1:
            print(
                f"{r['step']:>4} {r['tokens']:>6} {r['allreduce_bytes']:>16,} {r['formula_bytes']:>14,} "
                f"{r['allgather_bytes']:>17,} {r['collectives']:>11}"
            )
    same = sum(r["allreduce_bytes"] == r["formula_bytes"] for r in rows)
    total = sum(r["allreduce_bytes"] for r in rows)
    print(f"all-reduced bytes equal to the formula on {same} of {len(rows)} steps; {total / MiB:,.2f} MiB in the run")


def same_tokens(runs: dict[int, Any]) -> dict[int, bool]:
    """``{tp: its greedy token ids equal the first size's}`` (request by request)."""
    first = next(iter(runs.values()))
    ref = [o.outputs[0].token_ids for o in first.outputs]
    return {tp: [o.outputs[0].token_ids for o in r.outputs] == ref for tp, r in runs.items()}


def time_split_rows(runs: dict[int, Any]) -> list[dict[str, Any]]:
    """Mean milliseconds per step at each size, split as the engine measures them: scheduling,
    compute (model time − communication), communication (rank 0's seconds in collectives,
    waiting for the other ranks included), sampling. Timings: they vary run to run."""
    rows = []
    for tp, r in runs.items():
        st = r.recorder.steps
        n = max(1, len(st))
        model = sum(s.model_time_s for s in st)
        comm = sum(s.comm_time_s for s in st)
        rows.append(
            {
                "tensor_parallel_size": tp,
                "steps": len(st),
                "schedule_ms": 1e3 * sum(s.schedule_time_s for s in st) / n,
                "compute_ms": 1e3 * (model - comm) / n,
                "communication_ms": 1e3 * comm / n,
                "sample_ms": 1e3 * sum(s.sample_time_s for s in st) / n,
                "communication_share": comm / model if model else 0.0,
            }
        )
    return rows


def print_time_split(rows: Sequence[dict[str, Any]]) -> None:
    """:func:`time_split_rows` as a table (timings: they vary from run to run)."""
    print(
        f"{'':<6} {'steps':>5} {'schedule':>9} {'compute':>9} {'comm.':>9} {'sample':>9} {'comm. share of model':>21}"
    )
    for r in rows:
        print(
            f"TP={r['tensor_parallel_size']:<3} {r['steps']:>5} {r['schedule_ms']:>7.1f}ms {r['compute_ms']:>7.1f}ms "
            f"{r['communication_ms']:>7.1f}ms {r['sample_ms']:>7.1f}ms {r['communication_share']:>21.0%}"
        )


_SPLIT = (("schedule_ms", "scheduling"), ("compute_ms", "compute"), ("communication_ms", "communication"),
          ("sample_ms", "sampling"))  # fmt: skip


def time_split_figure(rows: Sequence[dict[str, Any]], title: str | None = None) -> go.Figure:
    """Stacked bars of :func:`time_split_rows`: where a step's time goes at each size."""
    fig = go.Figure()
    x = [f"TP={r['tensor_parallel_size']}" for r in rows]
    for key, name in _SPLIT:
        fig.add_bar(x=x, y=[r[key] for r in rows], name=name, hovertemplate=f"{name}: %{{y:.1f}} ms/step")
    fig.update_layout(
        barmode="stack",
        title=title or "Mean step time, split (bundled model, CPU, gloo)",
        yaxis_title="ms per step",
        height=380,
    )
    return fig


# ====================================================================== simulator (chapters 9 and 10)
#: one-direction bandwidth and hop latency of a PCIe Gen4 x16 link, as the catalogue's PCIe cards (L4)
PCIE_GEN4_LINK = {"link_bandwidth": 32 * 10**9, "link_latency_s": 5e-6}


def sim_hardware(gpu: str = "A100-80GB", interconnect: str = "NVLink"):
    """A catalogue GPU with its own links (``"NVLink"``), or the same GPU with PCIe Gen4 x16 links
    (``"PCIe"``: a what-if — same FLOP/s, HBM and capacity, only the GPU-to-GPU link changed, so
    that the comparison isolates the interconnect).

    Raises:
        ValueError: an unknown GPU (names the catalogue) or interconnect.
    """
    from workbench.sim.hardware import find_hardware

    hw = find_hardware(gpu)
    if interconnect == hw.interconnect:
        return hw
    if interconnect == "PCIe":
        return hw.with_changes(
            name=f"{hw.name} (PCIe links)",
            interconnect="PCIe",
            link_source="what-if: PCIe Gen4 x16, 32 GB/s one direction, 5 µs per hop (as the catalogue's L4)",
            **PCIE_GEN4_LINK,
        )
    raise ValueError(f"interconnect={interconnect!r}: {hw.name} has {hw.interconnect}; use 'NVLink' or 'PCIe'")


def burst_trace(num_requests: int = 128, dataset: str = "sharegpt", seed: int = 0):
    """``num_requests`` requests that all arrive at t = 0 (offline throughput), with ShareGPT-like
    (or Alpaca-like) lengths from :func:`workbench.sim.trace.make_trace`'s seeded draw.

    Raises:
        ValueError: ``num_requests < 1`` or an unknown dataset.
    """
    from workbench.sim.trace import TraceRequest, make_trace

    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    t = make_trace(1000.0, 2 * num_requests / 1000.0 + 1.0, dataset, "poisson", seed)[:num_requests]
    return [TraceRequest(0.0, r.prompt_len, r.output_len, r.eos) for r in t]


def sim_run_row(
    model: str = "llama-2-70b",
    gpu: str = "A100-80GB",
    interconnect: str | None = None,
    tensor_parallel_size: int = 4,
    trace=None,
    **engine_args: Any,
) -> dict[str, Any]:
    """One simulator run (:func:`workbench.sim.run.simulate_job`, nothing written) and its figures.

    Args:
        model: a catalogue model; gpu: a catalogue GPU; interconnect: ``None`` (the GPU's own),
            ``"NVLink"`` or ``"PCIe"`` (:func:`sim_hardware`).
        tensor_parallel_size: GPUs the model is split over.
        trace: requests (default :func:`burst_trace`).
        **engine_args: engine arguments (``block_size``, ``max_num_seqs``, ``nccl_buffsize``,
            ``nccl_min_nchannels``, ``nccl_max_nchannels``, ``nccl_proto``, ...); ``max_model_len``
            defaults to 4096, ``max_num_seqs`` to 256.

    Returns:
        ``{"gpu", "interconnect", "tensor_parallel_size", "num_blocks", "comm_buffer_bytes",
        "output_tok_s", "output_tok_s_per_gpu", "tpot_p50_ms", "ttft_p50_s", "allreduce_share",
        "peak_running", "duration_s"}`` — simulated seconds; ``allreduce_share`` = simulated
        all-reduce seconds / step seconds over the run.

    Raises:
        ValueError: a size that does not split the model, a budget without room for one sequence,
            bad engine arguments (each names the value and the fix).
    """
    from workbench.catalog import MODELS
    from workbench.sim import SimSpec
    from workbench.sim.run import simulate_job

    if model not in MODELS:
        raise ValueError(f"model={model!r} is not in the catalogue; use one of {', '.join(MODELS)}")
    hw = sim_hardware(gpu, interconnect or _own_link(gpu))
    trace = trace if trace is not None else burst_trace()
    args = {"max_model_len": 4096, "max_num_seqs": 256} | engine_args
    res = simulate_job(SimSpec(MODELS[model], hw, tensor_parallel_size), trace, output_dir=None, **args)
    steps = res.engine.recorder.steps
    wall = sum(s.wall_time_s for s in steps)
    comm = sum(s.comm_time_s for s in steps)
    s = res.summary
    return {
        "model": model,
        "gpu": gpu,
        "interconnect": hw.interconnect,
        "tensor_parallel_size": tensor_parallel_size,
        "num_blocks": res.engine.memory.num_blocks,
        "comm_buffer_bytes": res.engine.memory.comm_buffer_bytes,
        "output_tok_s": s["output_throughput_tok_s"],
        "output_tok_s_per_gpu": s["output_throughput_tok_s"] / tensor_parallel_size,
        "tpot_p50_ms": 1e3 * s["tpot_p50_s"],
        "ttft_p50_s": s["ttft_p50_s"],
        "allreduce_share": comm / wall if wall else 0.0,
        "peak_running": max((x.num_running for x in steps), default=0),
        "duration_s": s["simulated_duration_s"],
    }


def _own_link(gpu: str) -> str:
    from workbench.sim.hardware import find_hardware

    return find_hardware(gpu).interconnect


def sim_tp_grid(
    model: str = "llama-2-70b",
    gpu: str = "A100-80GB",
    sizes: Sequence[int] = (2, 4, 8),
    interconnects: Sequence[str] = ("NVLink", "PCIe"),
    trace=None,
    **engine_args: Any,
) -> list[dict[str, Any]]:
    """:func:`sim_run_row` for every interconnect x tensor-parallel size, on the same trace."""
    trace = trace if trace is not None else burst_trace()
    return [sim_run_row(model, gpu, link, tp, trace, **engine_args) for link in interconnects for tp in sizes]


def print_sim_rows(rows: Sequence[dict[str, Any]], extra: Sequence[str] = ()) -> None:
    """Simulator rows as a table (simulated figures, rounded)."""
    head = [*extra, "GPUs", "link", "KV blocks", "out tok/s", "tok/s/GPU", "TPOT p50 ms", "TTFT p50 s", "all-reduce"]
    body = []
    for r in rows:
        body.append(
            [str(r[k]) for k in extra]
            + [
                f"{r['tensor_parallel_size']} x {r['gpu']}",
                r["interconnect"],
                f"{r['num_blocks']:,}",
                f"{r['output_tok_s']:,.0f}",
                f"{r['output_tok_s_per_gpu']:,.0f}",
                f"{r['tpot_p50_ms']:.1f}",
                f"{r['ttft_p50_s']:.2f}",
                f"{r['allreduce_share']:.1%}",
            ]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for row in body:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


def tp_sim_findings(rows: Sequence[dict[str, Any]]) -> None:
    """Sentences computed from :func:`sim_tp_grid` rows: PCIe against NVLink at each size, and
    how throughput per GPU changes as GPUs are added."""
    by = {(r["interconnect"], r["tensor_parallel_size"]): r for r in rows}
    sizes = sorted({r["tensor_parallel_size"] for r in rows})
    for n in sizes:
        nv, pc = by.get(("NVLink", n)), by.get(("PCIe", n))
        if nv and pc:
            print(
                f"{n} GPUs: PCIe gives {pc['output_tok_s'] / nv['output_tok_s']:.2f}x NVLink's throughput; "
                f"all-reduce {pc['allreduce_share']:.1%} of step time vs {nv['allreduce_share']:.1%}; "
                f"TPOT p50 {pc['tpot_p50_ms']:.1f} vs {nv['tpot_p50_ms']:.1f} ms"
            )
    for link in dict.fromkeys(r["interconnect"] for r in rows):
        rs = [by[(link, n)] for n in sizes if (link, n) in by]
        if len(rs) > 1:
            a, b = rs[0], rs[-1]
            print(
                f"{link}: {a['tensor_parallel_size']} -> {b['tensor_parallel_size']} GPUs multiplies throughput by "
                f"{b['output_tok_s'] / a['output_tok_s']:.2f} (x{b['tensor_parallel_size'] / a['tensor_parallel_size']:g} "
                f"GPUs); per GPU {a['output_tok_s_per_gpu']:,.0f} -> {b['output_tok_s_per_gpu']:,.0f} tok/s"
            )


def sim_tp_figure(rows: Sequence[dict[str, Any]]) -> go.Figure:
    """Throughput and all-reduce share against the number of GPUs, one line per interconnect."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("output tokens/s (simulated)", "all-reduce share of step time"))
    for link in dict.fromkeys(r["interconnect"] for r in rows):
        rs = [r for r in rows if r["interconnect"] == link]
        x = [r["tensor_parallel_size"] for r in rs]
        fig.add_scatter(x=x, y=[r["output_tok_s"] for r in rs], name=link, legendgroup=link, row=1, col=1)
        fig.add_scatter(
            x=x, y=[r["allreduce_share"] for r in rs], name=link, legendgroup=link, showlegend=False, row=1, col=2
        )
    fig.update_xaxes(
        title_text="tensor_parallel_size (GPUs)", tickvals=sorted({r["tensor_parallel_size"] for r in rows})
    )
    fig.update_yaxes(tickformat=".0%", row=1, col=2)
    fig.update_layout(height=380, title=f"{rows[0]['model']} on {rows[0]['gpu']}: NVLink vs PCIe")
    return fig


# ====================================================================== chapter 10: NCCL buffers
#: buffer configurations of the chapter: (label, engine arguments)
BUFFER_CONFIGS: dict[str, dict[str, Any]] = {
    "default (4 MiB, 2 ch)": {},
    "4 MiB, 16 ch": {"nccl_buffsize": 4 * MiB, "nccl_min_nchannels": 16},
    "16 MiB, 16 ch": {"nccl_buffsize": 16 * MiB, "nccl_min_nchannels": 16},
    "64 MiB, 32 ch": {"nccl_buffsize": 64 * MiB, "nccl_min_nchannels": 32},
    "1 MiB, 2 ch, Simple only": {"nccl_buffsize": 1 * MiB, "nccl_proto": "Simple"},
}


def buffer_estimate(tensor_parallel_size: int, **nccl_args: Any):
    """:func:`workbench.comm.nccl_buffer_bytes` from engine arguments (``nccl_buffsize``,
    ``nccl_min_nchannels``, ``nccl_max_nchannels``, ``nccl_proto``; ``nchannels``: the count NCCL
    picks before the bounds, default 2) — the same call the engine and the simulator make."""
    from workbench.comm import nccl_buffer_bytes

    unknown = set(nccl_args) - {"nccl_buffsize", "nccl_min_nchannels", "nccl_max_nchannels", "nccl_proto", "nchannels"}
    if unknown:
        raise ValueError(
            f"unknown buffer argument(s) {sorted(unknown)}; use nccl_buffsize, nccl_min_nchannels, "
            "nccl_max_nchannels, nccl_proto"
        )
    return nccl_buffer_bytes(
        tensor_parallel_size,
        buffsize=nccl_args.get("nccl_buffsize"),
        nchannels=nccl_args.get("nchannels"),
        protocols=nccl_args.get("nccl_proto"),
        min_nchannels=nccl_args.get("nccl_min_nchannels"),
        max_nchannels=nccl_args.get("nccl_max_nchannels"),
    )


def buffer_rows(
    sizes: Sequence[int] = (2, 4, 8), configs: dict[str, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Per-rank and whole-group buffer bytes of each configuration at each group size (the model)."""
    configs = configs or BUFFER_CONFIGS
    rows = []
    for name, cfg in configs.items():
        for n in sizes:
            e = buffer_estimate(n, **cfg)
            rows.append(
                {
                    "config": name,
                    "tensor_parallel_size": n,
                    "nchannels": e.nchannels,
                    "protocols": "+".join(e.protocols),
                    "per_connection_bytes": e.per_connection_bytes,
                    "per_rank_bytes": e.per_rank_bytes,
                    "group_bytes": e.total_bytes,
                }
            )
    return rows


def print_buffer_rows(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'configuration':<26} {'TP':>3} {'channels':>8} {'protocols':<18} {'per conn. MiB':>13} {'per rank MiB':>12} {'group MiB':>10}"
    )
    for r in rows:
        print(
            f"{r['config']:<26} {r['tensor_parallel_size']:>3} {r['nchannels']:>8} {r['protocols']:<18} "
            f"{r['per_connection_bytes'] / MiB:>13.2f} {r['per_rank_bytes'] / MiB:>12.2f} {r['group_bytes'] / MiB:>10.2f}"
        )


def buffer_figure(
    channels: Sequence[int] = (1, 2, 4, 8, 16, 32),
    buffsizes_mib: Sequence[int] = (1, 4, 16, 64),
    protocols: Sequence[str] = ("LL,LL128,Simple", "Simple"),
) -> go.Figure:
    """Per-rank buffer MiB against the channel count, one line per ``NCCL_BUFFSIZE`` and protocol set
    (ring: the same at any group size >= 2)."""
    fig = go.Figure()
    for proto in protocols:
        for b in buffsizes_mib:
            y = [
                buffer_estimate(
                    2, nccl_buffsize=b * MiB, nccl_min_nchannels=c, nccl_max_nchannels=c, nccl_proto=proto
                ).per_rank_bytes
                / MiB
                for c in channels
            ]
            dash = "solid" if "," in proto else "dot"
            fig.add_scatter(x=list(channels), y=y, name=f"{b} MiB, {proto}", line={"dash": dash})
    fig.update_layout(
        title="NCCL buffers per rank (model): channels x (NCCL_BUFFSIZE + LL + LL128 buffers)",
        xaxis={"title": "channels", "type": "log", "tickvals": list(channels)},
        yaxis={"title": "MiB per rank", "type": "log"},
        height=420,
    )
    return fig


def sim_budget(model: str, gpu: str, tensor_parallel_size: int, **engine_args: Any):
    """The simulated engine's memory budget (``MemoryBudget``; buffers from the ``nccl_*`` arguments)."""
    from workbench.catalog import MODELS
    from workbench.config import EngineConfig
    from workbench.sim import SimEngine, SimSpec

    args = {"max_model_len": 4096, "max_num_seqs": 256} | engine_args
    eng = SimEngine(
        EngineConfig(**args), SimSpec(MODELS[model], sim_hardware(gpu, _own_link(gpu)), tensor_parallel_size)
    )
    return eng.memory


def kv_cost_rows(
    model: str = "llama-2-70b",
    gpu: str = "A100-80GB",
    sizes: Sequence[int] = (4, 8),
    configs: dict[str, dict[str, Any]] | None = None,
    block_size: int = 16,
    seq_len: int = 4096,
) -> list[dict[str, Any]]:
    """What each buffer configuration costs in KV blocks and sequences, per rank.

    ``num_blocks`` is the simulated engine's budget with the buffers (:func:`sim_budget`);
    ``blocks_without`` is ``workbench kv-calc``'s with the same activation reserve and no buffers;
    ``kv_calc_agrees``: kv-calc with the buffers added to the reserve gives the engine's count.
    ``max_seqs`` / ``max_seqs_without``: whole ``seq_len`` sequences the pool holds."""
    from workbench.kvcalc import kv_calc

    configs = configs or BUFFER_CONFIGS
    rows = []
    for tp in sizes:
        for name, cfg in configs.items():
            m = sim_budget(model, gpu, tp, block_size=block_size, **cfg)
            common = dict(gpu=gpu, tensor_parallel_size=tp, block_size=block_size, seq_len=seq_len)
            without = kv_calc(model, activation_reserve=m.activation_bytes, **common)
            check = kv_calc(model, activation_reserve=m.activation_bytes + m.comm_buffer_bytes, **common)
            per_seq = math.ceil(seq_len / block_size)
            rows.append(
                {
                    "config": name,
                    "tensor_parallel_size": tp,
                    "gpu": gpu,
                    "comm_buffer_bytes": m.comm_buffer_bytes,
                    "block_bytes": m.block_bytes,
                    "num_blocks": m.num_blocks,
                    "blocks_without": without.num_blocks,
                    "blocks_lost": without.num_blocks - m.num_blocks,
                    "max_seqs": m.num_blocks // per_seq,
                    "max_seqs_without": without.max_sequences,
                    "kv_calc_agrees": check.num_blocks == m.num_blocks,
                }
            )
    return rows


def print_kv_cost(rows: Sequence[dict[str, Any]], seq_len: int = 4096) -> None:
    print(
        f"{'configuration':<26} {'GPUs':>12} {'block KiB':>9} {'buffers MiB':>11} {'blocks':>7} {'no buffers':>10} {'lost':>5} "
        f"{'seqs of ' + str(seq_len):>12} {'no buffers':>10} {'kv-calc agrees':>14}"
    )
    for r in rows:
        print(
            f"{r['config']:<26} {str(r['tensor_parallel_size']) + ' x ' + r['gpu']:>12} "
            f"{r['block_bytes'] / 1024:>9,.0f} {r['comm_buffer_bytes'] / MiB:>11,.1f} {r['num_blocks']:>7,} {r['blocks_without']:>10,} "
            f"{r['blocks_lost']:>5,} {r['max_seqs']:>12,} {r['max_seqs_without']:>10,} {str(r['kv_calc_agrees']):>14}"
        )


def long_trace(num_requests: int = 256, seed: int = 0):
    """Requests long enough that the KV pool binds at TP=4 (prompts 1,500-3,000 tokens, outputs
    200-400, uniform, seeded, EOS ignored), all arriving at t = 0."""
    import numpy as np

    from workbench.sim.trace import TraceRequest

    rng = np.random.default_rng(seed)
    prompts = rng.integers(1500, 3000, num_requests)
    outputs = rng.integers(200, 400, num_requests)
    return [TraceRequest(0.0, int(p), int(o), False) for p, o in zip(prompts, outputs)]


def sim_buffer_grid(
    model: str = "llama-2-70b",
    gpus: Sequence[str] = ("A100-80GB", "H100-80GB"),
    sizes: Sequence[int] = (4, 8),
    configs: dict[str, dict[str, Any]] | None = None,
    trace=None,
    **engine_args: Any,
) -> list[dict[str, Any]]:
    """:func:`sim_run_row` for every GPU x size x buffer configuration (``"config"`` names it)."""
    configs = configs or BUFFER_CONFIGS
    trace = trace if trace is not None else long_trace()
    return [
        {"config": name} | sim_run_row(model, gpu, None, tp, trace, **(engine_args | cfg))
        for gpu in gpus
        for tp in sizes
        for name, cfg in configs.items()
    ]


def buffer_findings(rows: Sequence[dict[str, Any]]) -> None:
    """Sentences computed from :func:`sim_buffer_grid` rows: per setup, whether the KV pool limited
    the batch (peak running sequences below the requests and ``max_num_seqs``), and each
    configuration's blocks, batch, throughput and TPOT against the first (default) configuration."""
    first = next(iter(dict.fromkeys(r["config"] for r in rows)))
    setups = dict.fromkeys((r["tensor_parallel_size"], r["gpu"]) for r in rows)
    for tp, gpu in setups:
        rs = [r for r in rows if (r["tensor_parallel_size"], r["gpu"]) == (tp, gpu)]
        base = next(r for r in rs if r["config"] == first)
        print(
            f"{tp} x {gpu}: with {first} buffers {base['num_blocks']:,} blocks, peak batch "
            f"{base['peak_running']} sequences, {base['output_tok_s']:,.0f} tok/s"
        )
        for r in rs:
            if r is base:
                continue
            print(
                f"    {r['config']:<26} {r['num_blocks'] - base['num_blocks']:>+7,} blocks, peak batch "
                f"{r['peak_running']:>4}, throughput {r['output_tok_s'] / base['output_tok_s']:.3f}x, "
                f"TPOT p50 {r['tpot_p50_ms'] / base['tpot_p50_ms']:.3f}x"
            )


def sim_buffer_figure(rows: Sequence[dict[str, Any]]) -> go.Figure:
    """Throughput relative to the default configuration, per GPU setup, one bar per configuration."""
    fig = go.Figure()
    setups = list(dict.fromkeys(f"{r['tensor_parallel_size']} x {r['gpu']}" for r in rows))
    base = {
        f"{r['tensor_parallel_size']} x {r['gpu']}": r["output_tok_s"]
        for r in rows
        if r["config"] == next(iter(dict.fromkeys(x["config"] for x in rows)))
    }
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = {f"{r['tensor_parallel_size']} x {r['gpu']}": r for r in rows if r["config"] == name}
        fig.add_bar(
            x=setups,
            y=[rs[s]["output_tok_s"] / base[s] for s in setups],
            name=name,
            customdata=[[rs[s]["output_tok_s"], rs[s]["num_blocks"]] for s in setups],
            hovertemplate="%{y:.3f}x: %{customdata[0]:,.0f} tok/s, %{customdata[1]:,} blocks",
        )
    fig.update_layout(
        barmode="group",
        title="Simulated throughput vs the default buffers (long requests: the KV pool binds at TP=4)",
        yaxis={"title": "output tokens/s, relative to the default", "range": [0.85, 1.02]},
        height=400,
    )
    return fig


def measured_buffer_lines(tensor_parallel_size: int | None = None, **nccl_args: Any) -> list[str]:
    """Where a GPU is present: the NCCL buffer memory a real engine measures, beside the model's.

    Builds a real engine on CUDA with worker processes and NCCL (``tensor_parallel_size`` = the
    number of GPUs that split the bundled model, else a one-rank NCCL group:
    ``distributed_executor_backend="mp"``); its ``MemoryBudget.comm_buffer_bytes`` is measured
    (free device memory before and after the group's first collectives,
    :mod:`workbench.executor.tensor_parallel`). Without CUDA: one line saying so.
    """
    import torch

    if not torch.cuda.is_available():
        return [
            "no CUDA device on this machine: the measured NCCL buffers need GPUs; the figures above are the model's"
        ]
    from workbench.engine import LLM
    from workbench.executor.tensor_parallel import modelled_comm_buffer_bytes

    n = torch.cuda.device_count()
    tp = tensor_parallel_size or (3 if n >= 3 else 1)
    llm = LLM(
        device="cuda",
        dtype="float16",
        tensor_parallel_size=tp,
        distributed_executor_backend="mp",
        max_model_len=256,
        num_gpu_blocks_override=64,
        **nccl_args,
    )
    try:
        eng = llm.llm_engine
        measured = eng.memory.comm_buffer_bytes
        source = eng._tp.comm_buffer_source if eng._tp is not None else "none"
        modelled = modelled_comm_buffer_bytes(eng.config, tp)
        return [
            f"{n} CUDA device(s); a {tp}-rank NCCL group ({torch.cuda.get_device_name(0)})",
            f"measured per rank: {measured / MiB:,.1f} MiB ({source}); the model: {modelled / MiB:,.1f} MiB",
        ]
    finally:
        llm.shutdown()


# ====================================================================== panels
class _Panel(RunButtonThread):
    """Widgets + Run button + status line; ``run(**overrides)`` is the button's code path."""

    controls: dict

    def _build(self, controls: dict, plot) -> None:
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        self._w = w
        self.controls = controls
        self.result = None
        self.history: list[tuple[dict, Any]] = []
        self._init_button(w)
        self.plot = plot
        grid = w.GridBox(list(controls.values()), layout=w.Layout(grid_template_columns="repeat(2, 50%)"))
        self.widget = w.VBox([grid, w.HBox([self.button, self.status]), plot])

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def current_values(self) -> dict[str, Any]:
        return {k: c.value for k, c in self.controls.items()}

    def run(self, **overrides: Any):
        """Run with the widgets' values and ``overrides`` (which also move the widgets when they
        can show them). Raises what the run raises (also shown in the status line)."""
        for k in overrides:
            if k not in self.controls:
                why = f"unknown control {k!r}; this panel has {', '.join(self.controls)}"
                self._show_error(f"ValueError: {why}")
                raise ValueError(why)
        values = self.current_values() | overrides
        return self._locked(values, {k: v for k, v in overrides.items() if _accepts(self.controls[k], v)})

    def _execute(self, values: dict[str, Any]):
        with self._busy():
            res = self._run(values)
        self.result = res
        self.history.append((values, res))
        self.status.value = "<pre>" + html.escape(self._describe(values, res)) + "</pre>"
        return res

    @abstractmethod
    def _run(self, values):
        """Start the panel's run (a real engine run or a simulator run) for these widget values."""

    @abstractmethod
    def _describe(self, values, res) -> str:
        """The status line after a successful run."""


class TPRunPanel(_Panel):
    """Real runs of the bundled model at ``tensor_parallel_size`` 1 or 3 (engines reused through
    :func:`tp_engine`), with the step-time split drawn for every size run so far.

    Controls: ``tensor_parallel_size`` (one of ``sizes``), ``num_requests``, ``max_output`` (the
    trace of :func:`tp_trace`, or the first ``num_requests`` of ``records`` with their outputs
    capped at ``max_output``). ``result`` is the latest ``JobResult``.

    Raises:
        ImportError: ipywidgets / anywidget missing (``pip install 'workbench[lab]'``).
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        num_requests: int = 4,
        max_output: int = 8,
        sizes: Sequence[int] = (1, 3),
        records=None,
        **engine_args,
    ):
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        st = {"description_width": "initial"}
        controls = {
            "tensor_parallel_size": w.Dropdown(
                options=list(sizes), value=tensor_parallel_size, description="tensor_parallel_size", style=st
            ),
            "num_requests": w.IntSlider(min=1, max=16, value=num_requests, description="num_requests", style=st),
            "max_output": w.IntSlider(min=1, max=32, value=max_output, description="max_output", style=st),
        }
        self.engine_args = engine_args
        self.records = list(records) if records is not None else None
        self.threads = _threads_per_rank(max(sizes))
        self.latest: dict[int, Any] = {}
        self.figure = go.FigureWidget(time_split_figure([]))
        self._build(controls, self.figure)

    def _run(self, values):
        if self.records is None:
            records = tp_trace(values["num_requests"], values["max_output"])
        else:
            from dataclasses import replace

            cap = values["max_output"]
            records = [
                replace(r, max_tokens=min(r.max_tokens, cap), output_len=min(r.output_len or cap, cap))
                for r in self.records[: values["num_requests"]]
            ]
        tp = values["tensor_parallel_size"]
        res = tp_run(tp, records, threads=self.threads, **self.engine_args)
        self.latest[tp] = res
        rows = time_split_rows(dict(sorted(self.latest.items())))
        with self.figure.batch_update():
            for trace, (key, _) in zip(self.figure.data, _SPLIT):
                trace.x = [f"TP={r['tensor_parallel_size']}" for r in rows]
                trace.y = [r[key] for r in rows]
        return res

    def _describe(self, values, res) -> str:
        st = res.recorder.steps
        comm = sum(s.comm_time_s for s in st)
        model = sum(s.model_time_s for s in st)
        return (
            f"TP={values['tensor_parallel_size']}: {len(st)} steps, {res.summary['output_tokens_total']} tokens, "
            f"{sum(s.allreduce_bytes for s in st) / MiB:,.2f} MiB all-reduced, communication "
            f"{comm / model if model else 0:.0%} of model time"
        )


class TPSimPanel(_Panel):
    """Simulator runs: the learner picks ``gpu``, ``interconnect``, ``tensor_parallel_size`` and the
    trace size; each Run is a new :func:`sim_run_row`, added to a throughput / all-reduce figure.

    Raises:
        ImportError: ipywidgets / anywidget missing.
    """

    def __init__(
        self,
        model: str = "llama-2-70b",
        gpu: str = "A100-80GB",
        interconnect: str = "NVLink",
        tensor_parallel_size: int = 4,
        num_requests: int = 128,
        on_result: Callable[[dict, dict], None] | None = None,
    ):
        from workbench.sim.hardware import HARDWARE
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        st = {"description_width": "initial"}
        gpus = [g for g, h in HARDWARE.items() if h.link_bandwidth > 0]
        controls = {
            "gpu": w.Dropdown(options=gpus, value=gpu, description="gpu", style=st),
            "interconnect": w.Dropdown(
                options=["NVLink", "PCIe"], value=interconnect, description="interconnect", style=st
            ),
            "tensor_parallel_size": w.Dropdown(
                options=[1, 2, 4, 8], value=tensor_parallel_size, description="tensor_parallel_size", style=st
            ),
            "num_requests": w.IntSlider(
                min=8, max=512, step=8, value=num_requests, description="num_requests", style=st
            ),
        }
        self.model = model
        self.on_result = on_result
        self.figure = go.FigureWidget()
        self.figure.add_bar(x=[], y=[], name="output tok/s")
        self.figure.add_scatter(x=[], y=[], name="all-reduce share", yaxis="y2", mode="markers", marker={"size": 12})
        self.figure.update_layout(
            title=f"{model}: simulated runs",
            yaxis={"title": "output tokens/s"},
            yaxis2={"title": "all-reduce share", "overlaying": "y", "side": "right", "tickformat": ".0%"},
            height=360,
        )
        self._build(controls, self.figure)

    def _run(self, values):
        link = values["interconnect"]
        if values["tensor_parallel_size"] == 1:
            link = _own_link(values["gpu"])  # one GPU: no link to choose
        row = sim_run_row(
            self.model, values["gpu"], link, values["tensor_parallel_size"], burst_trace(values["num_requests"])
        )
        label = f"{row['tensor_parallel_size']} x {row['gpu']}, {row['interconnect']} ({values['num_requests']} req)"
        with self.figure.batch_update():
            bar, dots = self.figure.data
            bar.x, bar.y = list(bar.x) + [label], list(bar.y) + [row["output_tok_s"]]
            dots.x, dots.y = list(dots.x) + [label], list(dots.y) + [row["allreduce_share"]]
        if self.on_result is not None:
            self.on_result(values, row)
        return row

    def _describe(self, values, row) -> str:
        return (
            f"{row['tensor_parallel_size']} x {row['gpu']} ({row['interconnect']}): {row['output_tok_s']:,.0f} tok/s, "
            f"TPOT p50 {row['tpot_p50_ms']:.1f} ms, all-reduce {row['allreduce_share']:.1%} of step time, "
            f"{row['num_blocks']:,} KV blocks per GPU"
        )


class BufferPanel(_Panel):
    """NCCL buffer tuning: sliders ``nccl_buffsize`` (MiB), ``nccl_min_nchannels``,
    ``nccl_max_nchannels``, a ``nccl_proto`` and ``tensor_parallel_size`` / ``gpu`` choice. Each
    Run recomputes the budget (buffers, KV blocks with and without them) and starts a simulator
    run on :func:`long_trace`; the result is a :func:`sim_run_row` plus the budget figures.

    Raises:
        ImportError: ipywidgets / anywidget missing.
    """

    def __init__(
        self,
        model: str = "llama-2-70b",
        gpu: str = "A100-80GB",
        tensor_parallel_size: int = 4,
        nccl_buffsize_mib: int = 4,
        nccl_min_nchannels: int = 2,
        nccl_max_nchannels: int = 2,
        nccl_proto: str = "LL,LL128,Simple",
        num_requests: int = 128,
    ):
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        st = {"description_width": "initial"}
        controls = {
            "nccl_buffsize_mib": w.IntSlider(
                min=1, max=128, value=nccl_buffsize_mib, description="nccl_buffsize (MiB)", style=st
            ),
            "nccl_proto": w.Dropdown(
                options=["LL,LL128,Simple", "LL,Simple", "Simple", "LL"],
                value=nccl_proto,
                description="nccl_proto",
                style=st,
            ),
            "nccl_min_nchannels": w.IntSlider(
                min=1, max=64, value=nccl_min_nchannels, description="nccl_min_nchannels", style=st
            ),
            "nccl_max_nchannels": w.IntSlider(
                min=1, max=64, value=nccl_max_nchannels, description="nccl_max_nchannels", style=st
            ),
            "tensor_parallel_size": w.Dropdown(
                options=[2, 4, 8], value=tensor_parallel_size, description="tensor_parallel_size", style=st
            ),
            "gpu": w.Dropdown(
                options=["A100-80GB", "H100-80GB", "H200", "A100-40GB"], value=gpu, description="gpu", style=st
            ),
            "num_requests": w.IntSlider(
                min=16, max=512, step=16, value=num_requests, description="num_requests", style=st
            ),
        }
        self.model = model
        self.figure = go.FigureWidget()
        self.figure.add_bar(x=[], y=[], name="KV blocks per GPU")
        self.figure.add_scatter(x=[], y=[], name="output tok/s", yaxis="y2", mode="markers", marker={"size": 12})
        self.figure.update_layout(
            title=f"{model}: buffers, KV blocks and simulated throughput",
            yaxis={"title": "KV blocks per GPU"},
            yaxis2={"title": "output tokens/s", "overlaying": "y", "side": "right"},
            height=360,
        )
        self._build(controls, self.figure)

    @staticmethod
    def engine_args(values: dict[str, Any]) -> dict[str, Any]:
        """The panel's values as engine arguments (``nccl_buffsize`` in bytes).

        Raises:
            ValueError: ``nccl_buffsize_mib`` is not a whole number of MiB >= 1.
        """
        mib = values["nccl_buffsize_mib"]
        if isinstance(mib, bool) or not isinstance(mib, int) or mib < 1:
            raise ValueError(f"nccl_buffsize_mib={mib!r} must be a whole number of MiB >= 1, e.g. 4 (NCCL's default)")
        return {
            "nccl_buffsize": mib * MiB,
            "nccl_proto": values["nccl_proto"],
            "nccl_min_nchannels": values["nccl_min_nchannels"],
            "nccl_max_nchannels": values["nccl_max_nchannels"],
        }

    def _run(self, values):
        args = self.engine_args(values)
        tp = values["tensor_parallel_size"]
        from workbench.config import EngineConfig

        EngineConfig(**args).validate()  # min > max and the like: named before anything runs
        cost = kv_cost_rows(self.model, values["gpu"], (tp,), {"panel": args})[0]
        row = sim_run_row(self.model, values["gpu"], None, tp, long_trace(values["num_requests"]), **args)
        row |= {k: cost[k] for k in ("blocks_without", "blocks_lost", "max_seqs", "max_seqs_without")}
        label = (
            f"{tp} x {values['gpu']}: {values['nccl_buffsize_mib']} MiB, "
            f"{values['nccl_min_nchannels']}-{values['nccl_max_nchannels']} ch, {values['nccl_proto']}"
        )
        with self.figure.batch_update():
            bar, dots = self.figure.data
            bar.x, bar.y = list(bar.x) + [label], list(bar.y) + [row["num_blocks"]]
            dots.x, dots.y = list(dots.x) + [label], list(dots.y) + [row["output_tok_s"]]
        return row

    def _describe(self, values, row) -> str:
        return (
            f"buffers {row['comm_buffer_bytes'] / MiB:,.1f} MiB per rank -> {row['num_blocks']:,} KV blocks "
            f"({row['blocks_lost']:,} fewer than without buffers; {row['max_seqs']:,} sequences of 4,096 tokens); "
            f"simulated {row['output_tok_s']:,.0f} tok/s, TPOT p50 {row['tpot_p50_ms']:.1f} ms"
        )


def buffer_exercise(
    model: str = "llama-2-70b",
    gpu: str = "H100-80GB",
    tensor_parallel_size: int = 4,
    nccl_buffsize: int = 8 * MiB,
    nchannels: int = 24,
    nccl_proto: str = "LL,LL128,Simple",
    block_size: int = 16,
) -> dict[str, Any]:
    """The context of exercise 10.1: ``config`` (the buffer configuration, ``nchannels`` forced by
    ``nccl_min_nchannels = nccl_max_nchannels``), ``budget`` (kv-calc's budget without buffers:
    ``kv_budget_bytes``, ``block_bytes``, ``num_blocks``) and ``engine_num_blocks`` (the simulated
    engine's pool with those buffers)."""
    from workbench.kvcalc import kv_calc

    m = sim_budget(
        model,
        gpu,
        tensor_parallel_size,
        block_size=block_size,
        nccl_buffsize=nccl_buffsize,
        nccl_min_nchannels=nchannels,
        nccl_max_nchannels=nchannels,
        nccl_proto=nccl_proto,
    )
    r = kv_calc(
        model,
        gpu=gpu,
        tensor_parallel_size=tensor_parallel_size,
        block_size=block_size,
        activation_reserve=m.activation_bytes,
    )
    return {
        "config": {
            "model": model,
            "gpu": gpu,
            "tensor_parallel_size": tensor_parallel_size,
            "nccl_buffsize": nccl_buffsize,
            "nchannels": nchannels,
            "nccl_proto": nccl_proto,
            "block_size": block_size,
        },
        "budget": {"kv_budget_bytes": r.kv_budget_bytes, "block_bytes": r.block_bytes, "num_blocks": r.num_blocks},
        "engine_num_blocks": m.num_blocks,
    }
