"""The built-in allocators of ``workbench/kv/``: best-fit contiguous placement and the binary buddy system.

Hand-counted unit tests (best-fit takes the smallest hole where first-fit takes the lowest; buddy splits, aligns,
rounds up to powers of two, coalesces back to its initial segments, covers a pool that is not a power of two); random
allocate/free schedules with the placement each rule predicts, invariants every step and nothing leaked (the
scheduler's random workloads in tests/test_kv_scheduler.py run over both as well); the accounting of the power-of-two
round-up and of buddy holes; and engine, simulator, lab and CLI runs whose greedy tokens equal paged's."""

from __future__ import annotations

import json
import random
import re

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench import LLM, SamplingParams
from workbench.config import BUILTIN_ALLOCATORS, KV_ALLOCATORS, EngineConfig
from workbench.kv import KVManager, make_kv_manager
from workbench.kv.best_fit import BestFitKVCacheManager
from workbench.kv.buddy import BuddyKVCacheManager
from workbench.kv.contiguous import ContiguousKVCacheManager, next_pow2
from workbench.metrics import waste_breakdown
from workbench.metrics.accounting import block_map, pool_usage

CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
NEW = ("best-fit", "buddy")
FACTORIES = {
    "orca-max": lambda n, bs: ContiguousKVCacheManager(n, bs, "orca-max"),  # first-fit, for contrast
    "best-fit": BestFitKVCacheManager,
    "buddy": BuddyKVCacheManager,
}


def _split(u) -> tuple[int, ...]:
    return tuple(getattr(u, c) for c in CATEGORIES)


def _check_steps(steps, pool):
    assert steps
    for s in steps:
        parts = [getattr(s, c) for c in CATEGORIES]
        assert sum(parts) == pool == s.num_blocks * s.block_size, s
        assert min(parts) >= 0, s


def _declare_blocks(kv, rid, blocks):
    """Declare a request whose orca-max reservation is exactly ``blocks`` blocks (prompt + max_tokens)."""
    tokens = blocks * kv.block_size
    assert kv.declare(rid, tokens - 1, 1, max_model_len=10_000) is None


# ------------------------------------------------------------------ registration
def test_both_names_are_registered_once_and_built_by_make_kv_manager():
    assert set(NEW) == set(BUILTIN_ALLOCATORS) and set(NEW) <= set(KV_ALLOCATORS)
    for name, cls in (("best-fit", BestFitKVCacheManager), ("buddy", BuddyKVCacheManager)):
        kv = make_kv_manager(EngineConfig(kv_allocator=name, block_size=8).validate(), 20)
        assert type(kv) is cls and kv.name == name and kv.num_blocks == 20 and kv.block_size == 8
        assert isinstance(kv, KVManager)
        assert not kv.enable_prefix_caching and not kv.supports_fork
        with pytest.raises(ValueError, match="needs kv_allocator='paged'"):
            EngineConfig(kv_allocator=name, enable_prefix_caching=True).validate()


# ------------------------------------------------------------------ best-fit
def test_best_fit_takes_the_smallest_hole_where_first_fit_takes_the_lowest():
    placed = {}
    for name in ("orca-max", "best-fit"):
        kv = FACTORIES[name](16, 4)
        for rid, blocks in (("A", 4), ("B", 1), ("C", 2), ("D", 1), ("E", 3), ("F", 1), ("G", 2), ("X", 2)):
            _declare_blocks(kv, rid, blocks)
        for rid in "ABCDEFG":
            assert kv.allocate_slots(rid, 1)
        assert kv.block_tables["G"] == [12, 13] and kv.free_runs() == [(14, 2)]
        for rid in ("A", "C", "E"):
            kv.free(rid)
        assert kv.free_runs() == [(0, 4), (5, 2), (8, 3), (14, 2)]
        assert kv.allocate_slots("X", 5)
        placed[name] = kv.block_tables["X"]
        kv.check_invariants()
    assert placed["orca-max"] == [0, 1]  # first fit: the lowest hole that holds 2 blocks (of 4)
    assert placed["best-fit"] == [5, 6]  # best fit: the smallest (2 blocks), the lowest of the two of size 2


