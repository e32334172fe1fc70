"""``workbench`` command line (click).

workbench run                      # the bundled model on the project's prompts, report under runs/
workbench run --dataset path/to/ShareGPT_V3_filtered_500.json --num-prompts 32
"""

from __future__ import annotations

import json
import logging
import os
import sys

import click

from workbench.cli.bench_serve import bench_serve_command
from workbench.cli.errors import user_errors
from workbench.cli.kv_calc import kv_calc_command
from workbench.cli.options import engine_args as _engine_args
from workbench.cli.options import engine_options, kv_figure_rows, kv_manager_line, parse_bytes
from workbench.cli.simulate import simulate_command
from workbench.config import BATCHING_POLICIES, CONTIGUOUS_ALLOCATORS, KV_ALLOCATORS

__all__ = ["main", "engine_options", "parse_bytes"]  # the engine options are generated from EngineConfig


@click.group()
@click.version_option(package_name="workbench")
@click.option("-v", "--verbose", is_flag=True, help="debug logging")
def main(verbose: bool) -> None:
    """workbench: a paged-KV, continuous-batching LLM engine and its course lab."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def prefix_repetition_options(f):
    """``--prefix-repetition-*``: the options of ``--dataset prefix-repetition``
    (:func:`workbench.bench.samples.prefix_repetition_records`); vLLM's ``bench serve`` names where it has them."""
    opts = [
        ("--prefix-repetition-prefix-len", int, "tokens of each tenant's system prompt [default: 256]"),
        ("--prefix-repetition-suffix-len", int, "tokens of each request's own suffix [default: 256]"),
        ("--prefix-repetition-num-prefixes", int, "tenants (distinct system prompts) [default: 10]"),
        ("--prefix-repetition-output-len", int, "output tokens per request [default: --max-tokens]"),
        ("--prefix-repetition-zipf", float, "Zipf exponent of tenant popularity (0 = uniform) [default: 0]"),
        ("--prefix-repetition-scan-every", int, "every N-th request a one-off scan prompt (0 = none) [default: 0]"),
        ("--prefix-repetition-scan-len", int, "tokens of a scan prompt [default: 4 x prefix len]"),
        ("--prefix-repetition-seed", int, "seed of the prompt set [default: 0]"),
        (
            "--prefix-repetition-vocab-size",
            int,
            "token ids are drawn from 3 up to this (the model's vocabulary) [default: 1000]",
        ),
    ]
    for name, kind, text in reversed(opts):
        f = click.option(name, type=kind, default=None, help=text)(f)
    return f


