"""Chapter 5, batching strategies: static, grouped and continuous batching on one trace, and the slots padding
costs.

The notebook ``labs/05_batching_strategies.ipynb`` calls these, one call per cell; its exercises are at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from workbench.labs.exercise_registry import _close, _number, _register
from workbench.labs.runs import (
    lab_run,
    lab_trace,
)
from workbench.viz.table import Column, Table


def spread_lengths(n: int = 16, lo: int = 128, hi: int = 2048) -> list[int]:
    """``n`` sequence lengths evenly spread over ``[lo, hi]`` (the claim's setting)."""
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def batching_runs(
    policies: Sequence[str] = ("continuous", "static", "grouped"), records=None, **engine_args
) -> dict[str, Any]:
    """The same requests through each batching policy (paged KV); ``{policy: JobResult}``."""
    records = list(records) if records is not None else lab_trace(8)
    args = {"max_num_seqs": 4, "num_gpu_blocks_override": 128} | engine_args
    return {p: lab_run(records, batching_policy=p, **args) for p in policies}


def latency_figure(results: dict[str, Any], metric: str = "e2e_s"):
    """Latency CDFs of several runs (:func:`workbench.viz.figures.latency_cdf_figure`)."""
    from workbench.viz.figures import latency_cdf_figure

    return latency_cdf_figure({k: [q.to_dict() for q in r.recorder.requests] for k, r in results.items()}, metric)


def padding_table(lengths: Sequence[int], group_size: int = 4) -> Table:
    """KV slots of one padded batch, of length-grouped padded batches, and of paged allocation.

    Rows ``{"layout", "slots", "saves"}`` (``saves``: the share of one padded batch's slots saved)."""
    one = padded_slots(list(lengths))
    grouped = padded_slots(list(lengths), group_size)
    exact = sum(lengths)
    rows = [
        {"layout": f"one padded batch of {len(lengths)}", "slots": one, "saves": None},
        {"layout": f"padded batches of {group_size}, grouped by length", "slots": grouped, "saves": 1 - grouped / one},
        {"layout": "paged (exactly the tokens)", "slots": exact, "saves": 1 - exact / one},
    ]
    return Table(
        [
            Column("layout", "layout", align="left"),
            Column("slots", "KV slots", "{:,}".format),
            Column("saves", "saves (% of one batch)", lambda v: "-" if v is None else f"{v:.1%}"),
        ],
        rows,
        title=f"lengths: {list(lengths)}",
    )


# ---------------------------------------------------------------- exercises
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
