"""Chapter 10 of the labs: NCCL buffer tuning.

The chapter uses the NCCL buffer model (:func:`workbench.comm.nccl_buffer_bytes`) and the
simulated engine's memory budget (the same arithmetic as ``workbench kv-calc``) to show what
``NCCL_BUFFSIZE``, the channel counts and the protocols cost in KV blocks and concurrency, and
what that does to the simulator's throughput and latency (:func:`sim_run_row`, shared with
chapter 9 in :mod:`workbench.labs.multigpu_common`). Where a GPU is present,
:func:`measured_buffer_lines` sets the model beside what a real engine measures.

The panel (:class:`BufferPanel`) is made of ipywidgets named like the engine arguments; its
``run()`` is the Run button's code path, without a click.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.labs.exercise_registry import _number, _register
from workbench.labs.multigpu_common import (
    MiB,
    _Panel,
    long_trace,
    sim_budget,
    sim_hardware,
    sim_run_row,
    sim_table,
)
from workbench.viz.common import LEGEND_ABOVE, LEGEND_ABOVE_MARGIN
from workbench.viz.table import Column, Table

__all__ = [
    "BUFFER_CONFIGS",
    "BufferPanel",
    "buffer_estimate",
    "buffer_exercise",
    "buffer_figure",
    "buffer_findings",
    "buffer_rows",
    "buffer_table",
    "kv_cost_rows",
    "kv_cost_table",
    "long_trace",
    "measured_buffer_lines",
    "sim_budget",
    "sim_buffer_figure",
    "sim_buffer_grid",
    "sim_hardware",
    "sim_run_row",
    "sim_table",
]


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


def _mib2(v: float) -> str:
    return f"{v / MiB:,.2f}"


def buffer_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`buffer_rows` as a table: channels, protocols and the buffer MiB per connection, per rank
    and for the whole group."""
    return Table(
        [
            Column("config", "configuration", str, align="left"),
            Column("tensor_parallel_size", "TP"),
            Column("nchannels", "channels"),
            Column("protocols", "protocols", str, align="left"),
            Column("per_connection_bytes", "per connection (MiB)", _mib2),
            Column("per_rank_bytes", "per rank (MiB)", _mib2),
            Column("group_bytes", "group (MiB)", _mib2),
        ],
        rows,
    )


#: the share of a GPU's memory the course's outline said communication buffers take on 2- to 8-GPU layouts
CLAIMED_COMM_SHARE = 0.15


