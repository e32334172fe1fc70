"""Self-checking exercises of the chapter notebooks: chapters 1-6 here, and every chapter's once imported
(the registry and :func:`check` live in :mod:`workbench.labs.exercise_registry`).

A learner's cell reads::

    answer = ...            # replace ... with your answer
    check("1.1", answer)

:func:`check` prints a verdict: not answered yet (with a hint), correct, or not yet (with why).
Every exercise carries its reference solution, and every call of :func:`check` first verifies
that solution against the same context (the learner's own run): if the solution does not pass,
the exercise is broken and :class:`ExerciseBroken` is raised. nbval runs every notebook in CI, so
a broken exercise cannot ship; ``tests/test_labs.py`` also checks each solution passes and known
wrong answers fail.

Solutions mode: with ``WORKBENCH_LAB_SOLUTIONS=1`` in the environment, an unanswered exercise
(``...``) is answered with its solution and checked, so an instructor can run a chapter end to
end; :func:`solution` returns the solution of one exercise for a given context.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from workbench.labs.exercise_registry import (
    EXERCISES,
    Exercise,
    ExerciseBroken,
    Verdict,
    _close,
    _number,
    _register,
    check,
    solution,
    solutions_mode,
)

__all__ = ["Exercise", "ExerciseBroken", "EXERCISES", "Verdict", "check", "solution", "solutions_mode"]


# ---------------------------------------------------------------- chapter 1: KV anatomy, the budget
@_register(
    "1.1",
    "How many bytes of KV cache does one token take in Llama-2-13B with a float16 cache "
    "(40 layers, 40 KV heads, head_dim 128)? Give bytes, for the whole model on one GPU.",
    "2 (K and V) x layers x KV heads x head_dim x bytes per element (docs/architecture.md §3).",
)
class _KVBytes13B:
    @staticmethod
    def solution() -> int:
        return 2 * 40 * 40 * 128 * 2

    @staticmethod
    def judge(answer) -> tuple[bool, str]:
        ref = _KVBytes13B.solution()
        x = _number(answer)
        if x is None:
            return False, f"give a number of bytes, got {answer!r}"
        if x == ref:
            return True, f"{ref:,} B = {ref / 1024:,.0f} KiB per token — about 20x the '40 KB' claim"
        if _close(x, ref / 1024) or _close(x, ref / 1000):
            return False, "that is the figure in KiB/KB; the question asks for bytes"
        if _close(x, ref / 2):
            return False, "you counted K or V, not both: multiply by 2"
        if _close(x, ref / 40):
            return False, "that is one layer's share; every layer keeps its own K and V"
        return False, f"{x:,.0f} B is not it; recount the five factors"


def reference_kv_bytes_per_token(config: dict, dtype_bytes: int) -> int:
    """KV bytes per token from a config dict (keys as in a Hugging Face ``config.json``)."""
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def _catalogue_configs() -> list[tuple[str, dict]]:
    from workbench.catalog import MODELS

    out = []
    for name, arch in MODELS.items():
        cfg = {
            "num_hidden_layers": arch.num_hidden_layers,
            "num_attention_heads": arch.num_attention_heads,
            "num_key_value_heads": arch.num_key_value_heads,
            "hidden_size": arch.hidden_size,
        }
        if arch.head_dim != arch.hidden_size // arch.num_attention_heads:  # as config.json: only when it differs
            cfg["head_dim"] = arch.head_dim
        out.append((name, cfg))
    return out


@_register(
    "1.2",
    "Write kv_bytes_per_token(config, dtype_bytes) for a Hugging Face config dict; it is checked "
    "against kv-calc on every model of the catalogue (grouped-query attention included).",
    "use num_key_value_heads (not num_attention_heads) and head_dim = hidden_size // num_attention_heads "
    "when the config has no head_dim.",
)
class _KVBytesFn:
    @staticmethod
    def solution():
        return reference_kv_bytes_per_token

    @staticmethod
    def judge(answer) -> tuple[bool, str]:
        from workbench.kvcalc import kv_calc

        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        for name, cfg in _catalogue_configs():
            for dtype, nbytes in (("float16", 2), ("float32", 4)):
                ref = kv_calc(name, dtype=dtype).kv_bytes_per_token
                got = answer(dict(cfg), nbytes)
                if got != ref:
                    return False, f"{name} ({dtype}): your function gives {got!r}, kv-calc {ref:,} B"
        return True, f"matches kv-calc on all {len(_catalogue_configs())} catalogue models, float16 and float32"


@_register(
    "1.3",
    "How many whole sequences of 4,096 tokens can this engine's KV pool hold at once (paged)?",
    "each sequence holds ceil(4096 / block_size) blocks; the pool has memory['num_blocks'] blocks.",
)
class _MaxSeqs:
    @staticmethod
    def solution(memory: dict) -> int:
        return memory["num_blocks"] // math.ceil(4096 / memory["block_size"])

    @staticmethod
    def judge(answer, memory: dict) -> tuple[bool, str]:
        ref = _MaxSeqs.solution(memory)
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of sequences, got {answer!r}"
        if x == ref:
            return True, f"{ref} sequences ({memory['num_blocks']:,} blocks / {math.ceil(4096 / memory['block_size'])})"
        if _close(x, memory["kv_pool_tokens"] / 4096):
            return False, "that is vLLM's 'max concurrency' (tokens / 4096), not whole sequences: round down by blocks"
        return False, f"{answer} is not it"


# ---------------------------------------------------------------- chapter 2: fragmentation
def reference_fragmentation_rate(step: dict) -> float:
    """(reservation + internal + external) / (pool − free), 0 when nothing is occupied (docs/architecture.md §3)."""
    used = step["num_blocks"] * step["block_size"] - step["free"]
    if used <= 0:
        return 0.0
    return (step["reservation"] + step["internal_fragmentation"] + step["external_fragmentation"]) / used


@_register(
    "2.1",
    "Write fragmentation_rate(step) for one step record (a dict with the five categories in token slots); "
    "it is checked against the engine's own figure on every step of your runs.",
    "occupied = num_blocks * block_size - free; the wasted part is reservation + internal + external.",
)
class _FragRate:
    @staticmethod
    def solution(steps: list) -> Callable:
        return reference_fragmentation_rate

    @staticmethod
    def judge(answer, steps: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        for s in steps:
            got = answer(dict(s))
            if not _close(got, s["fragmentation_rate"], 1e-9):
                return False, f"step {s['step']}: yours {got!r}, the engine's {s['fragmentation_rate']:.6f}"
        return True, f"equal to the engine's fragmentation rate on all {len(steps)} steps"


@_register(
    "2.2",
    "Which allocator of your comparison wasted the largest share of used memory on external fragmentation? "
    "Give its name as a string.",
    "look at the 'external frag.' column of the table above.",
)
class _MostExternal:
    @staticmethod
    def solution(rows: list) -> str:
        return max(rows, key=lambda r: r["external_fragmentation"])["run"]

    @staticmethod
    def judge(answer, rows: list) -> tuple[bool, str]:
        ref = _MostExternal.solution(rows)
        best = max(r["external_fragmentation"] for r in rows)
        tied = [r["run"] for r in rows if r["external_fragmentation"] == best]
        if answer in tied:
            return True, f"{answer}: {100 * best:.1f}% of used memory sits in holes too small for the next request"
        if answer == "paged":
            return False, "paged allocation has no external fragmentation: any free block serves any request"
        names = [r["run"] for r in rows]
        if answer not in names:
            return False, f"{answer!r} is not one of {names}"
        return (
            False,
            f"not {answer}; the largest is {100 * best:.1f}% (ask: which run is it? the answer is {ref!r} or a tie)",
        )


def reference_reserved_tokens(
    allocator: str, prompt_len: int, true_len: int, max_tokens: int, max_model_len: int
) -> int:
    """Tokens a contiguous allocator reserves at admission (:func:`workbench.kv.contiguous.reservation_tokens`)."""
    from workbench.kv.contiguous import reservation_tokens

    return reservation_tokens(allocator, prompt_len, max_tokens, max_model_len, true_len)


@_register(
    "2.3",
    "Write reserved_tokens(allocator, prompt_len, true_len, max_tokens, max_model_len): the tokens each "
    "contiguous allocator (static, orca-max, orca-pow2, orca-oracle) reserves for a request at admission; "
    "it is checked against the engine's rule on every request of your trace.",
    "static: the longest sequence allowed; orca-max: prompt + the cap (at most max_model_len); orca-pow2: "
    "prompt + the next power of two of the true length; orca-oracle: prompt + the true length.",
)
class _Reserved:
    ALLOCATORS = ("static", "orca-max", "orca-pow2", "orca-oracle")

    @staticmethod
    def solution(cases: list) -> Callable:
        return reference_reserved_tokens

    @staticmethod
    def judge(answer, cases: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        for a in _Reserved.ALLOCATORS:
            for c in cases:
                args = (c["prompt_len"], c["true_len"], c["max_tokens"], c["max_model_len"])
                ref = reference_reserved_tokens(a, *args)
                got = answer(a, *args)
                if got != ref:
                    return False, (
                        f"{a}, prompt {args[0]}, true length {args[1]}, max_tokens {args[2]}, max_model_len "
                        f"{args[3]}: yours {got!r}, the engine's {ref}"
                    )
        return True, f"the engine's reservation for all {len(cases)} requests under the four contiguous allocators"


# ---------------------------------------------------------------- chapter 3: probes and logs
@_register(
    "3.1",
    "From the startup memory line, how many bytes does the KV pool get? (an integer)",
    "the pool is num_blocks x block_bytes; it is the 'KV pool' figure of the line.",
)
class _PoolBytes:
    @staticmethod
    def solution(memory: dict) -> int:
        return memory["kv_pool_bytes"]

    @staticmethod
    def judge(answer, memory: dict) -> tuple[bool, str]:
        ref = memory["kv_pool_bytes"]
        x = _number(answer)
        if x is None:
            return False, f"give bytes as a number, got {answer!r}"
        if x == ref:
            return True, f"{ref:,} B = {memory['num_blocks']:,} blocks x {memory['block_bytes']:,} B"
        if x == memory["kv_budget_bytes"]:
            return False, "that is the budget; the pool is the whole blocks that fit in it (a little less)"
        return False, f"{x:,.0f} B is not it"


@_register(
    "3.2",
    "Write a probe: a function wasted_bytes(step) giving the bytes of KV memory allocated but holding no "
    "token state in one step record; checked on every step of the run.",
    "(reservation + internal_fragmentation + external_fragmentation) slots x kv_bytes_per_token.",
)
class _WastedBytes:
    @staticmethod
    def solution(steps: list) -> Callable:
        return lambda s: (
            (s["reservation"] + s["internal_fragmentation"] + s["external_fragmentation"]) * s["kv_bytes_per_token"]
        )

    @staticmethod
    def judge(answer, steps: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        ref = _WastedBytes.solution(steps)
        for s in steps:
            got, want = answer(dict(s)), ref(s)
            if got != want:
                hint = " (slots, not bytes?)" if want and got * s["kv_bytes_per_token"] == want else ""
                return False, f"step {s['step']}: yours {got!r}, expected {want:,} B{hint}"
        peak = max(ref(s) for s in steps)
        return True, f"matches on all {len(steps)} steps; peak waste {peak:,} B"


# ---------------------------------------------------------------- chapter 4: PagedAttention inside
def reference_slot(block_table: list[int], block_size: int, position: int) -> int:
    """Slot of a token: ``block_table[position // block_size] * block_size + position % block_size``."""
    return block_table[position // block_size] * block_size + position % block_size


@_register(
    "4.1",
    "Write slot(block_table, block_size, position): the flat KV-cache slot a token at this position is written "
    "to; checked against the engine's slot mapping for every token of the live batch.",
    "the logical block is position // block_size, the offset position % block_size.",
)
class _Slot:
    @staticmethod
    def solution(batch: list) -> Callable:
        return reference_slot

    @staticmethod
    def judge(answer, batch: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        n = 0
        for b in batch:
            for pos, want in zip(b["positions"], b["slots"]):
                got = answer(list(b["block_table"]), b["block_size"], pos)
                if got != want:
                    return False, f"request {b['request_id']} position {pos}: yours {got!r}, the engine wrote {want}"
                n += 1
        return True, f"all {n} slots of the batch match the engine's slot mapping"


@_register(
    "4.2",
    "A request ends with 130 tokens (prompt + output) at block_size 16: how many token slots of its last "
    "block are internal fragmentation?",
    "blocks = ceil(130 / 16); slots allocated - 130.",
)
class _Tail:
    @staticmethod
    def solution() -> int:
        return math.ceil(130 / 16) * 16 - 130

    @staticmethod
    def judge(answer) -> tuple[bool, str]:
        ref = _Tail.solution()
        if _number(answer) == ref:
            return True, f"{ref} slots: 9 blocks x 16 = 144 slots for 130 tokens"
        if _number(answer) == 130 % 16:
            return False, "that is how many slots of the last block are used, not unused"
        return False, f"{answer!r} is not it"


# ---------------------------------------------------------------- chapter 5: batching
def padded_slots(lengths: list[int], group_size: int | None = None) -> int:
    """KV slots of padded batches: each batch reserves ``len(batch) * max(batch)`` slots.

    ``group_size=None``: one batch of everything (static, arrival order irrelevant). Otherwise the
    lengths sorted and cut into consecutive groups of ``group_size`` (length-grouped batching).
    """
    if group_size is None:
        return len(lengths) * max(lengths)
    s = sorted(lengths)
    return sum(len(g) * max(g) for g in (s[i : i + group_size] for i in range(0, len(s), group_size)))


@_register(
    "5.1",
    "For the 16 sequence lengths of this chapter, what fraction of the static batch's padded KV memory does "
    "grouping into batches of 4 by length save? (a fraction between 0 and 1)",
    "a padded batch holds len(batch) x its longest length; sort the lengths, cut them into groups of 4, and "
    "compare the two totals.",
)
class _GroupSaving:
    @staticmethod
    def solution(lengths: list) -> float:
        return 1 - padded_slots(lengths, 4) / padded_slots(lengths)

    @staticmethod
    def judge(answer, lengths: list) -> tuple[bool, str]:
        ref = _GroupSaving.solution(lengths)
        x = _number(answer)
        if x is None:
            return False, f"give a fraction, got {answer!r}"
        if _close(x, ref, 1e-3):
            return True, f"grouping saves {100 * ref:.1f}% of the padded memory (the claim: 58%)"
        if _close(x, 100 * ref, 1e-3):
            return False, "that is a percentage; give a fraction between 0 and 1"
        if _close(x, 0.58, 1e-3):
            return False, "0.58 is the claim; compute the saving for these lengths"
        return False, f"{x:.4g} is not it"


# ---------------------------------------------------------------- chapter 6: sharing and preemption
@_register(
    "6.1",
    "N requests share a system prompt of P tokens; with prefix caching and block size B, how many KV blocks "
    "does sharing save? Write blocks_saved(N, P, B); checked against the engine's own runs.",
    "only whole blocks are shared: each of the N - 1 later requests reuses P // B blocks.",
)
class _PrefixSaving:
    @staticmethod
    def solution(runs: list) -> Callable:
        return lambda n, p, b: (n - 1) * (p // b)

    @staticmethod
    def judge(answer, runs: list) -> tuple[bool, str]:
        if not callable(answer):
            return False, f"give a function, got {type(answer).__name__}"
        for r in runs:
            got = answer(r["n"], r["prefix_tokens"], r["block_size"])
            if got != r["blocks_saved"]:
                return False, (
                    f"N={r['n']}, P={r['prefix_tokens']}, B={r['block_size']}: yours {got!r}, "
                    f"the engine saved {r['blocks_saved']} blocks"
                )
        return True, f"equal to the engine's saving in all {len(runs)} measured runs"


@_register(
    "6.2",
    "How many bytes did swapping move between device and host memory in the swap run (out and in together)?",
    "sum the steps' swap_out_blocks + swap_in_blocks, times the block's bytes (block_size x kv_bytes_per_token).",
)
class _SwapBytes:
    @staticmethod
    def solution(steps: list) -> int:
        return sum(
            (s["swap_out_blocks"] + s["swap_in_blocks"]) * s["block_size"] * s["kv_bytes_per_token"] for s in steps
        )

    @staticmethod
    def judge(answer, steps: list) -> tuple[bool, str]:
        ref = _SwapBytes.solution(steps)
        x = _number(answer)
        if x is None:
            return False, f"give bytes as a number, got {answer!r}"
        if x == ref:
            return True, f"{ref:,} B moved ({ref / 2**20:.2f} MiB)"
        blocks = sum(s["swap_out_blocks"] + s["swap_in_blocks"] for s in steps)
        if x == blocks:
            return False, "that is the number of blocks; multiply by the bytes of one block"
        return False, f"{x:,.0f} B is not it"


# The later chapters' exercises register themselves in the registry on import (after chapters 1-6, so
# EXERCISES keeps chapter order); they import the registry, not this module.
from workbench.labs import (  # noqa: E402, F401
    exercises_arch,
    exercises_multigpu,
    exercises_production,
    exercises_tuning,
)
