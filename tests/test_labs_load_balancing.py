"""Chapter 11's library (workbench.labs.ch11_load_balancing): its workloads, the figures it derives from a
``bench serve`` result, and the simulator's layouts — without servers (the chapter itself runs real replicas in
the chapter review)."""

from __future__ import annotations

import pytest

from workbench.labs import ch11_load_balancing as lb


def test_workloads_are_seeded_and_have_their_shape():
    a = lb.make_workload("multi-tenant", 12, seed=3)
    assert [s.prompt for s in a] == [s.prompt for s in lb.make_workload("multi-tenant", 12, seed=3)]
    assert [s.prompt for s in a] != [s.prompt for s in lb.make_workload("multi-tenant", 12, seed=4)]
    assert all(s.prompt_len > 150 and s.expected_output_len == 16 for s in a)
    assert lb.shared_prefix_share(a) > 0.5  # four tenants' system prompts repeat
    skewed = lb.make_workload("skewed", 10, seed=0)
    long = [s for s in skewed if s.prompt_len > 300]
    assert len(long) == 2 and all(s.expected_output_len == 48 for s in long)
    assert lb.shared_prefix_share(skewed) < 0.05
    turns = lb.make_workload("multi-turn", 8, seed=0)
    by_session = {}
    for s in turns:  # every turn extends an earlier turn of its session (its own prompt is a prefix of the next)
        prev = [p for p in by_session.get(s.prompt[:80], [])]
        assert all(s.prompt.startswith(p) for p in prev)
        by_session.setdefault(s.prompt[:80], []).append(s.prompt)
    assert len(by_session) == 2 and sorted(map(len, by_session.values())) == [4, 4]


def test_a_bad_workload_or_policy_is_refused():
    with pytest.raises(ValueError, match="'chat' is not one of multi-tenant"):
        lb.make_workload("chat")
    with pytest.raises(ValueError, match="num_requests=2"):
        lb.make_workload("skewed", 2)
    with pytest.raises(ValueError, match="'fastest' is not one of the chapter's"):
        lb.run_policy(None, "fastest", [], 1.0)


def _result(split, hits, queries, ttfts):
    reps = [
        {"requests": n, "prefix_cache_hits": h, "prefix_cache_queries": q, "prefill_tokens_computed": q - h,
         "preemptions": 0.0, "max_kv_cache_usage": 0.1 * n}
        for n, h, q in zip(split, hits, queries)
    ]  # fmt: skip
    n = len(ttfts)
    return {"replicas": reps, "completed": n, "failed": 0, "request_throughput": n / 10.0, "output_throughput": 0.0,
            "ttfts": ttfts, "latencies": [t + 1.0 for t in ttfts], "output_lens": [11] * n, "duration": 10.0,
            "kv_imbalance_mean": 1.2, "kv_imbalance_max": 2.0}  # fmt: skip


def test_summarize_and_goodput_from_a_result():
    row = lb.summarize(_result([3, 1], [30, 0], [100, 50], [0.1, 0.2, 0.3, 0.9]), "cache_aware", "multi-tenant")
    assert row["hit_rate"] == pytest.approx(30 / 150)
    assert row["prefill_computed"] == 120 and row["split"] == [3, 1]
    assert row["ttft_p50"] == pytest.approx(250.0)
    assert row["tpots"] == [pytest.approx(0.1)] * 4  # (E2EL - TTFT) / (11 - 1)
    slo = lb.slo_from(row)  # twice the median TTFT, rounded up to 10 ms
    assert slo["ttft_s"] == pytest.approx(0.5)
    lb.apply_slo([row], slo)
    assert row["goodput"] == pytest.approx(3 / 10.0)  # 0.9 s misses the TTFT target


def test_best_policy_keeps_ties():
    rows = [{"policy": "a", "x": 0.7}, {"policy": "b", "x": 0.705}, {"policy": "c", "x": 0.5}]
    assert lb.best_policy(rows, "x") == ["a", "b"]
    assert lb.best_policy(rows, "x", lowest=True) == ["c"]


def test_gpu_layouts_in_the_simulator():
    """One model, two layouts of 8 GPUs, a short trace: TP 8 keeps a quarter of the weights per rank that two
    replicas of TP 4 keep half of, so it has more KV pool per rank; prefix affinity computes fewer prefill tokens
    than round robin on the same trace."""
    small = (("llama-2-70b", 4.0, 3.0, ((1, 8, "round_robin"), (2, 4, "round_robin"), (2, 4, "cache_aware"))),)
    tp8, rr, ca = lb.gpu_layouts(layouts=small)
    assert tp8["weights_gib"] == pytest.approx(rr["weights_gib"] / 2, rel=0.01)
    assert tp8["kv_gib"] > rr["kv_gib"]
    assert tp8["requests"] == rr["requests"] == ca["requests"] == sum(rr["split"])
    assert ca["prefill_computed"] < rr["prefill_computed"]
    assert "2 × TP4" in str(lb.layout_table([tp8, rr, ca]))
