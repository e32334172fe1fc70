"""``workbench bench serve``: a load generator for any OpenAI-compatible server, modelled on
``vllm bench serve`` (vLLM 0.32: its flags, its metric definitions and its result keys).

Requests are sent to ``/v1/completions`` (backend ``openai``, vLLM's ``vllm`` is the same) or
``/v1/chat/completions`` (``openai-chat``) with ``stream: true``, ``stream_options: {"include_usage":
true}``, the output length as ``max_tokens`` (``max_completion_tokens`` on chat), ``repetition_penalty:
1.0`` and ``logprobs`` on completions (as vLLM's client), ``ignore_eos`` when asked, the sampling
parameters only when given (no ``temperature`` by default: the server's default applies, as in
vLLM), then ``extra_body``. Each request carries ``x-request-id: <request_id_prefix><index>``. The
send times follow an arrival process of ``request_rate`` requests per second with gamma-distributed
gaps (:func:`request_arrival_offsets`), or a linear/exponential ramp; ``max_concurrency`` caps the
requests in flight. Per request, on the client's monotonic clock, as vLLM's request functions:

* **TTFT** (time to first token): the first SSE chunk that carries ``choices`` − send (its text may
  be empty: a chat server's first chunk often carries only the role);
* **ITL** (inter-token latency): the gaps between consecutive chunks that carry ``choices``;
* **E2EL** (end-to-end latency): the last chunk that carries ``choices`` − send (the usage chunk and
  ``[DONE]`` are not counted);
* **TPOT** (time per output token, first excluded): (E2EL − TTFT) / (output tokens − 1), with the
  output tokens from the usage chunk (``completion_tokens``), else the benchmark tokenizer's count
  of the generated text; undefined for a 1-token output;
* **client queue time**: send − the request's arrival time (non-zero only under ``max_concurrency``).

Whole-run figures: throughputs per second of the duration (first arrival to the last reply);
``max_output_tokens_per_s`` and ``max_concurrent_requests`` from one-second buckets since the first
send (the most tokens in one bucket; the most requests active during one bucket), as vLLM's.

A request that gets an HTTP error, an error object in the stream, or no chunk with ``choices``
counts in ``failed`` with its error kept in ``errors``; it is left out of every latency figure and
token total. Definitions and result keys follow vLLM's ``vllm/benchmarks/serve.py`` and
https://docs.vllm.ai/en/latest/cli/bench/serve.html. The per-request lists (``input_lens``,
``output_lens``, ``ttfts``, ``itls``, ``start_times``, ``generated_texts``, ``errors``) are kept only
with ``save_detailed``, as vLLM; ``latencies`` and ``queue_times`` always. Differences: figures with
no data are ``None`` (vLLM writes 0); an HTTP error keeps the server's message (vLLM keeps only the
status reason); an error object inside the stream fails the request (vLLM's client ignores it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import threading
import time
import uuid
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

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time", "e2el_including_client_queue")
"""Metrics ``--percentile-metrics`` may name (vLLM's)."""
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
"""Metrics ``--goodput`` may set a service-level objective on (vLLM's), in milliseconds."""
_METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
    "client_queue_time": ("Client Queue Time", "Client-side Queueing"),
    "e2el_including_client_queue": ("E2EL incl. Client Queue", "Queue-inclusive End-to-end Latency"),
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


def ramp_up_rates(n: int, strategy: str, start_rps: float, end_rps: float) -> np.ndarray:
    """The request rate (req/s) at which each of ``n`` requests arrives under vLLM's ramp-up: from
    ``start_rps`` at the first request to ``end_rps`` at the last, ``linear`` (evenly) or
    ``exponential`` (by a constant factor per request)."""
    progress = np.arange(n) / max(n - 1, 1)
    if strategy == "linear":
        return start_rps + (end_rps - start_rps) * progress
    return start_rps * (end_rps / start_rps) ** progress


def request_arrival_offsets(
    n: int,
    request_rate: float,
    burstiness: float = 1.0,
    seed: int | None = 0,
    rng: np.random.Generator | None = None,
    ramp_up: tuple[str, float, float] | None = None,
) -> np.ndarray:
    """When each of ``n`` requests is sent, in seconds after the benchmark starts: the cumulative
    sum of :func:`sample_interarrival_gaps`, rescaled (as vLLM does) so the last request goes out at
    exactly ``n / request_rate`` — which keeps throughput comparable across seeds. All zeros for
    ``request_rate`` ``inf``. With ``ramp_up`` = ``(strategy, start_rps, end_rps)`` each gap is drawn at
    that request's rate (:func:`ramp_up_rates`) and nothing is rescaled, as vLLM's ramp-up."""
    rng = rng if rng is not None else np.random.default_rng(seed)
    if ramp_up is not None:
        rates = ramp_up_rates(n, *ramp_up)
        gaps = [sample_interarrival_gaps(1, float(r), burstiness, rng)[0] for r in rates]
        return np.cumsum(gaps)
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
        prompt_len: prompt tokens (the usage chunk's ``prompt_tokens`` when the server sends it, else
            the benchmark tokenizer's count).
        expected_output_len: ``max_tokens`` asked for.
        success: the stream finished without an error and with at least one chunk carrying ``choices``.
        error: why it failed (HTTP status and body, or the error object), ``""`` on success.
        ttft: first chunk with ``choices`` − send.
        itl: gaps between consecutive chunks with ``choices``.
        latency: last chunk with ``choices`` − send (E2EL).
        output_tokens: ``completion_tokens`` of the usage chunk; ``None`` until counted otherwise
            (see :func:`calculate_metrics`).
        generated_text: the streamed text.
        start_time: send time.
        arrival_time: when the request was due (before waiting for a ``max_concurrency`` slot).
        text_chunks: chunks whose text was not empty.
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
    arrival_time: float | None = None
    text_chunks: int = 0

    @property
    def queue_time(self) -> float:
        """Client-side wait for a concurrency slot, in seconds (vLLM's ``client_queue_time``)."""
        return 0.0 if self.arrival_time is None else self.start_time - self.arrival_time


@dataclass
class RequestOptions:
    """What every request of a run carries besides its prompt (vLLM's ``RequestFuncInput`` fields).

    Attributes:
        model: the ``model`` field sent (``--served-model-name``, else the model id).
        chat: ``/v1/chat/completions`` (messages, ``max_completion_tokens``) rather than completions.
        ignore_eos: send ``ignore_eos: true`` (vLLM's extension).
        logprobs: completions' ``logprobs`` (``None`` is sent as null, as vLLM's client).
        extra_body: merged into every body last (sampling parameters, ``--extra-body``).
        headers: extra HTTP headers (``--header``); ``x-request-id`` is set per request.
        request_id_prefix: request ids are this plus the request's index.
    """

    model: str
    chat: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    request_id_prefix: str = ""


def _payload(sample: SampleRequest, opts: RequestOptions) -> dict[str, Any]:
    body: dict[str, Any] = {"model": opts.model}
    if opts.chat:
        prompt = sample.prompt
        body["messages"] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        body["max_completion_tokens"] = sample.expected_output_len
    else:
        body.update(
            prompt=sample.prompt, repetition_penalty=1.0, max_tokens=sample.expected_output_len, logprobs=opts.logprobs
        )
    body.update(stream=True, stream_options={"include_usage": True})
    if opts.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension; sent only when asked
    body.update(opts.extra_body)
    return body


def _headers(opts: RequestOptions, request_id: str | None) -> dict[str, str]:
    headers = {}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    headers.update(opts.headers)
    if request_id is not None:
        headers["x-request-id"] = request_id
    return headers


def _error_text(obj: Any) -> str:
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    if isinstance(err, dict) and "message" in err:
        return str(err["message"])
    return json.dumps(err) if not isinstance(err, str) else err


async def send_request(
    client, api_url: str, sample: SampleRequest, opts: RequestOptions, request_id: str | None = None
) -> RequestRecord:
    """Send one streaming request and time it (see the module docstring); never raises for a
    failed request — the record says ``success=False`` and why."""
    import httpx

    rec = RequestRecord(prompt_len=sample.prompt_len, expected_output_len=sample.expected_output_len)
    last = None
    rec.start_time = start = time.perf_counter()
    try:
        async with client.stream(
            "POST", api_url, json=_payload(sample, opts), headers=_headers(opts, request_id)
        ) as resp:
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
                now = time.perf_counter()
                obj = json.loads(data)
                if obj.get("error"):
                    rec.error = f"error in stream: {_error_text(obj)}"[:500]
                    return rec
                choices = obj.get("choices") or []
                if choices:  # a chunk with choices times a token, even with empty text (vLLM's rule)
                    c = choices[0]
                    text = (c.get("delta") or {}).get("content") if opts.chat else c.get("text")
                    if last is None:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                    if text:
                        rec.generated_text += text
                        rec.text_chunks += 1
                elif usage := obj.get("usage"):
                    if usage.get("completion_tokens") is not None:
                        rec.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        rec.prompt_len = int(usage["prompt_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:500]
        return rec
    if last is None:
        rec.error = "the stream held no chunk with choices (none to time the first token by)"
        return rec
    rec.latency = last - start
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


def _peaks(ok: list[RequestRecord]) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``: one-second buckets from the
    first send; a token counts in the bucket its chunk arrived in (send + TTFT + the ITLs so far), a
    request in every bucket from its send's to its end's."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start_time for r in ok)
    n = int(np.ceil(max(r.start_time + r.latency for r in ok) - t0)) + 1
    tokens, active = np.zeros(n), np.zeros(n)
    for r in ok:
        at = r.start_time + r.ttft + np.concatenate([[0.0], np.cumsum(r.itl)])
        b = (at - t0).astype(int)
        np.add.at(tokens, b[(b >= 0) & (b < n)], 1)
        active[int(r.start_time - t0) : int(r.start_time + r.latency - t0) + 1] += 1
    return float(tokens.max()), int(active.max())


def calculate_metrics(
    records: list[RequestRecord],
    duration_s: float,
    percentile_metrics: list[str],
    metric_percentiles: list[float],
    goodput: dict[str, float] | None,
) -> dict[str, Any]:
    """The result figures of a benchmark from its request records (vLLM's ``calculate_metrics`` and
    the result dict its ``benchmark`` builds, in the same key order).

    Args:
        records: one per request, in dataset order; a successful one has ``output_tokens`` set.
        duration_s: wall time of the benchmark, in seconds (throughputs are per second of it).
        percentile_metrics: which of :data:`PERCENTILE_METRICS` get ``{mean,median,std,pNN}_<m>_ms``.
        metric_percentiles: the percentiles (0 < p <= 100) reported, e.g. ``[99]`` → ``p99_<m>_ms``.
        goodput: service-level objectives in milliseconds (``{"ttft": 500}``); a completed request
            is good when it meets every one (a 1-token output has TPOT 0 here, as in vLLM). None:
            ``request_goodput`` is None.

    Returns:
        ``completed``, ``failed``, ``total_input_tokens`` and ``total_output_tokens`` (completed
        requests only), ``request_throughput`` (req/s), ``request_goodput`` (good req/s),
        ``output_throughput`` and ``total_token_throughput`` (tok/s), the per-request lists
        ``input_lens``, ``output_lens`` (0 for failed), ``ttfts`` (s, None for failed), ``itls`` (s),
        ``latencies`` (E2EL, s), ``start_times`` (send times, s on ``time.perf_counter``),
        ``queue_times`` (s), ``generated_texts``, ``errors``, then ``max_output_tokens_per_s``,
        ``max_concurrent_requests`` (see :func:`_peaks`), ``rtfx`` (0: no audio input), and the
        statistics in milliseconds (None without data).
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
    peak_tokens, peak_requests = _peaks(ok)
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
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft if r.success else None for r in records],
        "itls": [r.itl if r.success else [] for r in records],
        "latencies": [r.latency if r.success else None for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.queue_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "rtfx": 0.0,
    }
    values = {
        "ttft": ttfts,
        "tpot": tpots,
        "itl": itls,
        "e2el": e2els,
        "client_queue_time": [r.queue_time for r in ok],
        "e2el_including_client_queue": [r.latency + r.queue_time for r in ok],
    }
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


async def _first_model(client, base_url: str, headers: dict[str, str]) -> tuple[str, str]:
    """``(name, id)`` of the first model the server lists: the ``id`` is the name requests send, the
    ``root`` (else the ``id``) the model id of the result, as vLLM's ``get_first_model_from_server``."""
    import httpx

    url = f"{base_url}/v1/models"
    try:
        resp = await client.get(url, headers=headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(
            f"could not list the models at {url} ({type(e).__name__}: {e}); check that the server is running "
            "at --base-url (or --host/--port), or name the model with --model"
        ) from None
    if not data:
        raise RuntimeError(f"{url} lists no models; name the model with --model")
    return data[0]["id"], data[0].get("root") or data[0]["id"]


@dataclass
class _Plan:
    """How a run sends its requests (see :func:`run_bench_serve` for each field's meaning)."""

    api_url: str
    base_url: str
    model: str | None
    served_model_name: str | None
    chat: bool
    request_rate: float
    burstiness: float
    ramp_up: tuple[str, float, float] | None
    max_concurrency: int | None
    seed: int
    opts: RequestOptions
    num_warmups: int = 0
    ready_check_timeout_sec: float = 0
    probe_request_rate: float = 0.0
    insecure: bool = False
    disable_tqdm: bool = True
    print_result: bool = False
    rps_change_events: list[dict] = field(default_factory=list)


async def _ready_check(client, plan: _Plan, first: SampleRequest) -> None:
    """vLLM's ready check: send the first request until it succeeds, every 5 s, for at most
    ``ready_check_timeout_sec``; raise with the last error when it never does."""
    deadline = time.perf_counter() + plan.ready_check_timeout_sec
    while True:
        rec = await send_request(client, plan.api_url, first, plan.opts)
        if rec.success:
            return
        left = deadline - time.perf_counter()
        if left <= 0:
            raise RuntimeError(
                f"the endpoint was not ready within --ready-check-timeout-sec {plan.ready_check_timeout_sec:g}: "
                f"{rec.error}; check the server and --base-url/--endpoint, or raise the timeout"
            )
        await asyncio.sleep(min(5.0, left))


async def _probe_loop(client, plan: _Plan, stop: asyncio.Event, out: list[RequestRecord]) -> None:
    """vLLM's probe requests: a one-token ``"Hi"`` every ``1 / probe_request_rate`` s after the previous
    one ends, outside ``max_concurrency``, until ``stop`` is set."""
    probe = SampleRequest(prompt="Hi", prompt_len=1, expected_output_len=1)
    while not stop.is_set():
        out.append(await send_request(client, plan.api_url, probe, plan.opts))
        await asyncio.sleep(1.0 / plan.probe_request_rate)


async def _benchmark(
    plan: _Plan, samples_fn, monitor=None
) -> tuple[str, str, list[SampleRequest], list[RequestRecord], float, list[RequestRecord]]:
    """Send every request of the plan; returns ``(model_id, model_name, samples, records, duration_s,
    probe_records)``."""
    import httpx

    # the pool holds every request that may be in flight, so none waits for a connection after its send time
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(6 * 3600, connect=30),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        verify=not plan.insecure,
    ) as client:
        if plan.model is None:
            model_name, model_id = await _first_model(client, plan.base_url, _headers(plan.opts, None))
        else:
            model_id, model_name = plan.model, plan.served_model_name
        plan.opts.model = model_name or model_id
        samples = samples_fn(model_id)
        if plan.ready_check_timeout_sec > 0:
            await _ready_check(client, plan, samples[0])
        if plan.num_warmups > 0:
            sem = asyncio.Semaphore(plan.max_concurrency or plan.num_warmups)

            async def warm() -> None:
                async with sem:
                    await send_request(client, plan.api_url, samples[0], plan.opts)

            await asyncio.gather(*(warm() for _ in range(plan.num_warmups)))
        offsets = request_arrival_offsets(
            len(samples), plan.request_rate, plan.burstiness, seed=plan.seed, ramp_up=plan.ramp_up
        )
        rates = ramp_up_rates(len(samples), *plan.ramp_up) if plan.ramp_up else None
        if plan.print_result:  # vLLM's lines before the run
            if plan.ramp_up:
                print(f"Traffic ramp-up strategy: {plan.ramp_up[0]}.")
                print(f"Will increase RPS from {plan.ramp_up[1]:g} to {plan.ramp_up[2]:g} RPS over the duration of "
                      "the benchmark.")  # fmt: skip
            else:
                print(f"Traffic request rate: {plan.request_rate}")
            kind = "Poisson process" if plan.burstiness == 1.0 else "Gamma distribution"
            print(f"Burstiness factor: {plan.burstiness} ({kind})")
            print(f"Maximum request concurrency: {plan.max_concurrency}")
        sem = asyncio.Semaphore(plan.max_concurrency) if plan.max_concurrency else None
        pbar = None
        if not plan.disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(samples), desc="bench serve", unit="req")

        async def one(i: int, sample: SampleRequest) -> RequestRecord:
            arrival = time.perf_counter()
            rid = f"{plan.opts.request_id_prefix}{i}"
            if sem is None:
                rec = await send_request(client, plan.api_url, sample, plan.opts, rid)
            else:
                async with sem:
                    rec = await send_request(client, plan.api_url, sample, plan.opts, rid)
            rec.arrival_time = arrival
            if pbar is not None:
                pbar.update(1)
            return rec

        if monitor is not None:
            await asyncio.to_thread(monitor.start)
        probes: list[RequestRecord] = []
        stop = asyncio.Event()
        probe_task = None
        if plan.probe_request_rate > 0:
            probe_task = asyncio.create_task(_probe_loop(client, plan, stop, probes))
        t0 = time.perf_counter()
        try:
            tasks = []
            last_rps = -1
            if plan.ramp_up:
                last_rps = int(plan.ramp_up[1])
                plan.rps_change_events.append({"rps": last_rps, "timestamp": datetime.now().isoformat()})
            for i, (sample, at) in enumerate(zip(samples, offsets)):
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                if rates is not None and int(rates[i]) > last_rps:  # vLLM's rps_change_events: each whole req/s
                    now = datetime.now().isoformat()
                    plan.rps_change_events += [
                        {"rps": r, "timestamp": now} for r in range(last_rps + 1, int(rates[i]) + 1)
                    ]
                    last_rps = int(rates[i])
                tasks.append(asyncio.create_task(one(i, sample)))
            records = await asyncio.gather(*tasks)
            duration = time.perf_counter() - t0
        finally:
            stop.set()
            if probe_task is not None:
                await probe_task
            if monitor is not None:
                await asyncio.to_thread(monitor.stop)
        if pbar is not None:
            pbar.close()
    return model_id, plan.opts.model, samples, list(records), duration, probes


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


BACKENDS = ("openai", "openai-chat", "vllm")
"""vLLM's ``--backend`` values this client speaks (``vllm`` is ``openai``, as in vLLM)."""
_OTHER_BACKENDS = (
    "openai-responses", "openai-audio", "openai-embeddings", "openai-embeddings-chat", "openai-embeddings-clip",
    "openai-embeddings-vlm2vec", "infinity-embeddings", "infinity-embeddings-clip", "vllm-pooling", "vllm-rerank",
)  # fmt: skip
SAMPLING_FIELDS = (
    "top_p", "top_k", "min_p", "temperature", "frequency_penalty", "presence_penalty", "repetition_penalty",
)  # fmt: skip
"""vLLM's sampling flags: each is sent only when given (``--temperature`` etc.)."""
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
"""Per-request lists vLLM keeps in the result only with ``--save-detailed``."""


def parse_key_values(items: list[str] | tuple[str, ...] | dict[str, str] | None, flag: str) -> dict[str, str]:
    """``["k=v", ...]`` → ``{"k": "v"}`` (``--metadata``, ``--header``; split at the first ``=``, stripped).

    Raises:
        ValueError: an item without ``=``.
    """
    if not items:
        return {}
    if isinstance(items, dict):
        return {str(k): str(v) for k, v in items.items()}
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        example = "x-additional-info=0.3.3" if flag == "--header" else "version=0.3.3"
        _check(bool(sep) and bool(key.strip()), f"{flag} {item!r}: expected KEY=VALUE, e.g. {flag} {example}")
        out[key.strip()] = value.strip()
    return out


def parse_range_ratio(value: float | str | dict) -> tuple[float, float]:
    """``--random-range-ratio``: one number for input and output, or ``{"input": r, "output": r}`` (a dict
    or its JSON), each in [0, 1) → ``(input_ratio, output_ratio)``.

    Raises:
        ValueError: not a number or such a dict, or a ratio outside [0, 1).
    """
    hint = 'give a number in [0, 1), or a JSON dict like \'{"input": 0.3, "output": 0.5}\''
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"--random-range-ratio {value!r}: {hint}") from None
    if isinstance(value, dict):
        _check(set(value) <= {"input", "output"}, f"--random-range-ratio {value!r}: {hint}")
        pair = (float(value.get("input", 0.0)), float(value.get("output", 0.0)))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        pair = (float(value), float(value))
    else:
        raise ValueError(f"--random-range-ratio {value!r}: {hint}")
    for r in pair:
        _check(0 <= r < 1, f"--random-range-ratio {value!r}: {r} is not in [0, 1) (lengths vary by ± that fraction)")
    return pair


def run_bench_serve(
    *,
    base_url: str | None = None,
    host: str = "127.0.0.1",
    port: int = 8000,
    endpoint: str = "/v1/completions",
    backend: str | None = None,
    label: str | None = None,
    model: str | None = None,
    served_model_name: str | None = None,
    tokenizer: str | None = None,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    dataset_name: str = "random",
    dataset_path: str | None = None,
    num_prompts: int = 1000,
    input_len: int | None = None,
    output_len: int | None = None,
    random_input_len: int = 1024,
    random_output_len: int = 128,
    random_range_ratio: float | str | dict = 0.0,
    random_prefix_len: int = 0,
    sharegpt_output_len: int | None = None,
    prefix_repetition_prefix_len: int = 256,
    prefix_repetition_suffix_len: int = 256,
    prefix_repetition_num_prefixes: int = 10,
    prefix_repetition_output_len: int = 128,
    disable_shuffle: bool = False,
    no_oversample: bool = False,
    samples: list[SampleRequest] | None = None,
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    ramp_up_strategy: str | None = None,
    ramp_up_start_rps: float | None = None,
    ramp_up_end_rps: float | None = None,
    max_concurrency: int | None = None,
    num_warmups: int = 0,
    ready_check_timeout_sec: float = 0,
    probe_request_rate: float = 0.0,
    goodput: list[str] | dict[str, float] | None = None,
    percentile_metrics: str | list[str] | None = None,
    metric_percentiles: str | list[float] = "99",
    seed: int = 0,
    ignore_eos: bool = False,
    logprobs: int | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    temperature: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    extra_body: dict | str | None = None,
    header: list[str] | dict[str, str] | None = None,
    request_id_prefix: str | None = None,
    insecure: bool = False,
    metadata: list[str] | dict[str, str] | None = None,
    save_result: bool = False,
    save_detailed: bool = False,
    append_result: bool = False,
    result_dir: str | None = None,
    result_filename: str | None = None,
    disable_tqdm: bool = False,
    print_result: bool = True,
    replica_urls: list[str] | None = None,
    replica_monitor=None,
) -> dict[str, Any]:
    """Benchmark an OpenAI-compatible server as ``vllm bench serve`` does; return the result dict.

    Every argument is the ``vllm bench serve`` flag of the same name (``--num-prompts`` for
    ``num_prompts``) with vLLM 0.32's meaning and default, except where said. Runs its own event loop
    (in a thread when one is already running, as in a notebook).

    Args:
        base_url: the server, e.g. ``http://127.0.0.1:8000``; default ``http://{host}:{port}``.
        endpoint: ``/v1/completions`` or ``/v1/chat/completions``.
        backend: ``openai`` / ``vllm`` (completions) or ``openai-chat``; default: the one the endpoint
            implies (vLLM's default is ``openai``, which refuses a chat endpoint). ``label``: the result's
            ``label`` and the file name's prefix (default: the backend).
        model: the model id (result and tokenizer); default the first of ``GET /v1/models``, whose ``id``
            is then sent. ``served_model_name``: the name sent, when ``model`` is given (default ``model``).
        tokenizer: counts prompt tokens and builds random prompts; default the bundled model's
            (see :func:`workbench.bench.samples.load_tokenizer`; nothing is downloaded — which is why
            ``trust_remote_code`` changes nothing and ``tokenizer_mode`` takes only ``auto`` / ``hf``).
        dataset_name, dataset_path, random_*, prefix_repetition_*, sharegpt_output_len, disable_shuffle,
            no_oversample: the prompts (:func:`workbench.bench.samples.build_samples`; lengths in
            tokens). ``input_len`` / ``output_len`` override every dataset's. ``random`` turns
            ``ignore_eos`` on, as vLLM does, so outputs run to the asked length.
        samples: ready-made requests instead of a dataset (then no tokenizer is loaded, and an output
            length the server does not report is the number of chunks that carried text).
        request_rate: requests per second (``inf``: all at once); ``burstiness``: gamma shape of the
            gaps (1: Poisson); ``ramp_up_*``: a linear or exponential ramp of the rate instead.
        max_concurrency: most requests in flight (None: no cap). ``num_warmups``: requests (the first
            prompt) sent before the run and not counted. ``ready_check_timeout_sec``: retry the first
            prompt until it succeeds first (0: no check). ``probe_request_rate``: one-token probes
            beside the load (``probe_*`` keys).
        goodput: service-level objectives in milliseconds (``["ttft:500", "tpot:50"]`` or a dict).
        percentile_metrics: which of :data:`PERCENTILE_METRICS` to report (default ``ttft,tpot,itl``).
        metric_percentiles: percentiles reported, e.g. ``"50,90,99"``.
        seed: seeds the prompts and the arrival times.
        ignore_eos, logprobs, top_p ... repetition_penalty, extra_body: what each request body
            carries (sampling fields only when given; ``extra_body`` a dict or its JSON).
        header: extra HTTP headers (``["KEY=VALUE"]``); ``request_id_prefix``: ids
            ``<prefix><index>`` sent as ``x-request-id`` (default ``bench-<8 hex>-``); ``insecure``: no
            TLS certificate check.
        metadata: ``["KEY=VALUE"]`` written into the result's top level.
        save_result, append_result, result_dir, result_filename: write the result as JSON (append:
            one more JSON line), by default as ``<label>-<rate>qps[-concurrency<N>]-<model>-<date>.json``.
        save_detailed: keep the per-request lists (:data:`DETAILED_KEYS`) in the result; without it they
            are dropped from the returned dict too, as vLLM.
        disable_tqdm: no progress bar. print_result: print the result block.
        replica_urls: the base URLs of the replicas behind the router at ``base_url`` (not a vLLM flag): their
            ``/metrics`` are read before, during and after the run, and the result gets ``replicas`` (per-replica
            requests, tokens, prefix-cache hit rate, preemptions, peak KV usage), ``kv_imbalance_mean`` /
            ``kv_imbalance_max`` and ``replica_timeline`` (:mod:`workbench.bench.replica_metrics`).
        replica_monitor: a :class:`~workbench.bench.replica_metrics.ReplicaMonitor` to use instead of one made from
            ``replica_urls`` (so that the caller can read its readings while the run goes on).

    Returns:
        vLLM's result: ``date``, ``endpoint_type``, ``backend``, ``label``, ``model_id``, ``tokenizer_id``,
        ``num_prompts``, the metadata, ``request_rate`` (``"inf"`` or req/s), ``burstiness``,
        ``max_concurrency`` (and ``ramp_up_*``), then what :func:`calculate_metrics` returns.

    Raises:
        ValueError: a bad argument (the message names the value and the fix).
        RuntimeError: the server's model list could not be read (with no ``model``), or the ready check
            failed.
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
    _check(num_warmups >= 0, f"--num-warmups {num_warmups}: must be 0 or more requests")
    _check(ready_check_timeout_sec >= 0, f"--ready-check-timeout-sec {ready_check_timeout_sec:g}: must be 0 or more")
    _check(probe_request_rate >= 0, f"--probe-request-rate {probe_request_rate:g}: must be 0 (off) or more req/s")
    _check(random_prefix_len >= 0, f"--random-prefix-len {random_prefix_len}: must be 0 or more tokens")
    _check(
        tokenizer_mode in ("auto", "hf"),
        f"--tokenizer-mode {tokenizer_mode}: only auto and hf apply here (the tokenizer is a local Hugging Face "
        "one; mistral_common and other modes are not installed)",
    )
    in_ratio, out_ratio = parse_range_ratio(random_range_ratio)
    ramp_up = None
    if ramp_up_strategy is not None:
        _check(
            ramp_up_strategy in ("linear", "exponential"),
            f"--ramp-up-strategy {ramp_up_strategy}: use linear or exponential",
        )
        _check(
            math.isinf(request_rate),
            "--ramp-up-strategy sets the request rate; drop --request-rate (the ramp goes from "
            "--ramp-up-start-rps to --ramp-up-end-rps)",
        )
        _check(
            ramp_up_start_rps is not None and ramp_up_end_rps is not None,
            "--ramp-up-strategy needs both --ramp-up-start-rps and --ramp-up-end-rps",
        )
        _check(
            0 < ramp_up_start_rps <= ramp_up_end_rps,
            f"--ramp-up-start-rps {ramp_up_start_rps:g} / --ramp-up-end-rps {ramp_up_end_rps:g}: the start must be "
            "positive and at most the end",
        )
        ramp_up = (ramp_up_strategy, float(ramp_up_start_rps), float(ramp_up_end_rps))
    if percentile_metrics is None:
        percentile_metrics = "ttft,tpot,itl"  # vLLM's default for generation
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
    meta = parse_key_values(metadata, "--metadata")
    headers = parse_key_values(header, "--header")
    if isinstance(extra_body, str):
        try:
            extra_body = json.loads(extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body {extra_body!r}: not JSON ({e}); give e.g. '{{\"top_k\": 5}}'") from None
    _check(
        extra_body is None or isinstance(extra_body, dict),
        f"--extra-body {extra_body!r}: must be a JSON object",
    )
    given = {"top_p": top_p, "top_k": top_k, "min_p": min_p, "temperature": temperature,
             "frequency_penalty": frequency_penalty, "presence_penalty": presence_penalty,
             "repetition_penalty": repetition_penalty}  # fmt: skip
    body_extra = {k: v for k, v in given.items() if v is not None} | (extra_body or {})
    monitor = replica_monitor
    if replica_urls and monitor is None:
        from workbench.bench.replica_metrics import ReplicaMonitor

        monitor = ReplicaMonitor(list(replica_urls))
    if monitor is not None:
        monitor.check()  # a wrong URL fails before anything is sent
    implied = _endpoint_kind(endpoint)
    if backend is not None:
        _check(
            backend not in _OTHER_BACKENDS,
            f"--backend {backend}: workbench serve has no such endpoint and this client measures text generation "
            f"only; use one of {', '.join(BACKENDS)}",
        )
        _check(backend in BACKENDS, f"--backend {backend!r}: use one of {', '.join(BACKENDS)}")
        wanted = "openai-chat" if backend == "openai-chat" else "openai"
        _check(
            wanted == implied,
            f"--backend {backend} needs --endpoint "
            f"{'/v1/chat/completions' if wanted == 'openai-chat' else '/v1/completions'} (got {endpoint})",
        )
    backend = backend or implied
    chat = backend == "openai-chat"
    if input_len is not None:
        random_input_len = input_len
    if output_len is not None:
        random_output_len = prefix_repetition_output_len = sharegpt_output_len = output_len
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
    tokenizer_id = tokenizer
    tok_box: dict[str, Any] = {}

    def make_samples(model_id: str) -> list[SampleRequest]:
        nonlocal tokenizer_id
        if samples is not None:
            return list(samples)
        tok, tokenizer_id = load_tokenizer(tokenizer)
        tok_box["tok"] = tok
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
            output_len=sharegpt_output_len if dataset_name == "sharegpt" else output_len,
            random_input_len=random_input_len,
            random_output_len=random_output_len,
            random_range_ratio=(in_ratio, out_ratio),
            random_prefix_len=random_prefix_len,
            prefix_repetition_prefix_len=prefix_repetition_prefix_len,
            prefix_repetition_suffix_len=prefix_repetition_suffix_len,
            prefix_repetition_num_prefixes=prefix_repetition_num_prefixes,
            prefix_repetition_output_len=prefix_repetition_output_len,
            disable_shuffle=disable_shuffle,
            no_oversample=no_oversample,
        )
        if not chat and any(not isinstance(s.prompt, str) for s in built):
            raise ValueError(
                f"--dataset-path {dataset_path} holds chat messages, which /v1/completions cannot take; "
                "use --endpoint /v1/chat/completions"
            )
        return built

    plan = _Plan(
        api_url=base + "/" + endpoint.lstrip("/"),
        base_url=base,
        model=model,
        served_model_name=served_model_name,
        chat=chat,
        request_rate=request_rate,
        burstiness=burstiness,
        ramp_up=ramp_up,
        max_concurrency=max_concurrency,
        seed=seed,
        opts=RequestOptions(
            model=model or "",
            chat=chat,
            ignore_eos=ignore_eos,
            logprobs=logprobs,
            extra_body=body_extra,
            headers=headers,
            request_id_prefix=f"bench-{uuid.uuid4().hex[:8]}-" if request_id_prefix is None else request_id_prefix,
        ),
        num_warmups=num_warmups,
        ready_check_timeout_sec=ready_check_timeout_sec,
        probe_request_rate=probe_request_rate,
        insecure=insecure,
        disable_tqdm=disable_tqdm,
        print_result=print_result,
    )
    model_id, _, used, records, duration, probes = _run_coroutine(_benchmark(plan, make_samples, monitor))
    _count_output_tokens(records, tok_box.get("tok"))
    now = datetime.now().strftime("%Y%m%d-%H%M%S")
    result: dict[str, Any] = {
        "date": now,
        "endpoint_type": backend,
        "backend": backend,
        "label": label,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "num_prompts": len(used),
        **meta,
        "request_rate": request_rate if request_rate < math.inf else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
    }
    if ramp_up is not None:
        result.update(ramp_up_strategy=ramp_up[0], ramp_up_start_rps=ramp_up_start_rps, ramp_up_end_rps=ramp_up_end_rps)
    figures = calculate_metrics(records, duration, metrics, percentiles, slos or None)
    head = {k: figures.pop(k) for k in list(figures) if not k.endswith("_ms")}
    result.update(head)
    result.update(_probe_stats(probes))
    if plan.rps_change_events:
        result["rps_change_events"] = plan.rps_change_events
    result.update(figures)
    if monitor is not None:
        result.update(monitor.summary())
    if print_result:
        print(format_result(result, metrics, percentiles, records))
    if not save_detailed:
        for key in DETAILED_KEYS:
            result.pop(key, None)
    if save_result or append_result:
        name = result_filename or (
            f"{label or backend}-"
            + (f"ramp-up-{ramp_up[0]}-{ramp_up_start_rps}qps-{ramp_up_end_rps}qps" if ramp_up else f"{request_rate}qps")
            + (f"-concurrency{max_concurrency}" if max_concurrency is not None else "")
            + f"-{model_id.split('/')[-1]}-{now}.json"
        )
        path = Path(result_dir) / name if result_dir else Path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a+" if append_result else "w", encoding="utf-8") as f:
            if append_result and f.tell() != 0:
                f.write("\n")
            json.dump(result, f)
        if print_result:
            print(f"result: {path}")
    return result


def _count_output_tokens(records: list[RequestRecord], tokenizer) -> None:
    """Output tokens of a successful request the server sent no usage for: the tokenizer's count of its
    text (vLLM's fallback), or without a tokenizer the number of chunks that carried text."""
    for r in records:
        if r.success and r.output_tokens is None:
            if tokenizer is not None:
                r.output_tokens = len(tokenizer(r.generated_text, add_special_tokens=False).input_ids)
            else:
                r.output_tokens = r.text_chunks


def _probe_stats(probes: list[RequestRecord]) -> dict[str, Any]:
    """vLLM's ``probe_*`` keys (E2EL in ms), or nothing when no probe completed."""
    lats = [p.latency for p in probes if p.success]
    if not lats:
        return {}
    return {
        "probe_completed": len(lats),
        "probe_failed": len(probes) - len(lats),
        "probe_median_e2el_ms": float(np.median(lats)) * 1000,
        "probe_p99_e2el_ms": float(np.percentile(lats, 99)) * 1000,
        "probe_max_e2el_ms": float(max(lats)) * 1000,
    }


def format_result(
    result: dict[str, Any], metrics: list[str], percentiles: list[float], records: list[RequestRecord] | None = None
) -> str:
    """The console block of ``vllm bench serve`` (``{:<40} {:<10}`` rows) for ``result``, then the first
    ten errors (of ``records``, else of the result's ``errors``)."""

    def row(label: str, value, fmt: str = "{:<10.2f}") -> str:
        shown = "n/a" if value is None else fmt.format(value)
        return f"{label:<40} {shown}".rstrip()

    lines = []
    if result["completed"] == 0:
        lines.append("All requests failed. This is likely due to a misconfiguration on the benchmark arguments.")
    lines.append("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
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
    lines.append(row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]))
    lines.append(row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10.2f}"))
    lines.append(row("Total token throughput (tok/s):", result["total_token_throughput"]))
    if "probe_completed" in result:
        lines.append("{s:{c}^{n}}".format(s="Probe Requests", n=50, c="-"))
        lines.append(row("Probe requests completed:", result["probe_completed"], "{:<10}"))
        lines.append(row("Probe requests failed:", result["probe_failed"], "{:<10}"))
        lines.append(row("Median probe E2EL (ms):", result["probe_median_e2el_ms"]))
        lines.append(row("P99 probe E2EL (ms):", result["probe_p99_e2el_ms"]))
        lines.append(row("Max probe E2EL (ms):", result["probe_max_e2el_ms"]))
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
    errors = [e for e in ([r.error for r in records] if records is not None else result.get("errors", [])) if e]
    for i, e in enumerate(errors[:10]):
        lines.append(f"error {i}: {e}")
    if len(errors) > 10:
        lines.append(f"... and {len(errors) - 10} more errors (the result's errors list has them all)")
    return "\n".join(lines)