@main.command(short_help="Serve a prompt set; print a summary; write a run folder with a report.")
@click.option(
    "--dataset",
    type=click.Path(dir_okay=False),
    default=None,
    help="ShareGPT JSON or JSONL prompts, or 'prefix-repetition' (tenants' system prompts, the "
    "--prefix-repetition-* options) [default: datasets/default_prompts.jsonl]",
)
@click.option("--num-prompts", default=64, show_default=True, type=int, help="use the first N prompts")
@click.option("--max-tokens", default=128, show_default=True, type=int, help="output cap per request")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="nucleus sampling (1 = off)")
@click.option("--top-k", default=-1, show_default=True, type=int, help="keep the k most likely tokens (-1 = all)")
@click.option("--ignore-eos", is_flag=True, help="generate max-tokens tokens even past the end-of-sequence token")
@click.option("--output-dir", default="runs", show_default=True, help="parent of the run folder")
@prefix_repetition_options
@engine_options
def run(dataset, num_prompts, max_tokens, temperature, top_p, top_k, ignore_eos, output_dir, **kw):
    """Serve a prompt set with the engine; print a summary; write runs/<timestamp>/ with a report."""
    from rich.console import Console
    from rich.table import Table

    from workbench.bench.run import run_job

    console = Console()
    options = {k.removeprefix("prefix_repetition_"): kw.pop(k) for k in list(kw) if k.startswith("prefix_repetition_")}
    options = {k: v for k, v in options.items() if v is not None}
    if "scan_len" in options and not options.get("scan_every"):
        raise click.UsageError("--prefix-repetition-scan-len has no effect without --prefix-repetition-scan-every N")
    with user_errors():
        res = run_job(
            dataset=dataset,
            dataset_options=options or None,  # run_job refuses them with another dataset
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            ignore_eos=ignore_eos,
            output_dir=output_dir,
            **_engine_args(kw),
        )
    s = res.summary
    steps = res.recorder.steps
    pre_rc = sum(x.num_preempted_recompute for x in steps)
    pre_sw = sum(x.num_preempted_swap for x in steps)
    swapped = (sum(x.swap_out_blocks for x in steps), sum(x.swap_in_blocks for x in steps))
    swapped = swapped if any(swapped) else None
    t = Table(title="workbench run", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right", overflow="fold")  # a plug-in's long name wraps, not cut

    def ms(v):
        return "n/a" if v is None else f"{v * 1000:,.1f} ms"

    rows = [
        ("KV manager", kv_manager_line(res.engine_config)),
        ("requests (finished / errors)", f"{s['requests_total']} ({s['requests_finished']} / {s['requests_errored']})"),
        ("prompt tokens", f"{s['prompt_tokens_total']:,}"),
        ("output tokens", f"{s['output_tokens_total']:,}"),
        ("wall time", f"{s['wall_time_s']:.2f} s"),
        ("startup: engine build, not in wall time", f"{s['startup_s']:.1f} s (model load {s['model_load_s']:.1f} s)"),
        ("output throughput", f"{s['output_throughput_tok_s']:,.1f} tok/s"),
        ("total throughput", f"{s['total_throughput_tok_s']:,.1f} tok/s"),
        ("TTFT p50 / p99", f"{ms(s['ttft_p50_s'])} / {ms(s['ttft_p99_s'])}"),
        ("TPOT p50 / p99", f"{ms(s['tpot_p50_s'])} / {ms(s['tpot_p99_s'])}"),
        ("ITL p50 / p99", f"{ms(s['itl_p50_s'])} / {ms(s['itl_p99_s'])}"),
        ("mean requests batched per step", f"{s['batched_reqs_mean']:.1f}"),
        ("KV utilization (mean over steps)", f"{s['kv_utilization_mean_frac']:.1%}"),
        ("KV blocks used (peak / pool)", f"{s['blocks_used_peak']:,} / {res.memory['num_blocks']:,}"),
        ("fragmentation rate (mean)", f"{s['fragmentation_rate_mean_frac']:.1%}"),
        (
            "KV pool: token states / reservation / internal / external / free (mean share)",
            " / ".join(
                f"{s[f'waste_{c}_pool_frac']:.1%}"
                for c in ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
            ),
        ),
        ("preemptions (recompute / swap)", f"{s['preemptions_total']} ({pre_rc} / {pre_sw})"),
    ]
    if swapped:
        rows.append(("KV blocks swapped out / in", f"{swapped[0]:,} / {swapped[1]:,}"))
    comm_s = sum(x.comm_time_s for x in steps)
    if comm_s:  # tensor parallelism: rank 0's seconds in collectives, within the model time
        model_s = sum(x.model_time_s for x in steps)
        mib = sum(x.allreduce_bytes for x in steps) / 2**20
        rows.append(
            (
                "collectives / model time (tensor parallel)",
                f"{comm_s:.2f} s / {model_s:.2f} s, {mib:,.1f} MiB all-reduced",
            )
        )
    rows += kv_figure_rows(s, res.engine_config)
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    for rec, o in zip(res.records, res.outputs):
        if o.error:
            console.print(f"[red]request {o.request_id} (prompt {rec.id}) refused:[/red] {o.error}")
    for w in res.warnings:  # logged at the start too; repeated here, below the progress bar and the table
        console.print(f"warning: {w}", style="yellow", markup=False, soft_wrap=True)
    if res.run_dir is not None:
        console.print(f"report:   {res.run_dir / 'report.html'}")
        console.print(f"steps:    {res.run_dir / 'steps.jsonl'}")
        console.print(f"requests: {res.run_dir / 'requests.jsonl'}")
    if s["requests_total"] and not s["requests_finished"]:  # nothing was served: not a successful run
        raise click.ClickException(f"none of the {s['requests_total']} requests finished; the reasons are above")


@main.command(short_help="Run one trace through several KV allocators / batching policies; one report.")
@click.option(
    "--kv-allocator",
    "allocators",
    default=",".join(("paged", *CONTIGUOUS_ALLOCATORS)),
    show_default=True,
    help=f"comma-separated: {', '.join(KV_ALLOCATORS)} or package.module:Class (default: the vLLM paper's Fig. 2 five)",
)
@click.option(
    "--batching-policy",
    "policies",
    default=BATCHING_POLICIES[0],
    show_default=True,
    help=f"comma-separated: {', '.join(BATCHING_POLICIES)}",
)
@click.option("--dataset", type=click.Path(dir_okay=False), default=None, help="ShareGPT JSON or JSONL prompts")
@click.option("--num-prompts", default=64, show_default=True, type=int, help="use the first N prompts")
@click.option("--max-tokens", default=128, show_default=True, type=int, help="output cap per request")
@click.option("--output-dir", default="runs", show_default=True, help="parent of the compare-<timestamp> folder")
@click.option(
    "--true-output-lens",
    default="auto",
    show_default=True,
    help="each request's true output length (it ends there, as at EOS; orca-pow2/oracle reserve by it): "
    "model (a paged run first), trace (the dataset's output_len), exponential:M (seeded, mean M tokens, "
    "EOS ignored), auto (trace if every prompt has one, else model)",
)
@engine_options(exclude=("kv_allocator", "batching_policy"))
def compare(allocators, policies, dataset, num_prompts, max_tokens, output_dir, true_output_lens, **kw):
    """Serve the same prompts (greedy) once per allocator x batching policy, and write compare.html
    with the waste breakdown side by side, throughput, TTFT and requests batched.

    \b
    workbench compare --num-prompts 32 --max-model-len 1024 --kv-cache-memory-bytes 48MiB
    workbench compare --kv-allocator paged --batching-policy continuous,static,grouped
    workbench compare --max-tokens 512 --true-output-lens exponential:32   # the paper's Fig. 2 order
    """
    from rich.console import Console
    from rich.table import Table

    from workbench.bench.compare import compare as run_compare

    console = Console(width=max(130, Console().width))  # the table's 9 columns, also when piped
    with user_errors():
        res = run_compare(
            allocators=[a.strip() for a in allocators.split(",") if a.strip()],
            batching_policies=[p.strip() for p in policies.split(",") if p.strip()],
            dataset=dataset,
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            output_dir=output_dir,
            true_output_lens=true_output_lens,
            **_engine_args(kw),
        )
    t = Table(title="workbench compare: where the KV pool went (share of occupied memory)")
    for c in (
        "variant",
        "token states",
        "reservation",
        "internal",
        "external",
        "batched",
        "tok/s",
        "TTFT p50",
        "refused",
    ):
        t.add_column(c, justify="left" if c == "variant" else "right", no_wrap=True)
    for r in res.rows:
        t.add_row(
            r["variant"],
            f"{r['token_states_used_frac']:.1%}",
            f"{r['reservation_used_frac']:.1%}",
            f"{r['internal_fragmentation_used_frac']:.1%}",
            f"{r['external_fragmentation_used_frac']:.1%}",
            f"{r['batched_reqs_mean']:.2f}",
            f"{r['output_throughput_tok_s']:,.1f}",
            "n/a" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:.3f} s",
            str(r["requests_errored"]),
        )
    console.print(t)
    for label, job in res.results.items():
        refused = [(rec, o) for rec, o in zip(job.records, job.outputs) if o.error]
        for rec, o in refused:
            console.print(f"[red]{label}: prompt {rec.id} refused:[/red] {o.error}")
    for w in res.warnings:
        console.print(f"warning: {w}", style="yellow", markup=False, soft_wrap=True)
    if res.out_dir is not None:
        console.print(f"report: {res.out_dir / 'compare.html'}")
        console.print(f"rows:   {res.out_dir / 'compare.json'}")


