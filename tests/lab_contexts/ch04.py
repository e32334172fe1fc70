"""Contexts and known wrong answers of chapter 4's exercises (``workbench/labs/ch04_paged_attention_inside.py``): PagedAttention inside."""

BATCH = [
    {"request_id": "a", "block_table": [7, 2, 9], "block_size": 16, "positions": [0, 17, 35], "slots": [112, 33, 147]},
    {"request_id": "b", "block_table": [4], "block_size": 16, "positions": [5], "slots": [69]},
]

CONTEXTS: dict = {"4.1": {"batch": BATCH}, "4.2": {}}
WRONG: dict = {"4.1": [lambda t, b, p: t[p // b] + p % b], "4.2": [2, 16]}
