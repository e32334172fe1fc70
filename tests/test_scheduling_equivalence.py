"""Greedy output does not depend on how the work is scheduled: chunked prefill, prefix caching,
preemption by recompute or swap — on the bundled model with real prompts, and cases from
real-world bug reports."""

from __future__ import annotations

import pytest
from conftest import real_prompts

from workbench import LLM, SamplingParams

SP = SamplingParams(max_tokens=40, ignore_eos=True)  # decode steps enough to preempt and resume several requests
BASE = dict(dtype="float32", max_num_seqs=8, max_model_len=512)


@pytest.fixture(scope="module")
def msgs():
    system = "You are a careful assistant. Answer briefly and precisely, in plain English. " * 3
    return [[{"role": "system", "content": system}, {"role": "user", "content": p[:300]}] for p in real_prompts(8)]


@pytest.fixture(scope="module")
def reference(msgs):
    llm = LLM(enable_chunked_prefill=False, max_num_batched_tokens=4096, **BASE)
    outs = llm.generate(msgs, SP)
    lengths = [len(o.prompt_token_ids) for o in outs]
    return [o.outputs[0].token_ids for o in outs], max(lengths) + SP.max_tokens, min(lengths)


@pytest.mark.parametrize(
    "args",
    [
        {"enable_chunked_prefill": True, "max_num_batched_tokens": 64},
        {"enable_prefix_caching": True, "max_num_seqs": 2},  # later admissions find the system prompt
        {"tiny_pool": True, "preemption_mode": "recompute"},
        {"tiny_pool": True, "preemption_mode": "swap", "swap_space": 0.5},
    ],
    ids=["chunked-64", "prefix-caching", "tiny-pool-recompute", "tiny-pool-swap"],
)
@pytest.mark.slow
def test_bundled_greedy_identical_under_scheduling_variants(msgs, reference, args):
    ref, longest, shortest_prompt = reference
    args = dict(args)
    if args.pop("tiny_pool", False):
        # room for the longest sequence and one more short prompt: two requests run at once and
        # outgrow the pool within a few decode steps, so requests are preempted and resumed
        blocks = -(-longest // 16) + -(-shortest_prompt // 16)
        args |= {"num_gpu_blocks_override": blocks, "max_model_len": blocks * 16}
    llm = LLM(**(BASE | args))
    outs = llm.generate(msgs, SP)
    assert [o.outputs[0].token_ids for o in outs] == ref
    steps = llm.llm_engine.recorder.steps
    if "num_gpu_blocks_override" in args:
        preempted = sum(o.metrics["num_preemptions"] > 0 for o in outs)
        assert preempted >= 3, f"only {preempted} of 8 requests were preempted: the pool was not small enough"
    if args.get("enable_prefix_caching"):
        assert sum(s.prefix_cache_hits for s in steps) > 0  # the shared system prompt
    if args.get("max_num_batched_tokens") == 64:
        assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) <= 64


def test_two_prompts_near_pool_capacity_with_two_slots_finish(tiny_model):
    # vLLM issues of this shape: two long prompts that each nearly fill the pool livelock
    # admit -> preempt -> readmit. Each must finish, one after the other.
    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        max_num_seqs=2,
        max_num_batched_tokens=16,
        max_model_len=128,
        num_gpu_blocks_override=32,
    )
    prompts = [[3 + i % 200 for i in range(110)], [7 + i % 190 for i in range(112)]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert len(llm.llm_engine.recorder.steps) < 200


@pytest.mark.slow
def test_prompt_20x_the_chunk_is_unchanged_by_chunking(tiny_model):
    prompt = [2 + (i * 7) % 240 for i in range(200)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    whole = LLM(
        model=str(tiny_model), block_size=4, max_model_len=256, enable_chunked_prefill=False, max_num_batched_tokens=256
    ).generate([prompt], sp)
    llm = LLM(model=str(tiny_model), block_size=4, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=10)
    chunked = llm.generate([prompt], sp)
    assert chunked[0].outputs[0].token_ids == whole[0].outputs[0].token_ids
    assert chunked[0].metrics["num_prefill_chunks"] == 20
