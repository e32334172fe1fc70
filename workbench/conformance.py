"""The conformance check every KV manager must pass: the real scheduler over random seeded schedules.

:func:`check_kv_manager` takes a manager (a built-in or plug-in ``kv_allocator`` name, a
:class:`~workbench.kv.interface.KVManager` subclass, or any ``factory(num_blocks, block_size)``) and drives
:class:`workbench.scheduler.Scheduler` -- the engine's own, with a fake model that samples token 5, or the EOS
token 0 at random -- over small pools: requests arriving over time, chunked and whole prefills, decodes, preemption
by recompute when an on-demand pool runs out, requests aborted in any state, requests finishing. Every manager call
and every step is checked:

* ``allocate_slots`` that says ``False`` changed nothing (block tables, free count, free runs); one that says
  ``True`` backs the slots asked for and keeps the blocks the request already had, in place;
* ``free`` releases every block of the request (the free count goes up by its table's length) and nothing else;
* after each step: the manager's own ``check_invariants``; every block id inside the pool; no block in two block
  tables, or twice in one (the check never forks or caches prefixes, so no block may be shared); blocks held + free
  == the pool; only running requests hold blocks, and their tables cover their computed tokens; the slots of one
  step's writes are distinct; the accounting's five-way split (:func:`workbench.metrics.accounting.pool_usage`)
  sums to the pool with no negative part; no step schedules nothing while requests wait (deadlock);
* at the end: every request finished, no block table left, every block free, the free runs as at the start
  (nothing leaked).

The first failing schedule is shrunk (requests dropped while it still fails) and reported with the step, the
problem and the manager calls that led to it (:class:`ConformanceReport`). ``tests/test_kv_scheduler.py`` runs its
hypothesis-drawn workloads through :func:`run_schedule` and :func:`check_step`.
"""

from __future__ import annotations

import random
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from workbench.kv.interface import KVManager

Factory = Callable[[int, int], KVManager]
CATEGORIES = ("token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free")


class ConformanceError(AssertionError):
    """A manager broke a rule of the interface (the message says which, and where)."""


@dataclass(frozen=True)
class ScheduleRequest:
    """One request of a schedule: prompt and output cap (tokens), the step it arrives at, and the step it is
    aborted at (``None``: runs to its end, unless the fake model samples EOS)."""

    prompt_len: int
    max_tokens: int
    arrival_step: int = 0
    abort_step: int | None = None


@dataclass(frozen=True)
class Schedule:
    """A workload for the scheduler over a pool of ``num_blocks`` blocks of ``block_size`` slots.

    ``eos_every``: the fake model samples EOS with probability ``1/eos_every`` (0: never); ``seed`` seeds it.
    """

    requests: tuple[ScheduleRequest, ...]
    num_blocks: int
    block_size: int
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 64
    chunked: bool = True
    eos_every: int = 0
    seed: int = 0

    def describe(self) -> str:
        reqs = ", ".join(
            f"{i}: prompt {r.prompt_len} + max {r.max_tokens}"
            + (f" @step {r.arrival_step}" if r.arrival_step else "")
            + (f", aborted @step {r.abort_step}" if r.abort_step is not None else "")
            for i, r in enumerate(self.requests)
        )
        return (
            f"pool {self.num_blocks} blocks x {self.block_size} slots, max_num_seqs {self.max_num_seqs}, "
            f"budget {self.max_num_batched_tokens} tokens, chunked {self.chunked}, eos_every {self.eos_every}, "
            f"seed {self.seed};\n    requests [{reqs}]"
        )