def test_best_fit_keeps_orca_max_sizing_and_refusal():
    kv = BestFitKVCacheManager(10, 4)
    assert kv.name == "best-fit" and kv.allocator == "orca-max"
    assert kv.declare("a", 10, 20, max_model_len=64) is None and kv.reservation_blocks("a") == 8  # 30 tokens
    assert kv.declare("b", 10, 20, max_model_len=16) is None and kv.reservation_blocks("b") == 4  # capped
    assert kv.allocate_slots("a", 10) and not kv.allocate_slots("b", 10)  # 2 blocks free, 4 needed
    assert "b" not in kv.block_tables and kv.num_free_blocks == 2
    with pytest.raises(RuntimeError, match="reserved 32"):
        kv.allocate_slots("a", 33)
    u = pool_usage(kv, {"a": 10}, waiting_need_blocks=kv.reservation_blocks("b"))
    assert (u.external_fragmentation, u.free) == (8, 0)


# ------------------------------------------------------------------ buddy
def test_buddy_splits_the_smallest_block_and_aligns():
    kv = BuddyKVCacheManager(16, 4)
    assert kv.free_runs() == [(0, 16)] and kv.max_reservation_blocks == 16
    assert kv.allocate_slots("a", 4)  # 1 block: 16 -> 8 + 4 + 2 + 1 + [1]
    assert kv.block_tables["a"] == [0]
    assert kv.free_runs() == [(1, 1), (2, 2), (4, 4), (8, 8)]
    assert kv.allocate_slots("b", 9)  # 3 blocks -> 4: the free 4 at 4, not a split of the 8
    assert kv.block_tables["b"] == [4, 5, 6, 7]
    assert kv.allocate_slots("c", 8)  # 2 blocks: the free 2 at 2
    assert kv.block_tables["c"] == [2, 3]
    assert kv.allocate_slots("d", 4)  # 1 block: the free 1 at 1
    assert kv.free_runs() == [(8, 8)] and kv.num_free_blocks == 8
    for table in kv.block_tables.values():  # every run starts at a multiple of its power-of-two length
        assert len(table) == next_pow2(len(table)) and table[0] % len(table) == 0
    assert not kv.allocate_slots("e", 40)  # 10 blocks -> 16: none free
    assert "e" not in kv.block_tables and kv.num_free_blocks == 8
    assert kv.allocate_slots("none", 0) and "none" not in kv.block_tables  # no tokens: no block
    kv.check_invariants()


def test_buddy_coalesces_back_to_one_segment():
    kv = BuddyKVCacheManager(16, 1)
    for rid, n in (("a", 1), ("b", 1), ("c", 2), ("d", 4), ("e", 8)):
        assert kv.allocate_slots(rid, n)
    assert kv.free_runs() == [] and kv.num_free_blocks == 0
    kv.free("b")
    kv.free("d")
    assert kv.free_runs() == [(1, 1), (4, 4)]  # b's buddy a and d's buddy (a, b, c) are held: no merge
    kv.free("a")
    assert kv.free_runs() == [(0, 2), (4, 4)]  # a + b -> [0, 2)
    kv.free("c")
    assert kv.free_runs() == [(0, 8)]  # [0, 2) + c -> [0, 4), + d's -> [0, 8)
    kv.free("e")
    assert kv.free_runs() == [(0, 16)] and kv.num_free_blocks == 16 and not kv.block_tables
    kv.free("nobody")  # no-op
    kv.check_invariants()


@pytest.mark.parametrize(
    "n, segments",
    [(1, [(0, 1)]), (20, [(0, 16), (16, 4)]), (13, [(0, 8), (8, 4), (12, 1)]), (7, [(0, 4), (4, 2), (6, 1)])],
)
def test_buddy_covers_a_pool_that_is_not_a_power_of_two(n, segments):
    kv = BuddyKVCacheManager(n, 2)
    assert kv.free_runs() == segments and kv.num_free_blocks == n
    assert kv.max_reservation_blocks == segments[0][1]
    kv.check_invariants()
    # fill it block by block, then free in a shuffled order: never merged across segments, back to the start
    ids = [f"r{i}" for i in range(n)]
    for rid in ids:
        assert kv.allocate_slots(rid, 1)
    assert not kv.allocate_slots("more", 1) and kv.num_free_blocks == 0
    random.Random(n).shuffle(ids)
    for rid in ids:
        kv.free(rid)
        kv.check_invariants()
    assert kv.free_runs() == segments


