"""Binary buddy allocation of contiguous reservations: ``kv_allocator="buddy"``.

The binary buddy system (K. C. Knowlton, *A fast storage allocator*, CACM 8(10), 1965; D. E. Knuth, *The Art of
Computer Programming*, vol. 1, §2.5, Algorithms R and S) over the KV pool's block address range. Each request reserves
what ``orca-max`` reserves (prompt + ``max_tokens``, capped by ``max_model_len``; :mod:`workbench.kv.contiguous`)
rounded up to a power-of-two number of blocks, ``2**k`` ("order ``k``"), in one run of consecutive blocks.

* **Free lists per order.** A block of order ``k`` starts at a multiple of ``2**k``.
* **Splitting on allocation.** An order-``k`` request takes the lowest-addressed free block of the smallest order
  ``j >= k`` and halves it ``j - k`` times; each upper half goes to the free list one order down.
* **Coalescing on free.** A freed block of order ``k`` at address ``a`` merges with its *buddy* ``a XOR 2**k`` while
  the buddy is free at the same order, then tries again one order up; once every request has left, the pool is again
  its initial segments.
* **A pool of ``N`` blocks, ``N`` not a power of two,** is covered by maximal aligned power-of-two segments, one per
  set bit of ``N`` from the highest down (``N = 20``: ``[0, 16)`` and ``[16, 20)``). A block of order ``k`` is valid
  when it starts at a multiple of ``2**k`` and ends at most at ``N``; two buddies merge only into a valid parent. The
  longest reservation that can be placed is the largest segment, ``2**floor(log2 N)`` blocks: :meth:`declare` caps a
  longer request's output there, and :meth:`refuse` ends a request whose prompt does not fit it with an error.

What the pool's accounting (:mod:`workbench.metrics.accounting`) sees, with no accounting code here: the round-up to a
power of two lies beyond the most slots the request can ever write (prompt + output cap - 1), so it is *internal
fragmentation* from the step the request is admitted, as ``orca-max``'s round-up to whole blocks is; the part below
that bound not yet written is *reservation*, settled as internal fragmentation if the request ends without writing
it. *External fragmentation* is the free slots in holes that cannot take the first waiting request: here that is the
free buddy blocks smaller than its ``2**k``, so :meth:`free_runs` lists the free blocks themselves (two adjacent free
blocks that are not buddies are two holes: no aligned block spans both) and :meth:`reservation_blocks` the rounded
size. Like the other contiguous allocators: no prefix caching, swapping or forking; a request that fits no free block
waits, and once admitted never needs another block.
"""

from __future__ import annotations

from workbench.kv.contiguous import next_pow2, reservation_tokens
from workbench.kv.interface import KVManager
from workbench.kv.manager import cdiv