def random_schedule(rng: random.Random, size: int = 10) -> Schedule:
    """A random schedule of 1 .. ``size`` requests over a pool that holds the longest of them, sometimes barely
    (so on-demand managers preempt)."""
    bs = rng.choice([1, 2, 4, 16])
    n = rng.randint(1, max(1, size))
    reqs = []
    for i in range(n):
        arrival = 0 if i == 0 or rng.random() < 0.6 else rng.randint(0, 12)
        abort = rng.randint(arrival, arrival + 30) if rng.random() < 0.2 else None
        reqs.append(ScheduleRequest(rng.randint(1, 60), rng.randint(1, 40), arrival, abort))
    longest = max(r.prompt_len + r.max_tokens for r in reqs)
    seqs = rng.randint(1, 8)
    return Schedule(
        tuple(reqs),
        num_blocks=-(-longest // bs) + rng.choice([0, 0, 1, 2, 5, 12]),
        block_size=bs,
        max_num_seqs=seqs,
        max_num_batched_tokens=rng.randint(seqs, max(seqs, 80)),
        chunked=rng.random() < 0.7,
        eos_every=rng.choice([0, 0, 5, 20]),
        seed=rng.randrange(10**6),
    )


# ------------------------------------------------------------------ the manager, watched
class _Watch:
    """Wraps a manager instance's ``allocate_slots`` and ``free`` (instance attributes, so the scheduler calls
    them): checks each call's contract and keeps a log of the calls."""

    def __init__(self, kv: KVManager) -> None:
        self.kv, self.step, self.log, self.counts = kv, 0, [], Counter()
        self._allocate, self._free = kv.allocate_slots, kv.free
        kv.allocate_slots, kv.free = self.allocate_slots, self.free

    def _state(self):
        kv = self.kv
        return {r: list(t) for r, t in kv.block_tables.items()}, kv.num_free_blocks, list(kv.free_runs())

    def _note(self, text: str) -> None:
        self.log.append((self.step, text))

    def allocate_slots(self, request_id, num_total_tokens, cached_blocks=(), write_start=None) -> bool:
        before = self._state()
        ok = self._allocate(request_id, num_total_tokens, cached_blocks, write_start)
        self._note(f"allocate_slots({request_id!r}, {num_total_tokens}) -> {ok}")
        self.counts["allocate_slots"] += 1
        kv = self.kv
        if not ok:
            self.counts["refused"] += 1
            if self._state() != before:
                raise ConformanceError(
                    f"allocate_slots({request_id!r}, {num_total_tokens}) returned False but changed the state: "
                    f"{_diff(before, self._state())}"
                )
            return ok
        table = kv.block_tables.get(request_id, [])
        if len(table) * kv.block_size < num_total_tokens:
            raise ConformanceError(
                f"allocate_slots({request_id!r}, {num_total_tokens}) returned True but the block table {table} "
                f"holds {len(table) * kv.block_size} slots"
            )
        old = before[0].get(request_id, [])
        if table[: len(old)] != old:
            raise ConformanceError(
                f"allocate_slots({request_id!r}, {num_total_tokens}) moved blocks the request already held: "
                f"{old} became {table}"
            )
        return ok

    def free(self, request_id) -> None:
        tables, free_before, _ = self._state()
        self._free(request_id)
        held = tables.get(request_id, [])
        self._note(f"free({request_id!r})" + (f" [held {len(held)} blocks]" if held else " [held none]"))
        self.counts["free"] += 1
        kv = self.kv
        if request_id in kv.block_tables and kv.block_tables[request_id]:
            raise ConformanceError(f"free({request_id!r}) left its block table {kv.block_tables[request_id]}")
        if kv.num_free_blocks != free_before + len(held):
            raise ConformanceError(
                f"free({request_id!r}) of {len(held)} blocks {held} took num_free_blocks from {free_before} to "
                f"{kv.num_free_blocks} (expected {free_before + len(held)})"
            )
        others = {r: t for r, t in kv.block_tables.items() if r != request_id}
        if others != {r: t for r, t in tables.items() if r != request_id}:
            raise ConformanceError(f"free({request_id!r}) changed other requests' block tables")


def _diff(before, after) -> str:
    out = []
    for name, a, b in zip(("block tables", "num_free_blocks", "free runs"), before, after):
        if a != b:
            out.append(f"{name} {a} -> {b}")
    return "; ".join(out)


# ------------------------------------------------------------------ the per-step checks
def check_step(kv: KVManager, sched, bounds: dict[str, int] | None = None) -> Any:
    """The invariants every manager keeps after a step (see the module docstring); raises
    :class:`ConformanceError`. Returns the accounting's split (:class:`~workbench.metrics.accounting.KVUsage`)
    with ``bounds`` (most slots each request can write), for further checks."""
    from workbench.metrics.accounting import pool_usage

    try:
        kv.check_invariants()
    except AssertionError as e:
        raise ConformanceError(f"the manager's own check_invariants failed: {e}") from None
    n = kv.num_blocks
    owner: dict[int, str] = {}
    for rid, table in kv.block_tables.items():
        for b in table:
            if not (isinstance(b, int) and 0 <= b < n):
                raise ConformanceError(f"block table of {rid!r} holds {b!r}, outside the pool 0..{n - 1}")
            if b in owner:
                who = "twice" if owner[b] == rid else f"and in {owner[b]!r}'s"
                raise ConformanceError(f"block {b} is in {rid!r}'s block table {who} (handed out twice)")
            owner[b] = rid
    if len(owner) + kv.num_free_blocks != n:
        raise ConformanceError(
            f"{len(owner)} blocks held + num_free_blocks {kv.num_free_blocks} != the pool's {n} blocks"
            + (" (blocks leaked)" if len(owner) + kv.num_free_blocks < n else "")
        )
    running = {r.request_id: r for r in sched.running}
    for rid, table in kv.block_tables.items():
        if table and rid not in running:
            raise ConformanceError(f"{rid!r} is not running but holds blocks {table} (not freed)")
    for rid, r in running.items():
        if len(kv.block_tables.get(rid, ())) * kv.block_size < r.num_computed_tokens:
            raise ConformanceError(f"running {rid!r} has {r.num_computed_tokens} tokens computed beyond its blocks")
    need = kv.reservation_blocks(sched.waiting[0].request_id) if sched.waiting else 0
    computed = {rid: r.num_computed_tokens for rid, r in running.items()}
    usages = []
    for bound in (bounds, None):
        u = pool_usage(kv, computed, bound, need)
        parts = {c: getattr(u, c) for c in CATEGORIES}
        if sum(parts.values()) != u.pool or u.pool != n * kv.block_size or min(parts.values()) < 0:
            raise ConformanceError(f"the five-way split {parts} does not sum to the pool's {n * kv.block_size} slots")
        usages.append(u)
    return usages[0]


def _check_writes(kv: KVManager, out) -> None:
    """The slots of one step's writes: backed, inside the pool, and never the same slot for two tokens."""
    seen: dict[int, str] = {}
    for s in out.scheduled:
        rid = s.request.request_id
        try:
            slots = kv.slot_mapping(rid, s.start, s.start + s.num_new_tokens)
        except (KeyError, IndexError):
            raise ConformanceError(f"{rid!r} was scheduled {s.num_new_tokens} tokens its blocks do not back") from None
        for slot in slots:
            if not 0 <= slot < kv.pool_tokens or slot in seen:
                raise ConformanceError(f"slot {slot} written by {rid!r} and {seen.get(slot)!r} in one step")
            seen[slot] = rid


# ------------------------------------------------------------------ one schedule
@dataclass
class ScheduleRun:
    """What :func:`run_schedule` returns: the requests (refused ones absent), steps run, the manager, counts."""

    requests: list
    steps: int
    kv: KVManager
    counts: Counter = field(default_factory=Counter)


def run_schedule(
    factory: Factory,
    schedule: Schedule,
    on_step: Callable[[KVManager, Any, Any], None] | None = None,
    watch: _Watch | None = None,
) -> ScheduleRun:
    """Run ``schedule`` through the real scheduler over ``factory(num_blocks, block_size)``, checking every call
    and step; ``on_step(kv, scheduler, usage)`` adds checks after each step. Raises :class:`ConformanceError`."""
    from workbench.request import Request, RequestStatus
    from workbench.sampling import SamplingParams
    from workbench.scheduler import Scheduler

    bs, nb = schedule.block_size, schedule.num_blocks
    kv = factory(nb, bs)
    start_runs = list(kv.free_runs())
    watch = watch or _Watch(kv)
    rng = random.Random(schedule.seed)
    sched = Scheduler(
        kv, schedule.max_num_seqs, schedule.max_num_batched_tokens, enable_chunked_prefill=schedule.chunked
    )
    mml = nb * bs
    pending = sorted(enumerate(schedule.requests), key=lambda x: x[1].arrival_step)
    reqs, bounds, aborts, counts = [], {}, {}, watch.counts
    limit = (
        sum(r.prompt_len + r.max_tokens for r in schedule.requests) * 4
        + 100
        + max((r.arrival_step for r in schedule.requests), default=0)
    )
    step = 0
    while pending or sched.has_unfinished():
        watch.step = step
        while pending and pending[0][1].arrival_step <= step:
            i, spec = pending.pop(0)
            rid = str(i)
            try:  # the engine's add_request: the manager sizes the request before it is queued
                cap = kv.declare(rid, spec.prompt_len, spec.max_tokens, mml)
            except ValueError:
                counts["refused requests"] += 1
                continue
            if kv.refuse(spec.prompt_len):  # a prompt it can never place: the engine ends the request at once
                kv.forget(rid)
                counts["refused requests"] += 1
                continue
            max_tokens = spec.max_tokens if cap is None else min(spec.max_tokens, cap)
            r = Request(
                rid,
                [7] * spec.prompt_len,
                SamplingParams(max_tokens=max_tokens),
                float(step),
                eos_token_id=0,
                max_total_len=mml,
            )
            reqs.append(r)
            bounds[rid] = r.num_prompt_tokens + r.max_output_tokens - 1
            if spec.abort_step is not None:
                aborts[rid] = (spec.abort_step, r)
            sched.add_request(r)
        for rid, (at, r) in list(aborts.items()):
            if at <= step and not r.is_finished:
                watch._note(f"abort {rid!r} ({r.status.name.lower()})")
                sched.finish(r, RequestStatus.FINISHED_ABORTED)
                kv.forget(rid)
                counts["aborted"] += 1
                del aborts[rid]
        out = sched.schedule()
        if not out.scheduled and (sched.waiting or sched.running):
            raise ConformanceError(
                f"a step scheduled nothing while {len(sched.waiting)} requests wait and {len(sched.running)} run "
                "(deadlock: nothing will ever free a block)"
            )
        _check_writes(kv, out)
        counts["preempted"] += len(out.preempted)
        sampled = {
            s.request.request_id: (0 if schedule.eos_every and rng.random() < 1 / schedule.eos_every else 5)
            for s in out.scheduled
            if s.samples
        }
        for r in sched.update(out, sampled, now=float(step)):
            kv.forget(r.request_id)
        u = check_step(kv, sched, bounds)
        if on_step is not None:
            on_step(kv, sched, u)
        step += 1
        counts["steps"] += 1
        if step > limit:
            raise ConformanceError(f"requests did not finish in {limit} steps")
    if kv.block_tables and any(kv.block_tables.values()):
        raise ConformanceError(f"every request ended but block tables remain: {dict(kv.block_tables)} (leaked)")
    if kv.num_free_blocks != nb:
        raise ConformanceError(f"every request ended but num_free_blocks is {kv.num_free_blocks} of {nb} (leaked)")
    if list(kv.free_runs()) != start_runs:
        raise ConformanceError(f"every request ended but the free runs are {kv.free_runs()}, not {start_runs}")
    return ScheduleRun(reqs, step, kv, counts)


# ------------------------------------------------------------------ the check
@dataclass
class Counterexample:
    """The first (shrunk) schedule a manager failed: where, what, and the manager calls before it."""

    schedule: Schedule
    step: int
    problem: str
    calls: list[str]

    def __str__(self) -> str:
        lines = [f"  schedule: {self.schedule.describe()}", f"  at step {self.step}: {self.problem}"]
        if self.calls:
            lines.append("  the manager calls before it:")
            lines += [f"    {c}" for c in self.calls]
        return "\n".join(lines)


@dataclass
class ConformanceReport:
    """What :func:`check_kv_manager` found: true when every schedule passed.

    Attributes:
        allocator: the manager's name.
        passed: every schedule passed.
        schedules: schedules run (up to and including the first failure).
        counts: manager calls and events over the schedules (``allocate_slots``, ``refused``, ``free``,
            ``preempted``, ``aborted``, ``steps``, ...).
        failure: the first counterexample, shrunk, or ``None``.
    """

    allocator: str
    passed: bool
    schedules: int
    counts: Counter
    failure: Counterexample | None = None

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        c = self.counts
        what = (
            f"{c['steps']:,} steps, {c['allocate_slots']:,} allocate_slots ({c['refused']:,} refused), "
            f"{c['free']:,} free, {c['preempted']:,} preemptions, {c['aborted']:,} aborts"
        )
        if self.passed:
            return f"{self.allocator}: PASSED {self.schedules} random schedules, nothing leaked\n    ({what})"
        return f"{self.allocator}: FAILED on schedule {self.schedules}; the failing schedule, shrunk:\n{self.failure}"

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(str(self))


def _resolve(manager) -> tuple[Factory, str]:
    if isinstance(manager, str):
        from workbench.config import EngineConfig
        from workbench.kv import make_kv_manager, plugin_class

        EngineConfig(kv_allocator=manager).validate()  # an unknown name fails here, named
        if ":" in manager:
            plugin_class(manager)  # and a plug-in that does not load
        return (lambda n, bs: make_kv_manager(EngineConfig(kv_allocator=manager, block_size=bs), n)), manager
    name = getattr(manager, "name", None)
    if not isinstance(name, str):
        name = getattr(manager, "__name__", None) or getattr(getattr(manager, "fn", None), "__name__", repr(manager))
    return manager, name


def _attempt(factory: Factory, schedule: Schedule) -> tuple[Counter, Counterexample | None]:
    """Run one schedule on a fresh, watched manager: its counts, and the counterexample if it failed."""
    watch = None
    try:
        kv = factory(schedule.num_blocks, schedule.block_size)
        watch = _Watch(kv)
        return run_schedule(lambda n, bs: kv, schedule, watch=watch).counts, None
    except Exception as e:  # a ConformanceError, or the manager's own exception: both fail the schedule
        if isinstance(e, ConformanceError):
            problem = str(e)
        else:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            problem = f"the manager raised {type(e).__name__}: {e} (in {frame.name}, line {frame.lineno})"
        counts = watch.counts if watch else Counter()
        calls = _collapse(watch.log)[-10:] if watch else []
        return counts, Counterexample(schedule, watch.step if watch else 0, problem, calls)


def _collapse(log: list[tuple[int, str]]) -> list[str]:
    """``step N: call`` lines, a call repeated over consecutive steps written once (``steps 4-9: ... (6 times)``)."""
    out: list[list] = []
    for step, text in log:
        if out and out[-1][2] == text and out[-1][1] == step - 1:
            out[-1][1], out[-1][3] = step, out[-1][3] + 1
        else:
            out.append([step, step, text, 1])
    return [f"step {a}: {t}" if k == 1 else f"steps {a}-{b}: {t} ({k} times)" for a, b, t, k in out]


def _shrink(factory: Factory, schedule: Schedule, failure: Counterexample) -> Counterexample:
    """Drop requests one at a time while the schedule still fails; the smallest failure found."""
    changed = True
    while changed and len(schedule.requests) > 1:
        changed = False
        for i in range(len(schedule.requests)):
            smaller = replace(schedule, requests=schedule.requests[:i] + schedule.requests[i + 1 :])
            _, f = _attempt(factory, smaller)
            if f is not None:
                schedule, failure, changed = smaller, f, True
                break
    return failure


def check_kv_manager(
    manager: str | type[KVManager] | Factory, schedules: int = 50, seed: int = 0, size: int = 10
) -> ConformanceReport:
    """Run ``schedules`` random seeded schedules (:func:`random_schedule`, up to ``size`` requests) through the
    real scheduler over the manager, checking every call and step (module docstring).

    Args:
        manager: a ``kv_allocator`` name (``"paged"``, ``"best-fit"``, ``"package.module:ClassName"``), a
            :class:`~workbench.kv.interface.KVManager` subclass, or a ``factory(num_blocks, block_size)``.
        schedules: how many schedules; the first ones are small (fewer requests), later ones up to ``size``.
        seed: seeds the schedules (same seed, same schedules).

    Returns:
        A :class:`ConformanceReport` (true when every schedule passed; else the first counterexample, shrunk).
    """
    factory, name = _resolve(manager)
    rng = random.Random(seed)
    total = Counter()
    for i in range(schedules):
        schedule = random_schedule(rng, size=min(size, 2 + i // 2))
        counts, failure = _attempt(factory, schedule)
        total.update(counts)
        if failure is not None:
            return ConformanceReport(name, False, i + 1, total, _shrink(factory, schedule, failure))
    return ConformanceReport(name, True, schedules, total)
