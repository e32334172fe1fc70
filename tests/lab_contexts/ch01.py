"""Contexts and known wrong answers of chapter 1's exercises (``workbench/labs/ch01_kv_cache_anatomy.py``): KV anatomy and the memory budget."""

from lab_contexts.common import MEMORY

CONTEXTS: dict = {"1.1": {}, "1.2": {}, "1.3": {"memory": MEMORY}}
WRONG: dict = {
    "1.1": [800, 409_600, 20_480, "819200"],
    "1.2": [
        lambda c, b: (
            2 * c["num_hidden_layers"] * c["num_attention_heads"] * (c["hidden_size"] // c["num_attention_heads"]) * b
        )
    ],
    "1.3": [MEMORY["kv_pool_tokens"] / 4096, 3],
}
