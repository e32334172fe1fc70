"""Prefix caching: content-hashed full blocks, LRU eviction, hits that never cover the last token."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench import LLM, SamplingParams
from workbench.kv import KVCacheManager
from workbench.kv.manager import block_hash
from workbench.metrics.accounting import pool_usage
from workbench.request import Request
from workbench.sampling import SamplingParams as SP
from workbench.scheduler import Scheduler


def test_hash_chains_over_the_parent():
    a = block_hash(None, [1, 2, 3, 4])
    assert a == block_hash(None, [1, 2, 3, 4])
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])  # same tokens, other prefix


def _fill(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    hits = kv.find_cached_prefix(tokens)
    assert kv.allocate_slots(rid, len(tokens), hits)
    kv.cache_full_blocks(rid, tokens, len(tokens))


def test_hit_reuses_blocks_and_leaves_the_last_token():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    toks = list(range(12))  # 3 full blocks
    _fill(kv, "a", toks)
    # an identical prompt: only 2 blocks hit (the last token must run through the model)
    assert kv.find_cached_prefix(toks) == kv.get_block_table("a")[:2]
    assert kv.find_cached_prefix(toks + [99]) == kv.get_block_table("a")
    assert kv.find_cached_prefix([7] + toks) == []
    hits = kv.find_cached_prefix(toks + [99])
    assert kv.allocate_slots("b", 13, hits)
    assert kv.get_block_table("b")[:3] == kv.get_block_table("a")
    assert [kv.pool.ref_cnt[b] for b in hits] == [2, 2, 2]
    u = pool_usage(kv, {"a": 12, "b": 12})  # shared blocks count once
    assert u.token_states == 12
    kv.check_invariants()


def test_freed_cached_blocks_stay_findable_and_are_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    _fill(kv, "old", [1, 2, 3, 4])
    kv.free("old")
    _fill(kv, "new", [5, 6, 7, 8])
    kv.free("new")
    assert kv.pool.num_free_blocks == 4 and len(kv.pool.cached_free_blocks()) == 4
    assert len(kv.find_cached_prefix([1, 2, 3, 4, 0])) == 2
    # 2 fresh blocks evict the least recently freed cached blocks: "old"'s
    assert kv.allocate_slots("x", 4)
    assert kv.pool.num_evictions == 2
    assert kv.find_cached_prefix([1, 2, 3, 4, 0]) == []
    assert len(kv.find_cached_prefix([5, 6, 7, 8, 0])) == 2
    # a hit on a free cached block takes it off the free queue; the rest must still fit
    hits = kv.find_cached_prefix([5, 6, 7, 8, 0])
    assert not kv.allocate_slots("y", 5 + 2, hits)  # needs 2 hits + 2 new; no other block is free
    assert "y" not in kv.block_tables and kv.pool.num_free_blocks == 2 and len(kv.pool.cached) == 2
    assert kv.allocate_slots("y", 4, hits)  # the hits alone: no new block needed
    assert kv.get_block_table("y") == hits and kv.pool.num_free_blocks == 0
    kv.check_invariants()


@settings(max_examples=40, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 10_000))
def test_scheduler_with_prefix_caching_never_leaks(data, block_size, seed):
    rng = random.Random(seed)
    system = [rng.randrange(3, 9) for _ in range(data.draw(st.integers(0, 12)))]
    n = data.draw(st.integers(1, 10))
    prompts = [system + [rng.randrange(3, 9) for _ in range(rng.randint(1, 10))] for _ in range(n)]
    max_tokens = [rng.randint(1, 12) for _ in range(n)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    num_blocks = -(-longest // block_size) + data.draw(st.integers(0, 12))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    sched = Scheduler(kv, data.draw(st.integers(1, 6)), 64, enable_chunked_prefill=data.draw(st.booleans()))
    reqs = [
        Request(str(i), p, SP(max_tokens=m), 0.0, eos_token_id=0, max_total_len=num_blocks * block_size)
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    for r in reqs:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.scheduled
        for s in out.scheduled:  # hits never cover the token that must produce logits
            assert s.start + s.num_new_tokens <= s.request.num_tokens and s.num_new_tokens >= 1
        sched.update(out, {s.request.request_id: rng.randrange(3, 9) for s in out.scheduled if s.samples}, 0.0)
        kv.check_invariants()
        u = pool_usage(kv, {r.request_id: r.num_computed_tokens for r in sched.running})
        assert u.token_states + u.internal_fragmentation + u.free == u.pool and u.internal_fragmentation >= 0
        steps += 1
        assert steps < 2000
    assert kv.pool.num_free_blocks == num_blocks and not kv.block_tables
    assert all(r.is_finished and r.num_output_tokens == r.max_output_tokens for r in reqs)


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    rng = random.Random(3)
    system = [rng.randrange(2, 250) for _ in range(40)]
    return [system + [rng.randrange(2, 250) for _ in range(rng.randint(1, 20))] for _ in range(8)]


@pytest.mark.slow
def test_greedy_equal_with_and_without_prefix_caching(tiny_model, shared_prefix_prompts):
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    args = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    off = LLM(model=str(tiny_model), **args).generate(shared_prefix_prompts, sp)
    llm = LLM(model=str(tiny_model), enable_prefix_caching=True, **args)
    on = llm.generate(shared_prefix_prompts, sp)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    steps = llm.llm_engine.recorder.steps
    hits = sum(s.prefix_cache_hits for s in steps)
    assert hits >= 4 * 40 - 4 * 4  # the later batches find the 10 blocks of the shared system prompt
    assert sum(s.prefix_cache_queries for s in steps) == sum(len(p) for p in shared_prefix_prompts)
    again = llm.generate(shared_prefix_prompts, sp)  # a repeat: everything but the last block hits
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in off]
    assert all(o.metrics["num_cached_tokens"] >= len(p) - 4 for o, p in zip(again, shared_prefix_prompts))


def test_hit_rate_is_zero_for_random_prompts_under_heavy_preemption(tiny_model):
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 250) for _ in range(30)] for _ in range(8)]
    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=96,
        num_gpu_blocks_override=30,
        enable_prefix_caching=True,
    )
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    steps = llm.llm_engine.recorder.steps
    assert sum(s.num_preemptions for s in steps) > 0
    assert sum(s.prefix_cache_hits for s in steps) == 0  # recomputed tokens are not hits
    assert llm.llm_engine.kv.num_free_blocks == 30
