"""The memory budget of a run: where the device memory goes (docs/architecture.md §3 and ``workbench/memory.py``),
as rows, a stacked bar and the run report's "Memory budget" section.

The input is a memory budget as the run records it (``MemoryBudget.to_dict()``, the ``memory`` of a
run folder's ``config.json``): ``capacity_bytes``, ``gpu_memory_utilization``, ``weights_bytes``,
``activation_bytes``, ``comm_buffer_bytes``, ``non_torch_bytes`` (and ``other_torch_bytes`` on CUDA), ``kv_pool_bytes``, ``num_blocks``,
``block_size`` (tokens), ``kv_bytes_per_token``, ``block_bytes``, ``kv_pool_tokens``,
``max_model_len``, ``max_concurrency``, ``source`` and ``device_name``. The names of the parts are
chapter 1's (:func:`workbench.labs.ch01_kv_cache_anatomy.budget_table` uses these rows).
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

import plotly.graph_objects as go

from workbench.viz.common import budget_colour

MiB = 1 << 20

#: What the activation figure is, by the budget's ``source`` (``MemoryBudget.summary_line``'s words).
_ACTIVATIONS_HOW = {
    "cuda": "profiled peak of one forward of max_num_batched_tokens",
    "cpu device_memory": "profiled peak of one forward of max_num_batched_tokens",
    "simulated": "estimate: no model to profile",
}


def budget_rows(memory: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``[(part, bytes)]`` of a memory budget: where the capacity goes, in the order it fills the device —
    weights, activations, communication buffers, memory outside PyTorch, the KV pool (whole blocks),
    what is left of ``capacity × gpu_memory_utilization`` (less than a block; named ``left: unused``
    when a bypass such as ``num_gpu_blocks_override`` set the pool), and what
    ``1 − gpu_memory_utilization`` holds back."""
    usable = int(memory["capacity_bytes"] * memory["gpu_memory_utilization"])
    budgeted = memory.get("source", "cuda") in _ACTIVATIONS_HOW  # else a bypass set the pool's size
    outside = ("outside PyTorch", memory.get("non_torch_bytes", 0))
    if memory.get("other_torch_bytes"):  # CUDA: tensors this process held before the engine's profile
        outside = ("outside PyTorch + other PyTorch tensors", outside[1] + memory["other_torch_bytes"])
    parts = [
        ("weights", memory["weights_bytes"]),
        ("activations (profiled peak)", memory["activation_bytes"]),
        ("communication buffers", memory["comm_buffer_bytes"]),
        outside,
        ("KV pool (whole blocks)", memory["kv_pool_bytes"]),
    ]
    left = "left: part of a block" if budgeted else "left: unused"
    parts.append((left, usable - sum(b for _, b in parts)))
    parts.append(("held back: 1 - gpu_memory_utilization", memory["capacity_bytes"] - usable))
    return parts


def budget_figure(memory: Mapping[str, Any], title: str = "Where the memory goes") -> go.Figure:
    """One horizontal stacked bar of :func:`budget_rows`, in MiB."""
    fig = go.Figure()
    for name, b in budget_rows(memory):
        fig.add_bar(
            y=["device"],
            x=[b / MiB],
            name=name,
            orientation="h",
            marker_color=budget_colour(name),
            hovertemplate=f"{name}: %{{x:,.1f}} MiB<extra></extra>",
        )
    # one bar and no right-hand axis: the seven long legend entries go beside it, one per line (above
    # the plot they take up to seven rows on a narrow page, and run into the title)
    fig.update_layout(
        barmode="stack",
        title={"text": title},
        xaxis_title="device memory (MiB)",
        height=320,
        legend={"traceorder": "normal", "yanchor": "top", "y": 1},
        margin={"t": 60},
    )
    return fig


def _capacity_how(device: str, source: str) -> str:
    """Where the capacity figure comes from, in words: ``"device_memory declared for the CPU"``,
    ``"NVIDIA H100 80GB HBM3: the GPU's total memory"``."""
    if source == "cpu device_memory":
        return "device_memory declared for the CPU"
    if source == "cuda":
        return f"{device}: the GPU's total memory"
    return f"{device}: {source}" if source else device


def _mib(b: float) -> str:
    return f"{b / MiB:,.1f}"


def budget_table_rows(memory: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """The report's budget table: ``(figure, value, MiB, share of capacity)`` rows — the capacity and the
    share the engine may use, the parts of :func:`budget_rows`, then the KV pool's geometry (blocks,
    block size in tokens, bytes per token and per block, tokens, sequences of ``max_model_len``)."""
    cap = memory["capacity_bytes"]
    util = memory["gpu_memory_utilization"]
    where = memory.get("device_name") or "device"

    def share(b: float) -> str:
        return f"{b / cap:.1%}" if cap else "n/a"

    rows = [
        ("capacity", f"{cap:,} B ({_capacity_how(where, memory.get('source', ''))})", _mib(cap), share(cap)),
        (
            "x gpu_memory_utilization",
            f"{util} (usable: {int(cap * util):,} B)",
            _mib(int(cap * util)),
            share(int(cap * util)),
        ),
    ]
    how = {
        "activations (profiled peak)": _ACTIVATIONS_HOW.get(memory.get("source", ""), "not profiled: the pool was set"),
        "KV pool (whole blocks)": f"{memory['num_blocks']:,} blocks x {memory['block_bytes']:,} B",
    }
    for name, b in budget_rows(memory):
        if name == "left: unused":
            how[name] = f"usable - the parts above; {memory['source']} set the pool's size"
        note = how.get(name, "usable - the parts above" if name.startswith("left") else "")
        rows.append((name, f"{b:,} B" + (f" ({note})" if note else ""), _mib(b), share(b)))
    rows += [
        ("KV blocks", f"{memory['num_blocks']:,}", "", ""),
        ("block size (tokens)", f"{memory['block_size']:,}", "", ""),
        ("KV bytes per token", f"{memory['kv_bytes_per_token']:,} B", "", ""),
        ("block bytes", f"{memory['block_bytes']:,} B", "", ""),
        ("KV pool (tokens)", f"{memory['kv_pool_tokens']:,}", "", ""),
    ]
    if memory.get("max_model_len"):
        rows.append(
            (
                f"sequences of max_model_len={memory['max_model_len']:,}",
                f"{memory['max_concurrency']:.2f} at once (max concurrency)",
                "",
                "",
            )
        )
    return rows


def budget_section_html(memory: Mapping[str, Any] | None) -> str:
    """The report's "Memory budget" section (a table of :func:`budget_table_rows`), or ``""`` without a budget."""
    if not memory:
        return ""
    body = "\n".join(
        "<tr>" + "".join(f"<{t}>{html.escape(v)}</{t}>" for t, v in zip(("th", "td", "td", "td"), row)) + "</tr>"
        for row in budget_table_rows(memory)
    )
    return (
        '<section class="budget"><h2>Memory budget</h2>\n'
        "<p>capacity &times; gpu_memory_utilization &minus; weights &minus; activations &minus; buffers "
        "&rarr; KV blocks (docs/architecture.md &sect;3); the KV pool is whole blocks of block_size tokens.</p>\n"
        '<table class="budget"><thead><tr><th>figure</th><th>value</th><th>MiB</th><th>share of capacity</th>'
        f"</tr></thead>\n<tbody>\n{body}\n</tbody></table></section>"
    )
