"""``GET /metrics`` exports every metric family a default vLLM 0.32 server exports, with vLLM's name, type, label
names and bucket boundaries, and values that come from the engine (workbench/metrics/prometheus.py).

The table below was taken from vLLM 0.32's source (vllm/v1/metrics/loggers.py ``PrometheusStatLogger``,
vllm/v1/metrics/perf.py ``PerfMetricsProm``, vllm/v1/metrics/buckets.py, vllm/config/cache.py); where that source
(runs/bench/vllm-venv) or a scrape of a real vLLM 0.32 server (runs/against_vllm/vllm_metrics.txt) is on this
machine, the table is checked against them too (not in CI).
"""

from __future__ import annotations

import ast
import math
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from workbench.config import EngineConfig
from workbench.metrics.prometheus import CACHE_CONFIG_LABELS, PrometheusSink, build_1_2_5_buckets
from workbench.metrics.stats import RequestRecord, StepStats

ROOT = Path(__file__).resolve().parents[1]
VLLM_SITE = ROOT / "runs" / "bench" / "vllm-venv" / "lib" / "python3.11" / "site-packages" / "vllm"
VLLM_SCRAPE = ROOT / "runs" / "against_vllm" / "vllm_metrics.txt"

BASE = ("model_name", "engine")
#: vLLM 0.32's bucket families (vllm/v1/metrics/buckets.py); "request_tokens" is 1-2-5 up to max_model_len
BUCKETS = {
    "request_latency": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0,
    ),
    "time_to_first_token": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0,
    ),
    "inter_token_latency": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    ),
    "iteration_tokens": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "request_params_n": (1, 2, 5, 10, 20),
    "request_num_preemptions": (1, 2, 3, 4, 5, 10, 20),
}  # fmt: skip

