"""``workbench compare``: the same trace through several KV allocators and batching policies.

Each variant is a full engine run (:func:`workbench.bench.run.run_job`) of the same prompts with
the same sampling; only ``kv_allocator`` / ``batching_policy`` change. Every variant replays the
same true output length per request (each request ends there, as if its model had emitted EOS;
the oracle allocators ``orca-oracle`` and ``orca-pow2`` reserve by it), taken from the trace when
it records them, from a seeded long-tailed distribution, or from the ``paged`` run (which runs
first, and is added when an oracle allocator needs them and it was not asked for): :mod:`workbench.bench.output_lens`. With a
``max_tokens`` cap well above long-tailed true lengths the five allocators order as the vLLM
paper's Fig. 2. One folder holds a run folder per variant, ``compare.json`` (one flat row per variant) and
``compare.html`` (the waste breakdown side by side, throughput, TTFT, requests batched, the
memory timelines and latency CDFs).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from workbench.bench.datasets import select_prompts
from workbench.bench.output_lens import true_output_lens_for
from workbench.bench.run import JobResult, check_engine_args, run_job
from workbench.kv.contiguous import KV_ALLOCATORS
from workbench.metrics.waste import USED_CATEGORIES, WASTE_CATEGORIES, waste_breakdown
from workbench.plugins import is_plugin_name
from workbench.scheduler import BATCHING_POLICIES


@dataclass
class Comparison:
    """Results of :func:`compare`: ``rows`` (one flat dict per variant, in run order), the runs, the
    folder, and ``warnings`` (e.g. fewer prompts than asked for; said once, not per variant)."""

    rows: list[dict]
    results: dict[str, JobResult]
    out_dir: Path | None
    warnings: list[str] = field(default_factory=list)


def variant_label(allocator: str, policy: str) -> str:
    """A variant's short name: the allocator (a plug-in by its class name), with the batching policy unless it is
    ``continuous``."""
    name = allocator.rsplit(":", 1)[-1]
    return name if policy == "continuous" else f"{name} / {policy}"


def compare_row(label: str, allocator: str, policy: str, res: JobResult) -> dict:
    """One variant's figures: the waste breakdown (share of the pool and of occupied memory),
    throughput, TTFT, requests batched, preemptions."""
    steps = [s.to_dict() for s in res.recorder.steps]
    wb = waste_breakdown(steps)
    s = res.summary
    row = {"variant": label, "kv_allocator": allocator, "batching_policy": policy}
    for c in WASTE_CATEGORIES:
        row[f"{c}_pool_frac"] = wb["pool_share"][c]
    for c in USED_CATEGORIES:
        row[f"{c}_used_frac"] = wb["used_share"][c]
    row.update(
        kv_utilization_mean=wb["kv_utilization_mean"],
        fragmentation_rate_mean=wb["fragmentation_rate_mean"],
        batched_reqs_mean=s["batched_reqs_mean"],
        running_reqs_mean=s["running_reqs_mean"],
        output_throughput_tok_s=s["output_throughput_tok_s"],
        total_throughput_tok_s=s["total_throughput_tok_s"],
        ttft_p50_s=s["ttft_p50_s"],
        ttft_p99_s=s["ttft_p99_s"],
        e2e_p50_s=s["e2e_p50_s"],
        preemptions_total=s["preemptions_total"],
        num_steps=s["num_steps"],
        wall_time_s=s["wall_time_s"],
        requests_finished=s["requests_finished"],
        requests_errored=s["requests_errored"],
    )
    return row


def compare(
    *,
    allocators: list[str] = ("paged", "static", "orca-max", "orca-pow2", "orca-oracle"),
    batching_policies: list[str] = ("continuous",),
    dataset: str | Path | None = None,
    num_prompts: int | None = 64,
    max_tokens: int = 128,
    output_dir: str | Path | None = "runs",
    progress: bool = True,
    true_output_lens: str | list[int] = "auto",
    **engine_args,
) -> Comparison:
    """Run every (allocator, batching policy) pair on the same prompts.

    Args:
        allocators: values of ``kv_allocator``.
        batching_policies: values of ``batching_policy``.
        dataset, num_prompts, max_tokens: as :func:`~workbench.bench.run.run_job` (greedy sampling).
        output_dir: parent of the ``compare-<timestamp>`` folder; ``None`` writes nothing.
        true_output_lens: where each request's true output length comes from: ``"auto"``, ``"model"``,
            ``"trace"``, ``"exponential:M"`` (:mod:`workbench.bench.output_lens`; seeded by the engine's
            ``seed``), or one length per prompt. Lengths not from the model are replayed with EOS ignored
            (the request ends at its true length or the cap, not where this model would stop).
        **engine_args: other engine arguments, the same for every variant.

    Raises:
        ValueError: an unknown allocator or policy, a bad ``true_output_lens`` (before any model loads), or bad
            engine arguments.
    """
    bad = [a for a in allocators if a not in KV_ALLOCATORS and not is_plugin_name(a)] + [
        p for p in batching_policies if p not in BATCHING_POLICIES
    ]
    if bad:
        raise ValueError(
            f"unknown variant(s) {bad}: allocators are {', '.join(KV_ALLOCATORS)}; "
            f"batching policies are {', '.join(BATCHING_POLICIES)}"
        )
    for k in ("kv_allocator", "batching_policy"):
        engine_args.pop(k, None)
    check_variants(allocators, batching_policies, engine_args)
    records, short = select_prompts(num_prompts, dataset)
    lens = true_output_lens_for(records, true_output_lens, max_tokens, seed=engine_args.get("seed", 0))
    replay = lens is not None  # lengths not measured from this model: EOS ignored, the request ends at them
    variants = [(a, p) for p in batching_policies for a in allocators]
    if not replay and any(a in ("orca-oracle", "orca-pow2") for a, _ in variants):
        policy = batching_policies[0]
        if ("paged", policy) in variants:
            variants.remove(("paged", policy))
        variants.insert(0, ("paged", policy))  # its output lengths are the oracle's
    out_dir = None
    if output_dir is not None:
        out_dir = Path(output_dir) / datetime.now().strftime("compare-%Y%m%d-%H%M%S")
    results: dict[str, JobResult] = {}
    rows = []
    for a, p in variants:
        label = variant_label(a, p)
        res = run_job(
            dataset=dataset,
            num_prompts=len(records),  # what the dataset has: warned once above, not once per variant
            max_tokens=max_tokens,
            output_dir=out_dir,
            run_name=label.replace(" / ", "_"),
            progress=progress,
            progress_label=label,
            kv_allocator=a,
            batching_policy=p,
            true_output_lens=lens,
            ignore_eos=replay,
            **engine_args,
        )
        if a == "paged" and lens is None:
            lens = [max(1, len(o.outputs[0].token_ids)) for o in res.outputs]
        results[label] = res
        rows.append(compare_row(label, a, p, res))
    if out_dir is not None:
        (out_dir / "compare.json").write_text(json.dumps(rows, indent=2))
        config = engine_args | {"max_tokens": max_tokens, "true_output_lens": _lens_label(true_output_lens)}
        write_compare_report(out_dir / "compare.html", rows, results, config)
    return Comparison(rows, results, out_dir, [short] if short else [])


def check_variants(allocators: list[str], batching_policies: list[str], engine_args: dict) -> None:
    """Refuse a variant that would fail before anything runs: each (allocator, policy) pair's engine arguments are
    validated (:meth:`EngineConfig.validate`), each plug-in allocator is loaded, and a compaction trigger is checked
    against the allocators that cannot move blocks; so a bad last variant does not cost the runs before it.

    Raises:
        ValueError: the first variant's error, naming the variant.
    """
    twice = sorted(
        {a for a in allocators if allocators.count(a) > 1}
        | {p for p in batching_policies if batching_policies.count(p) > 1}
    )
    if twice:
        raise ValueError(f"{', '.join(twice)} given twice; give each allocator and batching policy once")
    for a in allocators:
        for p in batching_policies:
            try:
                check_engine_args(engine_args | {"kv_allocator": a, "batching_policy": p})
            except ValueError as e:
                raise ValueError(f"variant {variant_label(a, p)}: {e}") from None


def _lens_label(source) -> str:
    return source if isinstance(source, str) else f"{len(source)} given"


_COLUMNS = [
    ("variant", "variant", None),
    ("token_states_used_frac", "token states / used", "pct"),
    ("reservation_used_frac", "reservation / used", "pct"),
    ("internal_fragmentation_used_frac", "internal frag. / used", "pct"),
    ("external_fragmentation_used_frac", "external frag. / used", "pct"),
    ("kv_utilization_mean", "KV utilization (token states / pool)", "pct"),
    ("batched_reqs_mean", "requests batched (mean)", "f2"),
    ("output_throughput_tok_s", "output tok/s", "f1"),
    ("ttft_p50_s", "TTFT p50 (s)", "f3"),
    ("ttft_p99_s", "TTFT p99 (s)", "f3"),
    ("preemptions_total", "preemptions", "int"),
    ("requests_errored", "refused", "int"),
    ("num_steps", "steps", "int"),
]


def _fmt(v, kind) -> str:
    if v is None:
        return "n/a"
    if kind == "pct":
        return f"{v:.1%}"
    if kind == "f1":
        return f"{v:,.1f}"
    if kind == "f2":
        return f"{v:.2f}"
    if kind == "f3":
        return f"{v:.3f}"
    if kind == "int":
        return f"{int(v):,}"
    return html.escape(str(v))


def comparison_table(rows: list[dict]) -> str:
    """The side-by-side table as HTML."""
    head = "".join(f"<th>{html.escape(t)}</th>" for _, t, _ in _COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r.get(k), f)}</td>" for k, _, f in _COLUMNS) + "</tr>" for r in rows)
    return f'<table class="summary"><caption>side by side</caption><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def variant_timeline_figure(label: str, steps: list[dict]):
    """One variant's KV pool over the run (:func:`~workbench.viz.figures.memory_timeline_figure`, in
    token slots per step), titled by the variant. Kept at the timeline's own height: a shorter plot
    area than the right axis' title clips the title and lets the legend cover the top tick labels."""
    from workbench.viz.figures import memory_timeline_figure

    fig = memory_timeline_figure(steps, unit="tokens", x="step")
    fig.update_layout(title_text=f"KV pool over the run: {label}")
    return fig


