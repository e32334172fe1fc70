"""Contexts and known wrong answers of chapter 19's exercises (``workbench/labs/ch19_regression_baseline.py``): a performance regression baseline."""

CONTEXTS: dict = {}
WRONG: dict = {}


def _row19(key, gated, verdict, metric=None):
    return {"key": key, "metric": metric or key, "gated": gated, "verdict": verdict}


_CASES19 = [
    {"baseline": [1.0, 1.0, 1.0], "new": [1.3, 1.3, 1.3], "higher_is_better": False},  # latency up 30%
    {"baseline": [1.0, 1.0, 1.0], "new": [1.1, 1.1, 9.0], "higher_is_better": False},  # one outlier: mean 3.7x
    {"baseline": [10.0, 10.0, 10.0], "new": [7.0, 7.5, 7.9], "higher_is_better": True},  # throughput -25%
    {"baseline": [10.0, 10.0, 10.0], "new": [13.0, 13.0, 13.0], "higher_is_better": True},  # +30%: improved
    {"baseline": [1.0, 1.0, 1.0], "new": [0.8, 0.8, 0.8], "higher_is_better": False},  # 0.8x < 1/1.2: improved
    {"baseline": [10.0, 10.0, 10.0], "new": [8.5, 8.5, 8.5], "higher_is_better": True},  # within the limit: ok
]
CONTEXTS["19.1"] = {"cases": _CASES19}


def _mean_verdict(b, n, hib):  # means instead of medians: the outlier case fails it
    r = (sum(n) / len(n)) / (sum(b) / len(b))
    return (
        ("regressed" if r < 0.8 else "improved" if r > 1.25 else "ok")
        if hib
        else ("regressed" if r > 1.2 else "improved" if r < 1 / 1.2 else "ok")
    )


def _no_direction(b, n, hib):  # every metric as a latency
    r = sorted(n)[1] / sorted(b)[1]
    return "regressed" if r > 1.2 else "improved" if r < 1 / 1.2 else "ok"


WRONG["19.1"] = [_mean_verdict, _no_direction, lambda b, n, hib: "ok", "regressed"]
_ROWS19 = [
    _row19("output_throughput_tok_s", True, "regressed", "output throughput"),
    _row19("ttft_p50_s", True, "regressed", "TTFT median"),
    _row19("ttft_p99_s", False, "not gated", "TTFT p99"),
    _row19("tpot_p50_s", True, "ok", "TPOT median"),
]
CONTEXTS["19.2"] = {"rows": _ROWS19}
WRONG["19.2"] = [{"ttft_p50_s"}, {"ttft_p50_s", "output_throughput_tok_s", "ttft_p99_s"}, {"nonsense"}, 3]
