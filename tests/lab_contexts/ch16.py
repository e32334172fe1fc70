"""Contexts and known wrong answers of chapter 16's exercises (``workbench/labs/ch16_case_study.py``): the case study."""

CONTEXTS: dict = {}
WRONG: dict = {}

_BUDGET16 = {"kv_pool_bytes": 32_225 * 16 * 81_920}
_ROWS16 = [
    {"hypothesis": "fragmentation", "measured": "1.7% of used KV memory", "verdict": "cannot"},
    {"hypothesis": "queueing", "measured": "TTFT grows, completions flat", "verdict": "partly"},
    {"hypothesis": "output_length_drift", "measured": "finished/s 6.98 -> 5.87", "verdict": "can"},
    {"hypothesis": "preemption", "measured": "0 preemptions", "verdict": "cannot"},
]
CONTEXTS["16.3"] = {"budget": _BUDGET16, "kv_utilization": 0.28}
WRONG["16.3"] = [
    _BUDGET16["kv_pool_bytes"] * 0.28 / 2**30,  # the used part
    _BUDGET16["kv_pool_bytes"] * 0.72 / 1e9,  # GB, not GiB
    _BUDGET16["kv_pool_bytes"] * 0.72,  # bytes
    12,
    "lots",
]
CONTEXTS["16.1"] = {"rate": 12.0, "capacity": 9.31, "seconds": 7200.0}
WRONG["16.1"] = [12.0 * 7200, 12.0 - 9.31, 9.31 * 7200, 0, "many"]
CONTEXTS["16.2"] = {"rows": _ROWS16}
WRONG["16.2"] = [
    {"fragmentation"},
    {"queueing", "output_length_drift"},
    set(),
    {"output_length_drift", "gremlins"},
    42,
]
