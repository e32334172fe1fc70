"""Exercises of the stage-5 chapters (production practice), registered in
:data:`workbench.labs.exercise_registry.EXERCISES`: chapter 15 (the case study), 16 (load testing),
17 (monitoring and alerting) and 18 (a performance regression baseline)."""

from __future__ import annotations

from workbench.labs.exercise_registry import _number, _register  # noqa: F401


# ---------------------------------------------------------------- chapter 15: the case study
def _gib_unused(budget: dict, kv_utilization: float) -> float:
    return budget["kv_pool_bytes"] * (1 - kv_utilization) / 2**30


@_register(
    "15.3",
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
    "15.1",
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
    "15.2",
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
def _knee16(rows: list, frac: float) -> float | None:
    from workbench.labs.ch16_load_testing import knee

    return knee(rows, frac)


@_register(
    "16.1",
    "From the sweep's rows (offered and achieved req/s), which offered rate is the knee — the lowest offered rate "
    "whose achieved throughput is below `frac` of it? (a rate in req/s, or None if the server kept up everywhere)",
    "sort the rows by offered rate; the first one with achieved < frac × offered is where completions stop "
    "keeping up with arrivals and the waiting queue grows.",
)
class _Knee:
    @staticmethod
    def solution(rows: list, frac: float) -> float | None:
        return _knee16(rows, frac)

    @staticmethod
    def judge(answer, rows: list, frac: float) -> tuple[bool, str]:
        want = _knee16(rows, frac)
        if want is None:
            if answer is None:
                return True, "None: the server kept up at every offered rate; sweep higher to find the knee"
            return False, f"at every rate achieved ≥ {frac} × offered: the answer is None"
        if answer is None:
            return False, "one row has achieved below frac × offered: look again"
        x = _number(answer)
        if x is None:
            return False, f"give an offered rate in req/s, got {answer!r}"
        if abs(x - want) <= 0.01 * want:
            r = next(r for r in rows if r["offered"] == want)
            return True, (
                f"{want:.2f} req/s offered, {r['achieved']:.2f} req/s achieved: from here on requests arrive "
                "faster than they finish"
            )
        for r in rows:
            if abs(x - r["achieved"]) <= 0.01 * max(r["achieved"], 1e-9):
                return False, "that is an achieved rate; the question asks for the offered rate at the knee"
        if any(abs(x - r["offered"]) <= 0.01 * r["offered"] for r in rows):
            if x > want:
                return False, "a lower offered rate already falls below frac × offered: take the lowest"
            return False, f"at {x:.2f} req/s the server still achieves at least {frac} × offered"
        return False, f"{answer!r} is not one of the offered rates {sorted(r['offered'] for r in rows)}"


def _good16(ttfts: list, tpots: list, slo_ttft_s: float, slo_tpot_s: float) -> float:
    from workbench.labs.ch16_load_testing import goodput_fraction

    return goodput_fraction(ttfts, tpots, slo_ttft_s, slo_tpot_s)


@_register(
    "16.2",
    "Per-request TTFT and TPOT (seconds) and an SLO: what fraction of the requests met it? (a number from 0 to 1)",
    "a request is good only if its TTFT ≤ slo_ttft_s AND its TPOT ≤ slo_tpot_s (a TPOT of None — one output "
    "token — meets the TPOT part; a TTFT of None is a failed request); divide the good ones by all requests.",
)
class _GoodFraction:
    @staticmethod
    def solution(ttfts: list, tpots: list, slo_ttft_s: float, slo_tpot_s: float) -> float:
        return _good16(ttfts, tpots, slo_ttft_s, slo_tpot_s)

    @staticmethod
    def judge(answer, ttfts: list, tpots: list, slo_ttft_s: float, slo_tpot_s: float) -> tuple[bool, str]:
        want = _good16(ttfts, tpots, slo_ttft_s, slo_tpot_s)
        n = len(ttfts)
        x = _number(answer)
        if x is None:
            return False, f"give a fraction from 0 to 1, got {answer!r}"
        if abs(x - want) <= 0.005:
            return True, f"{want:.3f}: {round(want * n)} of {n} requests met both the TTFT and the TPOT target"
        if abs(x - 100 * want) <= 0.5 and want > 0.01:
            return False, "that is a percentage; give the fraction (0 to 1)"
        if abs(x - want * n) <= 0.5 and n > 1:
            return False, "that is the number of good requests; divide by all requests"
        only_ttft = sum(1 for a in ttfts if a is not None and a <= slo_ttft_s) / max(n, 1)
        only_tpot = sum(1 for a, b in zip(ttfts, tpots) if a is not None and (b is None or b <= slo_tpot_s)) / max(n, 1)
        if abs(x - only_ttft) <= 0.005:
            return False, "that counts TTFT only; a good request must also meet the TPOT target"
        if abs(x - only_tpot) <= 0.005:
            return False, "that counts TPOT only; a good request must also meet the TTFT target"
        return False, f"{answer!r} is {'too high' if x > want else 'too low'}: good = both targets met"


# ---------------------------------------------------------------- chapter 17: monitoring and alerting
def _hq(q: float, buckets: list) -> float:
    """Prometheus' histogram_quantile on cumulative (le, count) buckets: linear inside the bucket the rank falls in;
    the +Inf bucket answers the largest finite bound (promql/quantile.go)."""
    bs = sorted((float(le), float(c)) for le, c in buckets)
    total = bs[-1][1]
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in bs:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


@_register(
    "17.1",
    "Write histogram_quantile(q, buckets) as Prometheus computes it: buckets are cumulative (le, count) pairs of a "
    "histogram (the last le is +Inf); return the q-quantile in the buckets' unit. The answer is the function.",
    "rank = q x the +Inf bucket's count; find the first bucket whose count reaches the rank; interpolate linearly "
    "between the previous bucket's bound (0 for the first) and this one's; in the +Inf bucket answer the largest "
    "finite bound.",
)
class _HistogramQuantile:
    @staticmethod
    def solution(buckets: list):
        return _hq

    @staticmethod
    def judge(answer, buckets: list) -> tuple[bool, str]:
        import math

        quantiles = (0.5, 0.9, 0.99)
        if not callable(answer):
            return False, f"give a function histogram_quantile(q, buckets), got {answer!r}"
        for q in quantiles:
            want = _hq(q, buckets)
            try:
                got = float(answer(q, [tuple(b) for b in buckets]))
            except Exception as e:  # noqa: BLE001 - the learner's code
                return False, f"histogram_quantile({q}, ...) raised {type(e).__name__}: {e}"
            if not (math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(got) and math.isnan(want))):
                return False, (
                    f"histogram_quantile({q}) = {got:.6g}, Prometheus says {want:.6g}; interpolate inside the bucket "
                    "the rank falls in, from the previous bucket's bound"
                )
        return True, f"matches Prometheus at q = {', '.join(map(str, quantiles))} on these buckets"


