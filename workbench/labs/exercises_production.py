"""Exercises of the stage-5 chapters (production practice), registered in
:data:`workbench.labs.exercise_registry.EXERCISES`: chapter 15 (the case study), 16 (load testing),
17 (monitoring and alerting) and 18 (a performance regression baseline)."""

from __future__ import annotations

from workbench.labs.exercise_registry import _number, _register  # noqa: F401


# ---------------------------------------------------------------- chapter 15: the case study
def _gib_unused(budget: dict, kv_utilization: float) -> float:
    return budget["kv_pool_bytes"] * (1 - kv_utilization) / 2**30


@_register(
    "15.1",
    "How many GiB of one GPU's KV pool are allocated but unused at this KV utilization? (a number in GiB)",
    "the pool is preallocated at startup (kv_pool_bytes); KV utilization is token states / pool slots, so the "
    "rest of the pool holds no token state — free blocks and the empty slots of used ones.",
)
class _UnusedGiB:
    @staticmethod
    def solution(budget: dict, kv_utilization: float) -> float:
        return _gib_unused(budget, kv_utilization)

    @staticmethod
    def judge(answer, budget: dict, kv_utilization: float) -> tuple[bool, str]:
        want = _gib_unused(budget, kv_utilization)
        x = _number(answer)
        if x is None:
            return False, f"give a number of GiB, got {answer!r}"
        if abs(x - want) <= 0.01 * want:
            return True, (
                f"{want:,.1f} GiB of the {budget['kv_pool_bytes'] / 2**30:,.1f} GiB pool hold no token state: "
                "allocated at startup, unused now"
            )
        if abs(x - want * 2**30 / 1e9) <= 0.01 * want * 2**30 / 1e9:
            return False, "that is in GB (10^9 bytes); the question asks GiB (2^30 bytes)"
        used = budget["kv_pool_bytes"] * kv_utilization / 2**30
        if abs(x - used) <= 0.01 * max(used, 1e-9):
            return False, "that is the part holding token states; the question asks for the rest of the pool"
        if abs(x - want * 2**30) <= 0.01 * want * 2**30:
            return False, "that is in bytes; divide by 2**30 for GiB"
        return False, f"{answer!r} is {'too much' if x > want else 'too little'}: pool bytes × (1 − KV utilization)"


def _queue_after(rate: float, capacity: float, seconds: float) -> float:
    return max(0.0, (rate - capacity) * seconds)


@_register(
    "15.2",
    "Requests arrive at `rate` req/s and the server completes `capacity` req/s. How many requests are waiting "
    "after `seconds` seconds, starting from an empty queue? (a number of requests)",
    "every second, rate requests arrive and capacity leave; the difference piles up in the waiting queue "
    "(it cannot go below zero).",
)
class _QueueGrowth:
    @staticmethod
    def solution(rate: float, capacity: float, seconds: float) -> float:
        return _queue_after(rate, capacity, seconds)

    @staticmethod
    def judge(answer, rate: float, capacity: float, seconds: float) -> tuple[bool, str]:
        want = _queue_after(rate, capacity, seconds)
        x = _number(answer)
        if x is None:
            return False, f"give a number of requests, got {answer!r}"
        if abs(x - want) <= max(1.0, 0.02 * want):
            if want == 0:
                return True, "0: below capacity the queue does not grow; TTFT stays near the prefill time"
            return True, (
                f"about {want:,.0f} requests waiting; the last of them waits about {want / capacity:,.0f} s — "
                "TTFT grows with time, without bound, while completions stay at capacity"
            )
        if abs(x - rate * seconds) <= 0.02 * rate * seconds:
            return False, "that is every arrival; the server completes capacity requests per second meanwhile"
        if abs(x - (rate - capacity)) <= 0.02 * abs(rate - capacity) + 1e-9:
            return False, "that is the growth per second; multiply by the seconds"
        if want == 0 and x < 0:
            return False, "a queue cannot be negative: below capacity it stays empty"
        return False, f"{answer!r} is {'too many' if x > want else 'too few'}: (arrivals − completions) per second × seconds"


def _can_both(rows: list) -> set:
    return {r["hypothesis"] for r in rows if r["verdict"] == "can"}


@_register(
    "15.3",
    "From the hypothesis table's measurements, which hypotheses can produce both symptoms — TTFT rising and "
    "fewer requests finishing per second? (a set of the hypothesis names, e.g. {'preemption'})",
    "a mechanism explains the report only if its replay shows both; one that shows neither, or only one, or "
    "shows them from the first minute rather than after two hours, is not the diagnosis.",
)
class _WhichHypotheses:
    @staticmethod
    def solution(rows: list) -> set:
        return _can_both(rows)

    @staticmethod
    def judge(answer, rows: list) -> tuple[bool, str]:
        names = {r["hypothesis"] for r in rows}
        if isinstance(answer, str):
            answer = {answer}
        try:
            got = {str(a).strip().replace(" ", "_") for a in answer}
        except TypeError:
            return False, f"give a set of hypothesis names, got {answer!r}"
        unknown = got - names
        if unknown:
            return False, f"{sorted(unknown)} are not hypotheses here; the names are {sorted(names)}"
        want = _can_both(rows)
        if got == want:
            return True, f"{sorted(want)}: the only mechanism whose replay shows both symptoms"
        extra, missing = got - want, want - got
        why = {r["hypothesis"]: r["measured"] for r in rows}
        if extra:
            e = sorted(extra)[0]
            return False, f"{e} does not show both symptoms — measured: {why[e]}"
        return False, f"one is missing; look again at {sorted(missing)[0]}: {why[sorted(missing)[0]]}"


# ---------------------------------------------------------------- chapter 16: load testing
# (chapter 16's exercises go here)


# ---------------------------------------------------------------- chapter 17: monitoring and alerting
# (chapter 17's exercises go here)


# ---------------------------------------------------------------- chapter 18: a performance regression baseline
# (chapter 18's exercises go here)