@main.command(short_help="Serve the model over an OpenAI-compatible HTTP API, with Prometheus /metrics.")
@click.argument("model_tag", required=False)
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="address to bind (0.0.0.0: every interface). vLLM binds every interface by default; loopback here, so "
    "that a course machine exposes nothing unless asked",
)
@click.option("--port", default=8000, show_default=True, type=int, help="TCP port")
@click.option("--served-model-name", default=None, help="the name clients use as 'model' [default: --model's value]")
@click.option(
    "--graceful-shutdown-timeout",
    default=5.0,
    show_default=True,
    type=float,
    help="seconds in-flight requests get to finish after SIGINT/SIGTERM; the rest are aborted",
)
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
@click.option(
    "--api-key",
    envvar="VLLM_API_KEY",
    default=None,
    help="require 'Authorization: Bearer KEY' on /v1 and /admin requests [env: VLLM_API_KEY]",
)
@click.option(
    "--enable-admin-api",
    is_flag=True,
    help="add GET /admin/state, POST /admin/compact, /admin/max_num_seqs and /admin/max_num_queued_reqs (an alert "
    "receiver's actions; not in vLLM)",
)
@click.option(
    "--max-request-body-bytes",
    default=16 * 1024 * 1024,
    show_default=True,
    type=click.IntRange(min=1),
    help="larger request bodies are answered 413 unread (not in vLLM, which reads any size)",
)
@engine_options
def serve(model_tag, host, port, served_model_name, graceful_shutdown_timeout, log_level, api_key, enable_admin_api,
          max_request_body_bytes, **kw):  # fmt: skip
    """Serve the model over HTTP, as `vllm serve`: POST /v1/completions and /v1/chat/completions
    (streaming with "stream": true), GET /v1/models, /health, /metrics (Prometheus), POST /tokenize
    and /detokenize. MODEL_TAG, when given, is the model (as --model).

    \b
    workbench serve --port 8000 --max-model-len 2048
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
    """
    from workbench.entrypoints.async_llm import EngineDeadError
    from workbench.server.api_server import run_server

    args = _engine_args(kw)
    if model_tag is not None:
        args["model"] = model_tag
    try:
        with user_errors():
            run_server(
                args, host, port, served_model_name, log_level, graceful_shutdown_timeout, api_key, enable_admin_api,
                max_request_body_bytes,
            )  # fmt: skip
    except EngineDeadError as e:
        raise click.ClickException(f"{e}; the server has stopped (exit status 1)") from None