def _fires_at(samples: list, threshold: float, for_s: float, interval_s: float):
    import math

    need = math.ceil(for_s / interval_s - 1e-9)
    start = None
    for i, v in enumerate(samples):
        if v is not None and v > threshold:
            start = i if start is None else start
            if i - start >= need:
                return i
        else:
            start = None
    return None


@_register(
    "17.2",
    "A rule `expr: waiting > threshold` with `for: for_s` is evaluated once per sample (every interval_s seconds). "
    "At which sample index does it first fire? (an index into samples, or None if it never fires)",
    "the alert goes pending at the first evaluation where the condition holds and fires at the first later "
    "evaluation at least for_s after that; a false evaluation in between resets it.",
)
class _FiresAt:
    @staticmethod
    def solution(samples: list, threshold: float, for_s: float, interval_s: float):
        return _fires_at(samples, threshold, for_s, interval_s)

    @staticmethod
    def judge(answer, samples: list, threshold: float, for_s: float, interval_s: float) -> tuple[bool, str]:
        want = _fires_at(samples, threshold, for_s, interval_s)
        if answer is None or want is None:
            ok = answer is None and want is None
            if ok:
                return True, "None: the condition never holds for long enough"
            if answer is None:
                return False, f"it does fire: look for a run of samples above {threshold} lasting {for_s} s"
            return False, f"it never fires: no run of samples above {threshold} lasts {for_s} s"
        if isinstance(answer, bool) or not isinstance(answer, int):
            return False, f"give a sample index (an int) or None, got {answer!r}"
        if answer == want:
            return (
                True,
                f"sample {want}: pending at sample {want - math_ceil(for_s / interval_s)}, firing {for_s} s later",
            )
        first = next((i for i, v in enumerate(samples) if v is not None and v > threshold), None)
        if answer == first:
            return False, "that is where it goes pending; it fires only once the condition has held for for_s"
        return False, f"{answer} is {'too late' if answer > want else 'too early'}"


