"""Chapter 4, PagedAttention inside: one live batch's block tables and slots, the kernel against a reference,
block sizes.

The notebook ``labs/04_paged_attention_inside.ipynb`` calls these, one call per cell; its exercises are at the end."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.labs.exercise_registry import _number, _register

# the notebook calls these too (ch.lab_engine)
from workbench.labs.runs import (
    lab_engine,  # noqa: F401
    lab_run,
    lab_trace,
)
from workbench.viz.table import Column, Table


class _CaptureInputs:
    """Wraps an executor's forward: records each step's model input and the block tables it was laid
    out with (read before the model runs: a request that finishes in the step frees its blocks)."""

    def __init__(self, executor, kv) -> None:
        self.executor = executor
        self.forward = executor.execute_model
        self.kv = kv
        self.inputs: list = []

    def __call__(self, inp):
        tables = {s.request.request_id: list(self.kv.get_block_table(s.request.request_id)) for s in inp.order}
        self.inputs.append((inp, tables))
        return self.forward(inp)


def live_batch(llm, records=None, num_steps: int = 3) -> list[list[dict[str, Any]]]:
    """Run ``num_steps`` engine steps and return, per step, each scheduled request's block table,
    positions and the slots the engine wrote them to (from the executor's real input).

    Each entry: ``{"request_id", "block_table", "block_size", "positions", "slots", "phase"}``.
    The requests stay in the engine (call ``llm.llm_engine.abort`` or keep stepping to finish them).
    """
    from workbench.bench.run import to_engine_prompt
    from workbench.sampling import SamplingParams

    eng = llm.llm_engine
    records = list(records) if records is not None else lab_trace(4, mean_output=8, max_output=16)
    for i, r in enumerate(records):
        eng.add_request(f"req-{i}", to_engine_prompt(r), SamplingParams(max_tokens=r.max_tokens, ignore_eos=True))
    cap = _CaptureInputs(eng.executor, eng.kv)
    eng.executor.execute_model = cap  # this instance's forward, for the steps below
    out = []
    try:
        for _ in range(num_steps):
            before = len(cap.inputs)
            eng.step()
            if len(cap.inputs) == before:
                break
            inp, tables = cap.inputs[-1]
            pos = inp.positions.tolist()
            slots = inp.meta.slot_mapping.tolist()
            i = 0
            step = []
            for s in inp.order:
                n = s.num_new_tokens
                rid = s.request.request_id
                step.append(
                    {
                        "request_id": rid,
                        "block_table": tables[rid],
                        "block_size": eng.kv.block_size,
                        "positions": pos[i : i + n],
                        "slots": slots[i : i + n],
                        "phase": "prefill" if n > 1 else "decode",
                    }
                )
                i += n
            out.append(step)
    finally:
        del eng.executor.execute_model  # the class's method again
    return out


def batch_table(steps: Sequence[Sequence[dict[str, Any]]] | Sequence[dict[str, Any]]) -> Table:
    """One line per scheduled request of each step (:func:`live_batch`): phase, the positions
    written, the slots they went to (first..last) and the block table. A single step is accepted too.

    Rows ``{"step", "request_id", "phase", "positions", "slots", "block_table"}``."""
    if steps and isinstance(steps[0], dict):
        steps = [steps]
    rows = [
        {
            "step": i,
            "request_id": b["request_id"],
            "phase": b["phase"],
            "positions": (b["positions"][0], b["positions"][-1]),
            "slots": (b["slots"][0], b["slots"][-1]),
            "block_table": list(b["block_table"]),
        }
        for i, step in enumerate(steps)
        for b in step
    ]
    span = lambda v: f"{v[0]}..{v[1]}"  # noqa: E731
    return Table(
        [
            Column("step", "step"),
            Column("request_id", "request", align="left"),
            Column("phase", "phase", align="left"),
            Column("positions", "positions", span),
            Column("slots", "slots", span),
            Column("block_table", "block table (physical block ids)", str, align="left"),
        ],
        rows,
    )


def block_table_figure(step: Sequence[dict[str, Any]], num_blocks: int) -> go.Figure:
    """Logical blocks (rows: requests) -> physical blocks (x): one square per block-table entry,
    at its physical block id, numbered with its logical index (0 = the request's first block)."""
    fig = go.Figure()
    for b in step:
        tb = b["block_table"]
        fig.add_scatter(
            x=tb,
            y=[b["request_id"]] * len(tb),
            mode="markers+text",
            text=[str(i) for i in range(len(tb))],
            textposition="middle center",
            textfont={"size": 9, "color": "white"},
            marker={"size": 15, "symbol": "square"},
            name=b["request_id"],
            hovertemplate="logical block %{text} -> physical block %{x}<extra>" + b["request_id"] + "</extra>",
        )
    fig.update_layout(
        title="Block tables: logical blocks 0, 1, 2, ... of each request land anywhere in the pool",
        xaxis={"title": f"physical block id (pool of {num_blocks:,} blocks)", "range": [-1, num_blocks]},
        yaxis={"title": "request", "type": "category"},
        height=max(260, 140 + 40 * len(step)),
        showlegend=False,
    )
    return fig


def kernel_vs_reference(seed: int = 0, num_seqs: int = 3, block_size: int = 16) -> dict[str, Any]:
    """Run the Triton paged-attention decode kernel in Triton's interpreter (CPU) against the
    PyTorch reference on a random paged cache; returns the shapes and the largest difference.

    Raises:
        ImportError: Triton is not installed (``pip install 'workbench[triton]'``).
    """
    import torch

    from workbench.kernels.paged_attention import paged_decode_attention
    from workbench.kernels.reference import paged_decode_attention_ref

    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 32, 16
    ctx = torch.tensor([5, 17, 33][:num_seqs], dtype=torch.int32)
    width = math.ceil(int(ctx.max()) / block_size)
    perm = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width).to(torch.int32)
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, perm, ctx, scale, interpret=True)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, perm, ctx, scale)
    return {
        "query": list(q.shape),
        "k_cache": list(k_cache.shape),
        "block_tables": perm.tolist(),
        "context_lens": ctx.tolist(),
        "max_abs_diff": float((out - ref).abs().max()),
        "allclose": bool(torch.allclose(out, ref, atol=1e-4, rtol=1e-4)),
    }


