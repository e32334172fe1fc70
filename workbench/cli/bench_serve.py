"""``workbench bench serve``: the command line of :func:`workbench.bench.serve.run_bench_serve`,
with the flag names of ``vllm bench serve`` (https://docs.vllm.ai/en/latest/cli/bench/serve.html)."""

from __future__ import annotations

import math

import click

from workbench.cli.errors import user_errors

__all__ = ["bench_serve_command"]


def _rate(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a number; give requests per second, or inf", param_hint="--request-rate"
        ) from None


@click.command(
    "serve",
    short_help="Load-test an OpenAI-compatible server (vLLM's bench serve: TTFT, TPOT, ITL, E2EL).",
    context_settings={"show_default": True},
)
@click.option("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 [default: http://HOST:PORT]")
@click.option("--host", default="127.0.0.1", help="server host, when no --base-url")
@click.option("--port", default=8000, type=int, help="server port, when no --base-url")
@click.option("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
@click.option("--model", default=None, help="model name sent [default: the first of GET /v1/models]")
@click.option(
    "--tokenizer",
    default=None,
    help="local tokenizer folder or .gguf that counts prompt tokens and builds random prompts "
    "[default: the bundled model's (SmolLM2-135M-Instruct); nothing is downloaded]",
)
@click.option(
    "--dataset-name",
    type=click.Choice(["random", "prefix-repetition", "prefix_repetition", "sharegpt", "jsonl"]),
    default="random",
    help="where prompts come from (prefix_repetition: vLLM's spelling of prefix-repetition)",
)
@click.option("--dataset-path", default=None, type=click.Path(dir_okay=False), help="file for sharegpt / jsonl")
@click.option("--num-prompts", default=1000, type=int, help="requests to send")
@click.option("--output-len", default=None, type=int, help="output tokens for every request (overrides the dataset's)")
@click.option("--random-input-len", default=1024, type=int, help="random: prompt tokens")
@click.option("--random-output-len", default=128, type=int, help="random: output tokens")
@click.option("--random-range-ratio", default=0.0, type=float, help="random: lengths vary uniformly by ± this fraction")
@click.option("--prefix-repetition-prefix-len", default=256, type=int, help="prefix-repetition: shared prefix tokens")
@click.option("--prefix-repetition-suffix-len", default=256, type=int, help="prefix-repetition: own suffix tokens")
@click.option("--prefix-repetition-num-prefixes", default=10, type=int, help="prefix-repetition: distinct prefixes")
@click.option("--prefix-repetition-output-len", default=128, type=int, help="prefix-repetition: output tokens")
@click.option("--request-rate", default="inf", help="requests per second (inf: all at once)")
@click.option("--burstiness", default=1.0, type=float, help="gamma shape of arrival gaps: 1 Poisson, <1 burstier")
@click.option("--max-concurrency", default=None, type=int, help="most requests in flight [default: no cap]")
@click.option(
    "--goodput",
    multiple=True,
    help="SLOs in ms a good request meets, e.g. --goodput ttft:500 tpot:50 (metrics: ttft, tpot, e2el)",
)
@click.option("--percentile-metrics", default="ttft,tpot,itl", help="metrics to report: ttft,tpot,itl,e2el")
@click.option("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99")
@click.option("--seed", default=0, type=int, help="seeds the prompts and the arrival times")
@click.option("--ignore-eos", is_flag=True, help="generate past EOS (always on for --dataset-name random, as vLLM)")
@click.option("--save-result", is_flag=True, help="write the result as JSON")
@click.option("--result-dir", default=None, help="folder of the JSON [default: current folder]")
@click.option("--result-filename", default=None, help="[default: <backend>-<rate>qps-<model>-<date>.json]")
@click.option("--disable-tqdm", is_flag=True, help="no progress bar")
@click.option(
    "--replica-url",
    "replica_urls",
    multiple=True,
    help="a replica behind the router at --base-url (repeat): per-replica figures and KV imbalance from their "
    "/metrics (not a vLLM flag)",
)
@click.argument("more_goodput", nargs=-1, metavar="")
def bench_serve_command(request_rate, goodput, more_goodput, **kw):
    """Send a prompt set to a running OpenAI-compatible server (workbench serve, vLLM, ...) at a
    request rate, stream every reply, and report throughput and TTFT / TPOT / ITL / E2EL (ms) as
    `vllm bench serve` does (its flags, metric definitions and result keys).

    \b
    workbench bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --random-input-len 256 --random-output-len 64
    workbench bench serve --dataset-name sharegpt --dataset-path ShareGPT.json --request-rate 4 --goodput ttft:500 tpot:50
    """
    from workbench.bench.serve import run_bench_serve

    if more_goodput and not goodput:
        raise click.UsageError(f"unexpected argument(s) {' '.join(more_goodput)}; did you mean --goodput?")
    with user_errors(RuntimeError):
        run_bench_serve(
            request_rate=math.inf if request_rate.strip().lower() == "inf" else _rate(request_rate),
            goodput=[*goodput, *more_goodput],
            **kw,
        )
