"""Exercises of chapters 7 and 8 (the parameter matrix; chunked prefill), registered in
:data:`workbench.labs.exercise_registry.EXERCISES`."""

from __future__ import annotations

import math
from collections.abc import Callable

from workbench.labs.exercise_registry import _number, _register


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
