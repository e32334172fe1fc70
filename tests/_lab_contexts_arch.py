"""Contexts and known wrong answers of the stage-4 chapters' exercises (chapter 14: memory beside the KV
cache), for tests/test_labs.py."""

# 14.1: Llama-2-70B on 8 x H100-80GB, block_size 16 (workbench.labs.rank_memory.custom_ar_exercise;
# tests/test_labs_arch.py checks these figures against the simulated engine)
EX_14_1 = {
    "config": {"model": "llama-2-70b", "gpu": "H100-80GB", "tensor_parallel_size": 8, "block_size": 16},
    "budget": {"kv_budget_bytes": 59_325_134_336, "block_bytes": 655_360, "num_blocks": 90_522},
    "engine_num_blocks": 90_561,
}

CONTEXTS: dict = {"14.1": EX_14_1}
WRONG: dict = {
    "14.1": [
        25_168_384,  # the buffers' bytes
        38,  # buffers // block_bytes: ignores the part-block already left over
        26,  # the two IPC buffers only, no rank_data
        39 * 8,  # the whole group's
        "39",
    ],
}

# 11.1: the learner's allocator class, through the conformance check (workbench.labs.own_allocator)
from workbench.labs.own_allocator import EXERCISE_CONTEXT as _EX_11_1  # noqa: E402
from workbench.labs.own_allocator import DoubleHandNextFit as _DoubleHand  # noqa: E402
from workbench.labs.own_allocator import LeakyNextFit as _Leaky  # noqa: E402

CONTEXTS["11.1"] = dict(_EX_11_1)
WRONG["11.1"] = [_Leaky, _DoubleHand, "next-fit", dict]
