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
* **Finish reasons.** ``finished_reason`` takes vLLM 0.32's five values (``FinishReason``): ``stop``,
  ``length``, ``abort``, ``error`` and ``repetition``; all five series exist from the start (0), as vLLM
  creates every reason up front. ``error`` is vLLM's value for a retryable request-level internal error
  (a KV load failure); here it is a request the engine refused (a prompt that can never fit
  ``max_model_len`` or the KV pool), or one a failed step ended. vLLM rejects such a prompt before it
  reaches the engine; here it is a finished request with a record, kept apart from client aborts.
  ``repetition`` is never counted: vLLM sets it when a request's ``SamplingParams.repetition_detection``
  finds a repeating token pattern in the output (a hallucination loop); this engine has no repetition
  detection (``SamplingParams`` has no such field).
* **Per-request preemptions and prompt sources** come from the same records:
  ``vllm:request_num_preemptions`` observes each finished sequence's ``num_preemptions`` (recompute and
  swap preemptions alike; ``vllm:num_preemptions_total`` counts the same events as they happen).
  For each request whose prefill completed (it has a first token; vLLM counts prompt sources when the
  prefill completes), ``vllm:request_prefill_kv_computed_tokens`` observes ``prompt_tokens -
  num_cached_tokens`` (its prefix-cache hits at first admission), ``vllm:prompt_tokens_by_source_total``
  adds the same figure under ``source="local_compute"`` and the hits under ``"local_cache_hit"``, and
  ``vllm:prompt_tokens_cached_total`` the hits. So the three sources sum to the prompt tokens of the
  requests that produced a first token, not to ``vllm:prompt_tokens_total``, which also counts refused
  requests and requests aborted before their first token. A parallel-sampling sequence after the first
  (``n > 1``) shares the first one's prompt KV without a prefix-cache lookup: like each of vLLM's child
  requests it reports its whole prompt as computed (vLLM's children do compute it; here they compute only
  the last prompt token). ``vllm:prompt_tokens_cached_by_source_total{source="device"}`` adds each step's
  prefix-cache hits, as vLLM adds its scheduler's, so it equals ``vllm:prefix_cache_hits_total``.
* ``vllm:request_params_n`` and ``vllm:request_max_num_generation_tokens`` observe once per user request,
  when the last of its ``n`` sequences is recorded: ``n`` and the most output tokens of its sequences,
  as vLLM's ``ParentRequest``. ``n`` is read from the engine's request (the sink must be attached to
  the engine; fed records alone, each record counts as a request with ``n = 1``).
* ``vllm:num_requests_waiting_by_reason``: ``reason="capacity"`` is ``vllm:num_requests_waiting``;
  ``"deferred"`` (vLLM: requests skipped for LoRA budget, KV transfer or a blocked status) is always 0,
  as this scheduler skips no waiting request.
