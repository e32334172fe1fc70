"""Data parallelism in the simulator (workbench/sim/cluster.py): replicas behind a modelled router."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from workbench.catalog import MODELS
from workbench.cli.main import main
from workbench.config import EngineConfig
from workbench.sim import SimEngine, SimSpec, make_trace
from workbench.sim.cluster import ROUTING_POLICIES, kv_imbalance, simulate_cluster
from workbench.sim.hardware import HARDWARE
from workbench.sim.run import simulate_job
from workbench.sim.trace import TraceRequest, make_tenant_trace, zipf_weights

L7 = SimSpec(MODELS["llama-2-7b"], HARDWARE["A100-80GB"], 1)


def _run(trace, dp=2, policy="round_robin", **kw):
    return simulate_cluster(L7, trace, data_parallel_size=dp, routing_policy=policy, output_dir=None, **kw)


def test_round_robin_splits_requests_evenly():
    trace = [TraceRequest(0.1 * i, 20, 4) for i in range(12)]
    res = _run(trace, dp=3)
    assert res.routed == [0, 1, 2] * 4
    assert [r["requests_routed"] for r in res.summary["replicas"]] == [4, 4, 4]
    assert [r["requests_total"] for r in res.summary["replicas"]] == [4, 4, 4]
    assert res.summary["requests_finished"] == 12


def test_least_loaded_sends_to_the_idle_replica():
    # two long requests keep replicas 0 and 1 busy; replica 2 is idle when the third arrives
    trace = [TraceRequest(0.0, 50, 400, eos=False), TraceRequest(0.0, 50, 400, eos=False), TraceRequest(0.5, 50, 4)]
    res = _run(trace, dp=3, policy="least_loaded")
    assert res.routed == [0, 1, 2]
    busy_first = [TraceRequest(0.0, 50, 400, eos=False), TraceRequest(0.5, 50, 4), TraceRequest(0.6, 50, 4)]
    assert _run(busy_first, dp=2, policy="least_loaded").routed == [0, 1, 1]


def test_a_replica_whose_clock_is_past_the_arrival_admits_it_with_its_arrival_time():
    # one replica: the long prefill's step is in flight past 0.001 s when the second request arrives
    trace = [TraceRequest(0.0, 3000, 2, eos=False), TraceRequest(0.001, 10, 2, eos=False)]
    res = _run(trace, dp=1)
    recs = {r.request_id: r for r in res.replicas[0].engine.recorder.requests}
    assert recs["sim-1"].arrival_time_s == pytest.approx(0.001)
    assert recs["sim-1"].first_scheduled_time_s > 0.001


def test_cache_aware_beats_round_robin_on_a_multi_tenant_trace():
    trace = make_tenant_trace(6, 8, "sharegpt", seed=5, num_tenants=6, zipf_s=1.0, system_prompt_len=512)
    kw = dict(dp=4, enable_prefix_caching=True, record_itl=False, seed=5)
    rr = _run(trace, policy="round_robin", **kw).summary
    ca = _run(trace, policy="cache_aware", **kw).summary
    assert rr["requests_finished"] == ca["requests_finished"] == len(trace)
    hit = {k: s["prefix_cache_hits_total"] / s["prefix_cache_queries_total"] for k, s in (("rr", rr), ("ca", ca))}
    assert hit["ca"] > hit["rr"]
    assert ca["prefill_tokens_computed"] < rr["prefill_tokens_computed"]


def test_tenant_trace_shares_a_prefix_per_tenant_and_is_seeded():
    a = make_tenant_trace(5, 10, seed=1, num_tenants=4, zipf_s=1.2, system_prompt_len=64)
    assert a == make_tenant_trace(5, 10, seed=1, num_tenants=4, zipf_s=1.2, system_prompt_len=64)
    base = make_trace(5, 10, seed=1)
    assert [r.prompt_len for r in a] == [b.prompt_len + 64 for b in base]
    assert {r.prefix_id for r in a} <= {0, 1, 2, 3} and all(r.prefix_len == 64 for r in a)
    w = zipf_weights(4, 1.0)
    assert w[0] > w[1] > w[2] > w[3] and w.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="num_tenants=0"):
        make_tenant_trace(5, 10, num_tenants=0)
    # the engine: same prefix id -> the same first tokens; the rest its own
    eng = SimEngine(EngineConfig(), L7)
    for i, pid in enumerate((3, 3, 4)):
        eng.add_request_lengths(f"r{i}", 40, 2, prefix_id=pid, prefix_len=32)
    eng.add_request_lengths("plain", 40, 2)
    ids = {k: r.prompt_token_ids for k, r in eng.requests.items()}
    assert ids["r0"][:32] == ids["r1"][:32] != ids["r2"][:32]
    assert ids["r0"][32:] != ids["r1"][32:] and len(ids["r0"]) == 40
    assert ids["plain"][0] != ids["r0"][0]


def test_kv_imbalance_is_one_for_one_replica_and_at_least_one_always():
    trace = make_trace(8, 4, seed=2)
    one = _run(trace, dp=1, record_itl=False).summary["imbalance"]
    assert all(p["ratio"] == 1.0 for p in one["series"]) and one["ratio_max"] == 1.0
    for policy in ROUTING_POLICIES:
        imb = _run(trace, dp=3, policy=policy, record_itl=False).summary["imbalance"]
        assert all(p["ratio"] >= 1.0 - 1e-12 for p in imb["series"]) and imb["ratio_mean"] >= 1.0
    # by hand: replica 0 at half its pool from t=1, replica 1 empty: max/mean = 0.5/0.25 = 2; before t=1 both 0 -> 1
    steps0 = [{"time_s": 0.5, "wall_time_s": 0.5, "blocks_used": 5, "num_blocks": 10}]
    imb = kv_imbalance([steps0, []], 2.0, grid_s=0.5)
    assert [p["ratio"] for p in imb["series"]] == [1.0, 1.0, 2.0, 2.0, 2.0]
    assert imb["ratio_max"] == 2.0 and imb["ratio_mean"] == pytest.approx(8 / 5)


def test_per_rank_memory_of_70b_tp4_and_tp8_layouts():
    h100 = HARDWARE["H100-80GB"]
    mem = {}
    for tp in (4, 8):
        spec = SimSpec(MODELS["llama-2-70b"], h100, tp)
        res = simulate_cluster(spec, [TraceRequest(0.0, 16, 2)], data_parallel_size=8 // tp, output_dir=None)
        mem[tp] = res.summary["replicas"][0]["per_rank_memory"]
    assert mem[8]["weights_bytes"] * 2 == pytest.approx(mem[4]["weights_bytes"], rel=1e-3)
    assert mem[8]["kv_cache_bytes"] > mem[4]["kv_cache_bytes"]  # weights leave more of each GPU to the KV pool
    assert mem[4]["nccl_buffer_bytes"] > 0 and mem[8]["nccl_buffer_bytes"] > 0


def test_bad_policy_and_replica_count_are_refused_naming_the_value(tmp_path):
    trace = [TraceRequest(0.0, 16, 2)]
    with pytest.raises(ValueError, match="routing_policy='fastest'.*round_robin.*cache_aware"):
        simulate_cluster(L7, trace, routing_policy="fastest", output_dir=tmp_path / "a")
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        simulate_cluster(L7, trace, data_parallel_size=0, output_dir=tmp_path / "a")
    assert not (tmp_path / "a").exists()
    base = ["simulate", "--model", "llama-2-7b", "--gpu", "L4", "-tp", "1", "--no-progress", "--output-dir",
            str(tmp_path / "b"), "--duration", "1"]  # fmt: skip
    r = CliRunner().invoke(main, [*base, "-dp", "2", "--routing-policy", "fastest"])
    assert r.exit_code != 0 and "fastest" in r.output and "cache_aware" in r.output
    r = CliRunner().invoke(main, [*base, "-dp", "0"])
    assert r.exit_code != 0 and "data_parallel_size=0" in r.output
    assert not (tmp_path / "b").exists()


def test_one_replica_through_the_cluster_gives_simulate_jobs_figures():
    trace = make_tenant_trace(6, 5, seed=7, num_tenants=3, system_prompt_len=128)
    kw = dict(output_dir=None, enable_prefix_caching=True, max_num_seqs=16)
    job = simulate_job(L7, trace, **kw).summary
    cl = simulate_cluster(L7, trace, data_parallel_size=1, routing_policy="cache_aware", **kw).summary
    rep = cl["replicas"][0]
    for k, v in job.items():
        if k != "replay_wall_s":
            assert rep[k] == v, k
    for k in ("requests_finished", "request_throughput_req_s", "output_throughput_tok_s", "ttft_p50_s", "ttft_p99_s"):
        assert cl[k] == pytest.approx(job[k]), k


def test_goodput_counts_requests_within_both_objectives():
    trace = make_trace(10, 4, seed=3)
    res = _run(trace, dp=2, ttft_slo_s=1e9, tpot_slo_s=1e9).summary
    assert res["request_goodput_req_s"] == pytest.approx(res["request_throughput_req_s"])
    assert _run(trace, dp=2, ttft_slo_s=0.0, tpot_slo_s=1e9).summary["request_goodput_req_s"] == 0.0
    assert _run(trace, dp=2).summary["request_goodput_req_s"] is None


def test_cli_dp2_writes_the_cluster_and_replica_folders(tmp_path):
    r = CliRunner().invoke(
        main,
        ["simulate", "--model", "llama-2-7b", "--gpu", "L4", "-tp", "1", "-dp", "2", "--routing-policy",
         "cache_aware", "--tenants", "3", "--tenant-zipf", "1.1", "--system-prompt-len", "64",
         "--enable-prefix-caching", "--request-rate", "3", "--duration", "3", "--seed", "4", "--output-dir",
         str(tmp_path), "--run-name", "x", "--no-progress", "--goodput", "ttft:500", "tpot:50"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "GPUs in all: 2 replicas x 1" in r.output
    d = tmp_path / "x"
    summary = json.loads((d / "summary.json").read_text())
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["data_parallel_size"] == 2 and cfg["num_gpus_total"] == 2 and cfg["routing_policy"] == "cache_aware"
    assert len(summary["replicas"]) == 2 and summary["imbalance"]["series"]
    assert summary["request_goodput_req_s"] is not None
    assert summary["goodput_slo_s"] == {"ttft": 0.5, "tpot": 0.05}  # bench serve's form: --goodput ttft:500 tpot:50
    assert (d / "timeline.json").is_file()
    for i in (0, 1):
        for f in ("steps.jsonl", "requests.jsonl", "summary.json", "config.json", "report.html", "timeline.json"):
            assert (d / f"replica-{i}" / f).is_file(), (i, f)
    n = sum(len((d / f"replica-{i}" / "requests.jsonl").read_text().splitlines()) for i in (0, 1))
    assert n == summary["requests_total"] == cfg["trace"]["num_requests"]
