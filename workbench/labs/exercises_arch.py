"""Exercises of the stage-4 chapters (architecture changes), registered in
:data:`workbench.labs.exercise_registry.EXERCISES`: chapter 14, memory beside the KV cache."""

from __future__ import annotations

from workbench.labs.exercise_registry import _number, _register


def _custom_ar(config: dict):
    from workbench.comm import custom_all_reduce_bytes
    from workbench.sim.hardware import find_hardware

    nvlink = find_hardware(config["gpu"]).interconnect == "NVLink"
    return custom_all_reduce_bytes(config["tensor_parallel_size"], fully_connected=nvlink)


# ---------------------------------------------------------------- chapter 14: memory beside the KV cache
@_register(
    "14.1",
    "How many KV blocks per GPU does disable_custom_all_reduce=True buy back for this deployment? "
    "(an integer; checked against the simulated engine's budget with the custom all-reduce off)",
    "a rank's custom all-reduce holds a metadata buffer (meta_size() + max_size), an input buffer (max_size) "
    "and 8 MiB of rank_data (workbench.comm.custom_all_reduce_bytes); add them back to the budget and count "
    "whole blocks before and after.",
)
class _CustomArBlocks:
    @staticmethod
    def solution(config: dict, budget: dict, engine_num_blocks: int) -> int:
        freed = _custom_ar(config).per_rank_bytes
        return (budget["kv_budget_bytes"] + freed) // budget["block_bytes"] - budget["num_blocks"]

    @staticmethod
    def judge(answer, config: dict, budget: dict, engine_num_blocks: int) -> tuple[bool, str]:
        want = engine_num_blocks - budget["num_blocks"]
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of blocks, got {answer!r}"
        est = _custom_ar(config)
        if x == want:
            return True, (
                f"{want:,} blocks per GPU: the custom all-reduce holds {est.per_rank_bytes:,} B per rank; the pool "
                f"goes from {budget['num_blocks']:,} to {engine_num_blocks:,} blocks"
            )
        if x in (est.per_rank_bytes, est.per_rank_bytes / 2**20):
            return False, "that is the buffers' size; convert it into the whole blocks it gives back"
        if x == want * config["tensor_parallel_size"]:
            return False, "that is the whole group's; the question asks per GPU"
        two = (budget["kv_budget_bytes"] + est.meta_bytes + est.buffer_bytes) // budget["block_bytes"]
        if x == two - budget["num_blocks"] and x != want:
            return False, "count rank_data (8 MiB of peer-pointer tables) too, not only the two IPC buffers"
        if x == est.per_rank_bytes // budget["block_bytes"] and x != want:
            return False, (
                "buffers // block_bytes ignores the part-block the budget already had left over: "
                "compare the two budgets' whole blocks"
            )
        side = "too many" if x > want else "too few"
        return False, (
            f"{answer!r} is {side}: the custom all-reduce takes {est.per_rank_bytes / 2**20:,.1f} MiB per GPU and a "
            f"block is {budget['block_bytes']:,} B; count the budget's whole blocks with and without it"
        )


# ---------------------------------------------------------------- chapter 11: your own allocator
@_register(
    "11.1",
    "Complete the skeleton (allocate_slots, free) so that your allocator passes the conformance check: "
    "the real scheduler over random schedules, invariants every step, nothing leaked (the answer is the class)",
    "allocate_slots adds blocks until the table covers num_total_tokens slots, and refuses (returning False, "
    "changing nothing) when too few are free; free gives every block of the request back and drops its table.",
)
class _OwnAllocator:
    @staticmethod
    def solution(schedules: int, seed: int):
        from workbench.labs.ch11_your_own_allocator import NextFitKVManager

        return NextFitKVManager

    @staticmethod
    def judge(answer, schedules: int, seed: int) -> tuple[bool, str]:
        from workbench.conformance import check_kv_manager

        from workbench.kv.interface import KVManager

        cls = getattr(answer, "fn", answer)  # a class arrives wrapped by check()'s return-value probe
        if not (isinstance(cls, type) and issubclass(cls, KVManager)):
            return False, f"give the class itself (a KVManager subclass), got {answer!r}"
        report = check_kv_manager(cls, schedules=schedules, seed=seed)
        if report.passed:
            return True, str(report)
        f = report.failure
        return False, (
            f"schedule {report.schedules} of {schedules} failed at step {f.step}: {f.problem} (print "
            "check_kv_manager(YourClass) for the schedule and the calls before it)"
        )