def compare_figures(steps: dict[str, list[dict]], requests: dict[str, list[dict]]) -> list:
    """The page's figures: waste bars, latency CDFs (TTFT, end-to-end), one memory timeline per variant."""
    from workbench.viz.figures import latency_cdf_figure, waste_bars_figure

    figs = [waste_bars_figure(steps), latency_cdf_figure(requests, metric=["ttft_s", "e2e_s"])]
    return figs + [variant_timeline_figure(k, st) for k, st in steps.items()]


def write_compare_report(path: Path, rows: list[dict], results: dict[str, JobResult], config: dict) -> Path:
    """A self-contained HTML page: the table, waste bars, memory timelines, latency CDFs."""
    from workbench.viz.report import _CSS, _LEGEND_HTML, _kv_table

    steps = {k: [s.to_dict() for s in r.recorder.steps] for k, r in results.items()}
    reqs = {k: [q.to_dict() for q in r.recorder.requests] for k, r in results.items()}
    figs = compare_figures(steps, reqs)
    parts = []
    for i, fig in enumerate(figs):
        parts.append(
            '<div class="figure">'
            + fig.to_html(full_html=False, include_plotlyjs=(i == 0), default_width="100%")
            + "</div>"
        )
    title = "workbench compare"
    doc = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title>'
        f"<style>{_CSS}</style></head><body><h1>{title}</h1>"
        f'<div class="tables">{_kv_table(config, "configuration (every variant)", "config")}</div>'
        f"{comparison_table(rows)}{''.join(parts)}{_LEGEND_HTML}</body></html>\n"
    )
    path.write_text(doc, encoding="utf-8")
    return path
