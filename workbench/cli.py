"""``workbench`` command line (click).

workbench run                      # the bundled model on the project's prompts, report under runs/
workbench run --dataset ../shared/data/sharegpt/ShareGPT_V3_filtered_500.json --num-prompts 32
"""

from __future__ import annotations

import logging
import os
import re
import sys

import click

from workbench.config import DEFAULT_MODEL, EngineConfig

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_bytes(value: str | int | None) -> int | None:
    """``"2GiB"``, ``"1.5G"``, ``"512MiB"`` or a plain integer -> bytes.

    Raises:
        click.BadParameter: not a size.
    """
    if value is None or isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise click.BadParameter(f"{value!r} is not a size; write e.g. 2GiB, 512MiB or 2147483648")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def engine_options(f=None, *, exclude: tuple[str, ...] = ()):
    """Every engine argument as a flag, named as in vLLM (less the ``exclude``d flags)."""
    if f is None:
        return lambda g: engine_options(g, exclude=exclude)
    opts = [
        click.option(
            "--model",
            default=DEFAULT_MODEL,
            show_default=True,
            help="HF folder, .safetensors (config.json beside it), .gguf, or the bundled model",
        ),
        click.option("--tokenizer", default=None, help="tokenizer folder (default: the model's)"),
        click.option("--dtype", default="auto", show_default=True, help="auto | float32 | bfloat16 | float16"),
        click.option("--device", default="cpu", show_default=True, help="cpu | cuda | auto"),
        click.option(
            "--seed",
            default=0,
            show_default=True,
            type=int,
            help="seed of sampling for requests without a seed of their own",
        ),
        click.option("--block-size", default=16, show_default=True, type=int, help="tokens per KV block"),
        click.option(
            "--gpu-memory-utilization",
            default=0.9,
            show_default=True,
            type=float,
            help="share of device memory for weights + activations + KV cache, in (0, 1]",
        ),
        click.option(
            "--device-memory",
            default=None,
            help="CPU only: the memory gpu_memory_utilization applies to (e.g. 2GiB) [default: 2GiB]",
        ),
        click.option(
            "--max-num-seqs", default=64, show_default=True, type=int, help="most requests in one step (batch)"
        ),
        click.option(
            "--max-num-batched-tokens",
            default=None,
            type=int,
            help="token budget per step (prefill + decode) [default: 2048 with chunked prefill, else max_model_len]",
        ),
        click.option(
            "--max-model-len",
            default=None,
            type=int,
            help="longest sequence, prompt + output, in tokens [default: the model's, capped at 4096]",
        ),
        click.option(
            "--num-gpu-blocks-override",
            default=None,
            type=int,
            help="number of KV blocks, bypassing the memory budget (for experiments)",
        ),
        click.option(
            "--enable-chunked-prefill/--no-enable-chunked-prefill",
            default=True,
            show_default=True,
            help="split long prompts across steps to fit the token budget",
        ),
        click.option(
            "--long-prefill-token-threshold",
            default=0,
            show_default=True,
            type=int,
            help="most prompt tokens one request takes per step (0 = no cap beyond the budget)",
        ),
        click.option(
            "--enable-prefix-caching/--no-enable-prefix-caching",
            default=False,
            show_default=True,
            help="reuse the KV blocks of identical prompt prefixes",
        ),
        click.option(
            "--scheduling-policy",
            type=click.Choice(["fcfs", "priority"]),
            default="fcfs",
            show_default=True,
            help="order of admission and of preemption",
        ),
        click.option(
            "--preemption-mode",
            type=click.Choice(["recompute", "swap"]),
            default="recompute",
            show_default=True,
            help="what happens to a request preempted when KV blocks run out",
        ),
        click.option(
            "--swap-space",
            default=4.0,
            show_default=True,
            type=float,
            help="CPU swap pool (GiB) for --preemption-mode swap",
        ),
        click.option(
            "--kv-cache-dtype",
            default="auto",
            show_default=True,
            help="auto (= --dtype) | float32 | bfloat16 | float16",
        ),
        click.option(
            "--kv-cache-memory-bytes",
            default=None,
            help="size of the KV pool (e.g. 64MiB), bypassing the profiled memory budget",
        ),
        click.option(
            "--kv-allocator",
            type=click.Choice(["paged", "static", "orca-max", "orca-pow2", "orca-oracle"]),
            default="paged",
            show_default=True,
            help="paged (PagedAttention) or a contiguous baseline reserving each request's maximum length",
        ),
        click.option(
            "--batching-policy",
            type=click.Choice(["continuous", "static", "grouped"]),
            default="continuous",
            show_default=True,
            help="continuous (iteration-level) or static / length-grouped batches that wait for their longest member",
        ),
        click.option(
            "--block-map-every",
            default=0,
            show_default=True,
            type=int,
            help="record a per-block picture of the KV pool every N steps (0 = never), for the report's block map",
        ),
        click.option(
            "--attention-backend",
            type=click.Choice(["auto", "torch", "triton", "triton-interpret"]),
            default="auto",
            show_default=True,
            help="paged attention: auto (Triton on CUDA if installed, else PyTorch), the PyTorch reference, "
            "compiled Triton kernels (CUDA), or the Triton kernels in Triton's interpreter (slow; teaching)",
        ),
        click.option(
            "--tensor-parallel-size",
            "-tp",
            default=1,
            show_default=True,
            type=int,
            help="ranks the model is split across (worker processes; gloo on CPU, NCCL on CUDA)",
        ),
        click.option(
            "--distributed-executor-backend",
            type=click.Choice(["uni", "mp"]),
            default=None,
            help="uni = one process (tensor-parallel-size 1 only); mp = worker processes (default when "
            "tensor-parallel-size > 1; with 1, a one-rank process group)",
        ),
        click.option(
            "--distributed-timeout-s",
            default=120.0,
            show_default=True,
            type=float,
            help="seconds a collective waits for the other ranks before the engine fails",
        ),
        click.option(
            "--nccl-buffsize",
            default=None,
            help="NCCL_BUFFSIZE for every rank: a size (4MiB, 1048576) [NCCL's default: 4MiB]",
        ),
        click.option("--nccl-min-nchannels", default=None, type=int, help="NCCL_MIN_NCHANNELS for every rank"),
        click.option("--nccl-max-nchannels", default=None, type=int, help="NCCL_MAX_NCHANNELS for every rank"),
        click.option("--nccl-proto", default=None, help="NCCL_PROTO for every rank, e.g. Simple or ^LL128"),
    ]
    for o in reversed(opts):

        def probe():
            pass

        if o(probe).__click_params__[0].name in exclude:
            continue
        f = o(f)
    return f


