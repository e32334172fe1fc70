"""Contexts and known wrong answers of chapter 7's exercises (``workbench/labs/ch07_parameter_matrix.py``): the parameter matrix."""


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

CONTEXTS: dict = {"7.1": {"rows": SWEEP_ROWS, "ttft_p99_target_s": 3.5}}
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
}
