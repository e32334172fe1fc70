"""Real engine runs for the chapter notebooks: a seeded trace, one call per run, readable summaries.

Every run here is a real :func:`~workbench.bench.run.run_job` of the engine (the bundled
SmolLM2-135M-Instruct in float32 by default, or any model folder given as ``model=``); nothing is
pre-recorded. The lab trace fixes each request's output length (its true output length, EOS
ignored: each request ends there, or at its ``max_tokens`` cap when that comes first), so the memory
figures a chapter prints depend on the engine's decisions alone, not on which token the model picks —
the stored notebook outputs that nbval compares are then the same on every machine.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from workbench.bench.datasets import PromptRecord, default_prompts
from workbench.bench.output_lens import exponential_output_lens
from workbench.bench.run import JobResult, run_job

__all__ = [
    "LAB_ENGINE_DEFAULTS",
    "lab_trace",
    "lab_run",
    "run_summary",
    "breakdown_rows",
    "breakdown_table",
    "lab_engine",
    "memory_timeline",
    "waste_figure",
]

#: engine arguments every lab run starts from (a learner's panel or call overrides them)
LAB_ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "seed": 0,
    "max_model_len": 256,
    "block_size": 16,
    "max_num_seqs": 16,
}

#: output-length means (tokens) of the vLLM paper's traces (Kwon et al., SOSP 2023, Fig. 11)
TRACE_OUTPUT_MEANS = {"sharegpt": 337.99, "alpaca": 58.45}


def check_engine_arg_names(names: Iterable[str], also: Sequence[str] = ()) -> None:
    """Refuse a name that is not an :class:`~workbench.config.EngineConfig` field (nor one of
    ``also``), naming the closest one.

    Raises:
        ValueError: the first unknown name, with "did you mean ..." or the list of engine arguments.
    """
    import difflib

    from workbench.config import engine_arg_names

    fields = engine_arg_names()  # EngineConfig's fields, less the internal ones
    for name in names:
        if name not in fields and name not in also:
            near = difflib.get_close_matches(name, [*fields, *also], n=1)
            raise ValueError(
                f"{name!r} is not an engine argument"
                + (f"; did you mean {near[0]!r}?" if near else f"; engine arguments: {', '.join(sorted(fields))}")
            )


def check_engine_args(args: dict[str, Any]) -> None:
    """What the engine would refuse in ``args``, refused before any model loads: an unknown name
    (:func:`check_engine_arg_names`) or a bad value (:meth:`~workbench.config.EngineConfig.validate`).

    Raises:
        ValueError: naming the argument and the fix.
    """
    from workbench.config import EngineConfig

    check_engine_arg_names(args)
    EngineConfig(**args).validate()


def lab_trace(
    num_requests: int = 10,
    *,
    mean_output: float = 16.0,
    max_output: int = 48,
    min_output: int = 2,
    seed: int = 0,
    max_prompt_chars: int = 600,
    max_tokens: int | None = None,
) -> list[PromptRecord]:
    """Real prompts (the project's own set) with a seeded, long-tailed output length each.

    Output lengths follow an exponential distribution of mean ``mean_output`` tokens, clipped to
    ``[min_output, max_output]`` — the long tail that makes reserving for the maximum wasteful
    (ShareGPT's outputs are long-tailed; vLLM paper Fig. 11). Each record's ``output_len`` is that
    length (its true output length: :func:`lab_run` ends the request there, EOS ignored, so every
    request produces exactly that many tokens and the oracle allocators know it), and its
    ``max_tokens`` (the declared cap, what ``orca-max`` reserves for) is ``max_tokens``, or the true
    length itself when ``max_tokens`` is ``None``.

    Args:
        num_requests: how many records (prompts are taken in file order, skipping those longer
            than ``max_prompt_chars`` characters so that CPU runs stay short).
        mean_output, max_output, min_output: output lengths, tokens.
        seed: the random seed (same seed, same trace).
        max_tokens: every request's cap (tokens, at least ``max_output``); ``None``: each request's
            own true length (the cap is then exact, and ``orca-max`` reserves what ``orca-oracle`` does).

    Raises:
        ValueError: a non-positive count, inconsistent bounds, or a cap below ``max_output``.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if not (1 <= min_output <= max_output):
        raise ValueError(f"need 1 <= min_output ({min_output}) <= max_output ({max_output})")
    if mean_output <= 0:
        raise ValueError(f"mean_output={mean_output} must be > 0 tokens")
    if max_tokens is not None and max_tokens < max_output:
        raise ValueError(f"max_tokens={max_tokens} is below max_output={max_output}; give a cap >= max_output")
    pool = [r for r in default_prompts() if isinstance(r.prompt, str) and len(r.prompt) <= max_prompt_chars]
    lens = exponential_output_lens(num_requests, mean_output, seed=seed, min_len=min_output, max_len=max_output)
    return [
        replace(pool[i % len(pool)], id=f"{pool[i % len(pool)].id}-{i}", max_tokens=max_tokens or n, output_len=n)
        for i, n in enumerate(lens)
    ]


#: run_job's own keyword arguments (not engine arguments) that lab_run passes through
_JOB_ARGS = frozenset(inspect.signature(run_job).parameters) - {"engine_args"}


def lab_run(
    records: Sequence[PromptRecord] | None = None,
    *,
    sinks: Iterable | None = None,
    output_dir: str | None = None,
    ignore_eos: bool = True,
    **engine_args: Any,
) -> JobResult:
    """One real engine run of ``records`` (default: :func:`lab_trace`) with the lab defaults.

    Args:
        records: the requests; each record's ``max_tokens`` caps its output, and with ``ignore_eos`` its
            ``output_len`` (else its ``max_tokens``) is its true output length, where it ends.
        sinks: extra recorder sinks, e.g. a ``LiveMonitor``'s ``sink`` for a live plot.
        output_dir: write a run folder (report, ``steps.jsonl``) under it; ``None`` writes nothing.
        ignore_eos: generate exactly ``max_tokens`` per request (default), so that memory figures do
            not depend on the sampled tokens.
        **engine_args: :class:`~workbench.config.EngineConfig` fields over :data:`LAB_ENGINE_DEFAULTS`.

    Returns:
        The :class:`~workbench.bench.run.JobResult` (outputs, recorder with every ``StepStats``,
        summary, memory budget).

    Raises:
        ValueError: bad engine arguments (named, before the model loads).
    """
    records = list(records) if records is not None else lab_trace()
    args = LAB_ENGINE_DEFAULTS | engine_args
    job = {k: v for k, v in args.items() if k in _JOB_ARGS}  # run_job's own (e.g. llm: an engine to reuse)
    check_engine_args({k: v for k, v in args.items() if k not in job})
    return run_job(
        records=records,
        num_prompts=None,
        ignore_eos=ignore_eos,
        output_dir=output_dir,
        progress=False,
        sinks=list(sinks or []),
        true_output_lens=[r.output_len or r.max_tokens for r in records] if ignore_eos else None,
        **args,
    )


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def run_summary(res: JobResult) -> dict[str, Any]:
    """The deterministic figures of a run (no timings): counts, pool, the waste split, batch size.

    Shares are of *used* memory (pool − free), each step weighted by its occupancy — the vLLM
    paper's Fig. 2 measure (:func:`workbench.metrics.waste_breakdown`); ``token_states_pool`` is
    the share of the whole pool.
    """
    from workbench.metrics.waste import waste_breakdown

    steps = [s.to_dict() for s in res.recorder.steps]
    wb = waste_breakdown(steps)
    running = [s["num_running"] for s in steps]
    return {
        "requests": res.summary["requests_total"],
        "finished": res.summary["requests_finished"],
        "prompt_tokens": res.summary["prompt_tokens_total"],
        "output_tokens": res.summary["output_tokens_total"],
        "steps": len(steps),
        "pool_blocks": res.memory["num_blocks"],
        "block_size": steps[0]["block_size"] if steps else None,
        "peak_blocks_used": max((s["blocks_used"] for s in steps), default=0),
        "mean_running": sum(running) / len(running) if running else 0.0,
        "preemptions": sum(s["num_preemptions"] for s in steps),
        "token_states": wb["used_share"]["token_states"],
        "reservation": wb["used_share"]["reservation"],
        "internal_fragmentation": wb["used_share"]["internal_fragmentation"],
        "external_fragmentation": wb["used_share"]["external_fragmentation"],
        "token_states_pool": wb["pool_share"]["token_states"],
    }


#: the summary columns of :func:`breakdown_table`: ``(key, header with its unit, formatter)``
SUMMARY_COLUMNS = (
    ("steps", "steps", str),
    ("mean_running", "mean batch (requests)", lambda v: f"{v:.2f}"),
    ("peak_blocks_used", "peak blocks", str),
    ("preemptions", "preempted", str),
    ("token_states", "token states (% of used)", _pct),
    ("reservation", "reservation (% of used)", _pct),
    ("internal_fragmentation", "internal frag. (% of used)", _pct),
    ("external_fragmentation", "external frag. (% of used)", _pct),
)


def breakdown_rows(results: dict[str, JobResult]) -> list[dict[str, Any]]:
    """:func:`run_summary` of each named run, with its name under ``"run"``."""
    return [{"run": name} | run_summary(r) for name, r in results.items()]


def breakdown_table(rows: Sequence[dict[str, Any]], columns=SUMMARY_COLUMNS, first: str = "run"):
    """A :class:`~workbench.viz.table.Table` of summary rows (:func:`run_summary`, :func:`breakdown_rows`):
    steps, batch, blocks, preemptions and where the used KV memory went (shares of used memory, %).

    ``columns``: ``(key, header, formatter)`` triples after the ``first`` column (the run's name)."""
    from workbench.viz.table import Column, Table

    cols = [Column(first, first, str, align="left")] + [Column(k, h, fmt) for k, h, fmt in columns]
    return Table(cols, rows)


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks a paged sequence of ``tokens`` tokens holds: ``ceil(tokens / block_size)``."""
    return math.ceil(tokens / block_size)


# ---------------------------------------------------------------- an engine and a run's figures, for several chapters
def lab_engine(**engine_args: Any):
    """A real engine (an ``LLM``) with the lab defaults (the bundled model unless ``model=`` is given)."""
    from workbench.entrypoints.llm import LLM

    return LLM(**(LAB_ENGINE_DEFAULTS | engine_args))


def waste_figure(results: dict[str, Any]):
    """Where each run's KV memory went (:func:`workbench.viz.figures.waste_bars_figure`)."""
    from workbench.viz.figures import waste_bars_figure

    return waste_bars_figure({k: [s.to_dict() for s in r.recorder.steps] for k, r in results.items()})


def memory_timeline(result, title: str | None = None):
    """The five KV-pool categories over one run (:func:`workbench.viz.figures.memory_timeline_figure`)."""
    from workbench.viz.figures import memory_timeline_figure

    fig = memory_timeline_figure([s.to_dict() for s in result.recorder.steps], unit="tokens")
    if title:
        fig.update_layout(title=title)
    return fig
