"""Contexts and known wrong answers of chapter 8's exercises (``workbench/labs/ch08_chunked_prefill.py``): chunked prefill."""

import math

PREFILLS = [
    {"prompt_tokens": 500, "budget": 128, "decodes": 4, "chunks": math.ceil(500 / 124)},
    {"prompt_tokens": 450, "budget": 64, "decodes": 3, "chunks": math.ceil(450 / 61)},
    {"prompt_tokens": 300, "budget": 1024, "decodes": 0, "chunks": 1},
]

CONTEXTS: dict = {"8.1": {"measured": PREFILLS}}
WRONG: dict = {
    "8.1": [lambda p, b, d: math.ceil(p / b), lambda p, b, d: p // (b - d), 5],
}
