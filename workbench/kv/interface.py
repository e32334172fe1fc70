"""The KV-manager interface: everything the scheduler, the engine and the accounting use of a manager.

A KV manager hands out *token slots* of one pool (``num_blocks`` blocks of ``block_size`` slots),
block by block, and keeps each request's *block table* (its physical blocks in logical order). The
scheduler decides who runs; the manager says yes or no to a request for slots and remembers who
holds what. Memory figures (docs/architecture.md §3) are computed from this interface by
:mod:`workbench.metrics.accounting`: a manager never computes one. vLLM v1 draws the same line
between its scheduler and ``KVCacheManager`` (vllm/v1/core/kv_cache_manager.py).

Implemented by the paged manager (:mod:`workbench.kv.manager`; PagedAttention, Kwon et al., SOSP
2023, §4), the contiguous baselines (:mod:`workbench.kv.contiguous`) and plug-ins
(``kv_allocator="package.module:ClassName"``, built as ``ClassName(num_blocks, block_size)``):
implement the abstract methods, override the optional capabilities the manager has. Units: tokens
(slots); block ids index ``0 .. num_blocks-1``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping


class KVManager(ABC):
    """A pool of KV blocks and the block tables of the requests holding them.

    Attributes every manager sets:
        name: the allocator's name (``"paged"``, ``"orca-max"``, ...; shown in block maps and reports).
        block_size: token slots per block.
        block_tables: request id -> its physical block ids, logical order (read-only for callers;
            no entry for a request holding no blocks).
        enable_prefix_caching: :meth:`find_cached_prefix` can find blocks, which are then shared.
        supports_fork: :meth:`fork` shares blocks (parallel sampling, ``n > 1``, needs it).
    """

    name: str
    block_size: int
    block_tables: Mapping[str, list[int]]
    enable_prefix_caching: bool = False
    supports_fork: bool = False

    # ------------------------------------------------------------------ the pool
    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks in the pool."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int:
        """Blocks no request holds (a free block that still caches a prefix counts as free)."""

    @property
    def pool_tokens(self) -> int:
        """Token slots in the pool (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    @property
    def may_share_blocks(self) -> bool:
        """``True`` once some block may have two owners (a fork, a prefix-cache hit). While ``False``,
        :meth:`allocate_slots` for tokens the request's blocks already cover is a no-op returning
        ``True``, which the scheduler skips (the decode fast path; see docs/benchmarks.md, section
        "Replay speed")."""
        return False

    # ------------------------------------------------------------------ slots
    @abstractmethod
    def allocate_slots(self, request_id: str, num_total_tokens: int, cached_blocks=(), write_start=None) -> bool:
        """Back slots ``0 .. num_total_tokens-1`` of the request with blocks.

        Args:
            request_id: the request.
            num_total_tokens: tokens computed so far + tokens scheduled this step.
            cached_blocks: prefix-cache hits (:meth:`find_cached_prefix`) that start the block
                table of a request holding no blocks yet.
            write_start: first position written this step; a shared block from there on is
                copied on write (the copy is queued for :meth:`take_pending_copies`).

        Returns:
            ``False``, and nothing changed, when the pool cannot back them now.
        """

    @abstractmethod
    def free(self, request_id: str) -> None:
        """Release every block of the request (no-op for a request holding none)."""

    def get_block_table(self, request_id: str) -> list[int]:
        """The request's physical block ids (empty when it holds none)."""
        return self.block_tables.get(request_id, [])

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Physical slot of each token position ``start .. end-1``: ``table[p // bs] * bs + p % bs``.

        Raises:
            KeyError: the request holds no blocks.
        """
        bs = self.block_size
        table = self.block_tables[request_id]
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """``(src, dst)`` device block copies queued since the last call, in order (copy-on-write, then moves);
        the scheduler hands them to the executor with the step."""
        copies, self.pending_copies = getattr(self, "pending_copies", []), []
        return copies

    def move_blocks(self, moves: list[tuple[int, int]]) -> None:
        """Relocate live blocks ``(src, dst)`` in list order, rewriting block tables and queueing the copies (rules:
        :mod:`workbench.kv.moves`). Raises ``NotImplementedError`` where unsupported (the default)."""
        raise NotImplementedError(f"kv_allocator={self.name!r} cannot move blocks: compaction is unsupported")

    # ---------------------------------------------------- reservation (contiguous)
    def declare(
        self,
        request_id: str,
        num_prompt_tokens: int,
        max_tokens: int,
        max_model_len: int,
        true_output_len: int | None = None,
    ) -> int | None:
        """A request's sizes before it is queued (tokens), for a manager that reserves ahead.

        Contiguous allocators size their reservation from them (``true_output_len``: the true
        output length, from a trace or an earlier run, where the engine ends the request); a manager that allocates on demand ignores them.

        Returns:
            the largest output the reservation will hold (the engine caps ``max_tokens`` at it),
            or ``None`` for no cap.

        Raises:
            ValueError: the request cannot be sized (e.g. a length the allocator needs is missing);
                nothing is queued.
        """
        return None

    def forget(self, request_id: str) -> None:
        """The request has ended: drop what :meth:`declare` recorded."""
        return None

    def refuse(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt this long can never run on this manager (the request's error), or ``None``; asked after the
        engine's own checks (:func:`workbench.inputs.prompt_refusal`), so a refused request ends alone."""
        return None

    def reservation_blocks(self, request_id: str) -> int:
        """Consecutive blocks the request needs at admission (0: any free blocks serve it).

        A waiting request with a positive need sees free runs shorter than it as *external
        fragmentation* (docs/architecture.md §3).
        """
        return 0

    def free_runs(self) -> list[tuple[int, int]]:
        """Free runs ``(first block, num_blocks)`` in address order (for external fragmentation
        and block maps; only read when some request needs consecutive blocks)."""
        tables = self.block_tables
        used = sorted(b for t in tables.values() for b in t)
        runs, cur = [], 0
        for b in used:
            if b > cur:
                runs.append((cur, b - cur))
            cur = max(cur, b + 1)
        if cur < self.num_blocks:
            runs.append((cur, self.num_blocks - cur))
        return runs

    # ------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, token_ids: list[int]) -> list[int]:
        """Physical blocks of the longest cached prefix of ``token_ids`` (its last token is never
        covered: it must run to produce logits); empty without prefix caching."""
        return []

    def num_hashed_blocks(self, request_id: str) -> int:
        """Full blocks of the request registered in the prefix cache so far."""
        return 0

    def cache_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Register the request's blocks whose ``block_size`` tokens are all computed."""
        return None

    def cached_free_blocks(self) -> list[int]:
        """Free blocks that still hold a cached prefix (reusable by a hit); empty without prefix caching."""
        return []

    # ------------------------------------------------------------------ fork
    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """Give ``child_id`` the parent's blocks covering ``num_tokens`` tokens, shared (parallel sampling).

        Raises:
            NotImplementedError: the manager cannot share blocks (then ``n > 1`` is refused).
        """
        raise NotImplementedError(f"kv_allocator={self.name!r} does not share blocks: parallel sampling needs paged")

    # ------------------------------------------------------------------ swap
    def can_swap_out(self, request_id: str) -> bool:
        """Room in the CPU swap pool for the request's blocks (``False`` without swap space)."""
        return False

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's blocks to the swap pool; ``(device_block, cpu_block)`` pairs to copy.

        Raises:
            RuntimeError: no room (call :meth:`can_swap_out` first).
        """
        raise RuntimeError(f"kv_allocator={self.name!r} has no swap space")

    def can_swap_in(self, request_id: str, num_total_tokens: int = 0) -> bool:
        """Room for the swapped request's blocks and ``num_total_tokens`` slots in all."""
        return False

    def swap_in(self, request_id: str) -> list[tuple[int, int]]:
        """Bring a swapped request back; ``(cpu_block, device_block)`` pairs to copy."""
        raise RuntimeError(f"kv_allocator={self.name!r} has no swap space")

    def drop_swapped(self, request_id: str) -> None:
        """Release a swapped request's CPU blocks (it was aborted); no-op otherwise."""
        return None

    # ------------------------------------------------------------------ tests
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the manager's state is inconsistent (tests call it every step)."""
        return None