* ``vllm:cache_config_info`` (an info gauge, 1, labels vLLM 0.32's ``CacheConfig`` fields and ``engine``,
  no ``model_name``, as vLLM's) is filled from the engine's ``EngineConfig`` and memory budget:
  ``block_size``, ``num_gpu_blocks``, ``gpu_memory_utilization``, ``cache_dtype`` (``--kv-cache-dtype``),
  ``enable_prefix_caching``, ``num_gpu_blocks_override``, ``kv_cache_memory_bytes``, ``num_cpu_blocks``
  (the CPU swap pool; ``None`` without one, as vLLM v1's), ``kv_cache_size_tokens`` and
  ``kv_cache_max_concurrency`` (vLLM's formulas), ``hash_block_size`` / ``cache_hit_alignment_tokens`` /
  ``effective_attention_block_size`` (the block size). ``user_specified_block_size`` is ``True`` when
  ``block_size`` differs from the default (whether it was given is not kept). Fields of features this
  engine lacks (Mamba, sliding window, KV offloading, layouts, ...) carry vLLM's defaults
  (:data:`CACHE_CONFIG_DEFAULTS`). The series exists once :meth:`PrometheusSink.attach` ran.
* **Families of features this engine lacks report what vLLM reports with the feature off**:
  ``vllm:external_prefix_cache_queries_total`` / ``_hits_total`` (no KV connector), ``vllm:mm_cache_queries_total``
  / ``_hits_total`` (text-only models), the ``host`` / ``p2p`` / ``disk`` / ``external_unspecified`` sources of
  ``vllm:prompt_tokens_cached_by_source_total`` and ``external_kv_transfer`` of
  ``vllm:prompt_tokens_by_source_total`` stay 0; ``vllm:engine_sleep_state`` is always ``awake=1``,
  ``weights_offloaded=0``, ``discard_all=0`` (no sleep mode). ``vllm:estimated_flops_per_gpu_total``,
  ``vllm:estimated_read_bytes_per_gpu_total`` and ``vllm:estimated_write_bytes_per_gpu_total`` stay 0: vLLM
  0.32 creates them always but adds to them only with ``--enable-mfu-metrics`` (its model-FLOPs estimator,
  ``vllm/v1/metrics/perf.py``), which is off by default, so a default vLLM server reports 0 too.
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

#: vLLM's ``n`` parameter buckets (``vllm:request_params_n``).
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
#: vLLM's per-request preemption-count buckets (``vllm:request_num_preemptions``; 0 falls in the first).
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)

#: ``finished_reason`` values, vLLM's ``FinishReason`` in its order; ``error`` here is a request the engine
#: refused, ``repetition`` is never set (see the module docstring).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
#: ``vllm:num_requests_waiting_by_reason``'s ``reason`` values.
WAITING_REASONS = ("capacity", "deferred")
#: ``vllm:engine_sleep_state``'s ``sleep_state`` values.
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
#: ``vllm:prompt_tokens_by_source``'s ``source`` values (vLLM's ``PromptTokenStats.ALL_SOURCES``).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``vllm:prompt_tokens_cached_by_source``'s ``source`` values (vLLM's ``CacheHitSource``).
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
#: The labels of ``vllm:cache_config_info``: vLLM 0.32's ``CacheConfig`` fields (``metrics_info()`` is its
#: ``__dict__``), in declaration order, then ``engine``. No ``model_name``, as vLLM's.
CACHE_CONFIG_LABELS = (
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit", "gpu_memory_utilization",
    "cache_dtype", "is_attention_free", "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
    "prefix_caching_hash_algo", "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded", "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype", "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks", "effective_attention_block_size",
    "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size", "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill", "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size",
    "kv_offloading_backend", "_block_size_resolved", "engine",
)  # fmt: skip
#: ``vllm:cache_config_info`` labels for features this engine does not have: vLLM's defaults.
CACHE_CONFIG_DEFAULTS = {
    "kv_cache_layout": "None",
    "prefix_match_unit": "None",
    "is_attention_free": "False",
    "sliding_window": "None",  # the loader refuses sliding-window models
    "prefix_caching_hash_algo": "sha256",  # block hashes are chained SHA-256 (workbench/kv/manager.py)
    "prefix_cache_retention_interval": "0",
    "kv_cache_dtype_skip_layers": "[]",
    "mamba_page_size_padded": "None",
    "skip_page_size_padded": "None",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_ssm_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "replayssm_buffer_len": "16",
    "use_replayssm": "False",
    "use_kda_recoverssm": "False",
    "kv_sharing_fast_prefill": "False",
    "swa_bounded_replay": "True",
    "kv_offloading_size": "None",
    "kv_offloading_backend": "native",
    "_block_size_resolved": "True",
}
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
        self.waiting_by_reason = self._by(
            Gauge,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
            "reasons equals vllm:num_requests_waiting. (Here every waiting request waits for capacity: the "
            "scheduler defers none, so deferred is 0.)",
            "reason",
            WAITING_REASONS,
        )
        self.sleep_state = self._by(
            Gauge,
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2. (No sleep mode here: "
            "always awake.)",
            "sleep_state",
            SLEEP_STATES,
        )
        self.sleep_state["awake"].set(1)  # vLLM's record_sleep_state() defaults: awake
        self.cached_by_source = self._by(
            Counter,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to "
            "DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at "
            "admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits. (One tier here: device.)",
            "source",
            CACHE_HIT_SOURCES,
        )
        # vLLM's families for features this engine lacks: declared, as vLLM declares them, and never increased
        # (the values vLLM reports with the feature off; see the module docstring)
        self.external_prefix_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
            "queried tokens. (No KV connector here: 0.)",
        )
        self.external_prefix_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of "
            "cached tokens. (No KV connector here: 0.)",
        )
        self.mm_cache_queries = counter(
            "vllm:mm_cache_queries",
            "Multi-modal cache queries, in terms of number of queried items. (Text-only engine: 0.)",
        )
        self.mm_cache_hits = counter(
            "vllm:mm_cache_hits",
            "Multi-modal cache hits, in terms of number of cached items. (Text-only engine: 0.)",
        )
        self.estimated_flops = counter(
            "vllm:estimated_flops_per_gpu",
            "Estimated number of floating point operations per GPU (for Model Flops Utilization calculations). "
            "(0, as vLLM without --enable-mfu-metrics, its default.)",
        )
        self.estimated_read_bytes = counter(
            "vllm:estimated_read_bytes_per_gpu",
            "Estimated number of bytes read from memory per GPU (for Model Flops Utilization calculations). "
            "(0, as vLLM without --enable-mfu-metrics, its default.)",
        )
        self.estimated_write_bytes = counter(
            "vllm:estimated_write_bytes_per_gpu",
            "Estimated number of bytes written to memory per GPU (for Model Flops Utilization calculations). "
            "(0, as vLLM without --enable-mfu-metrics, its default.)",
        )
        #: vLLM's info gauge of its CacheConfig (labels: CACHE_CONFIG_LABELS, no model_name); one series, set to 1
        #: by attach() from the engine's configuration
        self.cache_config_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            CACHE_CONFIG_LABELS,
            registry=self.registry,
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
        self.prompt_by_source = by(
            Counter,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source. (Prompt tokens of finished requests whose prefill completed: "
            "local_compute = computed, local_cache_hit = prefix-cache hits; no KV transfer here.)",
            "source",
            PROMPT_TOKEN_SOURCES,
        )
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens (local + external). (Prefix-cache hits of finished requests whose "
            "prefill completed.)",
        )
        tok = build_1_2_5_buckets(max_len)
        self.h_max_generation = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens. (Per request: the most output tokens of "
            "its n sequences.)",
            tok,
        )
        self.h_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS
        )
        self.h_num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted. (Per sequence, recompute and swap.)",
            REQUEST_NUM_PREEMPTIONS_BUCKETS,
        )
        self.h_prefill_kv_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens). (Prompt tokens - "
            "prefix-cache hits, per request whose prefill completed.)",
            tok,
        )
        self._groups: dict[str, list[int]] = {}  # an n > 1 request's id -> [sequences recorded, most output tokens]
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
        bytes, communication buffer bytes; ``vllm:cache_config_info`` from its configuration. Also lets
        :meth:`on_request` read each finished request's ``max_tokens`` (``vllm:request_params_max_tokens``) and
        ``n`` (``vllm:request_params_n``)."""
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
        if getattr(engine, "config", None) is not None:  # one series: the engine attached last
            self.cache_config_info.clear()
            self.cache_config_info.labels(**cache_config_labels(engine)).set(1)

    def engine_stopped(self) -> None:
        """The engine loop stopped on an error: it runs and queues nothing any more (the gauges say so
        rather than freezing at the last step's values)."""
        for g in (self.running, self.waiting, self.swapped, *self.waiting_by_reason.values()):
            g.set(0)

    # ------------------------------------------------------------------ sink interface
    def on_step(self, s: StepStats) -> None:
        """Gauges of the queues and the KV pool after the step; its counters and iteration tokens."""
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.waiting_by_reason["capacity"].set(s.num_waiting)  # the scheduler defers none: "deferred" stays 0
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
        self.cached_by_source["device"].inc(s.prefix_cache_hits)
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
        self.h_num_preemptions.observe(r.num_preemptions)
        if r.first_token_time_s is not None:  # its prefill completed (vLLM counts prompt sources then)
            cached = min(max(r.num_cached_tokens, 0), r.prompt_tokens)
            self.h_prefill_kv_computed.observe(r.prompt_tokens - cached)
            self.prompt_by_source["local_compute"].inc(r.prompt_tokens - cached)
            self.prompt_by_source["local_cache_hit"].inc(cached)
            self.prompt_cached.inc(cached)
        req = getattr(self.engine, "requests", {}).get(r.request_id) if self.engine is not None else None
        if req is not None:  # the engine drops it after the step that records it
            self.h_max_tokens.observe(req.sampling_params.max_tokens)
        self._observe_group(r, req)

    def _observe_group(self, r: RequestRecord, req) -> None:
        """``vllm:request_params_n`` and ``vllm:request_max_num_generation_tokens``: once per request (user id),
        when the last of its ``n`` sequences is recorded, as vLLM's ``ParentRequest`` does. Without the engine's
        request (a sink fed records alone) a record is a request with ``n = 1``."""
        n = req.sampling_params.n if req is not None else 1
        if n <= 1:
            self.h_params_n.observe(1)
            self.h_max_generation.observe(r.output_tokens)
            return
        key = req.parent_id or r.request_id
        g = self._groups.setdefault(key, [0, 0])
        g[0] += 1
        g[1] = max(g[1], r.output_tokens)
        if g[0] >= n:
            del self._groups[key]
            self.h_params_n.observe(n)
            self.h_max_generation.observe(g[1])

    def on_block_map(self, snapshot: dict) -> None:
        """Block maps are not exported."""

    def close(self) -> None:
        """Nothing to flush; the registry stays readable."""

    # ------------------------------------------------------------------ exposition
    def render(self) -> bytes:
        """The registry in Prometheus text format (the body of ``GET /metrics``)."""
        return prometheus_client.generate_latest(self.registry)


def cache_config_labels(engine) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` for ``engine``: vLLM's ``CacheConfig.metrics_info()`` (each field
    as ``str()``), filled from the engine's configuration and memory budget; features this engine lacks get vLLM's
    defaults (:data:`CACHE_CONFIG_DEFAULTS`). ``kv_cache_max_concurrency`` and ``kv_cache_size_tokens`` are vLLM's
    formulas for one full-attention group: blocks / ceil(max_model_len / block_size), and that x max_model_len."""
    from workbench.config import EngineConfig

    cfg, mem = engine.config, engine.memory
    bs, blocks = mem.block_size, mem.num_blocks
    max_len = getattr(engine, "max_model_len", None) or DEFAULT_MAX_MODEL_LEN
    concurrency = blocks / -(-max_len // bs)
    swap_pool = getattr(getattr(engine, "kv", None), "swap_pool", None)  # the CPU swap pool, paged managers only
    num_cpu_blocks = swap_pool.num_blocks if swap_pool is not None else 0
    default_bs = EngineConfig.__dataclass_fields__["block_size"].default
    labels = {
        **CACHE_CONFIG_DEFAULTS,
        "block_size": bs,
        "user_specified_block_size": cfg.block_size != default_bs,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "cache_dtype": cfg.kv_cache_dtype,
        "num_gpu_blocks_override": cfg.num_gpu_blocks_override,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "num_gpu_blocks": blocks,
        "num_cpu_blocks": num_cpu_blocks or None,  # the CPU swap pool (preemption_mode="swap"); None as vLLM's
        "effective_attention_block_size": bs,
        "kv_cache_size_tokens": int(concurrency * max_len),
        "kv_cache_max_concurrency": concurrency,
        "hash_block_size": bs,  # a hash per full block
        "cache_hit_alignment_tokens": bs,  # hits are whole blocks
        "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
        "engine": "0",
    }
    return {k: str(labels[k]) for k in CACHE_CONFIG_LABELS}


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _observe(h, v: float | None) -> None:
    if v is not None and not math.isnan(v):
        h.observe(v)


__all__ = ["CONTENT_TYPE", "PrometheusSink", "build_1_2_5_buckets", "cache_config_labels"]
