"""Contiguous KV allocators: the baselines PagedAttention replaced (vLLM paper, Kwon et al., SOSP 2023, §2.3, §6.1).

Before PagedAttention, serving systems stored a request's KV cache in one contiguous chunk of memory sized, at
admission, for the longest the request could become. This module reproduces that inside the same engine: the pool is
one address range of ``num_blocks`` blocks; a request reserves one run of consecutive blocks when it is admitted;
placement is **first-fit** (the lowest-addressed hole that is large enough), so holes left by finished requests
fragment the range and *external fragmentation* is real. The model runs unchanged: a contiguous region
``[start, start + n)`` is simply the block table ``[start, start+1, ..., start+n-1]``.

How much each request reserves (tokens, rounded up to whole blocks, capped by the pool):

==============  ====================================================================================================
``static``      ``max_model_len`` for every request (a padded tensor of the longest sequence the model allows;
                FasterTransformer-style static batching)
``orca-max``    prompt + ``max_tokens`` (capped by ``max_model_len``): the most the request may produce (Orca, Yu et
                al., OSDI 2022, as the vLLM paper's "Orca (Max)" with a per-request cap)
``orca-pow2``   prompt + the true output length rounded up to a power of two, capped by ``max_tokens`` ("Orca
                (Pow2)": over-reserves by less than 2x; needs the true length)
``orca-oracle`` prompt + the true output length ("Orca (Oracle)"; needs the true length)
==============  ====================================================================================================

The true output length comes from the trace or a previous run (``true_output_len`` of
:meth:`workbench.engine.LLMEngine.add_request`, which also ends the request there, for every allocator).

A request whose reservation does not fit any hole waits (the scheduler stops admitting, first come first served), as
it would in such a system. Once admitted it never needs another block, so it is never preempted. Prefix caching,
swapping and parallel sampling need block sharing or moving and are refused with these allocators."""

from __future__ import annotations

from bisect import insort

from workbench.kv.interface import KVManager
from workbench.kv.manager import cdiv
from workbench.kv.moves import move_contiguous

#: allocator names accepted by ``EngineConfig.kv_allocator``
from workbench.config import CONTIGUOUS_ALLOCATORS, KV_ALLOCATORS  # noqa: F401  # isort: skip  (declared in config)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def reservation_tokens(
    allocator: str, num_prompt_tokens: int, max_tokens: int, max_model_len: int, true_output_len: int | None = None
) -> int:
    """Tokens a contiguous allocator reserves for a request at admission: at most ``max_model_len``, except for
    ``orca-pow2``, which may round beyond it (the caller caps by the pool). Raises ``ValueError`` for an unknown
    allocator, or ``orca-pow2``/``orca-oracle`` without ``true_output_len``.

    Args:
        allocator: one of :data:`CONTIGUOUS_ALLOCATORS`.
        num_prompt_tokens, max_tokens, max_model_len: the prompt's length, the request's output cap and the engine's
            longest sequence (tokens).
        true_output_len: the true output length (tokens), for ``orca-pow2`` / ``orca-oracle``.
    """
    if allocator == "static":
        return max_model_len
    if allocator == "orca-max":
        return min(num_prompt_tokens + max_tokens, max_model_len)
    if allocator in ("orca-pow2", "orca-oracle"):
        if true_output_len is None:
            raise ValueError(
                f"kv_allocator={allocator!r} reserves by the request's true output length, which was not given; "
                "pass true_output_len to add_request (true_output_lens to LLM.generate / run_job; workbench "
                "compare takes them from the trace or a paged run first), or use kv_allocator='orca-max'"
            )
        out = max(1, min(true_output_len, max_tokens))
        if allocator == "orca-oracle":
            return min(num_prompt_tokens + out, max_model_len)
        return num_prompt_tokens + min(next_pow2(out), max(max_tokens, out))
    raise ValueError(f"kv_allocator={allocator!r} is not contiguous; use one of {CONTIGUOUS_ALLOCATORS}")


