"""Contexts and known wrong answers of chapter 11's exercises (``workbench/labs/ch11_load_balancing.py``): load
balancing across replicas."""

CONTEXTS: dict = {}
WRONG: dict = {}

_ROWS11 = [
    {"policy": "round_robin", "workload": "multi-tenant", "hit_rate": 0.55, "ttft_p99": 2500.0},
    {"policy": "power_of_two", "workload": "multi-tenant", "hit_rate": 0.58, "ttft_p99": 900.0},
    {"policy": "cache_aware", "workload": "multi-tenant", "hit_rate": 0.71, "ttft_p99": 1200.0},
    {"policy": "kv_aware", "workload": "multi-tenant", "hit_rate": 0.70, "ttft_p99": 1300.0},
    {"policy": "round_robin", "workload": "skewed", "hit_rate": 0.0, "ttft_p99": 2540.0},
    {"policy": "power_of_two", "workload": "skewed", "hit_rate": 0.0, "ttft_p99": 1960.0},
]
CONTEXTS["11.1"] = {"rows": _ROWS11}
WRONG["11.1"] = ["round_robin", "power_of_two", "fastest", 0.71, None]
CONTEXTS["11.2"] = {"usages": [0.6, 0.2, 0.1]}
WRONG["11.2"] = [6.0, 0.5, 0.6, 1.0, "3"]  # max/min, a difference, the largest usage, even
CONTEXTS["11.3"] = {"rows": _ROWS11}
WRONG["11.3"] = ["round_robin", "cache_aware", 1960.0, None]  # the slower one; not run on skewed; a number
_LAYOUTS11 = [
    {"layout": "llama-2-70b: 1 × TP8", "gpus": 8, "kv_gib": 55.4, "weights_gib": 16.1, "split": [89]},
    {"layout": "llama-2-70b: 2 × TP4, round_robin", "gpus": 8, "kv_gib": 39.4, "weights_gib": 32.1, "split": [45, 44]},
]
CONTEXTS["11.4"] = {"rows": _LAYOUTS11, "layout": "llama-2-70b: 2 × TP4, round_robin"}
WRONG["11.4"] = [39.4, 78.8, 443.2, "lots", None]  # one rank, one rank per replica, the TP8 layout's total
