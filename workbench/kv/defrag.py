"""KV defragmentation by block copies: compaction plans, triggers, and a record of every pass.

A *pass* moves live blocks into free ones (:meth:`~workbench.kv.interface.KVManager.move_blocks`: the block tables
are rewritten and the copies ride in the step's ``SchedulerOutput.block_copies``, after copy-on-write; rules in
:mod:`workbench.kv.moves`). What a pass moves (:func:`plan_compaction`):

* **contiguous** allocators (``regions``): whole regions slide down, lowest first, closing the holes below them;
  with a waiting request's need (blocks) the pass stops as soon as one free run holds it.
* **paged** and any other table-based manager: Intel Gaudi's rule — the highest used blocks go into the lowest
  free ones, pairwise, while the free block is below the used one.

When (``kv_defrag_trigger``; the engine calls :meth:`Defragmenter.after_schedule` once per step, after
scheduling, so a request unblocked by a pass is admitted in the next step):

==================  ==============================================================================================
``none``            never (the default); :meth:`Defragmenter.compact` (``LLMEngine.compact``) runs a pass on demand
``fragmentation``   the fragmentation rate (docs/architecture.md §3: (reservation + internal + external) / occupied, as
                    :mod:`workbench.metrics.accounting` computes it after the previous step) exceeds the threshold
                    (default 0.5). Compaction can only remove the *external* part, so this fires on waste it
                    cannot reduce; a pass with nothing to move costs nothing.
``waiting``         the first waiting request needs consecutive blocks (``reservation_blocks``) that the free
                    blocks would hold but no free run does: external fragmentation blocks admission
``highest-block``   (highest used block id + 1) - used blocks > threshold (default 32)
==================  ==============================================================================================

Source of the ``highest-block`` rule: Intel Gaudi's vLLM plugin (github.com/vllm-project/vllm-gaudi,
``vllm_gaudi/extension/defragmentation.py``, ``OnlineDefragmenter.defragment``). There it is on by default with
contiguous paged attention (feature ``defrag`` follows ``VLLM_CONTIGUOUS_PA``, itself on when prefix caching is
off), runs before every model step, fires when ``max_used - VLLM_DEFRAG_THRESHOLD > num_used`` (threshold default
32), swaps the highest used blocks with the lowest free ones pairwise until a free block lies above the used one,
and does at most 512 swaps per pass (its largest padded swap size, ``to_swap_pad_thresholds[-1]``). Differences
here: Gaudi reserves block 0 (free blocks count from 1) so its gap is ``max_used - num_used``, ours counts from 0;
Gaudi remaps ids inside the worker (the scheduler never sees the swap) and, with prefix caching, swaps the free
block's content back so a cached free block survives — here the block tables are rewritten and a cached free
destination is evicted; the pass size is ``kv_defrag_max_moves`` (default 512, as Gaudi).

Each pass is a :class:`DefragPass` (blocks and bytes moved, the highest-block gap and largest free run before and
after, the requests it unblocked); per step they are summed into ``StepStats.defrag_*``, with the step's copy time
(``StepStats.copy_time_s``, measured by the executor).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from workbench.kv.interface import KVManager

#: the trigger's threshold when ``kv_defrag_threshold`` is not given (fragmentation: a rate; highest-block: blocks)
DEFAULT_THRESHOLDS = {"fragmentation": 0.5, "highest-block": 32}
#: Gaudi's most swaps in one pass (vllm-gaudi ``OnlineDefragmenter.to_swap_pad_thresholds[-1]``)
DEFAULT_MAX_MOVES = 512


def used_blocks(kv: KVManager) -> set[int]:
    """Block ids some request's table holds."""
    return {b for t in kv.block_tables.values() for b in t}


def highest_block_gap(kv: KVManager) -> int:
    """Free blocks below the highest used one: ``highest used id + 1 - used blocks`` (0 when packed or empty)."""
    used = used_blocks(kv)
    return max(used) + 1 - len(used) if used else 0


def largest_free_run(kv: KVManager) -> int:
    """Blocks in the largest run of consecutive free blocks (:meth:`KVManager.free_runs`)."""
    return max((n for _, n in kv.free_runs()), default=0)


def supports_moves(kv: KVManager | type[KVManager]) -> bool:
    """Whether the manager (or its class) overrides :meth:`KVManager.move_blocks` (plug-ins refuse by default)."""
    cls = kv if isinstance(kv, type) else type(kv)
    return cls.move_blocks is not KVManager.move_blocks


def check_trigger(trigger: str, kv: KVManager | type[KVManager], name: str) -> None:
    """Refuse a compaction trigger other than ``"none"`` on a manager (or manager class) that cannot move blocks.

    Raises:
        ValueError: naming ``kv_defrag_trigger``, the allocator ``name`` and the fix.
    """
    if trigger != "none" and not supports_moves(kv):
        raise ValueError(
            f"kv_defrag_trigger={trigger!r} needs a KV manager that moves blocks, but kv_allocator={name!r} "
            "does not implement move_blocks; use kv_defrag_trigger='none', or an allocator that moves blocks (paged, the "
            "contiguous ones, best-fit; not buddy, whose blocks must stay aligned)"
        )


