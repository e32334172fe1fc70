"""The KV-cache manager: block tables, slot allocation, prefix caching and the memory figures.

Paged allocation as in PagedAttention (Kwon et al., SOSP 2023, §4.1–4.2): a
request's K/V live in fixed-size blocks that need not be contiguous; its block
table maps logical block ``i`` (tokens ``i*block_size .. (i+1)*block_size-1``)
to a physical block. Blocks are allocated only when tokens are scheduled, so a
request holds at most one partly filled block.

Prefix caching (vLLM's automatic prefix caching, docs "design/prefix_caching"): a full
block is identified by SHA-256 over its parent block's hash and its own token ids, so
equal hashes mean equal prefixes (a cryptographic hash: no collision check is needed).
A new request reuses the longest chain of cached blocks covering at most all but its
last token (that token must run through the model to produce logits).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from workbench.kv.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids (int64 little-endian)."""
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class KVUsage:
    """The pool split of ARCHITECTURE §3, in token slots (multiply by KV bytes per token for bytes).

    ``token_states + reservation + internal_fragmentation + external_fragmentation + free == pool``.
    """

    pool: int
    token_states: int
    reservation: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int

    @property
    def kv_utilization(self) -> float:
        """token states / pool (0..1)."""
        return self.token_states / self.pool if self.pool else 0.0

    @property
    def fragmentation_rate(self) -> float:
        """(reservation + internal + external) / (pool - free): the share of occupied memory holding no token state."""
        used = self.pool - self.free
        waste = self.reservation + self.internal_fragmentation + self.external_fragmentation
        return waste / used if used else 0.0


