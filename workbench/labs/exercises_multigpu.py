"""Exercises of chapters 9 and 10 (tensor parallelism; NCCL buffer tuning), registered in
:data:`workbench.labs.exercise_registry.EXERCISES`."""

from __future__ import annotations

from collections.abc import Callable

from workbench.labs.exercise_registry import _number, _register


# ---------------------------------------------------------------- chapter 9: tensor parallelism
def reference_allreduce_bytes(num_tokens: int, hidden_size: int, num_hidden_layers: int, dtype_bytes: int) -> int:
    """``(1 + 2 L) x tokens x hidden x dtype bytes``: the vocab-parallel embedding's all-reduce and
    two per layer (after attention's ``o_proj`` and the MLP's ``down_proj``)."""
    return (1 + 2 * num_hidden_layers) * num_tokens * hidden_size * dtype_bytes


@_register(
    "9.1",
    "Write allreduce_bytes(num_tokens, hidden_size, num_hidden_layers, dtype_bytes): the bytes one rank "
    "all-reduces in a step of num_tokens tokens; checked against the TP=3 engine's StepStats on every step.",
    "every row-parallel layer ends in an all-reduce of a [tokens, hidden] tensor: two per layer (attention, MLP) "
    "— and count the vocab-parallel embedding too.",
)
class _AllreduceBytes:
    @staticmethod
    def solution(steps: list, model: dict) -> Callable:
        return reference_allreduce_bytes

    @staticmethod
    def judge(answer, steps: list, model: dict) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        L, h, b = model["num_hidden_layers"], model["hidden_size"], model["dtype_bytes"]
        for s in steps:
            tokens = s["num_prefill_tokens"] + s["num_decode_tokens"]
            got, want = answer(tokens, h, L, b), s["allreduce_bytes"]
            if got != want:
                why = ""
                if got and want and got * (1 + 2 * L) == want * 2 * L:
                    why = " — one all-reduce short per step: the vocab-parallel embedding all-reduces too"
                elif got and got * b == want:
                    why = " — elements, not bytes: multiply by dtype_bytes"
                return (
                    False,
                    f"step {s['step']} ({tokens} tokens): yours {got!r}, the engine all-reduced {want:,} B{why}",
                )
        total = sum(s["allreduce_bytes"] for s in steps)
        return True, f"equal to the engine's bytes on all {len(steps)} steps ({total:,} B in the run)"


# ---------------------------------------------------------------- chapter 10: NCCL buffers
@_register(
    "10.1",
    "How many KV blocks per GPU does this buffer configuration cost, compared with no NCCL buffers at all? "
    "(an integer; checked against the simulated engine's own budget)",
    "buffers per rank = channels x (NCCL_BUFFSIZE + LL + LL128 buffers of the enabled protocols); blocks = "
    "budget // block_bytes — compute the blocks of the budget without and with the buffers, and subtract.",
)
class _BlocksLost:
    @staticmethod
    def solution(config: dict, budget: dict, engine_num_blocks: int) -> int:
        from workbench.comm import nccl_buffer_bytes

        buffers = nccl_buffer_bytes(
            config["tensor_parallel_size"],
            buffsize=config["nccl_buffsize"],
            nchannels=config["nchannels"],
            protocols=config["nccl_proto"],
        ).per_rank_bytes
        after = (budget["kv_budget_bytes"] - buffers) // budget["block_bytes"]
        return budget["num_blocks"] - after

    @staticmethod
    def judge(answer, config: dict, budget: dict, engine_num_blocks: int) -> tuple[bool, str]:
        from workbench.comm import nccl_buffer_bytes

        want = budget["num_blocks"] - engine_num_blocks
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of blocks, got {answer!r}"
        est = nccl_buffer_bytes(
            config["tensor_parallel_size"],
            buffsize=config["nccl_buffsize"],
            nchannels=config["nchannels"],
            protocols=config["nccl_proto"],
        )
        if x == want:
            return True, (
                f"{want:,} blocks per GPU: {est.per_rank_bytes:,} B of buffers; the engine's pool went from "
                f"{budget['num_blocks']:,} to {engine_num_blocks:,} blocks"
            )
        if x == est.per_rank_bytes or x == est.per_rank_bytes / 2**20:
            return False, "that is the buffers' size; convert it into the blocks it displaces"
        if x == want * config["tensor_parallel_size"]:
            return False, "that is the whole group's loss; the question asks per GPU"
        simple = config["nchannels"] * config["nccl_buffsize"] // budget["block_bytes"]
        if x == simple and simple != want:
            return False, "count every enabled protocol's buffer (LL and LL128 too), not NCCL_BUFFSIZE alone"
        if x == est.per_rank_bytes // budget["block_bytes"] and x != want:
            return False, (
                "buffers // block_bytes ignores the part-block the budget already had left over: "
                "compare the two budgets' whole blocks"
            )
        side = "too many" if x > want else "too few"
        return False, (
            f"{answer!r} is {side}: the buffers take {est.per_rank_bytes / 2**20:,.1f} MiB per GPU and a block is "
            f"{budget['block_bytes']:,} B; count the budget's whole blocks with and without the buffers"
        )
