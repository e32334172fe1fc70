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
#: the figures the course's outline quoted for pre-paged serving systems, as (low, high) ranges
CLAIMS = {
    "fragmentation_rate": (0.15, 0.40),  # share of occupied KV memory without token state
    "throughput_loss": (0.20, 0.50),  # requests/s lost against a paged pool
    "ttft_p99_ratio": (2.0, 5.0),  # TTFT p99 against a paged pool ("TTFT jitter")
}
#: the outline's target for a tuned deployment: fragmentation below 5% and throughput up 30% against the baseline
TARGET = {"fragmentation_rate_below": 0.05, "throughput_gain_at_least": 0.30}


def gpu_scale_rows(
    allocators: Sequence[str] = ("paged", "orca-oracle", "orca-pow2", "orca-max"),
    rate: float = 16.0,
    duration_s: float = 120.0,
    model: str = "llama-2-7b",
    gpu: str = "A100-80GB",
    progress: Callable[[str], Any] | None = None,
    **engine_args: Any,
) -> list[dict[str, Any]]:
    """The same ShareGPT-like Poisson trace (``rate`` requests/s for ``duration_s`` simulated seconds, seed 0)
    through each allocator on ``model`` on one ``gpu`` in the simulator (the real scheduler and KV managers, a cost
    model for time; the pool from ``gpu_memory_utilization`` 0.9; ``max_model_len`` 4096, ``max_num_seqs`` 256):
    the run's summary keys ``fragmentation_rate_mean_frac``, ``request_throughput_req_s``, ``ttft_p50_s``,
    ``ttft_p99_s``, plus ``allocator``. Deterministic."""
    from workbench.catalog import MODELS
    from workbench.sim import SimSpec, find_hardware, make_trace
    from workbench.sim.run import simulate_job

    spec = SimSpec(MODELS[model], find_hardware(gpu))
    trace = make_trace(rate, duration_s, "sharegpt", "poisson", 0)
    args = {"max_model_len": 4096, "max_num_seqs": 256} | engine_args
    rows = []
    for i, a in enumerate(allocators):
        if progress:
            progress(f"[{i + 1}/{len(allocators)}] {a} ...")
        s = simulate_job(spec, trace, output_dir=None, record_itl=False, kv_allocator=a, **args).summary
        keys = ("fragmentation_rate_mean_frac", "request_throughput_req_s", "ttft_p50_s", "ttft_p99_s")
        rows.append({"allocator": a} | {k: s[k] for k in keys})
    return rows


def gpu_scale_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`gpu_scale_rows` as a table, each contiguous row also against the paged one."""
    paged = next(r for r in rows if r["allocator"] == "paged")
    shown = [
        r | {"loss": 1 - r["request_throughput_req_s"] / paged["request_throughput_req_s"],
             "p99_ratio": r["ttft_p99_s"] / paged["ttft_p99_s"]}
        for r in rows
    ]  # fmt: skip
    return Table(
        [
            Column("allocator", "allocator", align="left"),
            Column("fragmentation_rate_mean_frac", "fragmentation rate (mean)", lambda v: f"{100 * v:.1f}%"),
            Column("request_throughput_req_s", "req/s", lambda v: f"{v:.2f}"),
            Column("loss", "throughput lost vs paged", lambda v: f"{100 * v:.0f}%"),
            Column("ttft_p50_s", "TTFT p50 (ms)", lambda v: f"{1000 * v:,.0f}"),
            Column("ttft_p99_s", "TTFT p99 (ms)", lambda v: f"{1000 * v:,.0f}"),
            Column("p99_ratio", "TTFT p99 vs paged", lambda v: f"{v:.1f}x"),
        ],
        shown,
    )


def _where(v: float, lo: float, hi: float) -> str:
    return "inside" if lo <= v <= hi else ("below" if v < lo else "above")


def claims_verdict(rows: Sequence[dict[str, Any]]) -> str:
    """The outline's figures for pre-paged systems (:data:`CLAIMS`) against :func:`gpu_scale_rows`: for the
    contiguous allocators, the range of each figure measured and where it falls against the claimed range."""
    paged = next(r for r in rows if r["allocator"] == "paged")
    cont = [r for r in rows if r["allocator"] != "paged"]
    figures = {
        "fragmentation_rate": [r["fragmentation_rate_mean_frac"] for r in cont],
        "throughput_loss": [1 - r["request_throughput_req_s"] / paged["request_throughput_req_s"] for r in cont],
        "ttft_p99_ratio": [r["ttft_p99_s"] / paged["ttft_p99_s"] for r in cont],
    }
    lines = [f"paged: fragmentation rate {100 * paged['fragmentation_rate_mean_frac']:.1f}%"]
    for name, vals in figures.items():
        lo, hi = CLAIMS[name]
        pct = name != "ttft_p99_ratio"
        fmt = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:.1f}x")
        places = sorted({_where(v, lo, hi) for v in vals})
        lines.append(f"{name.replace('_', ' ')}: {fmt(min(vals))} to {fmt(max(vals))} (claimed {fmt(lo)} to "
                     f"{fmt(hi)}): {', '.join(places)} the claimed range")  # fmt: skip
    return "\n".join(lines)


def target_verdict(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The outline's target (:data:`TARGET`) as a before/after check of the three core figures of two runs'
    summaries — ``workbench run``'s ``summary.json`` (requests/s = ``requests_finished / wall_time_s``),
    ``workbench simulate``'s, or :func:`gpu_scale_rows` rows (``request_throughput_req_s``), each with ``ttft_p50_s``
    and ``fragmentation_rate_mean_frac``: requests/s gained, TTFT p50
    before and after, the fragmentation rate after; and whether each part of the target is met.

    Raises:
        KeyError: a summary without those keys (name the missing key).
    """

    def req_s(d: dict[str, Any]) -> float:  # workbench run's summary has the finished requests and the wall time
        if "request_throughput_req_s" in d:
            return d["request_throughput_req_s"]
        return d["requests_finished"] / d["wall_time_s"]

    for name, d in (("before", before), ("after", after)):
        need = ["ttft_p50_s", "fragmentation_rate_mean_frac"]
        need += [] if "request_throughput_req_s" in d else ["requests_finished", "wall_time_s"]
        for k in need:
            if k not in d:
                raise KeyError(f"{name} has no {k!r}: give a run's summary (workbench run / simulate summary.json)")
    gain = req_s(after) / req_s(before) - 1
    frag = after["fragmentation_rate_mean_frac"]
    t0, t1 = 1000 * before["ttft_p50_s"], 1000 * after["ttft_p50_s"]
    ok_frag, ok_gain = frag < TARGET["fragmentation_rate_below"], gain >= TARGET["throughput_gain_at_least"]
    return "\n".join([
        f"requests/s: {gain:+.0%} (target at least +{TARGET['throughput_gain_at_least']:.0%}): {'met' if ok_gain else 'not met'}",
        f"fragmentation rate after: {100 * frag:.1f}% (target below {100 * TARGET['fragmentation_rate_below']:.0f}%): "
        f"{'met' if ok_frag else 'not met'}",
        f"TTFT p50: {t0:,.0f} ms before, {t1:,.0f} ms after",
    ])  # fmt: skip


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
