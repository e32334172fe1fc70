"""``workbench bench serve``: a load generator for any OpenAI-compatible server, modelled on
``vllm bench serve`` (its flags, its metric definitions and its result keys).

Requests are sent to ``/v1/completions`` (or ``/v1/chat/completions``) with ``stream: true``,
``stream_options: {"include_usage": true}``, ``max_tokens`` = the request's output length,
temperature 0 and, when asked, ``ignore_eos``. The send times follow an arrival process of
``request_rate`` requests per second with gamma-distributed gaps (:func:`request_arrival_offsets`);
``max_concurrency`` caps the requests in flight. Per request, on the client's monotonic clock:

* **TTFT** (time to first token): first SSE chunk with text − send;
* **ITL** (inter-token latency): the gaps between consecutive chunks with text;
* **E2EL** (end-to-end latency): end of the stream (``data: [DONE]``) − send;
* **TPOT** (time per output token, first excluded): (E2EL − TTFT) / (output tokens − 1), with the
  output tokens from the usage chunk (``completion_tokens``), or the number of text chunks when the
  server sends no usage; undefined for a 1-token output.

A request that gets an HTTP error, an error object in the stream, or no text at all counts in
``failed`` with its error kept in ``errors``; it is left out of every latency figure and token
total. Definitions and result keys follow vLLM's ``vllm/benchmarks/serve.py`` and
https://docs.vllm.ai/en/latest/cli/bench/serve.html; differences: figures with no data are ``None``
(vLLM writes 0), and E2EL ends at the end of the stream rather than at the last text chunk.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from workbench.bench.samples import (
    DATASET_NAMES,
    DEFAULT_JSONL_OUTPUT_LEN,
    SampleRequest,
    build_samples,
    load_tokenizer,
)
from workbench.catalog import is_bundled_model

__all__ = [
    "DEFAULT_JSONL_OUTPUT_LEN",
    "GOODPUT_METRICS",
    "PERCENTILE_METRICS",
    "RequestRecord",
    "SampleRequest",
    "build_samples",
    "calculate_metrics",
    "load_tokenizer",
    "parse_goodput",
    "request_arrival_offsets",
    "run_bench_serve",
    "sample_interarrival_gaps",
]

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
"""Metrics ``--percentile-metrics`` may name (vLLM's)."""
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""Metrics ``--goodput`` may set a service-level objective on (vLLM's), in milliseconds."""
_METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}
_ENDPOINTS = {"completions": "openai", "chat/completions": "openai-chat"}
log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------
# arrival process


def sample_interarrival_gaps(n: int, request_rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` gaps between request arrivals, in seconds: gamma-distributed with shape ``burstiness``
    and scale ``1 / (request_rate * burstiness)``, so the mean is ``1 / request_rate`` and the
    variance ``1 / (request_rate**2 * burstiness)``. ``burstiness`` 1 gives exponential gaps (a
    Poisson process); below 1 burstier, above 1 more even; ``inf`` a constant ``1 / request_rate``.
    ``request_rate`` ``inf`` gives zeros (vLLM's ``get_request``)."""
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / request_rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def request_arrival_offsets(
    n: int, request_rate: float, burstiness: float = 1.0, seed: int | None = 0, rng: np.random.Generator | None = None
) -> np.ndarray:
    """When each of ``n`` requests is sent, in seconds after the benchmark starts: the cumulative
    sum of :func:`sample_interarrival_gaps`, rescaled (as vLLM does) so the last request goes out at
    exactly ``n / request_rate`` — which keeps throughput comparable across seeds. All zeros for
    ``request_rate`` ``inf``."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    offsets = np.cumsum(sample_interarrival_gaps(n, request_rate, burstiness, rng))
    if n and offsets[-1] > 0:
        offsets *= (n / request_rate) / offsets[-1]
    return offsets


# ---------------------------------------------------------------------------------------------
# one request


@dataclass
class RequestRecord:
    """What the client saw of one request; times in seconds (``time.perf_counter``).

    Attributes:
        prompt_len: prompt tokens (the benchmark tokenizer's count).
        expected_output_len: ``max_tokens`` asked for.
        success: the stream finished without an error and with at least one text chunk.
        error: why it failed (HTTP status and body, or the error object), ``""`` on success.
        ttft: first text chunk − send.
        itl: gaps between consecutive text chunks.
        latency: end of stream − send (E2EL).
        output_tokens: ``completion_tokens`` of the usage chunk, else the number of text chunks.
        generated_text: the streamed text.
        start_time: send time.
    """

    prompt_len: int
    expected_output_len: int
    success: bool = False
    error: str = ""
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    output_tokens: int | None = None
    generated_text: str = ""
    start_time: float = 0.0


def _payload(sample: SampleRequest, model: str, chat: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model}
    if chat:
        prompt = sample.prompt
        body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    else:
        body["prompt"] = sample.prompt
    body.update(
        max_tokens=sample.expected_output_len,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; sent only when asked
    return body


def _error_text(obj: Any) -> str:
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])
    return json.dumps(err) if not isinstance(err, str) else err


async def send_request(
    client, api_url: str, sample: SampleRequest, model: str, chat: bool, ignore_eos: bool
) -> RequestRecord:
    """Send one streaming request and time it (see the module docstring); never raises for a
    failed request — the record says ``success=False`` and why."""
    import httpx

    rec = RequestRecord(prompt_len=sample.prompt_len, expected_output_len=sample.expected_output_len)
    chunks = 0
    last = None
    rec.start_time = start = time.perf_counter()
    try:
        async with client.stream("POST", api_url, json=_payload(sample, model, chat, ignore_eos)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                try:
                    detail = _error_text(json.loads(body))
                except json.JSONDecodeError:
                    detail = body
                rec.error = f"HTTP {resp.status_code}: {detail[:500]}"
                return rec
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line or line.startswith(":"):  # keep-alives and SSE comments
                    continue
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"error in stream: {_error_text(obj)}"[:500]
                    return rec
                choices = obj.get("choices") or []
                if choices:
                    c = choices[0]
                    text = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft = now - start
                        else:
                            rec.itl.append(now - last)
                        last = now
                        chunks += 1
                        rec.generated_text += text
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    rec.output_tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:500]
        return rec
    rec.latency = time.perf_counter() - start
    if last is None:
        rec.error = "the stream held no text (no chunk to time the first token by)"
        return rec
    if rec.output_tokens is None:
        rec.output_tokens = chunks
    rec.success = True
    return rec


# ---------------------------------------------------------------------------------------------
# metrics


def _pword(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """mean, median, std and percentiles of ``values`` (seconds) in milliseconds; None without values."""
    arr = np.asarray(values, dtype=float) * 1000
    out: dict[str, float | None] = {}
    for name, fn in (("mean", np.mean), ("median", np.median), ("std", np.std)):
        out[name] = float(fn(arr)) if arr.size else None
    for p in percentiles:
        out[f"p{_pword(p)}"] = float(np.percentile(arr, p)) if arr.size else None
    return out


def calculate_metrics(
    records: list[RequestRecord],
    duration_s: float,
    percentile_metrics: list[str],
    metric_percentiles: list[float],
    goodput: dict[str, float] | None,
) -> dict[str, Any]:
    """The result figures of a benchmark from its request records (vLLM's ``calculate_metrics``).

    Args:
        records: one per request, in dataset order.
        duration_s: wall time of the benchmark, in seconds (throughputs are per second of it).
        percentile_metrics: which of ``ttft, tpot, itl, e2el`` get ``{mean,median,std,pNN}_<m>_ms``.
        metric_percentiles: the percentiles (0 < p <= 100) reported, e.g. ``[99]`` → ``p99_<m>_ms``.
        goodput: service-level objectives in milliseconds (``{"ttft": 500}``); a completed request
            is good when it meets every one (a 1-token output has TPOT 0 here, as in vLLM). None:
            ``request_goodput`` is None.

    Returns:
        ``completed``, ``failed``, ``total_input_tokens`` and ``total_output_tokens`` (completed
        requests only), ``request_throughput`` (req/s), ``request_goodput`` (good req/s),
        ``output_throughput`` and ``total_token_throughput`` (tok/s), ``max_concurrent_requests``
        (the most completed requests whose [send, end) intervals overlap), the per-request lists
        ``input_lens``, ``output_lens`` (0 for failed), ``ttfts`` (s, None for failed), ``itls`` (s),
        ``latencies`` (E2EL, s), ``start_times`` (send times, s on ``time.perf_counter``), ``generated_texts``, ``errors``, and the statistics in milliseconds (None without data).
    """
    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    itls = [g for r in ok for g in r.itl]
    tpots, all_tpots = [], []
    for r in ok:
        tpot = 0.0
        if r.output_tokens > 1:
            tpot = (r.latency - r.ttft) / (r.output_tokens - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = None
    if goodput:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        n_good = sum(all(per_metric[m][i] <= slo_ms / 1000 for m, slo_ms in goodput.items()) for i in range(len(ok)))
        good = n_good / duration_s
    events = sorted([(r.start_time, 1) for r in ok] + [(r.start_time + r.latency, -1) for r in ok])
    peak = cur = 0
    for _, d in events:  # ends sort before starts at the same time: [start, end) intervals
        cur += d
        peak = max(peak, cur)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": good,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_concurrent_requests": peak,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft if r.success else None for r in records],
        "itls": [r.itl if r.success else [] for r in records],
        "latencies": [r.latency if r.success else None for r in records],
        "start_times": [r.start_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    values = {"ttft": ttfts, "tpot": tpots, "itl": itls, "e2el": e2els}
    for m in percentile_metrics:
        for stat, v in _stats(values[m], metric_percentiles).items():
            out[f"{stat}_{m}_ms"] = v
    return out


# ---------------------------------------------------------------------------------------------
# argument checks


def parse_goodput(items: list[str] | tuple[str, ...] | dict[str, float] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` (items may also hold several space- or comma-separated pairs)
    → ``{"ttft": 500.0, "tpot": 50.0}``: service-level objectives in milliseconds.

    Raises:
        ValueError: a pair not ``NAME:MILLISECONDS``, a name not in ``ttft, tpot, e2el``, or a
            negative value.
    """
    if not items:
        return {}
    pairs = list(items.items()) if isinstance(items, dict) else None
    if pairs is None:
        pairs = []
        for item in items:
            for word in item.replace(",", " ").split():
                name, sep, value = word.partition(":")
                try:
                    pairs.append((name.strip().lower(), float(value)))
                    assert sep
                except (ValueError, AssertionError):
                    raise ValueError(
                        f"--goodput {word!r}: expected NAME:MILLISECONDS, e.g. --goodput ttft:500 tpot:50"
                    ) from None
    out = {}
    for name, value in pairs:
        if name not in GOODPUT_METRICS:
            raise ValueError(
                f"--goodput {name}:{value:g}: {name!r} is not a goodput metric; use one of {', '.join(GOODPUT_METRICS)}"
            )
        if not value >= 0:
            raise ValueError(f"--goodput {name}:{value:g}: the objective must be non-negative milliseconds")
        out[name] = float(value)
    return out


def _parse_list(text: str | list, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",")] if isinstance(text, str) else [str(x).strip() for x in text]
    items = [x for x in items if x]
    if not items:
        raise ValueError(f"{what} is empty; give a comma-separated list")
    return items


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _endpoint_kind(endpoint: str) -> str:
    for suffix, backend in sorted(_ENDPOINTS.items(), key=lambda kv: -len(kv[0])):
        if endpoint.rstrip("/").endswith("/" + suffix):
            return backend
    raise ValueError(f"--endpoint {endpoint}: not a completions endpoint; use /v1/completions or /v1/chat/completions")


# ---------------------------------------------------------------------------------------------
# the benchmark


async def _first_model(client, base_url: str) -> str:
    import httpx

    url = f"{base_url}/v1/models"
    try:
        resp = await client.get(url)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(
            f"could not list the models at {url} ({type(e).__name__}: {e}); check that the server is running "
            "at --base-url (or --host/--port), or name the model with --model"
        ) from None
    if not data:
        raise RuntimeError(f"{url} lists no models; name the model with --model")
    return data[0]["id"]


async def _benchmark(
    api_url: str,
    base_url: str,
    model: str | None,
    samples_fn,
    chat: bool,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None,
    ignore_eos: bool,
    seed: int,
    disable_tqdm: bool,
    monitor=None,
) -> tuple[str, list[SampleRequest], list[RequestRecord], float]:
    import httpx

    # the pool holds every request that may be in flight, so none waits for a connection after its send time
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(6 * 3600, connect=30),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    ) as client:
        if model is None:
            model = await _first_model(client, base_url)
        samples = samples_fn(model)
        offsets = request_arrival_offsets(len(samples), request_rate, burstiness, seed=seed)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = None
        if not disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(samples), desc="bench serve", unit="req")

        async def one(sample: SampleRequest) -> RequestRecord:
            if sem is None:
                rec = await send_request(client, api_url, sample, model, chat, ignore_eos)
            else:
                async with sem:
                    rec = await send_request(client, api_url, sample, model, chat, ignore_eos)
            if pbar is not None:
                pbar.update(1)
            return rec

        if monitor is not None:
            await asyncio.to_thread(monitor.start)
        t0 = time.perf_counter()
        try:
            tasks = []
            for sample, at in zip(samples, offsets):
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(sample)))
            records = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
        finally:
            if monitor is not None:
                await asyncio.to_thread(monitor.stop)
        if pbar is not None:
            pbar.close()
    return model, samples, list(records), duration


def _run_coroutine(coro):
    """Run ``coro`` to completion: here, or in a thread of its own when an event loop is already
    running in this thread (a Jupyter cell)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name="bench-serve")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_bench_serve(
    *,
    base_url: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    endpoint: str = "/v1/completions",
    model: str | None = None,
    tokenizer: str | None = None,
    dataset_name: str = "random",
    dataset_path: str | None = None,
    num_prompts: int = 1000,
    output_len: int | None = None,
    random_input_len: int = 1024,
    random_output_len: int = 128,
    random_range_ratio: float = 0.0,
    prefix_repetition_prefix_len: int = 256,
    prefix_repetition_suffix_len: int = 256,
    prefix_repetition_num_prefixes: int = 10,
    prefix_repetition_output_len: int = 128,
    samples: list[SampleRequest] | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    goodput: list[str] | dict[str, float] | None = None,
    percentile_metrics: str | list[str] = "ttft,tpot,itl",
    metric_percentiles: str | list[float] = "99",
    seed: int = 0,
    ignore_eos: bool = False,
    save_result: bool = False,
    result_dir: str | None = None,
    result_filename: str | None = None,
    disable_tqdm: bool = False,
    print_result: bool = True,
    replica_urls: list[str] | None = None,
    replica_monitor=None,
) -> dict[str, Any]:
    """Benchmark an OpenAI-compatible server as ``vllm bench serve`` does; return the result dict.

    Runs its own event loop (in a thread when one is already running, as in a notebook).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``; default ``http://{host}:{port}``.
        endpoint: ``/v1/completions`` (backend ``openai``) or ``/v1/chat/completions``
            (``openai-chat``).
        model: the model name sent; default the first of ``GET /v1/models``.
        tokenizer: counts prompt tokens and builds random prompts; default the bundled model's
            (see :func:`workbench.bench.samples.load_tokenizer`; nothing is downloaded).
        dataset_name, dataset_path, output_len, random_*, prefix_repetition_*: the prompts
            (:func:`workbench.bench.samples.build_samples`; lengths in tokens). ``random`` turns
            ``ignore_eos`` on, as vLLM does, so outputs run to the asked length.
        samples: ready-made requests instead of a dataset (then no tokenizer is loaded).
        num_prompts: requests to send.
        request_rate: requests per second (``inf``: all at once).
        burstiness: shape of the gamma-distributed gaps (1: Poisson; see :func:`sample_interarrival_gaps`).
        max_concurrency: most requests in flight (None: no cap).
        goodput: service-level objectives in milliseconds (``["ttft:500", "tpot:50"]`` or a dict).
        percentile_metrics: which of ``ttft,tpot,itl,e2el`` to report.
        metric_percentiles: percentiles reported, e.g. ``"50,90,99"``.
        seed: seeds the prompts and the arrival times.
        ignore_eos: ask the server to generate past the end-of-sequence token (vLLM's extension).
        save_result, result_dir, result_filename: write the result as JSON, by default as
            ``<backend>-<rate>qps[-concurrency<N>]-<model>-<YYYYmmdd-HHMMSS>.json`` (vLLM's name).
        disable_tqdm: no progress bar. print_result: print the result block.
        replica_urls: the base URLs of the replicas behind the router at ``base_url`` (not a vLLM flag): their
            ``/metrics`` are read before, during and after the run, and the result gets ``replicas`` (per-replica
            requests, tokens, prefix-cache hit rate, preemptions, peak KV usage), ``kv_imbalance_mean`` /
            ``kv_imbalance_max`` and ``replica_timeline`` (:mod:`workbench.bench.replica_metrics`).
        replica_monitor: a :class:`~workbench.bench.replica_metrics.ReplicaMonitor` to use instead of one made from
            ``replica_urls`` (so that the caller can read its readings while the run goes on).

    Returns:
        ``date``, ``backend``, ``model_id``, ``tokenizer_id``, ``num_prompts``, ``request_rate`` (``"inf"``
        or req/s), ``burstiness``, ``max_concurrency``, and what :func:`calculate_metrics` returns.

    Raises:
        ValueError: a bad argument (the message names the value and the fix).
        RuntimeError: the server's model list could not be read (with no ``model``).
    """
    _check(num_prompts >= 1, f"--num-prompts {num_prompts}: give at least 1 request")
    _check(
        request_rate > 0,
        f"--request-rate {request_rate:g}: must be positive requests per second, or inf to send all at once",
    )
    _check(burstiness > 0, f"--burstiness {burstiness:g}: must be positive (1 = Poisson arrivals)")
    _check(
        max_concurrency is None or max_concurrency >= 1,
        f"--max-concurrency {max_concurrency}: must be at least 1, or left out for no cap",
    )
    _check(
        0 <= random_range_ratio < 1,
        f"--random-range-ratio {random_range_ratio}: must be in [0, 1) (lengths vary by ± that fraction)",
    )
    metrics = _parse_list(percentile_metrics, "--percentile-metrics")
    for m in metrics:
        _check(
            m in PERCENTILE_METRICS,
            f"--percentile-metrics: {m!r} is not a metric; use a comma-separated subset of {', '.join(PERCENTILE_METRICS)}",
        )
    percentiles = []
    for p in _parse_list(metric_percentiles, "--metric-percentiles"):
        try:
            value = float(p)
        except ValueError:
            raise ValueError(f"--metric-percentiles: {p!r} is not a number; give e.g. 50,90,99") from None
        _check(0 < value <= 100, f"--metric-percentiles: {p} is not in (0, 100]; give e.g. 50,90,99")
        percentiles.append(value)
    slos = parse_goodput(goodput)
    monitor = replica_monitor
    if replica_urls and monitor is None:
        from workbench.bench.replica_metrics import ReplicaMonitor

        monitor = ReplicaMonitor(list(replica_urls))
    if monitor is not None:
        monitor.check()  # a wrong URL fails before anything is sent
    backend = _endpoint_kind(endpoint)
    chat = backend == "openai-chat"
    if samples is None:
        dataset_name = {"prefix_repetition": "prefix-repetition"}.get(dataset_name, dataset_name)  # vLLM's spelling
        _check(
            dataset_name in DATASET_NAMES,
            f"--dataset-name {dataset_name!r} is not one of {', '.join(DATASET_NAMES)}",
        )
        if dataset_name in ("sharegpt", "jsonl"):
            _check(dataset_path is not None, f"--dataset-name {dataset_name} needs --dataset-path FILE")
        else:
            _check(
                dataset_path is None,
                f"--dataset-name {dataset_name} makes its own prompts; drop --dataset-path, "
                "or use --dataset-name sharegpt or jsonl for a file",
            )
        if dataset_name == "random":
            ignore_eos = True  # as vLLM: random prompts run to the asked output length
    base = (base_url or f"http://{host}:{port}").rstrip("/")
    api_url = base + "/" + endpoint.lstrip("/")
    tokenizer_id = tokenizer

    def make_samples(model_id: str) -> list[SampleRequest]:
        nonlocal tokenizer_id
        if samples is not None:
            return list(samples)
        tok, tokenizer_id = load_tokenizer(tokenizer)
        if tokenizer is None and not is_bundled_model(model_id):
            log.warning(
                "prompt tokens are counted with the bundled model's tokenizer (%s), not %s's: lengths may "
                "differ on the server; pass --tokenizer <local folder> to count with the served model's",
                tokenizer_id,
                model_id,
            )
        built = build_samples(
            dataset_name,
            tok,
            num_prompts=num_prompts,
            seed=seed,
            dataset_path=dataset_path,
            output_len=output_len,
            random_input_len=random_input_len,
            random_output_len=random_output_len,
            random_range_ratio=random_range_ratio,
            prefix_repetition_prefix_len=prefix_repetition_prefix_len,
            prefix_repetition_suffix_len=prefix_repetition_suffix_len,
            prefix_repetition_num_prefixes=prefix_repetition_num_prefixes,
            prefix_repetition_output_len=prefix_repetition_output_len,
        )
        if not chat and any(not isinstance(s.prompt, str) for s in built):
            raise ValueError(
                f"--dataset-path {dataset_path} holds chat messages, which /v1/completions cannot take; "
                "use --endpoint /v1/chat/completions"
            )
        return built

    model_id, used, records, duration = _run_coroutine(
        _benchmark(
            api_url,
            base,
            model,
            make_samples,
            chat,
            request_rate,
            burstiness,
            max_concurrency,
            ignore_eos,
            seed,
            disable_tqdm,
            monitor,
        )
    )
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "date": now,
        "backend": backend,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(used),
        "request_rate": request_rate if request_rate < math.inf else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
    }
    result.update(calculate_metrics(records, duration, metrics, percentiles, slos or None))
    if monitor is not None:
        result.update(monitor.summary())
    if print_result:
        print(format_result(result, metrics, percentiles))
    if save_result:
        name = result_filename or (
            f"{backend}-{request_rate}qps"
            + (f"-concurrency{max_concurrency}" if max_concurrency is not None else "")
            + f"-{model_id.split('/')[-1]}-{now}.json"
        )
        path = Path(result_dir) / name if result_dir else Path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        if print_result:
            print(f"result: {path}")
    return result


