"""Where the KV pool went: the five-way split of docs/architecture.md §3, its settling, block maps.

Computed here, from what the :class:`~workbench.kv.interface.KVManager` interface exposes
(block tables, block size, free blocks, free runs, a waiting request's consecutive need,
cached free blocks) and the requests' own counters — never by an allocator. Any manager that
implements the interface gets every figure below without a line of accounting code.

Definitions (Kwon et al., *Efficient Memory Management for Large Language Model Serving with
PagedAttention*, SOSP 2023, §2.3 and Fig. 2), all in token slots:

* **token states**: slots holding K/V of computed tokens (a block shared under prefix caching
  counts once);
* **reservation**: allocated slots a request may still write (below its bound, prompt + output
  cap - 1, since the last sampled token is never written);
* **internal fragmentation**: allocated slots it will never write;
* **external fragmentation**: free slots in runs shorter than the first waiting request's
  consecutive need (zero for paged allocation: any free block serves);
* **free**: the rest. The five sum to the pool.

Which allocated slots a request will still write is known only when it releases them, so a
step's reservation / internal split is provisional; :class:`PoolAccounting` settles it in every
step the request held memory once it releases them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from workbench.kv.interface import KVManager


@dataclass
class KVUsage:
    """The pool split of docs/architecture.md §3, in token slots (multiply by KV bytes per token for bytes).

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


def shared_token_states(kv: KVManager, num_computed: Mapping[str, int]) -> int:
    """Slots holding token states, a block shared by several requests counted once (its fullest fill)."""
    bs = kv.block_size
    filled: dict[int, int] = {}
    for r, table in kv.block_tables.items():
        n = num_computed.get(r, 0)
        for i, b in enumerate(table):
            f = min(bs, n - i * bs)
            if f <= 0:
                break
            if f > filled.get(b, 0):
                filled[b] = f
    return sum(filled.values())


def external_free_slots(kv: KVManager, waiting_need_blocks: int) -> int:
    """Free slots in runs shorter than ``waiting_need_blocks`` (0 when nothing waits or any block serves)."""
    if waiting_need_blocks <= 0:
        return 0
    return sum(n for _, n in kv.free_runs() if n < waiting_need_blocks) * kv.block_size


def usage_from_sums(kv: KVManager, token_states: int, unwritten: int | None, external: int = 0) -> KVUsage:
    """The split from its sums (token slots): ``unwritten`` = allocated slots below each request's
    bound not written yet (``None``: every unwritten slot is internal fragmentation)."""
    bs = kv.block_size
    free_blocks = kv.num_free_blocks
    waste = (kv.num_blocks - free_blocks) * bs - token_states
    reservation = 0 if unwritten is None else min(unwritten, waste)
    return KVUsage(
        pool=kv.num_blocks * bs,
        token_states=token_states,
        reservation=reservation,
        internal_fragmentation=waste - reservation,
        external_fragmentation=external,
        free=free_blocks * bs - external,
    )


def pool_usage(
    kv: KVManager,
    num_computed: Mapping[str, int],
    final_bound: Mapping[str, int] | None = None,
    waiting_need_blocks: int = 0,
) -> KVUsage:
    """The pool split of a manager's current state.

    Args:
        kv: any KV manager.
        num_computed: tokens with K/V in the cache, per request holding blocks.
        final_bound: most slots each request can ever write (prompt + output cap - 1); ``None``
            counts every unwritten allocated slot as internal fragmentation.
        waiting_need_blocks: the first waiting request's consecutive need
            (:meth:`KVManager.reservation_blocks`); shorter free runs are external fragmentation.
    """
    if kv.enable_prefix_caching or kv.may_share_blocks:
        token_states = shared_token_states(kv, num_computed)
    else:
        token_states = sum(num_computed.get(r, 0) for r in kv.block_tables)
    unwritten = None
    if final_bound is not None:
        bs = kv.block_size
        unwritten = 0
        for r, table in kv.block_tables.items():
            left = min(len(table) * bs, final_bound.get(r, 0)) - num_computed.get(r, 0)
            if left > 0:
                unwritten += left
    return usage_from_sums(kv, token_states, unwritten, external_free_slots(kv, waiting_need_blocks))


def block_map(kv: KVManager, num_computed: Mapping[str, int], waiting_need_blocks: int = 0, step: int = 0) -> dict:
    """A per-block picture of the pool, for the block-map figure.

    Returns:
        ``{"step", "allocator", "block_size", "owner", "owner_ids", "filled", "state"}``:
        ``owner[b]`` indexes ``owner_ids`` (the first request holding block ``b``) or is -1;
        ``filled[b]`` = slots of ``b`` holding token states; ``state[b]`` is ``"used"``,
        ``"free"``, ``"cached"`` (free, still holding a prefix-cached block) or ``"external"``
        (free, in a run too short for the first waiting request).
    """
    bs = kv.block_size
    n = kv.num_blocks
    owner = [-1] * n
    filled = [0] * n
    state = ["free"] * n
    ids: list[str] = []
    for r, table in kv.block_tables.items():
        k = len(ids)
        ids.append(r)
        c = num_computed.get(r, 0)
        for i, b in enumerate(table):
            if owner[b] < 0:
                owner[b] = k
            state[b] = "used"
            filled[b] = max(filled[b], max(0, min(bs, c - i * bs)))
    for b in kv.cached_free_blocks():
        if state[b] == "free":
            state[b] = "cached"
    if waiting_need_blocks > 0:
        for start, m in kv.free_runs():
            if m < waiting_need_blocks:
                state[start : start + m] = ["external"] * m
    return {
        "step": step,
        "allocator": kv.name,
        "block_size": bs,
        "owner": owner,
        "owner_ids": ids,
        "filled": filled,
        "state": state,
    }


