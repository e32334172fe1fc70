"""Contexts and known wrong answers of the exercises of chapters 7 and 8 (the parameter matrix; chunked prefill), for tests/test_labs.py."""

CONTEXTS: dict = {}
WRONG: dict = {}