@main.command(short_help="Start JupyterLab on the course's chapter notebooks (labs/).")
@click.option(
    "--labs-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="folder of the notebooks (default: labs/ of this checkout, else the current folder)",
)
@click.option("--port", default=8888, show_default=True, type=int)
@click.option("--no-browser", is_flag=True, help="do not open a browser")
@click.argument("jupyter_args", nargs=-1, type=click.UNPROCESSED)
def lab(labs_dir, port, no_browser, jupyter_args):
    """Start JupyterLab on labs/ (needs the lab and triton extras: pip install -e '.[lab,triton]').

    Extra arguments go to JupyterLab, e.g. workbench lab -- --ip=0.0.0.0
    (run as root, --allow-root is added).
    """
    import importlib.util
    import subprocess
    from pathlib import Path

    if importlib.util.find_spec("jupyterlab") is None:
        raise click.ClickException("JupyterLab is not installed: pip install -e '.[lab,triton]'")
    if labs_dir is None:
        here = Path(__file__).resolve().parents[2] / "labs"  # the checkout's notebooks: <repo>/workbench/cli/main.py
        labs_dir = here if here.is_dir() else Path.cwd()
    labs_dir = Path(labs_dir)
    if not labs_dir.is_dir():
        raise click.ClickException(f"--labs-dir {labs_dir} is not a folder")
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={labs_dir}", f"--port={port}"]
    if no_browser:
        cmd.append("--no-browser")
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in jupyter_args:
        cmd.append("--allow-root")  # JupyterLab refuses to start as root without it (containers)
    cmd += list(jupyter_args)
    click.echo(f"JupyterLab on {labs_dir} (Ctrl-C to stop)")
    sys.exit(subprocess.call(cmd))


