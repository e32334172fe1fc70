"""Physical KV blocks: a free-block queue, reference counts, and the prefix cache's hash table.

The design follows vLLM's block pool (vllm/v1/core/block_pool.py). With prefix caching a freed block keeps its
content hash and stays findable until it is handed out again (evicted); which free block goes next is the eviction
policy's choice (:mod:`workbench.kv.eviction`; vLLM's LRU free queue by default)."""

from __future__ import annotations

from workbench.kv.eviction import eviction_policy_class


class BlockPool:
    """``num_blocks`` physical blocks, free ones handed out in the order of the ``eviction_policy`` a built-in name
    or plug-in names (:func:`~workbench.kv.eviction.eviction_policy_class`); ``ValueError`` if ``num_blocks <
    1`` or the policy is unknown.

    Attributes:
        policy: the free blocks and which goes next (an :class:`~workbench.kv.eviction.EvictionPolicy`).
        ref_cnt: owners of each block (0 = free).
        block_hash: the content hash of each cached (full, prefix-cacheable) block, else ``None``.
        cached: hash -> block id, for every block that holds a cached full block.
        num_evictions: cached blocks evicted (handed out for new content) so far.
        events: when recorded (:mod:`workbench.kv.events`), the hashes of evicted blocks (among others), else ``None``.
    """

    def __init__(self, num_blocks: int, eviction_policy: str = "lru") -> None:
        self.policy = eviction_policy_class(eviction_policy)(num_blocks)  # raises for num_blocks < 1
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        #: False until some block has a second owner (a fork, a prefix-cache hit): while False no block is shared,
        #: so a write needs no copy-on-write check
        self.ever_shared = False
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.num_evictions = 0
        self.events: list | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (cached ones included: they can be handed out)."""
        return len(self.policy)

    def cached_free_blocks(self) -> list[int]:
        """The free blocks that still hold a cached prefix block, in eviction order."""
        return self.policy.eviction_order()

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each) in the policy's order, evicting cached content. Raises
        ``RuntimeError`` if fewer than ``n`` are free (a bug guard: callers check :attr:`num_free_blocks`)."""
        if n > len(self.policy):
            raise RuntimeError(f"asked for {n} blocks with only {len(self.policy)} free")
        out = []
        for _ in range(n):
            b = self.policy.pop()
            h = self.block_hash[b]
            if h is not None:
                del self.cached[h]
                self.block_hash[b] = None
                self.num_evictions += 1
                if self.events is not None:
                    self.events.append(h)
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def touch(self, block_id: int) -> None:
        """Add an owner to a block found in the prefix cache (taking it off the free queue if free)."""
        self.policy.hit(block_id)
        self.ref_cnt[block_id] += 1
        if self.ref_cnt[block_id] > 1:
            self.ever_shared = True

    def incref(self, block_id: int) -> None:
        """Add an owner to an allocated block; raises ``RuntimeError`` if the block is free."""
        if self.ref_cnt[block_id] < 1:
            raise RuntimeError(f"block {block_id} is free; cannot share it")
        self.ref_cnt[block_id] += 1
        self.ever_shared = True

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full block's content hash; True if it entered the cache (a duplicate stays uncached)."""
        if block_hash not in self.cached and self.block_hash[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
            self.policy.register(block_id)
            return True
        return False

    def free(self, blocks: list[int]) -> None:
        """Drop one reference of each block; a block whose count reaches 0 goes back to the policy, in reverse order
        so that a request's tail blocks, the least likely to be shared, are evicted first (as vLLM does).
        Raises ``RuntimeError`` if a block is already free (double free)."""
        for b in reversed(blocks):
            if self.ref_cnt[b] < 1:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.policy.release(b, self.block_hash[b] is not None)

    def check_invariants(self) -> None:
        """Assert that free blocks, reference counts and the hash table agree (for tests)."""
        self.policy.check_invariants(self.ref_cnt, self.block_hash, self.cached)
