"""The Prometheus exposition of ``GET /metrics`` (workbench serve): a :class:`~workbench.metrics.Recorder` sink.

:class:`PrometheusSink` turns every :class:`~workbench.metrics.StepStats` and every finished
request's :class:`~workbench.metrics.RequestRecord` into Prometheus metrics in a registry of its
own (never the process-wide one, so two engines in one process do not clash); :meth:`render`
is the response body, :attr:`CONTENT_TYPE` its type.

Names, types, HELP texts and bucket boundaries of the ``vllm:`` metrics are vLLM's
(``vllm/v1/metrics/loggers.py``, ``PrometheusStatLogger``; documented at
https://docs.vllm.ai/en/latest/design/metrics.html and
https://docs.vllm.ai/en/latest/usage/metrics.html), with vLLM's labels ``model_name`` and
``engine`` (always ``"0"``: one engine core). prometheus_client adds ``_total`` to counters
(``vllm:prompt_tokens_total``), as in vLLM's exposition. This project's own figures are under
``workbench:``, in base units (seconds, bytes, token slots).

Where this exporter differs from vLLM, and why:

* **When request figures are counted.** Everything per request — ``vllm:request_success``, the
  token counters ``vllm:prompt_tokens`` / ``vllm:generation_tokens``, and every latency and size
  histogram (TTFT and inter-token latency included) — is counted once, from the request's
  ``RequestRecord`` when it finishes. vLLM adds prompt tokens when a prefill completes and
  generation tokens and TTFT / ITL as tokens come out, so a long request shows in vLLM's rates
  sooner. Counting from the records makes the exposition agree exactly with the engine's own
  records: ``vllm:request_success_total`` summed = number of records,
  ``vllm:generation_tokens_total`` = sum of ``output_tokens``, ``vllm:prompt_tokens_total`` = sum
  of ``prompt_tokens`` (the whole prompt, cached tokens included, once per request however often
  it was recomputed after preemption — as vLLM), each histogram's ``_count`` = the number of
  records that have the figure and ``_sum`` their sum. A refused request (``finished_reason="error"``)
  adds its prompt tokens too, although none ran through the model.
* **Finish reasons.** ``finished_reason`` takes vLLM's values ``stop``, ``length`` and ``abort``,
  plus ``error``: a request the engine refused (a prompt that can never fit ``max_model_len`` or the
  KV pool). vLLM rejects such a request before it reaches the engine; here it is a finished request
  with a record, and a fourth value keeps it apart from client aborts. All four series exist from
  the start (0), as vLLM creates its reasons up front.
* **Missing figures are not observed.** A request without a figure (TPOT of a one-token output,
  TTFT or queue time of a refused request) adds nothing to that histogram; vLLM observes 0 for
  the TPOT of one-token outputs.
* ``vllm:iteration_tokens_total`` observes the tokens each engine step ran through the model
  (prefill chunk tokens + decode tokens); vLLM observes prompt + generation tokens per iteration.
* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` are the scheduler's queues after the
  step; requests swapped out to CPU are in ``workbench:num_requests_swapped``, not in waiting.
* ``vllm:kv_cache_usage_perc`` is ``blocks used / blocks`` (0..1, despite the name), as vLLM's
  block-pool usage: free blocks still holding a prefix-cached block count as free.

The pool split (``workbench:kv_pool_tokens{state=...}``) is the live figure at the last step. Which
allocated slots a request will still write is known only when it releases them, so the step-time
split between ``reservation`` and ``internal_fragmentation`` is provisional
(:class:`~workbench.metrics.accounting.PoolAccounting` settles it afterwards in the Recorder's
steps and in ``steps.jsonl``; a gauge already scraped is not revised). The five states always sum
to the pool (docs/architecture.md §3).
"""

from __future__ import annotations

import math

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from workbench.metrics.stats import RequestRecord, StepStats