@main.group()
def bench() -> None:
    """Benchmarks against a running server, as `vllm bench`."""


@bench.command("compare")
@click.argument("baseline", nargs=1, type=click.Path(exists=True))
@click.argument("new", nargs=1, type=click.Path(exists=True))
@click.option(
    "--latency-threshold", default=1.20, show_default=True, type=float, help="a latency regressed above this ratio"
)
@click.option(
    "--throughput-threshold", default=0.80, show_default=True, type=float, help="a throughput regressed below this"
)
@click.option("--html", "html_path", default=None, type=click.Path(dir_okay=False), help="write the report page here")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), help="write the rows as JSON here")
@click.option(
    "--allow-workload-mismatch",
    is_flag=True,
    help="compare although the two sides ran different workloads (prompts, rate, concurrency); refused otherwise",
)
def bench_compare(baseline, new, latency_threshold, throughput_threshold, html_path, json_path,
                  allow_workload_mismatch):  # fmt: skip
    """Compare NEW benchmark results against BASELINE: per metric the ratio of the medians over repeats, a verdict,
    and exit code 1 when a gated metric regressed (0 when none did, 2 on bad input), for CI.

    BASELINE and NEW are each a `bench serve --save-result` JSON file, a `workbench run` folder, a JSON list or JSON
    Lines of results, or a folder of such files or folders (the repeats).

    \b
    workbench bench compare runs/base/ runs/new/ --html compare.html
    workbench bench compare base.json new.json --latency-threshold 1.1
    """
    from rich.console import Console

    from workbench.bench.regression import compare_results, load_results

    with user_errors(exit_code=2):  # bad input; 1 is a regression
        report = compare_results(
            load_results(baseline), load_results(new), latency_threshold, throughput_threshold,
            allow_workload_mismatch=allow_workload_mismatch,
        )  # fmt: skip
    console = Console(width=max(120, Console().width))
    console.print(str(report.table()), markup=False, highlight=False, soft_wrap=True)
    for r in report.regressions:
        limit = report.throughput_limit if r["higher_is_better"] else report.latency_limit
        console.print(f"REGRESSED: {r['metric']} ({r['key']}) {r['ratio']:.3f}x the baseline median (limit {limit:.2f}x)",
                      style="red", markup=False)  # fmt: skip
    if html_path:
        console.print(f"report: {report.write_html(html_path)}", markup=False)
    if json_path:
        from pathlib import Path

        Path(json_path).write_text(json.dumps(report.to_dict(), indent=2))
        console.print(f"rows:   {json_path}", markup=False)
    sys.exit(0 if report.passed else 1)


bench.add_command(bench_serve_command)  # `workbench bench serve`; its options live in workbench.cli.bench_serve
main.add_command(kv_calc_command)  # `workbench kv-calc`; its options live in workbench.cli.kv_calc
main.add_command(simulate_command)  # `workbench simulate`; its options live in workbench.cli.simulate


if __name__ == "__main__":
    sys.exit(main())
