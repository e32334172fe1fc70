"""Contexts and known wrong answers of the stage-5 chapters' exercises (chapters 15-18, production practice),
for tests/test_labs.py."""

CONTEXTS: dict = {}
WRONG: dict = {}

# ---------------------------------------------------------------- chapter 15: the case study
_BUDGET15 = {"kv_pool_bytes": 32_225 * 16 * 81_920}
_ROWS15 = [
    {"hypothesis": "fragmentation", "measured": "1.7% of used KV memory", "verdict": "cannot"},
    {"hypothesis": "queueing", "measured": "TTFT grows, completions flat", "verdict": "partly"},
    {"hypothesis": "output_length_drift", "measured": "finished/s 6.98 -> 5.87", "verdict": "can"},
    {"hypothesis": "preemption", "measured": "0 preemptions", "verdict": "cannot"},
]
CONTEXTS["15.3"] = {"budget": _BUDGET15, "kv_utilization": 0.28}
WRONG["15.3"] = [
    _BUDGET15["kv_pool_bytes"] * 0.28 / 2**30,  # the used part
    _BUDGET15["kv_pool_bytes"] * 0.72 / 1e9,  # GB, not GiB
    _BUDGET15["kv_pool_bytes"] * 0.72,  # bytes
    12,
    "lots",
]
CONTEXTS["15.1"] = {"rate": 12.0, "capacity": 9.31, "seconds": 7200.0}
WRONG["15.1"] = [12.0 * 7200, 12.0 - 9.31, 9.31 * 7200, 0, "many"]
CONTEXTS["15.2"] = {"rows": _ROWS15}
WRONG["15.2"] = [
    {"fragmentation"},
    {"queueing", "output_length_drift"},
    set(),
    {"output_length_drift", "gremlins"},
    42,
]

# ---------------------------------------------------------------- chapter 16: load testing
_ROWS16 = [
    {"offered": 0.8, "achieved": 0.74},
    {"offered": 1.3, "achieved": 1.12},
    {"offered": 1.9, "achieved": 1.41},
    {"offered": 3.2, "achieved": 1.55},
]
CONTEXTS["16.1"] = {"rows": _ROWS16, "frac": 0.8}
WRONG["16.1"] = [3.2, 1.3, 1.41, 0.8, None, "knee"]
_TTFTS16 = [0.21, 0.35, 0.9, 0.25, None, 0.3, 1.4, 0.28]
_TPOTS16 = [0.09, 0.2, 0.1, 0.11, None, 0.08, 0.1, None]
CONTEXTS["16.2"] = {"ttfts": _TTFTS16, "tpots": _TPOTS16, "slo_ttft_s": 0.5, "slo_tpot_s": 0.15}
WRONG["16.2"] = [5 / 8, 6 / 8, 4, 50, 1.0, "most"]  # TTFT only, TPOT only, a count, a percentage

# ---------------------------------------------------------------- chapter 17: monitoring and alerting
_BUCKETS17 = [(0.1, 2.0), (0.25, 10.0), (0.5, 30.0), (1.0, 38.0), (2.5, 40.0), (float("inf"), 40.0)]
CONTEXTS["17.1"] = {"buckets": _BUCKETS17}


def _upper_bound(q, buckets):  # the bucket's upper bound, no interpolation
    total = buckets[-1][1]
    return next(le for le, c in buckets if c >= q * total)


def _from_zero(q, buckets):  # interpolates from 0 in every bucket
    total = buckets[-1][1]
    le, c = next((le, c) for le, c in buckets if c >= q * total)
    return le * q * total / c


WRONG["17.1"] = [_upper_bound, _from_zero, lambda q, b: 0.5, 0.5]
_SAMPLES17 = [0, 2, 12, 14, 9, 15, 16, 18, 19, 20, 4]
CONTEXTS["17.2"] = {"samples": _SAMPLES17, "threshold": 10, "for_s": 3, "interval_s": 1.0}
WRONG["17.2"] = [2, 5, 7, None, "8", 9]


# ---------------------------------------------------------------- chapter 18: a performance regression baseline
def _row18(key, gated, verdict, metric=None):
    return {"key": key, "metric": metric or key, "gated": gated, "verdict": verdict}


_CASES18 = [
    {"baseline": [1.0, 1.0, 1.0], "new": [1.3, 1.3, 1.3], "higher_is_better": False},  # latency up 30%
    {"baseline": [1.0, 1.0, 1.0], "new": [1.1, 1.1, 9.0], "higher_is_better": False},  # one outlier: mean 3.7x
    {"baseline": [10.0, 10.0, 10.0], "new": [7.0, 7.5, 7.9], "higher_is_better": True},  # throughput -25%
    {"baseline": [10.0, 10.0, 10.0], "new": [13.0, 13.0, 13.0], "higher_is_better": True},  # +30%: improved
    {"baseline": [1.0, 1.0, 1.0], "new": [0.8, 0.8, 0.8], "higher_is_better": False},  # 0.8x < 1/1.2: improved
    {"baseline": [10.0, 10.0, 10.0], "new": [8.5, 8.5, 8.5], "higher_is_better": True},  # within the limit: ok
]
CONTEXTS["18.1"] = {"cases": _CASES18}


def _mean_verdict(b, n, hib):  # means instead of medians: the outlier case fails it
    r = (sum(n) / len(n)) / (sum(b) / len(b))
    return ("regressed" if r < 0.8 else "improved" if r > 1.25 else "ok") if hib else (
        "regressed" if r > 1.2 else "improved" if r < 1 / 1.2 else "ok"
    )


def _no_direction(b, n, hib):  # every metric as a latency
    r = sorted(n)[1] / sorted(b)[1]
    return "regressed" if r > 1.2 else "improved" if r < 1 / 1.2 else "ok"


WRONG["18.1"] = [_mean_verdict, _no_direction, lambda b, n, hib: "ok", "regressed"]
_ROWS18 = [
    _row18("output_throughput_tok_s", True, "regressed", "output throughput"),
    _row18("ttft_p50_s", True, "regressed", "TTFT median"),
    _row18("ttft_p99_s", False, "not gated", "TTFT p99"),
    _row18("tpot_p50_s", True, "ok", "TPOT median"),
]
CONTEXTS["18.2"] = {"rows": _ROWS18}
WRONG["18.2"] = [{"ttft_p50_s"}, {"ttft_p50_s", "output_throughput_tok_s", "ttft_p99_s"}, {"nonsense"}, 3]
