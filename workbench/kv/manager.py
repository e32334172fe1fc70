"""The KV-cache manager: block tables, slot allocation and the memory figures.

Paged allocation as in PagedAttention (Kwon et al., SOSP 2023, §4.1–4.2): a
request's K/V live in fixed-size blocks that need not be contiguous; its block
table maps logical block ``i`` (tokens ``i*block_size .. (i+1)*block_size-1``)
to a physical block. Blocks are allocated only when tokens are scheduled, so a
request holds at most one partly filled block.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.kv.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

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

    def blocks_needed(self, request_id: str, num_total_tokens: int) -> int:
        """New blocks a request needs so that ``num_total_tokens`` slots are allocated."""
        have = len(self.block_tables.get(request_id, ()))
        return max(0, cdiv(num_total_tokens, self.block_size) - have)

    def can_allocate(self, request_id: str, num_total_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_total_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Make sure slots ``0 .. num_total_tokens-1`` of the request are backed by blocks.

        Args:
            request_id: the request.
            num_total_tokens: tokens computed so far + tokens scheduled this step.

        Returns:
            ``False`` (and allocates nothing) when too few blocks are free.
        """
        need = self.blocks_needed(request_id, num_total_tokens)
        if need > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(request_id, [])
        if need:
            table.extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        """Release every block of a request (no-op for a request holding none)."""
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
        allocated = (self.pool.num_blocks - self.pool.num_free_blocks) * self.block_size
        token_states = sum(num_computed.get(r, 0) for r in self.block_tables)
        free = self.pool.num_free_blocks * self.block_size
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
