"""Chapter 3, probes and logs: a fragmentation probe on the step records, what a GPU reports, the step log as a
table.

The notebook ``labs/03_probes_and_logs.ipynb`` calls these, one call per cell; its exercises are at the end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from workbench.labs.exercise_registry import _number, _register

# the notebook calls these too (ch.lab_engine)
from workbench.labs.runs import lab_engine  # noqa: F401
from workbench.viz.table import Column, Table

MiB = 1 << 20


class FragmentationProbe:
    """A recorder sink that watches every step: the peak fragmentation, and the steps where the
    fragmentation rate exceeds ``threshold`` while requests wait (memory lost while it is needed).

    Attach with ``lab_run(..., sinks=[probe.sink])`` or ``recorder.add_sink(probe.sink)``.
    """

    def __init__(self, threshold: float = 0.2) -> None:
        from workbench.metrics.recorder import CallbackSink

        self.threshold = threshold
        self.peak_rate = 0.0
        self.peak_step: int | None = None
        self.peak_external_slots = 0
        self.alerts: list[int] = []
        self.sink = CallbackSink(self.on_step)

    def on_step(self, s) -> None:
        if s.fragmentation_rate > self.peak_rate:
            self.peak_rate, self.peak_step = s.fragmentation_rate, s.step
        self.peak_external_slots = max(self.peak_external_slots, s.external_fragmentation)
        if s.num_waiting and s.fragmentation_rate > self.threshold:
            self.alerts.append(s.step)


def gpu_probe() -> list[str]:
    """PyTorch allocator and NVML figures of GPU 0, when there is one; otherwise one line saying so.

    Allocator fragmentation (docs/architecture.md §3) = reserved − allocated bytes of PyTorch's caching
    allocator; outside PyTorch = NVML used − reserved.
    """
    import torch

    if not torch.cuda.is_available():
        return ["no CUDA device on this machine: the allocator and NVML figures need a GPU"]
    from workbench.memory import nvml_memory

    st = torch.cuda.memory_stats(0)
    alloc, reserved = st.get("allocated_bytes.all.current", 0), st.get("reserved_bytes.all.current", 0)
    lines = [
        f"PyTorch allocated {alloc / MiB:,.1f} MiB, reserved {reserved / MiB:,.1f} MiB, "
        f"allocator fragmentation {(reserved - alloc) / MiB:,.1f} MiB"
    ]
    nv = nvml_memory(0)
    if nv:
        lines.append(
            f"NVML: {nv.get('name', 'GPU')} used {nv['used'] / MiB:,.0f} of {nv['total'] / MiB:,.0f} MiB; "
            f"outside PyTorch {(nv['used'] - reserved) / MiB:,.0f} MiB"
        )
    return lines


def steps_table(steps: Sequence[dict[str, Any]], every: int = 5) -> Table:
    """Every ``every``-th step record (and the last): tokens, requests, blocks and the pool split in
    token slots. Rows: the step records picked."""
    cols = (
        ("step", "step"),
        ("num_prefill_tokens", "prefill (tokens)"),
        ("num_decode_tokens", "decode (tokens)"),
        ("num_running", "running"),
        ("num_waiting", "waiting"),
        ("blocks_used", "blocks"),
        ("token_states", "tokens (slots)"),
        ("reservation", "reserved (slots)"),
        ("internal_fragmentation", "internal (slots)"),
        ("external_fragmentation", "external (slots)"),
        ("free", "free (slots)"),
    )
    picked = [s for i, s in enumerate(steps) if i % every == 0 or i == len(steps) - 1]
    return Table([Column(k, h) for k, h in cols], picked)


# ---------------------------------------------------------------- exercises
@_register(
    "3.1",
    "From the startup memory line, how many bytes does the KV pool get? (an integer)",
    "the pool is num_blocks x block_bytes; it is the 'KV pool' figure of the line.",
)
class _PoolBytes:
    @staticmethod
    def solution(memory: dict) -> int:
        return memory["kv_pool_bytes"]

    @staticmethod
    def judge(answer, memory: dict) -> tuple[bool, str]:
        ref = memory["kv_pool_bytes"]
        x = _number(answer)
        if x is None:
            return False, f"give bytes as a number, got {answer!r}"
        if x == ref:
            return True, f"{ref:,} B = {memory['num_blocks']:,} blocks x {memory['block_bytes']:,} B"
        if x == memory["kv_budget_bytes"]:
            return False, "that is the budget; the pool is the whole blocks that fit in it (a little less)"
        return False, f"{x:,.0f} B is not it"


@_register(
    "3.2",
    "Write a probe: a function wasted_bytes(step) giving the bytes of KV memory allocated but holding no "
    "token state in one step record; checked on every step of the run.",
    "(reservation + internal_fragmentation + external_fragmentation) slots x kv_bytes_per_token.",
)
class _WastedBytes:
    @staticmethod
    def solution(steps: list) -> Callable:
        return lambda s: (
            (s["reservation"] + s["internal_fragmentation"] + s["external_fragmentation"]) * s["kv_bytes_per_token"]
        )

    @staticmethod
    def judge(answer, steps: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        ref = _WastedBytes.solution(steps)
        for s in steps:
            got, want = answer(dict(s)), ref(s)
            if got != want:
                hint = " (slots, not bytes?)" if want and got * s["kv_bytes_per_token"] == want else ""
                return False, f"step {s['step']}: yours {got!r}, expected {want:,} B{hint}"
        peak = max(ref(s) for s in steps)
        return True, f"matches on all {len(steps)} steps; peak waste {peak:,} B"