def format_result(result: dict[str, Any], metrics: list[str], percentiles: list[float]) -> str:
    """The console block of ``vllm bench serve`` (``{:<40} {:<10}`` rows) for ``result``."""

    def row(label: str, value, fmt: str = "{:<10.2f}") -> str:
        shown = "n/a" if value is None else fmt.format(value)
        return f"{label:<40} {shown}".rstrip()

    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]
    lines.append(row("Successful requests:", result["completed"], "{:<10}"))
    lines.append(row("Failed requests:", result["failed"], "{:<10}"))
    if result["max_concurrency"] is not None:
        lines.append(row("Maximum request concurrency:", result["max_concurrency"], "{:<10}"))
    if result["request_rate"] != "inf":
        lines.append(row("Request rate configured (RPS):", result["request_rate"]))
    lines.append(row("Benchmark duration (s):", result["duration"]))
    lines.append(row("Total input tokens:", result["total_input_tokens"], "{:<10}"))
    lines.append(row("Total generated tokens:", result["total_output_tokens"], "{:<10}"))
    lines.append(row("Request throughput (req/s):", result["request_throughput"]))
    if result["request_goodput"] is not None:
        lines.append(row("Request goodput (req/s):", result["request_goodput"]))
    lines.append(row("Output token throughput (tok/s):", result["output_throughput"]))
    lines.append(row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10}"))
    lines.append(row("Total token throughput (tok/s):", result["total_token_throughput"]))
    for m in metrics:
        short, title = _METRIC_TITLES[m]
        lines.append("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", result[f"mean_{m}_ms"]))
        lines.append(row(f"Median {short} (ms):", result[f"median_{m}_ms"]))
        for p in percentiles:
            lines.append(row(f"P{_pword(p)} {short} (ms):", result[f"p{_pword(p)}_{m}_ms"]))
    if "replicas" in result:
        lines.append("{s:{c}^{n}}".format(s="Replicas", n=50, c="-"))
        for i, r in enumerate(result["replicas"]):
            hit = "n/a" if r["prefix_cache_hit_rate"] is None else f"{r['prefix_cache_hit_rate']:.0%}"
            usage = "n/a" if r["max_kv_cache_usage"] is None else f"{r['max_kv_cache_usage']:.1%}"
            lost = " (lost)" if r["lost"] else ""
            lines.append(
                f"{i} {r['url']}{lost}: {r['requests']} req, prefix hits {hit}, "
                f"peak KV {usage}, {r['preemptions']} preempted"
            )
        lines.append(row("KV imbalance, mean (max/mean):", result["kv_imbalance_mean"]))
        lines.append(row("KV imbalance, max (max/mean):", result["kv_imbalance_max"]))
    lines.append("=" * 50)
    errors = [e for e in result["errors"] if e]
    for i, e in enumerate(errors[:10]):
        lines.append(f"error {i}: {e}")
    if len(errors) > 10:
        lines.append(f"... and {len(errors) - 10} more errors (the result's errors list has them all)")
    return "\n".join(lines)
