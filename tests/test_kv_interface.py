"""The KV-manager seam: a third manager written in tests/ against ``workbench.kv.interface.KVManager``
alone (tests/fixtures/lowest_first.py) runs everywhere the paged and contiguous managers do — the
engine, the accounting (split, waste breakdown, block maps), the simulator, ``workbench run`` /
``compare`` and the labs — and bad plug-in names are refused before any model loads."""

from __future__ import annotations

import ast
import inspect
import json
import random

import pytest
from click.testing import CliRunner

from tests.fixtures import lowest_first
from tests.fixtures.lowest_first import LowestFirstKVManager
from workbench import LLM, SamplingParams
from workbench.config import EngineConfig
from workbench.kv.interface import KVManager
from workbench.metrics import waste_breakdown
from workbench.metrics.accounting import block_map, pool_usage

PLUGIN = "tests.fixtures.lowest_first:LowestFirstKVManager"
CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")
ARGS = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96)


def _prompts(n, seed, lo=20, hi=40):
    rng = random.Random(seed)
    return [[rng.randrange(2, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _check_steps(steps):
    assert steps
    for s in steps:
        parts = [getattr(s, c) for c in CATEGORIES]
        assert sum(parts) == s.num_blocks * s.block_size, s
        assert min(parts) >= 0, s


# ------------------------------------------------------------------ the manager itself
def test_lowest_first_hands_out_the_lowest_free_blocks_on_demand():
    kv = LowestFirstKVManager(8, 4)
    assert isinstance(kv, KVManager) and kv.num_blocks == 8 and kv.pool_tokens == 32
    assert kv.allocate_slots("a", 6) and kv.block_tables["a"] == [0, 1]
    assert kv.allocate_slots("b", 5) and kv.block_tables["b"] == [2, 3]
    assert kv.allocate_slots("a", 8) and kv.block_tables["a"] == [0, 1]  # covered: nothing new
    assert kv.allocate_slots("a", 9) and kv.block_tables["a"] == [0, 1, 4]  # one block, as tokens need it
    kv.free("a")
    assert kv.num_free_blocks == 6 and "a" not in kv.block_tables
    assert kv.free_runs() == [(0, 2), (4, 4)] == KVManager.free_runs(kv)  # same as the interface default
    assert kv.allocate_slots("c", 12) and kv.block_tables["c"] == [0, 1, 4]  # the lowest first, not FIFO
    assert kv.slot_mapping("c", 7, 9) == [1 * 4 + 3, 4 * 4 + 0]
    assert not kv.allocate_slots("d", 20)  # 5 blocks, 3 free: refused, nothing changed
    assert "d" not in kv.block_tables and kv.num_free_blocks == 3
    assert kv.allocate_slots("d", 0) and "d" not in kv.block_tables  # no tokens: no block, no table
    kv.check_invariants()
    kv.free("nobody")  # no-op
    for r in ("b", "c"):
        kv.free(r)
    assert kv.num_free_blocks == 8 and not kv.block_tables and kv.free_runs() == [(0, 8)]
    kv.check_invariants()


def test_lowest_first_check_invariants_catches_a_corrupt_state():
    kv = LowestFirstKVManager(4, 2)
    assert kv.allocate_slots("a", 3) and kv.allocate_slots("b", 1)
    kv.check_invariants()
    kv.block_tables["b"].append(0)  # a block in two tables
    with pytest.raises(AssertionError):
        kv.check_invariants()
    kv.block_tables["b"].pop()
    kv.block_tables["x"] = [kv.free_runs()[0][0]]  # a used block still on the free list
    with pytest.raises(AssertionError):
        kv.check_invariants()


def test_lowest_first_keeps_the_interface_defaults():
    kv = LowestFirstKVManager(4, 2)
    assert kv.name == "lowest-first"
    assert not kv.enable_prefix_caching and not kv.supports_fork and not kv.may_share_blocks
    assert kv.declare("a", 10, 5, 64) is None and kv.reservation_blocks("a") == 0
    assert kv.find_cached_prefix([1, 2, 3, 4, 5]) == [] and kv.cached_free_blocks() == []
    assert not kv.can_swap_out("a") and kv.take_pending_copies() == []
    with pytest.raises(NotImplementedError, match="lowest-first"):
        kv.fork("a", "b", 2)


def test_lowest_first_uses_the_interface_alone_and_computes_no_figure():
    """The module imports nothing of workbench but the interface, and holds no accounting code."""
    imported, names = set(), set()
    for node in ast.walk(ast.parse(inspect.getsource(lowest_first))):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
        elif isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
    assert {m for m in imported if m and m.startswith("workbench")} == {"workbench.kv.interface"}
    methods = {n for n, v in vars(LowestFirstKVManager).items() if callable(v) or isinstance(v, property)}
    assert methods <= {"__init__", "num_blocks", "num_free_blocks", "allocate_slots", "free", "free_runs",
                       "check_invariants"}  # fmt: skip
    for word in ("usage", "fragmentation", "block_map", "token_states", "reservation", "accounting"):
        assert not [n for n in names if word in n.lower()], word


def test_accounting_reads_the_split_and_block_map_of_the_plug_in():
    kv = LowestFirstKVManager(8, 4)
    assert kv.allocate_slots("a", 6) and kv.allocate_slots("b", 3)
    u = pool_usage(kv, {"a": 6, "b": 3})
    assert (u.token_states, u.reservation, u.internal_fragmentation, u.external_fragmentation, u.free) == (
        9,
        0,
        3,
        0,
        20,
    )
    u = pool_usage(kv, {"a": 6, "b": 3}, final_bound={"a": 7, "b": 10})  # a may write 1 more, b 1 (block end)
    assert (u.reservation, u.internal_fragmentation) == (2, 1)
    m = block_map(kv, {"a": 6, "b": 3}, step=3)
    assert m["allocator"] == "lowest-first" and m["step"] == 3
    assert m["owner_ids"] == ["a", "b"] and m["owner"] == [0, 0, 1, -1, -1, -1, -1, -1]
    assert m["filled"][:3] == [4, 2, 3] and m["state"].count("used") == 3


# ------------------------------------------------------------------ the engine, on the tiny model
@pytest.fixture(scope="module")
def paged_and_plugin(tiny_model):
    """The same prompts, greedy, in a tight pool (preemption), paged and through the plug-in."""
    ps = _prompts(8, 1)
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    runs = {}
    for name in ("paged", PLUGIN):
        llm = LLM(model=str(tiny_model), kv_allocator=name, num_gpu_blocks_override=30, block_map_every=1, **ARGS)
        runs[name] = (llm, [o.outputs[0].token_ids for o in llm.generate(ps, sp)])
    return runs


def test_engine_with_the_plug_in_generates_what_paged_generates(paged_and_plugin):
    (_, ref), (llm, got) = paged_and_plugin["paged"], paged_and_plugin[PLUGIN]
    assert got == ref and all(len(t) == 30 for t in got)
    eng = llm.llm_engine
    assert type(eng.kv) is LowestFirstKVManager and eng.kv.num_blocks == 30
    steps = eng.recorder.steps
    _check_steps(steps)
    assert all(s.external_fragmentation == 0 for s in steps)
    assert all(s.num_blocks * s.block_size == 30 * 4 for s in steps)
    assert sum(s.num_preempted_recompute for s in steps) > 0  # the tight pool preempted, and it recovered
    # everything released and settled
    assert eng.kv.num_free_blocks == 30 and not eng.kv.block_tables and not eng.accounting.holding
    eng.kv.check_invariants()


def test_waste_breakdown_and_block_maps_of_the_plug_in(paged_and_plugin):
    llm, _ = paged_and_plugin[PLUGIN]
    rec = llm.llm_engine.recorder
    w = waste_breakdown(rec.steps)
    assert w["num_steps"] == len(rec.steps) > 0
    assert abs(sum(w["pool_share"].values()) - 1) < 1e-9
    assert abs(sum(w["used_share"].values()) - 1) < 1e-9
    assert w["used_share"]["external_fragmentation"] == 0 and w["used_share"]["token_states"] > 0.5
    maps = rec.block_maps
    assert len(maps) == len(rec.steps)
    assert {m["allocator"] for m in maps} == {"lowest-first"}
    for m, s in zip(maps, rec.steps):
        assert len(m["owner"]) == 30 and m["state"].count("used") == s.blocks_used
        assert "external" not in m["state"] and "cached" not in m["state"]
        assert sum(m["filled"]) == s.token_states
    # the same run's paged maps name their allocator too
    paged_maps = paged_and_plugin["paged"][0].llm_engine.recorder.block_maps
    assert paged_maps and {m["allocator"] for m in paged_maps} == {"paged"}


@pytest.mark.slow
def test_paged_only_features_are_refused_with_the_plug_in(tiny_model):
    for extra in ({"enable_prefix_caching": True}, {"preemption_mode": "swap", "swap_space": 0.001}):
        with pytest.raises(ValueError, match="needs kv_allocator='paged'"):
            LLM(model=str(tiny_model), kv_allocator=PLUGIN, **ARGS, **extra)
    llm = LLM(model=str(tiny_model), kv_allocator=PLUGIN, **ARGS)
    with pytest.raises(ValueError, match="parallel sampling"):
        llm.generate([[5, 6, 7]], SamplingParams(n=2, max_tokens=3))


@pytest.mark.slow
def test_parallel_sampling_split_has_no_negative_category(tiny_model):
    """n > 1 shares prompt blocks (fork) without prefix caching: the split must still count a
    shared block's token states once, so no category goes negative."""
    llm = LLM(model=str(tiny_model), **ARGS)
    llm.generate(_prompts(3, 2), SamplingParams(n=3, max_tokens=6, ignore_eos=True))
    _check_steps(llm.llm_engine.recorder.steps)


# ------------------------------------------------------------------ bad plug-in names
@pytest.mark.parametrize(
    "name, match",
    [
        ("nosuch.module:X", "cannot load 'X' from module 'nosuch.module'"),
        ("tests.fixtures.lowest_first:NoSuchClass", "cannot load 'NoSuchClass'"),
        ("collections:OrderedDict", "is not a KVManager subclass"),
    ],
)
def test_bad_plug_in_names_fail_clearly_before_the_model_loads(tiny_model, monkeypatch, name, match):
    import workbench.engine

    loads = []

    def no_load(*a, **k):  # the executor reads the model: it must never be reached
        loads.append(a)
        raise RuntimeError("the model was loaded")

    monkeypatch.setattr(workbench.engine, "make_executor", no_load)
    with pytest.raises(ValueError, match=match) as e:
        LLM(model=str(tiny_model), kv_allocator=name)
    assert name in str(e.value) and not loads


def test_bad_allocator_names_are_refused_by_the_config():
    with pytest.raises(ValueError, match="kv_allocator"):
        EngineConfig(kv_allocator="slab").validate()
    with pytest.raises(ValueError, match="kv_allocator"):
        EngineConfig(kv_allocator="a:b:c").validate()
    EngineConfig(kv_allocator=PLUGIN).validate()


# ------------------------------------------------------------------ the simulator
def test_simulator_replays_a_trace_through_the_plug_in():
    from workbench.catalog import MODELS
    from workbench.sim import SimEngine, SimSpec
    from workbench.sim.hardware import HARDWARE
    from workbench.sim.trace import TraceRequest

    spec = SimSpec(MODELS["llama-2-70b"], HARDWARE["A100-80GB"], 4)
    trace = [TraceRequest(0.01 * i, 20 + 7 * i, 10 + 3 * i, eos=i % 2 == 0) for i in range(8)]
    res = {}
    for name in ("paged", PLUGIN):
        eng = SimEngine(EngineConfig(kv_allocator=name, max_num_seqs=4, block_size=16), spec)
        eng.add_trace(trace)
        eng.run()
        assert not eng.has_unfinished_requests()
        reqs = eng.recorder.requests
        assert len(reqs) == len(trace) and all(r.finish_reason in ("stop", "length") for r in reqs)
        _check_steps(eng.recorder.steps)
        assert not eng.kv.block_tables and eng.kv.num_free_blocks == eng.kv.num_blocks
        res[name] = sorted((r.output_tokens, r.finish_reason) for r in reqs)
    assert type(eng.kv) is LowestFirstKVManager
    assert res[PLUGIN] == res["paged"]  # same lengths and reasons: the allocator changes no output


# ------------------------------------------------------------------ the labs
def test_lab_run_takes_the_plug_in(tiny_model):
    from workbench import labs

    trace = labs.lab_trace(5, mean_output=6, max_output=12)
    records = [
        r.__class__(list(range(3, 3 + 10 + i)), False, r.id, r.max_tokens, r.output_len) for i, r in enumerate(trace)
    ]
    args = dict(model=str(tiny_model), max_model_len=128, num_gpu_blocks_override=16)
    res = labs.lab_run(records, kv_allocator=PLUGIN, **args)
    ref = labs.lab_run(records, kv_allocator="paged", **args)
    assert res.summary["output_tokens_total"] == sum(r.max_tokens for r in records)
    assert [o.outputs[0].token_ids for o in res.outputs] == [o.outputs[0].token_ids for o in ref.outputs]
    _check_steps(res.recorder.steps)
    with pytest.raises(ValueError, match="nosuch"):
        labs.lab_run(records, kv_allocator="nosuch.module:X", **args)


# ------------------------------------------------------------------ workbench run / compare (bundled model)
@pytest.mark.slow
def test_workbench_run_cli_takes_the_plug_in(tmp_path):
    from workbench.cli.main import main

    args = ["--num-prompts", "2", "--max-tokens", "4", "--max-num-seqs", "2", "--max-model-len", "512"]
    res = CliRunner().invoke(
        main, ["run", "--kv-allocator", PLUGIN, *args, "--output-dir", str(tmp_path)], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    (run_dir,) = list(tmp_path.iterdir())
    assert json.loads((run_dir / "config.json").read_text())["kv_allocator"] == PLUGIN
    steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
    assert steps and all(sum(s[c] for c in CATEGORIES) == s["num_blocks"] * s["block_size"] for s in steps)
    assert all(s["external_fragmentation"] == 0 for s in steps)
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 2
    bad = CliRunner().invoke(main, ["run", "--kv-allocator", "nosuch.module:X", *args, "--output-dir", str(tmp_path)])
    assert bad.exit_code != 0 and "nosuch.module" in bad.output


@pytest.mark.slow
def test_compare_takes_the_plug_in(tmp_path):
    from workbench.bench.compare import compare

    small = dict(num_prompts=2, max_tokens=6, max_model_len=512, max_num_seqs=2, num_gpu_blocks_override=100)
    res = compare(allocators=["paged", PLUGIN], output_dir=tmp_path / "api", progress=False, **small)
    outs = {k: [o.outputs[0].token_ids for o in r.outputs] for k, r in res.results.items()}
    assert len(res.rows) == 2 and len(set(map(str, outs.values()))) == 1  # greedy: the same tokens
    for row in res.rows:
        assert row["requests_finished"] == 2 and row["external_fragmentation_used_frac"] == 0


@pytest.mark.slow
def test_compare_cli_takes_the_plug_in(tmp_path):
    from workbench.cli.main import main

    r = CliRunner().invoke(
        main,
        [
            "compare",
            "--kv-allocator",
            f"paged,{PLUGIN}",
            "--num-prompts",
            "2",
            "--max-tokens",
            "4",
            "--max-num-seqs",
            "2",
            "--max-model-len",
            "512",
            "--output-dir",
            str(tmp_path / "cli"),
        ],  # fmt: skip
    )
    assert r.exit_code == 0, r.output
    (folder,) = (tmp_path / "cli").iterdir()
    rows = json.loads((folder / "compare.json").read_text())
    assert [x["kv_allocator"] for x in rows] == ["paged", PLUGIN]
    name = PLUGIN.rsplit(":", 1)[1]  # a plug-in's variant and run folder go by its class name (no ':' in a path)
    assert [x["variant"] for x in rows] == ["paged", name] and (folder / name / "summary.json").is_file()
