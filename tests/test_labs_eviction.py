"""Chapter 13's library (workbench.labs.ch13_eviction_policies, workbench.plugins.register_class): a notebook's policy class
registered and run by the engine, an engine's prefix cache reset to another policy equal to a fresh engine, the
free queue's order, the simulator's replay, the exercise's scenario and the panel."""

from __future__ import annotations

import pytest

from workbench.kv.eviction import EvictionPolicy, LRUPolicy
from workbench.labs import ch13_eviction_policies as ev
from workbench.metrics.stats import prefix_cache_summary
from workbench.plugins import register_class, registered

FIXTURE = "tests.fixtures.scan_resistant:ProtectedLRUPolicy"


class EmptyFirstLRU(EvictionPolicy):
    name = "empty-first"

    def victim(self) -> int:
        return next((b for b in self.free if not self.is_cached[b]), next(iter(self.free)))


def test_register_makes_a_notebook_class_loadable_by_name():
    from workbench.config import EngineConfig
    from workbench.kv.eviction import eviction_policy_class

    name = register_class(EmptyFirstLRU, EvictionPolicy)
    assert name == "workbench.plugins:EmptyFirstLRU"
    assert eviction_policy_class(name) is EmptyFirstLRU and registered(EvictionPolicy)["EmptyFirstLRU"] is EmptyFirstLRU
    EngineConfig(enable_prefix_caching=True, prefix_cache_eviction=name).validate()

    class EmptyFirstLRU2(EmptyFirstLRU):  # the cell edited and run again: same name, the new class
        pass

    EmptyFirstLRU2.__name__ = "EmptyFirstLRU"
    assert eviction_policy_class(register_class(EmptyFirstLRU2)) is EmptyFirstLRU2
    register_class(EmptyFirstLRU)
    with pytest.raises(TypeError, match="not a EvictionPolicy subclass"):
        register_class(int, EvictionPolicy)
    with pytest.raises(TypeError, match="takes a class"):
        register_class(EmptyFirstLRU(4))
    with pytest.raises(ValueError, match="cannot load 'Missing'.*run the code"):
        eviction_policy_class("workbench.plugins:Missing")


def test_exercise_scenario_under_each_policy():
    assert ev.next_victims("lru") == [2, 3, 1]  # the front of the queue: A's suffix, B's suffix, then sys 1
    assert ev.next_victims("fifo") == [0, 1, 2]  # cached first, first out: the system prompt
    assert ev.next_victims("lfu") == [2, 3, 7]  # the hit blocks last; ties: freed longest ago (X's tail)
    assert ev.next_victims(FIXTURE) == [2, 3, 1]  # one hit protects nothing (protect_hits = 2)
    rows = {r["block"]: r for r in ev.scenario_rows()}
    assert rows[0]["hits"] == rows[1]["hits"] == 1 and rows[7]["freed_order"] == 4 and rows[4]["freed_order"] == 7
    with pytest.raises(ValueError, match="unknown event"):
        ev.pool_after("lru", [("evict", "A")])


@pytest.mark.slow
def test_sim_replay_shows_lru_losing_the_hot_prompt_to_a_scan():
    traces = ev.sim_traces(num_prompts=120)
    rows = {(r["trace"], r["policy"]): r for r in ev.policy_rows(["lru", "lfu", FIXTURE], traces, sim=True)}
    for r in rows.values():
        assert r["saved_tokens"] <= r["queried_tokens"] and r["hit_rate"] == r["saved_tokens"] / r["queried_tokens"]
        assert len(r["requests"]) == 120
    scan = "tenants + scan"
    assert rows[(scan, "lru")]["tenant_hit_rate"] < rows[("tenants", "lru")]["tenant_hit_rate"]
    assert rows[(scan, "protected-lru")]["hot_hit_rate"] > rows[(scan, "lru")]["hot_hit_rate"]
    assert rows[(scan, "lfu")]["hot_hit_rate"] > rows[(scan, "lru")]["hot_hit_rate"]
    fig = ev.hot_tenant_figure([rows[(scan, "lru")], rows[(scan, "lfu")]], "t")
    assert [t.name for t in fig.data] == ["lru", "lfu"] and fig.layout.yaxis.title.text
    fig = ev.hit_rate_figure(list(rows.values()), "t")
    assert {t.name for t in fig.data} == {"tenants", scan} and fig.layout.xaxis.title.text
    assert "TTFT mean (simulated)" in str(ev.policy_table(list(rows.values()), simulated=True))
    pop = ev.popularity_figure(traces[scan], 1.1)
    assert "scan prompts" in pop.layout.title.text and pop.layout.yaxis.title.text == "requests"


@pytest.fixture(scope="module")
def llm():
    engine = ev.eviction_engine()
    yield engine
    engine.shutdown()


