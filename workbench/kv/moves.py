"""Block moves: relocating live KV blocks (compaction), and the order block copies run in.

A *pass* is a list of moves ``(src, dst)`` of device block ids, applied **in list order, as if one at a time**:
at its turn ``src`` must be live (some request's block table holds it) and ``dst`` free (free before the pass, or
vacated by an earlier move of the same pass: a ``dst`` may be an earlier ``src``, as when a contiguous region slides
down by less than its length). Every block table holding ``src`` then holds ``dst`` at the same position, and the
copy ``src -> dst`` is queued for the executor (:meth:`~workbench.kv.interface.KVManager.take_pending_copies`, then
``SchedulerOutput.block_copies``), after the step's copy-on-write copies: the executor makes a step's device copies
in that same sequential order (:func:`copy_rounds`).

This module imports nothing of ``workbench`` (the KV managers import it); planning and triggers are in
:mod:`workbench.kv.defrag`.
"""

from __future__ import annotations

Pairs = list[tuple[int, int]]


def copy_rounds(pairs: Pairs, parallel: bool = False) -> list[Pairs]:
    """Split device block copies ``(src, dst)``, meant in list order, into rounds that each run as one operation.

    Within a round no pair reads a block an earlier pair of the round writes (read after write) and no block is
    written twice; with ``parallel`` (programs in no set order: the Triton ``copy_blocks`` kernel, whose docstring
    forbids a block being both a source and a destination of one call) no pair writes a block an earlier pair of the
    round reads either. The torch path (``cache[:, dst] = cache[:, src]``: gather every source, then scatter) reads
    all sources before any write, so a write after read is safe there. Copy-on-write copies (fresh destinations)
    are always one round; a contiguous region sliding down by ``k < n`` blocks takes ``ceil(n / k)`` parallel rounds.

    Args:
        pairs: ``(src, dst)`` block ids, in the order they are meant.
        parallel: the copies of a round may run in any order (Triton), not gather-then-scatter (torch).

    Returns:
        The rounds, in order; concatenated they are ``pairs``.
    """
    rounds: list[Pairs] = []
    cur: Pairs = []
    written: set[int] = set()
    read: set[int] = set()
    for s, d in pairs:
        if s in written or d in written or (parallel and d in read):
            rounds.append(cur)
            cur, written, read = [], set(), set()
        cur.append((s, d))
        written.add(d)
        read.add(s)
    if cur:
        rounds.append(cur)
    return rounds


def relocate(tables, moves: Pairs, num_blocks: int) -> dict[str, list[int]]:
    """The block tables ``moves`` change, as they will be after the pass (the rules in the module docstring).

    Args:
        tables: request id -> block ids (a manager's ``block_tables``; not changed).
        moves: ``(src, dst)`` pairs, in order.
        num_blocks: blocks in the pool (ids ``0 .. num_blocks-1``).

    Returns:
        request id -> its new block table, for each request a move touches.

    Raises:
        ValueError: a block id out of range, a ``src`` holding no live block at its turn, or a ``dst`` that is not
            free at its turn; nothing is changed.
    """
    holders: dict[int, list[tuple[str, int]]] = {}
    for rid, table in tables.items():
        for i, b in enumerate(table):
            holders.setdefault(b, []).append((rid, i))
    new: dict[str, list[int]] = {}
    for k, (s, d) in enumerate(moves):
        if not (0 <= s < num_blocks and 0 <= d < num_blocks):
            raise ValueError(f"move {k} ({s}, {d}): block ids must be in 0..{num_blocks - 1}")
        if s not in holders:
            raise ValueError(f"move {k} ({s}, {d}): block {s} holds no live block at its turn; move live blocks only")
        if d in holders:
            raise ValueError(
                f"move {k} ({s}, {d}): block {d} is in use at its turn; a destination must be free "
                "(free before the pass, or vacated by an earlier move)"
            )
        owners = holders[d] = holders.pop(s)
        for rid, i in owners:
            new.setdefault(rid, list(tables[rid]))[i] = d
    return new


def move_paged(kv, moves: Pairs) -> None:
    """:meth:`KVManager.move_blocks` of the paged manager (:class:`workbench.kv.manager.KVCacheManager`).

    Reference counts move with the content (a prefix-shared block keeps all its owners), as does its prefix-cache
    hash registration; a free destination that still caches a prefix block loses it (counted in ``num_evictions``,
    as when allocation evicts it, with its age). The content's eviction-policy figures (hits, when it was cached) move with it
    (:meth:`~workbench.kv.eviction.EvictionPolicy.moved`); the vacated source is freed, holding no cached content. Per-request hash chains
    are content hashes, so they do not change; the swap pool is not touched (only device blocks move).

    Raises:
        ValueError: see :func:`relocate`; nothing is changed.
    """
    new = relocate(kv.block_tables, moves, kv.num_blocks)
    pool = kv.pool
    for s, d in moves:
        pool.policy.take(d)  # off the free set (d is free: relocate checked); an eviction if it caches a block
        old = pool.block_hash[d]
        if old is not None:  # a cached free block: its content is overwritten
            del pool.cached[old]
            pool.block_hash[d] = None
            pool.num_evictions += 1
        pool.ref_cnt[d] = pool.ref_cnt[s]
        pool.policy.moved(s, d)
        h = pool.block_hash[s]
        if h is not None:
            pool.cached[h], pool.block_hash[d], pool.block_hash[s] = d, h, None
        pool.ref_cnt[s] = 1
        pool.free([s])
    for rid, table in new.items():
        kv.block_tables[rid][:] = table
    kv.pending_copies.extend(moves)


def move_contiguous(kv, moves: Pairs) -> None:
    """:meth:`KVManager.move_blocks` of a contiguous manager (``regions`` of ``(start, num_blocks, request id)``):
    whole regions move, keeping their block order, so a request's table stays one run.

    Raises:
        ValueError: see :func:`relocate`, or moves that would split a region or reorder its blocks; nothing is
            changed.
    """
    new = relocate(kv.block_tables, moves, kv.num_blocks)
    regions = []
    for start, n, rid in kv.regions:
        table = new.get(rid)
        if table is not None:
            if table != list(range(table[0], table[0] + n)):
                raise ValueError(
                    f"moves {moves[:4]}... leave request {rid}'s region as blocks {table[:6]}...; a contiguous "
                    "allocator moves whole regions (every block, to consecutive destinations in order)"
                )
            start = table[0]
        regions.append((start, n, rid))
    kv.regions = sorted(regions)
    for rid, table in new.items():
        kv.block_tables[rid][:] = table
    kv.pending_copies = [*getattr(kv, "pending_copies", []), *moves]