def test_buddy_does_not_merge_across_segments():
    kv = BuddyKVCacheManager(12, 1)  # [0, 8) and [8, 12)
    assert kv.allocate_slots("a", 8) and kv.allocate_slots("b", 4)
    assert kv.block_tables["b"] == [8, 9, 10, 11]
    kv.free("a")
    kv.free("b")  # [8, 12)'s buddy would be [12, 16), outside the pool; [0, 8) and [8, 12) are not buddies
    assert kv.free_runs() == [(0, 8), (8, 4)]
    assert not kv.allocate_slots("c", 9)  # 9 blocks -> 16 > the largest segment
    kv.check_invariants()


def test_buddy_sizing_rounds_up_caps_at_the_largest_segment_and_refuses_what_never_fits():
    kv = BuddyKVCacheManager(20, 4)  # largest segment: 16 blocks = 64 tokens
    assert kv.declare("a", 10, 10, max_model_len=200) is None and kv.reservation_blocks("a") == 8  # 5 -> 8
    assert kv.declare("b", 10, 54, max_model_len=200) is None and kv.reservation_blocks("b") == 16  # writes 63
    assert kv.declare("b2", 10, 55, max_model_len=200) is None  # writes 64 slots: exactly the segment
    # writes up to 40 + 50 - 1 = 89 slots: the output is capped so that 40 + cap - 1 = 64
    assert kv.declare("c", 40, 50, max_model_len=200) == 25 and kv.reservation_blocks("c") == 16
    assert kv.declare("d", 64, 50, max_model_len=200) == 1  # the prompt fills the segment
    assert kv.declare("e", 40, 50, max_model_len=48) is None  # max_model_len bounds it below the segment
    assert kv.declare("f", 65, 5, max_model_len=200) is None  # never fits: the engine asks refuse() and ends it
    assert re.search(r"65 tokens .* at most 64 tokens .*num_gpu_blocks_override=32", kv.refuse(65))
    assert kv.refuse(64) is None and kv.refuse(1) is None
    assert kv.declare("g", 200, 5, max_model_len=200) is None  # the engine refuses a prompt >= max_model_len
    assert kv.reservation_blocks("nobody") == 0
    kv.forget("a")
    assert kv.reservation_blocks("a") == 0


def test_buddy_check_invariants_catches_a_corrupt_state():
    kv = BuddyKVCacheManager(8, 1)
    assert kv.allocate_slots("a", 2)
    kv.check_invariants()
    kv.free_lists[1].add(0)  # a held block also on a free list
    with pytest.raises(AssertionError, match="exactly once"):
        kv.check_invariants()
    kv.free_lists[1].discard(0)
    kv.free("a")
    assert kv.free_runs() == [(0, 8)]
    kv.free_lists[3].remove(0)
    kv.free_lists[2].update({0, 4})  # two free buddies left unmerged
    with pytest.raises(AssertionError, match="not coalesced"):
        kv.check_invariants()
    kv.free_lists[2].remove(0)
    kv.free_lists[2].add(1)  # a misaligned block
    with pytest.raises(AssertionError, match="aligned"):
        kv.check_invariants()


# ------------------------------------------------------------------ the accounting of buddy
def test_power_of_two_round_up_is_internal_fragmentation_from_admission():
    """prompt 10 + max_tokens 10: orca-max reserves 5 blocks of 4 (20 slots), buddy 8 (32). The request can write
    at most 10 + 10 - 1 = 19 slots: slots beyond that are internal fragmentation at once, those below it not yet
    written are reservation."""
    bound = {"a": 19}
    split = {}
    for name in ("orca-max", "buddy"):
        kv = FACTORIES[name](32, 4)
        assert kv.declare("a", 10, 10, max_model_len=1000) is None
        assert kv.allocate_slots("a", 10)
        split[name] = _split(pool_usage(kv, {"a": 10}, bound))
    assert split["orca-max"] == (10, 9, 20 - 19, 0, 128 - 20)
    assert split["buddy"] == (10, 9, 32 - 19, 0, 128 - 32)  # the round-up: 12 more slots of internal


