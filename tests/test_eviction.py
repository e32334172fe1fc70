"""Prefix-cache eviction policies (``prefix_cache_eviction``): each built-in's order on hand-built pools, the
default LRU step for step against the free queue it replaced, invariants on random schedules for every policy
(and a plug-in), the engine's outputs unchanged by the policy, the figures in StepStats / the summary, the
multi-tenant prefix-repetition prompt set, and bad names refused before any model loads."""

from __future__ import annotations

import json
import random
from collections import OrderedDict

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.scan_resistant import ProtectedLRUPolicy
from workbench import LLM, SamplingParams
from workbench.bench.samples import prefix_repetition_records
from workbench.config import PREFIX_CACHE_EVICTIONS, EngineConfig
from workbench.kv import BlockPool, KVCacheManager
from workbench.kv.eviction import BUILTIN, EvictionPolicy, LRUPolicy, eviction_policy_class
from workbench.metrics.stats import prefix_cache_summary
from workbench.request import Request
from workbench.sampling import SamplingParams as SP
from workbench.scheduler import Scheduler

PLUGIN = "tests.fixtures.scan_resistant:ProtectedLRUPolicy"
POLICIES = (*PREFIX_CACHE_EVICTIONS, PLUGIN)


def _h(i: int) -> bytes:
    return i.to_bytes(4, "little")


def _cached_pool(policy: str, n: int) -> BlockPool:
    """A pool of ``n`` blocks, each allocated, given content ``_h(block)`` and freed, in id order."""
    pool = BlockPool(n, policy)
    blocks = pool.allocate(n)
    assert blocks == list(range(n))
    for b in blocks:
        pool.cache_block(b, _h(b))
    for b in blocks:
        pool.free([b])
    return pool


def _evict(pool: BlockPool, n: int) -> list[int]:
    """The blocks ``n`` allocations hand out, in order (each freed again uncached at once)."""
    out = []
    for _ in range(n):
        (b,) = pool.allocate(1)
        out.append(b)
    pool.free(out)  # uncached now: free without content
    return out


# ------------------------------------------------------------------ names
def test_config_declares_the_built_in_policies():
    assert tuple(BUILTIN) == PREFIX_CACHE_EVICTIONS == ("lru", "fifo", "lfu")
    assert eviction_policy_class("lru") is LRUPolicy and eviction_policy_class(PLUGIN) is ProtectedLRUPolicy
    assert EngineConfig().prefix_cache_eviction == "lru"


# ------------------------------------------------------------------ hand-built eviction orders
def test_lru_evicts_the_least_recently_freed_block_cached_or_not():
    pool = _cached_pool("lru", 4)
    pool.touch(1)  # a hit: off the free queue
    pool.touch(1)
    pool.free([1])
    pool.free([1])  # freed again: now the most recently freed
    assert pool.cached_free_blocks() == [0, 2, 3, 1]
    assert _evict(pool, 2) == [0, 2]
    assert pool.num_evictions == 2 and sorted(pool.cached) == [_h(1), _h(3)]


def test_fifo_evicts_the_content_cached_earliest_whatever_its_hits():
    pool = _cached_pool("fifo", 4)
    for _ in range(3):  # block 0: cached first, hit three times, freed last
        pool.touch(0)
        pool.free([0])
    assert pool.cached_free_blocks() == [0, 1, 2, 3]
    assert _evict(pool, 1) == [0]
    # the evicted block, now empty, is handed out before any cached one
    assert _evict(pool, 1) == [0] and _evict(pool, 1) == [0]
    assert pool.cached_free_blocks() == [1, 2, 3] and pool.num_evictions == 1


def test_lfu_evicts_the_fewest_hits_and_breaks_ties_least_recently_freed():
    pool = _cached_pool("lfu", 5)
    for b, hits in ((0, 2), (1, 0), (2, 1), (3, 0), (4, 1)):
        for _ in range(hits):
            pool.touch(b)
            pool.free([b])
    # hits: 1 -> 0 (freed 2nd), 3 -> 0 (freed 4th), 2 -> 1 (re-freed before 4), 4 -> 1, 0 -> 2
    assert pool.cached_free_blocks() == [1, 3, 2, 4, 0]
    assert _evict(pool, 1) == [1]
    assert _evict(pool, 1) == [1]  # the empty block first
    pool.policy.check_invariants(pool.ref_cnt, pool.block_hash, pool.cached)