#: (family as prometheus_client's parser names it: counters without ``_total``, type, label names, buckets)
FAMILIES = [
    ("vllm:estimated_flops_per_gpu", "counter", BASE, None),
    ("vllm:estimated_read_bytes_per_gpu", "counter", BASE, None),
    ("vllm:estimated_write_bytes_per_gpu", "counter", BASE, None),
    ("vllm:num_requests_running", "gauge", BASE, None),
    ("vllm:num_requests_waiting", "gauge", BASE, None),
    ("vllm:num_requests_waiting_by_reason", "gauge", (*BASE, "reason"), None),
    ("vllm:engine_sleep_state", "gauge", (*BASE, "sleep_state"), None),
    ("vllm:kv_cache_usage_perc", "gauge", BASE, None),
    ("vllm:prefix_cache_queries", "counter", BASE, None),
    ("vllm:prefix_cache_hits", "counter", BASE, None),
    ("vllm:external_prefix_cache_queries", "counter", BASE, None),
    ("vllm:external_prefix_cache_hits", "counter", BASE, None),
    ("vllm:mm_cache_queries", "counter", BASE, None),
    ("vllm:mm_cache_hits", "counter", BASE, None),
    ("vllm:num_preemptions", "counter", BASE, None),
    ("vllm:prompt_tokens", "counter", BASE, None),
    ("vllm:prompt_tokens_by_source", "counter", (*BASE, "source"), None),
    ("vllm:prompt_tokens_cached", "counter", BASE, None),
    ("vllm:prompt_tokens_cached_by_source", "counter", (*BASE, "source"), None),
    ("vllm:generation_tokens", "counter", BASE, None),
    ("vllm:request_success", "counter", (*BASE, "finished_reason"), None),
    ("vllm:admission_rejections", "counter", ("model_name", "reason"), None),
    ("vllm:request_prompt_tokens", "histogram", BASE, "request_tokens"),
    ("vllm:request_generation_tokens", "histogram", BASE, "request_tokens"),
    ("vllm:iteration_tokens_total", "histogram", BASE, "iteration_tokens"),
    ("vllm:request_max_num_generation_tokens", "histogram", BASE, "request_tokens"),
    ("vllm:request_params_n", "histogram", BASE, "request_params_n"),
    ("vllm:request_params_max_tokens", "histogram", BASE, "request_tokens"),
    ("vllm:time_to_first_token_seconds", "histogram", BASE, "time_to_first_token"),
    ("vllm:inter_token_latency_seconds", "histogram", BASE, "inter_token_latency"),
    ("vllm:request_time_per_output_token_seconds", "histogram", BASE, "inter_token_latency"),
    ("vllm:e2e_request_latency_seconds", "histogram", BASE, "request_latency"),
    ("vllm:request_queue_time_seconds", "histogram", BASE, "request_latency"),
    ("vllm:request_inference_time_seconds", "histogram", BASE, "request_latency"),
    ("vllm:request_prefill_time_seconds", "histogram", BASE, "request_latency"),
    ("vllm:request_decode_time_seconds", "histogram", BASE, "request_latency"),
    ("vllm:request_num_preemptions", "histogram", BASE, "request_num_preemptions"),
    ("vllm:request_prefill_kv_computed_tokens", "histogram", BASE, "request_tokens"),
    ("vllm:cache_config_info", "gauge", CACHE_CONFIG_LABELS, None),
]
#: the values of each family's extra label, all present from the start
LABEL_VALUES = {
    "vllm:num_requests_waiting_by_reason": {"capacity", "deferred"},
    "vllm:engine_sleep_state": {"awake", "weights_offloaded", "discard_all"},
    "vllm:prompt_tokens_by_source": {"local_compute", "local_cache_hit", "external_kv_transfer"},
    "vllm:prompt_tokens_cached_by_source": {"device", "host", "p2p", "disk", "external_unspecified"},
    "vllm:request_success": {"stop", "length", "abort", "error", "repetition"},
    "vllm:admission_rejections": {"max_num_queued_reqs", "max_num_queued_tokens"},
}
#: vLLM 0.32's CacheConfig fields (vllm/config/cache.py), the labels of vllm:cache_config_info with "engine"
CACHE_CONFIG_FIELDS = (
    "block_size", "user_specified_block_size", "kv_cache_layout", "prefix_match_unit", "gpu_memory_utilization",
    "cache_dtype", "is_attention_free", "num_gpu_blocks_override", "sliding_window", "enable_prefix_caching",
    "prefix_caching_hash_algo", "prefix_cache_retention_interval", "kv_cache_dtype_skip_layers",
    "mamba_page_size_padded", "skip_page_size_padded", "mamba_block_size", "mamba_cache_dtype",
    "mamba_ssm_cache_dtype", "mamba_cache_mode", "enable_mamba_shared_prefix_checkpoint", "replayssm_buffer_len",
    "use_replayssm", "use_kda_recoverssm", "num_gpu_blocks", "num_cpu_blocks", "effective_attention_block_size",
    "kv_cache_size_tokens", "kv_cache_max_concurrency", "hash_block_size", "cache_hit_alignment_tokens",
    "kv_sharing_fast_prefill", "swa_bounded_replay", "kv_cache_memory_bytes", "kv_offloading_size",
    "kv_offloading_backend", "_block_size_resolved",
)  # fmt: skip


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}


