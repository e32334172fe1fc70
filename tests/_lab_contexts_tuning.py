"""Contexts and known wrong answers of the exercises of chapters 7 and 8 (the parameter matrix; chunked prefill), for tests/test_labs.py."""

import math


def _row(n: int, throughput: float | None, ttft: float | None, error: str | None = None) -> dict:
    return {
        "label": f"max_num_seqs={n}",
        "config": {"max_num_seqs": n},
        "error": error,
        "output_throughput_tok_s": throughput,
        "ttft_p99_s": ttft,
    }


SWEEP_ROWS = [
    _row(4, 10.0, 1.0),
    _row(8, 20.0, 3.0),
    _row(16, 30.0, 5.0),
    _row(32, None, None, error="not enough memory for the KV cache"),
]
PREFILLS = [
    {"prompt_tokens": 500, "budget": 128, "decodes": 4, "chunks": math.ceil(500 / 124)},
    {"prompt_tokens": 450, "budget": 64, "decodes": 3, "chunks": math.ceil(450 / 61)},
    {"prompt_tokens": 300, "budget": 1024, "decodes": 0, "chunks": 1},
]

CONTEXTS: dict = {
    "7.1": {"rows": SWEEP_ROWS, "ttft_p99_target_s": 3.5},
    "8.1": {"measured": PREFILLS},
}
WRONG: dict = {
    "7.1": [
        SWEEP_ROWS[2]["config"],  # the most throughput, but it misses the target
        0,  # meets the target with less throughput
        "max_num_seqs=32",  # refused
        None,
        {"max_num_seqs": 99},
        "nonsense",
        {"max_num_seqs": 8, "block_size": 32},  # an argument the row did not have
    ],
    "8.1": [lambda p, b, d: math.ceil(p / b), lambda p, b, d: p // (b - d), 5],
}
