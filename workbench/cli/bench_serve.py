"""``workbench bench serve``: the command line of :func:`workbench.bench.serve.run_bench_serve`,
with the flags of vLLM 0.32's ``vllm bench serve`` (https://docs.vllm.ai/en/latest/cli/bench/serve.html).

As vLLM's parser: ``--metadata``, ``--header`` and ``--goodput`` take several values after one flag
(``--metadata version=0.3.3 tp=1``), and ``--num_prompts`` is ``--num-prompts``. vLLM's flags that cannot
apply to this client (:data:`NOT_APPLICABLE`) are refused with the reason, before anything is sent.
"""

from __future__ import annotations

import math

import click

from workbench.cli.errors import user_errors

__all__ = ["NOT_APPLICABLE", "OTHER_DATASETS", "bench_serve_command"]

_MULTI = ("--goodput", "--metadata", "--header")
"""Options that take every following value up to the next flag (vLLM's ``nargs="*"`` / ``"+"``)."""

_NO_DATASET = "workbench bench serve's datasets are random, prefix-repetition, sharegpt and jsonl"
NOT_APPLICABLE: dict[str, str] = {
    "--use-beam-search": "workbench's engine has no beam search",
    "--profile": "workbench serve has no /start_profile endpoint; profile an engine step with "
    "benchmarks/profile_step.py",
    "--lora-modules": "workbench's engine serves no LoRA adapters",
    "--lora-assignment": "workbench's engine serves no LoRA adapters",
    "--skip-tokenizer-init": "the client counts tokens with a local tokenizer, which loads in a second",
    "--plot-timeline": "not built here; keep the per-request figures with --save-result --save-detailed and "
    "compare runs with workbench bench compare",
    "--timeline-itl-thresholds": "goes with --plot-timeline, which is not built here",
    "--plot-dataset-stats": "not built here; --save-detailed keeps input_lens and output_lens",
    "--no-stream": "it sets how Hugging Face datasets load; " + _NO_DATASET,
    "--skip-chat-template": "no dataset here renders a chat template on the client",
    "--enable-multimodal-chat": "workbench serves a text-only model",
    "--chat-template-kwargs": "no dataset here renders a chat template on the client; send template kwargs "
    "with --extra-body '{\"chat_template_kwargs\": {...}}'",
    "--custom-output-len": "--dataset-name custom is vLLM's; use --dataset-name jsonl with --output-len",
    "--custom-ensure-client-side-data": "multimodal custom datasets are vLLM's; " + _NO_DATASET,
    "--self-timed": "timed_trace datasets are vLLM's; " + _NO_DATASET,
    "--no-self-timed": "timed_trace datasets are vLLM's; " + _NO_DATASET,
    "--random-batch-size": "it batches embedding requests; this client measures text generation",
    "--no-reranker": "it is for rerank benchmarks; this client measures text generation",
}
for _flag in (
    "--spec-bench-output-len", "--spec-bench-category", "--timed-trace-chunk-hash-size",
    "--timed-trace-sec-multiplier", "--timed-trace-label-timestamp", "--timed-trace-label-input-length",
    "--timed-trace-label-output-length", "--timed-trace-label-hash-ids", "--blazedit-min-distance",
    "--blazedit-max-distance", "--asr-max-audio-len-sec", "--asr-min-audio-len-sec", "--hf-subset", "--hf-split",
    "--hf-name", "--hf-output-len", "--bfcl-categories", "--speed-bench-dataset-subset", "--speed-bench-output-len",
    "--speed-bench-category",
):  # fmt: skip
    NOT_APPLICABLE[_flag] = f"it belongs to one of vLLM's Hugging Face or trace datasets; {_NO_DATASET}"
for _flag in (
    "--random-mm-base-items-per-request", "--random-mm-num-mm-items-range-ratio", "--random-mm-limit-mm-per-prompt",
    "--random-mm-bucket-config",
):  # fmt: skip
    NOT_APPLICABLE[_flag] = "random-mm is a multimodal dataset and workbench serves a text-only model"


#: vLLM's ``--dataset-name`` values this client has no loader for, and what to use instead
OTHER_DATASETS: dict[str, str] = {
    "custom": "use --dataset-name jsonl: one JSON object per line with a prompt (and output_len), as vLLM's custom",
    "hf": "Hugging Face datasets need a download; save the prompts as JSON Lines and use --dataset-name jsonl",
    "burstgpt": "it is a downloaded trace; save its lengths as JSON Lines prompts and use --dataset-name jsonl",
    "sonnet": "it is a vLLM source file; use --dataset-name random or jsonl",
    "random-mm": "workbench serves a text-only model",
    "random-rerank": "this client measures text generation",
    "custom_audio": "workbench serves a text-only model",
    "custom_image": "workbench serves a text-only model",
    "spec_bench": "it is a downloaded dataset; " + _NO_DATASET,
    "speed_bench": "it is a downloaded dataset; " + _NO_DATASET,
    "timed_trace": "replaying a trace's timestamps is not built here; " + _NO_DATASET,
}


