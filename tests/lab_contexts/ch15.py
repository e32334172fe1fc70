"""Contexts and known wrong answers of chapter 15's exercises (``workbench/labs/ch15_memory_beside_kv.py``): memory beside the KV cache."""

# 15.1: Llama-2-70B on 8 x H100-80GB, block_size 16 (workbench.labs.ch15_memory_beside_kv.custom_ar_exercise;
# tests/test_labs_arch.py checks these figures against the simulated engine)
EX_15_1 = {
    "config": {"model": "llama-2-70b", "gpu": "H100-80GB", "tensor_parallel_size": 8, "block_size": 16},
    "budget": {"kv_budget_bytes": 59_325_134_336, "block_bytes": 655_360, "num_blocks": 90_522},
    "engine_num_blocks": 90_561,
}

CONTEXTS: dict = {"15.1": EX_15_1}
WRONG: dict = {
    "15.1": [
        25_168_384,  # the buffers' bytes
        38,  # buffers // block_bytes: ignores the part-block already left over
        26,  # the two IPC buffers only, no rank_data
        39 * 8,  # the whole group's
        "39",
    ],
}
