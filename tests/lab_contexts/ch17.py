"""Contexts and known wrong answers of chapter 17's exercises (``workbench/labs/ch17_load_testing.py``): load testing."""

CONTEXTS: dict = {}
WRONG: dict = {}

_ROWS17 = [
    {"offered": 0.8, "achieved": 0.74},
    {"offered": 1.3, "achieved": 1.12},
    {"offered": 1.9, "achieved": 1.41},
    {"offered": 3.2, "achieved": 1.55},
]
CONTEXTS["17.1"] = {"rows": _ROWS17, "frac": 0.8}
WRONG["17.1"] = [3.2, 1.3, 1.41, 0.8, None, "knee"]
_TTFTS17 = [0.21, 0.35, 0.9, 0.25, None, 0.3, 1.4, 0.28]
_TPOTS17 = [0.09, 0.2, 0.1, 0.11, None, 0.08, 0.1, None]
CONTEXTS["17.2"] = {"ttfts": _TTFTS17, "tpots": _TPOTS17, "slo_ttft_s": 0.5, "slo_tpot_s": 0.15}
WRONG["17.2"] = [5 / 8, 6 / 8, 4, 50, 1.0, "most"]  # TTFT only, TPOT only, a count, a percentage