# ---------------------------------------------------------------- chapter 12: eviction policies for shared prefixes
def _victims(events, num_blocks: int, need: int) -> dict[str, list[int]]:
    from workbench.labs.ch12_eviction_policies import next_victims

    return {p: next_victims(p, events, num_blocks, need) for p in ("lru", "fifo", "lfu")}


@_register(
    "12.1",
    "After these pool events, a request needs 3 new blocks. Which blocks does each policy hand out, in order? "
    '(a dict {"lru": [...], "fifo": [...], "lfu": [...]} of block ids; checked against the engine\'s BlockPool)',
    "lru: the front of the free queue, cached or not (a request's blocks are freed tail first); fifo: empty blocks "
    "first, then by the order the content was cached; lfu: empty blocks first, then fewest hits, ties to the block "
    "freed longest ago.",
)
class _NextVictims:
    @staticmethod
    def solution(events, num_blocks: int, need: int) -> dict[str, list[int]]:
        return _victims(events, num_blocks, need)

    @staticmethod
    def judge(answer, events, num_blocks: int, need: int) -> tuple[bool, str]:
        want = _victims(events, num_blocks, need)
        if not isinstance(answer, dict) or set(answer) != set(want):
            return False, f'give a dict with the keys "lru", "fifo" and "lfu", each a list of {need} block ids'
        try:
            got = {k: [int(b) for b in v] for k, v in answer.items()}
        except (TypeError, ValueError):
            return False, f"each policy's answer is a list of {need} block ids (integers)"
        wrong = [k for k in want if got[k] != want[k]]
        if not wrong:
            return True, (
                f"lru {want['lru']}, fifo {want['fifo']}, lfu {want['lfu']}: LRU hands out part of the system prompt "
                "because the scan was freed after it, FIFO the system prompt first because it was cached first, "
                "LFU the blocks nobody hit"
            )
        notes = []
        for k in wrong:
            g = got[k]
            if sorted(g) == sorted(want[k]):
                notes.append(f"{k}: the right blocks, in another order")
            elif k == "lru" and g[:1] == [4]:
                notes.append(
                    "lru: a request's blocks are freed tail first (X 3 before X 0), and A's and B's before X's"
                )
            elif k == "lru" and any(b in g for b in (4, 5, 6, 7)):
                notes.append("lru: the scan's blocks were freed last, so they sit at the back of the queue")
            elif k == "fifo" and g[:1] != want["fifo"][:1]:
                notes.append("fifo: the content cached first goes first, however often it was hit since")
            elif k == "lfu" and any(b in g for b in (0, 1)):
                notes.append("lfu: the system prompt's blocks have a hit each; blocks with 0 hits go first")
            else:
                notes.append(f"{k}: not {g}")
        return False, "; ".join(notes)


# ---------------------------------------------------------------- chapter 13: defragmentation
def _plan(regions, num_blocks: int, need_blocks: int):
    from types import SimpleNamespace

    from workbench.kv.defrag import plan_compaction

    kv = SimpleNamespace(regions=sorted(tuple(r) for r in regions), num_blocks=num_blocks)
    return plan_compaction(kv, num_blocks, need_blocks)


@_register(
    "13.1",
    "A contiguous pool (regions = [start, blocks, request]) and a waiting request that needs need_blocks "
    "consecutive blocks: how many blocks does a compaction pass move before a free run holds it? "
    "(an integer; checked against workbench.kv.defrag.plan_compaction)",
    "regions slide down whole, lowest first, each to the end of the one below it; after each slide look at the "
    "largest free run (the hole just opened, or any run above) and stop as soon as one holds need_blocks.",
)
class _CompactionMoves:
    @staticmethod
    def solution(regions, num_blocks: int, need_blocks: int) -> int:
        return len(_plan(regions, num_blocks, need_blocks))

    @staticmethod
    def judge(answer, regions, num_blocks: int, need_blocks: int) -> tuple[bool, str]:
        moves = _plan(regions, num_blocks, need_blocks)
        want = len(moves)
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of blocks, got {answer!r}"
        full = len(_plan(regions, num_blocks, 0))
        if x == want:
            return True, f"{want} blocks, then a free run holds {need_blocks}; packing the whole pool would move {full}"
        free = num_blocks - sum(r[1] for r in regions)
        if x == full:
            return False, "that packs the whole pool; the pass stops as soon as one free run holds the request"
        if x == need_blocks:
            return False, "that is what the request needs; count the live blocks that move to open that hole"
        if x == free:
            return False, "that is the free blocks; the pass copies live blocks, not free ones"
        side = "too many" if x > want else "too few"
        return False, f"{answer!r} is {side}: slide the regions one at a time and check the free runs after each"
