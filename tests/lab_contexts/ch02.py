"""Contexts and known wrong answers of chapter 2's exercises (``workbench/labs/ch02_fragmentation_live.py``): fragmentation."""

from lab_contexts.common import STEPS

ROWS = [
    {"run": "paged", "external_fragmentation": 0.0},
    {"run": "orca-pow2", "external_fragmentation": 0.12},
    {"run": "static", "external_fragmentation": 0.01},
]
CASES = [
    {"prompt_len": 47, "true_len": 30, "max_tokens": 96, "max_model_len": 256},
    {"prompt_len": 136, "true_len": 5, "max_tokens": 96, "max_model_len": 256},
    {"prompt_len": 200, "true_len": 17, "max_tokens": 96, "max_model_len": 256},  # orca-max capped by max_model_len
]

CONTEXTS: dict = {"2.1": {"steps": STEPS}, "2.2": {"rows": ROWS}, "2.3": {"cases": CASES}}
WRONG: dict = {
    "2.1": [lambda s: (s["reservation"] + s["internal_fragmentation"]) / (s["num_blocks"] * s["block_size"])],
    "2.2": ["paged", "static", "nonsense"],
    "2.3": [
        lambda a, p, t, m, ml: ml if a == "static" else p + m,  # every orca reserves the cap
        lambda a, p, t, m, ml: {"static": ml, "orca-max": p + m}.get(a, p + t),  # orca-max not capped, pow2 = oracle
        lambda a, p, t, m, ml: {"static": ml, "orca-max": min(p + m, ml), "orca-pow2": p + 2 * t}.get(a, p + t),
    ],
}
