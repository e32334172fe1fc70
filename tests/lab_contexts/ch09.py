"""Contexts and known wrong answers of chapter 9's exercises (``workbench/labs/ch09_tensor_parallelism.py``): tensor parallelism."""

# 9.1: the bundled model's dimensions (30 layers, hidden 576, float32) and steps of a TP run whose
# all-reduce bytes follow the engine's count, (1 + 2L) x tokens x hidden x 4
MODEL_DIMS = {"hidden_size": 576, "num_hidden_layers": 30, "dtype_bytes": 4}
STEPS_9_1 = [
    {"step": i, "num_prefill_tokens": p, "num_decode_tokens": d, "allreduce_bytes": 61 * (p + d) * 576 * 4}
    for i, (p, d) in enumerate([(171, 0), (0, 4), (0, 2), (0, 1)])
]


CONTEXTS: dict = {"9.1": {"steps": STEPS_9_1, "model": MODEL_DIMS}}
WRONG: dict = {
    "9.1": [
        lambda t, h, L, b: 2 * L * t * h * b,  # Megatron's two per layer: the embedding's all-reduce missing
        lambda t, h, L, b: (1 + 2 * L) * t * h,  # elements, not bytes
        lambda t, h, L, b: (1 + 2 * L) * t * h * b * 2 * 2 // 3,  # ring traffic on the wire at N=3, not payload
        42,
    ],
}
