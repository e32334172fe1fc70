"""Physical KV blocks: a free-block queue, reference counts, and the prefix cache's hash table.

The design follows vLLM's block pool (vllm/v1/core/block_pool.py): blocks are handed out from the front of a free
queue and returned to its back when their reference count drops to zero. With prefix caching a freed block keeps its
content hash and stays findable until it is handed out again, so the free queue doubles as the LRU list of cached
blocks: the least recently freed cached block is evicted first."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """``num_blocks`` physical blocks; raises ``ValueError`` if ``num_blocks < 1``.

    Attributes:
        ref_cnt: owners of each block (0 = free).
        block_hash: the content hash of each cached (full, prefix-cacheable) block, else ``None``.
        cached: hash -> block id, for every block that holds a cached full block.
        num_evictions: cached blocks evicted (handed out for new content) so far.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        #: False until some block has a second owner (a fork, a prefix-cache hit): while False no block is shared,
        #: so a write needs no copy-on-write check
        self.ever_shared = False
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached ones included: they can be handed out)."""
        return len(self._free)

    def cached_free_blocks(self) -> list[int]:
        """The free blocks that still hold a cached prefix block, in eviction order."""
        return [b for b in self._free if self.block_hash[b] is not None]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), evicting cached content LRU-first. Raises
        ``RuntimeError`` if fewer than ``n`` are free (a bug guard: callers check :attr:`num_free_blocks`)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                del self.cached[h]
                self.block_hash[b] = None
                self.num_evictions += 1
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, block_id: int) -> None:
        """Add an owner to a block found in the prefix cache (taking it off the free queue if free)."""
        if self.ref_cnt[block_id] == 0:
            del self._free[block_id]
        self.ref_cnt[block_id] += 1
        if self.ref_cnt[block_id] > 1:
            self.ever_shared = True

    def incref(self, block_id: int) -> None:
        """Add an owner to an allocated block; raises ``RuntimeError`` if the block is free."""
        if self.ref_cnt[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free; cannot share it")
        self.ref_cnt[block_id] += 1
        self.ever_shared = True

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full block's content hash (first writer wins; a duplicate stays uncached)."""
        if block_hash not in self.cached and self.block_hash[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def free(self, blocks: list[int]) -> None:
        """Drop one reference of each block; a block whose count reaches 0 goes to the free queue's back, in reverse
        order so that a request's tail blocks, the least likely to be shared, are evicted first (as vLLM does).
        Raises ``RuntimeError`` if a block is already free (double free)."""
        for b in reversed(blocks):
            if self.ref_cnt[b] < 1:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None

    def check_invariants(self) -> None:
        """Assert that free blocks, reference counts and the hash table agree (for tests)."""
        for b, c in enumerate(self.ref_cnt):
            if c < 0:
                raise AssertionError(f"block {b} has reference count {c}")
            if (c == 0) != (b in self._free):
                raise AssertionError(f"block {b}: reference count {c} but free={b in self._free}")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"cached hash of block {b} disagrees with the table")
        if sum(h is not None for h in self.block_hash) != len(self.cached):
            raise AssertionError("a block carries a hash that is not in the table")
