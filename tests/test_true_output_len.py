"""A request's true output length (``true_output_len``): it ends there with ``finish_reason="stop"``
(as if its model had emitted EOS) whatever ``max_tokens`` says, for every allocator; the contiguous
baselines reserve by it (orca-max: prompt + cap; orca-pow2: the power of two of the true length;
orca-oracle: the true length); and with a cap well above long-tailed true lengths the five allocators
order as the vLLM paper's Fig. 2 (static < orca-max < orca-pow2 < orca-oracle < paged, token states).
"""

from __future__ import annotations

import pytest

from workbench import LLM, SamplingParams
from workbench.bench.datasets import default_prompts
from workbench.bench.output_lens import exponential_output_lens, parse_output_len_source, true_output_lens_for
from workbench.catalog import MODELS
from workbench.config import EngineConfig
from workbench.kv.contiguous import next_pow2
from workbench.kv.manager import cdiv
from workbench.metrics.waste import waste_breakdown
from workbench.sim import SimEngine, SimSpec
from workbench.sim.hardware import HARDWARE
from workbench.sim.trace import TraceRequest

ALLOCATORS = ["paged", "static", "orca-max", "orca-pow2", "orca-oracle"]
FIG2_ORDER = ["static", "orca-max", "orca-pow2", "orca-oracle", "paged"]


@pytest.fixture(scope="module")
def engines(tiny_model):
    """One tiny-model engine per allocator: blocks of 4 tokens, max_model_len 64, a pool of 64 blocks."""
    return {
        a: LLM(
            model=str(tiny_model),
            block_size=4,
            num_gpu_blocks_override=64,
            max_model_len=64,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            kv_allocator=a,
        )
        for a in ALLOCATORS
    }


@pytest.mark.parametrize("allocator", ALLOCATORS)
def test_a_request_stops_at_its_true_length_with_stop_while_max_tokens_is_larger(engines, allocator):
    llm = engines[allocator]
    prompts = [[5, 6, 7, 8, 9], list(range(10, 30)), [40, 41]]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    outs = llm.generate(prompts, sp, true_output_lens=[3, 11, 30])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 11, 30]
    # below the cap: "stop", as at EOS; at the cap, the cap ends it ("length", checked first as in vLLM)
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "stop", "length"]
    # a true length beyond the cap: the cap wins
    (o,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), true_output_lens=[9])
    assert len(o.outputs[0].token_ids) == 4 and o.outputs[0].finish_reason == "length"
    eng = llm.llm_engine
    assert not eng.requests and not eng.kv.block_tables  # everything released


def test_true_length_tokens_are_the_models_own(engines):
    """Ending at the true length cuts the same greedy sequence a full run produces."""
    llm = engines["paged"]
    prompt = [[7, 8, 9, 10, 11, 12]]
    (full,) = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    (cut,) = llm.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True), true_output_lens=[6])
    assert cut.outputs[0].token_ids == full.outputs[0].token_ids[:6]


def test_add_request_true_output_len_on_the_engine(engines):
    eng = engines["paged"].llm_engine
    eng.add_request("t", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True), true_output_len=7)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.finished]
    assert len(outs[0].outputs[0].token_ids) == 7 and outs[0].outputs[0].finish_reason == "stop"
    rec = eng.recorder.requests[-1].to_dict()  # requests.jsonl's row: the cap and the true length it replayed
    assert (rec["request_id"], rec["max_tokens"], rec["true_output_len"], rec["output_tokens"]) == ("t", 50, 7, 7)


@pytest.mark.parametrize("allocator", ["static", "orca-max", "orca-pow2", "orca-oracle"])
def test_reservation_per_allocator(engines, allocator):
    """orca-max reserves prompt + cap, orca-pow2 prompt + pow2(true), orca-oracle prompt + true (tokens,
    in blocks of 4), static max_model_len; the true length no longer caps max_tokens."""
    eng = engines[allocator].llm_engine
    prompt, cap, true = list(range(2, 12)), 40, 5  # 10 prompt tokens
    rid = f"res-{allocator}"
    eng.add_request(rid, prompt, SamplingParams(max_tokens=cap, ignore_eos=True), true_output_len=true)
    expected_tokens = {
        "static": 64,
        "orca-max": min(10 + cap, 64),
        "orca-pow2": 10 + next_pow2(true),
        "orca-oracle": 10 + true,
    }[allocator]
    assert eng.kv.reservation_blocks(rid) == cdiv(expected_tokens, 4)
    assert eng.requests[rid].sampling_params.max_tokens == cap  # not capped at the true length
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                assert len(o.outputs[0].token_ids) == true and o.outputs[0].finish_reason == "stop"
    eng.kv.check_invariants()


