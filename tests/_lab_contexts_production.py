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
CONTEXTS["15.1"] = {"budget": _BUDGET15, "kv_utilization": 0.28}
WRONG["15.1"] = [
    _BUDGET15["kv_pool_bytes"] * 0.28 / 2**30,  # the used part
    _BUDGET15["kv_pool_bytes"] * 0.72 / 1e9,  # GB, not GiB
    _BUDGET15["kv_pool_bytes"] * 0.72,  # bytes
    12,
    "lots",
]
CONTEXTS["15.2"] = {"rate": 12.0, "capacity": 9.31, "seconds": 7200.0}
WRONG["15.2"] = [12.0 * 7200, 12.0 - 9.31, 9.31 * 7200, 0, "many"]
CONTEXTS["15.3"] = {"rows": _ROWS15}
WRONG["15.3"] = [
    {"fragmentation"},
    {"queueing", "output_length_drift"},
    set(),
    {"output_length_drift", "gremlins"},
    42,
]

# ---------------------------------------------------------------- chapter 16: load testing
# (chapter 16's contexts go here)

# ---------------------------------------------------------------- chapter 17: monitoring and alerting
# (chapter 17's contexts go here)

# ---------------------------------------------------------------- chapter 18: a performance regression baseline
# (chapter 18's contexts go here)