def value(fams: dict, name: str, suffix: str = "", **labels) -> float:
    fam = fams[name]
    return sum(
        s.value for s in fam.samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


def bucket_bounds(fam) -> list[float]:
    return [float(s.labels["le"]) for s in fam.samples if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]


def check_hist(fams: dict, name: str, values: list[float]) -> None:
    assert value(fams, name, "_count") == len(values), name
    assert math.isclose(value(fams, name, "_sum"), sum(values), abs_tol=1e-9), name
    for s in fams[name].samples:
        if s.name == name + "_bucket":
            assert s.value == sum(v <= float(s.labels["le"]) for v in values), (name, s.labels["le"])


def check_families(fams: dict, max_model_len: int, skip: tuple[str, ...] = ()) -> None:
    """Every family of :data:`FAMILIES` with vLLM's type, label names, label values and buckets."""
    for name, kind, labels, buckets in FAMILIES:
        if name in skip:
            continue
        assert name in fams, name
        fam = fams[name]
        assert fam.type == kind, name
        assert fam.samples, name
        for s in fam.samples:
            assert set(s.labels) - {"le"} == set(labels), (name, sorted(s.labels))
        if name in LABEL_VALUES:
            extra = labels[-1]
            assert {s.labels[extra] for s in fam.samples} == LABEL_VALUES[name], name
        if buckets is not None:
            want = build_1_2_5_buckets(max_model_len) if buckets == "request_tokens" else BUCKETS[buckets]
            assert bucket_bounds(fam) == [float(b) for b in want], name


def fake_engine(**config) -> SimpleNamespace:
    """What :meth:`PrometheusSink.attach` reads of an engine, without a model."""
    cfg = EngineConfig(**config)
    memory = SimpleNamespace(
        num_blocks=100, block_size=cfg.block_size, kv_bytes_per_token=64, kv_pool_bytes=100 * cfg.block_size * 64,
        comm_buffer_bytes=0, block_bytes=cfg.block_size * 64,
    )  # fmt: skip
    return SimpleNamespace(config=cfg, memory=memory, max_model_len=256, requests={})


# ---------------------------------------------------------------- names, types, labels, buckets
def test_every_vllm_family_is_exported_with_vllms_type_labels_and_buckets():
    sink = PrometheusSink("m")
    check_families(families(sink.render().decode()), 8192, skip=("vllm:cache_config_info",))
    sink.attach(fake_engine())
    fams = families(sink.render().decode())
    check_families(fams, 8192)
    assert [s.value for s in fams["vllm:cache_config_info"].samples] == [1.0]
    # the counters with vLLM's _total names in the exposition
    text = sink.render().decode()
    for name in ("vllm:estimated_flops_per_gpu_total{", "vllm:prompt_tokens_cached_by_source_total{"):
        assert name in text


def test_cache_config_info_from_the_engine_configuration():
    sink = PrometheusSink("m", engine=fake_engine(block_size=8, enable_prefix_caching=True, kv_cache_dtype="float16"))
    (s,) = families(sink.render().decode())["vllm:cache_config_info"].samples
    assert set(s.labels) == set(CACHE_CONFIG_LABELS) and "model_name" not in s.labels
    labels = s.labels
    assert labels["block_size"] == "8" and labels["num_gpu_blocks"] == "100"
    assert labels["enable_prefix_caching"] == "True" and labels["cache_dtype"] == "float16"
    assert labels["gpu_memory_utilization"] == str(EngineConfig().gpu_memory_utilization)
    assert labels["num_gpu_blocks_override"] == "None" and labels["kv_cache_memory_bytes"] == "None"
    assert labels["user_specified_block_size"] == "True"  # 8 is not the default block size
    # vLLM's formulas: blocks / ceil(max_model_len / block_size) requests of max_model_len tokens
    assert labels["kv_cache_max_concurrency"] == str(100 / 32) and labels["kv_cache_size_tokens"] == str(800)
    assert labels["num_cpu_blocks"] == "None"  # no swap pool (preemption_mode="recompute")
    assert labels["engine"] == "0" and labels["_block_size_resolved"] == "True"
    assert labels["mamba_cache_mode"] == "none" and labels["kv_offloading_backend"] == "native"
    # attaching again replaces the series
    sink.attach(fake_engine(block_size=16))
    (s,) = families(sink.render().decode())["vllm:cache_config_info"].samples
    assert s.labels["block_size"] == "16" and s.labels["user_specified_block_size"] == "False"


# ---------------------------------------------------------------- values from records and steps
def _record(rid: str, prompt: int, out: int, preemptions: int = 0, cached: int = 0, ran: bool = True):
    return RequestRecord(
        request_id=rid,
        prompt_tokens=prompt,
        output_tokens=out,
        finish_reason="length" if ran else "error",
        error=None if ran else "refused",
        arrival_time_s=0.0,
        first_scheduled_time_s=0.1 if ran else None,
        first_token_time_s=0.2 if ran else None,
        finish_time_s=0.5 if ran else 0.0,
        ttft_s=0.2 if ran else None,
        tpot_s=None,
        e2e_s=0.5 if ran else None,
        queue_time_s=0.1 if ran else None,
        num_preemptions=preemptions,
        num_cached_tokens=cached,
    )


def _step(**kw) -> StepStats:
    base = dict.fromkeys(
        (
            "step", "time_s", "wall_time_s", "schedule_time_s", "model_time_s", "sample_time_s", "num_prefill_tokens",
            "num_decode_tokens", "num_prefill_reqs", "num_decode_reqs", "num_running", "num_waiting",
            "num_preemptions", "num_finished", "token_states", "reservation", "internal_fragmentation",
            "external_fragmentation", "kv_utilization", "fragmentation_rate",
        ),
        0,
    )  # fmt: skip
    base.update(num_blocks=10, blocks_used=0, blocks_free=10, block_size=16, kv_bytes_per_token=64, free=160)
    return StepStats(**{**base, **kw})


def test_per_request_preemptions_prompt_sources_and_cached_tokens_from_the_records():
    sink = PrometheusSink("m")
    recs = [
        _record("a", prompt=40, out=5, preemptions=2, cached=32),
        _record("b", prompt=20, out=3),
        _record("c", prompt=10, out=7, preemptions=1),
        _record("d", prompt=30, out=0, ran=False),  # refused: no prefill, never preempted
    ]
    for r in recs:
        sink.on_request(r)
    fams = families(sink.render().decode())
    check_hist(fams, "vllm:request_num_preemptions", [2, 0, 1, 0])
    check_hist(fams, "vllm:request_prefill_kv_computed_tokens", [8, 20, 10])  # requests whose prefill completed
    assert value(fams, "vllm:prompt_tokens_cached", "_total") == 32
    assert value(fams, "vllm:prompt_tokens_by_source", "_total", source="local_cache_hit") == 32
    assert value(fams, "vllm:prompt_tokens_by_source", "_total", source="local_compute") == 8 + 20 + 10
    assert value(fams, "vllm:prompt_tokens_by_source", "_total", source="external_kv_transfer") == 0
    assert value(fams, "vllm:prompt_tokens", "_total") == 100  # refused prompts included (documented)
    # fed records alone, each is a request with n = 1
    check_hist(fams, "vllm:request_params_n", [1, 1, 1, 1])
    check_hist(fams, "vllm:request_max_num_generation_tokens", [5, 3, 7, 0])
    assert value(fams, "vllm:request_success", "_total", finished_reason="repetition") == 0


def test_step_figures_waiting_by_reason_cached_by_source_and_features_off():
    sink = PrometheusSink("m")
    sink.on_step(_step(num_waiting=3, num_running=2, prefix_cache_queries=64, prefix_cache_hits=48))
    sink.on_step(_step(num_waiting=5, prefix_cache_queries=16, prefix_cache_hits=16))
    fams = families(sink.render().decode())
    assert value(fams, "vllm:num_requests_waiting_by_reason", reason="capacity") == 5
    assert value(fams, "vllm:num_requests_waiting_by_reason", reason="deferred") == 0
    assert value(fams, "vllm:num_requests_waiting_by_reason") == value(fams, "vllm:num_requests_waiting") == 5
    by_source = {
        s.labels["source"]: s.value
        for s in fams["vllm:prompt_tokens_cached_by_source"].samples
        if s.name.endswith("_total")
    }
    assert by_source == {"device": 64, "host": 0, "p2p": 0, "disk": 0, "external_unspecified": 0}
    assert value(fams, "vllm:prefix_cache_hits", "_total") == 64
    sleep = {s.labels["sleep_state"]: s.value for s in fams["vllm:engine_sleep_state"].samples}
    assert sleep == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
    for name in (
        "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits", "vllm:mm_cache_queries",
        "vllm:mm_cache_hits", "vllm:estimated_flops_per_gpu", "vllm:estimated_read_bytes_per_gpu",
        "vllm:estimated_write_bytes_per_gpu",
    ):  # fmt: skip
        assert value(fams, name, "_total") == 0, name
    sink.engine_stopped()
    fams = families(sink.render().decode())
    assert value(fams, "vllm:num_requests_waiting_by_reason") == 0


def test_values_agree_with_a_real_engine_that_preempts_caches_and_samples_in_parallel(tiny_model):
    from workbench import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=96,
        num_gpu_blocks_override=30,
        enable_prefix_caching=True,
    )
    eng = llm.llm_engine
    sink = PrometheusSink("tiny", engine=eng)
    eng.recorder.add_sink(sink)
    shared = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    prompts = [shared + [20 + i] * (8 + 3 * i) for i in range(6)]
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_tokens=40, ignore_eos=True))
    eng.add_request("par", prompts[0], SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True))
    eng.add_request("long", [7] * 200, SamplingParams(max_tokens=4))  # refused: over max_model_len
    for _ in range(500):
        if not eng.has_unfinished_requests():
            break
        eng.step()
    assert not eng.has_unfinished_requests()
    recs, steps = eng.recorder.requests, eng.recorder.steps
    fams = families(sink.render().decode())
    check_families(fams, 96)

    assert len(recs) == 6 + 3 + 1
    preemptions = [r.num_preemptions for r in recs]
    assert sum(preemptions) == sum(s.num_preemptions for s in steps) > 0  # the pool is too small: preemptions
    check_hist(fams, "vllm:request_num_preemptions", preemptions)
    ran = [r for r in recs if r.first_token_time_s is not None]
    assert len(ran) == 9
    cached = sum(r.num_cached_tokens for r in ran)
    assert cached > 0  # the shared prefix and the repeated prompt hit the prefix cache
    check_hist(fams, "vllm:request_prefill_kv_computed_tokens", [r.prompt_tokens - r.num_cached_tokens for r in ran])
    assert value(fams, "vllm:prompt_tokens_cached", "_total") == cached
    assert value(fams, "vllm:prompt_tokens_by_source", "_total", source="local_cache_hit") == cached
    assert value(fams, "vllm:prompt_tokens_by_source", "_total") == sum(r.prompt_tokens for r in ran)
    hits = sum(s.prefix_cache_hits for s in steps)
    assert value(fams, "vllm:prompt_tokens_cached_by_source", "_total", source="device") == hits
    assert value(fams, "vllm:prompt_tokens_cached_by_source", "_total") == value(
        fams, "vllm:prefix_cache_hits", "_total"
    )
    # once per user request: 6 single ones, the n=3 one, the refused one
    check_hist(fams, "vllm:request_params_n", [1] * 6 + [3] + [1])
    by_rid = Counter()
    for r in recs:
        key = r.request_id.rpartition("#")[0] or r.request_id
        by_rid[key] = max(by_rid[key], r.output_tokens)
    assert by_rid["par"] == 30 and by_rid["long"] == 0
    check_hist(fams, "vllm:request_max_num_generation_tokens", sorted(by_rid.values()))
    assert value(fams, "vllm:num_requests_waiting_by_reason") == 0
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.labels["num_gpu_blocks"] == "30" and info.labels["block_size"] == "4"
    assert info.labels["enable_prefix_caching"] == "True" and info.labels["num_gpu_blocks_override"] == "30"
    assert info.labels["kv_cache_max_concurrency"] == str(30 / 24)