@pytest.mark.parametrize("bad", [0, -3, 2.5, "7", True, [4]])
def test_bad_true_lengths_are_refused_before_anything_is_queued(engines, bad):
    llm = engines["paged"]
    eng = llm.llm_engine
    with pytest.raises(ValueError, match="true_output_len"):
        eng.add_request("bad", [3, 4, 5], SamplingParams(max_tokens=5), true_output_len=bad)
    assert "bad" not in eng.requests and not eng.scheduler.waiting
    with pytest.raises(ValueError, match=r"true_output_lens\[1\]"):
        llm.generate([[3, 4], [5, 6]], SamplingParams(max_tokens=5), true_output_lens=[2, bad])
    assert not eng.requests and not eng.scheduler.waiting
    with pytest.raises(ValueError, match="2 true output lengths for 1 prompts"):
        llm.generate([[3, 4]], SamplingParams(max_tokens=5), true_output_lens=[2, 3])


def test_oracle_allocators_still_need_a_true_length(engines):
    with pytest.raises(ValueError, match="true_output_lens"):
        engines["orca-pow2"].generate([[5, 6, 7]], SamplingParams(max_tokens=3))


# ------------------------------------------------------------------ where the lengths come from
def test_exponential_lengths_are_seeded_long_tailed_and_clipped():
    a = exponential_output_lens(500, 32, seed=1, max_len=256)
    assert a == exponential_output_lens(500, 32, seed=1, max_len=256)
    assert a != exponential_output_lens(500, 32, seed=2, max_len=256)
    assert min(a) >= 1 and max(a) <= 256
    mean, median = sum(a) / len(a), sorted(a)[len(a) // 2]
    assert 26 < mean < 38 and median < mean  # long tail: the mean above the median
    with pytest.raises(ValueError, match="mean"):
        exponential_output_lens(3, 0)


def test_output_len_sources():
    recs = default_prompts(4)
    assert true_output_lens_for(recs, "model", 64) is None
    assert true_output_lens_for(recs, "auto", 64) is None  # the default prompts record none
    assert true_output_lens_for(recs, "exponential:8", 64, seed=0) == exponential_output_lens(4, 8, seed=0, max_len=64)
    assert true_output_lens_for(recs, [1, 2, 3, 4], 64) == [1, 2, 3, 4]
    traced = [r.__class__(**{**r.__dict__, "output_len": i + 1}) for i, r in enumerate(recs)]
    assert true_output_lens_for(traced, "auto", 64) == true_output_lens_for(traced, "trace", 64) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="no output_len"):
        true_output_lens_for(recs, "trace", 64)
    for bad in ("exponential", "exponential:-1", "exponential:x", "sharegpt", "model:3"):
        with pytest.raises(ValueError, match="exponential:M"):
            parse_output_len_source(bad)


# ------------------------------------------------------------------ the paper's Fig. 2 order
def fig2_shares(cap: int = 512, mean: float = 32, n: int = 48) -> dict[str, float]:
    """Token states / used memory of each allocator on the default prompts, in the simulator (the real
    scheduler and KV managers, a cost model instead of the model): prompt tokens ~ characters / 4, true
    output lengths exponential (mean ``mean``, seeded) under a cap of ``cap``; a 16,384-token pool."""
    recs = default_prompts(n)
    prompts = [max(1, len(r.prompt if isinstance(r.prompt, str) else r.prompt[0]["content"]) // 4) for r in recs]
    lens = exponential_output_lens(n, mean, seed=0, max_len=cap)
    out = {}
    for a in ALLOCATORS:
        cfg = EngineConfig(kv_allocator=a, max_model_len=2048, num_gpu_blocks_override=1024, max_num_seqs=64)
        eng = SimEngine(cfg, SimSpec(MODELS["llama-2-7b"], HARDWARE["A100-80GB"], 1))
        eng.add_trace([TraceRequest(0.0, p, o, eos=True) for p, o in zip(prompts, lens)], max_tokens=cap)
        eng.run()
        reqs = sorted(eng.recorder.requests, key=lambda r: int(r.request_id.removeprefix("sim-")))
        assert [r.output_tokens for r in reqs] == lens and {r.finish_reason for r in reqs} <= {"stop", "length"}
        out[a] = waste_breakdown([s.to_dict() for s in eng.recorder.steps])["used_share"]["token_states"]
    return out


def test_the_five_allocators_order_as_the_papers_fig2_on_the_default_prompts():
    shares = fig2_shares()
    ordered = [shares[a] for a in FIG2_ORDER]
    assert ordered == sorted(ordered) and len(set(ordered)) == 5, shares
    assert shares["paged"] > 0.9