def plan_compaction(kv: KVManager, max_moves: int, need_blocks: int = 0) -> list[tuple[int, int]]:
    """The moves of one pass, in order (at most ``max_moves``; none when already packed).

    Args:
        kv: the manager; one with ``regions`` (contiguous: ``(start, num_blocks, request id)`` sorted by start) moves
            whole regions, any other moves single blocks by Gaudi's rule (module docstring).
        max_moves: most moves (blocks); a contiguous region larger than what is left of it stops the pass.
        need_blocks: contiguous only: stop once a free run holds this many blocks (0 = pack everything).

    Raises:
        ValueError: ``max_moves < 1``.
    """
    if max_moves < 1:
        raise ValueError(f"max_moves={max_moves} must be >= 1 (blocks moved in one pass)")
    if hasattr(kv, "regions"):
        return _plan_regions(kv.regions, kv.num_blocks, max_moves, need_blocks)
    used = sorted(used_blocks(kv), reverse=True)
    taken = set(used)
    free = (b for b in range(kv.num_blocks) if b not in taken)
    moves = []
    for u, f in zip(used, free):
        if f > u or len(moves) >= max_moves:
            break
        moves.append((u, f))
    return moves


def _plan_regions(regions, num_blocks: int, max_moves: int, need_blocks: int) -> list[tuple[int, int]]:
    """Slide regions down in address order (each block moves to ``cur + i``, lowest first: a destination is free
    or vacated by an earlier move of the same region)."""
    # after_gap[k]: the largest free run from region k's end on, while regions k.. are still in place
    after_gap = [0] * len(regions)
    run = num_blocks - (regions[-1][0] + regions[-1][1]) if regions else num_blocks
    for k in range(len(regions) - 1, -1, -1):
        after_gap[k] = run
        if k:
            run = max(run, regions[k][0] - regions[k - 1][0] - regions[k - 1][1])
    moves: list[tuple[int, int]] = []
    cur = 0
    for k, (start, n, _) in enumerate(regions):
        if need_blocks and max(start - cur, after_gap[k]) >= need_blocks:
            break
        if start > cur:
            if len(moves) + n > max_moves:
                break
            moves += [(start + i, cur + i) for i in range(n)]
        cur += n
    return moves


@dataclass
class DefragPass:
    """One compaction pass. Blocks and bytes as moved (bytes = blocks x block bytes, K and V of every layer)."""

    trigger: str  #: what ran it: a trigger's name, or "admin" (:meth:`Defragmenter.compact`)
    blocks_moved: int
    bytes_moved: int
    gap_before: int  #: :func:`highest_block_gap` before / after (blocks)
    gap_after: int
    largest_run_before: int  #: :func:`largest_free_run` before / after (blocks)
    largest_run_after: int
    #: waiting requests whose reservation no free run held before the pass
    blocked: list[str] = field(default_factory=list)
    #: of ``blocked``, requests admitted in the step after the pass
    unblocked: int = 0
    #: seconds of its copies when run on their own (admin passes); ``None`` when carried by a step
    copy_time_s: float | None = None


@dataclass
class DefragStep:
    """What compaction did in one engine step (``SchedulerOutput.defrag``; summed into ``StepStats``)."""

    passes: int = 0
    blocks_moved: int = 0
    bytes_moved: int = 0
    unblocked: int = 0
    carried: int = 0  #: moves appended to the step's ``block_copies`` (the rest ran between steps)
    copy_time_s: float = 0.0  #: seconds of copies run between steps (admin passes)

    def add(self, p: DefragPass) -> None:
        self.passes += 1
        self.blocks_moved += p.blocks_moved
        self.bytes_moved += p.bytes_moved
        self.copy_time_s += p.copy_time_s or 0.0


