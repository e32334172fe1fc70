"""Chapter 2, fragmentation live: the same trace under each allocator, where the KV memory went, and the vLLM
paper's Fig. 2.

The notebook ``labs/02_fragmentation_live.ipynb`` calls these, one call per cell; its exercises are at the end."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from workbench.labs.exercise_registry import _close, _register

# the notebook calls these too (ch.memory_timeline, ch.waste_figure)
from workbench.labs.runs import (  # noqa: F401
    LAB_ENGINE_DEFAULTS,
    breakdown_rows,
    lab_run,
    lab_trace,
    memory_timeline,
    waste_figure,
)
from workbench.viz.table import Column, Table

#: the vLLM paper's Fig. 2 (Kwon et al., SOSP 2023): share of the KV memory holding token states,
#: averaged over serving OPT-13B on a ShareGPT-like trace; Orca (Max) reserves the model's maximum
#: length (our ``static``), Orca (Pow2) the next power of two, Orca (Oracle) the true length.
PAPER_FIG2_TOKEN_STATES = {"static": 0.204, "orca-pow2": 0.268, "orca-oracle": 0.382, "paged": 0.963}


def compare_allocators(
    allocators: Sequence[str] = ("paged", "static", "orca-max", "orca-pow2", "orca-oracle"),
    records=None,
    **engine_args: Any,
) -> dict[str, Any]:
    """The same requests through each KV allocator (real runs); ``{allocator: JobResult}``.

    Defaults: :func:`~workbench.labs.runs.lab_trace`, a pool of 48 blocks of 16 tokens
    (``num_gpu_blocks_override``) so that memory binds, ``max_model_len`` 256. Every run replays each
    record's true output length (``output_len``) under its cap (``max_tokens``): with a cap well above
    the true lengths the five allocators order as the vLLM paper's Fig. 2.
    """
    records = list(records) if records is not None else lab_trace()
    args = {"num_gpu_blocks_override": 48} | engine_args
    return {a: lab_run(records, kv_allocator=a, **args) for a in allocators}


def reservation_cases(result, records, max_model_len: int | None = None) -> list[dict[str, int]]:
    """Each request of a run as ``{"prompt_len", "true_len", "max_tokens", "max_model_len"}`` (tokens): its
    prompt's token count in that run, its true output length and cap (the record's ``output_len`` and
    ``max_tokens``), and the engine's ``max_model_len`` (default: the lab's) — exercise 2.3's cases."""
    mml = max_model_len or LAB_ENGINE_DEFAULTS["max_model_len"]
    return [
        {
            "prompt_len": len(o.prompt_token_ids),
            "true_len": r.output_len or r.max_tokens,
            "max_tokens": r.max_tokens,
            "max_model_len": mml,
        }
        for r, o in zip(records, result.outputs)
    ]


def paper_fig2_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Our token-state share of used memory beside the paper's Fig. 2, per allocator."""
    rows = []
    for r in breakdown_rows(results):
        paper = PAPER_FIG2_TOKEN_STATES.get(r["run"])
        rows.append({"allocator": r["run"], "ours": r["token_states"], "paper": paper})
    return rows


def fig2_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`paper_fig2_rows` as a table: share of the used KV memory holding token states, ours
    beside the vLLM paper's Fig. 2 (percent)."""
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    return Table(
        [
            Column("allocator", "allocator", align="left"),
            Column("ours", "token states, ours (% of used)", pct),
            Column("paper", "vLLM paper Fig. 2 (% of used)", pct),
        ],
        rows,
    )


# ---------------------------------------------------------------- exercises
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
