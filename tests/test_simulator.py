"""The simulator (workbench.sim): cost-model sanity, memory budget equal to kv-calc's, the real
scheduler on a simulated clock, determinism, calibration (synthetic recovery and a real replay),
traces, and `workbench simulate` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from workbench.catalog import GPUS, MODELS
from workbench.cli.main import main
from workbench.config import EngineConfig
from workbench.kvcalc import kv_calc
from workbench.sim import CostModel, Efficiency, SimEngine, SimSpec, StepShape, find_hardware, make_trace
from workbench.sim.calibrate import fit_efficiency, load_calibration, replay
from workbench.sim.hardware import HARDWARE, cpu_profile
from workbench.sim.trace import DATASETS, TraceRequest, arrivals, read_lengths

A100 = HARDWARE["A100-80GB"]
L70 = MODELS["llama-2-70b"]


# ----------------------------------------------------------------------------- catalogue


def test_catalogue_has_the_issue_gpus_with_sources():
    for name in ("A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4", "T4", "V100-32GB"):
        h = find_hardware(name)
        assert h.peak_flops > 1e13 and h.hbm_bandwidth > 1e11 and h.memory_bytes >= 16 * 2**30
        assert h.link_bandwidth > 0 and h.link_latency_s > 0 and h.interconnect in ("NVLink", "PCIe")
        assert h.source.startswith("https://")
        if name in GPUS:  # same capacity as kv-calc's catalogue, to the byte
            assert h.memory_bytes == GPUS[name].memory_bytes
    assert find_hardware("h100").name == "H100-80GB"
    with pytest.raises(ValueError, match="not in the simulator's catalogue"):
        find_hardware("A100")


def test_cpu_profile_is_measured_and_cached():
    a, b = cpu_profile(), cpu_profile()
    assert a == b and a.peak_flops > 1e8 and a.hbm_bandwidth > 1e8 and a.interconnect == "none"


# ----------------------------------------------------------------------------- cost model sanity


def _decode_bound():
    return StepShape(decode=[600] * 32, num_sampling=32)


def _prefill_bound():
    return StepShape(prefill=[(0, 4096)], num_sampling=1)


def test_doubling_hbm_bandwidth_speeds_decode_bound_steps_only():
    fast = A100.with_changes(hbm_bandwidth=2 * A100.hbm_bandwidth)
    base, dbl = CostModel(L70, A100, 4), CostModel(L70, fast, 4)
    d0, d1 = base.step(_decode_bound()), dbl.step(_decode_bound())
    assert d0.bound == "memory"
    assert d1.memory_s == pytest.approx(d0.memory_s / 2)
    assert d1.time_s < d0.time_s
    assert d0.time_s - d1.time_s == pytest.approx(d0.memory_s - max(d1.memory_s, d1.compute_s))
    p0, p1 = base.step(_prefill_bound()), dbl.step(_prefill_bound())
    assert p0.bound == "compute" and p1.bound == "compute"
    assert p1.time_s == p0.time_s


def test_tp2_halves_per_gpu_weight_and_kv_bytes_and_adds_allreduce():
    arch = MODELS["llama-2-13b"]  # 40 KV heads: split exactly
    one, two = CostModel(arch, A100, 1), CostModel(arch, A100, 2)
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert two.linear_params * 2 == one.linear_params
    # weights: everything halves but the replicated RMSNorm weights (2 per layer + 1, x hidden)
    norms = (2 * arch.num_hidden_layers + 1) * arch.hidden_size * 2
    assert two.weights_bytes * 2 - one.weights_bytes == norms
    shape = StepShape(decode=[500] * 64, num_sampling=64)
    c1, c2 = one.step(shape), two.step(shape)
    assert c1.comm_s == 0.0
    n, L, h = 2, arch.num_hidden_layers, arch.hidden_size
    msg = 64 * h * 2
    ring = 2 * (n - 1) * A100.link_latency_s + 2 * (n - 1) / n * msg / (A100.link_bandwidth * two.eff.link)
    # 2 all-reduces per layer + the vocab-parallel embedding's, and the logits' all-gather
    gather = (n - 1) * A100.link_latency_s + (n - 1) / n * 64 * arch.vocab_size * 2 / (
        A100.link_bandwidth * two.eff.link
    )
    assert c2.comm_s == pytest.approx((2 * L + 1) * ring + gather)
    assert c2.memory_s < c1.memory_s


def test_cost_model_formulas_by_hand():
    arch = MODELS["smollm2-135m"]
    eff = Efficiency(compute=0.5, memory=0.25, overhead_s=1e-3, per_seq_s=1e-4)
    cm = CostModel(arch, A100, 1, "float16", efficiency=eff)
    shape = StepShape(prefill=[(10, 5)], decode=[7, 9], num_sampling=3)
    c = cm.step(shape)
    pairs = 7 + 9 + 5 * 10 + 5 * 6 // 2
    flops = 2 * 7 * cm.linear_params + 2 * 3 * cm.head_params + 4 * 30 * 9 * 64 * pairs
    assert c.flops == flops
    assert c.bytes == cm.weights_bytes + cm.kv_bytes_per_token * ((7 + 9 + 15) + 7)
    assert c.time_s == pytest.approx(
        1e-3 + 3e-4 + max(flops / (A100.peak_flops * 0.5), c.bytes / (A100.hbm_bandwidth * 0.25))
    )


def test_bad_inputs_name_the_value_and_the_fix():
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        CostModel(L70, A100, 3)
    with pytest.raises(ValueError, match="needs a GPU-to-GPU link"):
        CostModel(MODELS["smollm2-135m"], cpu_profile(), 3)
    with pytest.raises(ValueError, match=r"compute=1.5 must be in \(0, 1\]"):
        Efficiency(compute=1.5)
    with pytest.raises(ValueError, match="request_rate"):
        arrivals(0, 10)
    with pytest.raises(ValueError, match="sharegpt"):
        make_trace(1, 10, dataset="nonsense")


# ----------------------------------------------------------------------------- memory budget


def test_kv_pool_and_concurrency_of_70b_on_4xa100_match_kv_calc_exactly():
    cfg = EngineConfig(gpu_memory_utilization=0.9, max_num_seqs=256)
    eng = SimEngine(cfg, SimSpec(L70, A100, 4))
    m = eng.memory
    assert m.comm_buffer_bytes > 0 and m.activation_bytes > 0
    ref = kv_calc(
        "llama-2-70b",
        tensor_parallel_size=4,
        gpu="A100-80GB",
        gpu_memory_utilization=0.9,
        activation_reserve=m.activation_bytes + m.comm_buffer_bytes,
        seq_len=eng.max_model_len,
    )
    assert m.weights_bytes == ref.weights_bytes_per_gpu
    assert m.kv_bytes_per_token == ref.kv_bytes_per_token
    assert m.num_blocks == ref.num_blocks and m.kv_pool_tokens == ref.kv_tokens
    assert m.max_concurrency == ref.max_concurrency
    # no reserve at all: kv-calc's default table row (README) exactly
    eng0 = SimEngine(cfg, SimSpec(L70, A100, 4, activation_bytes=0, nccl_nchannels=None))
    eng0_budget = eng0.memory.kv_budget_bytes + eng0.memory.comm_buffer_bytes
    ref0 = kv_calc("llama-2-70b", tensor_parallel_size=4, gpu="A100-80GB", gpu_memory_utilization=0.9)
    assert eng0_budget == ref0.kv_budget_bytes


def test_engine_arguments_change_the_simulated_outcome():
    small = SimSpec(MODELS["llama-2-7b"], HARDWARE["L4"], 1)
    trace = make_trace(4, 20, "sharegpt", seed=3)

    def run(**kw):
        eng = SimEngine(EngineConfig(**kw), small)
        eng.add_trace(trace)
        eng.run()
        return eng

    a = run(gpu_memory_utilization=0.9, max_num_seqs=64)
    b = run(gpu_memory_utilization=0.8, max_num_seqs=64)
    c = run(gpu_memory_utilization=0.9, max_num_seqs=4)
    assert b.memory.num_blocks < a.memory.num_blocks
    assert max(s.num_running for s in c.recorder.steps) <= 4 < max(s.num_running for s in a.recorder.steps)
    ttft = {k: np.median([r.ttft_s for r in e.recorder.requests]) for k, e in (("a", a), ("c", c))}
    assert ttft["c"] > ttft["a"]  # fewer seats: requests queue


def test_preemption_happens_when_the_pool_is_small_and_every_request_still_finishes():
    eng = SimEngine(EngineConfig(num_gpu_blocks_override=300, max_num_seqs=64), SimSpec(MODELS["llama-2-7b"], A100, 1))
    trace = make_trace(20, 10, "sharegpt", seed=1)
    eng.add_trace([t for t in trace if t.prompt_len + t.output_len < 4000])
    eng.run()
    assert sum(s.num_preemptions for s in eng.recorder.steps) > 0
    assert all(r.finish_reason in ("stop", "length") for r in eng.recorder.requests)
    eng.kv.check_invariants()


# ----------------------------------------------------------------------------- simulated clock


def test_latencies_come_from_simulated_step_durations():
    eng = SimEngine(EngineConfig(), SimSpec(MODELS["llama-2-7b"], A100, 1))
    eng.add_trace([TraceRequest(5.0, 100, 4, eos=False)])
    eng.run()
    steps, (r,) = eng.recorder.steps, eng.recorder.requests
    assert len(steps) == 4 and steps[0].time_s == 5.0  # the idle clock jumped to the arrival
    assert r.ttft_s == pytest.approx(steps[0].wall_time_s)
    assert r.e2e_s == pytest.approx(sum(s.wall_time_s for s in steps))
    assert r.itl_s == pytest.approx([s.wall_time_s for s in steps[1:]])
    assert r.finish_reason == "length" and r.output_tokens == 4


def test_eos_ends_a_request_at_the_trace_length():
    eng = SimEngine(EngineConfig(), SimSpec(MODELS["llama-2-7b"], A100, 1))
    eng.add_trace([TraceRequest(0.0, 10, 3, eos=True), TraceRequest(0.0, 10, 5, eos=False)])
    eng.run()
    got = {r.output_tokens: r.finish_reason for r in eng.recorder.requests}
    assert got == {3: "stop", 5: "length"}


def test_same_seed_same_run_token_for_token():
    spec = SimSpec(MODELS["llama-2-13b"], HARDWARE["H100-80GB"], 2)

    def run(seed):
        eng = SimEngine(EngineConfig(max_num_seqs=32), spec)
        eng.add_trace(make_trace(8, 15, "alpaca", seed=seed))
        eng.run()
        return [s.to_dict() for s in eng.recorder.steps], [r.to_dict() for r in eng.recorder.requests]

    assert run(7) == run(7)
    assert run(7) != run(8)


# ----------------------------------------------------------------------------- traces


def test_trace_lengths_have_the_vllm_papers_means():
    for name, (mp, mo, _, _) in DATASETS.items():
        tr = make_trace(1000, 100, name, seed=0)  # 100,000 requests
        assert abs(len(tr) - 100_000) < 2_000
        assert np.mean([t.prompt_len for t in tr]) == pytest.approx(mp, rel=0.03)
        assert np.mean([t.output_len for t in tr]) == pytest.approx(mo, rel=0.03)
    const = make_trace(4, 2, "alpaca", arrival="constant")
    assert [t.arrival_s for t in const] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]


def test_trace_file_lengths_and_eos(tmp_path):
    f = tmp_path / "requests.jsonl"
    rows = [
        {"prompt_tokens": 12, "output_tokens": 30, "finish_reason": "stop"},
        {"prompt_tokens": 40, "output_tokens": 8, "finish_reason": "length"},
        {"prompt_tokens": 9000, "output_tokens": 0, "finish_reason": "error", "error": "too long"},
    ]
    f.write_text("\n".join(json.dumps(r) for r in rows))
    assert read_lengths(f) == [(12, 30, True), (40, 8, False)]
    tr = make_trace(5, 10, str(f), seed=2)
    assert {(t.prompt_len, t.output_len, t.eos) for t in tr} <= {(12, 30, True), (40, 8, False)}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "hi"}))
    with pytest.raises(ValueError, match="lacks a prompt length"):
        read_lengths(bad)


# ----------------------------------------------------------------------------- calibration


def test_fit_recovers_known_parameters_from_synthetic_steps():
    rng = np.random.default_rng(0)
    n = 400
    seqs = rng.integers(1, 64, n).astype(float)
    flops = rng.uniform(1e9, 4e11, n)
    nbytes = rng.uniform(5e8, 7e8, n) + seqs * 1e6
    o, p, a, b = 4e-3, 2e-4, 1 / 5e10, 1 / 8e9
    t = o + p * seqs + np.maximum(a * flops, b * nbytes)
    fit = fit_efficiency(flops, nbytes, seqs, t)
    assert 0 < fit.compute_bound_steps < n  # both sides of the roofline are present
    for got, want in ((fit.overhead_s, o), (fit.per_seq_s, p), (fit.s_per_flop, a), (fit.s_per_byte, b)):
        assert got == pytest.approx(want, rel=1e-6)
    noisy = t * rng.normal(1, 0.02, n)
    fit2 = fit_efficiency(flops, nbytes, seqs, noisy)
    assert fit2.s_per_flop == pytest.approx(a, rel=0.05) and fit2.s_per_byte == pytest.approx(b, rel=0.05)
    with pytest.raises(ValueError, match="too few"):
        fit_efficiency([1.0], [1.0], [1.0], [1.0])


@pytest.fixture(scope="module")
def tiny_real_run(tmp_path_factory):
    """A real run of the bundled model on CPU: 4 prompts, 6 tokens, 2 at a time (a few seconds)."""
    from workbench.bench.run import run_job

    out = tmp_path_factory.mktemp("real-runs")
    res = run_job(num_prompts=4, max_tokens=6, max_num_seqs=2, output_dir=out, progress=False, run_name="tiny")
    return res.run_dir


@pytest.mark.slow
def test_replay_of_a_real_run_schedules_the_same_steps(tiny_real_run):
    res = replay(tiny_real_run, cpu_profile(), Efficiency())
    real = [json.loads(x) for x in (tiny_real_run / "steps.jsonl").read_text().splitlines()]
    assert res.num_steps == len(real) > 4
    assert res.matched == res.num_steps
    assert np.all(res.flops > 0) and np.all(res.bytes > 0)


def test_calibrate_cli_end_to_end(tiny_real_run, tmp_path):
    out = tmp_path / "cal.json"
    r = CliRunner().invoke(
        main,
        ["simulate", "--calibrate", "--gpu", "cpu", "--train", str(tiny_real_run), "--test", str(tiny_real_run),
         "--calibration-out", str(out)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    held = json.loads(r.output.strip().splitlines()[-1])["held_out_median_abs_step_error"]
    assert 0 <= held < 1
    hw, eff = load_calibration(out)
    assert hw.name == "cpu" and 0 < eff.compute <= 1 and 0 < eff.memory <= 1
    d = json.loads(out.read_text())
    assert d["test"][0]["steps"] == d["test"][0]["steps_matched"]
    assert math.isfinite(d["test"][0]["throughput_error"])


# ----------------------------------------------------------------------------- CLI


def test_simulate_cli_writes_the_run_folder(tmp_path):
    r = CliRunner().invoke(
        main,
        ["simulate", "--model", "llama-2-7b", "--gpu", "L4", "-tp", "1", "--request-rate", "2", "--duration", "5",
         "--seed", "4", "--output-dir", str(tmp_path), "--run-name", "x", "--no-progress", "--window", "2"],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    d = tmp_path / "x"
    for f in ("steps.jsonl", "requests.jsonl", "summary.json", "config.json", "report.html", "timeline.json"):
        assert (d / f).is_file(), f
    steps = [json.loads(x) for x in (d / "steps.jsonl").read_text().splitlines()]
    reqs = [json.loads(x) for x in (d / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == len(make_trace(2, 5, "sharegpt", seed=4))
    times = [s["time_s"] for s in steps]
    assert times == sorted(times)
    summary = json.loads((d / "summary.json").read_text())
    assert summary["simulated_duration_s"] == pytest.approx(times[-1] + steps[-1]["wall_time_s"])
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["simulated"] and cfg["hardware"]["name"] == "L4" and cfg["trace"]["seed"] == 4
    tl = json.loads((d / "timeline.json").read_text())
    assert sum(w["arrived"] for w in tl) == len(reqs)
    refused = tmp_path / "refused"
    bad = CliRunner().invoke(
        main, ["simulate", "--model", "llama-2-70b", "-tp", "3", "--no-progress", "--output-dir", str(refused)]
    )
    assert bad.exit_code != 0 and "tensor_parallel_size=3" in bad.output
    assert not refused.exists()  # refused before it ran: no run folder, not even its parent


def test_timeline_divides_each_window_by_the_time_it_covers():
    from workbench.sim.run import timeline

    reqs = [
        {
            "arrival_time_s": 0.0,
            "finish_time_s": 10.0,
            "ttft_s": 0.5,
            "queue_time_s": 0.1,
            "num_preemptions": 0,
            "output_tokens": 100,
        },
        {
            "arrival_time_s": 70.0,
            "finish_time_s": 90.0,
            "ttft_s": 0.5,
            "queue_time_s": 0.1,
            "num_preemptions": 0,
            "output_tokens": 50,
        },
    ]
    rows = timeline(reqs, window_s=60.0, end_s=90.0)
    assert [r["t_end_s"] for r in rows] == [60.0, 90.0]
    assert rows[0]["output_tok_s"] == 100 / 60 and rows[1]["output_tok_s"] == 50 / 30  # the last window is 30 s long
    assert rows[1]["finished_req_s"] == 1 / 30


def test_simulated_collectives_are_counted_as_the_real_engine_counts_them():
    """The real engine's tensor-parallel forward (workbench.model.parallel, as vLLM's) all-reduces the
    hidden state after the vocab-parallel embedding and twice per layer, and all-gathers the
    sampling rows' logits: the simulated step records count the same collectives and bytes."""
    eng = SimEngine(EngineConfig(max_num_seqs=8), SimSpec(L70, A100, 4))
    eng.add_trace([TraceRequest(0.0, 40, 5, eos=False), TraceRequest(0.0, 300, 3, eos=False)])
    eng.run()
    L, h, V = L70.num_hidden_layers, L70.hidden_size, L70.vocab_size
    for st in eng.recorder.steps:
        tokens = st.num_prefill_tokens + st.num_decode_tokens
        sampling = st.num_decode_reqs + st.num_prefill_reqs  # each prompt here fits one step, so samples
        assert st.allreduce_bytes == (2 * L + 1) * tokens * h * 2
        assert st.allgather_bytes == sampling * (-(-V // 4) * 4) * 2
        assert st.num_collectives == 2 * L + 1 + 1
        assert st.comm_time_s > 0


def test_step_records_keep_only_the_steps_settling_can_still_correct():
    """The engine keeps, per request holding blocks, the steps whose reservation may still turn into
    internal fragmentation (where it held more slots than it has written since): about one block's
    worth with paged allocation, not every step of a long request."""
    eng = SimEngine(EngineConfig(max_num_seqs=4, block_size=16), SimSpec(L70, A100, 4))
    eng.add_trace([TraceRequest(0.0, 30, 300, eos=False), TraceRequest(0.0, 50, 200, eos=True)])
    longest = 0
    while eng.has_unfinished_requests():
        eng.step()
        longest = max([longest] + [len(e[2]) for e in eng.accounting.holding.values()])
    assert 0 < longest <= 16 + 1
    steps = eng.recorder.steps
    assert len(steps) >= 300
    # and the settled split still adds up to the pool in every step
    for st in steps:
        assert st.token_states + st.reservation + st.internal_fragmentation + st.external_fragmentation + st.free == (
            st.num_blocks * st.block_size
        )


@pytest.mark.slow
def test_simulate_cli_takes_sizes_names_conflicting_channel_flags_and_refused_requests(tmp_path):
    base = ["simulate", "--model", "llama-2-70b", "--gpu", "A100-80GB", "-tp", "4", "--no-progress",
            "--output-dir", str(tmp_path)]  # fmt: skip
    r = CliRunner().invoke(main, [*base, "--duration", "2", "--nccl-buffsize", "1MiB", "--run-name", "a"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    from workbench.comm import nccl_buffer_bytes

    assert cfg["nccl_buffsize"] == 1 << 20
    assert cfg["memory"]["comm_buffer_bytes"] == nccl_buffer_bytes(4, buffsize=1 << 20).per_rank_bytes
    r = CliRunner().invoke(main, [*base, "--duration", "2", "--nccl-nchannels", "4", "--nccl-max-nchannels", "16"])
    assert r.exit_code != 0 and "give one or the other" in r.output
    # a prompt longer than max_model_len is refused with its reason; the others run
    r = CliRunner().invoke(main, [*base, "--duration", "20", "--max-model-len", "256", "--run-name", "b"])
    assert r.exit_code == 0, r.output
    reqs = [json.loads(x) for x in (tmp_path / "b" / "requests.jsonl").read_text().splitlines()]
    refused = [q for q in reqs if q["error"]]
    assert refused and len(refused) < len(reqs)
    assert f"{len(refused):,} request(s) refused" in r.output and "max_model_len" in r.output


@pytest.mark.slow
def test_speed_against_a_commit_alternates_the_two_trees_and_names_what_each_imported(tmp_path):
    """``benchmarks/simulate.py speed --against REF``: REF's tree (git archive) and this one alternate, each run in
    a fresh process, and each run's line names the package it imported: a comparison that timed one tree twice
    would show it."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    if subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: nothing to compare against")
    out = tmp_path / "speed.json"
    proc = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "simulate.py"), "speed", "--against", "HEAD", "--repeats", "1",
         "--duration", "20", "--rate", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["label"] for r in runs] == ["HEAD", "this tree"]
    assert Path(runs[1]["workbench"]).parents[1] == repo and Path(runs[0]["workbench"]).parents[1] != repo
    assert runs[0]["steps"] == runs[1]["steps"] > 0  # the same decisions
    for r in runs:
        assert f"workbench.__file__ = {r['workbench']}" in proc.stdout
    assert "this tree / HEAD: whole command" in proc.stdout