def _rate(value: str, flag: str = "--request-rate") -> float:
    try:
        return float(value)
    except ValueError:
        raise click.BadParameter(
            f"{value!r} is not a number; give requests per second, or inf", param_hint=flag
        ) from None


class _VllmFlags(click.Command):
    """A command that reads vLLM's argument style before click parses it (see the module docstring)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        out: list[str] = []
        multi = None
        for arg in args:
            if arg.startswith("--"):
                name, eq, value = arg.partition("=")
                name = name.replace("_", "-")
                if name in NOT_APPLICABLE:
                    raise click.UsageError(f"{name} is a vllm bench serve flag that does not apply here: "
                                           f"{NOT_APPLICABLE[name]}", ctx)  # fmt: skip
                if name == "--dataset-name" and value in OTHER_DATASETS:
                    raise click.UsageError(f"--dataset-name {value} is a vllm bench serve dataset that does not "
                                           f"apply here: {OTHER_DATASETS[value]}", ctx)  # fmt: skip
                multi = name if name in _MULTI and not eq else None
                out.append(name + eq + value)
            elif out and out[-1] == "--dataset-name" and arg in OTHER_DATASETS:
                raise click.UsageError(f"--dataset-name {arg} is a vllm bench serve dataset that does not apply "
                                       f"here: {OTHER_DATASETS[arg]}", ctx)  # fmt: skip
            elif multi is not None and out and out[-1] != multi:
                out += [multi, arg]  # one more value of a multi-value flag
            else:
                out.append(arg)
        return super().parse_args(ctx, out)


@click.command(
    "serve",
    cls=_VllmFlags,
    short_help="Load-test an OpenAI-compatible server (vLLM's bench serve: TTFT, TPOT, ITL, E2EL).",
    context_settings={"show_default": True},
)
@click.option("--base-url", default=None, help="the server, e.g. http://127.0.0.1:8000 [default: http://HOST:PORT]")
@click.option("--host", default="127.0.0.1", help="server host, when no --base-url")
@click.option("--port", default=8000, type=int, help="server port, when no --base-url")
@click.option("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
@click.option(
    "--backend",
    default=None,
    help="openai or vllm (completions), openai-chat [default: what --endpoint implies; vLLM's default openai "
    "refuses a chat endpoint]",
)
@click.option("--label", default=None, help="the result's label and file-name prefix [default: the backend]")
@click.option("--model", default=None, help="model id [default: the first of GET /v1/models]")
@click.option("--served-model-name", default=None, help="the model name sent, when --model is given [default: --model]")
@click.option(
    "--tokenizer",
    default=None,
    help="local tokenizer folder or .gguf that counts prompt tokens and builds random prompts "
    "[default: the bundled model's (SmolLM2-135M-Instruct); nothing is downloaded]",
)
@click.option("--tokenizer-mode", default="auto", help="auto or hf (a local Hugging Face tokenizer either way)")
@click.option("--trust-remote-code", is_flag=True, help="accepted for vLLM's scripts; no code is downloaded here")
@click.option(
    "--dataset-name",
    type=click.Choice(["random", "prefix-repetition", "prefix_repetition", "sharegpt", "jsonl"]),
    default="random",
    help="where prompts come from (prefix_repetition: vLLM's spelling of prefix-repetition)",
)
@click.option("--dataset-path", default=None, type=click.Path(dir_okay=False), help="file for sharegpt / jsonl")
@click.option("--num-prompts", default=1000, type=int, help="requests to send")
@click.option("--input-len", default=None, type=int, help="prompt tokens (sets --random-input-len)")
@click.option("--output-len", default=None, type=int, help="output tokens for every request (overrides the dataset's)")
@click.option("--random-input-len", default=1024, type=int, help="random: prompt tokens")
@click.option("--random-output-len", default=128, type=int, help="random: output tokens")
@click.option(
    "--random-range-ratio",
    default="0.0",
    help='random: lengths vary uniformly by ± this fraction; or \'{"input": 0.3, "output": 0.5}\'',
)
@click.option("--random-prefix-len", default=0, type=int, help="random: tokens of one fixed prefix before each prompt")
@click.option("--sharegpt-output-len", default=None, type=int, help="sharegpt: output tokens instead of the reply's")
@click.option("--prefix-repetition-prefix-len", default=256, type=int, help="prefix-repetition: shared prefix tokens")
@click.option("--prefix-repetition-suffix-len", default=256, type=int, help="prefix-repetition: own suffix tokens")
@click.option("--prefix-repetition-num-prefixes", default=10, type=int, help="prefix-repetition: distinct prefixes")
@click.option("--prefix-repetition-output-len", default=128, type=int, help="prefix-repetition: output tokens")
@click.option("--disable-shuffle", is_flag=True, help="sharegpt: keep the file's order")
@click.option("--no-oversample", is_flag=True, help="a file with fewer prompts than --num-prompts: send only those")
@click.option("--request-rate", default="inf", help="requests per second (inf: all at once)")
@click.option("--burstiness", default=1.0, type=float, help="gamma shape of arrival gaps: 1 Poisson, <1 burstier")
@click.option("--ramp-up-strategy", type=click.Choice(["linear", "exponential"]), default=None, help="ramp the rate")
@click.option("--ramp-up-start-rps", default=None, type=int, help="the ramp's first rate (req/s; above 0)")
@click.option("--ramp-up-end-rps", default=None, type=int, help="the ramp's last rate (req/s)")
@click.option("--max-concurrency", default=None, type=int, help="most requests in flight [default: no cap]")
@click.option("--num-warmups", default=0, type=int, help="requests sent first and not counted")
@click.option(
    "--ready-check-timeout-sec", default=0, type=float, help="retry the first request until it succeeds (0: no check)"
)
@click.option("--probe-request-rate", default=0.0, type=float, help="one-token probes per second beside the load")
@click.option(
    "--goodput",
    multiple=True,
    help="SLOs in ms a good request meets, e.g. --goodput ttft:500 tpot:50 (metrics: ttft, tpot, e2el)",
)
@click.option(
    "--percentile-metrics",
    default=None,
    help="metrics to report: ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue [default: ttft,tpot,itl]",
)
@click.option("--metric-percentiles", default="99", help="percentiles to report, e.g. 50,90,99")
@click.option("--seed", default=0, type=int, help="seeds the prompts and the arrival times")
@click.option("--ignore-eos", is_flag=True, help="generate past EOS (always on for --dataset-name random, as vLLM)")
@click.option("--logprobs", default=None, type=int, help="completions: logprobs per token asked for")
@click.option("--temperature", default=None, type=float, help="sent only when given (as vLLM: the server's default)")
@click.option("--top-p", default=None, type=float, help="sent only when given")
@click.option("--top-k", default=None, type=int, help="sent only when given")
@click.option("--min-p", default=None, type=float, help="sent only when given")
@click.option("--frequency-penalty", default=None, type=float, help="sent only when given")
@click.option("--presence-penalty", default=None, type=float, help="sent only when given")
@click.option(
    "--repetition-penalty",
    default=None,
    type=float,
    help="sent when given; completions otherwise carry 1.0, as vLLM's client sends",
)
@click.option("--extra-body", default=None, help="JSON object merged into every request body")
@click.option("--header", multiple=True, help="KEY=VALUE headers sent with every request (several after one flag)")
@click.option("--request-id-prefix", default=None, help="request ids (x-request-id) [default: bench-<8 hex>-]")
@click.option("--insecure", is_flag=True, help="no TLS certificate check")
@click.option("--metadata", multiple=True, help="KEY=VALUE pairs written into the result (several after one flag)")
@click.option("--save-result", is_flag=True, help="write the result as JSON")
@click.option("--save-detailed", is_flag=True, help="keep per-request lists (ttfts, itls, texts, ...) in the result")
@click.option("--append-result", is_flag=True, help="append the result as one more JSON line to the file")
@click.option("--result-dir", default=None, help="folder of the JSON [default: current folder]")
@click.option("--result-filename", default=None, help="[default: <label>-<rate>qps-<model>-<date>.json]")
@click.option("--disable-tqdm", is_flag=True, help="no progress bar")
@click.option(
    "--replica-url",
    "replica_urls",
    multiple=True,
    help="a replica behind the router at --base-url (repeat): per-replica figures and KV imbalance from their "
    "/metrics (not a vLLM flag)",
)
def bench_serve_command(request_rate, **kw):
    """Send a prompt set to a running OpenAI-compatible server (workbench serve, vLLM, ...) at a
    request rate, stream every reply, and report throughput and TTFT / TPOT / ITL / E2EL (ms) as
    `vllm bench serve` does (its flags, metric definitions and result keys). No temperature is sent
    unless --temperature is given, as vLLM: the server's default applies.

    \b
    workbench bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --random-input-len 256 --random-output-len 64
    workbench bench serve --dataset-name sharegpt --dataset-path ShareGPT.json --request-rate 4 --goodput ttft:500 tpot:50
    """
    from workbench.bench.serve import run_bench_serve

    with user_errors(RuntimeError):
        run_bench_serve(
            request_rate=math.inf if request_rate.strip().lower() == "inf" else _rate(request_rate),
            **kw,
        )
