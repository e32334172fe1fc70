"""Contexts and known wrong answers of chapter 13's exercises (``workbench/labs/ch13_eviction_policies.py``): eviction policies."""

# 13.1: the hand-built pool events of workbench.labs.ch13_eviction_policies (8 blocks; the next request needs 3)
EX_13_1 = {
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
CONTEXTS: dict = {"13.1": EX_13_1}
WRONG: dict = {
    "13.1": [
        {"lru": [0, 1, 2], "fifo": [0, 1, 2], "lfu": [2, 3, 7]},  # LRU as if it were FIFO
        {"lru": [2, 3, 1], "fifo": [2, 3, 7], "lfu": [2, 3, 7]},  # FIFO protecting the hit blocks
        {"lru": [2, 3, 1], "fifo": [0, 1, 2], "lfu": [2, 3, 1]},  # LFU as LRU
        {"lru": [4, 5, 6], "fifo": [0, 1, 2], "lfu": [2, 3, 7]},  # the scan freed head first, and first
        {"lru": [2, 3, 1], "fifo": [0, 1, 2], "lfu": [2, 3, 4]},  # LFU ties broken by the scan's head block
        [2, 3, 1],
    ],
}