def math_ceil(x: float) -> int:
    import math

    return math.ceil(x - 1e-9)


# ---------------------------------------------------------------- chapter 18: a performance regression baseline
def _verdict18(baseline: list, new: list, higher_is_better: bool) -> str:
    import statistics

    ratio = statistics.median(new) / statistics.median(baseline)
    if higher_is_better:
        return "regressed" if ratio < 0.80 else "improved" if ratio > 1 / 0.80 else "ok"
    return "regressed" if ratio > 1.20 else "improved" if ratio < 1 / 1.20 else "ok"


@_register(
    "18.1",
    "Write verdict(baseline, new, higher_is_better) -> 'regressed' | 'improved' | 'ok' for one metric: baseline and "
    "new are lists of repeats; compare their medians with the dashboard's limits (a latency regressed above 1.20x "
    "the baseline, a throughput below 0.80x; improved beyond the inverse limits). The answer is the function.",
    "ratio = median(new) / median(baseline); for a latency (higher_is_better False) above 1.20 is regressed, below "
    "1/1.20 improved; for a throughput below 0.80 is regressed, above 1/0.80 improved.",
)
class _Verdict:
    @staticmethod
    def solution(cases: list):
        return _verdict18

    @staticmethod
    def judge(answer, cases: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function verdict(baseline, new, higher_is_better), got {answer!r}"
        for c in cases:
            want = _verdict18(c["baseline"], c["new"], c["higher_is_better"])
            try:
                got = answer(list(c["baseline"]), list(c["new"]), c["higher_is_better"])
            except Exception as e:  # noqa: BLE001 - the learner's code: any error is a wrong answer
                return False, f"verdict raised {type(e).__name__}: {e} on {c}"
            if got != want:
                return False, (
                    f"on baseline {c['baseline']}, new {c['new']}, higher_is_better={c['higher_is_better']}: got "
                    f"{got!r}, want {want!r} (medians, not means: one outlier repeat must not move the verdict)"
                )
        return True, f"all {len(cases)} cases right: medians over repeats, limits 1.20x / 0.80x"


def _regressed18(rows: list) -> set:
    return {r["key"] for r in rows if r["gated"] and r["verdict"] == "regressed"}


@_register(
    "18.2",
    "From this comparison's rows, which gated metrics regressed? (a set of metric keys, e.g. {'ttft_p50_s'})",
    "look at the rows whose 'gated' is True and whose 'verdict' is 'regressed'; tail percentiles are not gated.",
)
class _WhichRegressed:
    @staticmethod
    def solution(rows: list) -> set:
        return _regressed18(rows)

    @staticmethod
    def judge(answer, rows: list) -> tuple[bool, str]:
        if isinstance(answer, str):
            answer = {answer}
        try:
            got = {str(a) for a in answer}
        except TypeError:
            return False, f"give a set of metric keys, got {answer!r}"
        labels = {r["metric"]: r["key"] for r in rows}
        got = {labels.get(a, a) for a in got}  # a label ('TTFT median') counts as its key
        keys = {r["key"] for r in rows}
        if got - keys:
            return False, f"{sorted(got - keys)} are not metrics of this report; its keys are {sorted(keys)}"
        want = _regressed18(rows)
        if got == want:
            return True, f"{sorted(want)}: the gated metrics past their limit"
        ungated = {r["key"] for r in rows if not r["gated"]} & got
        if ungated:
            return False, f"{sorted(ungated)} are tail percentiles: reported, not gated"
        return False, f"not quite: {len(want)} gated metric(s) regressed; compare each ratio with its limit"