def block_size_sweep(block_sizes: Sequence[int] = (8, 16, 32), records=None, pool_tokens: int = 768, **engine_args):
    """The same requests at several ``block_size`` values and the same pool in tokens; ``{bs: JobResult}``."""
    records = list(records) if records is not None else lab_trace()
    return {
        bs: lab_run(records, block_size=bs, num_gpu_blocks_override=pool_tokens // bs, **engine_args)
        for bs in block_sizes
    }


def print_kernel_loop() -> None:
    """Print the key loop of the Triton decode kernel (``workbench/kernels/paged_attention.py``)."""
    import inspect

    from workbench.kernels import paged_attention

    src = inspect.getsource(
        paged_attention._paged_decode_kernel.fn
        if hasattr(paged_attention._paged_decode_kernel, "fn")
        else paged_attention._paged_decode_kernel
    )
    lines = src.splitlines()
    start = next(i for i, x in enumerate(lines) if "for n0 in range(" in x)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith("if SPLIT")), len(lines))
    print("\n".join(lines[start:end]).rstrip())


# ---------------------------------------------------------------- exercises
def reference_slot(block_table: list[int], block_size: int, position: int) -> int:
    """Slot of a token: ``block_table[position // block_size] * block_size + position % block_size``."""
    return block_table[position // block_size] * block_size + position % block_size


@_register(
    "4.1",
    "Write slot(block_table, block_size, position): the flat KV-cache slot a token at this position is written "
    "to; checked against the engine's slot mapping for every token of the live batch.",
    "the logical block is position // block_size, the offset position % block_size.",
)
class _Slot:
    @staticmethod
    def solution(batch: list) -> Callable:
        return reference_slot

    @staticmethod
    def judge(answer, batch: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        n = 0
        for b in batch:
            for pos, want in zip(b["positions"], b["slots"]):
                got = answer(list(b["block_table"]), b["block_size"], pos)
                if got != want:
                    return False, f"request {b['request_id']} position {pos}: yours {got!r}, the engine wrote {want}"
                n += 1
        return True, f"all {n} slots of the batch match the engine's slot mapping"


@_register(
    "4.2",
    "A request ends with 130 tokens (prompt + output) at block_size 16: how many token slots of its last "
    "block are internal fragmentation?",
    "blocks = ceil(130 / 16); slots allocated - 130.",
)
class _Tail:
    @staticmethod
    def solution() -> int:
        return math.ceil(130 / 16) * 16 - 130

    @staticmethod
    def judge(answer) -> tuple[bool, str]:
        ref = _Tail.solution()
        if _number(answer) == ref:
            return True, f"{ref} slots: 9 blocks x 16 = 144 slots for 130 tokens"
        if _number(answer) == 130 % 16:
            return False, "that is how many slots of the last block are used, not unused"
        return False, f"{answer!r} is not it"
