"""The paged KV-cache manager: block tables, slot allocation, prefix caching, swapping.

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

from workbench.kv.block_pool import BlockPool
from workbench.kv.interface import KVManager
from workbench.kv.moves import move_paged


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes | None, token_ids: list[int]) -> bytes:
    """SHA-256 of the parent block's hash and this block's token ids (int64 little-endian)."""
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager(KVManager):
    """Paged allocation (the :class:`~workbench.kv.interface.KVManager` interface): token slots, block by block.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: keep full blocks findable by content hash.
        num_cpu_blocks: blocks of the CPU swap pool (0 = no swapping).
        eviction_policy: which free cached block is evicted first: ``"lru"``, ``"fifo"``, ``"lfu"`` or a plug-in.
    """

    name = "paged"
    supports_fork = True

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching=False, num_cpu_blocks=0, eviction_policy="lru"
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, eviction_policy)
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
    def may_share_blocks(self) -> bool:
        return self.pool.ever_shared

    def move_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Relocate live blocks, with their reference counts and prefix-cache hashes (:func:`move_paged`)."""
        move_paged(self, moves)

    def cached_free_blocks(self) -> list[int]:
        return self.pool.cached_free_blocks()

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
        need = max(0, cdiv(num_total_tokens, bs) - have - len(cached_blocks))
        ref = self.pool.ref_cnt
        cow = []  # shared blocks in the written range (none can be shared before the pool ever shares one)
        if table and write_start is not None and self.pool.ever_shared:
            cow = [i for i in range(write_start // bs, min(have, cdiv(num_total_tokens, bs))) if ref[table[i]] > 1]
        if not (need or cow or cached_blocks):
            return True  # the common step of a running request: a decode inside its last block
        # hits on free cached blocks leave the free queue: they are not available for new blocks
        reclaimed = sum(1 for b in cached_blocks if ref[b] == 0)
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