def test_keyed_policies_hand_out_empty_blocks_before_evicting():
    for name in ("fifo", "lfu", PLUGIN):
        pool = BlockPool(4, name)
        a = pool.allocate(2)
        for b in a:
            pool.cache_block(b, _h(b))
        pool.free(a)  # blocks 2, 3 are empty, 0, 1 cached and freed more recently
        assert sorted(pool.allocate(2)) == [2, 3] and pool.num_evictions == 0, name
        assert len(pool.cached) == 2


def test_the_plug_in_protects_blocks_hit_twice_from_a_scan():
    pool = _cached_pool(PLUGIN, 6)
    for _ in range(2):  # block 0 (a hot system prompt block) hit twice, freed before the scan's blocks
        pool.touch(0)
        pool.free([0])
    scan = pool.allocate(5)  # hands out 1..5 (cached, 0 hits) before protected block 0
    assert sorted(scan) == [1, 2, 3, 4, 5] and _h(0) in pool.cached
    lru = _cached_pool("lru", 6)
    for _ in range(2):
        lru.touch(0)
        lru.free([0])
    lru.free(lru.allocate(6))
    assert _h(0) not in lru.cached  # plain LRU flushed it


def test_evicted_ages_count_steps_since_the_free():
    pool = _cached_pool("lru", 3)  # all freed at step 0
    pool.policy.take_evicted_ages(4)
    pool.allocate(1)
    assert pool.policy.take_evicted_ages(5) == [4]
    pool.free([0])  # freed uncached at step 5: handing it out is no eviction
    assert pool.allocate(3) == [1, 2, 0]
    assert pool.policy.take_evicted_ages(6) == [5, 5]


# ------------------------------------------------------------------ LRU is the free queue it replaced
class _OldPool:
    """The pre-policy BlockPool's free queue (an OrderedDict: popitem(last=False), append on free)."""

    def __init__(self, n):
        self.free, self.hash = OrderedDict.fromkeys(range(n)), [None] * n

    def allocate(self):
        b, _ = self.free.popitem(last=False)
        self.hash[b] = None
        return b


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1000)), max_size=120), n=st.integers(1, 8))
def test_lru_hands_out_what_the_old_free_queue_did(ops, n):
    pool, old = BlockPool(n), _OldPool(n)
    owned: list[int] = []
    for op, x in ops:
        free = [b for b in range(n) if pool.ref_cnt[b] == 0]
        if op == 0 and free:  # allocate one
            b = pool.allocate(1)[0]
            assert b == old.allocate()
            owned.append(b)
        elif op == 1 and owned:  # free one (a request's blocks, as the manager does)
            b = owned.pop(x % len(owned))
            pool.free([b])
            if pool.ref_cnt[b] == 0:
                old.free[b] = None
        elif op == 2 and owned:  # register content
            b = owned[x % len(owned)]
            pool.cache_block(b, _h(x))
        elif op == 3 and pool.cached:  # a hit
            b = sorted(pool.cached.values())[x % len(pool.cached)]
            if pool.ref_cnt[b] == 0:
                del old.free[b]
            pool.touch(b)
            owned.append(b)
        pool.check_invariants()
        assert list(pool.policy.free) == list(old.free)