# ---------------------------------------------------------------- the table against vLLM itself
needs_vllm = pytest.mark.skipif(
    not (VLLM_SITE / "v1" / "metrics" / "loggers.py").exists(),
    reason="vLLM 0.32 is not installed in runs/bench/vllm-venv (not in CI)",
)


@needs_vllm
def test_the_table_matches_vllms_source():
    src = (VLLM_SITE / "v1" / "metrics" / "loggers.py").read_text() + (
        VLLM_SITE / "v1" / "metrics" / "perf.py"
    ).read_text()
    declared = {
        (name, kind) for kind, name in re.findall(r'_(counter|gauge|histogram)_cls\(\s*name="(vllm:[a-z0-9_]+)"', src)
    }
    declared |= {(name, "gauge") for name in re.findall(r'name = "(vllm:[a-z0-9_]+)"', src)}  # the info gauge
    for name, kind, _, _ in FAMILIES:  # (prometheus_client drops a counter's _total from its family name)
        assert (name, kind) in declared or (kind == "counter" and (f"{name}_total", kind) in declared), name
    # the bucket families
    tree = ast.parse((VLLM_SITE / "v1" / "metrics" / "buckets.py").read_text())
    consts = {
        n.target.id: ast.literal_eval(n.value)
        for n in tree.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id.endswith("_BUCKETS")
    }
    for key, bounds in BUCKETS.items():
        assert consts[f"{key.upper()}_BUCKETS"] == bounds, key
    # the CacheConfig fields (metrics_info() is the instance's __dict__)
    tree = ast.parse((VLLM_SITE / "config" / "cache.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CacheConfig"]
    fields = [
        n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and "ClassVar" not in ast.unparse(n.annotation)
    ]
    assert tuple(fields) == CACHE_CONFIG_FIELDS
    assert CACHE_CONFIG_LABELS == (*CACHE_CONFIG_FIELDS, "engine")
    # every FinishReason is pre-created
    assert re.search(r'FINISH_REASON_STRINGS = \("stop", "length", "abort", "error", "repetition"\)',
                     (VLLM_SITE / "v1" / "engine" / "__init__.py").read_text())  # fmt: skip


@pytest.mark.skipif(not VLLM_SCRAPE.exists(), reason="no scrape of a real vLLM 0.32 server here (not in CI)")
def test_the_table_matches_a_real_vllm_scrape():
    fams = families(VLLM_SCRAPE.read_text())
    vllm = {n for n in fams if n.startswith("vllm:")}
    assert vllm == {name for name, *_ in FAMILIES}
    max_len = int(bucket_bounds(fams["vllm:request_prompt_tokens"])[-1])  # its max_model_len's 1-2-5 series
    check_families(fams, max_len)
