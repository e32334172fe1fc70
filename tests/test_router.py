"""Replicas of ``workbench serve`` behind vLLM's real router (``vllm-router``), on loopback: what the router asks
of a worker (health, tokenize, completions) workbench answers; ``round_robin`` splits requests evenly; with
``kv_aware`` the router reads the replicas' KV-cache events (vLLM's format) and finds prefixes in them.
Every process is stopped by its PID at the end, also when a test fails."""

from __future__ import annotations

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


def complete(base_url: str, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0}
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