# ------------------------------------------------------------------ random schedules, every policy
@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 10_000))
def test_random_schedules_keep_the_invariants(policy, data, block_size, seed):
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 9) for _ in range(data.draw(st.integers(0, 12)))] for _ in range(3)]
    n = data.draw(st.integers(1, 12))
    prompts = [rng.choice(systems) + [rng.randrange(3, 9) for _ in range(rng.randint(1, 10))] for _ in range(n)]
    max_tokens = [rng.randint(1, 8) for _ in range(n)]
    longest = max(len(p) + m for p, m in zip(prompts, max_tokens))
    num_blocks = -(-longest // block_size) + data.draw(st.integers(0, 8))
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, eviction_policy=policy)
    sched = Scheduler(kv, data.draw(st.integers(1, 4)), 64, enable_chunked_prefill=data.draw(st.booleans()))
    reqs = [
        Request(str(i), p, SP(max_tokens=m), 0.0, eos_token_id=0, max_total_len=num_blocks * block_size)
        for i, (p, m) in enumerate(zip(prompts, max_tokens))
    ]
    for r in reqs:
        sched.add_request(r)
    steps = evictions = 0
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.scheduled
        sched.update(out, {s.request.request_id: rng.randrange(3, 9) for s in out.scheduled if s.samples}, 0.0)
        kv.check_invariants()  # the policy's free set, marks and heap agree with counts and hashes
        ages = kv.pool.policy.take_evicted_ages(steps + 1)
        assert all(0 <= a <= steps for a in ages)
        evictions += len(ages)
        free_cached = kv.cached_free_blocks()
        assert sorted(free_cached) == sorted(b for b in kv.pool.cached.values() if kv.pool.ref_cnt[b] == 0)
        steps += 1
        assert steps < 2000
    assert evictions == kv.pool.num_evictions
    assert kv.pool.num_free_blocks == num_blocks and not kv.block_tables
    assert all(r.is_finished and r.num_output_tokens == r.max_output_tokens for r in reqs)


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def tenant_prompts():
    recs = prefix_repetition_records(14, prefix_len=24, suffix_len=6, num_prefixes=3, zipf=1.0, scan_every=4,
                                     scan_len=40, vocab_size=250, seed=1)  # fmt: skip
    return [r.prompt for r in recs]


def test_greedy_outputs_are_the_same_under_every_policy(tiny_model, tenant_prompts):
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    args = dict(block_size=4, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64, num_gpu_blocks_override=24)
    outs, figures = {}, {}
    for policy in POLICIES:
        llm = LLM(model=str(tiny_model), enable_prefix_caching=True, prefix_cache_eviction=policy, **args)
        assert type(llm.llm_engine.kv.pool.policy) is eviction_policy_class(policy)
        outs[policy] = [o.outputs[0].token_ids for o in llm.generate(tenant_prompts, sp)]
        steps = [s.to_dict() for s in llm.llm_engine.recorder.steps]
        figures[policy] = summary = prefix_cache_summary(steps)
        assert summary["prefix_cache_evictions_total"] == llm.llm_engine.kv.pool.num_evictions > 0
        assert summary["prefix_cache_hits_total"] > 0 and summary["evicted_block_age_mean_steps"] >= 0
        assert all(s["prefix_cache_evictions"] == len(s["evicted_block_ages_steps"]) for s in steps)
    off = LLM(model=str(tiny_model), **args).generate(tenant_prompts, sp)
    for policy in POLICIES:  # only the cache hits differ
        assert outs[policy] == [o.outputs[0].token_ids for o in off], policy
    assert len({f["prefix_cache_hits_total"] for f in figures.values()}) > 1  # the policies do differ


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(prefix_cache_eviction="mru", enable_prefix_caching=True), r"'lru', 'fifo', 'lfu'.*package\.module"),
        (dict(prefix_cache_eviction="nosuch.module:X", enable_prefix_caching=True), "cannot load 'X'"),
        (dict(prefix_cache_eviction="collections:OrderedDict", enable_prefix_caching=True), "not a EvictionPolicy"),
        (dict(prefix_cache_eviction="lfu"), "--enable-prefix-caching"),
        (dict(prefix_cache_eviction=PLUGIN), "--enable-prefix-caching"),
    ],
)
def test_bad_policies_are_refused_before_the_model_loads(tiny_model, monkeypatch, args, match):
    import workbench.engine

    loads = []

    def no_load(*a, **k):
        loads.append(a)
        raise RuntimeError("the model was loaded")

    monkeypatch.setattr(workbench.engine, "make_executor", no_load)
    with pytest.raises(ValueError, match=match) as e:
        LLM(model=str(tiny_model), **args)
    assert "prefix_cache_eviction" in str(e.value) and not loads
    with pytest.raises(ValueError, match=match):
        EngineConfig(**args).validate()


def test_a_policy_that_picks_a_block_in_use_is_caught():
    class Bad(EvictionPolicy):
        def victim(self):
            return 0

    pool = BlockPool(2, "lru")
    pool.policy = Bad(2)
    pool.allocate(1)
    with pytest.raises(RuntimeError, match="not free"):
        pool.allocate(1)