def test_buddy_holes_are_external_fragmentation_only_where_no_aligned_block_fits():
    kv = BuddyKVCacheManager(16, 4)
    for rid in "abcd":
        _declare_blocks(kv, rid, 4)
        assert kv.allocate_slots(rid, 1)
    _declare_blocks(kv, "e", 6)  # 6 blocks -> 8
    assert kv.reservation_blocks("e") == 8
    kv.free("b")
    kv.free("c")  # [4, 8) and [8, 12): adjacent, 8 blocks free, but not buddies: no 8-aligned run
    assert kv.free_runs() == [(4, 4), (8, 4)]
    assert KVManager.free_runs(kv) == [(4, 8)]  # what merging by address would claim
    assert not kv.allocate_slots("e", 1)
    u = pool_usage(kv, {"a": 1, "d": 1}, waiting_need_blocks=kv.reservation_blocks("e"))
    assert (u.external_fragmentation, u.free) == (8 * 4, 0)  # every free slot is in a hole too small for e
    m = block_map(kv, {"a": 1, "d": 1}, kv.reservation_blocks("e"))
    assert m["allocator"] == "buddy" and m["state"] == ["used"] * 4 + ["external"] * 8 + ["used"] * 4
    kv.free("a")  # [0, 4) + [4, 8) -> [0, 8): e fits
    assert kv.free_runs() == [(0, 8), (8, 4)]
    u = pool_usage(kv, {"d": 1}, waiting_need_blocks=8)
    assert (u.external_fragmentation, u.free) == (4 * 4, 8 * 4)
    assert kv.allocate_slots("e", 1) and kv.block_tables["e"] == list(range(8))
    kv.check_invariants()


# ------------------------------------------------------------------ random schedules (hypothesis)
@pytest.mark.parametrize("allocator", ["orca-max", *NEW])
@settings(max_examples=80, deadline=None)
@given(
    num_blocks=st.integers(1, 70),
    block_size=st.sampled_from([1, 4, 16]),
    ops=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 400), st.integers(0, 80), st.integers(0, 10**6)),
                 max_size=60),
)  # fmt: skip
def test_random_allocate_free_schedules_place_by_their_rule_and_leak_nothing(allocator, num_blocks, block_size, ops):
    """Random reservations and releases straight on the manager: each admission lands where its rule says (first
    fit: the lowest hole that holds it; best fit and buddy: the smallest, then the lowest; buddy over power-of-two
    aligned free blocks), is refused exactly when no hole holds it (all free memory is then external
    fragmentation), invariants hold and the split sums to the pool every step, and after releasing everything the
    pool is as it started."""
    kv = FACTORIES[allocator](num_blocks, block_size)
    start_runs = kv.free_runs()
    mml = num_blocks * block_size
    computed: dict[str, int] = {}
    for i, (op, prompt, out, pick) in enumerate(ops):
        waiting = 0
        if op or not computed:
            rid = f"r{i}"
            try:
                kv.declare(rid, prompt, out + 1, mml)
            except ValueError:  # buddy: a prompt longer than the largest segment
                assert allocator == "buddy" and prompt > kv.max_reservation_blocks * block_size
                continue
            need = kv.reservation_blocks(rid)
            assert need >= 1 and (allocator != "buddy" or need == next_pow2(need))
            fits = [(n, s) for s, n in kv.free_runs() if n >= need]
            ok = kv.allocate_slots(rid, min(prompt, need * block_size))
            assert ok == bool(fits)
            if ok:
                expected = min(fits)[1] if allocator in NEW else min(s for _, s in fits)
                assert kv.block_tables[rid] == list(range(expected, expected + need))
                computed[rid] = min(prompt, need * block_size)
            else:
                waiting = need
                kv.forget(rid)
        else:
            rid = sorted(computed)[pick % len(computed)]
            kv.free(rid)
            kv.forget(rid)
            del computed[rid]
        kv.check_invariants()
        assert sum(len(t) for t in kv.block_tables.values()) + kv.num_free_blocks == num_blocks
        u = pool_usage(kv, computed, waiting_need_blocks=waiting)
        assert sum(_split(u)) == num_blocks * block_size and min(_split(u)) >= 0
        if waiting:
            assert u.free == 0 and u.external_fragmentation == kv.num_free_blocks * block_size
    for rid in list(computed):
        kv.free(rid)
    kv.check_invariants()
    assert not kv.block_tables and kv.num_free_blocks == num_blocks and kv.free_runs() == start_runs