def _engine_args(kw: dict) -> dict:
    keys = set(EngineConfig.__dataclass_fields__)
    args = {k: v for k, v in kw.items() if k in keys}
    args["device_memory"] = parse_bytes(args.get("device_memory"))
    args["kv_cache_memory_bytes"] = parse_bytes(args.get("kv_cache_memory_bytes"))
    if args.get("nccl_buffsize") is not None:
        args["nccl_buffsize"] = parse_bytes(args["nccl_buffsize"])
    return args


@click.group()
@click.version_option(package_name="workbench")
@click.option("-v", "--verbose", is_flag=True, help="debug logging")
def main(verbose: bool) -> None:
    """workbench: a paged-KV, continuous-batching LLM engine and its course lab."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@main.command(short_help="Serve a prompt set; print a summary; write a run folder with a report.")
@click.option(
    "--dataset",
    type=click.Path(dir_okay=False),
    default=None,
    help="ShareGPT JSON or JSONL prompts [default: datasets/default_prompts.jsonl]",
)
@click.option("--num-prompts", default=64, show_default=True, type=int, help="use the first N prompts")
@click.option("--max-tokens", default=128, show_default=True, type=int, help="output cap per request")
@click.option("--temperature", default=0.0, show_default=True, type=float, help="0 = greedy")
@click.option("--top-p", default=1.0, show_default=True, type=float, help="nucleus sampling (1 = off)")
@click.option("--top-k", default=-1, show_default=True, type=int, help="keep the k most likely tokens (-1 = all)")
@click.option("--ignore-eos", is_flag=True, help="generate max-tokens tokens even past the end-of-sequence token")
@click.option("--output-dir", default="runs", show_default=True, help="parent of the run folder")
@engine_options
def run(dataset, num_prompts, max_tokens, temperature, top_p, top_k, ignore_eos, output_dir, **kw):
    """Serve a prompt set with the engine; print a summary; write runs/<timestamp>/ with a report."""
    from rich.console import Console
    from rich.table import Table

    from workbench.bench.run import run_job

    console = Console()
    try:
        res = run_job(
            dataset=dataset,
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            ignore_eos=ignore_eos,
            output_dir=output_dir,
            **_engine_args(kw),
        )
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    s = res.summary
    steps = res.recorder.steps
    pre_rc = sum(x.num_preempted_recompute for x in steps)
    pre_sw = sum(x.num_preempted_swap for x in steps)
    swapped = (sum(x.swap_out_blocks for x in steps), sum(x.swap_in_blocks for x in steps))
    swapped = swapped if any(swapped) else None
    queries = sum(x.prefix_cache_queries for x in steps)
    hits = sum(x.prefix_cache_hits for x in steps)
    t = Table(title="workbench run", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")

    def ms(v):
        return "n/a" if v is None else f"{v * 1000:,.1f} ms"

    rows = [
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
    if queries:
        rows.append(("prefix-cache hit rate (prompt tokens)", f"{hits / queries:.1%} ({hits:,} of {queries:,})"))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    for rec, o in zip(res.records, res.outputs):
        if o.error:
            console.print(f"[red]request {o.request_id} (prompt {rec.id}) refused:[/red] {o.error}")
    if res.run_dir is not None:
        console.print(f"report:   {res.run_dir / 'report.html'}")
        console.print(f"steps:    {res.run_dir / 'steps.jsonl'}")
        console.print(f"requests: {res.run_dir / 'requests.jsonl'}")


@main.command(short_help="Run one trace through several KV allocators / batching policies; one report.")
@click.option(
    "--kv-allocator",
    "allocators",
    default="paged,static,orca-max,orca-pow2,orca-oracle",
    show_default=True,
    help="comma-separated: paged, static, orca-max, orca-pow2, orca-oracle",
)
@click.option(
    "--batching-policy",
    "policies",
    default="continuous",
    show_default=True,
    help="comma-separated: continuous, static, grouped",
)
@click.option("--dataset", type=click.Path(dir_okay=False), default=None, help="ShareGPT JSON or JSONL prompts")
@click.option("--num-prompts", default=64, show_default=True, type=int, help="use the first N prompts")
@click.option("--max-tokens", default=128, show_default=True, type=int, help="output cap per request")
@click.option("--output-dir", default="runs", show_default=True, help="parent of the compare-<timestamp> folder")
@engine_options(exclude=("kv_allocator", "batching_policy"))
def compare(allocators, policies, dataset, num_prompts, max_tokens, output_dir, **kw):
    """Serve the same prompts (greedy) once per allocator x batching policy, and write compare.html
    with the waste breakdown side by side, throughput, TTFT and requests batched.

    \b
    workbench compare --num-prompts 32 --max-model-len 1024 --kv-cache-memory-bytes 48MiB
    workbench compare --kv-allocator paged --batching-policy continuous,static,grouped
    """
    from rich.console import Console
    from rich.table import Table

    from workbench.bench.compare import compare as run_compare

    console = Console(width=max(130, Console().width))  # the table's 9 columns, also when piped
    try:
        res = run_compare(
            allocators=[a.strip() for a in allocators.split(",") if a.strip()],
            batching_policies=[p.strip() for p in policies.split(",") if p.strip()],
            dataset=dataset,
            num_prompts=num_prompts,
            max_tokens=max_tokens,
            output_dir=output_dir,
            **_engine_args(kw),
        )
    except (ValueError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
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
    if res.out_dir is not None:
        console.print(f"report: {res.out_dir / 'compare.html'}")
        console.print(f"rows:   {res.out_dir / 'compare.json'}")


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
        here = Path(__file__).resolve().parents[1] / "labs"
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


from workbench.kvcalc import kv_calc_command  # noqa: E402  (`workbench kv-calc`; its options live there)

main.add_command(kv_calc_command)

from workbench.sim.cli import simulate_command  # noqa: E402  (`workbench simulate`; its options live there)

main.add_command(simulate_command)


if __name__ == "__main__":
    sys.exit(main())