# ------------------------------------------------------------------ the prompt set
def test_prefix_repetition_records_are_seeded_zipf_and_scanned():
    recs = prefix_repetition_records(2000, prefix_len=32, suffix_len=8, num_prefixes=5, zipf=1.2, seed=7)
    assert recs == prefix_repetition_records(2000, prefix_len=32, suffix_len=8, num_prefixes=5, zipf=1.2, seed=7)
    assert recs != prefix_repetition_records(2000, prefix_len=32, suffix_len=8, num_prefixes=5, zipf=1.2, seed=8)
    counts = [sum(r.id.startswith(f"t{k}-") for r in recs) for k in range(5)]
    assert counts == sorted(counts, reverse=True) and counts[0] > 3 * counts[4]  # 1 / (k+1)^1.2: ~6.9x
    by_tenant = {}
    for r in recs:
        assert len(r.prompt) == 40 and all(3 <= t < 1000 for t in r.prompt) and r.max_tokens is None
        by_tenant.setdefault(r.id.split("-")[0], set()).add(tuple(r.prompt[:32]))
    assert all(len(v) == 1 for v in by_tenant.values()) and len({min(v) for v in by_tenant.values()}) == 5
    uniform = prefix_repetition_records(3000, num_prefixes=3, prefix_len=4, suffix_len=1, seed=0)
    assert all(900 < sum(r.id.startswith(f"t{k}-") for r in uniform) < 1100 for k in range(3))
    scan = prefix_repetition_records(12, prefix_len=16, num_prefixes=2, scan_every=3, output_len=5, seed=0)
    assert [r.id.startswith("scan-") for r in scan] == [i % 3 == 2 for i in range(12)]
    assert all(len(r.prompt) == 64 for r in scan if r.id.startswith("scan-")) and scan[0].max_tokens == 5


@pytest.mark.parametrize(
    "kw, match",
    [(dict(num_prefixes=0), "num_prefixes=0"), (dict(zipf=-1.0), "zipf=-1.0"), (dict(scan_len=0), "scan_len=0")],
)
def test_prefix_repetition_records_refuse_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        prefix_repetition_records(4, **kw)


def test_workbench_run_takes_the_trace_and_the_plug_in(tiny_model, tmp_path):
    from workbench.cli.main import main

    args = ["run", "--model", str(tiny_model), "--dataset", "prefix-repetition", "--num-prompts", "10",
            "--prefix-repetition-prefix-len", "24", "--prefix-repetition-suffix-len", "4",
            "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-scan-every", "3",
            "--prefix-repetition-scan-len", "40", "--prefix-repetition-vocab-size", "250", "--max-tokens", "4",
            "--block-size", "4", "--max-model-len", "64", "--num-gpu-blocks-override", "24", "--max-num-seqs", "2",
            "--enable-prefix-caching", "--prefix-cache-eviction", PLUGIN, "--output-dir", str(tmp_path)]  # fmt: skip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "prefix-cache evictions" in res.output and "KV manager" in res.output
    (run_dir,) = list(tmp_path.iterdir())
    config = json.loads((run_dir / "config.json").read_text())
    assert config["prefix_cache_eviction"] == PLUGIN and config["dataset"].startswith("prefix-repetition {")
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert summary["prefix_cache_evictions_total"] == sum(s["prefix_cache_evictions"] for s in steps) > 0
    assert summary["prefix_cache_hits_total"] == sum(s["prefix_cache_hits"] for s in steps) > 0
    assert 0 < summary["prefix_cache_hit_rate_frac"] < 1 and summary["evicted_block_age_p50_steps"] is not None
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 10
    bad = CliRunner().invoke(main, ["run", "--model", str(tiny_model), "--prefix-cache-eviction", "fifo"])
    assert bad.exit_code != 0 and "--enable-prefix-caching" in bad.output
    # an option of the trace with another dataset is refused, not dropped; vLLM's spelling of the name is taken
    bad = CliRunner().invoke(main, ["run", "--model", str(tiny_model), "--prefix-repetition-prefix-len", "24"])
    assert bad.exit_code != 0 and "apply to dataset='prefix-repetition' only" in bad.output
    args[args.index("prefix-repetition")] = "prefix_repetition"
    again = CliRunner().invoke(main, args, catch_exceptions=False)
    assert again.exit_code == 0, again.output
    second = max(tmp_path.iterdir(), key=lambda d: d.stat().st_mtime)
    assert (second / "requests.jsonl").read_text().count("\n") == 10
