"""Contexts and known wrong answers of chapter 14's exercises (``workbench/labs/ch14_defragmentation.py``): defragmentation."""

# 14.1: a contiguous pool of 24 blocks (workbench.labs.ch14_defragmentation.EXERCISE_14_1): regions slide down until a run
# of 5 opens — a to 0..3 (4 moves), b to 4..6 (3 moves): 7 blocks; packing everything would move 14
EX_14_1 = {
    "regions": [[2, 4, "a"], [8, 3, "b"], [13, 5, "c"], [20, 2, "d"]],
    "num_blocks": 24,
    "need_blocks": 5,
}
CONTEXTS: dict = {"14.1": EX_14_1}
WRONG: dict = {
    "14.1": [
        14,  # packs the whole pool
        5,  # the request's need
        10,  # the free blocks
        4,  # only the first region
        "seven",
    ],
}
