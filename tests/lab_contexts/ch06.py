"""Contexts and known wrong answers of chapter 6's exercises (``workbench/labs/ch06_sharing_and_preemption.py``): sharing and preemption."""

from lab_contexts.common import STEPS

SHARING = [{"n": 4, "prefix_tokens": 40, "block_size": 16, "blocks_saved": 6}]

CONTEXTS: dict = {"6.1": {"runs": SHARING}, "6.2": {"steps": STEPS}}
WRONG: dict = {"6.1": [lambda n, p, b: n * (p // b), lambda n, p, b: (n - 1) * p / b], "6.2": [4, 0]}
