"""Contexts and known wrong answers of the exercises of chapters 9 and 10 (tensor parallelism; NCCL buffer tuning), for tests/test_labs.py."""

# 9.1: the bundled model's dimensions (30 layers, hidden 576, float32) and steps of a TP run whose
# all-reduce bytes follow the engine's count, (1 + 2L) x tokens x hidden x 4
MODEL_DIMS = {"hidden_size": 576, "num_hidden_layers": 30, "dtype_bytes": 4}
STEPS_9_1 = [
    {"step": i, "num_prefill_tokens": p, "num_decode_tokens": d, "allreduce_bytes": 61 * (p + d) * 576 * 4}
    for i, (p, d) in enumerate([(171, 0), (0, 4), (0, 2), (0, 1)])
]

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

CONTEXTS: dict = {
    "9.1": {"steps": STEPS_9_1, "model": MODEL_DIMS},
    "10.1": EX_10_1,
}
WRONG: dict = {
    "9.1": [
        lambda t, h, L, b: 2 * L * t * h * b,  # Megatron's two per layer: the embedding's all-reduce missing
        lambda t, h, L, b: (1 + 2 * L) * t * h,  # elements, not bytes
        lambda t, h, L, b: (1 + 2 * L) * t * h * b * 2 * 2 // 3,  # ring traffic on the wire at N=3, not payload
        42,
    ],
    "10.1": [
        331_874_304,  # the buffers' bytes
        253,  # buffers // block_bytes: ignores the part-block already left over
        153,  # NCCL_BUFFSIZE alone (Simple), no LL / LL128
        254 * 4,  # the whole group's
        "254",
    ],
}