class PoolAccounting:
    """The engine's running account of the KV pool: the split after every step, settled.

    Per request holding blocks it keeps ``[request, bound, groups, slots written at the last step]``, ``groups`` being
    ``[slots held, [step cell, ...]]`` runs of consecutive steps in which the request held the same number of slots,
    for the steps whose split a release may still correct; when the request releases its blocks (finish, abort,
    preemption, swap-out), :meth:`settle_released` moves the slots it held but never wrote from reservation to
    internal fragmentation in those steps. (What a release corrects in a step depends on the slots held then and the
    final length only, so the steps of one run share one correction: grouping them keeps a decode's per-step work to
    appending a cell.)

    Args:
        kv: the engine's KV manager.
    """

    def __init__(self, kv: KVManager) -> None:
        self.kv = kv
        #: request id -> [request, most slots it can write, [[slots held, [[StepStats], ...]], ...], slots written]
        self.holding: dict[str, list] = {}
        self._num_seen = 0
        #: the split at the last :meth:`observe` (the step-time figures; ``None`` before the first step)
        self.last_usage: KVUsage | None = None

    def observe(self, requests: Mapping, step_cell: list, waiting_need_blocks: int, want_computed: bool):
        """Walk the block tables once after a step: the split, and each holder's entry for settling.

        Args:
            requests: the engine's unfinished requests by id (``num_computed_tokens``, bounds).
            step_cell: a one-element list that will hold this step's record (entries refer to it).
            waiting_need_blocks: the first waiting request's consecutive need.
            want_computed: also return ``{request id: computed tokens}`` (for a block map).

        Returns:
            ``(KVUsage, computed dict or None)``.
        """
        kv = self.kv
        bs = kv.block_size
        holding = self.holding
        dedupe = kv.enable_prefix_caching or kv.may_share_blocks  # a block shared by forks counts once
        computed: dict[str, int] | None = {} if (want_computed or dedupe) else None
        token_states = unwritten = 0
        num_seen = 0
        for rid, table in kv.block_tables.items():
            entry = holding.get(rid)
            if entry is None:
                r = requests.get(rid)
                if r is None:
                    continue
                # most KV slots it can write: prompt + output cap, less the last sampled token (never written)
                entry = holding[rid] = [r, r.num_prompt_tokens + r.max_output_tokens - 1, [], 0]
            c = entry[0].num_computed_tokens
            if computed is not None:
                computed[rid] = c
            held = len(table) * bs
            token_states += c
            bound = entry[1]
            left = (held if held < bound else bound) - c
            if left > 0:
                unwritten += left
            groups = entry[2]
            # A step in which the request held no more slots than it has written since can never be
            # corrected by settling (its final length >= written >= held there): keep only the others,
            # so a long request keeps about one block's worth of steps, not every step.
            if groups and groups[0][0] <= c:
                k = 1
                while k < len(groups) and groups[k][0] <= c:
                    k += 1
                del groups[:k]
            if groups and groups[-1][0] == held:
                groups[-1][1].append(step_cell)
            else:
                groups.append([held, [step_cell]])
            entry[3] = c
            num_seen += 1
        self._num_seen = num_seen
        if dedupe:
            token_states = shared_token_states(kv, computed)
        usage = self.last_usage = usage_from_sums(
            kv, token_states, unwritten, external_free_slots(kv, waiting_need_blocks)
        )
        return usage, computed

    def settle_released(self) -> None:
        """Settle every request that held blocks at an earlier observation and holds none now."""
        if len(self.holding) > self._num_seen:
            tables = self.kv.block_tables
            for rid in [rid for rid in self.holding if rid not in tables]:
                self.settle(rid)

    def settle(self, request_id: str) -> None:
        """The request released its blocks: now that it is known how many slots it wrote, move the
        slots it held but never wrote from reservation to internal fragmentation in every step it
        held them (docs/architecture.md §3)."""
        req, bound, groups, last_written = self.holding.pop(request_id)
        # a recompute preemption resets num_computed_tokens: it then wrote what the last step saw
        final = req.num_computed_tokens if req.num_computed_tokens >= last_written else last_written
        for held, cells in groups:
            # In a step where it held `held` slots and had written w (w <= held, bound and final), the split counted
            # min(held, bound) - w as reservation and should have counted min(held, final) - w: the difference
            # moves to internal fragmentation, whatever w was.
            move = (held if held < bound else bound) - (held if held < final else final)
            if move > 0:
                for (st,) in cells:
                    delta = move if move < st.reservation else st.reservation
                    if delta > 0:
                        st.reservation -= delta
                        st.internal_fragmentation += delta
