"""Where a run's KV pool went, on average: the waste breakdown of one run.

Definitions follow docs/architecture.md §3 and the vLLM paper (Kwon et al., *Efficient Memory
Management for Large Language Model Serving with PagedAttention*, SOSP 2023, §2.3 and
Fig. 2). Every step record splits the KV pool (``num_blocks * block_size`` token slots) into
five categories that sum to the pool: token states, reservation, internal fragmentation,
external fragmentation and free. *Occupied* (used) memory is the pool minus free, i.e. the
first four categories; the vLLM paper's Fig. 2 shows those four as shares of occupied memory.

:func:`waste_breakdown` reduces a run's step records to per-run means; the CLI summary,
``workbench compare`` and :func:`workbench.viz.figures.waste_bars_figure` read its output.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["USED_CATEGORIES", "WASTE_CATEGORIES", "flatten_breakdown", "waste_breakdown"]

#: The five KV-pool categories (step-record keys), in stacking order; they sum to the pool.
WASTE_CATEGORIES: tuple[str, ...] = (
    "token_states",
    "reservation",
    "internal_fragmentation",
    "external_fragmentation",
    "free",
)
#: The four categories that make up occupied memory (pool - free).
USED_CATEGORIES: tuple[str, ...] = WASTE_CATEGORIES[:4]


def _get(step: Any, key: str) -> Any:
    """``step[key]`` for a mapping (a JSONL record), ``step.key`` for a ``StepStats``."""
    if isinstance(step, Mapping):
        return step[key]
    return getattr(step, key)


def _mean(total: float, n: int) -> float:
    return total / n if n else 0.0


def waste_breakdown(steps: Iterable[Any]) -> dict[str, Any]:
    """Per-run means of the KV-pool split of docs/architecture.md §3, each step weighted equally.

    Args:
        steps: step records of one run -- ``StepStats`` objects or their ``to_dict()`` dicts
            (as read back from ``steps.jsonl``), in any order.

    Returns:
        A dict (JSON-serialisable) with:

        * ``num_steps`` -- number of step records;
        * ``pool_slots_mean`` -- mean pool size in token slots (``num_blocks * block_size``);
        * ``pool_bytes_mean`` -- mean pool size in bytes (slots × ``kv_bytes_per_token``);
        * ``slots_mean`` -- ``{category: mean token slots}`` over the five categories;
        * ``bytes_mean`` -- ``{category: mean bytes}`` (per-step slots × ``kv_bytes_per_token``);
        * ``pool_share`` -- ``{category: mean over steps of slots / pool}`` (0..1); the five
          values sum to 1 (0 for all when there are no steps);
        * ``used_slots_mean`` -- mean occupied slots (pool - free);
        * ``used_share`` -- ``{category: Σ_steps slots / Σ_steps (pool - free)}`` over the four
          non-free categories (0..1), i.e. each step weighted by its occupied memory; the four
          values sum to 1, or are all 0 when nothing was ever occupied. This is the vLLM
          paper's Fig. 2 breakdown; ``1 - used_share["token_states"]`` is the run's
          occupancy-weighted fragmentation rate;
        * ``kv_utilization_mean`` -- mean of the steps' ``kv_utilization`` (token states /
          pool, 0..1);
        * ``fragmentation_rate_mean`` -- mean of the steps' ``fragmentation_rate``
          ((reservation + internal + external) / (pool - free), 0 on steps where nothing is
          occupied; 0..1). Each step counts equally here, so it differs from
          ``1 - used_share["token_states"]`` when occupancy varies;
        * ``num_running_mean``, ``num_waiting_mean`` -- mean requests running / waiting after
          each step;
        * ``blocks_used_mean``, ``blocks_used_peak`` -- blocks.

        With no steps every mean and share is ``0.0`` (nothing is divided by zero).

    Raises:
        KeyError / AttributeError: a step record lacks a field used here.
        ValueError: a step's five categories do not sum to its pool ``num_blocks * block_size``,
            or a value is negative or not finite (the message names the step).
    """
    n = 0
    pool_slots = pool_bytes = used_slots = 0.0
    slots = dict.fromkeys(WASTE_CATEGORIES, 0.0)
    nbytes = dict.fromkeys(WASTE_CATEGORIES, 0.0)
    share = dict.fromkeys(WASTE_CATEGORIES, 0.0)
    util = frag = running = waiting = blocks_used = 0.0
    blocks_peak = 0
    for s in steps:
        values = {k: _get(s, k) for k in WASTE_CATEGORIES}
        step_id = _get(s, "step")
        for k, v in values.items():
            if not math.isfinite(float(v)) or v < 0:
                raise ValueError(f"step {step_id}: {k}={v!r} is not a finite, non-negative slot count")
        pool = int(_get(s, "num_blocks")) * int(_get(s, "block_size"))
        total = sum(values.values())
        if total != pool:
            raise ValueError(
                f"step {step_id}: the five KV categories sum to {total} slots, not the pool "
                f"num_blocks * block_size = {pool} (docs/architecture.md §3); the step record is inconsistent"
            )
        bpt = float(_get(s, "kv_bytes_per_token"))
        n += 1
        pool_slots += pool
        pool_bytes += pool * bpt
        for k, v in values.items():
            slots[k] += v
            nbytes[k] += v * bpt
            if pool:
                share[k] += v / pool
        used_slots += pool - values["free"]
        util += float(_get(s, "kv_utilization"))
        frag += float(_get(s, "fragmentation_rate"))
        running += float(_get(s, "num_running"))
        waiting += float(_get(s, "num_waiting"))
        bu = int(_get(s, "blocks_used"))
        blocks_used += bu
        blocks_peak = max(blocks_peak, bu)
    return {
        "num_steps": n,
        "pool_slots_mean": _mean(pool_slots, n),
        "pool_bytes_mean": _mean(pool_bytes, n),
        "slots_mean": {k: _mean(v, n) for k, v in slots.items()},
        "bytes_mean": {k: _mean(v, n) for k, v in nbytes.items()},
        "pool_share": {k: _mean(v, n) for k, v in share.items()},
        "used_slots_mean": _mean(used_slots, n),
        "used_share": {k: (slots[k] / used_slots if used_slots else 0.0) for k in USED_CATEGORIES},
        "kv_utilization_mean": _mean(util, n),
        "fragmentation_rate_mean": _mean(frag, n),
        "num_running_mean": _mean(running, n),
        "num_waiting_mean": _mean(waiting, n),
        "blocks_used_mean": _mean(blocks_used, n),
        "blocks_used_peak": blocks_peak,
    }


def flatten_breakdown(breakdown: Mapping[str, Any]) -> dict[str, float | int]:
    """One flat row of :func:`waste_breakdown`'s output, for summary tables and CSV.

    Nested ``{category: value}`` dicts become ``<category>_<suffix>`` keys: ``_slots_mean``
    (token slots), ``_bytes_mean`` (bytes), ``_pool_frac`` (share of the pool, 0..1) and
    ``_used_frac`` (share of occupied memory, 0..1); scalar entries keep their names.

    Raises:
        KeyError: ``breakdown`` lacks one of :func:`waste_breakdown`'s keys.
    """
    out: dict[str, float | int] = {}
    for key, value in breakdown.items():
        if not isinstance(value, Mapping):
            out[key] = value
    for src, suffix in (
        ("slots_mean", "slots_mean"),
        ("bytes_mean", "bytes_mean"),
        ("pool_share", "pool_frac"),
        ("used_share", "used_frac"),
    ):
        for cat, v in breakdown[src].items():
            out[f"{cat}_{suffix}"] = v
    return out
