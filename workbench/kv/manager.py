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
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
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

    def allocate_slots(self, request_id: str, num_total_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make sure slots ``0 .. num_total_tokens-1`` of the request are backed by blocks.

        Args:
            request_id: the request.
            num_total_tokens: tokens computed so far + tokens scheduled this step.
            cached_blocks: prefix-cache hits (from :meth:`find_cached_prefix`) that start the
                block table of a request holding no blocks yet.

        Returns:
            ``False`` (and changes nothing) when too few blocks are free.
        """
        table = self.block_tables.get(request_id)
        have = len(table) if table else 0
        need = max(0, cdiv(num_total_tokens, self.block_size) - have - len(cached_blocks))
        # hits on free cached blocks leave the free queue: they are not available for new blocks
        reclaimed = sum(1 for b in cached_blocks if self.pool.ref_cnt[b] == 0)
        if need > self.pool.num_free_blocks - reclaimed:
            return False
        if table is None:
            table = self.block_tables[request_id] = []
        for b in cached_blocks:
            self.pool.touch(b)
        table.extend(cached_blocks)
        if cached_blocks:
            self._hashes[request_id] = [self.pool.block_hash[b] for b in cached_blocks]
        if need:
            table.extend(self.pool.allocate(need))
        return True

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

    def usage(self, num_computed: dict[str, int]) -> KVUsage:
        """The pool split after a step.

        Args:
            num_computed: tokens with K/V in the cache, per request holding blocks.
        """
        bs = self.block_size
        allocated = (self.pool.num_blocks - self.pool.num_free_blocks) * bs
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
        free = self.pool.num_free_blocks * bs
        return KVUsage(
            pool=self.pool_tokens,
            token_states=token_states,
            reservation=0,
            internal_fragmentation=allocated - token_states,
            external_fragmentation=0,
            free=free,
        )

    def check_invariants(self) -> None:
        """Assert that block tables and reference counts agree (for tests)."""
        self.pool.check_invariants()
        owners = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for b in table:
                owners[b] += 1
        if owners != self.pool.ref_cnt:
            raise AssertionError("reference counts differ from the number of block tables holding each block")
