"""The Prometheus exporter of ``workbench serve`` (``GET /metrics``): vLLM's names and types, and
counters and histograms that agree with the engine's own records."""

from __future__ import annotations

import math

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workbench.metrics.prometheus import FINISH_REASONS, PrometheusSink
from workbench.metrics.stats import RequestRecord, StepStats

#: family name (as the parser reports it: counters without ``_total``) -> type
VLLM = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
}
WORKBENCH = {
    "workbench:kv_pool_tokens": "gauge",
    "workbench:kv_pool_ratio": "gauge",
    "workbench:kv_utilization": "gauge",
    "workbench:fragmentation_rate": "gauge",
    "workbench:kv_blocks_used": "gauge",
    "workbench:kv_blocks_free": "gauge",
    "workbench:kv_blocks_cached_free": "gauge",
    "workbench:kv_blocks_total": "gauge",
    "workbench:kv_block_size_tokens": "gauge",
    "workbench:kv_bytes_per_token": "gauge",
    "workbench:kv_pool_bytes": "gauge",
    "workbench:comm_buffer_bytes": "gauge",
    "workbench:num_requests_swapped": "gauge",
    "workbench:kv_swap_bytes": "counter",
    "workbench:collective_bytes": "counter",
    "workbench:collectives": "counter",
    "workbench:collective_seconds": "counter",
    "workbench:engine_steps": "counter",
    "workbench:prefix_cache_evictions": "counter",
    "workbench:prefix_cache_evicted_block_age_steps": "histogram",
}
STATES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")


def families(sink: PrometheusSink) -> dict:
    return {f.name: f for f in text_string_to_metric_families(sink.render().decode())}


