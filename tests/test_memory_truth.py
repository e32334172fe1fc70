"""Truth tests: the waste breakdown, contiguous baselines, batching policies, the memory budget."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workbench import LLM, SamplingParams
from workbench.kv.contiguous import ContiguousKVCacheManager, next_pow2, reservation_tokens
from workbench.kv.manager import KVCacheManager
from workbench.memory import LiveTensorBytes, activation_peak_bytes, plan_memory, profile_activation_peak
from workbench.metrics import JsonlSink, Recorder
from workbench.metrics.accounting import block_map, pool_usage

ALLOCATORS = ["paged", "static", "orca-max", "orca-pow2", "orca-oracle"]
CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")


def total(s) -> int:
    return sum(getattr(s, c) for c in CATEGORIES)


def run(llm: LLM, prompts, max_tokens, true=None):
    """Generate with a fresh recorder; return (outputs, steps)."""
    eng = llm.llm_engine
    eng.recorder = Recorder()
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate(prompts, sps, true_output_lens=true)
    return outs, eng.recorder.steps


@pytest.fixture(scope="module")
def engines(tiny_model):
    """One small-pool engine per allocator (48 blocks of 4 tokens; max_model_len 64)."""
    return {
        a: LLM(
            model=str(tiny_model),
            block_size=4,
            num_gpu_blocks_override=48,
            max_model_len=64,
            max_num_seqs=6,
            max_num_batched_tokens=64,
            kv_allocator=a,
        )
        for a in ALLOCATORS
    }


# ------------------------------------------------------------------ conservation (hypothesis)
trace = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 20), st.integers(1, 20)),  # prompt len, max_tokens, true len
    min_size=1,
    max_size=10,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(trace=trace, seed=st.integers(0, 1000))
@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_five_categories_sum_to_the_pool_every_step(engines, allocator, trace, seed):
    llm = engines[allocator]
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 250) for _ in range(p)] for p, _, _ in trace]
    max_tokens = [m for _, m, _ in trace]
    true = [t for _, _, t in trace]  # each request ends at its true length, or at max_tokens when that is smaller
    outs, steps = run(llm, prompts, max_tokens, true)
    pool = 48 * 4
    assert steps
    for s in steps:
        assert total(s) == pool, s
        assert min(getattr(s, c) for c in CATEGORIES) >= 0, s
        used = pool - s.free - s.external_fragmentation
        assert s.blocks_used * 4 == used
    if allocator == "paged":
        for s in steps:
            assert s.external_fragmentation == 0
            # internal fragmentation: at most the unused tail of each holder's last block
            assert s.internal_fragmentation <= s.num_running * 3
    assert [len(o.outputs[0].token_ids) for o in outs] == [min(t, m) for _, m, t in trace]
    assert [o.outputs[0].finish_reason for o in outs] == ["stop" if t < m else "length" for _, m, t in trace]
    # every request released its blocks and was settled
    assert not llm.llm_engine.accounting.holding and not llm.llm_engine.kv.block_tables


def test_settled_split_is_exact_for_one_request(engines):
    """One request alone, orca-max: prompt 10, max_tokens 20, EOS ignored but true length capped at 7 (oracle).

    orca-max reserves cdiv(10+20, 4) = 8 blocks = 32 slots. The request writes 10 + 7 - 1 = 16 slots.
    At the step where it has written w slots: reservation = 16 - w, internal = 32 - 16 = 16.
    """
    llm = engines["orca-max"]
    eng = llm.llm_engine
    eng.recorder = Recorder()
    eng.add_request("solo", list(range(2, 12)), SamplingParams(max_tokens=20, ignore_eos=True))
    # stop it after 7 output tokens by aborting: its final length is then 10 + 7 - 1 = 16 written slots
    while eng.has_unfinished_requests():
        eng.step()
        req = eng.requests.get("solo")
        if req is not None and req.num_output_tokens == 7:
            eng.abort("solo")
    steps = [s for s in eng.recorder.steps if s.num_running]
    assert steps
    for s in steps:
        assert s.token_states + s.reservation == 16
        assert s.internal_fragmentation == 32 - 16
        assert s.external_fragmentation == 0


def test_paged_internal_fragmentation_is_the_last_block_tail(engines):
    llm = engines["paged"]
    outs, steps = run(llm, [list(range(2, 12))], [5])  # 10 + 5 tokens; 14 written slots
    assert [len(o.outputs[0].token_ids) for o in outs] == [5]
    for s in steps:
        if s.num_running:
            # final block 4 (slots 12..15) keeps 2 slots never written; earlier steps hold fewer blocks
            held = s.blocks_used * 4
            assert s.internal_fragmentation == max(0, held - 14)
            assert s.reservation == min(held, 14) - s.token_states


# ------------------------------------------------------------------ first-fit hole (hand count)
def test_first_fit_leaves_a_hole_hand_count_manager():
    kv = ContiguousKVCacheManager(10, 4, "orca-max")
    for rid, tokens in (("A", 12), ("B", 8), ("C", 16), ("D", 16)):
        # orca-max reserves prompt + max_tokens (capped by max_model_len): `tokens` slots
        assert kv.declare(rid, tokens - 1, 1, max_model_len=40) is None
    assert kv.allocate_slots("A", 11) and kv.allocate_slots("B", 4) and kv.allocate_slots("C", 12)
    assert kv.block_tables["C"] == [5, 6, 7, 8]
    kv.free("A")
    assert kv.free_runs() == [(0, 3), (9, 1)]
    assert not kv.allocate_slots("D", 12)  # 4 blocks free, but no run of 4
    u = pool_usage(kv, {"B": 4, "C": 12}, waiting_need_blocks=kv.reservation_blocks("D"))
    assert u.external_fragmentation == (3 + 1) * 4
    assert u.free == 0
    assert u.token_states == 16 and u.reservation + u.internal_fragmentation == (2 + 4) * 4 - 16
    kv.check_invariants()
    kv.free("B")
    assert kv.allocate_slots("D", 12) and kv.block_tables["D"] == [0, 1, 2, 3]  # first fit
    kv.check_invariants()


def test_first_fit_leaves_a_hole_hand_count_engine(tiny_model):
    """The same trace through the engine: A (3 blocks) finishes after one token; D (4 blocks) waits
    for a run of 4 while 4 blocks are free in two holes: 16 slots of external fragmentation."""
    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        num_gpu_blocks_override=10,
        max_model_len=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_allocator="orca-max",
    )
    prompts = [list(range(2, 13)), [3, 4, 5, 6], list(range(20, 32)), list(range(40, 52))]
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 4, 4, 4)]
    outs = llm.generate(prompts, sps)
    steps = llm.llm_engine.recorder.steps
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 4, 4, 4]
    # step 0: A, B, C prefill; A finishes (frees blocks 0-2); D cannot fit (holes of 3 and 1 blocks)
    assert steps[0].num_finished == 1 and steps[0].num_waiting == 1
    assert steps[0].external_fragmentation == 16 and steps[0].free == 0
    # D runs after B frees blocks 3-4: the hole 0-4 takes it
    assert any(s.external_fragmentation == 0 and s.num_running >= 1 for s in steps[1:])


def test_reservation_sizes():
    assert reservation_tokens("static", 10, 20, 64) == 64
    assert reservation_tokens("orca-max", 10, 20, 64) == 30
    assert reservation_tokens("orca-max", 60, 20, 64) == 64
    assert reservation_tokens("orca-oracle", 10, 20, 64, true_output_len=7) == 17
    assert reservation_tokens("orca-pow2", 10, 20, 64, true_output_len=7) == 18  # 7 -> 8
    assert reservation_tokens("orca-pow2", 10, 20, 64, true_output_len=17) == 30  # 32 capped by max_tokens
    assert [next_pow2(n) for n in (1, 2, 3, 17, 64)] == [1, 2, 4, 32, 64]
    with pytest.raises(ValueError, match="true_output_len"):
        reservation_tokens("orca-oracle", 10, 20, 64)


def test_contiguous_refuses_what_it_cannot_do(tiny_model, engines):
    with pytest.raises(ValueError, match="kv_allocator='paged'"):
        LLM(model=str(tiny_model), kv_allocator="static", enable_prefix_caching=True)
    with pytest.raises(ValueError, match="kv_allocator"):
        LLM(model=str(tiny_model), kv_allocator="slab")
    with pytest.raises(ValueError, match="n=2"):
        engines["orca-max"].generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=3))
    with pytest.raises(ValueError, match="true_output_lens"):
        engines["orca-oracle"].generate([[5, 6, 7]], SamplingParams(max_tokens=3))


@pytest.mark.slow
def test_greedy_tokens_do_not_depend_on_allocator_or_batching(tiny_model, engines):
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 250) for _ in range(rng.randint(3, 30))] for _ in range(8)]
    ref, _ = run(engines["paged"], prompts, [12] * 8)
    ref_ids = [o.outputs[0].token_ids for o in ref]
    for a in ("static", "orca-max", "orca-oracle"):
        outs, _ = run(engines[a], prompts, [12] * 8, [12] * 8)
        assert [o.outputs[0].token_ids for o in outs] == ref_ids, a
    for policy in ("static", "grouped"):
        llm = LLM(model=str(tiny_model), block_size=4, max_num_seqs=3, max_model_len=64, batching_policy=policy)
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert [o.outputs[0].token_ids for o in outs] == ref_ids, policy


# ------------------------------------------------------------------ batching policies
def _admission_trace(llm: LLM, prompts, max_tokens):
    """Run step by step; return the list of running-id sets after each step and the batches formed."""
    eng = llm.llm_engine
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True))
    admitted_at: dict[str, int] = {}
    finished_at: dict[str, int] = {}
    k = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            finished_at[o.request_id] = k
        for r in eng.scheduler.running:
            admitted_at.setdefault(r.request_id, k)
        k += 1
    return admitted_at, finished_at


@pytest.mark.parametrize("policy", ["static", "grouped"])
def test_static_batches_wait_for_their_longest_member(tiny_model, policy):
    llm = LLM(model=str(tiny_model), block_size=4, max_num_seqs=3, max_model_len=128, batching_policy=policy)
    lens = [5, 50, 6, 52, 7, 49, 8]
    prompts = [list(range(2, 2 + n)) for n in lens]
    admitted, finished = _admission_trace(llm, prompts, [3, 9, 5, 4, 8, 2, 6])
    order = sorted(admitted, key=lambda r: admitted[r])
    batches: list[list[str]] = []
    for r in order:
        if batches and admitted[r] == admitted[batches[-1][0]]:
            batches[-1].append(r)
        else:
            batches.append([r])
    assert all(len(b) <= 3 for b in batches)
    for prev, nxt in zip(batches, batches[1:]):
        # nobody of the next batch starts before every member of the previous one has finished
        assert admitted[nxt[0]] > max(finished[r] for r in prev)
    if policy == "grouped":
        assert sorted(batches[0]) == ["r0", "r2", "r4"]  # prompts of 5, 6, 7 tokens
        assert sorted(batches[1]) == ["r1", "r3", "r5"]  # 50, 52, 49
    else:
        assert sorted(batches[0]) == ["r0", "r1", "r2"]


def test_continuous_admits_as_soon_as_a_slot_frees(tiny_model):
    llm = LLM(model=str(tiny_model), block_size=4, max_num_seqs=2, max_model_len=128)
    admitted, finished = _admission_trace(llm, [[5, 6, 7]] * 3, [2, 10, 2])
    assert admitted["r2"] == finished["r0"] + 1 < finished["r1"]


# ------------------------------------------------------------------ memory budget
def test_live_tensor_bytes_follows_allocations():
    with LiveTensorBytes() as m:
        a = torch.ones(1000)  # 4,000 bytes
        b = a * 2  # 4,000 more
        v = b.view(10, 100)  # a view: no new bytes
        del b
        assert m.current == 8000  # the view keeps b's storage alive
        del v
        assert m.current == 4000
        c = torch.ones(500, dtype=torch.float64)  # 4,000
        del a, c
    assert m.peak == 8000
    assert m.current == 0


def test_profiled_activation_peak_is_measured_and_grows_with_tokens(tiny_model, engines):
    model = engines["paged"].llm_engine.model
    cfg = model.config
    small = profile_activation_peak(model, 64, 64, 8, 4)
    big = profile_activation_peak(model, 256, 64, 8, 4)
    logits = 8 * cfg.vocab_size * 4
    assert logits < small < big
    # the analytical estimate of the largest live tensors is the same order of magnitude
    est = activation_peak_bytes(cfg, 256, 8, torch.float32)
    assert est / 4 < big < est * 4


def test_engine_budget_uses_the_profile_and_logs_one_line(tiny_model, caplog):
    caplog.set_level("INFO", logger="workbench")
    llm = LLM(model=str(tiny_model), block_size=4, max_model_len=64, max_num_batched_tokens=128, device_memory=8 << 20)
    m = llm.llm_engine.memory
    assert m.source == "cpu device_memory" and m.activation_bytes > 0
    assert m.kv_budget_bytes == int((8 << 20) * 0.9) - m.weights_bytes - m.activation_bytes
    assert m.num_blocks == m.kv_budget_bytes // m.block_bytes
    real = sum(t.numel() * t.element_size() for t in llm.llm_engine.executor.kv_caches)
    assert real == m.kv_pool_bytes
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory budget")]
    assert len(lines) == 1 and "profiled" in lines[0] and "max concurrency" in lines[0]
    d = m.to_dict()
    assert d["kv_pool_tokens"] == m.num_blocks * 4 and d["max_concurrency"] == m.kv_pool_tokens / 64


def test_bypasses_skip_the_profile(tiny_model):
    a = LLM(model=str(tiny_model), block_size=4, max_model_len=64, kv_cache_memory_bytes=1 << 20).llm_engine.memory
    assert a.source == "kv_cache_memory_bytes" and a.activation_bytes == 0
    assert a.num_blocks == (1 << 20) // a.block_bytes
    b = LLM(model=str(tiny_model), block_size=4, max_model_len=64, num_gpu_blocks_override=20).llm_engine.memory
    assert b.source == "num_gpu_blocks_override" and b.num_blocks == 20


def test_too_little_memory_is_a_clear_startup_error(tiny_model):
    with pytest.raises(ValueError, match="not enough memory for the KV cache.*device_memory"):
        LLM(model=str(tiny_model), max_model_len=64, device_memory=1 << 20)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=100 holds no KV block"):
        LLM(model=str(tiny_model), max_model_len=64, kv_cache_memory_bytes=100)


def test_maximum_input_runs_after_warm_up_and_one_more_is_refused(tiny_model):
    """A pool sized by the profile for exactly one max_model_len sequence: the longest prompt runs,
    one token longer is refused with a clear error, and the other requests finish."""
    llm = LLM(model=str(tiny_model), block_size=4, max_model_len=64, max_num_batched_tokens=64, device_memory=4 << 20)
    eng = llm.llm_engine
    assert eng.memory.kv_pool_tokens >= 64
    outs = llm.generate(
        [list(range(2, 65)), list(range(2, 66)), [7, 8, 9]],
        SamplingParams(max_tokens=4, ignore_eos=True),
    )
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 1  # 63 + 1 = max_model_len
    assert outs[1].error and "max_model_len=64" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert outs[2].error is None and len(outs[2].outputs[0].token_ids) == 4


def test_plan_memory_on_cpu_without_nvidia_does_not_warn(recwarn):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    )
    m = plan_memory(
        hf_config=cfg,
        device=torch.device("cpu"),
        device_memory=1 << 24,
        gpu_memory_utilization=0.5,
        weights_bytes=1 << 20,
        kv_dtype=torch.float16,
        block_size=16,
        max_model_len=128,
        activation_bytes=1 << 20,
    )
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert m.kv_budget_bytes == (1 << 23) - (2 << 20)
    assert not [w for w in recwarn.list if "nvml" in str(w.message).lower()]


# ------------------------------------------------------------------ block map and the JSONL rewrite
def test_block_map_matches_the_usage():
    kv = KVCacheManager(8, 4)
    assert kv.allocate_slots("a", 6) and kv.allocate_slots("b", 3)
    snap = block_map(kv, {"a": 6, "b": 3}, step=5)
    assert snap["step"] == 5 and len(snap["owner"]) == 8
    assert sum(snap["filled"]) == pool_usage(kv, {"a": 6, "b": 3}).token_states == 9
    assert snap["state"].count("used") == 3 and snap["owner_ids"] == ["a", "b"]
    c = ContiguousKVCacheManager(6, 4, "static")
    c.declare("x", 2, 4, max_model_len=8)  # static reserves max_model_len: 8 slots
    c.declare("y", 2, 4, max_model_len=16)  # 16 slots
    assert c.reservation_blocks("x") == 2 and c.reservation_blocks("y") == 4
    assert c.allocate_slots("x", 2)
    m = block_map(c, {"x": 2}, waiting_need_blocks=c.reservation_blocks("y") + 1)
    assert m["state"] == ["used", "used", "external", "external", "external", "external"]
    assert m["filled"][:2] == [2, 0]


def test_jsonl_steps_hold_the_settled_figures(tiny_model, tmp_path):
    llm = LLM(
        model=str(tiny_model), block_size=4, max_model_len=64, num_gpu_blocks_override=40, kv_allocator="orca-max"
    )
    sink = JsonlSink(tmp_path)
    llm.llm_engine.recorder = Recorder([sink])
    llm.llm_engine.config.block_map_every = 2
    llm.generate([[5, 6, 7, 8]] * 3, [SamplingParams(max_tokens=m, ignore_eos=True) for m in (2, 9, 5)])
    llm.llm_engine.recorder.close()
    rows = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    mem = [s.to_dict() for s in llm.llm_engine.recorder.steps]
    assert rows == mem and any(r["internal_fragmentation"] for r in rows)
    maps = [json.loads(x) for x in (tmp_path / "block_maps.jsonl").read_text().splitlines()]
    assert [m["step"] for m in maps] == [s["step"] for s in rows if s["step"] % 2 == 0]


def test_a_pool_larger_than_the_machine_is_refused_before_allocating(tiny_model):
    import os

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with pytest.raises(ValueError, match="GiB of RAM; lower device_memory, num_gpu_blocks_override"):
        LLM(model=str(tiny_model), block_size=16, max_model_len=64, kv_cache_memory_bytes=2 * ram)


def test_conflicting_pool_sizes_and_oracle_with_prefix_caching_fail_before_any_run(tiny_model, monkeypatch):
    from workbench.bench import run as run_mod

    with pytest.raises(ValueError, match="give only one of them"):
        LLM(model=str(tiny_model), kv_cache_memory_bytes=1 << 20, num_gpu_blocks_override=10)
    loads = []
    monkeypatch.setattr(run_mod, "LLM", lambda *a, **k: loads.append(k))
    with pytest.raises(ValueError, match="needs kv_allocator='paged'"):
        run_mod.run_job(num_prompts=2, output_dir=None, kv_allocator="orca-oracle", enable_prefix_caching=True)
    assert not loads
