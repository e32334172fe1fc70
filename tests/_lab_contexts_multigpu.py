"""Contexts and known wrong answers of the exercises of chapters 9 and 10 (tensor parallelism; NCCL buffer tuning), for tests/test_labs.py."""

CONTEXTS: dict = {}
WRONG: dict = {}