class BuddyKVCacheManager(KVManager):
    """Power-of-two contiguous reservations with splitting and coalescing (binary buddy system).

    Args:
        num_blocks: blocks in the pool (the address range is ``0 .. num_blocks-1``); any size >= 1.
        block_size: token slots per block.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
    """

    name = "buddy"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1")
        self.block_size = block_size
        self._num_blocks = num_blocks
        #: the largest order: the first (largest) segment has ``2**max_order`` blocks
        self.max_order = num_blocks.bit_length() - 1
        #: ``free_lists[k]``: start blocks of the free blocks of order ``k``
        self.free_lists: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        start = 0
        for k in range(self.max_order, -1, -1):  # the segments: one per set bit of num_blocks, largest first
            if num_blocks >> k & 1:
                self.free_lists[k].add(start)
                start += 1 << k
        self._num_free = num_blocks
        self.block_tables: dict[str, list[int]] = {}
        #: request id -> ``(start block, order)`` of its reservation
        self.regions: dict[str, tuple[int, int]] = {}
        self._reserve: dict[str, int] = {}  # request -> reserved tokens (declared, capped by the largest segment)

    # ------------------------------------------------------------------ the pool
    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def max_reservation_blocks(self) -> int:
        """The longest run one request can get: the largest segment, ``2**max_order`` blocks."""
        return 1 << self.max_order

    def free_runs(self) -> list[tuple[int, int]]:
        """The free buddy blocks ``(start, num_blocks)`` in address order: the holes a reservation can go in."""
        return sorted((s, 1 << k) for k, starts in enumerate(self.free_lists) for s in starts)

    # ------------------------------------------------------------------ sizing
    def declare(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        true_output_len: int | None = None,
    ) -> int | None:
        """Size the request's reservation: ``orca-max``'s (prompt + ``max_tokens``, capped by ``max_model_len``),
        at most the largest segment (tokens; rounded to a power of two of blocks by :meth:`reservation_blocks`).

        A prompt longer than the largest segment is not sized here: :meth:`refuse` ends that request with an error
        (nothing else stops). A prompt the engine refuses anyway (``>= max_model_len``, or longer than the pool) is
        left to its refusal.

        Returns:
            ``None``, or the output cap that keeps the request's slots (prompt + output - 1; the last sampled token
            is never written) within the largest segment when the pool's size is not a power of two.
        """
        limit = self.max_reservation_blocks * self.block_size
        reserve = reservation_tokens("orca-max", num_prompt_tokens, max_tokens, max_model_len)
        self._reserve[request_id] = max(1, min(reserve, limit))
        if reserve - 1 <= limit or num_prompt_tokens >= max_model_len or num_prompt_tokens >= self.pool_tokens:
            return None
        if num_prompt_tokens > limit:
            return None  # refused (refuse); the engine ends it at its next step
        return limit - num_prompt_tokens + 1

    def refuse(self, num_prompt_tokens: int) -> str | None:
        """The error of a request whose prompt is longer than the largest segment (it can never be placed), or ``None``."""
        limit = self.max_reservation_blocks * self.block_size
        if num_prompt_tokens <= limit:
            return None
        return (
            f"prompt has {num_prompt_tokens} tokens but kv_allocator='buddy' reserves at most {limit} tokens in one run "
            f"(the largest power-of-two segment, {self.max_reservation_blocks} of the pool's {self._num_blocks} blocks); "
            f"give a pool of a power of two blocks (e.g. num_gpu_blocks_override={next_pow2(self._num_blocks)}), shorten "
            "the prompt, or use kv_allocator='orca-max'"
        )

    def forget(self, request_id: str) -> None:
        """Drop the request's declared reservation (it has ended)."""
        self._reserve.pop(request_id, None)

    def reservation_blocks(self, request_id: str) -> int:
        """Blocks the request reserves at admission: its declared tokens in whole blocks, rounded up to a power of
        two (0 if it was never declared)."""
        tokens = self._reserve.get(request_id, 0)
        return next_pow2(cdiv(tokens, self.block_size)) if tokens else 0

    # ------------------------------------------------------------------ slots
    def allocate_slots(
        self, request_id: str, num_total_tokens: int, cached_blocks=(), write_start: int | None = None
    ) -> bool:
        """Reserve the request's power-of-two run at its first call; later calls only check it.

        Returns:
            ``False``, and nothing changed, when no free block of the request's order or above exists (or the run
            would be longer than the largest segment).

        Raises:
            RuntimeError: ``num_total_tokens`` exceeds the reservation (a bug: the engine caps requests by it).
        """
        table = self.block_tables.get(request_id)
        if table is None:
            blocks = max(self.reservation_blocks(request_id), cdiv(num_total_tokens, self.block_size))
            if blocks == 0:
                return True
            order = (blocks - 1).bit_length()
            start = self._split(order) if order <= self.max_order else None
            if start is None:
                return False
            self.regions[request_id] = (start, order)
            self._num_free -= 1 << order
            table = self.block_tables[request_id] = list(range(start, start + (1 << order)))
        if num_total_tokens > len(table) * self.block_size:
            raise RuntimeError(
                f"request {request_id} needs {num_total_tokens} slots but reserved {len(table) * self.block_size} "
                "(buddy); its output cap must not exceed its reservation"
            )
        return True

    def free(self, request_id: str) -> None:
        """Release the request's run, coalescing it with its free buddies (no-op for a request holding none)."""
        if self.block_tables.pop(request_id, None) is None:
            return
        start, order = self.regions.pop(request_id)
        self._num_free += 1 << order
        self._coalesce(start, order)

    def _split(self, order: int) -> int | None:
        """Take a free block of ``order``: the lowest-addressed one of the smallest order that has one, halved down
        to ``order`` (Knuth's Algorithm R); its start, or ``None``."""
        j = next((j for j in range(order, self.max_order + 1) if self.free_lists[j]), None)
        if j is None:
            return None
        start = min(self.free_lists[j])
        self.free_lists[j].remove(start)
        while j > order:
            j -= 1
            self.free_lists[j].add(start + (1 << j))  # the upper half stays free, one order down
        return start

    def _coalesce(self, start: int, order: int) -> None:
        """Return a block, merging it with its buddy while both are free and their parent is a valid block
        (Knuth's Algorithm S)."""
        while True:
            buddy = start ^ (1 << order)
            parent = min(start, buddy)
            if parent + (2 << order) > self._num_blocks or buddy not in self.free_lists[order]:
                break
            self.free_lists[order].remove(buddy)
            start, order = parent, order + 1
        self.free_lists[order].add(start)

    # ------------------------------------------------------------------ tests
    def check_invariants(self) -> None:
        """Assert that free and reserved blocks are aligned, valid and tile the pool exactly once, that no two
        free buddies are left unmerged, and that the block tables match the reservations (for tests)."""
        n = self._num_blocks
        cover = [0] * n
        blocks = [(s, k, "free") for k, starts in enumerate(self.free_lists) for s in starts]
        blocks += [(s, k, rid) for rid, (s, k) in self.regions.items()]
        for s, k, who in blocks:
            if s % (1 << k) or s + (1 << k) > n:
                raise AssertionError(f"block {s} of order {k} ({who}) is not an aligned block inside the pool")
            for b in range(s, s + (1 << k)):
                cover[b] += 1
        if any(c != 1 for c in cover):
            raise AssertionError(f"blocks covered {[i for i, c in enumerate(cover) if c != 1]} not exactly once")
        for k, starts in enumerate(self.free_lists):
            for s in starts:
                buddy = s ^ (1 << k)
                if min(s, buddy) + (2 << k) <= n and buddy in starts:
                    raise AssertionError(f"free buddies {s} and {buddy} of order {k} were not coalesced")
        for rid, (s, k) in self.regions.items():
            if self.block_tables.get(rid) != list(range(s, s + (1 << k))):
                raise AssertionError(f"block table of {rid} differs from its reservation")
        if len(self.regions) != len(self.block_tables):
            raise AssertionError("a block table without a reservation")
        if self._num_free != sum(len(starts) << k for k, starts in enumerate(self.free_lists)):
            raise AssertionError("free-block count differs from the free lists")
