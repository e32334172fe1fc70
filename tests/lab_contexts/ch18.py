"""Contexts and known wrong answers of chapter 18's exercises (``workbench/labs/ch18_monitoring_and_alerting.py``): monitoring and alerting."""

CONTEXTS: dict = {}
WRONG: dict = {}

_BUCKETS18 = [(0.1, 2.0), (0.25, 10.0), (0.5, 30.0), (1.0, 38.0), (2.5, 40.0), (float("inf"), 40.0)]
CONTEXTS["18.1"] = {"buckets": _BUCKETS18}


def _upper_bound(q, buckets):  # the bucket's upper bound, no interpolation
    total = buckets[-1][1]
    return next(le for le, c in buckets if c >= q * total)


def _from_zero(q, buckets):  # interpolates from 0 in every bucket
    total = buckets[-1][1]
    le, c = next((le, c) for le, c in buckets if c >= q * total)
    return le * q * total / c


WRONG["18.1"] = [_upper_bound, _from_zero, lambda q, b: 0.5, 0.5]
_SAMPLES18 = [0, 2, 12, 14, 9, 15, 16, 18, 19, 20, 4]
CONTEXTS["18.2"] = {"samples": _SAMPLES18, "threshold": 10, "for_s": 3, "interval_s": 1.0}
WRONG["18.2"] = [2, 5, 7, None, "8", 9]