def value(fams: dict, name: str, suffix: str = "", **labels) -> float:
    """Sum of the samples ``name + suffix`` whose labels include ``labels``."""
    fam = fams[name]
    return sum(
        s.value for s in fam.samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


def hist(fams: dict, name: str) -> tuple[float, float]:
    """``(_count, _sum)`` of a histogram."""
    return value(fams, name, "_count"), value(fams, name, "_sum")


def check_hist(fams: dict, name: str, values: list[float]) -> None:
    count, total = hist(fams, name)
    assert count == len(values), name
    assert math.isclose(total, sum(values), rel_tol=1e-9, abs_tol=1e-9), name
    buckets = [s for s in fams[name].samples if s.name == name + "_bucket"]
    inf = [s.value for s in buckets if s.labels["le"] == "+Inf"]
    assert inf == [count], name
    for s in buckets:  # cumulative counts agree with the values
        le = float(s.labels["le"])
        assert s.value == sum(v <= le for v in values), (name, s.labels["le"])


def test_exposition_names_types_help_and_units_without_an_engine():
    sink = PrometheusSink("m")
    fams = families(sink)
    for name, kind in {**VLLM, **WORKBENCH}.items():
        assert name in fams, name
        assert fams[name].type == kind, name
        assert fams[name].documentation.strip(), name
    text = sink.render().decode()
    assert "vllm:prompt_tokens_total{" in text and "workbench:engine_steps_total{" in text
    for s in fams["vllm:num_requests_running"].samples:
        assert s.labels["model_name"] == "m"
    # vLLM 0.32's finish reasons (FinishReason: error here is a refused request, repetition is never set) exist
    # before any request finishes
    reasons = {s.labels["finished_reason"] for s in fams["vllm:request_success"].samples if s.name.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    # vLLM's buckets
    ttft = [s.labels["le"] for s in fams["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert ttft[:3] == ["0.001", "0.005", "0.01"] and ttft[-2:] == ["2560.0", "+Inf"]
    assert sink.CONTENT_TYPE.startswith("text/plain")


def test_two_sinks_in_one_process_do_not_clash():
    a, b = PrometheusSink("a"), PrometheusSink("b")
    assert a.registry is not b.registry and a.registry is not prometheus_client.REGISTRY
    a.on_request(_record("1", "stop", out=3))
    fa, fb = families(a), families(b)
    assert value(fa, "vllm:request_success", "_total") == 1
    assert value(fb, "vllm:request_success", "_total") == 0
    assert {s.labels["model_name"] for s in fb["vllm:generation_tokens"].samples} == {"b"}
    # and neither touched the process-wide registry
    assert prometheus_client.REGISTRY.get_sample_value("vllm:generation_tokens_total", {"model_name": "a"}) is None


def test_a_given_registry_is_used():
    reg = prometheus_client.CollectorRegistry()
    sink = PrometheusSink("m", registry=reg)
    sink.on_request(_record("1", "stop", out=2))
    assert reg.get_sample_value("vllm:generation_tokens_total", {"model_name": "m", "engine": "0"}) == 2


def test_error_finish_counts_under_its_own_reason_and_skips_missing_latencies():
    sink = PrometheusSink("m")
    sink.on_request(_record("1", "error", out=0, timed=False))
    sink.on_request(_record("2", "length", out=1))
    fams = families(sink)
    assert value(fams, "vllm:request_success", "_total", finished_reason="error") == 1
    assert value(fams, "vllm:request_success", "_total", finished_reason="length") == 1
    assert hist(fams, "vllm:e2e_request_latency_seconds")[0] == 1  # the refused request has no latency
    assert hist(fams, "vllm:request_time_per_output_token_seconds")[0] == 0  # one output token: no TPOT
    assert hist(fams, "vllm:request_prompt_tokens")[0] == 2


def test_step_gauges_and_counters_from_step_stats():
    sink = PrometheusSink("m")
    s = _step(swap_out_blocks=2, swap_in_blocks=1, allreduce_bytes=100, num_collectives=3, comm_time_s=0.5)
    sink.on_step(s)
    sink.on_step(s)
    fams = families(sink)
    assert value(fams, "vllm:num_requests_running") == s.num_running
    assert value(fams, "vllm:kv_cache_usage_perc") == s.blocks_used / s.num_blocks
    assert value(fams, "workbench:kv_swap_bytes", "_total", direction="out") == 2 * 2 * 16 * 64
    assert value(fams, "workbench:kv_swap_bytes", "_total", direction="in") == 2 * 1 * 16 * 64
    assert value(fams, "workbench:collective_bytes", "_total", op="allreduce") == 200
    assert value(fams, "workbench:collectives", "_total") == 6
    assert value(fams, "workbench:collective_seconds", "_total") == 1.0
    assert value(fams, "workbench:engine_steps", "_total") == 2
    assert hist(fams, "vllm:iteration_tokens_total") == (2, 2 * (s.num_prefill_tokens + s.num_decode_tokens))
    pool = {st: value(fams, "workbench:kv_pool_tokens", state=st) for st in STATES}
    assert sum(pool.values()) == s.num_blocks * s.block_size
    assert math.isclose(sum(value(fams, "workbench:kv_pool_ratio", state=st) for st in STATES), 1.0)


def test_prefix_cache_counters_and_evicted_block_ages_from_step_stats():
    sink = PrometheusSink("m")
    steps = [
        _step(
            prefix_cache_queries=100, prefix_cache_hits=64, prefix_cache_evictions=3, evicted_block_ages_steps=[0, 5, 5]
        ),
        _step(prefix_cache_queries=40, prefix_cache_hits=0, prefix_cache_evictions=1, evicted_block_ages_steps=[300]),
        _step(),
    ]
    for s in steps:
        sink.on_step(s)
    fams = families(sink)
    assert value(fams, "vllm:prefix_cache_queries", "_total") == 140
    assert value(fams, "vllm:prefix_cache_hits", "_total") == 64
    assert value(fams, "workbench:prefix_cache_evictions", "_total") == 4
    check_hist(fams, "workbench:prefix_cache_evicted_block_age_steps", [0, 5, 5, 300])


@pytest.mark.slow
def test_exporter_agrees_with_the_engine_records_on_the_bundled_model():
    from workbench import LLM, SamplingParams

    llm = LLM(max_model_len=256, max_num_seqs=4, enable_prefix_caching=True)
    engine = llm.llm_engine
    sink = PrometheusSink("smol", engine=engine)
    engine.recorder.add_sink(sink)
    system = "You are a careful assistant who answers questions about memory in LLM serving, briefly. "
    prompts = [system + q for q in ("What is a KV cache?", "Why page it?", "What is a block?", "What is swap?")]
    prompts += prompts[:2]  # repeats: their whole prompt but the last block is cached
    llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.recorder.remove_sink(sink)
    sink.close()
    recs: list[RequestRecord] = engine.recorder.requests
    steps: list[StepStats] = engine.recorder.steps
    assert len(recs) == len(prompts)
    fams = families(sink)

    for name, kind in {**VLLM, **WORKBENCH}.items():
        assert fams[name].type == kind, name
        assert all(s.labels.get("model_name") == "smol" for s in fams[name].samples), name

    assert value(fams, "vllm:request_success", "_total") == len(recs)
    assert value(fams, "vllm:request_success", "_total", finished_reason="length") == len(recs)
    assert value(fams, "vllm:generation_tokens", "_total") == sum(r.output_tokens for r in recs) == 8 * len(recs)
    assert value(fams, "vllm:prompt_tokens", "_total") == sum(r.prompt_tokens for r in recs)
    assert value(fams, "vllm:num_preemptions", "_total") == sum(s.num_preemptions for s in steps)
    assert value(fams, "vllm:prefix_cache_queries", "_total") == sum(s.prefix_cache_queries for s in steps)
    hits = value(fams, "vllm:prefix_cache_hits", "_total")
    assert hits == sum(s.prefix_cache_hits for s in steps) > 0
    assert value(fams, "workbench:engine_steps", "_total") == len(steps)

    check_hist(fams, "vllm:time_to_first_token_seconds", [r.ttft_s for r in recs])
    check_hist(fams, "vllm:e2e_request_latency_seconds", [r.e2e_s for r in recs])
    check_hist(fams, "vllm:request_queue_time_seconds", [r.queue_time_s for r in recs])
    check_hist(fams, "vllm:request_time_per_output_token_seconds", [r.tpot_s for r in recs])
    check_hist(fams, "vllm:inter_token_latency_seconds", [x for r in recs for x in r.itl_s])
    check_hist(
        fams, "vllm:request_prefill_time_seconds", [r.first_token_time_s - r.first_scheduled_time_s for r in recs]
    )
    check_hist(fams, "vllm:request_decode_time_seconds", [r.finish_time_s - r.first_token_time_s for r in recs])
    check_hist(fams, "vllm:request_inference_time_seconds", [r.finish_time_s - r.first_scheduled_time_s for r in recs])
    check_hist(fams, "vllm:request_prompt_tokens", [r.prompt_tokens for r in recs])
    check_hist(fams, "vllm:request_generation_tokens", [r.output_tokens for r in recs])
    check_hist(fams, "vllm:request_params_max_tokens", [8] * len(recs))
    check_hist(fams, "vllm:iteration_tokens_total", [s.num_prefill_tokens + s.num_decode_tokens for s in steps])
    # vLLM's token buckets: 1-2-5 up to max_model_len
    le = [s.labels["le"] for s in fams["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert le == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]

    mem, last = engine.memory, steps[-1]
    pool = {st: value(fams, "workbench:kv_pool_tokens", state=st) for st in STATES}
    assert sum(pool.values()) == mem.num_blocks * mem.block_size
    assert pool == {st: getattr(last, st) for st in STATES}  # the live figure at the last step
    assert math.isclose(sum(value(fams, "workbench:kv_pool_ratio", state=st) for st in STATES), 1.0)
    assert value(fams, "workbench:kv_blocks_total") == mem.num_blocks
    assert value(fams, "workbench:kv_blocks_used") + value(fams, "workbench:kv_blocks_free") == mem.num_blocks
    assert value(fams, "vllm:kv_cache_usage_perc") == last.blocks_used / last.num_blocks
    assert value(fams, "workbench:kv_bytes_per_token") == mem.kv_bytes_per_token
    assert value(fams, "workbench:kv_pool_bytes") == mem.kv_pool_bytes
    assert value(fams, "workbench:comm_buffer_bytes") == mem.comm_buffer_bytes == 0  # one device
    assert value(fams, "vllm:num_requests_running") == 0 and value(fams, "vllm:num_requests_waiting") == 0


# ---------------------------------------------------------------- synthetic records
def _record(rid: str, reason: str, out: int, timed: bool = True) -> RequestRecord:
    t = (0.0, 0.1, 0.3, 0.3 + 0.05 * max(out - 1, 0)) if timed else (0.0, None, None, 0.0)
    arrival, sched, first, finish = t
    return RequestRecord(
        request_id=rid,
        prompt_tokens=5,
        output_tokens=out,
        finish_reason=reason,
        error="refused" if reason == "error" else None,
        arrival_time_s=arrival,
        first_scheduled_time_s=sched,
        first_token_time_s=first,
        finish_time_s=finish,
        ttft_s=first,
        tpot_s=0.05 if out > 1 else None,
        e2e_s=finish if timed else None,
        queue_time_s=sched,
        itl_s=[0.05] * max(out - 1, 0),
    )


def _step(**kw) -> StepStats:
    base = dict(
        step=0,
        time_s=0.0,
        wall_time_s=0.01,
        schedule_time_s=0.001,
        model_time_s=0.008,
        sample_time_s=0.001,
        num_prefill_tokens=30,
        num_decode_tokens=2,
        num_prefill_reqs=1,
        num_decode_reqs=2,
        num_running=3,
        num_waiting=1,
        num_preemptions=0,
        num_finished=0,
        num_blocks=10,
        blocks_used=4,
        blocks_free=6,
        block_size=16,
        kv_bytes_per_token=64,
        token_states=40,
        reservation=10,
        internal_fragmentation=14,
        external_fragmentation=0,
        free=96,
        kv_utilization=0.25,
        fragmentation_rate=24 / 64,
    )
    return StepStats(**{**base, **kw})


def test_swap_abort_refusal_and_parallel_sampling_agree_with_the_records(tiny_model):
    import random
    from collections import Counter

    from workbench import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=96,
        num_gpu_blocks_override=30,
        preemption_mode="swap",
        swap_space=0.001,
    )
    eng = llm.llm_engine
    sink = PrometheusSink("tiny")
    sink.attach(eng)
    eng.recorder.add_sink(sink)
    rng = random.Random(5)
    ps = [[rng.randrange(2, 250) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, SamplingParams(max_tokens=40, ignore_eos=True))
    eng.add_request("par", ps[0], SamplingParams(n=3, temperature=1.0, max_tokens=40, ignore_eos=True))
    eng.add_request("long", [7] * 200, SamplingParams(max_tokens=4))  # refused: over max_model_len
    aborted = False
    for _ in range(400):
        if not eng.has_unfinished_requests():
            break
        if eng.scheduler.swapped and not aborted:
            aborted = True
            eng.abort(eng.scheduler.swapped[0].parent_id)
        eng.step()
    assert aborted and not eng.has_unfinished_requests()
    recs, steps = eng.recorder.requests, eng.recorder.steps
    fams = families(sink)
    reasons = Counter(r.finish_reason for r in recs)
    assert reasons["abort"] >= 1 and reasons["error"] == 1
    for reason in FINISH_REASONS:
        assert value(fams, "vllm:request_success", "_total", finished_reason=reason) == reasons[reason]
    assert value(fams, "vllm:request_success", "_total") == len(recs) == 6 + 3 + 1
    assert value(fams, "vllm:generation_tokens", "_total") == sum(r.output_tokens for r in recs)
    assert value(fams, "vllm:prompt_tokens", "_total") == sum(r.prompt_tokens for r in recs)
    assert value(fams, "vllm:num_preemptions", "_total") == sum(s.num_preemptions for s in steps) > 0
    block_bytes = eng.memory.block_bytes
    out_blocks = sum(s.swap_out_blocks for s in steps)
    assert out_blocks > 0
    assert value(fams, "workbench:kv_swap_bytes", "_total", direction="out") == out_blocks * block_bytes
    assert (
        value(fams, "workbench:kv_swap_bytes", "_total", direction="in")
        == sum(s.swap_in_blocks for s in steps) * block_bytes
    )
    check_hist(fams, "vllm:e2e_request_latency_seconds", [r.e2e_s for r in recs if r.e2e_s is not None])
    check_hist(fams, "vllm:time_to_first_token_seconds", [r.ttft_s for r in recs if r.ttft_s is not None])
    check_hist(fams, "vllm:request_time_per_output_token_seconds", [r.tpot_s for r in recs if r.tpot_s is not None])
    check_hist(fams, "vllm:inter_token_latency_seconds", [x for r in recs for x in r.itl_s])
    check_hist(fams, "vllm:request_generation_tokens", [r.output_tokens for r in recs])
    assert hist(fams, "vllm:request_params_max_tokens")[0] == len(recs)
    assert value(fams, "workbench:num_requests_swapped") == 0
    pool = sum(value(fams, "workbench:kv_pool_tokens", state=st) for st in STATES)
    assert pool == 30 * 4 == value(fams, "workbench:kv_blocks_total") * value(fams, "workbench:kv_block_size_tokens")