def comm_share_rows(
    gpus: Sequence[str] = ("H100-80GB",),
    sizes: Sequence[int] = (2, 8),
    configs: dict[str, dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Per rank, what communication holds on each GPU and group size: NCCL's buffers (:func:`buffer_estimate`,
    each configuration of ``configs``, default :data:`BUFFER_CONFIGS`) plus vLLM's custom all-reduce
    (:func:`workbench.comm.custom_all_reduce_bytes`, NVLink-connected), and their share of the GPU's memory."""
    from workbench.catalog import GPUS
    from workbench.comm import custom_all_reduce_bytes

    rows = []
    for gpu in gpus:
        cap = GPUS[gpu].memory_bytes
        for n in sizes:
            car = custom_all_reduce_bytes(n).per_rank_bytes
            for name, cfg in (configs or BUFFER_CONFIGS).items():
                nccl = buffer_estimate(n, **cfg).per_rank_bytes
                rows.append({
                    "gpu": gpu, "tensor_parallel_size": n, "config": name, "nccl_bytes": nccl,
                    "custom_all_reduce_bytes": car, "share": (nccl + car) / cap,
                })  # fmt: skip
    return rows


def comm_share_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`comm_share_rows` as a table."""
    return Table(
        [
            Column("gpu", "GPU", align="left"),
            Column("tensor_parallel_size", "TP"),
            Column("config", "NCCL buffers", align="left"),
            Column("nccl_bytes", "NCCL per rank (MiB)", _mib2),
            Column("custom_all_reduce_bytes", "custom all-reduce (MiB)", _mib2),
            Column("share", "share of the GPU", lambda v: f"{100 * v:.3f}%"),
        ],
        list(rows),
    )


def comm_share_verdict(rows: Sequence[dict[str, Any]], claimed: float = CLAIMED_COMM_SHARE) -> str:
    """The claim against :func:`comm_share_rows`: the largest and the default configuration's shares, and how far
    each is from ``claimed``."""
    top = max(rows, key=lambda r: r["share"])
    default = [r for r in rows if r["config"].startswith("default")]
    lo, hi = min(r["share"] for r in default), max(r["share"] for r in default)
    return "\n".join([
        f"default buffers: {100 * lo:.3f}% to {100 * hi:.3f}% of a GPU's memory per rank",
        f"largest: {100 * top['share']:.2f}% ({top['config']}, TP{top['tensor_parallel_size']} on {top['gpu']})",
        f"claimed: about {100 * claimed:.0f}%: "
        + ("holds" if top["share"] >= claimed / 2 else f"not supported, {claimed / top['share']:.0f}x the largest modelled share"),
    ])  # fmt: skip


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
        yaxis={"title": "buffer memory per rank (MiB)", "type": "log", "dtick": 1},
        height=440,
    )
    return fig


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


def kv_cost_table(rows: Sequence[dict[str, Any]], seq_len: int = 4096) -> Table:
    """:func:`kv_cost_rows` as a table: per rank, the block size, the buffers, the KV blocks with and
    without them, the blocks lost, whole ``seq_len``-token sequences with and without, and whether
    ``kv-calc`` (buffers added to its reserve) agrees with the engine. Rows: the given rows, ``gpus`` added."""
    return Table(
        [
            Column("config", "configuration", str, align="left"),
            Column("gpus", "GPUs", str),
            Column("block_bytes", "block (KiB)", lambda v: f"{v / 1024:,.0f}"),
            Column("comm_buffer_bytes", "buffers (MiB)", lambda v: f"{v / MiB:,.1f}"),
            Column("num_blocks", "KV (blocks)", "{:,}".format),
            Column("blocks_without", "no buffers (blocks)", "{:,}".format),
            Column("blocks_lost", "lost (blocks)", "{:,}".format),
            Column("max_seqs", f"sequences of {seq_len:,} tokens", "{:,}".format),
            Column("max_seqs_without", "no buffers (sequences)", "{:,}".format),
            Column("kv_calc_agrees", "kv-calc agrees", str),
        ],
        [dict(r) | {"gpus": f"{r['tensor_parallel_size']} x {r['gpu']}"} for r in rows],
    )


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


def buffer_findings(rows: Sequence[dict[str, Any]]) -> Table:
    """A table computed from :func:`sim_buffer_grid` rows: per GPU setup, each configuration's KV blocks
    (and the change against the first, default, configuration), its peak batch, its throughput and
    its TPOT p50 (both as a ratio to the first configuration's).

    Rows ``{"setup", "config", "num_blocks", "blocks_change", "peak_running", "output_tok_s",
    "throughput_ratio", "tpot_ratio"}``."""
    first = next(iter(dict.fromkeys(r["config"] for r in rows)))
    setups = dict.fromkeys((r["tensor_parallel_size"], r["gpu"]) for r in rows)
    out = []
    for tp, gpu in setups:
        rs = [r for r in rows if (r["tensor_parallel_size"], r["gpu"]) == (tp, gpu)]
        base = next(r for r in rs if r["config"] == first)
        for r in [base] + [r for r in rs if r is not base]:
            out.append(
                {
                    "setup": f"{tp} x {gpu}",
                    "config": r["config"],
                    "num_blocks": r["num_blocks"],
                    "blocks_change": r["num_blocks"] - base["num_blocks"],
                    "peak_running": r["peak_running"],
                    "output_tok_s": r["output_tok_s"],
                    "throughput_ratio": r["output_tok_s"] / base["output_tok_s"],
                    "tpot_ratio": r["tpot_p50_ms"] / base["tpot_p50_ms"],
                }
            )
    return Table(
        [
            Column("setup", "GPUs", str, align="left"),
            Column("config", "configuration", str, align="left"),
            Column("num_blocks", "KV (blocks)", "{:,}".format),
            Column("blocks_change", f"vs {first} (blocks)", "{:+,}".format),
            Column("peak_running", "peak batch (sequences)", str),
            Column("output_tok_s", "output (tok/s)", "{:,.0f}".format),
            Column("throughput_ratio", "throughput (x default)", "{:.3f}x".format),
            Column("tpot_ratio", "TPOT p50 (x default)", "{:.3f}x".format),
        ],
        out,
        title=f"Each configuration against {first}, per GPU setup (simulated)",
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
            y=[rs[s]["output_tok_s"] / base[s] - 1 for s in setups],
            name=name,
            customdata=[[rs[s]["output_tok_s"], rs[s]["num_blocks"]] for s in setups],
            hovertemplate="%{y:+.1%}: %{customdata[0]:,.0f} tok/s, %{customdata[1]:,} blocks",
        )
    fig.update_layout(
        barmode="group",
        title="Simulated throughput vs the default buffers (long requests: the KV pool binds at TP=4)",
        yaxis={"title": "output tokens/s, change vs the default (%)", "tickformat": "+.1%", "zeroline": True},
        height=420,
        legend=LEGEND_ABOVE,
        margin={"t": LEGEND_ABOVE_MARGIN},
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
    from workbench.entrypoints.llm import LLM
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
        source = getattr(eng.executor, "comm_buffer_source", "none")
        modelled = modelled_comm_buffer_bytes(eng.config, tp)
        return [
            f"{n} CUDA device(s); a {tp}-rank NCCL group ({torch.cuda.get_device_name(0)})",
            f"measured per rank: {measured / MiB:,.1f} MiB ({source}); the model: {modelled / MiB:,.1f} MiB",
        ]
    finally:
        llm.shutdown()


# ====================================================================== panels
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
            yaxis={"title": "KV blocks per GPU", "rangemode": "tozero", "tickformat": ",d"},
            yaxis2={
                "title": "output tokens/s",
                "overlaying": "y",
                "side": "right",
                "rangemode": "tozero",
                "showgrid": False,
                # its own round ticks, not the left axis's gridlines carried over (169 / 338 / 507)
                "tickmode": "auto",
                "tickformat": ",d",
            },
            height=380,
            legend=LEGEND_ABOVE,
            margin={"t": LEGEND_ABOVE_MARGIN},
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


# ---------------------------------------------------------------- exercises
@_register(
    "10.1",
    "How many KV blocks per GPU does this buffer configuration cost, compared with no NCCL buffers at all? "
    "(an integer; checked against the simulated engine's own budget)",
    "buffers per rank = channels x (NCCL_BUFFSIZE + LL + LL128 buffers of the enabled protocols); blocks = "
    "budget // block_bytes — compute the blocks of the budget without and with the buffers, and subtract.",
)
class _BlocksLost:
    @staticmethod
    def solution(config: dict, budget: dict, engine_num_blocks: int) -> int:
        from workbench.comm import nccl_buffer_bytes

        buffers = nccl_buffer_bytes(
            config["tensor_parallel_size"],
            buffsize=config["nccl_buffsize"],
            nchannels=config["nchannels"],
            protocols=config["nccl_proto"],
        ).per_rank_bytes
        after = (budget["kv_budget_bytes"] - buffers) // budget["block_bytes"]
        return budget["num_blocks"] - after

    @staticmethod
    def judge(answer, config: dict, budget: dict, engine_num_blocks: int) -> tuple[bool, str]:
        from workbench.comm import nccl_buffer_bytes

        want = budget["num_blocks"] - engine_num_blocks
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of blocks, got {answer!r}"
        est = nccl_buffer_bytes(
            config["tensor_parallel_size"],
            buffsize=config["nccl_buffsize"],
            nchannels=config["nchannels"],
            protocols=config["nccl_proto"],
        )
        if x == want:
            return True, (
                f"{want:,} blocks per GPU: {est.per_rank_bytes:,} B of buffers; the engine's pool went from "
                f"{budget['num_blocks']:,} to {engine_num_blocks:,} blocks"
            )
        if x == est.per_rank_bytes or x == est.per_rank_bytes / 2**20:
            return False, "that is the buffers' size; convert it into the blocks it displaces"
        if x == want * config["tensor_parallel_size"]:
            return False, "that is the whole group's loss; the question asks per GPU"
        simple = config["nchannels"] * config["nccl_buffsize"] // budget["block_bytes"]
        if x == simple and simple != want:
            return False, "count every enabled protocol's buffer (LL and LL128 too), not NCCL_BUFFSIZE alone"
        if x == est.per_rank_bytes // budget["block_bytes"] and x != want:
            return False, (
                "buffers // block_bytes ignores the part-block the budget already had left over: "
                "compare the two budgets' whole blocks"
            )
        side = "too many" if x > want else "too few"
        return False, (
            f"{answer!r} is {side}: the buffers take {est.per_rank_bytes / 2**20:,.1f} MiB per GPU and a block is "
            f"{budget['block_bytes']:,} B; count the budget's whole blocks with and without the buffers"
        )
