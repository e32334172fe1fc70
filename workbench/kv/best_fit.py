"""Best-fit contiguous reservation: ``kv_allocator="best-fit"``.

The same reservation as ``orca-max`` (prompt + ``max_tokens``, capped by ``max_model_len`` and the pool; see
:mod:`workbench.kv.contiguous`), placed in the *smallest* free hole that holds it (ties: the lowest address) instead of
the lowest-addressed one. Best fit keeps large holes whole for large requests at the price of leaving slivers
(Knuth, *The Art of Computer Programming*, vol. 1, §2.5, "best-fit method"; Wilson et al., *Dynamic Storage
Allocation: A Survey and Critical Review*, IWMM 1995, §3.4). Everything else — sizing, refusal, accounting, block maps
— is :class:`~workbench.kv.contiguous.ContiguousKVCacheManager`'s; only its placement hook differs.
"""

from __future__ import annotations

from workbench.kv.contiguous import ContiguousKVCacheManager


class BestFitKVCacheManager(ContiguousKVCacheManager):
    """``orca-max`` reservations placed best-fit over one block address range.

    Args:
        num_blocks: blocks in the pool (the address range is ``0 .. num_blocks-1``).
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size, "orca-max")  # the reservation's size: orca-max's
        self.name = "best-fit"

    def place(self, num_blocks: int) -> int | None:
        """Start of the smallest free hole of at least ``num_blocks`` blocks (the lowest-addressed of equal
        ones), or ``None`` when no hole holds them."""
        fits = [(n, start) for start, n in self.free_runs() if n >= num_blocks]
        return min(fits)[1] if fits else None
