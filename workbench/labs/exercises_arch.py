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
        from workbench.labs.own_allocator import NextFitKVManager

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
