"""Contexts and known wrong answers of chapter 10's exercises (``workbench/labs/ch10_nccl_buffers.py``): NCCL buffers."""

# 10.1: Llama-2-70B on 4 x H100-80GB, 24 channels of 8 MiB + LL + LL128 (workbench.labs.ch10_nccl_buffers.buffer_exercise;
# tests/test_labs_multigpu.py checks these figures against the simulated engine)
EX_10_1 = {
    "config": {
        "model": "llama-2-70b",
        "gpu": "H100-80GB",
        "tensor_parallel_size": 4,
        "nccl_buffsize": 8 << 20,
        "nchannels": 24,
        "nccl_proto": "LL,LL128,Simple",
        "block_size": 16,
    },
    "budget": {"kv_budget_bytes": 42_257_858_560, "block_bytes": 1_310_720, "num_blocks": 32_240},
    "engine_num_blocks": 31_986,
}


CONTEXTS: dict = {"10.1": EX_10_1}
WRONG: dict = {
    "10.1": [
        331_874_304,  # the buffers' bytes
        253,  # buffers // block_bytes: ignores the part-block already left over
        153,  # NCCL_BUFFSIZE alone (Simple), no LL / LL128
        254 * 4,  # the whole group's
        "254",
    ],
}
