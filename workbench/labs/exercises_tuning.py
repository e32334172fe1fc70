"""Exercises of chapters 7 and 8 (the parameter matrix; chunked prefill), registered in :data:`workbench.labs.exercises.EXERCISES`."""

from __future__ import annotations

import math
from collections.abc import Callable

from workbench.labs.exercises import _number, _register


# ---------------------------------------------------------------- chapter 7: the parameter matrix
def best_under_target(rows: list, ttft_p99_target_s: float) -> dict | None:
    """The row of highest ``output_throughput_tok_s`` among those whose ``ttft_p99_s`` is at most the
    target (refused points, ``error`` set, excluded); ``None`` when no row meets the target."""
    ok = [
        r
        for r in rows
        if not r.get("error") and r.get("ttft_p99_s") is not None and r["ttft_p99_s"] <= ttft_p99_target_s
    ]
    return max(ok, key=lambda r: r["output_throughput_tok_s"]) if ok else None


def _which_row(answer, rows: list):
    """The row an answer names: its config dict (the swept arguments, exactly), its index, or its label."""
    if isinstance(answer, dict):
        return next((r for r in rows if r["config"] == answer), None)
    if isinstance(answer, int) and not isinstance(answer, bool):
        return rows[answer] if 0 <= answer < len(rows) else None
    if isinstance(answer, str):
        return next((r for r in rows if r["label"] == answer.strip()), None)
    return None


@_register(
    "7.1",
    "Which configuration of the sweep gives the highest output throughput while its TTFT p99 stays at or "
    "under the target? Give its config dict (e.g. rows[3]['config']), its index in rows, or its label; "
    "None if no configuration meets the target.",
    "keep the rows with ttft_p99_s <= ttft_p99_target_s (and no error), then take the largest output_throughput_tok_s.",
)
class _BestConfig:
    @staticmethod
    def solution(rows: list, ttft_p99_target_s: float):
        best = best_under_target(rows, ttft_p99_target_s)
        return None if best is None else dict(best["config"])

    @staticmethod
    def judge(answer, rows: list, ttft_p99_target_s: float) -> tuple[bool, str]:
        best = best_under_target(rows, ttft_p99_target_s)
        if best is None:
            if answer is None:
                return True, f"no configuration meets TTFT p99 <= {ttft_p99_target_s:g} s"
            return False, f"no configuration meets TTFT p99 <= {ttft_p99_target_s:g} s: the answer is None"
        if answer is None:
            return False, f"{best['label']} meets the target; look again at the ttft_p99_s column"
        row = _which_row(answer, rows)
        if row is None:
            return False, f"{answer!r} names no row of the sweep: give rows[i]['config'], an index i or a label"
        t, x = row["ttft_p99_s"], row["output_throughput_tok_s"]
        if row is best:
            return True, (f"{row['label']}: {x:,.1f} tok/s at TTFT p99 {t:.2f} s (target {ttft_p99_target_s:g} s)")
        if row.get("error"):
            return False, f"{row['label']} did not run: {row['error']}"
        if t is None or t > ttft_p99_target_s:
            return False, f"{row['label']} misses the target: TTFT p99 {t:.2f} s > {ttft_p99_target_s:g} s"
        return False, (
            f"{row['label']} meets the target but another configuration that meets it has more throughput "
            f"than its {x:,.1f} tok/s"
        )


# ---------------------------------------------------------------- chapter 8: chunked prefill
def reference_prefill_chunks(prompt_tokens: int, budget: int, decodes: int) -> int:
    """Steps a prompt of ``prompt_tokens`` tokens takes under chunked prefill, when ``decodes`` running
    requests take one token each of every step's ``budget`` first: ``ceil(P / (B - D))``."""
    return math.ceil(prompt_tokens / (budget - decodes))


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
        for m in measured:
            got = answer(m["prompt_tokens"], m["budget"], m["decodes"])
            if _number(got) != m["chunks"]:
                hint = ""
                if got == math.ceil(m["prompt_tokens"] / m["budget"]):
                    hint = " (the decodes take part of every step's budget)"
                return False, (
                    f"P={m['prompt_tokens']}, B={m['budget']}, D={m['decodes']}: yours {got!r}, the engine took "
                    f"{m['chunks']} steps{hint}"
                )
        return True, f"equal to the engine's chunk count in all {len(measured)} measured prefills"