#: The content type of :meth:`PrometheusSink.render` (Prometheus text format 0.0.4).
CONTENT_TYPE: str = getattr(
    prometheus_client.exposition, "CONTENT_TYPE_PLAIN_0_0_4", "text/plain; version=0.0.4; charset=utf-8"
)

#: vLLM's TTFT buckets (seconds).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM's inter-token latency and per-request TPOT buckets (seconds).
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
#: vLLM's request latency buckets (seconds): e2e, queue, inference, prefill, decode.
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
#: vLLM's tokens-per-iteration buckets.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: workbench:prefix_cache_evicted_block_age_steps (engine steps; this project's choice: 0 = evicted in the step it
#: was freed, then powers of two up to about an hour of decode steps)
EVICTED_AGE_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
#: ``max_model_len`` for the token-count buckets when the sink is built without an engine.
DEFAULT_MAX_MODEL_LEN = 8192

#: ``finished_reason`` values: vLLM's three, then ours (a request the engine refused).
FINISH_REASONS = ("stop", "length", "abort", "error")
#: The five-way split of the KV pool (docs/architecture.md §3), the ``state`` label values.
POOL_STATES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
#: Collectives counted in :class:`~workbench.metrics.StepStats`, the ``op`` label values.
COLLECTIVES = ("allreduce", "allgather", "broadcast")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive."""
    out: list[int] = []
    exp = 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_value:
                return out
            out.append(v)
        exp += 1


class PrometheusSink:
    """A :class:`~workbench.metrics.Recorder` sink that keeps Prometheus metrics of one engine.

    Attach it with ``engine.recorder.add_sink(sink)``; static figures (KV pool size, bytes per
    token, communication buffers) come from :meth:`attach` (called by the constructor when
    ``engine`` is given). Every metric carries ``model_name`` and ``engine="0"``. See the module
    docstring for the list of differences from vLLM.

    Args:
        model_name: the ``model_name`` label (the served model name).
        registry: where the metrics live; a new :class:`prometheus_client.CollectorRegistry` by
            default (never the process-wide ``prometheus_client.REGISTRY``).
        engine: an :class:`~workbench.engine.LLMEngine` to :meth:`attach`; its ``max_model_len``
            sets the token-count buckets (vLLM's 1-2-5 series up to it;
            :data:`DEFAULT_MAX_MODEL_LEN` without an engine).

    Attributes:
        registry: the registry :meth:`render` exposes.
        CONTENT_TYPE: the response's ``Content-Type``.

    Example (a FastAPI route)::

        sink = PrometheusSink("SmolLM2-135M-Instruct", engine=engine)
        engine.recorder.add_sink(sink)

        @app.get("/metrics")
        def metrics():
            return Response(sink.render(), media_type=sink.CONTENT_TYPE)
    """

    CONTENT_TYPE = CONTENT_TYPE

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, engine=None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.engine = None
        self._parents: dict = {}  # labelled metrics by name, for label values added later
        self._declare_step_metrics()
        self._declare_request_metrics(getattr(engine, "max_model_len", None) or DEFAULT_MAX_MODEL_LEN)
        self._declare_pool_metrics()
        if engine is not None:
            self.attach(engine)

    # ------------------------------------------------------------------ declarations
    _LABELS = ("model_name", "engine")

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, self._LABELS, registry=self.registry).labels(self.model_name, "0")

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, self._LABELS, registry=self.registry).labels(self.model_name, "0")

    def _histogram(self, name: str, doc: str, buckets):
        return Histogram(name, doc, self._LABELS, registry=self.registry, buckets=buckets).labels(self.model_name, "0")

    def _by(self, metric_cls, name: str, doc: str, label: str, keys) -> dict:
        """One child per label value ``keys`` of a metric with one more label."""
        m = self._parents[name] = metric_cls(name, doc, (*self._LABELS, label), registry=self.registry)
        return {k: m.labels(self.model_name, "0", k) for k in keys}

    def _declare_step_metrics(self) -> None:
        """vLLM's scheduler and KV cache figures, and the counters fed by every StepStats."""
        gauge, counter, histogram = self._gauge, self._counter, self._histogram
        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches. (Requests.)")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed. (Requests.)")
        self.kv_usage = gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage. (Ratio 0..1 of KV blocks in use; free blocks "
            "still holding a prefix-cached block count as free.)",
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine. (Preemptions.)"
        )
        #: vLLM's frontend admission counter (labels model_name and reason only, as vLLM's): requests refused
        #: because --max-num-queued-reqs were already in flight; vLLM's other reason, max_num_queued_tokens,
        #: has no limit here and stays 0
        rejections = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ("model_name", "reason"),
            registry=self.registry,
        )
        self.admission_rejections = {
            r: rejections.labels(self.model_name, r) for r in ("max_num_queued_reqs", "max_num_queued_tokens")
        }
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step. (Tokens run through the model per step: prefill + decode.)",
            ITERATION_TOKEN_BUCKETS,
        )

    def _declare_request_metrics(self, max_len: int) -> None:
        """vLLM's per-request counters and histograms, fed by every RequestRecord; token buckets up to ``max_len``."""
        counter, histogram, by = self._counter, self._histogram, self._by
        self.prompt_tokens = counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed. (Prompt tokens of finished requests, cached ones included.)",
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed. (Output tokens of finished requests.)"
        )
        self.success = by(
            Counter,
            "vllm:request_success",
            "Count of successfully processed requests. (Finished requests by finished_reason: stop, length, "
            "abort, or error for a request the engine refused.)",
            "finished_reason",
            FINISH_REASONS,
        )
        self._success = self._parents["vllm:request_success"]
        tok = build_1_2_5_buckets(max_len)
        self.h_prompt = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed. (Prompt tokens per request.)", tok
        )
        self.h_generation = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed. (Output tokens per request.)", tok
        )
        self.h_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter. (Tokens.)", tok
        )
        self.h_ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.h_itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self.h_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request. ((e2e - TTFT) / (output tokens - 1), seconds.)",
            TOKEN_LATENCY_BUCKETS,
        )
        lat = REQUEST_LATENCY_BUCKETS
        self.h_e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lat)
        self.h_queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request. (First scheduled - arrival, seconds.)",
            lat,
        )
        self.h_inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request. (Finish - first scheduled, seconds.)",
            lat,
        )
        self.h_prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request. (First token - first scheduled, seconds.)",
            lat,
        )
        self.h_decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request. (Finish - first token, seconds.)",
            lat,
        )

    def _declare_pool_metrics(self) -> None:
        """This project's figures: the KV pool split (docs/architecture.md §3), blocks, swap, collectives, static
        sizes."""
        gauge, counter, by = self._gauge, self._counter, self._by
        live = (
            " Live figure at the last step: the reservation / internal fragmentation split is provisional "
            "until the requests holding the blocks release them."
        )
        self.pool_tokens = by(
            Gauge,
            "workbench:kv_pool_tokens",
            "KV pool split into token_states, reservation, internal_fragmentation, external_fragmentation and "
            "free, in token slots (the five sum to blocks x block size; multiply by workbench:kv_bytes_per_token "
            "for bytes)." + live,
            "state",
            POOL_STATES,
        )
        self.pool_ratio = by(
            Gauge,
            "workbench:kv_pool_ratio",
            "KV pool split as fractions of the pool (ratio 0..1; the five sum to 1)." + live,
            "state",
            POOL_STATES,
        )
        self.kv_utilization = gauge(
            "workbench:kv_utilization",
            "KV utilization: token states / KV pool (ratio 0..1, prefix-shared blocks once).",
        )
        self.fragmentation_rate = gauge(
            "workbench:fragmentation_rate",
            "Fragmentation rate: (reservation + internal + external fragmentation) / (pool - free), the share "
            "of occupied KV slots holding no token state (ratio 0..1)." + live,
        )
        self.blocks_used = gauge("workbench:kv_blocks_used", "KV blocks in use (blocks).")
        self.blocks_free = gauge(
            "workbench:kv_blocks_free", "Free KV blocks, prefix-cached free blocks included (blocks)."
        )
        self.blocks_cached_free = gauge(
            "workbench:kv_blocks_cached_free", "Free KV blocks still holding a prefix-cached block (blocks)."
        )
        self.swapped = gauge("workbench:num_requests_swapped", "Requests whose KV blocks sit in the CPU swap pool.")
        self.swap_bytes = by(
            Counter,
            "workbench:kv_swap_bytes",
            "KV cache bytes copied by swapping, per device: direction=out device to CPU, in CPU to device (bytes).",
            "direction",
            ("out", "in"),
        )
        self.collective_bytes = by(
            Counter,
            "workbench:collective_bytes",
            "Payload bytes of rank 0's collectives under tensor parallelism, per rank, by op (bytes; 0 on one device).",
            "op",
            COLLECTIVES,
        )
        self.collectives = counter("workbench:collectives", "Collectives run by rank 0 (count; 0 on one device).")
        self.collective_seconds = counter(
            "workbench:collective_seconds",
            "Seconds rank 0 spent in collectives, waiting for the slowest rank included (seconds).",
        )
        self.steps = counter("workbench:engine_steps", "Engine steps run (count).")
        self.prefix_evictions = counter(
            "workbench:prefix_cache_evictions",
            "Prefix-cached free KV blocks evicted (handed out for new content) under --prefix-cache-eviction (blocks).",
        )
        self.evicted_age = self._histogram(
            "workbench:prefix_cache_evicted_block_age_steps",
            "Age of each evicted prefix-cached block: engine steps from its free to its eviction (steps).",
            EVICTED_AGE_BUCKETS,
        )
        self.blocks_total = gauge("workbench:kv_blocks_total", "KV blocks in the pool (blocks).")
        self.block_size = gauge("workbench:kv_block_size_tokens", "Tokens per KV block (tokens).")
        self.kv_bytes_per_token = gauge(
            "workbench:kv_bytes_per_token",
            "KV cache bytes per token per device: 2 x layers x KV heads x head dim x dtype bytes / TP size (bytes).",
        )
        self.kv_pool_bytes = gauge("workbench:kv_pool_bytes", "KV pool size per device: blocks x block bytes (bytes).")
        self.comm_buffer_bytes = gauge(
            "workbench:comm_buffer_bytes",
            "Communication (NCCL) buffer bytes in the memory budget per device (bytes; 0 on one device).",
        )

    # ------------------------------------------------------------------ static figures
    def attach(self, engine) -> None:
        """Read the engine's static figures from ``engine.memory`` (a
        :class:`~workbench.memory.MemoryBudget`): blocks, block size, KV bytes per token, KV pool
        bytes, communication buffer bytes. Also lets :meth:`on_request` read each finished
        request's ``max_tokens`` (``vllm:request_params_max_tokens``)."""
        self.engine = engine
        mem = engine.memory
        self.blocks_total.set(mem.num_blocks)
        self.block_size.set(mem.block_size)
        self.kv_bytes_per_token.set(mem.kv_bytes_per_token)
        self.kv_pool_bytes.set(mem.kv_pool_bytes)
        self.comm_buffer_bytes.set(mem.comm_buffer_bytes)
        kv = getattr(engine, "kv", None)  # the pool as it stands before the first step (empty)
        if kv is not None:
            self.blocks_free.set(kv.num_free_blocks)
            self.blocks_used.set(kv.num_blocks - kv.num_free_blocks)

    def engine_stopped(self) -> None:
        """The engine loop stopped on an error: it runs and queues nothing any more (the gauges say so
        rather than freezing at the last step's values)."""
        for g in (self.running, self.waiting, self.swapped):
            g.set(0)

    # ------------------------------------------------------------------ sink interface
    def on_step(self, s: StepStats) -> None:
        """Gauges of the queues and the KV pool after the step; its counters and iteration tokens."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.swapped.set(s.num_swapped)
        self.kv_usage.set(s.blocks_used / s.num_blocks if s.num_blocks else 0.0)
        self.blocks_used.set(s.blocks_used)
        self.blocks_free.set(s.blocks_free)
        self.blocks_cached_free.set(s.num_cached_free_blocks)
        self.blocks_total.set(s.num_blocks)
        self.block_size.set(s.block_size)
        self.kv_bytes_per_token.set(s.kv_bytes_per_token)
        pool = s.num_blocks * s.block_size
        for st in POOL_STATES:
            v = getattr(s, st)
            self.pool_tokens[st].set(v)
            self.pool_ratio[st].set(v / pool if pool else 0.0)
        self.kv_utilization.set(s.kv_utilization)
        self.fragmentation_rate.set(s.fragmentation_rate)

        self.steps.inc()
        self.preemptions.inc(s.num_preemptions)
        self.prefix_queries.inc(s.prefix_cache_queries)
        self.prefix_hits.inc(s.prefix_cache_hits)
        self.prefix_evictions.inc(s.prefix_cache_evictions)
        for age in s.evicted_block_ages_steps:
            self.evicted_age.observe(age)
        self.iteration_tokens.observe(s.num_prefill_tokens + s.num_decode_tokens)
        block_bytes = s.block_size * s.kv_bytes_per_token
        self.swap_bytes["out"].inc(s.swap_out_blocks * block_bytes)
        self.swap_bytes["in"].inc(s.swap_in_blocks * block_bytes)
        for op in COLLECTIVES:
            self.collective_bytes[op].inc(getattr(s, f"{op}_bytes"))
        self.collectives.inc(s.num_collectives)
        self.collective_seconds.inc(s.comm_time_s)

    def on_request(self, r: RequestRecord) -> None:
        """Count a finished request: its finish reason, tokens, latencies and sizes."""
        if r.finish_reason not in self.success:  # a status added after this module: its own series
            self.success[r.finish_reason] = self._success.labels(self.model_name, "0", r.finish_reason)
        self.success[r.finish_reason].inc()
        self.prompt_tokens.inc(r.prompt_tokens)
        self.generation_tokens.inc(r.output_tokens)
        self.h_prompt.observe(r.prompt_tokens)
        self.h_generation.observe(r.output_tokens)
        _observe(self.h_ttft, r.ttft_s)
        _observe(self.h_tpot, r.tpot_s)
        _observe(self.h_e2e, r.e2e_s)
        _observe(self.h_queue, r.queue_time_s)
        _observe(self.h_prefill, _diff(r.first_token_time_s, r.first_scheduled_time_s))
        _observe(self.h_decode, _diff(r.finish_time_s, r.first_token_time_s))
        _observe(self.h_inference, _diff(r.finish_time_s, r.first_scheduled_time_s))
        for x in r.itl_s:
            self.h_itl.observe(x)
        req = getattr(self.engine, "requests", {}).get(r.request_id) if self.engine is not None else None
        if req is not None:  # the engine drops it after the step that records it
            self.h_max_tokens.observe(req.sampling_params.max_tokens)

    def on_block_map(self, snapshot: dict) -> None:
        """Block maps are not exported."""

    def close(self) -> None:
        """Nothing to flush; the registry stays readable."""

    # ------------------------------------------------------------------ exposition
    def render(self) -> bytes:
        """The registry in Prometheus text format (the body of ``GET /metrics``)."""
        return prometheus_client.generate_latest(self.registry)


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _observe(h, v: float | None) -> None:
    if v is not None and not math.isnan(v):
        h.observe(v)


__all__ = ["CONTENT_TYPE", "PrometheusSink", "build_1_2_5_buckets"]
