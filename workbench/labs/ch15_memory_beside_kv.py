"""Chapter 15 of the labs: memory beside the KV cache on every rank.

What a tensor-parallel rank holds besides its shard of the weights and its KV pool, what can be
shrunk or shared, and what each byte buys back in KV blocks and concurrent sequences.

*Measured on this CPU* (a real TP=3 engine on the bundled model, over gloo; chapter 9's
:func:`~workbench.labs.multigpu_common.tp_engine`): one rank's budget as the engine planned it
(:func:`rank_budget_rows`), the activation workspace profiled on every rank at several
``max_num_batched_tokens`` with the blocks each frees (:func:`workspace_rows`), every step's
all-reduce message against a custom all-reduce's ``max_size`` (:func:`message_rows`), and the
processes' resident memory (:func:`process_memory_rows`; it varies from run to run).

*Modelled for 4-8 GPUs* (the simulated engine's budget, :func:`workbench.labs.ch10_nccl_buffers.sim_budget`,
the same arithmetic as ``workbench kv-calc``): a per-rank breakdown (:func:`gpu_rank_rows`) —
weights, activation workspace, NCCL buffers (:func:`workbench.comm.nccl_buffer_bytes`), the custom
all-reduce's IPC buffers (:func:`workbench.comm.custom_all_reduce_bytes`), a CUDA graph pool
(:func:`cuda_graph_pool_bytes`), the KV pool, and the ``1 - gpu_memory_utilization`` headroom that
must hold what the budget does not count (the graph pool where it is captured after the KV cache,
the caching allocator's slack); what turning each down buys back (:func:`buyback_rows`); the
simulator's throughput where the pool limits the batch (:func:`sim_buyback_grid`); a slider panel
(:class:`RankMemoryPanel`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.labs.exercise_registry import _number, _register
from workbench.labs.multigpu_common import (
    MiB,
    _Panel,
    close_engines,
    long_trace,
    model_dims,
    sim_budget,
    sim_run_row,
    tp_engine,
    tp_run,
    tp_trace,
)
from workbench.viz.common import BUDGET_COLOURS
from workbench.viz.table import Column, Table

__all__ = [
    "CHOICES",
    "GRAPH_CAPTURE_SIZE",
    "RankMemoryPanel",
    "buyback_rows",
    "buyback_table",
    "close_engines",
    "cuda_graph_pool_bytes",
    "custom_ar_exercise",
    "gpu_rank_figure",
    "gpu_rank_rows",
    "gpu_rank_table",
    "message_rows",
    "message_table",
    "model_dims",
    "process_memory_rows",
    "process_memory_table",
    "rank_budget_rows",
    "rank_budget_table",
    "rank_choices",
    "sim_buyback_grid",
    "sim_buyback_table",
    "tp_engine",
    "tp_run",
    "tp_trace",
    "workspace_rows",
    "workspace_table",
]

GiB = 1 << 30

#: the largest batch vLLM v1 captures a CUDA graph for by default (``cudagraph_capture_sizes`` end at
#: 512 tokens; ``max_cudagraph_capture_size`` sets it in later releases)
GRAPH_CAPTURE_SIZE = 512

#: colours of the parts: chapter 1's budget colours, and one each for the parts this chapter adds
COLOURS = BUDGET_COLOURS | {
    "custom all-reduce": "#ff9da6",
    "CUDA graph pool": "#9d755d",
    "allocator slack": "#72b7b2",
}


# ====================================================================== measured on this CPU
def _engine(llm):
    return llm.llm_engine


def rank_budget_rows(llm) -> list[dict[str, Any]]:
    """One rank's budget as the real engine planned it (``MemoryBudget``; every rank has the same plan:
    rank 0 plans with the largest activation peak over the ranks): ``{"part", "bytes", "how"}`` rows —
    capacity, weights (this rank's shard), the profiled activation peak, the communication buffers
    (gloo has none: NCCL's, modelled), a custom all-reduce's buffers (would vLLM have one here?),
    the KV pool, what is left and the headroom."""
    from workbench.comm import custom_all_reduce_bytes

    eng = _engine(llm)
    m = eng.memory
    tp = eng.config.tensor_parallel_size
    car = custom_all_reduce_bytes(tp)
    usable = int(m.capacity_bytes * m.gpu_memory_utilization)
    return [
        {"part": "capacity (device_memory)", "bytes": m.capacity_bytes, "how": "declared for the CPU"},
        {"part": "weights", "bytes": m.weights_bytes, "how": f"this rank's shard (1/{tp}, norms replicated)"},
        {
            "part": "activations (profiled peak)",
            "bytes": m.activation_bytes,
            "how": f"one forward of {eng.max_num_batched_tokens:,} tokens, largest over the {tp} ranks",
        },
        {"part": "communication buffers", "bytes": m.comm_buffer_bytes, "how": "NCCL's, modelled (gloo keeps none)"},
        {"part": "custom all-reduce", "bytes": car.per_rank_bytes, "how": f"none: {car.reason}"},
        {"part": "KV pool (whole blocks)", "bytes": m.kv_pool_bytes, "how": f"{m.num_blocks:,} blocks"},
        {
            "part": "left: part of a block",
            "bytes": usable - m.weights_bytes - m.activation_bytes - m.comm_buffer_bytes - m.kv_pool_bytes,
            "how": "less than one block",
        },
        {
            "part": "held back: 1 - gpu_memory_utilization",
            "bytes": m.capacity_bytes - usable,
            "how": f"gpu_memory_utilization = {m.gpu_memory_utilization}",
        },
    ]


def rank_budget_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`rank_budget_rows` as a table (bytes and MiB)."""
    return Table(
        [
            Column("part", "per rank", str, align="left"),
            Column("bytes", "bytes", "{:,}".format),
            Column("mib", "MiB", "{:,.1f}".format),
            Column("how", "where the figure comes from", str, align="left"),
        ],
        [dict(r) | {"mib": r["bytes"] / MiB} for r in rows],
    )


def workspace_rows(llm, token_budgets: Sequence[int] = (256, 512, 1024, 2048)) -> list[dict[str, Any]]:
    """The activation workspace profiled for real on every rank at each ``max_num_batched_tokens``
    (one dummy forward per budget on all ranks, the largest peak — the engine's own profile run,
    :func:`workbench.memory.engine_budget`), and the KV pool the same budget then leaves.

    Rows ``{"max_num_batched_tokens", "engine", "activation_bytes", "num_blocks", "blocks_change",
    "kv_pool_tokens", "max_seqs"}``; ``engine`` marks the engine's own setting, profiled again here like
    the others (a warm engine's profile can differ from its startup one, ``MemoryBudget.activation_bytes``,
    by tensors the first forward created once and kept); ``blocks_change`` is against that row;
    ``max_seqs`` whole sequences of ``max_model_len`` tokens.

    Raises:
        ValueError: a budget below ``max_num_seqs`` or above what the engine can profile (the engine's message).
    """
    from workbench.memory import engine_budget

    eng = _engine(llm)
    ex, m = eng.executor, eng.memory
    out = []
    for n in sorted(set(token_budgets) | {eng.max_num_batched_tokens}):
        b = engine_budget(
            eng.config,
            ex.hf_config,
            m.weights_bytes,
            m.comm_buffer_bytes,
            eng.max_model_len,
            n,
            ex.profile_activation_peak,
        )
        out.append(
            {
                "max_num_batched_tokens": n,
                "engine": n == eng.max_num_batched_tokens,
                "activation_bytes": b.activation_bytes,
                "num_blocks": b.num_blocks,
                "kv_pool_tokens": b.kv_pool_tokens,
                "max_seqs": b.kv_pool_tokens // eng.max_model_len,
            }
        )
    own = next(r for r in out if r["engine"])
    return [r | {"blocks_change": r["num_blocks"] - own["num_blocks"]} for r in out]


def workspace_table(rows: Sequence[dict[str, Any]], max_model_len: int = 256) -> Table:
    """:func:`workspace_rows` as a table (the engine's own setting marked)."""
    return Table(
        [
            Column("label", "max_num_batched_tokens", str),
            Column("activation_bytes", "activations per rank (MiB)", lambda v: f"{v / MiB:,.2f}"),
            Column("num_blocks", "KV (blocks)", "{:,}".format),
            Column("blocks_change", "vs the engine's (blocks)", "{:+,}".format),
            Column("max_seqs", f"sequences of {max_model_len} tokens", "{:,}".format),
        ],
        [dict(r) | {"label": f"{r['max_num_batched_tokens']:,}" + (" (engine)" if r["engine"] else "")} for r in rows],
    )


def message_rows(run, dims: dict[str, int], max_size: int | None = None) -> list[dict[str, Any]]:
    """Every step's all-reduce message of a real TP run, against a custom all-reduce's ``max_size``.

    The engine counts the bytes all-reduced per step (``StepStats.allreduce_bytes``); a step issues
    ``1 + 2L`` all-reduces of the same ``[tokens, hidden]`` tensor (chapter 9), so one message is that
    total over ``1 + 2L``. A custom all-reduce takes a message below ``max_size`` bytes; NCCL the rest.

    Rows ``{"step", "tokens", "allreduce_bytes", "message_bytes", "custom_ar"}``.
    """
    from workbench.comm import CUSTOM_AR_MAX_SIZE

    limit = CUSTOM_AR_MAX_SIZE if max_size is None else max_size
    per_step = 1 + 2 * dims["num_hidden_layers"]
    rows = []
    for s in run.recorder.steps:
        if not s.allreduce_bytes:
            continue
        msg = s.allreduce_bytes // per_step
        rows.append(
            {
                "step": s.step,
                "tokens": s.num_prefill_tokens + s.num_decode_tokens,
                "allreduce_bytes": s.allreduce_bytes,
                "message_bytes": msg,
                "custom_ar": msg < limit,
            }
        )
    return rows


def message_table(rows: Sequence[dict[str, Any]], dims: dict[str, int]) -> Table:
    """:func:`message_rows` as a table: tokens, the step's bytes, one message and who would carry it."""
    per_token = dims["hidden_size"] * dims["dtype_bytes"]
    return Table(
        [
            Column("step", "step"),
            Column("tokens", "tokens"),
            Column("allreduce_bytes", "all-reduced in the step (B)", "{:,}".format),
            Column("message_bytes", f"one message = tokens x {per_token:,} B", "{:,}".format),
            Column("custom_ar", "custom all-reduce takes it", lambda v: "yes" if v else "no: NCCL"),
        ],
        rows,
    )


def _rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_memory_rows(llm) -> list[dict[str, Any]]:
    """Resident memory (``VmRSS``, Linux) of each rank's process, beside the weights and KV pool its
    budget gives it. It varies from run to run and holds what no budget line does: the interpreter,
    PyTorch's libraries, gloo's sockets and buffers — the CPU's counterpart of the CUDA context. The
    KV pool is allocated zeroed, so pages of it no step has written are not resident yet.

    Rows ``{"rank", "pid", "rss_bytes", "weights_bytes", "kv_pool_bytes"}`` (``rss_bytes`` ``None``
    where ``/proc`` is absent)."""
    eng = _engine(llm)
    m = eng.memory
    pids = [os.getpid()] + list(getattr(eng.executor, "worker_pids", []))
    return [
        {
            "rank": r,
            "pid": pid,
            "rss_bytes": _rss_bytes(pid),
            "weights_bytes": m.weights_bytes,
            "kv_pool_bytes": m.kv_pool_bytes,
        }
        for r, pid in enumerate(pids)
    ]


def process_memory_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`process_memory_rows` in MiB (resident, the budget's weights and KV pool)."""

    def mib(v):
        return "n/a" if v is None else f"{v / MiB:,.0f}"

    return Table(
        [
            Column("rank", "rank"),
            Column("rss_bytes", "resident (MiB)", mib),
            Column("weights_bytes", "weights (MiB)", mib),
            Column("kv_pool_bytes", "KV pool, allocated (MiB)", mib),
        ],
        rows,
    )


# ====================================================================== modelled for 4-8 GPUs
def cuda_graph_pool_bytes(
    model: str = "llama-2-70b", capture_size: int = GRAPH_CAPTURE_SIZE, dtype: str = "float16"
) -> int:
    """A lower bound of a CUDA graph pool: the activations of a forward of the largest captured batch.

    vLLM captures one graph per size in ``cudagraph_capture_sizes`` (largest first, all in one memory
    pool), so the pool holds at least the intermediate tensors of the largest: the estimate is
    :func:`workbench.memory.activation_peak_bytes` at ``capture_size`` tokens without logits (the LM
    head runs outside the graph). Each graph's own state adds to it; vLLM logs the real figure
    ("Graph capturing finished in N secs, took X GiB"). ``0`` at ``capture_size=0`` (``enforce_eager``).

    Raises:
        ValueError: a model not in the catalogue or a negative size.
    """
    import torch

    from workbench.catalog import MODELS
    from workbench.memory import activation_peak_bytes

    if model not in MODELS:
        raise ValueError(f"model={model!r} is not in the catalogue; use one of {', '.join(MODELS)}")
    if capture_size < 0:
        raise ValueError(f"capture_size={capture_size} must be >= 0 tokens (0 = enforce_eager: no graphs)")
    return activation_peak_bytes(MODELS[model], capture_size, 0, getattr(torch, dtype))


#: the choices this chapter turns, each a dict of the model's inputs (:func:`rank_choices`)
CHOICES: dict[str, dict[str, Any]] = {
    "vLLM-like defaults": {},
    "disable_custom_all_reduce": {"custom_all_reduce": False},
    "NCCL 1 MiB, Simple only": {"nccl_buffsize": 1 * MiB, "nccl_proto": "Simple"},
    "max_num_batched_tokens 1,024": {"max_num_batched_tokens": 1024},
    "enforce_eager (no graphs)": {"capture_size": 0},
    "buffers and graphs off": {
        "custom_all_reduce": False,
        "nccl_buffsize": 1 * MiB,
        "nccl_proto": "Simple",
        "capture_size": 0,
    },
    "gpu_memory_utilization 0.95": {"gpu_memory_utilization": 0.95},
}


def rank_choices(**overrides: Any) -> dict[str, Any]:
    """The model's inputs with the defaults of a vLLM-like deployment: custom all-reduce on (where vLLM
    enables it), NCCL's default buffers, ``max_num_batched_tokens`` 2,048, CUDA graphs up to
    :data:`GRAPH_CAPTURE_SIZE` with the pool charged to the budget (``graphs_in_budget``; vLLM's
    ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``), no allocator slack assumed, ``gpu_memory_utilization``
    0.9, ``block_size`` 16, ``max_num_seqs`` 256, ``max_model_len`` 4,096.

    Raises:
        ValueError: an unknown name (names the known ones).
    """
    base = {
        "custom_all_reduce": True,
        "nccl_buffsize": None,
        "nccl_proto": None,
        "max_num_batched_tokens": 2048,
        "capture_size": GRAPH_CAPTURE_SIZE,
        "graphs_in_budget": True,
        "slack_bytes": 0,
        "gpu_memory_utilization": 0.9,
        "block_size": 16,
    }
    bad = set(overrides) - set(base)
    if bad:
        raise ValueError(f"unknown choice(s) {sorted(bad)}; use {', '.join(base)}")
    return base | overrides


def _budget(model: str, gpu: str, tp: int, c: dict[str, Any]):
    """The simulated engine's budget for the choices ``c`` (:func:`rank_choices`) and the graph pool."""
    import torch

    from workbench.catalog import MODELS
    from workbench.memory import activation_peak_bytes

    pool = cuda_graph_pool_bytes(model, c["capture_size"])
    act = activation_peak_bytes(MODELS[model], c["max_num_batched_tokens"], 256, torch.float16)
    engine = {
        "block_size": c["block_size"],
        "gpu_memory_utilization": c["gpu_memory_utilization"],
        "max_num_batched_tokens": c["max_num_batched_tokens"],
    }
    engine |= {k: c[k] for k in ("nccl_buffsize", "nccl_proto") if c[k] is not None}
    spec = {
        "custom_all_reduce": c["custom_all_reduce"],
        "activation_bytes": act + (pool if c["graphs_in_budget"] else 0),
    }
    return sim_budget(model, gpu, tp, spec=spec, **engine), act, pool, spec, engine


def gpu_rank_rows(
    model: str = "llama-2-70b",
    gpu: str = "H100-80GB",
    tensor_parallel_size: int = 8,
    seq_len: int = 4096,
    **choices: Any,
) -> dict[str, Any]:
    """One rank's memory, modelled: ``{"parts": [(part, bytes)], ...figures}``.

    ``parts`` fill the device in order: weights, activation workspace, NCCL buffers, custom all-reduce,
    the CUDA graph pool where the budget counts it, the KV pool (whole blocks), the budget's part-block,
    then the headroom ``(1 - gpu_memory_utilization) x capacity``: the graph pool where it is captured
    after the KV cache, the allocator slack (an input: ``slack_bytes``), and what is free. Figures:
    ``num_blocks``, ``block_bytes``, ``max_seqs`` (whole ``seq_len`` sequences), ``headroom_bytes``,
    ``headroom_free`` (negative: the headroom does not hold its parts — out of memory at run time).

    Raises:
        ValueError: bad choices (:func:`rank_choices`), a budget with no room for KV (the engine's message).
    """
    from workbench.comm import custom_all_reduce_bytes
    from workbench.sim.hardware import find_hardware

    c = rank_choices(**choices)
    m, act, pool, _, _ = _budget(model, gpu, tensor_parallel_size, c)
    hw = find_hardware(gpu)
    car = custom_all_reduce_bytes(
        tensor_parallel_size, fully_connected=hw.interconnect == "NVLink", disabled=not c["custom_all_reduce"]
    ).per_rank_bytes
    nccl = m.comm_buffer_bytes - car
    usable = int(m.capacity_bytes * m.gpu_memory_utilization)
    headroom = m.capacity_bytes - usable
    in_budget = pool if c["graphs_in_budget"] else 0
    parts = [
        ("weights", m.weights_bytes),
        ("activations (workspace)", act),
        ("communication buffers (NCCL)", nccl),
        ("custom all-reduce", car),
        ("CUDA graph pool (in the budget)", in_budget),
        ("KV pool (whole blocks)", m.kv_pool_bytes),
        (
            "left: part of a block",
            usable - m.weights_bytes - m.activation_bytes - m.comm_buffer_bytes - m.kv_pool_bytes,
        ),
    ]
    after = pool - in_budget
    free = headroom - after - c["slack_bytes"]
    parts += [
        ("CUDA graph pool (in the headroom)", after),
        ("allocator slack (headroom)", c["slack_bytes"]),
        ("held back: free headroom", max(free, 0)),
    ]
    per_seq = -(-seq_len // m.block_size)
    return {
        "model": model,
        "gpu": gpu,
        "tensor_parallel_size": tensor_parallel_size,
        "seq_len": seq_len,
        "choices": c,
        "parts": parts,
        "capacity_bytes": m.capacity_bytes,
        "num_blocks": m.num_blocks,
        "block_bytes": m.block_bytes,
        "max_seqs": m.num_blocks // per_seq,
        "headroom_bytes": headroom,
        "headroom_free": free,
        "memory": m,
    }


def _colour(part: str) -> str:
    """A part's colour: chapter 1's for the budget's parts, this chapter's for the ones it adds."""
    for name, colour in COLOURS.items():
        if part.startswith(name):
            return colour
    raise KeyError(f"no colour for {part!r}; known parts: {', '.join(COLOURS)}")


def gpu_rank_table(setups: Sequence[dict[str, Any]]) -> Table:
    """:func:`gpu_rank_rows` of several setups side by side: one line per part (MiB), one column per setup,
    then the KV blocks, the sequences and the headroom left."""
    names = [f"{s['tensor_parallel_size']} x {s['gpu']}" for s in setups]
    rows = []
    for i, (part, _) in enumerate(setups[0]["parts"]):
        rows.append({"part": part} | {n: f"{s['parts'][i][1] / MiB:,.1f}" for n, s in zip(names, setups)})
    rows.append({"part": "KV pool (blocks)"} | {n: f"{s['num_blocks']:,}" for n, s in zip(names, setups)})
    seq = setups[0].get("seq_len", 4096)
    rows.append({"part": f"sequences of {seq:,} tokens"} | {n: f"{s['max_seqs']:,}" for n, s in zip(names, setups)})
    return Table(
        [Column("part", "per rank (MiB)", str, align="left")] + [Column(n, n, str) for n in names],
        rows,
    )


def gpu_rank_figure(setups: Sequence[dict[str, Any]], title: str | None = None) -> go.Figure:
    """One horizontal stacked bar per setup (:func:`gpu_rank_rows`), GiB; the KV pool is most of each bar,
    so the figure also gives each part's share in its hover."""
    fig = go.Figure()
    names = [f"{s['tensor_parallel_size']} x {s['gpu']}" for s in setups]
    for i, (part, _) in enumerate(setups[0]["parts"]):
        xs = [s["parts"][i][1] / GiB for s in setups]
        if not any(xs):
            continue
        fig.add_bar(
            y=names,
            x=xs,
            name=part,
            orientation="h",
            marker_color=_colour(part),
            customdata=[[s["parts"][i][1] / MiB, s["parts"][i][1] / s["capacity_bytes"]] for s in setups],
            hovertemplate=f"{part}: %{{customdata[0]:,.0f}} MiB (%{{customdata[1]:.2%}} of the GPU)<extra></extra>",
        )
    fig.update_layout(
        barmode="stack",
        title={"text": title or f"{setups[0]['model']}: one rank's memory (modelled)"},
        xaxis={"title": "memory per GPU (GiB)", "rangemode": "tozero"},
        yaxis={"autorange": "reversed"},
        height=300 + 40 * len(setups),
        legend={"traceorder": "normal", "orientation": "h", "y": -0.3, "yanchor": "top"},
        margin={"t": 60, "b": 140, "l": 110},
    )
    return fig


def buyback_rows(
    model: str = "llama-2-70b",
    gpu: str = "H100-80GB",
    sizes: Sequence[int] = (4, 8),
    choices: dict[str, dict[str, Any]] | None = None,
    seq_len: int = 4096,
) -> list[dict[str, Any]]:
    """What each choice buys back, per rank: the KV blocks and whole ``seq_len`` sequences of the simulated
    engine's budget (:func:`gpu_rank_rows`) against the first choice's; ``freed_bytes`` is the
    memory the budget no longer subtracts (the first choice's budgeted parts minus this one's)."""
    choices = choices or CHOICES
    rows = []
    for tp in sizes:
        base = None
        for name, ch in choices.items():
            r = gpu_rank_rows(model, gpu, tp, seq_len, **ch)
            m = r["memory"]
            counted = m.weights_bytes + m.activation_bytes + m.comm_buffer_bytes
            base = base or (r, counted)
            rows.append(
                {
                    "choice": name,
                    "gpus": f"{tp} x {gpu}",
                    "tensor_parallel_size": tp,
                    "freed_bytes": base[1] - counted,
                    "block_bytes": r["block_bytes"],
                    "num_blocks": r["num_blocks"],
                    "blocks_bought": r["num_blocks"] - base[0]["num_blocks"],
                    "max_seqs": r["max_seqs"],
                    "seqs_bought": r["max_seqs"] - base[0]["max_seqs"],
                }
            )
    return rows


def buyback_table(rows: Sequence[dict[str, Any]], seq_len: int = 4096) -> Table:
    """:func:`buyback_rows` as a table."""
    return Table(
        [
            Column("gpus", "GPUs", str, align="left"),
            Column("choice", "choice", str, align="left"),
            Column("freed_bytes", "freed per rank (MiB)", lambda v: f"{v / MiB:,.1f}"),
            Column("num_blocks", "KV (blocks)", "{:,}".format),
            Column("blocks_bought", "bought back (blocks)", "{:+,}".format),
            Column("max_seqs", f"sequences of {seq_len:,}", "{:,}".format),
            Column("seqs_bought", "bought back (sequences)", "{:+,}".format),
        ],
        rows,
    )


def sim_buyback_grid(
    model: str = "llama-2-70b",
    setups: Sequence[tuple[str, int]] = (("A100-80GB", 4), ("H100-80GB", 8)),
    choices: dict[str, dict[str, Any]] | None = None,
    num_requests: int = 256,
) -> list[dict[str, Any]]:
    """:func:`~workbench.labs.multigpu_common.sim_run_row` on chapter 10's long-request trace for each setup
    and choice, the pool sized by the same budget (:func:`gpu_rank_rows`). The cost model does not price
    the custom all-reduce's or the CUDA graphs' speed (it charges every all-reduce the ring's hops and
    no kernel-launch overhead), so every difference comes from the KV pool."""
    choices = choices or {
        k: CHOICES[k] for k in ("vLLM-like defaults", "buffers and graphs off", "max_num_batched_tokens 1,024")
    }
    trace = long_trace(num_requests)
    rows = []
    for gpu, tp in setups:
        for name, ch in choices.items():
            _, _, _, spec, engine = _budget(model, gpu, tp, rank_choices(**ch))
            rows.append({"choice": name} | sim_run_row(model, gpu, None, tp, trace, spec=spec, **engine))
    return rows


def sim_buyback_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`sim_buyback_grid` rows as a table: KV blocks, peak batch, throughput and TPOT, each setup's
    later choices as a ratio to its first."""
    first = {}
    out = []
    for r in rows:
        key = (r["gpu"], r["tensor_parallel_size"])
        base = first.setdefault(key, r)
        out.append(
            dict(r)
            | {
                "gpus": f"{r['tensor_parallel_size']} x {r['gpu']}",
                "throughput_ratio": r["output_tok_s"] / base["output_tok_s"],
                "tpot_ratio": r["tpot_p50_ms"] / base["tpot_p50_ms"],
            }
        )
    return Table(
        [
            Column("gpus", "GPUs", str, align="left"),
            Column("choice", "choice", str, align="left"),
            Column("num_blocks", "KV (blocks)", "{:,}".format),
            Column("peak_running", "peak batch", str),
            Column("output_tok_s", "output (tok/s)", "{:,.0f}".format),
            Column("throughput_ratio", "throughput (x first)", "{:.3f}x".format),
            Column("tpot_ratio", "TPOT p50 (x first)", "{:.3f}x".format),
        ],
        out,
        title="Simulated: the same requests, the pool each choice leaves",
    )


def custom_ar_exercise(
    model: str = "llama-2-70b", gpu: str = "H100-80GB", tensor_parallel_size: int = 8, block_size: int = 16
) -> dict[str, Any]:
    """The context of exercise 15.1: ``config``; ``budget`` (the simulated engine's budget *with* the
    custom all-reduce: ``kv_budget_bytes``, ``block_bytes``, ``num_blocks``); ``engine_num_blocks``
    (its pool with ``disable_custom_all_reduce=True``)."""
    on = gpu_rank_rows(model, gpu, tensor_parallel_size, block_size=block_size)["memory"]
    off = gpu_rank_rows(model, gpu, tensor_parallel_size, block_size=block_size, custom_all_reduce=False)["memory"]
    return {
        "config": {"model": model, "gpu": gpu, "tensor_parallel_size": tensor_parallel_size, "block_size": block_size},
        "budget": {"kv_budget_bytes": on.kv_budget_bytes, "block_bytes": on.block_bytes, "num_blocks": on.num_blocks},
        "engine_num_blocks": off.num_blocks,
    }


# ====================================================================== panel
class RankMemoryPanel(_Panel):
    """One rank's memory, modelled: toggles and sliders named like the engine arguments —
    ``disable_custom_all_reduce``, ``enforce_eager``, ``nccl_buffsize`` (MiB), ``max_num_batched_tokens``,
    ``gpu_memory_utilization`` — and the model's own inputs (``graphs_in_budget``, ``allocator_slack``
    in MiB), the GPUs and the group size. Each Run recomputes the rank's breakdown
    (:func:`gpu_rank_rows`), the blocks and sequences against the vLLM-like defaults, and whether the
    headroom still holds what it must.

    Raises:
        ImportError: ipywidgets / anywidget missing.
    """

    def __init__(self, model: str = "llama-2-70b", gpu: str = "H100-80GB", tensor_parallel_size: int = 8):
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        st = {"description_width": "initial"}
        controls = {
            "disable_custom_all_reduce": w.Checkbox(value=False, description="disable_custom_all_reduce", style=st),
            "enforce_eager": w.Checkbox(value=False, description="enforce_eager (no CUDA graphs)", style=st),
            "graphs_in_budget": w.Checkbox(value=True, description="graph pool counted in the budget", style=st),
            "nccl_buffsize_mib": w.IntSlider(min=1, max=64, value=4, description="nccl_buffsize (MiB)", style=st),
            "max_num_batched_tokens": w.Dropdown(
                options=[512, 1024, 2048, 4096, 8192], value=2048, description="max_num_batched_tokens", style=st
            ),
            "allocator_slack_mib": w.IntSlider(
                min=0, max=8192, step=256, value=0, description="allocator slack (MiB)", style=st
            ),
            "gpu_memory_utilization": w.FloatSlider(
                min=0.80, max=0.98, step=0.01, value=0.90, description="gpu_memory_utilization", style=st
            ),
            "gpu": w.Dropdown(options=["A100-80GB", "H100-80GB", "H200"], value=gpu, description="gpu", style=st),
            "tensor_parallel_size": w.Dropdown(
                options=[4, 8], value=tensor_parallel_size, description="tensor_parallel_size", style=st
            ),
        }
        self.model = model
        self.figure = go.FigureWidget()
        self.figure.update_layout(
            barmode="stack",
            title=f"{model}: one rank's memory per run (modelled)",
            xaxis={"title": "memory per GPU (GiB)", "rangemode": "tozero"},
            yaxis={"autorange": "reversed"},
            height=480,
            legend={"traceorder": "normal", "orientation": "h", "y": -0.3, "yanchor": "top"},  # as gpu_rank_figure
            margin={"t": 60, "b": 160, "l": 130},
        )
        self._build(controls, self.figure)

    @staticmethod
    def choices(values: dict[str, Any]) -> dict[str, Any]:
        """The panel's values as the model's inputs (:func:`rank_choices`).

        Raises:
            ValueError: a buffer size or slack that is not a whole number of MiB >= 1 (>= 0 for the slack).
        """
        for key, lo in (("nccl_buffsize_mib", 1), ("allocator_slack_mib", 0)):
            v = values[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{key}={v!r} must be a whole number of MiB >= {lo}")
        return rank_choices(
            custom_all_reduce=not values["disable_custom_all_reduce"],
            capture_size=0 if values["enforce_eager"] else GRAPH_CAPTURE_SIZE,
            graphs_in_budget=values["graphs_in_budget"],
            nccl_buffsize=values["nccl_buffsize_mib"] * MiB,
            max_num_batched_tokens=values["max_num_batched_tokens"],
            slack_bytes=values["allocator_slack_mib"] * MiB,
            gpu_memory_utilization=round(float(values["gpu_memory_utilization"]), 2),
        )

    def _run(self, values):
        c = self.choices(values)
        tp, gpu = values["tensor_parallel_size"], values["gpu"]
        r = gpu_rank_rows(self.model, gpu, tp, **c)
        base = gpu_rank_rows(self.model, gpu, tp)
        r["blocks_bought"] = r["num_blocks"] - base["num_blocks"]
        r["seqs_bought"] = r["max_seqs"] - base["max_seqs"]
        label = f"run {len(self.history) + 1}: {tp} x {gpu}"
        with self.figure.batch_update():
            known = {t.name: t for t in self.figure.data}
            for part, b in r["parts"]:
                t = known.get(part)
                if t is None:
                    self.figure.add_bar(
                        y=[],
                        x=[],
                        name=part,
                        orientation="h",
                        marker_color=_colour(part),
                        hovertemplate=f"{part}: %{{x:,.2f}} GiB<extra></extra>",
                    )
                    t = self.figure.data[-1]
                t.y, t.x = list(t.y) + [label], list(t.x) + [b / GiB]
        return r

    def _describe(self, values, r) -> str:
        free = r["headroom_free"]
        room = (
            f"headroom {r['headroom_bytes'] / MiB:,.0f} MiB, {free / MiB:,.0f} MiB of it free"
            if free >= 0
            else f"the headroom ({r['headroom_bytes'] / MiB:,.0f} MiB) is {-free / MiB:,.0f} MiB short: "
            "out of memory at run time; lower gpu_memory_utilization"
        )
        return (
            f"{r['tensor_parallel_size']} x {r['gpu']}: {r['num_blocks']:,} KV blocks per GPU "
            f"({r['blocks_bought']:+,} vs the vLLM-like defaults), {r['max_seqs']:,} sequences of 4,096 tokens "
            f"({r['seqs_bought']:+,}); {room}"
        )


# ---------------------------------------------------------------- exercises
def _custom_ar(config: dict):
    from workbench.comm import custom_all_reduce_bytes
    from workbench.sim.hardware import find_hardware

    nvlink = find_hardware(config["gpu"]).interconnect == "NVLink"
    return custom_all_reduce_bytes(config["tensor_parallel_size"], fully_connected=nvlink)


@_register(
    "15.1",
    "How many KV blocks per GPU does disable_custom_all_reduce=True buy back for this deployment? "
    "(an integer; checked against the simulated engine's budget with the custom all-reduce off)",
    "a rank's custom all-reduce holds a metadata buffer (meta_size() + max_size), an input buffer (max_size) "
    "and 8 MiB of rank_data (workbench.comm.custom_all_reduce_bytes); add them back to the budget and count "
    "whole blocks before and after.",
)
class _CustomArBlocks:
    @staticmethod
    def solution(config: dict, budget: dict, engine_num_blocks: int) -> int:
        freed = _custom_ar(config).per_rank_bytes
        return (budget["kv_budget_bytes"] + freed) // budget["block_bytes"] - budget["num_blocks"]

    @staticmethod
    def judge(answer, config: dict, budget: dict, engine_num_blocks: int) -> tuple[bool, str]:
        want = engine_num_blocks - budget["num_blocks"]
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of blocks, got {answer!r}"
        est = _custom_ar(config)
        if x == want:
            return True, (
                f"{want:,} blocks per GPU: the custom all-reduce holds {est.per_rank_bytes:,} B per rank; the pool "
                f"goes from {budget['num_blocks']:,} to {engine_num_blocks:,} blocks"
            )
        if x in (est.per_rank_bytes, est.per_rank_bytes / 2**20):
            return False, "that is the buffers' size; convert it into the whole blocks it gives back"
        if x == want * config["tensor_parallel_size"]:
            return False, "that is the whole group's; the question asks per GPU"
        two = (budget["kv_budget_bytes"] + est.meta_bytes + est.buffer_bytes) // budget["block_bytes"]
        if x == two - budget["num_blocks"] and x != want:
            return False, "count rank_data (8 MiB of peer-pointer tables) too, not only the two IPC buffers"
        if x == est.per_rank_bytes // budget["block_bytes"] and x != want:
            return False, (
                "buffers // block_bytes ignores the part-block the budget already had left over: "
                "compare the two budgets' whole blocks"
            )
        side = "too many" if x > want else "too few"
        return False, (
            f"{answer!r} is {side}: the custom all-reduce takes {est.per_rank_bytes / 2**20:,.1f} MiB per GPU and a "
            f"block is {budget['block_bytes']:,} B; count the budget's whole blocks with and without it"
        )
