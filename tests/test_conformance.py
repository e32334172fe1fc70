"""The conformance check (workbench.conformance): every built-in and plug-in manager passes it; each kind
of bug it exists for is caught with a counterexample; a class defined at run time plugs in by name
(workbench.plugins.register_class); chapter 12's reference allocator, its buggy variants and exercise 12.1."""

from __future__ import annotations

import pytest

from tests.fixtures.lowest_first import LowestFirstKVManager
from workbench.config import EngineConfig
from workbench.conformance import Schedule, ScheduleRequest, check_kv_manager, run_schedule
from workbench.kv import make_kv_manager
from workbench.kv.interface import KVManager
from workbench.labs.ch12_your_own_allocator import DoubleHandNextFit, LeakyNextFit, NextFitKVManager, register_allocator


@pytest.mark.parametrize(
    "manager",
    ["paged", "orca-max", "static", "best-fit", "buddy", "tests.fixtures.my_alloc:MyAllocator",
     LowestFirstKVManager, NextFitKVManager],
)  # fmt: skip
def test_every_manager_passes_and_the_schedules_exercise_what_they_claim(manager):
    r = check_kv_manager(manager, schedules=40, seed=3)
    assert r and r.passed and r.failure is None and r.schedules == 40, str(r)
    c = r.counts
    assert c["steps"] > 500 and c["free"] > 40 and c["aborted"] > 0 and c["refused"] > 0
    if manager in ("paged", LowestFirstKVManager, NextFitKVManager):  # on demand: tight pools preempt
        assert c["preempted"] > 0
    assert "PASSED 40 random schedules" in str(r) and "nothing leaked" in str(r)


def test_same_seed_same_schedules():
    a, b = (check_kv_manager("paged", schedules=10, seed=5) for _ in range(2))
    assert a.counts == b.counts and str(a) == str(b)
    assert check_kv_manager("paged", schedules=10, seed=6).counts != a.counts


class _Refuser(LowestFirstKVManager):  # takes a block, then refuses: a refusal that changed the state
    def allocate_slots(self, request_id, num_total_tokens, cached_blocks=(), write_start=None):
        if num_total_tokens > 40 and self._free:
            self.block_tables.setdefault(request_id, []).append(self._free.pop(0))
            return False
        return super().allocate_slots(request_id, num_total_tokens)


class _Mover(NextFitKVManager):  # rebuilds a growing request's table elsewhere
    def allocate_slots(self, request_id, num_total_tokens, cached_blocks=(), write_start=None):
        old = self.block_tables.get(request_id)
        if old and -(-num_total_tokens // self.block_size) > len(old):
            self.free(request_id)
        return super().allocate_slots(request_id, num_total_tokens)


class _Short(NextFitKVManager):  # one block short of what it says yes to
    def allocate_slots(self, request_id, num_total_tokens, cached_blocks=(), write_start=None):
        return super().allocate_slots(request_id, max(0, num_total_tokens - self.block_size))


class _Raises(NextFitKVManager):
    def free(self, request_id):
        raise KeyError(request_id)


@pytest.mark.parametrize(
    "cls, problem",
    [
        (LeakyNextFit, "took num_free_blocks from"),
        (DoubleHandNextFit, "handed out twice"),
        (_Refuser, "returned False but changed the state"),
        (_Mover, "moved blocks the request already held"),
        (_Short, "returned True but the block table"),
        (_Raises, "the manager raised KeyError"),
    ],
)
def test_each_kind_of_bug_is_caught_with_a_shrunk_counterexample(cls, problem):
    r = check_kv_manager(cls, schedules=40, seed=3)
    assert not r and r.failure is not None and problem in r.failure.problem, str(r)
    text = str(r)
    assert "FAILED on schedule" in text and "schedule: pool" in text and problem in text
    assert len(r.failure.schedule.requests) <= 3  # shrunk: requests dropped while it still fails
    assert r.failure.calls and all(c.startswith("step") for c in r.failure.calls)


def test_a_leak_the_managers_own_invariants_miss_is_caught_at_the_end():
    class Hoarder(LowestFirstKVManager):  # free works, but the free count is a stale copy after the first free
        def free(self, request_id):
            super().free(request_id)
            self._free = self._free[:-1] if len(self._free) > 1 else self._free

    r = check_kv_manager(Hoarder, schedules=20, seed=1)
    assert not r and "num_free_blocks" in r.failure.problem


def test_run_schedule_runs_arrivals_aborts_and_preemption_on_a_hand_made_schedule():
    s = Schedule(
        (ScheduleRequest(30, 40), ScheduleRequest(30, 40), ScheduleRequest(10, 5, arrival_step=3, abort_step=4)),
        num_blocks=12, block_size=8, max_num_seqs=4, max_num_batched_tokens=64,
    )  # fmt: skip
    run = run_schedule(NextFitKVManager, s)
    assert run.counts["preempted"] > 0 and run.counts["aborted"] == 1
    assert run.kv.num_free_blocks == 12 and not run.kv.block_tables
    assert sum(r.status.name == "FINISHED_ABORTED" for r in run.requests) == 1


def test_a_name_that_does_not_load_is_refused_before_any_schedule():
    with pytest.raises(ValueError, match="kv_allocator"):
        check_kv_manager("nosuch.module:X")


# ------------------------------------------------------------------ classes defined at run time
def test_register_allocator_makes_a_run_time_class_loadable_by_name():
    class CellAllocator(NextFitKVManager):  # as if defined in a notebook cell
        name = "cell"

    name = register_allocator(CellAllocator)
    assert name == "workbench.plugins:CellAllocator"
    cfg = EngineConfig(kv_allocator=name, block_size=4).validate()
    kv = make_kv_manager(cfg, 10)
    assert type(kv) is CellAllocator and kv.num_blocks == 10 and kv.block_size == 4
    assert check_kv_manager(name, schedules=5)

    class CellAllocator(LowestFirstKVManager):  # the cell run again, changed: the name points to the newest
        pass

    assert register_allocator(CellAllocator) == name
    assert type(make_kv_manager(cfg, 10)) is CellAllocator
    assert register_allocator(CellAllocator, "Other").endswith(":Other")
    with pytest.raises(TypeError, match="KVManager subclass"):
        register_allocator(dict)
    for bad in ("register_class", "_x", "not an identifier"):
        with pytest.raises(ValueError, match="public identifier"):
            register_allocator(CellAllocator, bad)


def test_panel_dropdown_offers_a_plug_in_name():
    import ipywidgets

    from workbench.labs.panel import _allocator_options, _control

    name = register_allocator(NextFitKVManager)
    w = _control("kv_allocator", name, ipywidgets)
    assert w.value == name and w.options[-1] == name and "paged" in w.options
    assert _allocator_options("paged", "nonsense", name, name)[-1] == name
    assert "nonsense" not in _allocator_options("nonsense")


# ------------------------------------------------------------------ chapter 12's exercise
def test_a_skeleton_with_open_todos_is_unanswered(capsys):
    from workbench import labs

    class Skeleton(KVManager):
        def allocate_slots(self, request_id, num_total_tokens, cached_blocks=(), write_start=None):
            # TODO
            ...

        def free(self, request_id): ...

    assert not labs.check("12.1", Skeleton, schedules=5, seed=0)
    assert "not answered yet" in capsys.readouterr().out
    from workbench.labs.ch12_your_own_allocator import finished

    assert finished(Skeleton) is NextFitKVManager and finished(LowestFirstKVManager) is LowestFirstKVManager