class ContiguousKVCacheManager(KVManager):
    """First-fit contiguous reservation over one block address range.

    The :class:`~workbench.kv.interface.KVManager` interface (the scheduler and the model runner cannot tell it from
    paged allocation); :meth:`declare` sets each request's reservation size. No prefix caching, swapping or forking
    (the interface's defaults: nothing cached, no swap space, ``fork`` refused).

    Args:
        num_blocks: blocks in the pool (the address range is ``0 .. num_blocks-1``).
        block_size: token slots per block.
        allocator: a name from :data:`CONTIGUOUS_ALLOCATORS` (for reports); another raises ``ValueError``.
    """

    def __init__(self, num_blocks: int, block_size: int, allocator: str = "static") -> None:
        if allocator not in CONTIGUOUS_ALLOCATORS:
            raise ValueError(f"allocator={allocator!r} must be one of {CONTIGUOUS_ALLOCATORS}")
        self.allocator = self.name = allocator
        self.block_size = block_size
        self._num_blocks = num_blocks
        self.block_tables: dict[str, list[int]] = {}
        #: ``(start, num_blocks, request_id)`` of every reserved region, sorted by start
        self.regions: list[tuple[int, int, str]] = []
        self._reserve: dict[str, int] = {}  # request -> reserved tokens (declared)
        self._used_blocks = 0

    def declare(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        true_output_len: int | None = None,
    ) -> int | None:
        """Size the request's reservation (:func:`reservation_tokens`, capped by the pool). No output cap: the
        request ends at ``min(true_output_len, max_tokens)`` (the engine stops it there), which the reservation holds."""
        reserve = reservation_tokens(self.allocator, num_prompt_tokens, max_tokens, max_model_len, true_output_len)
        self._reserve[request_id] = max(1, min(reserve, self.pool_tokens))
        return None

    def reservation_blocks(self, request_id: str) -> int:
        """Blocks the request reserves at admission (0 if it was never declared)."""
        return cdiv(self._reserve.get(request_id, 0), self.block_size)

    def free_runs(self) -> list[tuple[int, int]]:
        """Free runs ``(start, num_blocks)`` in address order (the holes between regions)."""
        out, cur = [], 0
        for start, n, _ in self.regions:
            if start > cur:
                out.append((cur, start - cur))
            cur = start + n
        if cur < self._num_blocks:
            out.append((cur, self._num_blocks - cur))
        return out

    def first_fit(self, num_blocks: int) -> int | None:
        """Start of the lowest-addressed hole of at least ``num_blocks`` blocks, or ``None``."""
        return next((start for start, n in self.free_runs() if n >= num_blocks), None)

    place = first_fit  #: placement hook: start of a hole for ``num_blocks``, or ``None`` (see allocators.best_fit)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_blocks - self._used_blocks

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, cached_blocks=(), write_start: int | None = None
    ) -> bool:
        """Reserve the request's whole region at its first call (placed by :meth:`place`); later calls check it. Returns
        ``False`` (and changes nothing) when no hole holds the reservation. Raises ``RuntimeError`` if
        ``num_total_tokens`` exceeds the reservation (a bug: the engine caps requests by it)."""
        table = self.block_tables.get(request_id)
        if table is None:
            need = max(self.reservation_blocks(request_id), cdiv(num_total_tokens, self.block_size))
            start = self.place(need)
            if start is None:
                return False
            insort(self.regions, (start, need, request_id))
            self._used_blocks += need
            table = self.block_tables[request_id] = list(range(start, start + need))
        if num_total_tokens > len(table) * self.block_size:
            raise RuntimeError(
                f"request {request_id} needs {num_total_tokens} slots but reserved {len(table) * self.block_size} "
                f"({self.allocator}); its output cap must not exceed its reservation"
            )
        return True

    def free(self, request_id: str) -> None:
        """Release the request's region (no-op for a request holding none)."""
        table = self.block_tables.pop(request_id, None)
        if table:
            self.regions = [r for r in self.regions if r[2] != request_id]
            self._used_blocks -= len(table)

    def move_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Move whole regions (compaction; :func:`~workbench.kv.moves.move_contiguous`)."""
        move_contiguous(self, moves)

    def forget(self, request_id: str) -> None:
        """Drop the request's declared reservation (it has ended)."""
        self._reserve.pop(request_id, None)

    def check_invariants(self) -> None:
        """Assert that regions are disjoint, inside the range, and match the block tables (for tests)."""
        end = 0
        for start, n, rid in self.regions:
            if start < end or n < 1:
                raise AssertionError(f"region of {rid} at {start}+{n} overlaps the previous one (ends at {end})")
            if self.block_tables.get(rid) != list(range(start, start + n)):
                raise AssertionError(f"block table of {rid} differs from its region")
            end = start + n
        if end > self._num_blocks:
            raise AssertionError("a region runs past the pool")
        if sum(n for _, n, _ in self.regions) != self._used_blocks or len(self.regions) != len(self.block_tables):
            raise AssertionError("used-block count differs from the regions")
