"""Contexts and known wrong answers of the stage-4 chapters' exercises (chapter 14: memory beside the KV
cache), for tests/test_labs.py."""

# 14.1: Llama-2-70B on 8 x H100-80GB, block_size 16 (workbench.labs.ch14_memory_beside_kv.custom_ar_exercise;
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

# 11.1: the learner's allocator class, through the conformance check (workbench.labs.ch11_your_own_allocator)
from workbench.labs.ch11_your_own_allocator import EXERCISE_CONTEXT as _EX_11_1  # noqa: E402
from workbench.labs.ch11_your_own_allocator import DoubleHandNextFit as _DoubleHand  # noqa: E402
from workbench.labs.ch11_your_own_allocator import LeakyNextFit as _Leaky  # noqa: E402

CONTEXTS["11.1"] = dict(_EX_11_1)
WRONG["11.1"] = [_Leaky, _DoubleHand, "next-fit", dict]

# 12.1: the hand-built pool events of workbench.labs.ch12_eviction_policies (8 blocks; the next request needs 3)
EX_12_1 = {
    "events": [
        ("alloc", "A", ["sys 0", "sys 1", "A own"]),
        ("free", "A"),
        ("hit", "B", ["sys 0", "sys 1"]),
        ("alloc", "B", ["B own"]),
        ("free", "B"),
        ("alloc", "X", ["X 0", "X 1", "X 2", "X 3"]),
        ("free", "X"),
    ],
    "num_blocks": 8,
    "need": 3,
}
CONTEXTS["12.1"] = EX_12_1
WRONG["12.1"] = [
    {"lru": [0, 1, 2], "fifo": [0, 1, 2], "lfu": [2, 3, 7]},  # LRU as if it were FIFO
    {"lru": [2, 3, 1], "fifo": [2, 3, 7], "lfu": [2, 3, 7]},  # FIFO protecting the hit blocks
    {"lru": [2, 3, 1], "fifo": [0, 1, 2], "lfu": [2, 3, 1]},  # LFU as LRU
    {"lru": [4, 5, 6], "fifo": [0, 1, 2], "lfu": [2, 3, 7]},  # the scan freed head first, and first
    {"lru": [2, 3, 1], "fifo": [0, 1, 2], "lfu": [2, 3, 4]},  # LFU ties broken by the scan's head block
    [2, 3, 1],
]

# 13.1: a contiguous pool of 24 blocks (workbench.labs.ch13_defragmentation.EXERCISE_13_1): regions slide down until a run
# of 5 opens — a to 0..3 (4 moves), b to 4..6 (3 moves): 7 blocks; packing everything would move 14
EX_13_1 = {
    "regions": [[2, 4, "a"], [8, 3, "b"], [13, 5, "c"], [20, 2, "d"]],
    "num_blocks": 24,
    "need_blocks": 5,
}
CONTEXTS["13.1"] = EX_13_1
WRONG["13.1"] = [
    14,  # packs the whole pool
    5,  # the request's need
    10,  # the free blocks
    4,  # only the first region
    "seven",
]
