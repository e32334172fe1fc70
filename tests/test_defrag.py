"""KV defragmentation by block copies (workbench.kv.defrag / .moves): copy order on both copy paths, moves on
both managers (and their refusals), compaction plans on hand-built layouts, random schedules with compaction
interleaved under a content model of the cache, greedy tokens with and without compaction, triggers, records."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.lowest_first import LowestFirstKVManager
from workbench import LLMEngine, SamplingParams, kernels
from workbench.attention import get_backend
from workbench.config import EngineConfig
from workbench.executor.local import ModelRunner
from workbench.kv import KVCacheManager
from workbench.kv.contiguous import ContiguousKVCacheManager
from workbench.kv.defrag import (
    Defragmenter,
    DefragPass,
    highest_block_gap,
    largest_free_run,
    plan_compaction,
)
from workbench.kv.moves import copy_rounds
from workbench.metrics.accounting import KVUsage
from workbench.request import Request
from workbench.scheduler import Scheduler, SchedulerOutput
from workbench.viz.report import summary_table

needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed (pip install triton)")


# ---------------------------------------------------------------------------- copy order
def sequential(cache: torch.Tensor, pairs) -> torch.Tensor:
    """The meaning of a copy list: one pair at a time, in order."""
    out = cache.clone()
    for s, d in pairs:
        out[:, d] = out[:, s]
    return out


def random_cache(num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, num_blocks, 2, 1, 4), generator=g)  # [2, blocks, block_size, kv heads, head_dim]


def runner_with(cache: torch.Tensor, backend: str) -> ModelRunner:
    r = ModelRunner.__new__(ModelRunner)  # the copy path alone: no model
    r.kv_caches, r.cpu_caches, r.attn_backend = [cache], [], get_backend(backend, "cpu")
    return r


def test_rounds_split_only_where_order_matters():
    cow = [(0, 5), (1, 6), (2, 7)]  # fresh destinations: one round on either path
    assert copy_rounds(cow) == copy_rounds(cow, parallel=True) == [cow]
    slide = [(5, 3), (6, 4), (7, 5), (8, 6)]  # a region of 4 slides down by 2: dst 5 was an earlier src
    assert copy_rounds(slide) == [slide]  # gather-then-scatter reads every source first
    assert copy_rounds(slide, parallel=True) == [slide[:2], slide[2:]]
    chain = [(1, 0), (0, 2)]  # reads block 0 after writing it: a new round on both paths
    assert copy_rounds(chain) == copy_rounds(chain, parallel=True) == [[(1, 0)], [(0, 2)]]


@settings(max_examples=60, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=12), seed=st.integers(0, 99))
def test_torch_copy_path_applies_pairs_in_list_order(pairs, seed):
    cache = random_cache(8, seed)
    want = sequential(cache, pairs)
    runner_with(cache, "torch").copy_blocks([], pairs, [])
    assert torch.equal(cache, want)


@needs_triton
def test_triton_copy_path_applies_pairs_in_list_order():
    rng = random.Random(0)
    cases = [[(5, 3), (6, 4), (7, 5), (8, 6)], [(1, 0), (0, 2)], [(2, 3), (3, 2)]]
    cases += [[(rng.randrange(9), rng.randrange(9)) for _ in range(rng.randint(1, 8))] for _ in range(6)]
    for k, pairs in enumerate(cases):
        cache = random_cache(9, k)
        want = sequential(cache, pairs)
        get_backend("triton-interpret", "cpu").copy_blocks([cache], [], [], pairs, [])
        assert torch.equal(cache, want), pairs


# ---------------------------------------------------------------------------- moves
def contiguous(num_blocks: int, sizes: dict[str, int], block_size: int = 1) -> ContiguousKVCacheManager:
    """Regions of ``sizes`` blocks, allocated first-fit in order."""
    kv = ContiguousKVCacheManager(num_blocks, block_size, "orca-max")
    for rid, n in sizes.items():
        kv.declare(rid, n * block_size, 0, num_blocks * block_size)
        assert kv.allocate_slots(rid, 1)
    return kv


def test_contiguous_moves_whole_regions_and_queues_the_copies():
    kv = contiguous(10, {"a": 2, "b": 3, "c": 2})  # a: 0-1, b: 2-4, c: 5-6
    kv.free("a")
    kv.move_blocks([(2, 0), (3, 1), (4, 2)])  # b slides down by 2; dst 2 was an earlier src
    assert kv.block_tables["b"] == [0, 1, 2] and [r[:2] for r in kv.regions] == [(0, 3), (5, 2)]
    kv.check_invariants()
    assert kv.take_pending_copies() == [(2, 0), (3, 1), (4, 2)] and kv.take_pending_copies() == []
    with pytest.raises(ValueError, match="whole regions"):
        kv.move_blocks([(5, 3)])  # half of c
    with pytest.raises(ValueError, match="block 2 is in use"):
        kv.move_blocks([(5, 2), (6, 3)])
    with pytest.raises(ValueError, match="holds no live block"):
        kv.move_blocks([(8, 9)])
    assert kv.block_tables["c"] == [5, 6] and kv.take_pending_copies() == []  # refused passes change nothing
    kv.check_invariants()


def test_paged_moves_keep_reference_counts_hashes_and_the_free_queue():
    kv = KVCacheManager(8, 2, enable_prefix_caching=True)
    toks = [3, 4, 5, 6, 7]
    assert kv.allocate_slots("a", 5)  # blocks 0, 1, 2
    kv.cache_full_blocks("a", toks, 5)  # 0 and 1 are cached
    hits = kv.find_cached_prefix(toks)
    assert hits == [0, 1]
    assert kv.allocate_slots("b", 5, hits)  # shares 0 and 1, gets 3
    assert kv.allocate_slots("x", 2)  # block 4
    kv.cache_full_blocks("x", [9, 9], 2)
    kv.free("x")  # 4 is free and caches [9, 9]
    kv.move_blocks([(1, 4), (0, 5)])  # a shared, cached block into the cached free block 4
    assert kv.block_tables["a"] == [5, 4, 2] and kv.block_tables["b"] == [5, 4, 3]
    assert kv.pool.ref_cnt[4] == kv.pool.ref_cnt[5] == 2 and kv.pool.ref_cnt[0] == kv.pool.ref_cnt[1] == 0
    assert kv.find_cached_prefix(toks) == [5, 4]  # the hashes moved with the content
    assert kv.find_cached_prefix([9, 9, 1]) == []  # 4's cached block was overwritten: evicted
    assert kv.pool.num_evictions == 1
    kv.check_invariants()
    assert kv.take_pending_copies() == [(1, 4), (0, 5)]
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == 8
    kv.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
def test_a_move_carries_the_eviction_figures_and_records_the_evicted_age(policy):
    kv = KVCacheManager(8, 2, enable_prefix_caching=True, eviction_policy=policy)
    toks = [3, 4, 5, 6, 7]
    assert kv.allocate_slots("a", 5)  # blocks 0, 1, 2; 0 and 1 cached
    kv.cache_full_blocks("a", toks, 5)
    assert kv.allocate_slots("b", 5, kv.find_cached_prefix(toks))  # one hit each on 0 and 1
    assert kv.allocate_slots("x", 2)  # block 4, cached, then free
    kv.cache_full_blocks("x", [9, 9], 2)
    kv.free("x")
    pol = kv.pool.policy
    before = (pol.hits[1], pol.cached_seq[1])
    pol.take_evicted_ages(pol.step + 3)  # three steps pass
    kv.move_blocks([(1, 4)])
    assert (pol.hits[4], pol.cached_seq[4]) == before == (1, before[1])
    assert pol.take_evicted_ages(pol.step) == [3]  # block 4's cached content was evicted, 3 steps after its free
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    assert set(kv.cached_free_blocks()) == {0, 4} and kv.num_free_blocks == 8
    kv.check_invariants()


def test_managers_that_cannot_move_refuse():
    kv = LowestFirstKVManager(8, 2)
    with pytest.raises(NotImplementedError, match="cannot move blocks"):
        kv.move_blocks([(0, 1)])
    with pytest.raises(ValueError, match="kv_defrag_trigger='highest-block'.*does not implement move_blocks"):
        Defragmenter(kv, "highest-block")
    with pytest.raises(NotImplementedError, match="unsupported"):
        Defragmenter(kv).compact()


# ---------------------------------------------------------------------------- plans
def test_contiguous_plan_closes_holes_until_the_waiting_request_fits():
    kv = contiguous(20, {"a": 3, "b": 2, "c": 4, "d": 2, "e": 3, "f": 2})  # 0-2, 3-4, 5-8, 9-10, 11-13, 14-15
    for rid in ("a", "c", "e"):
        kv.free(rid)  # holes of 3, 4, 3 (+ 4 at the top): 14 free, the largest run 4
    assert largest_free_run(kv) == 4
    moves = plan_compaction(kv, 512, need_blocks=7)  # b to 0 (run 3 + 4 = 7 above it): enough
    assert moves == [(3, 0), (4, 1)]
    kv.move_blocks(moves)
    assert largest_free_run(kv) >= 7 and kv.first_fit(7) is not None
    moves = plan_compaction(kv, 512)  # pack everything
    kv.move_blocks(moves)
    assert kv.free_runs() == [(6, 14)] and highest_block_gap(kv) == 0
    assert plan_compaction(kv, 512) == []  # packed: nothing to move
    kv.check_invariants()


def test_contiguous_plan_moves_whole_regions_within_the_pass_limit():
    kv = contiguous(12, {"a": 2, "b": 3, "c": 3})
    kv.free("a")
    assert plan_compaction(kv, 2) == []  # b (3 blocks) does not fit a pass of 2
    assert len(plan_compaction(kv, 3)) == 3  # b alone
    with pytest.raises(ValueError, match="max_moves=0"):
        plan_compaction(kv, 0)


def test_paged_plan_is_gaudis_highest_used_into_lowest_free_at_most_n_per_pass():
    kv = KVCacheManager(64, 1)
    for i in range(40):
        assert kv.allocate_slots(str(i), 1)
    rng = random.Random(0)
    for i in rng.sample(range(40), 25):
        kv.free(str(i))  # 15 used blocks scattered over 0..39
    used = len({b for t in kv.block_tables.values() for b in t})
    passes = 0
    while highest_block_gap(kv):
        moves = plan_compaction(kv, 4)
        assert 0 < len(moves) <= 4
        top = sorted({b for t in kv.block_tables.values() for b in t}, reverse=True)
        assert [s for s, _ in moves] == top[: len(moves)]  # the highest used blocks ...
        assert all(d < s for s, d in moves)  # ... each into a lower free block
        kv.move_blocks(moves)
        kv.check_invariants()
        passes += 1
    assert max(b for t in kv.block_tables.values() for b in t) == used - 1 and passes <= -(-used // 4) + 1


# ---------------------------------------------------------------------------- triggers
class Waiting:
    def __init__(self, rid):
        self.request_id = rid


def test_triggers():
    kv = contiguous(12, {"a": 2, "b": 3, "c": 2, "w": 0})
    kv.free("a")
    kv.declare("w", 4, 0, 12)  # w needs 4 consecutive blocks: 7 are free, the largest run 5
    assert Defragmenter(kv).should_compact([Waiting("w")]) == (False, 0)
    d = Defragmenter(kv, "waiting")
    assert d.should_compact([Waiting("w")]) == (False, 4)  # run 5 holds it
    kv.declare("w", 6, 0, 12)
    assert d.should_compact([Waiting("w")]) == (True, 6)  # 7 free, no run of 6: external fragmentation
    kv.declare("w", 8, 0, 12)
    assert d.should_compact([Waiting("w")])[0] is False  # more than is free: compaction cannot help
    assert d.should_compact([])[0] is False
    usage = {"u": None}
    d = Defragmenter(kv, "fragmentation", usage=lambda: usage["u"])
    assert d.threshold == 0.5 and d.should_compact([])[0] is False  # no step yet
    usage["u"] = KVUsage(
        pool=12, token_states=2, reservation=3, internal_fragmentation=0, external_fragmentation=2, free=5
    )
    assert d.should_compact([]) == (True, 0)  # 5 of 7 occupied slots hold no token state
    usage["u"].token_states, usage["u"].reservation = 5, 0
    assert d.should_compact([])[0] is False
    d = Defragmenter(kv, "highest-block", threshold=1)  # used 2-6, free 0-1 below: gap 2
    assert highest_block_gap(kv) == 2 and d.should_compact([])[0] is True
    assert (
        Defragmenter(kv, "highest-block").threshold == 32
        and not Defragmenter(kv, "highest-block").should_compact([])[0]
    )


def test_engine_arguments_are_validated():
    with pytest.raises(ValueError, match="kv_defrag_trigger='sometimes' must be one of"):
        EngineConfig(kv_defrag_trigger="sometimes").validate()
    with pytest.raises(ValueError, match="kv_defrag_threshold=2 must be a rate in"):
        EngineConfig(kv_defrag_trigger="fragmentation", kv_defrag_threshold=2).validate()
    with pytest.raises(ValueError, match="kv_defrag_max_moves=0 must be an integer >= 1"):
        EngineConfig(kv_defrag_max_moves=0).validate()
    with pytest.raises(ValueError, match="kv_defrag_threshold=-1"):
        EngineConfig(kv_defrag_threshold=-1).validate()
    for trigger in ("none", "waiting"):  # a threshold these triggers would ignore is refused, not dropped
        with pytest.raises(
            ValueError, match=f"kv_defrag_threshold=0.3 has no effect with kv_defrag_trigger='{trigger}'"
        ):
            EngineConfig(kv_defrag_trigger=trigger, kv_defrag_threshold=0.3).validate()
    EngineConfig(kv_defrag_trigger="highest-block", kv_defrag_threshold=64, kv_defrag_max_moves=8).validate()


# ---------------------------------------------------------------------------- random schedules
class CacheModel:
    """A fake device: slot -> the token written there; swap space likewise. Each step applies the scheduler's
    copies in the executor's order (swap out, device copies in list order, swap in), then writes the step's tokens."""

    def __init__(self, bs):
        self.bs, self.dev, self.cpu = bs, {}, {}

    def copy(self, src_mem, dst_mem, pairs):
        snapshot = [{i: src_mem.get(s * self.bs + i) for i in range(self.bs)} for s, _ in pairs]
        for (_, d), blk in zip(pairs, snapshot):
            for i, v in blk.items():
                dst_mem[d * self.bs + i] = v

    def apply(self, out, kv):
        self.copy(self.dev, self.cpu, out.swap_out)
        for s, d in out.block_copies:  # one at a time, in order
            self.copy(self.dev, self.dev, [(s, d)])
        self.copy(self.cpu, self.dev, out.swap_in)
        for s in out.scheduled:
            r = s.request
            slots = kv.slot_mapping(r.request_id, s.start, s.start + s.num_new_tokens)
            for p, slot in zip(range(s.start, s.start + s.num_new_tokens), slots):
                self.dev[slot] = r.token_ids[p]

    def check(self, kv, requests):
        for r in requests:
            if r.request_id in kv.block_tables:
                n = r.num_computed_tokens
                got = [self.dev.get(slot) for slot in kv.slot_mapping(r.request_id, 0, n)]
                assert got == r.token_ids[:n], f"request {r.request_id}'s cached tokens moved wrongly"


@pytest.mark.parametrize("manager", ["paged", "orca-max"])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), seed=st.integers(0, 10_000), trigger=st.sampled_from(["highest-block", "waiting", "none"]))
def test_random_schedules_with_compaction_keep_every_token_and_leak_nothing(manager, data, seed, trigger):
    rng = random.Random(seed)
    bs = data.draw(st.sampled_from([1, 2, 4]))
    n = data.draw(st.integers(2, 10))
    prompts = [
        [rng.randrange(2, 9)] * 8 * (i % 2) + [rng.randrange(2, 99) for _ in range(rng.randint(1, 24))]
        for i in range(n)
    ]
    max_tokens = [rng.randint(1, 16) for _ in range(n)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    num_blocks = -(-longest // bs) + data.draw(st.integers(0, 16))
    if manager == "paged":
        policy = data.draw(st.sampled_from(["lru", "fifo", "lfu"]))  # moves keep every eviction policy consistent
        cpu = data.draw(st.integers(0, 20))
        kv = KVCacheManager(num_blocks, bs, enable_prefix_caching=True, num_cpu_blocks=cpu, eviction_policy=policy)
        mode = "swap" if kv.swap_pool else "recompute"
    else:
        kv, mode = ContiguousKVCacheManager(num_blocks, bs, "orca-max"), "recompute"
    sched = Scheduler(kv, data.draw(st.integers(1, 6)), 64, preemption_mode=mode)
    defrag = Defragmenter(
        kv,
        trigger,
        threshold=data.draw(st.sampled_from([0, 2])),
        max_moves=data.draw(st.sampled_from([1, 3, 512])),
        block_bytes=10,
    )
    reqs = []
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        r = Request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True), 0.0, max_total_len=num_blocks * bs)
        kv.declare(r.request_id, len(p), m, num_blocks * bs)
        sched.add_request(r)
        reqs.append(r)
    cache = CacheModel(bs)
    admin_every = data.draw(st.sampled_from([0, 2, 5]))
    for step in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        defrag.after_schedule(out, sched)
        cache.apply(out, kv)
        sched.update(out, {s.request.request_id: 5 for s in out.scheduled if s.samples}, float(step))
        kv.check_invariants()
        cache.check(kv, reqs)
        held = len({b for t in kv.block_tables.values() for b in t})
        assert held + kv.num_free_blocks == num_blocks
        if admin_every and step % admin_every == 0:
            p = defrag.compact(copy=lambda pairs: cache.copy(cache.dev, cache.dev, pairs))
            assert p is None or 0 < p.blocks_moved <= defrag.max_moves
            kv.check_invariants()
            cache.check(kv, reqs)
    assert all(r.is_finished for r in reqs) and not kv.block_tables and kv.num_free_blocks == num_blocks
    assert all(len(r.output_token_ids) == m for r, m in zip(reqs, max_tokens))
    assert all(p.blocks_moved <= defrag.max_moves and p.bytes_moved == 10 * p.blocks_moved for p in defrag.passes)


# ---------------------------------------------------------------------------- engine runs
def engine_run(model, kv_allocator, compact_every=0, steps_out=None, **kw):
    rng = random.Random(1)
    eng = LLMEngine(
        EngineConfig(
            model=str(model), block_size=4, max_num_seqs=5, max_model_len=96, num_gpu_blocks_override=48,
            kv_allocator=kv_allocator, **kw,
        )
    )  # fmt: skip
    shared = [rng.randrange(2, 250) for _ in range(12)]
    for i in range(10):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(2, 250) for _ in range(rng.randint(2, 30))]
        eng.add_request(str(i), prompt, SamplingParams(max_tokens=4 + (i * 7) % 19, ignore_eos=True))
    outs, k, passes = {}, 0, []
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
        k += 1
        if compact_every and k % compact_every == 0:
            passes.append(eng.compact())
        eng.kv.check_invariants()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks
    if steps_out is not None:
        steps_out += eng.recorder.steps
    return outs, [p for p in passes if p], eng


@pytest.mark.parametrize("kv_allocator,extra", [("orca-max", {}), ("paged", {"enable_prefix_caching": True})])
def test_greedy_tokens_are_the_same_with_compaction(tiny_model, kv_allocator, extra):
    ref, _, _ = engine_run(tiny_model, kv_allocator, **extra)
    got, passes, eng = engine_run(tiny_model, kv_allocator, compact_every=3, **extra)  # between steps
    assert got == ref and passes and all(isinstance(p, DefragPass) and p.copy_time_s >= 0 for p in passes)
    steps = []
    got, _, eng = engine_run(
        tiny_model, kv_allocator, steps_out=steps, kv_defrag_trigger="highest-block", kv_defrag_threshold=0, **extra
    )  # carried by the steps' block copies
    assert got == ref
    moved = [s for s in steps if s.defrag_blocks_moved]
    assert moved and all(s.copy_time_s > 0 for s in moved)
    assert sum(s.defrag_blocks_moved for s in steps) == eng.defrag.summary()["defrag_blocks_moved"]
    if kv_allocator == "paged":
        assert sum(s.prefix_cache_hits for s in steps) > 0
        assert all(s.cow_block_copies == 0 for s in steps)  # moves are not counted as copy-on-write


@needs_triton
@pytest.mark.slow
def test_greedy_tokens_are_the_same_with_compaction_on_the_triton_interpreter(tiny_model):
    ref, _, _ = engine_run(tiny_model, "orca-max", attention_backend="torch")
    got, _, eng = engine_run(
        tiny_model, "orca-max", attention_backend="triton-interpret", kv_defrag_trigger="highest-block",
        kv_defrag_threshold=0,
    )  # fmt: skip
    assert got == ref and eng.defrag.passes


def test_waiting_trigger_admits_the_blocked_request_in_the_next_step_and_the_summary_says_so(tiny_model):
    steps = []
    _, _, eng = engine_run(tiny_model, "orca-max", steps_out=steps, kv_defrag_trigger="waiting")
    summary = summary_table([s.to_dict() for s in steps], [], 1.0)
    ps = eng.defrag.passes
    assert ps and all(p.trigger == "waiting" and p.largest_run_after > p.largest_run_before for p in ps)
    assert summary["defrag_passes"] == len(ps) and summary["defrag_unblocked_reqs"] == sum(p.unblocked for p in ps) > 0
    assert summary["defrag_bytes_moved"] == sum(p.blocks_moved for p in ps) * eng.memory.block_bytes
    steps = []
    engine_run(tiny_model, "orca-max", steps_out=steps)
    assert "defrag_passes" not in summary_table([s.to_dict() for s in steps], [], 1.0)


def test_a_pass_never_runs_in_a_step_that_swaps_in():
    kv = KVCacheManager(8, 1)
    assert kv.allocate_slots("a", 1) and kv.allocate_slots("b", 1)
    kv.free("a")  # b at 1: a gap of 1
    d = Defragmenter(kv, "highest-block", threshold=0)
    out = SchedulerOutput(swap_in=[(0, 5)])

    class S:
        waiting = ()

    d.after_schedule(out, S)
    assert out.defrag is None and not d.passes
    out = SchedulerOutput()
    d.after_schedule(out, S)
    assert out.defrag.passes == 1 and out.block_copies == [(1, 0)] and kv.block_tables["b"] == [0]


def test_the_run_tables_name_the_kv_manager_and_show_the_compaction_figures():
    """What `workbench run` and `workbench simulate` print about the KV manager (workbench.cli.options)."""
    from workbench.cli.options import kv_figure_rows, kv_manager_line

    cfg = EngineConfig(kv_allocator="orca-max", kv_defrag_trigger="fragmentation").to_dict()
    assert kv_manager_line(cfg) == "orca-max, block_size 16; compaction: fragmentation > 0.5"
    cfg = EngineConfig(enable_prefix_caching=True, prefix_cache_eviction="lfu", block_size=8).to_dict()
    assert kv_manager_line(cfg) == "paged, block_size 8; prefix caching (eviction lfu)"
    cfg = EngineConfig(kv_defrag_trigger="highest-block", kv_defrag_threshold=4).to_dict()
    assert kv_manager_line(cfg).endswith("compaction: highest-block > 4")
    summary = {"defrag_passes": 3, "defrag_blocks_moved": 12, "defrag_bytes_moved": 3 * 2**20,
               "defrag_copy_time_s": 0.0042, "defrag_unblocked_reqs": 2}  # fmt: skip
    assert kv_figure_rows(summary) == [
        ("KV compaction: passes, blocks moved, copy time; requests unblocked", "3, 12 (3.0 MiB), 4.2 ms; 2")
    ]
    assert kv_figure_rows({"prefix_cache_queries_total": 0}) == []
    # on, but nothing happened: said so, not left out
    cfg = EngineConfig(kv_defrag_trigger="waiting", enable_prefix_caching=True).to_dict()
    assert kv_figure_rows({"prefix_cache_evictions_total": 0}, cfg) == [
        ("prefix-cache evictions", "0 (the cache never had to give a block back)"),
        ("KV compaction passes", "0 (the waiting trigger never fired)"),
    ]


def test_run_job_refuses_compaction_on_buddy_before_the_model_loads(tiny_model, monkeypatch):
    from workbench.bench import run as run_module

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(run_module, "LLM", no_load)
    with pytest.raises(ValueError, match="kv_allocator='buddy' does not implement move_blocks"):
        run_module.run_job(kv_allocator="buddy", kv_defrag_trigger="waiting", model=str(tiny_model), num_prompts=1,
                           output_dir=None, progress=False)  # fmt: skip