class Defragmenter:
    """Runs compaction passes over one KV manager: by trigger once per step, or on demand.

    Args:
        kv: the engine's KV manager.
        trigger: one of ``workbench.config.KV_DEFRAG_TRIGGERS`` (module docstring).
        threshold: the trigger's threshold (``None``: :data:`DEFAULT_THRESHOLDS`).
        max_moves: most block moves per pass.
        block_bytes: bytes of one block (K and V, every layer) for the records.
        usage: returns the pool split after the last step (anything with ``fragmentation_rate``) or ``None``.

    Raises:
        ValueError: a trigger other than ``"none"`` on a manager that cannot move blocks (a plug-in that does not
            implement :meth:`KVManager.move_blocks`), or ``max_moves < 1``.
    """

    def __init__(
        self,
        kv: KVManager,
        trigger: str = "none",
        threshold: float | None = None,
        max_moves: int = DEFAULT_MAX_MOVES,
        block_bytes: int = 0,
        usage: Callable[[], object] | None = None,
    ) -> None:
        check_trigger(trigger, kv, kv.name)
        if max_moves < 1:
            raise ValueError(f"kv_defrag_max_moves={max_moves} must be >= 1")
        self.kv, self.trigger, self.max_moves, self.block_bytes = kv, trigger, max_moves, block_bytes
        self.threshold = DEFAULT_THRESHOLDS.get(trigger, 0) if threshold is None else threshold
        self.usage = usage
        self.passes: list[DefragPass] = []
        self._pending: DefragStep | None = None  # admin passes since the last step
        self._last: DefragPass | None = None  # the last pass whose unblocked requests are still to count

    @classmethod
    def from_config(cls, config, kv: KVManager, block_bytes: int, accounting=None) -> Defragmenter:
        """The engine's: ``config.kv_defrag_*``; the fragmentation rate from ``accounting.last_usage``."""
        usage = (lambda: getattr(accounting, "last_usage", None)) if accounting is not None else None
        t, th, mm = config.kv_defrag_trigger, config.kv_defrag_threshold, config.kv_defrag_max_moves
        return cls(kv, t, th, mm, block_bytes, usage)

    # ------------------------------------------------------------------ triggers
    def should_compact(self, waiting) -> tuple[bool, int]:
        """``(fire, need_blocks)`` for the trigger, given the waiting queue (requests, first come first)."""
        kv, t = self.kv, self.trigger
        if t == "fragmentation":
            u = self.usage() if self.usage is not None else None
            return (u is not None and u.fragmentation_rate > self.threshold), 0
        if t == "highest-block":
            return highest_block_gap(kv) > self.threshold, 0
        if t == "waiting" and waiting:
            need = kv.reservation_blocks(waiting[0].request_id)
            return (0 < need <= kv.num_free_blocks and largest_free_run(kv) < need), need
        return False, 0

    # ------------------------------------------------------------------ passes
    def run_pass(self, trigger: str, max_moves: int, need_blocks: int = 0, waiting=()) -> DefragPass | None:
        """Plan and apply one pass (the copies are queued in the manager); ``None`` when nothing moves."""
        kv = self.kv
        moves = plan_compaction(kv, max_moves, need_blocks)
        if not moves:
            return None
        run0, gap0 = largest_free_run(kv), highest_block_gap(kv)
        blocked = [r.request_id for r in waiting if kv.reservation_blocks(r.request_id) > run0]
        kv.move_blocks(moves)
        n = len(moves)
        p = DefragPass(trigger, n, n * self.block_bytes, gap0, highest_block_gap(kv), run0, largest_free_run(kv))
        p.blocked = blocked
        self.passes.append(p)
        self._last = p
        return p

    def after_schedule(self, out, scheduler) -> None:
        """The engine's hook, once per step after scheduling: count what the last pass unblocked, and run a pass
        when the trigger fires; its copies join ``out.block_copies`` and ``out.defrag`` gets the step's record.

        No pass runs in a step that swaps blocks in (a swapped-in block is written after the device copies, so it
        must not be a move's source)."""
        rec, self._pending = self._pending, None
        if self.trigger == "none" and rec is None and self._last is None:
            return
        rec = rec or DefragStep()
        if self._last is not None:
            admitted = {s.request.request_id for s in out.scheduled}
            rec.unblocked = self._last.unblocked = sum(r in admitted for r in self._last.blocked)
            self._last = None
        if self.trigger != "none" and not out.swap_in:
            fire, need = self.should_compact(scheduler.waiting)
            p = self.run_pass(self.trigger, self.max_moves, need, scheduler.waiting) if fire else None
            if p is not None:
                copies = self.kv.take_pending_copies()
                out.block_copies = [*out.block_copies, *copies]
                rec.carried += len(copies)
                rec.add(p)
        out.defrag = rec if (rec.passes or rec.unblocked) else None

    def compact(self, max_moves: int | None = None, copy: Callable | None = None, waiting=()) -> DefragPass | None:
        """One pass now, between steps (the admin call ``LLMEngine.compact``): plan, move, and run the copies
        through ``copy(pairs)`` (the executor's device copies; it may return the seconds they took, as the
        simulator's does, else they are timed here). Returns the pass, or ``None`` when nothing had to move.

        Raises:
            NotImplementedError: the manager cannot move blocks.
            ValueError: ``max_moves < 1``.
        """
        if not supports_moves(self.kv):
            raise NotImplementedError(f"kv_allocator={self.kv.name!r} cannot move blocks: compaction is unsupported")
        p = self.run_pass("admin", self.max_moves if max_moves is None else max_moves, 0, waiting)
        if p is None:
            return None
        copies = self.kv.take_pending_copies()
        t0 = time.perf_counter()
        took = copy(copies) if copy is not None else None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # device copies are asynchronous: time them to completion
        p.copy_time_s = took if isinstance(took, float) else time.perf_counter() - t0
        self._pending = self._pending or DefragStep()
        self._pending.add(p)
        return p

    def summary(self) -> dict:
        """Totals over the run: passes, blocks, bytes, copy seconds of admin passes, requests unblocked."""
        ps = self.passes
        return {
            "defrag_passes": len(ps),
            "defrag_blocks_moved": sum(p.blocks_moved for p in ps),
            "defrag_bytes_moved": sum(p.bytes_moved for p in ps),
            "defrag_unblocked_reqs": sum(p.unblocked for p in ps),
        }
