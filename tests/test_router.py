"""Replicas of ``workbench serve`` behind vLLM's real router (``vllm-router``), on loopback: what the router asks
of a worker (health, tokenize, completions) workbench answers; ``round_robin`` splits requests evenly; with
``kv_aware`` the router reads the replicas' KV-cache events (vLLM's format) and finds prefixes in them.
Every process is stopped by its PID at the end, also when a test fails."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workbench.server.replicas import Replicas, RouterProcess, router_binary

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODEL = "smollm2-135m"
#: three tenants' system prompts, long enough for several 16-token blocks each
TENANTS = [f"You are the assistant of tenant {name}. " * 12 for name in ("Acme", "Globex", "Initech")]


@pytest.fixture(scope="module")
def replicas():
    try:
        router_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    with Replicas(2, policy="kv_aware", max_model_len=512, max_num_seqs=4) as rs:
        yield rs


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url, timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def complete(base_url: str, prompt: str, max_tokens: int = 3) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def successes(replicas: Replicas) -> list[float]:
    return [metric(u + "/metrics", "vllm:request_success_total") for u in replicas.urls]


def test_kv_aware_finds_prefixes_in_the_replicas_events(replicas):
    """The router subscribes to both replicas' events; once a tenant's prompt has run, the router's index
    finds its blocks (a placement hit) for the tenant's next request. Requests go one at a time until the
    first hit, at most 20: the events of a request reach the router while its decode steps still run."""
    before = sum(successes(replicas))
    for i in range(3):
        complete(replicas.base_url, TENANTS[i] + f"Question {i}.")
    hits = 0.0
    for i in range(20):
        complete(replicas.base_url, TENANTS[0] + f"Follow-up {i}.")
        hits = metric(replicas.router.metrics_url, "vllm_router_kv_placement_lookups_total", result="hit")
        if hits:
            break
    assert hits >= 1, replicas.router.log_tail()
    assert "decode" not in replicas.router.log_path.read_text(), "the router could not decode our events"
    assert sum(successes(replicas)) - before == 3 + i + 1  # every request answered by a replica
    # the tenant's follow-up ran where its prefix was: prefix-cache hits on the replicas
    assert sum(metric(u + "/metrics", "vllm:prefix_cache_hits_total") for u in replicas.urls) > 0


def test_round_robin_splits_requests_evenly(replicas):
    with RouterProcess(replicas.urls, "round_robin") as router:
        before = successes(replicas)
        for i in range(6):
            complete(router.base_url, f"Say hello number {i}.")
        after = successes(replicas)
    assert [a - b for a, b in zip(after, before)] == [3, 3]


def test_a_bad_policy_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match="not one of the router's"):
        Replicas(2, policy="fastest")
    with pytest.raises(ValueError, match="needs the replicas' KV-event endpoints"):
        RouterProcess(["http://127.0.0.1:1"], "kv_aware")


def split(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before)]


def prefix_counters(replicas: Replicas) -> list[float]:
    """Prefix-cache hits and queries (tokens) summed over the replicas."""
    return [
        sum(metric(u + "/metrics", name) for u in replicas.urls)
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    ]


#: a multi-tenant trace: which of four tenants sends each request, Zipf-distributed (numpy's zipf(1.5), seed 0)
ZIPF_TENANTS = [2, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 3, 0, 0, 1, 0]


def test_policies_on_a_multi_tenant_trace(replicas):
    """The same multi-tenant trace (four tenants' system prompts, one request at a time) through four policies
    over the same two replicas; each policy's tenants are new to the replicas, so no policy inherits another's
    cache. The prefix-aware policies (``cache_aware``: the router's own prefix tree; ``kv_aware``: the replicas'
    KV events) find a tenant's prompt where it ran, so the replicas hit their prefix caches more often than under
    ``round_robin``, which alternates each tenant between both replicas. Then eight concurrent requests:
    ``round_robin`` and ``power_of_two`` (the less loaded of two) split them four and four."""
    hit_rate, concurrent = {}, {}
    for policy in ("round_robin", "power_of_two", "cache_aware", "kv_aware"):
        tenants = [f"You are the assistant of tenant {n} ({policy}). " * 10 for n in ("Acme", "Globex", "Initech", "Umb")]
        with replicas.router_process(policy) as router:
            hits0, queries0 = prefix_counters(replicas)
            for i, t in enumerate(ZIPF_TENANTS):
                complete(router.base_url, tenants[t] + f"Question {i}?")
            hits, queries = prefix_counters(replicas)
            hit_rate[policy] = (hits - hits0) / (queries - queries0)
            before = successes(replicas)
            barrier = threading.Barrier(8)

            def one(i, url=router.base_url, barrier=barrier, policy=policy):
                barrier.wait()  # all eight in flight together
                complete(url, f"Tell story number {i} ({policy}).", max_tokens=24)

            with ThreadPoolExecutor(8) as pool:
                list(pool.map(one, range(8)))
            concurrent[policy] = split(successes(replicas), before)
    assert hit_rate["cache_aware"] > hit_rate["round_robin"], hit_rate
    assert hit_rate["kv_aware"] > hit_rate["round_robin"], hit_rate
    assert concurrent["round_robin"] == [4, 4], concurrent
    assert concurrent["power_of_two"] == [4, 4], concurrent


def test_bench_serve_through_the_router_reports_each_replica(replicas):
    """``bench serve`` drives the router as it drives one server; given the replicas' URLs, its result has their
    own figures: ``round_robin`` answered four of the eight requests on each."""
    from workbench.bench.serve import run_bench_serve

    with replicas.router_process("round_robin") as router:
        result = run_bench_serve(
            base_url=router.base_url,
            replica_urls=replicas.urls,
            num_prompts=8,
            random_input_len=32,
            random_output_len=8,
            disable_tqdm=True,
            print_result=False,
        )
    assert result["completed"] == 8 and result["failed"] == 0
    assert [r["requests"] for r in result["replicas"]] == [4, 4]
    assert [r["prompt_tokens"] for r in result["replicas"]] == [4 * 32, 4 * 32]
    assert result["kv_imbalance_max"] >= 1.0
    assert len(result["replica_timeline"]) >= 2


def test_a_replica_lost_under_load_loses_no_request():
    """Two replicas behind ``round_robin``; two clients send 12 requests each; after the first two answers one
    replica is SIGKILLed. The router retries every request that failed on the lost replica (refused connections,
    and the one in flight, reset) on the other, so every client gets its answer; its circuit breaker (opened after
    3 failures here; the router's default is 10) then stops sending to the lost replica."""
    try:
        router_binary()
    except RuntimeError as e:
        pytest.skip(str(e))
    codes: list[int] = []
    answered = threading.Semaphore(0)
    with Replicas(2, max_model_len=512, max_num_seqs=4, router_args=["--cb-failure-threshold", "3"]) as rs:

        def client(k):
            for i in range(12):
                body = {"model": MODEL, "prompt": f"Count {k} {i}", "max_tokens": 16, "ignore_eos": True}
                codes.append(httpx.post(rs.base_url + "/v1/completions", json=body, timeout=120).status_code)
                answered.release()

        threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        assert answered.acquire(timeout=300) and answered.acquire(timeout=300), codes
        rs.kill(1)
        for t in threads:
            t.join()
        lost = rs.urls[1]
        retries = metric(rs.router.metrics_url, "vllm_router_retries_total")
        breaker = metric(rs.router.metrics_url, "vllm_router_cb_state", worker=lost)
    assert codes == [200] * 24
    assert retries >= 1
    assert breaker == 1  # open: the router no longer picks the lost replica