# ------------------------------------------------------------------ the engine, on the tiny model
ARGS = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=64, max_model_len=64)


def _prompts(n, seed, lo=5, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(2, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def runs(tiny_model):
    """The same 12 prompts, greedy, through paged and the new allocators, on a 48-block pool (32 + 16 for buddy)
    small enough that requests wait for memory."""
    prompts = _prompts(12, 3)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in random.Random(4).choices(range(4, 24), k=12)]
    out = {}
    for name in ("paged", *NEW):
        llm = LLM(model=str(tiny_model), kv_allocator=name, num_gpu_blocks_override=48, block_map_every=1, **ARGS)
        out[name] = (llm, [o.outputs[0].token_ids for o in llm.generate(prompts, sps)], sps)
    return out


@pytest.mark.parametrize("name", NEW)
def test_engine_generates_what_paged_generates(runs, name):
    llm, got, sps = runs[name]
    assert got == runs["paged"][1] and [len(t) for t in got] == [sp.max_tokens for sp in sps]
    eng = llm.llm_engine
    assert eng.kv.name == name and eng.kv.num_blocks == 48
    steps = eng.recorder.steps
    _check_steps(steps, 48 * 4)
    assert any(s.num_waiting for s in steps)  # memory bound: requests waited for a hole
    # everything released and settled
    assert eng.kv.num_free_blocks == 48 and not eng.kv.block_tables and not eng.accounting.holding
    eng.kv.check_invariants()
    maps = eng.recorder.block_maps
    assert len(maps) == len(steps) and {m["allocator"] for m in maps} == {name}
    for m, s in zip(maps, steps):
        assert m["state"].count("used") == s.blocks_used and sum(m["filled"]) == s.token_states
        assert m["state"].count("external") * 4 == s.external_fragmentation
    w = waste_breakdown(steps)
    assert abs(sum(w["pool_share"].values()) - 1) < 1e-9 and w["used_share"]["token_states"] > 0


def test_engine_buddy_split_settles_the_round_up_as_internal_fragmentation(runs):
    """One request alone: prompt 10, max_tokens 10 -> reserve 20 tokens = 5 blocks -> 8 blocks = 32 slots. It
    writes 10 + 10 - 1 = 19: every step holds 19 - computed slots of reservation and 32 - 19 of internal."""
    eng = runs["buddy"][0].llm_engine
    eng.recorder.steps.clear()
    eng.add_request("solo", list(range(2, 12)), SamplingParams(max_tokens=10, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    steps = [s for s in eng.recorder.steps if s.num_running]
    assert steps and all(s.blocks_used == 8 for s in steps)
    for s in steps:
        assert (s.token_states + s.reservation, s.internal_fragmentation) == (19, 32 - 19)


def test_engine_buddy_caps_output_at_the_largest_segment_and_ends_a_longer_prompt_alone(tiny_model):
    """24 blocks of 4 = 16 + 8: a reservation holds at most 64 tokens though max_model_len is 96."""
    llm = LLM(model=str(tiny_model), kv_allocator="buddy", num_gpu_blocks_override=24, **(ARGS | {"max_model_len": 96}))
    (o,) = llm.generate([list(range(2, 42))], SamplingParams(max_tokens=50, ignore_eos=True))
    assert len(o.outputs[0].token_ids) == 64 - 40 + 1 and o.outputs[0].finish_reason == "length"
    # a prompt longer than the largest segment ends alone, with an error naming the limit and the fix; the
    # requests beside it run to their end
    outs = llm.generate([list(range(2, 72)), list(range(2, 12))], SamplingParams(max_tokens=4, ignore_eos=True))
    long, short = outs
    assert long.outputs[0].finish_reason == "error" and not long.outputs[0].token_ids
    assert "kv_allocator='buddy' reserves at most 64 tokens" in long.error
    assert "num_gpu_blocks_override=32" in long.error
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 4
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and not eng.kv._reserve  # nothing declared is left behind
    _check_steps(eng.recorder.steps, 24 * 4)


# ------------------------------------------------------------------ the simulator and the labs
def test_simulator_replays_a_trace_through_the_new_allocators():
    from workbench.catalog import MODELS
    from workbench.sim import SimEngine, SimSpec
    from workbench.sim.hardware import HARDWARE
    from workbench.sim.trace import TraceRequest

    spec = SimSpec(MODELS["llama-2-70b"], HARDWARE["A100-80GB"], 4)
    trace = [TraceRequest(0.01 * i, 20 + 37 * i, 10 + 13 * i, eos=i % 2 == 0) for i in range(10)]
    res = {}
    for name in ("paged", *NEW):
        eng = SimEngine(EngineConfig(kv_allocator=name, max_num_seqs=4, block_size=16), spec)
        eng.add_trace(trace)
        eng.run()
        assert eng.kv.name == name and not eng.has_unfinished_requests()
        _check_steps(eng.recorder.steps, eng.kv.pool_tokens)
        assert not eng.kv.block_tables and eng.kv.num_free_blocks == eng.kv.num_blocks
        eng.kv.check_invariants()
        res[name] = sorted((r.output_tokens, r.finish_reason) for r in eng.recorder.requests)
    assert res["best-fit"] == res["buddy"] == res["paged"]


@pytest.mark.parametrize("name", NEW)
def test_lab_run_and_panel_take_the_new_allocators(tiny_model, name):
    import ipywidgets

    from workbench import labs
    from workbench.labs.panel import _control

    assert _control("kv_allocator", name, ipywidgets).value == name  # the panels' dropdown offers it

    trace = labs.lab_trace(5, mean_output=6, max_output=12)
    records = [
        r.__class__(list(range(3, 3 + 10 + i)), False, r.id, r.max_tokens, r.output_len) for i, r in enumerate(trace)
    ]
    args = dict(model=str(tiny_model), max_model_len=128, num_gpu_blocks_override=40)
    res = labs.lab_run(records, kv_allocator=name, **args)
    ref = labs.lab_run(records, kv_allocator="paged", **args)
    assert [o.outputs[0].token_ids for o in res.outputs] == [o.outputs[0].token_ids for o in ref.outputs]
    _check_steps(res.recorder.steps, 40 * 16)


# ------------------------------------------------------------------ workbench run / compare (bundled model)
@pytest.mark.slow
def test_workbench_run_and_compare_cli_take_the_new_allocators(tmp_path):
    from workbench.cli.main import main

    args = ["--num-prompts", "2", "--max-tokens", "6", "--max-num-seqs", "2", "--max-model-len", "512"]
    for name in NEW:
        res = CliRunner().invoke(
            main, ["run", "--kv-allocator", name, *args, "--output-dir", str(tmp_path / name)], catch_exceptions=False
        )
        assert res.exit_code == 0, res.output
        (run_dir,) = list((tmp_path / name).iterdir())
        assert json.loads((run_dir / "config.json").read_text())["kv_allocator"] == name
        steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
        assert steps and all(sum(s[c] for c in CATEGORIES) == s["num_blocks"] * s["block_size"] for s in steps)
    r = CliRunner().invoke(
        main,
        ["compare", "--kv-allocator", "paged,orca-max,best-fit,buddy", *args, "--output-dir", str(tmp_path / "cmp")],
    )
    assert r.exit_code == 0, r.output
    (folder,) = (tmp_path / "cmp").iterdir()
    rows = json.loads((folder / "compare.json").read_text())
    assert [x["kv_allocator"] for x in rows] == ["paged", "orca-max", "best-fit", "buddy"]
    assert all(x["requests_finished"] == 2 for x in rows)


@pytest.mark.slow
def test_a_run_where_no_request_finished_fails(tmp_path):
    """Every prompt refused (the bundled model's chat prompts are longer than max_model_len=16 allows): the table and
    the reasons print, the exit code is 1."""
    from workbench.cli.main import main

    args = ["run", "--max-model-len", "16", "--num-prompts", "2", "--max-tokens", "2", "--output-dir", str(tmp_path)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1, r.output
    assert "none of the 2 requests finished; the reasons are above" in r.output and "refused" in r.output
