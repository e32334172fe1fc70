"""Block pool, KV manager and scheduler invariants on random workloads (no model)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.lowest_first import LowestFirstKVManager
from workbench import conformance
from workbench.kv import BlockPool, KVCacheManager
from workbench.kv.best_fit import BestFitKVCacheManager
from workbench.kv.buddy import BuddyKVCacheManager
from workbench.kv.contiguous import ContiguousKVCacheManager, next_pow2
from workbench.metrics.accounting import pool_usage
from workbench.request import Request, RequestStatus
from workbench.sampling import SamplingParams
from workbench.scheduler import Scheduler

#: the KV managers the scheduler properties must hold for: paged, a contiguous baseline (declares
#: each request's sizes before admission; also best-fit and buddy placement), and a plug-in written against the
#: interface alone
MANAGERS = {
    "paged": lambda num_blocks, block_size: KVCacheManager(num_blocks, block_size),
    "orca-max": lambda num_blocks, block_size: ContiguousKVCacheManager(num_blocks, block_size, "orca-max"),
    "lowest-first": LowestFirstKVManager,
    "best-fit": BestFitKVCacheManager,
    "buddy": BuddyKVCacheManager,
}
RESERVING = ("orca-max", "best-fit", "buddy")  # reserve the whole request at admission


def check_step(kv, sched, num_blocks, bounds):
    """The per-step invariants every manager keeps (the conformance check's,
    :func:`workbench.conformance.check_step`: its own, blocks in range and never in two tables,
    held + free == pool, only running requests hold blocks, the five-way split summing to the pool with no
    negative part), and every unwritten slot settled as internal when no bound is given."""
    assert kv.num_blocks == num_blocks
    u = conformance.check_step(kv, sched, bounds)
    need = kv.reservation_blocks(sched.waiting[0].request_id) if sched.waiting else 0
    computed = {r.request_id: r.num_computed_tokens for r in sched.running}
    assert pool_usage(kv, computed, None, need).reservation == 0
    return u


def test_block_pool_allocate_free_and_double_free():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 1 and sorted(a) == [0, 1, 2]
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.free(a)
    pool.check_invariants()
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([a[0]])


def test_slot_mapping_and_internal_fragmentation():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 6)  # 2 blocks
    table = kv.get_block_table("a")
    assert len(table) == 2
    assert kv.slot_mapping("a", 0, 6) == [table[0] * 4 + i for i in range(4)] + [table[1] * 4, table[1] * 4 + 1]
    u = pool_usage(kv, {"a": 6})
    assert (u.token_states, u.internal_fragmentation, u.free) == (6, 2, 24)
    assert u.token_states + u.reservation + u.internal_fragmentation + u.external_fragmentation + u.free == u.pool
    assert not kv.allocate_slots("b", 40)  # needs 10 blocks: refused, nothing allocated
    assert kv.num_free_blocks == 6
    kv.free("a")
    assert kv.num_free_blocks == 8


def _simulate(
    prompt_lens, max_tokens, num_blocks, block_size, max_num_seqs, budget, chunked, eos_every, seed, manager="paged"
):
    """Drive the scheduler like the engine does, with a fake model; return (requests, steps, kv)."""
    rng = random.Random(seed)
    kv = MANAGERS[manager](num_blocks, block_size)
    sched = Scheduler(kv, max_num_seqs, budget, enable_chunked_prefill=chunked)
    reqs = []
    for i, (p, m) in enumerate(zip(prompt_lens, max_tokens)):
        r = Request(
            str(i),
            [7] * p,
            SamplingParams(max_tokens=m),
            arrival_time=0.0,
            eos_token_id=0,
            max_total_len=num_blocks * block_size,
        )
        reqs.append(r)
        # as the engine does: the manager sees the request's sizes before it is queued (contiguous
        # managers size their reservation from them; on-demand managers ignore them)
        assert kv.declare(r.request_id, p, m, num_blocks * block_size) is None
        sched.add_request(r)
    bounds = {r.request_id: r.num_prompt_tokens + r.max_output_tokens - 1 for r in reqs}
    steps = 0
    bound = sum(p + m for p, m in zip(prompt_lens, max_tokens)) * 4 + 100
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.total_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        assert out.scheduled, "a step scheduled nothing while requests wait: deadlock"
        sampled = {
            s.request.request_id: (0 if eos_every and rng.random() < 1 / eos_every else 5)
            for s in out.scheduled
            if s.samples
        }
        sched.update(out, sampled, now=float(steps))
        u = check_step(kv, sched, num_blocks, bounds)
        if manager not in RESERVING:  # on demand: any block serves, less than a block unwritten per holder
            assert u.external_fragmentation == 0
            assert u.reservation + u.internal_fragmentation < block_size * max(1, len(sched.running))
            for r in sched.running:
                assert len(kv.get_block_table(r.request_id)) * block_size - r.num_computed_tokens < block_size
        steps += 1
        assert steps < bound, "requests did not finish in bounded steps"
    return reqs, steps, kv


@pytest.mark.parametrize("manager", list(MANAGERS))
@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    max_num_seqs=st.integers(1, 8),
    chunked=st.booleans(),
    eos_every=st.sampled_from([0, 3, 20]),
    seed=st.integers(0, 1000),
)
def test_scheduler_random_workloads_never_leak_or_deadlock(
    manager, data, block_size, max_num_seqs, chunked, eos_every, seed
):
    n = data.draw(st.integers(1, 12))
    prompt_lens = data.draw(st.lists(st.integers(1, 60), min_size=n, max_size=n))
    max_tokens = data.draw(st.lists(st.integers(1, 30), min_size=n, max_size=n))
    longest = max(p + m for p, m in zip(prompt_lens, max_tokens))
    # the pool always holds the longest sequence (the engine checks this at startup), sometimes barely
    num_blocks = -(-longest // block_size) + data.draw(st.integers(0, 20))
    if manager == "buddy":  # its longest run is the pool's largest power-of-two segment: make it hold the longest
        num_blocks = max(num_blocks, next_pow2(-(-longest // block_size)))
    budget = data.draw(st.integers(max_num_seqs, max(max_num_seqs, 80)))
    reqs, _, kv = _simulate(
        prompt_lens, max_tokens, num_blocks, block_size, max_num_seqs, budget, chunked, eos_every, seed, manager
    )
    assert all(r.is_finished for r in reqs)
    assert kv.num_free_blocks == num_blocks and not kv.block_tables
    for r in reqs:
        if r.status is RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == min(r.sampling_params.max_tokens, r.max_total_len - r.num_prompt_tokens)
        else:
            assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids[-1] == 0


@pytest.mark.parametrize("manager", ["paged", "lowest-first"])
def test_tiny_pool_preempts_by_recompute_and_finishes(manager):
    reqs, _, kv = _simulate(
        [30] * 6, [40] * 6, 12, 8, max_num_seqs=6, budget=64, chunked=True, eos_every=0, seed=0, manager=manager
    )
    assert sum(r.num_preemptions for r in reqs) > 0
    assert kv.num_free_blocks == 12 and not kv.block_tables
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 40 for r in reqs)


def test_continuous_batching_mixes_prefill_and_decode_and_respects_budget():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=10, enable_chunked_prefill=True)
    a = Request("a", [1] * 3, SamplingParams(max_tokens=5), 0.0, max_total_len=400)
    b = Request("b", [1] * 25, SamplingParams(max_tokens=5), 0.0, max_total_len=400)
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, {"a": 5}, 0.0)
    sched.add_request(b)
    out = sched.schedule()  # a decodes (1 token), b takes the rest of the budget (9 of 25)
    got = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
    assert got == {"a": 1, "b": 9}
    assert out.num_decode_tokens == 1 and out.num_prefill_tokens == 9
    assert [s.samples for s in out.scheduled] == [True, False]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it():
    kv = KVCacheManager(100, 4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=20, enable_chunked_prefill=False)
    a = Request("a", [1] * 3, SamplingParams(max_tokens=5), 0.0, max_total_len=400)
    b = Request("b", [1] * 19, SamplingParams(max_tokens=5), 0.0, max_total_len=400)
    sched.add_request(a)
    sched.update(sched.schedule(), {"a": 5}, 0.0)
    sched.add_request(b)
    out = sched.schedule()  # 1 decode + 19 prompt tokens = 20: fits whole
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"a": 1, "b": 19}
