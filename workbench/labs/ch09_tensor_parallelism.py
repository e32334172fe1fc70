"""Chapter 9 of the labs: tensor parallelism for real, and priced by the simulator.

The chapter runs the bundled model at ``tensor_parallel_size`` 1 and 3 (worker processes over
gloo, :mod:`workbench.executor.tensor_parallel`) and reads what each engine reports about
itself: its memory budget (one rank's weights, KV bytes per token, KV pool, communication
buffers), every step's ``StepStats`` (bytes all-reduced and all-gathered, collectives, seconds
in them) and the greedy tokens. Then the simulator (:mod:`workbench.sim`) prices the same
Megatron-style split for a 70B model on 2 / 4 / 8 GPUs with NVLink and with PCIe links.

Panels (:class:`TPRunPanel`, :class:`TPSimPanel`) are ipywidgets named like the engine arguments;
their ``run()`` is the Run button's code path, without a click.

From a script (not a notebook), put the tensor-parallel runs under ``if __name__ == "__main__":``:
the worker processes are spawned, and each re-imports the script (Python's multiprocessing rule).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.labs.exercise_registry import _register
from workbench.labs.multigpu_common import (
    MiB,
    _own_link,
    _Panel,
    _threads_per_rank,
    burst_trace,
    close_engines,
    model_dims,
    sim_hardware,
    sim_run_row,
    sim_table,
    tp_engine,
    tp_run,
    tp_trace,
)
from workbench.viz.common import (
    LEGEND_ABOVE,
    LEGEND_ABOVE_MARGIN,
    percent_axis,
    share_colour_range,
    title_above_legend,
)
from workbench.viz.table import Column, Table

__all__ = [
    "TPRunPanel",
    "TPSimPanel",
    "burst_trace",
    "close_engines",
    "comm_rows",
    "comm_table",
    "expected_allreduce_bytes",
    "explain_memory",
    "memory_rows",
    "memory_table",
    "model_dims",
    "same_tokens",
    "sim_hardware",
    "sim_run_row",
    "sim_table",
    "sim_tp_figure",
    "sim_tp_grid",
    "time_split_figure",
    "time_split_rows",
    "time_split_table",
    "tokens_table",
    "tp_engine",
    "tp_run",
    "tp_runs",
    "tp_sim_findings",
    "tp_trace",
]


# ====================================================================== chapter 9: real runs


def tp_runs(sizes: Sequence[int] = (1, 3), records=None, **engine_args) -> dict[int, Any]:
    """The same requests at each tensor-parallel size (greedy, EOS ignored); ``{tp: JobResult}``.

    Each size's engine comes from :func:`tp_engine` (built once, reused by later calls). Every
    process computes with the same number of torch threads — what a rank of the largest size gets,
    ``cores // max(sizes)``, at least 1 (:func:`tp_run`) — so the sizes are compared process for
    process (``docs/benchmarks.md``, section "Tensor parallelism on this CPU: compute vs communication")."""
    records = list(records) if records is not None else tp_trace()
    threads = _threads_per_rank(max(sizes))
    return {tp: tp_run(tp, records, threads=threads, **engine_args) for tp in sizes}


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


def memory_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`memory_rows` as a table, one line per figure of one rank (MiB or counts), one column per
    size, each figure with its ratio to the first size's. Rows: ``{"figure", "TP=N": cell text, ...}``
    (the raw figures are :func:`memory_rows`)."""
    base = rows[0]
    spec = (
        ("weights (MiB)", "weights_bytes", True),
        ("activations, profiled peak (MiB)", "activation_bytes", True),
        ("communication buffers (MiB)", "comm_buffer_bytes", True),
        ("KV bytes per token", "kv_bytes_per_token", False),
        ("KV pool (blocks)", "num_blocks", False),
        ("KV pool (MiB)", "kv_pool_bytes", True),
        ("KV pool (tokens)", "kv_pool_tokens", False),
    )
    sizes = [f"TP={r['tensor_parallel_size']}" for r in rows]
    out = []
    for label, k, mib in spec:
        line = {"figure": label}
        for name, r in zip(sizes, rows):
            v = r[k] / MiB if mib else r[k]
            txt = f"{v:,.1f}" if mib else f"{v:,}"
            if r is not base and base[k]:
                txt += f" ({r[k] / base[k]:.2f}x)"
            line[name] = txt
        out.append(line)
    return Table([Column("figure", "per rank", str, align="left")] + [Column(n, n, str) for n in sizes], out)


def tokens_table(runs: dict[int, Any], records=None) -> Table:
    """Each request's greedy token ids at the first size; a note per other size: did it produce the same.

    Rows ``{"request", "tokens", "token_ids"}``."""
    first_tp, first = next(iter(runs.items()))
    rows = [
        {"request": i, "tokens": len(o.outputs[0].token_ids), "token_ids": list(o.outputs[0].token_ids)}
        for i, o in enumerate(first.outputs)
    ]
    notes = [
        f"TP={tp} produced the same greedy tokens as TP={first_tp}: {same}"
        for tp, same in same_tokens(runs).items()
        if tp != first_tp
    ]
    return Table(
        [
            Column("request", "request"),
            Column("tokens", "output (tokens)"),
            Column("token_ids", f"greedy token ids at TP={first_tp}", str, align="left"),
        ],
        rows,
        notes=notes,
    )


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


