"""Prefix-cache eviction policies: which free KV block the paged :class:`~workbench.kv.block_pool.BlockPool`
hands out next (engine argument ``prefix_cache_eviction``).

With prefix caching (vLLM's automatic prefix caching, https://docs.vllm.ai/en/latest/design/prefix_caching.html)
a block whose last owner released it stays findable by its content hash until the pool hands it out for new
content: that hand-out is an *eviction*. The pool keeps the reference counts and the hash table; the policy keeps
the set of free blocks and decides which one goes next.

Built-in policies (the names of :data:`workbench.config.PREFIX_CACHE_EVICTIONS`):

* ``"lru"`` (:class:`LRUPolicy`, the default): vLLM's rule. One free queue in the order blocks were freed (a
  request's blocks tail first), handed out from the front, cached or not; a prefix hit takes a block off the
  queue (vLLM ``vllm/v1/core/block_pool.py``, ``FreeKVCacheBlockQueue``; docs "design/prefix_caching",
  "eviction order"). The least recently freed block goes first (vLLM 0.32 puts uncached freed blocks in front).
* ``"fifo"`` (:class:`FIFOPolicy`): free blocks holding no cached content first (in the order freed), then the
  cached block whose content was cached earliest, however often it was hit since (first-in first-out, as in
  the classic page-replacement algorithms; Belady, IBM Systems Journal 5(2), 1966).
* ``"lfu"`` (:class:`LFUPolicy`): empty free blocks first, then the cached block with the fewest prefix-cache
  hits since its content was cached; ties go to the least recently freed (least frequently used with an LRU
  tie-break, as in e.g. SGLang's radix-cache ``lfu`` policy).

A plug-in ``"package.module:ClassName"`` names an :class:`EvictionPolicy` subclass; it implements
:meth:`EvictionPolicy.victim` (and may override :meth:`EvictionPolicy.eviction_order`) and reads the per-block
figures the base class keeps (:attr:`~EvictionPolicy.hits`, :attr:`~EvictionPolicy.freed_seq`, ...).

Ages: the base class stamps each block with the engine step it was freed at (:attr:`EvictionPolicy.step`, which
:func:`workbench.metrics.stats.step_stats` advances after every recorded step); an evicted block's *age* is the
number of engine steps from that free to its eviction (0 = freed and evicted in the same step).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict

from workbench.plugins import is_plugin_name, load_plugin

__all__ = [
    "EvictionPolicy",
    "FIFOPolicy",
    "KeyedPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "check_prefix_cache_eviction",
    "eviction_policy_class",
]


class EvictionPolicy(ABC):
    """The free blocks of a pool of ``num_blocks`` and the order they are handed out in.

    The pool calls :meth:`release` (a block's reference count reached 0), :meth:`hit` (a prefix-cache hit on a
    block, free or not), :meth:`register` (a block's content hash entered the cache) and :meth:`pop` (hand out one
    free block); the base class keeps the free set and the per-block figures below, and asks :meth:`victim`,
    the one method a policy must implement, which free block goes next. All blocks start free, in id order.

    Attributes:
        free: the free blocks (dict keys, in the order they were freed: the LRU order).
        is_cached: per block: it holds a prefix-cached block (meaningful while it is free).
        hits: per block: prefix-cache hits since its content was cached (reset when it is handed out).
        cached_seq: per block: the order its current content was cached in (a counter; FIFO's key).
        freed_seq: per block: the order it was last freed in (a counter; LRU's key).
        freed_step: per block: the engine step it was last freed at.
        step: the current engine step (advanced by the step's record).
        evicted_ages: ages (engine steps since freed) of the blocks evicted since :meth:`take_evicted_ages`.

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    #: the name the policy is shown under (plug-ins: their own)
    name = "custom"

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        # An OrderedDict, not a dict: the free set is a queue taken from the front, and a plain dict's first key is
        # found by scanning past every entry deleted since its last resize (quadratic over a long run).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.is_cached = [False] * num_blocks
        self.hits = [0] * num_blocks
        self.cached_seq = [0] * num_blocks
        self.freed_seq = list(range(num_blocks))
        self.freed_step = [0] * num_blocks
        self.step = 0
        self.evicted_ages: list[int] = []
        self._seq = num_blocks

    # ------------------------------------------------------------------ what a policy decides
    @abstractmethod
    def victim(self) -> int:
        """The free block to hand out next (one of :attr:`free`; called only when some block is free)."""

    def eviction_order(self) -> list[int]:
        """The free blocks holding cached content, in the order they would be evicted (default: freed order)."""
        return [b for b in self.free if self.is_cached[b]]

    # ------------------------------------------------------------------ what the pool calls
    def __len__(self) -> int:
        return len(self.free)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self.free

    def release(self, block_id: int, cached: bool) -> None:
        """``block_id`` became free (its last owner released it); ``cached``: it holds a prefix-cached block."""
        self.free[block_id] = None
        self.is_cached[block_id] = cached
        self.freed_seq[block_id] = self._seq
        self._seq += 1
        self.freed_step[block_id] = self.step

    def hit(self, block_id: int) -> None:
        """A prefix-cache hit on ``block_id``: count it, and take the block off the free set if it is free."""
        self.hits[block_id] += 1
        self.free.pop(block_id, None)

    def register(self, block_id: int) -> None:
        """``block_id`` (allocated) now holds a block registered in the prefix cache."""
        self.cached_seq[block_id] = self._seq
        self._seq += 1

    def pop(self) -> int:
        """Take the :meth:`victim` off the free set and return it; an eviction if it held cached content.

        Raises:
            RuntimeError: the policy chose a block that is not free (a bug in the policy).
        """
        b = self.victim()
        if b not in self.free:
            raise RuntimeError(f"{type(self).__name__}.victim() chose block {b}, which is not free")
        self.take(b)
        return b

    def take(self, block_id: int) -> None:
        """Take the free ``block_id`` off the free set, chosen by the caller (:meth:`pop`, or a block move's
        destination, :func:`workbench.kv.moves.move_paged`); an eviction if it held cached content."""
        del self.free[block_id]
        if self.is_cached[block_id]:
            self.evicted_ages.append(self.step - self.freed_step[block_id])
            self.is_cached[block_id] = False
        self.hits[block_id] = 0

    def moved(self, src: int, dst: int) -> None:
        """A live block's content moved from ``src`` to ``dst`` (compaction): its figures (hits, when it was
        cached) follow it, so a move changes no policy's order."""
        self.hits[dst], self.cached_seq[dst] = self.hits[src], self.cached_seq[src]

    def check_invariants(self, ref_cnt: list[int], block_hash: list, cached: dict) -> None:
        """Assert that the pool's state and the policy's agree (for tests): no reference count below 0, a block is
        free exactly when its count is 0, a free block is marked cached exactly when it carries a content hash, and
        the pool's hash table (``cached``: hash -> block) matches the blocks' hashes (``block_hash``)."""
        for b, c in enumerate(ref_cnt):
            if c < 0:
                raise AssertionError(f"block {b} has reference count {c}")
            if (c == 0) != (b in self.free):
                raise AssertionError(f"block {b}: reference count {c} but free={b in self.free}")
            if c == 0 and self.is_cached[b] != (block_hash[b] is not None):
                raise AssertionError(f"free block {b}: marked cached={self.is_cached[b]}, hash {block_hash[b]!r}")
        for h, b in cached.items():
            if block_hash[b] != h:
                raise AssertionError(f"cached hash of block {b} disagrees with the table")
        if sum(h is not None for h in block_hash) != len(cached):
            raise AssertionError("a block carries a hash that is not in the table")

    def take_evicted_ages(self, next_step: int) -> list[int]:
        """The ages of the blocks evicted since the last call (engine steps), and the clock set to ``next_step``."""
        ages, self.evicted_ages = self.evicted_ages, []
        self.step = next_step
        return ages


class LRUPolicy(EvictionPolicy):
    """vLLM's documented rule: the front of the free queue (the least recently freed block, cached or not)."""

    name = "lru"

    def victim(self) -> int:
        return next(iter(self.free))


class KeyedPolicy(EvictionPolicy):
    """Free blocks without cached content first (least recently freed first), then the free cached block of
    smallest :meth:`key` (a min-heap with lazy deletion: O(log n) per free and per eviction)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # free, no cached content
        self._heap: list[tuple] = []  # (key, freed_seq, block) of free cached blocks; stale entries skipped

    @abstractmethod
    def key(self, block_id: int) -> tuple:
        """The sort key of a free cached block: the smallest is evicted first (stable while the block is free)."""

    def release(self, block_id: int, cached: bool) -> None:
        super().release(block_id, cached)
        if cached:
            heapq.heappush(self._heap, (self.key(block_id), self.freed_seq[block_id], block_id))
        else:
            self.empty[block_id] = None

    def victim(self) -> int:
        if self.empty:
            return next(iter(self.empty))
        while True:
            _, seq, b = self._heap[0]
            if b in self.free and self.freed_seq[b] == seq:
                return b
            heapq.heappop(self._heap)  # taken by a hit since, or freed again under a newer entry

    def take(self, block_id: int) -> None:
        super().take(block_id)
        self.empty.pop(block_id, None)

    def hit(self, block_id: int) -> None:
        super().hit(block_id)
        self.empty.pop(block_id, None)

    def check_invariants(self, ref_cnt: list[int], block_hash: list, cached: dict) -> None:
        """The base class's checks, and: :attr:`empty` is exactly the free uncached blocks, and every free cached
        block has a live heap entry."""
        super().check_invariants(ref_cnt, block_hash, cached)
        if set(self.empty) != {b for b in self.free if not self.is_cached[b]}:
            raise AssertionError("the empty-block list differs from the free blocks holding no cached content")
        live = {b for _, seq, b in self._heap if b in self.free and self.freed_seq[b] == seq}
        if live != {b for b in self.free if self.is_cached[b]}:
            raise AssertionError("the heap's live entries differ from the free cached blocks")

    def eviction_order(self) -> list[int]:
        return sorted((b for b in self.free if self.is_cached[b]), key=lambda b: (self.key(b), self.freed_seq[b]))


class FIFOPolicy(KeyedPolicy):
    """The cached block whose content was cached earliest, whatever its reuse."""

    name = "fifo"

    def key(self, block_id: int) -> tuple:
        return (self.cached_seq[block_id],)


class LFUPolicy(KeyedPolicy):
    """The cached block with the fewest prefix-cache hits since it was cached; ties: least recently freed."""

    name = "lfu"

    def key(self, block_id: int) -> tuple:
        return (self.hits[block_id], self.freed_seq[block_id])


#: the built-in policies by name: the names :data:`workbench.config.PREFIX_CACHE_EVICTIONS` declares, in its order
BUILTIN: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "fifo": FIFOPolicy, "lfu": LFUPolicy}


def eviction_policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class ``name`` stands for: a built-in name, or a plug-in ``"package.module:ClassName"``.

    Raises:
        ValueError: an unknown name, or a plug-in that does not load or is no :class:`EvictionPolicy` subclass
            (:func:`workbench.plugins.load_plugin`); the message names the value and the fix.
    """
    if name in BUILTIN:
        return BUILTIN[name]
    if is_plugin_name(name):
        return load_plugin("prefix_cache_eviction", name, EvictionPolicy)
    raise ValueError(
        f"prefix_cache_eviction={name!r} must be one of {', '.join(map(repr, BUILTIN))} or a plug-in "
        "'package.module:ClassName' (an EvictionPolicy subclass)"
    )


def check_prefix_cache_eviction(config) -> None:
    """Check ``config.prefix_cache_eviction`` (an :class:`~workbench.config.EngineConfig`): the name resolves
    (a plug-in is imported here, before any model loads), and a policy other than ``"lru"`` comes with
    ``enable_prefix_caching`` (without it no block is ever cached, so the policy would change nothing).

    Raises:
        ValueError: naming the value and the fix.
    """
    name = config.prefix_cache_eviction
    eviction_policy_class(name)
    if name != "lru" and not config.enable_prefix_caching:
        raise ValueError(
            f"prefix_cache_eviction={name!r} chooses which prefix-cached block to evict, but prefix caching is off; "
            "pass --enable-prefix-caching (enable_prefix_caching=True), or leave prefix_cache_eviction='lru'"
        )