class KVCacheManager:
    """Allocates token slots for requests, block by block.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: keep full blocks findable by content hash.
        num_cpu_blocks: blocks of the CPU swap pool (0 = no swapping).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, num_cpu_blocks: int = 0
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        #: CPU blocks for preemption by swapping (``swap_space``); ``None`` without swap space
        self.swap_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks > 0 else None
        self.swapped_tables: dict[str, list[int]] = {}
        #: copy-on-write ``(src, dst)`` block copies for the executor, drained by the scheduler each step
        self.pending_copies: list[tuple[int, int]] = []
        self.block_tables: dict[str, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self._hashes: dict[str, list[bytes]] = {}  # hashes of each request's full blocks, in order

    # ------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Physical blocks of the longest cached prefix of ``token_ids``, leaving its last token uncovered.

        Returns:
            block ids (empty when prefix caching is off or nothing is cached).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        blocks: list[int] = []
        parent = None
        for i in range((len(token_ids) - 1) // bs):
            h = block_hash(parent, token_ids[i * bs : (i + 1) * bs])
            b = self.pool.cached.get(h)
            if b is None:
                break
            blocks.append(b)
            parent = h
        return blocks

    def num_hashed_blocks(self, request_id: str) -> int:
        """Full blocks of the request already registered in the prefix cache."""
        return len(self._hashes.get(request_id, ()))

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register the hashes of the request's blocks whose ``block_size`` tokens are all computed."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hashes = self._hashes.setdefault(request_id, [])
        table = self.block_tables[request_id]
        for i in range(len(hashes), num_computed // bs):
            h = block_hash(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs])
            hashes.append(h)
            self.pool.cache_block(table[i], h)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def pool_tokens(self) -> int:
        """Token slots in the pool."""
        return self.pool.num_blocks * self.block_size

    def allocate_slots(
        self,
        request_id: str,
        num_total_tokens: int,
        cached_blocks: list[int] = (),
        write_start: int | None = None,
    ) -> bool:
        """Make sure slots ``0 .. num_total_tokens-1`` of the request are backed by blocks.

        Copy-on-write: a block in the written range ``write_start .. num_total_tokens-1`` that
        other requests share (reference count > 1, e.g. a parallel-sampling sibling's prompt
        block) is replaced by a private copy; the ``(src, dst)`` pair is queued in
        :attr:`pending_copies` for the executor to copy before the forward.

        Args:
            request_id: the request.
            num_total_tokens: tokens computed so far + tokens scheduled this step.
            cached_blocks: prefix-cache hits (from :meth:`find_cached_prefix`) that start the
                block table of a request holding no blocks yet.
            write_start: first position written this step (``None`` = no copy-on-write check).

        Returns:
            ``False`` (and changes nothing) when too few blocks are free.
        """
        bs = self.block_size
        table = self.block_tables.get(request_id)
        have = len(table) if table else 0
        if have * bs >= num_total_tokens and not cached_blocks:
            # the common step of a running request (a decode inside its last block): nothing to
            # allocate; only a shared block in the written range needs a copy
            if write_start is None:
                return True
            ref = self.pool.ref_cnt
            lo = write_start // bs
            hi = -(-num_total_tokens // bs)
            if hi - lo == 1:
                if ref[table[lo]] <= 1:
                    return True
            elif all(ref[table[i]] <= 1 for i in range(lo, hi)):
                return True
        need = max(0, cdiv(num_total_tokens, bs) - have - len(cached_blocks))
        cow = []
        if table and write_start is not None:
            cow = [
                i
                for i in range(write_start // bs, min(have, cdiv(num_total_tokens, bs)))
                if self.pool.ref_cnt[table[i]] > 1
            ]
        # hits on free cached blocks leave the free queue: they are not available for new blocks
        reclaimed = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        if need + len(cow) > self.pool.num_free_blocks - reclaimed:
            return False
        if table is None:
            table = self.block_tables[request_id] = []
        for i in cow:
            (dst,) = self.pool.allocate(1)
            self.pending_copies.append((table[i], dst))
            self.pool.free([table[i]])
            table[i] = dst
        if cow:
            del self._hashes.get(request_id, [])[cow[0] :]  # copies carry no cache identity
        for b in cached_blocks:
            self.pool.touch(b)
        table.extend(cached_blocks)
        if cached_blocks:
            self._hashes[request_id] = [self.pool.block_hash[b] for b in cached_blocks]
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give ``child_id`` the parent's blocks covering ``num_tokens`` tokens, shared by reference count."""
        blocks = self.block_tables[parent_id][: cdiv(num_tokens, self.block_size)]
        for b in blocks:
            self.pool.incref(b)
        self.block_tables[child_id] = list(blocks)
        hashes = self._hashes.get(parent_id, [])[: num_tokens // self.block_size]
        self._hashes[child_id] = list(hashes)

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, request_id: str) -> bool:
        return (
            self.swap_pool is not None and len(self.block_tables.get(request_id, ())) <= self.swap_pool.num_free_blocks
        )

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move a request's blocks to the CPU swap pool; return ``(device_block, cpu_block)`` pairs to copy.

        Raises:
            RuntimeError: the swap pool lacks room (check :meth:`can_swap_out` first).
        """
        table = self.block_tables.pop(request_id)
        self._hashes.pop(request_id, None)
        cpu = self.swap_pool.allocate(len(table))
        self.swapped_tables[request_id] = cpu
        pairs = list(zip(table, cpu))
        self.pool.free(table)
        return pairs

    def can_swap_in(self, request_id: str, num_total_tokens: int = 0) -> bool:
        """Room for the request's swapped blocks and for ``num_total_tokens`` slots in all."""
        need = max(len(self.swapped_tables[request_id]), cdiv(num_total_tokens, self.block_size))
        return need <= self.pool.num_free_blocks

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Bring a swapped request back; return ``(cpu_block, device_block)`` pairs to copy."""
        cpu = self.swapped_tables.pop(request_id)
        table = self.pool.allocate(len(cpu))
        self.block_tables[request_id] = table
        self.swap_pool.free(cpu)
        return list(zip(cpu, table))

    def drop_swapped(self, request_id: str) -> None:
        """Release a swapped request's CPU blocks (abort)."""
        cpu = self.swapped_tables.pop(request_id, None)
        if cpu:
            self.swap_pool.free(cpu)

    def free(self, request_id: str) -> None:
        """Release every block of a request (no-op for a request holding none)."""
        self._hashes.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Physical slot of each token position ``start .. end-1``: ``block_table[p // bs] * bs + p % bs``."""
        bs = self.block_size
        table = self.block_tables[request_id]
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def usage(
        self,
        num_computed: dict[str, int],
        final_bound: dict[str, int] | None = None,
        waiting_need_blocks: int = 0,
    ) -> KVUsage:
        """The pool split after a step (ARCHITECTURE §3), in token slots.

        Allocated slots that hold no token state are *reservation* when the request may still
        write them (below ``final_bound``) and *internal fragmentation* otherwise. Which of them a
        request really writes is known only when it ends; the engine then moves the unwritten
        part from reservation to internal fragmentation in the recorded steps
        (:meth:`workbench.engine.LLMEngine` does this), so a run's figures are exact.

        Args:
            num_computed: tokens with K/V in the cache, per request holding blocks.
            final_bound: most KV slots each request can ever write (prompt + output cap - 1);
                ``None`` counts every unwritten allocated slot as internal fragmentation.
            waiting_need_blocks: ignored (paged allocation has no external fragmentation: any
                free block serves any request).
        """
        bs = self.block_size
        if self.enable_prefix_caching:
            # a block shared by several requests holds its token states once
            filled: dict[int, int] = {}
            for r, table in self.block_tables.items():
                n = num_computed.get(r, 0)
                for i, b in enumerate(table):
                    f = min(bs, n - i * bs)
                    if f <= 0:
                        break
                    if f > filled.get(b, 0):
                        filled[b] = f
            token_states = sum(filled.values())
        else:
            token_states = sum(num_computed.get(r, 0) for r in self.block_tables)
        unwritten = None
        if final_bound is not None:
            unwritten = 0
            get_c = num_computed.get
            get_b = final_bound.get
            for r, table in self.block_tables.items():
                left = min(len(table) * bs, get_b(r, 0)) - get_c(r, 0)
                if left > 0:
                    unwritten += left
        return self.usage_from_sums(token_states, unwritten)

    def usage_from_sums(self, token_states: int, unwritten_below_bound: int | None = None) -> KVUsage:
        """The pool split of :meth:`usage` from its two sums (token slots), for a caller that
        already walks the block tables (the engine's step record).

        Args:
            token_states: slots holding K/V (shared blocks counted once).
            unwritten_below_bound: over the requests holding blocks, the allocated slots below
                each one's ``final_bound`` not written yet (``None``: all waste is internal
                fragmentation).
        """
        bs = self.block_size
        allocated = (self.pool.num_blocks - self.pool.num_free_blocks) * bs
        waste = allocated - token_states
        reservation = 0 if unwritten_below_bound is None else min(unwritten_below_bound, waste)
        return KVUsage(
            pool=self.pool_tokens,
            token_states=token_states,
            reservation=reservation,
            internal_fragmentation=waste - reservation,
            external_fragmentation=0,
            free=self.pool.num_free_blocks * bs,
        )

    def block_map(self, num_computed: dict[str, int], waiting_need_blocks: int = 0, step: int = 0) -> dict:
        """A per-block picture of the pool, for the block-map figure.

        Returns:
            ``{"step", "allocator", "block_size", "owner", "owner_ids", "filled", "state"}``:
            ``owner[b]`` indexes ``owner_ids`` (the first request holding block ``b``) or is -1;
            ``filled[b]`` = slots of ``b`` holding token states; ``state[b]`` is ``"used"``,
            ``"free"``, or ``"cached"`` (free but holding a prefix-cached block).
        """
        bs = self.block_size
        n = self.pool.num_blocks
        owner = [-1] * n
        filled = [0] * n
        state = ["free"] * n
        ids: list[str] = []
        for r, table in self.block_tables.items():
            k = len(ids)
            ids.append(r)
            c = num_computed.get(r, 0)
            for i, b in enumerate(table):
                if owner[b] < 0:
                    owner[b] = k
                state[b] = "used"
                filled[b] = max(filled[b], max(0, min(bs, c - i * bs)))
        if self.enable_prefix_caching:
            for b in range(n):
                if state[b] == "free" and self.pool.block_hash[b] is not None:
                    state[b] = "cached"
        return {
            "step": step,
            "allocator": "paged",
            "block_size": bs,
            "owner": owner,
            "owner_ids": ids,
            "filled": filled,
            "state": state,
        }

    # the contiguous allocators' reservation interface; paged allocation reserves nothing ahead
    def declare(self, request_id: str, reserve_tokens: int) -> None:
        return None

    def forget(self, request_id: str) -> None:
        return None

    def reservation_blocks(self, request_id: str) -> int:
        return 0

    def check_invariants(self) -> None:
        """Assert that block tables and reference counts agree (for tests)."""
        self.pool.check_invariants()
        if self.swap_pool is not None:
            self.swap_pool.check_invariants()
            cpu_owners = [0] * self.swap_pool.num_blocks
            for t in self.swapped_tables.values():
                for b in t:
                    cpu_owners[b] += 1
            if cpu_owners != self.swap_pool.ref_cnt:
                raise AssertionError("swap pool reference counts differ from the swapped block tables")
        owners = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                owners[b] += 1
        if owners != self.pool.ref_cnt:
            raise AssertionError("reference counts differ from the number of block tables holding each block")
