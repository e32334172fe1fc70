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


# ---------------------------------------------------------------- chapter 13: defragmentation
def _plan(regions, num_blocks: int, need_blocks: int):
    from types import SimpleNamespace

    from workbench.allocators.defrag import plan_compaction

    kv = SimpleNamespace(regions=sorted(tuple(r) for r in regions), num_blocks=num_blocks)
    return plan_compaction(kv, num_blocks, need_blocks)


@_register(
    "13.1",
    "A contiguous pool (regions = [start, blocks, request]) and a waiting request that needs need_blocks "
    "consecutive blocks: how many blocks does a compaction pass move before a free run holds it? "
    "(an integer; checked against workbench.allocators.defrag.plan_compaction)",
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
