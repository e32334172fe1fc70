"""Physical KV blocks: a free-block queue and reference counts.

The design follows vLLM's block pool (vllm/v1/core/block_pool.py): blocks are
handed out from the front of a free queue and returned to its back when their
reference count drops to zero, so recently freed blocks are reused last.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    """``num_blocks`` physical blocks of ``block_size`` token slots each.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each).

        Raises:
            RuntimeError: fewer than ``n`` blocks are free (callers check
                :attr:`num_free_blocks` first; this is a bug guard).
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_cnt[b] = 1
        return out

    def incref(self, block_id: int) -> None:
        """Add an owner to an allocated block (shared prefix, parallel sampling)."""
        if self.ref_cnt[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free; cannot share it")
        self.ref_cnt[block_id] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference of each block; a block whose count reaches 0 is free again.

        Blocks are returned in reverse order so that a request's tail blocks,
        the least likely to be shared, are reused first (as vLLM does).

        Raises:
            RuntimeError: a block is already free (double free).
        """
        for b in reversed(blocks):
            if self.ref_cnt[b] < 1:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        """Assert that free blocks and reference counts agree (for tests)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("a block is twice in the free queue")
        for b, c in enumerate(self.ref_cnt):
            if c < 0:
                raise AssertionError(f"block {b} has reference count {c}")
            if (c == 0) != (b in free):
                raise AssertionError(f"block {b}: reference count {c} but free={b in free}")
