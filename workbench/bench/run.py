"""The main job: a real model serving a prompt set through the engine, with a report.

``run_job`` is what ``workbench run`` calls; notebooks and benchmarks call it too.
It writes ``<output_dir>/<timestamp>/`` with ``steps.jsonl``, ``requests.jsonl``,
``summary.json``, ``config.json`` and a self-contained ``report.html``.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from workbench.bench.datasets import PromptRecord, select_prompts
from workbench.bench.samples import prefix_repetition_records
from workbench.config import EngineConfig
from workbench.entrypoints.llm import LLM
from workbench.entrypoints.progress import labelled_tqdm
from workbench.inputs import check_true_output_len
from workbench.metrics import JsonlSink, Recorder
from workbench.metrics.stats import prefix_cache_summary
from workbench.metrics.waste import flatten_breakdown, waste_breakdown
from workbench.outputs import RequestOutput
from workbench.sampling import SamplingParams

log = logging.getLogger("workbench")

#: ``dataset`` name of the built-in multi-tenant prompt set (:func:`workbench.bench.samples.prefix_repetition_records`)
PREFIX_REPETITION = "prefix-repetition"


@dataclass
class JobResult:
    """What a run produced: outputs in prompt order, the recorder, the summary and the folder;
    ``warnings``: what the run changed of what it was asked (e.g. fewer prompts than asked for)."""

    outputs: list[RequestOutput]
    records: list[PromptRecord]
    recorder: Recorder
    summary: dict
    run_dir: Path | None
    wall_time_s: float
    memory: dict
    warnings: list[str] = field(default_factory=list)
    #: the engine's arguments as run (:meth:`workbench.config.EngineConfig.to_dict`)
    engine_config: dict = field(default_factory=dict)


def check_engine_args(engine_args: dict) -> EngineConfig:
    """Validate engine arguments before any model loads: :meth:`EngineConfig.validate`, then a plug-in allocator's
    class is loaded and a compaction trigger checked against it (buddy and plug-ins without ``move_blocks`` cannot
    compact). Returns the validated config.

    Raises:
        ValueError: what the engine would refuse once built, naming the value and the fix.
    """
    from workbench.config import BUILTIN_ALLOCATORS
    from workbench.kv import plugin_class
    from workbench.kv.defrag import check_trigger
    from workbench.plugins import is_plugin_name

    cfg = EngineConfig(**engine_args).validate()
    a = cfg.kv_allocator
    if a in BUILTIN_ALLOCATORS or is_plugin_name(a):
        cls = plugin_class(f"workbench.kv.{BUILTIN_ALLOCATORS[a]}" if a in BUILTIN_ALLOCATORS else a)
        check_trigger(cfg.kv_defrag_trigger, cls, a)
    return cfg


def to_engine_prompt(rec: PromptRecord):
    """A dataset record as an engine prompt: chat records become one user message."""
    if rec.chat and isinstance(rec.prompt, str):
        return [{"role": "user", "content": rec.prompt}]
    return rec.prompt


def run_job(
    *,
    dataset: str | Path | None = None,
    num_prompts: int | None = 64,
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = -1,
    ignore_eos: bool = False,
    output_dir: str | Path | None = "runs",
    progress: bool = True,
    progress_label: str | None = None,
    llm: LLM | None = None,
    true_output_lens: list[int] | None = None,
    run_name: str | None = None,
    records: list[PromptRecord] | None = None,
    sinks: list | None = None,
    dataset_options: dict | None = None,
    **engine_args,
) -> JobResult:
    """Run a prompt set through the engine and write the run folder.

    Args:
        dataset: ShareGPT JSON or JSONL (see :mod:`workbench.bench.datasets`); ``None`` = the
            project's default prompts; ``"prefix-repetition"`` = the multi-tenant prompt set of
            :func:`workbench.bench.samples.prefix_repetition_records` (``num_prompts`` of them, default 64), with
            ``dataset_options`` its keyword arguments (``prefix_len``, ``zipf``, ``scan_every``, ...).
        num_prompts: first N prompts (``None`` = all); a source with fewer runs all it has, with a
            warning (logged, and in :attr:`JobResult.warnings`).
        max_tokens: output cap per request (a record's own ``max_tokens`` wins).
        temperature, top_p, top_k, ignore_eos: sampling (seeded by the engine's ``seed``).
        output_dir: parent of the run folder; ``None`` writes nothing.
        progress: show progress bars of finished requests and of tokens processed.
        progress_label: names the bars (``"paged / static: requests"``), e.g. a variant of ``compare``.
        llm: an already built engine (``engine_args`` are then ignored).
        true_output_lens: true output length (tokens) per prompt, to replay a trace: each request
            ends there (``finish_reason="stop"``) unless its ``max_tokens`` ends it first, with every
            allocator; ``orca-pow2`` / ``orca-oracle`` reserve by them (:mod:`workbench.bench.output_lens`).
            When they are not given, the records' ``output_len`` are used if every record has one;
            otherwise ``orca-oracle`` / ``orca-pow2`` get them from a ``kv_allocator="paged"`` run of the
            same prompts first (its outputs are the model's own, so the oracle is exact).
        run_name: the run folder's name under ``output_dir`` (default: a timestamp).
        records: the prompts themselves, instead of ``dataset`` (``num_prompts`` still applies).
        sinks: more recorder sinks (e.g. a :class:`~workbench.viz.live.LiveMonitor`'s ``sink``).
        **engine_args: :class:`~workbench.config.EngineConfig` fields.

    Raises:
        ValueError / FileNotFoundError: bad engine arguments or dataset (before the model loads
            where possible).
    """
    from workbench.viz.report import summary_table, write_report

    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"num_prompts={num_prompts} must be >= 1")
    if dataset == "prefix_repetition":  # vLLM's spelling (vllm bench serve --dataset-name prefix_repetition)
        dataset = PREFIX_REPETITION
    if dataset == PREFIX_REPETITION:
        if records is not None:
            raise ValueError("give either dataset='prefix-repetition' or records, not both")
        records, dataset = prefix_repetition_records(num_prompts or 64, **(dataset_options or {})), None
        shown = PREFIX_REPETITION + (f" {json.dumps(dataset_options, sort_keys=True)}" if dataset_options else "")
    elif dataset_options:
        raise ValueError(
            f"dataset_options={dataset_options!r} (--prefix-repetition-* options) apply to dataset='prefix-repetition' "
            f"only, not to dataset={dataset!r}; give --dataset prefix-repetition or drop them"
        )
    else:
        shown = str(dataset) if dataset else "datasets/default_prompts.jsonl"
    records, short = select_prompts(num_prompts, dataset, records)
    if not records:
        raise ValueError(f"dataset {dataset} has no prompts")
    # sampling parameters are checked before the model loads
    params = [
        SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_tokens=r.max_tokens or max_tokens,
            ignore_eos=ignore_eos,
        )
        for r in records
    ]
    if llm is None:
        check_engine_args(engine_args)  # bad arguments fail here, before any model loads
    allocator = llm.llm_engine.config.kv_allocator if llm is not None else engine_args.get("kv_allocator", "paged")
    if true_output_lens is None and all(r.output_len for r in records):
        true_output_lens = [r.output_len for r in records]  # a trace that records them: replayed
    if true_output_lens is not None:
        if len(true_output_lens) != len(records):
            raise ValueError(
                f"{len(true_output_lens)} true output lengths for {len(records)} prompts; give one per prompt"
            )
        for i, n in enumerate(true_output_lens):
            check_true_output_len(n, f"true_output_lens[{i}]")  # before any model loads
    if allocator in ("orca-oracle", "orca-pow2") and true_output_lens is None:
        log.info(
            "kv_allocator=%s reserves by each request's true output length: measuring them first with a "
            "kv_allocator='paged' run of the same prompts",
            allocator,
        )
        base = {k: v for k, v in engine_args.items() if k not in ("kv_allocator", "batching_policy")}
        pre = run_job(
            records=records,
            num_prompts=None,  # records are this job's already: no second warning
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            ignore_eos=ignore_eos,
            output_dir=None,
            progress=progress,
            progress_label=f"{progress_label + ', ' if progress_label else ''}paged run for the output lengths",
            **base,
        )
        true_output_lens = [max(1, len(o.outputs[0].token_ids)) for o in pre.outputs]
    run_dir = None
    sinks = list(sinks or [])
    created = False
    if output_dir is not None:
        run_dir = Path(output_dir) / (run_name or datetime.now().strftime("%Y%m%d-%H%M%S-%f"))
        created = not run_dir.exists()
        sinks.append(JsonlSink(run_dir))
    if llm is not None:
        # a fresh recorder holds only this job's steps; live sinks already attached (a LiveMonitor)
        # follow it, earlier run folders' JSONL sinks do not
        sinks += [k for k in llm.llm_engine.recorder.sinks if not isinstance(k, JsonlSink)]
    recorder = Recorder(sinks)
    if llm is None:
        try:
            llm = LLM(recorder=recorder, **engine_args)
        except BaseException:
            recorder.close()
            if created:  # refused before it ran: leave no empty run folder behind
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
    else:
        llm.llm_engine.recorder = recorder
    eng = llm.llm_engine
    prompts = [to_engine_prompt(r) for r in records]
    # the run's wall time on the engine's clock, the one its records are timed on (time.perf_counter unless the
    # engine was given another, as a simulated or priced executor's)
    t0 = eng.clock()
    bars = labelled_tqdm(progress_label) if progress and progress_label else progress
    outputs = llm.generate(prompts, params, use_tqdm=bars, true_output_lens=true_output_lens)
    wall = eng.clock() - t0
    recorder.close()
    steps = [s.to_dict() for s in recorder.steps]
    reqs = [r.to_dict() for r in recorder.requests]
    summary = summary_table(steps, reqs, wall)
    summary["startup_s"] = eng.startup_time_s  # the whole engine build
    summary["model_load_s"] = eng.load_time_s
    summary.update(
        {
            f"waste_{k}": v
            for k, v in flatten_breakdown(waste_breakdown(steps)).items()
            if k.endswith(("_pool_frac", "_used_frac"))
        }
    )
    if eng.config.enable_prefix_caching:
        summary.update(prefix_cache_summary(steps))
    memory = eng.memory.to_dict()
    if run_dir is not None:
        config = eng.config.to_dict() | {
            "max_model_len": eng.max_model_len,
            "max_num_batched_tokens": eng.max_num_batched_tokens,
            "num_blocks": eng.memory.num_blocks,
            "kv_bytes_per_token": eng.memory.kv_bytes_per_token,
            "resolved_dtype": str(eng.config.torch_dtype).removeprefix("torch."),  # what dtype "auto" became here
            "resolved_kv_cache_dtype": str(eng.config.kv_torch_dtype).removeprefix("torch."),
            "dataset": shown,
            "num_prompts": len(records),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "ignore_eos": ignore_eos,
            "true_output_lens": "given per request (a trace replay)" if true_output_lens else "none (EOS or the cap)",
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (run_dir / "config.json").write_text(json.dumps(config | {"memory": memory}, indent=2, default=str))
        write_report(
            run_dir / "report.html",
            steps,
            reqs,
            summary,
            config,
            title="workbench run",
            block_maps=recorder.block_maps,
            memory=memory,
        )
    warns = [short] if short else []
    return JobResult(outputs, records, recorder, summary, run_dir, wall, memory, warns, eng.config.to_dict())
