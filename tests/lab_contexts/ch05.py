"""Contexts and known wrong answers of chapter 5's exercises (``workbench/labs/ch05_batching_strategies.py``): batching strategies."""

from workbench.labs.ch05_batching_strategies import spread_lengths

CONTEXTS: dict = {"5.1": {"lengths": spread_lengths(16, 128, 2048)}}
WRONG: dict = {"5.1": [37.5, 0.58]}