def comm_table(rows: Sequence[dict[str, Any]], every: int = 1) -> Table:
    """:func:`comm_rows` as a table (every ``every``-th step and the last), and a note: on how many
    steps the all-reduce bytes equal the formula, and the MiB all-reduced in the run."""
    picked = [r for i, r in enumerate(rows) if i % every == 0 or i == len(rows) - 1]
    same = sum(r["allreduce_bytes"] == r["formula_bytes"] for r in rows)
    total = sum(r["allreduce_bytes"] for r in rows)
    n = "{:,}".format
    return Table(
        [
            Column("step", "step"),
            Column("tokens", "tokens"),
            Column("allreduce_bytes", "all-reduced (B)", n),
            Column("formula_bytes", "(1+2L)·T·h·b (B)", n),
            Column("allgather_bytes", "all-gathered (B)", n),
            Column("collectives", "collectives"),
        ],
        picked,
        notes=[
            f"all-reduced bytes equal to the formula on {same} of {len(rows)} steps; {total / MiB:,.2f} MiB in the run"
        ],
    )


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


def time_split_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`time_split_rows` as a table, mean milliseconds per step (timings: they vary from run to run)."""
    ms = "{:.1f}".format
    return Table(
        [
            Column("tensor_parallel_size", "", lambda v: f"TP={v}", align="left"),
            Column("steps", "steps"),
            Column("schedule_ms", "schedule (ms)", ms),
            Column("compute_ms", "compute (ms)", ms),
            Column("communication_ms", "comm. (ms)", ms),
            Column("sample_ms", "sample (ms)", ms),
            Column("communication_share", "comm. share of model (%)", "{:.0%}".format),
        ],
        rows,
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


# ====================================================================== simulator
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
    palette = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")
    for i, link in enumerate(dict.fromkeys(r["interconnect"] for r in rows)):
        rs = [r for r in rows if r["interconnect"] == link]
        x = [r["tensor_parallel_size"] for r in rs]
        style = {"name": link, "legendgroup": link, "line": {"color": palette[i % len(palette)]}}
        fig.add_scatter(x=x, y=[r["output_tok_s"] for r in rs], **style, row=1, col=1)
        fig.add_scatter(x=x, y=[r["allreduce_share"] for r in rs], **style, showlegend=False, row=1, col=2)
    fig.update_xaxes(
        title_text="tensor_parallel_size (GPUs)", tickvals=sorted({r["tensor_parallel_size"] for r in rows})
    )
    fig.update_yaxes(title_text="output tokens/s", rangemode="tozero", row=1, col=1)
    top = max(r["allreduce_share"] for r in rows)
    fig.update_yaxes(percent_axis(0, min(1.0, share_colour_range([top])[1])), row=1, col=2)
    fig.update_layout(
        height=430,
        title=title_above_legend(f"{rows[0]['model']} on {rows[0]['gpu']}: NVLink vs PCIe"),
        legend=LEGEND_ABOVE | {"y": 1.1},  # above the two panels' own titles
        margin={"t": LEGEND_ABOVE_MARGIN + 30},
    )
    return fig


# ====================================================================== panels
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
            yaxis={"title": "output tokens/s", "rangemode": "tozero"},
            yaxis2={"overlaying": "y", "side": "right", "showgrid": False} | percent_axis(title="all-reduce share"),
            height=380,
            legend=LEGEND_ABOVE,
            margin={"t": LEGEND_ABOVE_MARGIN},
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


# ---------------------------------------------------------------- exercises
def reference_allreduce_bytes(num_tokens: int, hidden_size: int, num_hidden_layers: int, dtype_bytes: int) -> int:
    """``(1 + 2 L) x tokens x hidden x dtype bytes``: the vocab-parallel embedding's all-reduce and
    two per layer (after attention's ``o_proj`` and the MLP's ``down_proj``)."""
    return (1 + 2 * num_hidden_layers) * num_tokens * hidden_size * dtype_bytes


@_register(
    "9.1",
    "Write allreduce_bytes(num_tokens, hidden_size, num_hidden_layers, dtype_bytes): the bytes one rank "
    "all-reduces in a step of num_tokens tokens; checked against the TP=3 engine's StepStats on every step.",
    "every row-parallel layer ends in an all-reduce of a [tokens, hidden] tensor: two per layer (attention, MLP) "
    "— and count the vocab-parallel embedding too.",
)
class _AllreduceBytes:
    @staticmethod
    def solution(steps: list, model: dict) -> Callable:
        return reference_allreduce_bytes

    @staticmethod
    def judge(answer, steps: list, model: dict) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        L, h, b = model["num_hidden_layers"], model["hidden_size"], model["dtype_bytes"]
        for s in steps:
            tokens = s["num_prefill_tokens"] + s["num_decode_tokens"]
            got, want = answer(tokens, h, L, b), s["allreduce_bytes"]
            if got != want:
                why = ""
                if got and want and got * (1 + 2 * L) == want * 2 * L:
                    why = " — one all-reduce short per step: the vocab-parallel embedding all-reduces too"
                elif got and got * b == want:
                    why = " — elements, not bytes: multiply by dtype_bytes"
                return (
                    False,
                    f"step {s['step']} ({tokens} tokens): yours {got!r}, the engine all-reduced {want:,} B{why}",
                )
        total = sum(s["allreduce_bytes"] for s in steps)
        return True, f"equal to the engine's bytes on all {len(steps)} steps ({total:,} B in the run)"