def _per_step(res):
    return [(s.prefix_cache_queries, s.prefix_cache_hits, s.evicted_block_ages_steps) for s in res.recorder.steps]


@pytest.mark.slow
def test_reset_prefix_cache_equals_a_fresh_engine(llm):
    from workbench.labs.runs import lab_run

    records = ev.tenant_trace(num_prompts=10, scan_every=3)
    name = register_class(EmptyFirstLRU, EvictionPolicy)
    for policy in ("lru", name):
        ev.real_run(llm, "lfu", records)  # leave another policy's cache behind
        reused = ev.real_run(llm, policy, records)
        fresh = lab_run(records, enable_prefix_caching=True, prefix_cache_eviction=policy, **ev.REAL_ENGINE)
        assert _per_step(reused) == _per_step(fresh)
        a = ev.run_figures(reused, policy, "x")
        b = ev.run_figures(fresh, policy, "x")
        assert {k: v for k, v in a.items() if k not in ("ttft_mean_ms", "requests")} == {
            k: v for k, v in b.items() if k not in ("ttft_mean_ms", "requests")
        }
        assert a["policy"] == ("lru" if policy == "lru" else "empty-first")
        steps = [s.to_dict() for s in reused.recorder.steps]
        assert a["evictions"] == prefix_cache_summary(steps)["prefix_cache_evictions_total"] > 0
        assert {r["request_id"] for r in a["requests"]} == {r.id for r in records}
    assert isinstance(llm.llm_engine.kv.pool.policy, EmptyFirstLRU)


@pytest.mark.slow
def test_free_queue_rows_follow_the_policy(llm):
    small = ev.tenant_trace(num_prompts=4, scan_every=4)
    ev.real_run(llm, "lru", small)
    rows = ev.free_queue_rows(llm, small)
    pool = llm.llm_engine.kv.pool
    assert isinstance(pool.policy, LRUPolicy)
    assert [r["block"] for r in rows] == list(pool.policy.free) and len(rows) == pool.num_blocks
    assert rows[0]["block"] == pool.allocate(1)[0]  # the first row is what the pool hands out next
    pool.free([rows[0]["block"]])
    assert any(r["content"].startswith("scan-3") for r in rows) and any("system prompt" in r["content"] for r in rows)
    ev.real_run(llm, "lfu", small)
    rows = ev.free_queue_rows(llm, small)
    firsts = [r["cached"] for r in rows]
    assert firsts == sorted(firsts)  # lfu: every empty block before any cached one
    assert "prefix-cached" in str(ev.free_queue_table(rows))


def test_reset_refuses_a_busy_or_uncached_engine(llm):
    with pytest.raises(ValueError, match="prefix_cache_eviction='nope'"):
        ev.reset_prefix_cache(llm, "nope")
    pool = llm.llm_engine.kv.pool
    b = pool.allocate(1)
    with pytest.raises(RuntimeError, match="idle"):
        ev.reset_prefix_cache(llm, "lru")
    pool.free(b)


def test_panel_runs_the_registered_policies():
    pytest.importorskip("ipywidgets")
    name = register_class(EmptyFirstLRU, EvictionPolicy)
    panel = ev.EvictionPanel(num_prompts=60)
    assert (("empty-first", name)) in panel.policy_options()
    row = panel.run(prefix_cache_eviction=name, scan_every=3, tenants=4)
    assert row["policy"] == "empty-first" and "empty-first: hit rate" in panel.status_text
    panel.run(prefix_cache_eviction="lru", scan_every=0)
    assert list(panel.figure.data[0].x) == ["1: empty-first, scan 1/3", "2: lru"]
    with pytest.raises(ValueError, match="unknown control"):
        panel.run(policy="lru")


@pytest.mark.slow
def test_panel_on_the_real_engine_runs_the_bundled_model(llm):
    """With ``llm`` the panel's Run is a real run of the bundled model on this CPU (no pool control: the engine's)."""
    pytest.importorskip("ipywidgets")
    panel = ev.EvictionPanel(num_prompts=8, llm=llm)
    assert "num_gpu_blocks_override" not in panel.controls and "this CPU" in panel.figure.layout.title.text
    row = panel.run(prefix_cache_eviction="lfu", scan_every=3, tenants=2)
    same = ev.run_figures(ev.real_run(llm, "lfu", ev.tenant_trace(3, num_prompts=8, num_prefixes=2)), "lfu", "scan")
    assert {k: row[k] for k in ("hit_rate", "saved_tokens", "evictions")} == {
        k: same[k] for k in ("hit_rate", "saved_tokens", "evictions")
    }
    assert row["saved_tokens"] > 0 and "(this CPU)" in panel.status_text
    assert list(panel.figure.data[0].x) == ["1: lfu, scan 1/3"]
