"""Chapter 12: your own allocator -- written against the KV-manager interface, checked, plugged in by name.

- :class:`NextFitKVManager`: the chapter's reference allocator (the solution of the notebook's skeleton):
  on-demand blocks like paged, taken *next-fit* -- the search for a free block starts after the block handed out
  last and wraps around, so the used blocks rotate through the pool instead of packing at its bottom;
- :class:`LeakyNextFit`, :class:`DoubleHandNextFit`: the same with one bug each, which the conformance check
  (:func:`workbench.conformance.check_kv_manager`) catches with a counterexample;
- :func:`call_trace`: every interface call the scheduler makes during a real run, step by step;
- :func:`compare_runs`, :func:`block_maps_figure`: the same requests through paged, first-fit ``orca-max``,
  best-fit, buddy and yours -- waste breakdown and block maps side by side;
- :func:`finished`: the learner's class once its TODOs are filled in, else the reference.

A class defined in a notebook cell plugs in by name through :func:`register_allocator`
(:func:`workbench.plugins.register_class`).
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Sequence
from typing import Any

from workbench.conformance import ConformanceReport, check_kv_manager
from workbench.kv.interface import KVManager
from workbench.labs.exercise_registry import _register
from workbench.labs.runs import lab_run, lab_trace
from workbench.plugins import register_class
from workbench.viz.table import Column, Table

__all__ = [
    "DoubleHandNextFit",
    "EXERCISE_CONTEXT",
    "LeakyNextFit",
    "NextFitKVManager",
    "block_maps_figure",
    "call_trace",
    "check",
    "compare_runs",
    "finished",
    "interface_table",
    "register_allocator",
]


def register_allocator(cls: type[KVManager], name: str | None = None) -> str:
    """Make a :class:`~workbench.kv.interface.KVManager` subclass defined in a notebook cell loadable as
    ``kv_allocator="workbench.plugins:<name>"`` and return that name (:func:`workbench.plugins.register_class`;
    ``TypeError`` for a class that is not a KVManager, ``ValueError`` for a bad name)."""
    return register_class(cls, KVManager, name)


#: the context of exercise 12.1 (the conformance check's schedules and seed)
EXERCISE_CONTEXT = {"schedules": 40, "seed": 11}


# ---------------------------------------------------------------- the reference allocator
class NextFitKVManager(KVManager):
    """On-demand block allocation, next-fit: each new block is the first free one after the last handed out.

    Args:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks-1``).
        block_size: token slots per block.
    """

    name = "next-fit"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self._num_blocks = num_blocks
        self.is_free = [True] * num_blocks  # is_free[b]: no request holds block b
        self.cursor = 0  # where the search for the next free block starts
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        return sum(self.is_free)

    def _next_free(self) -> int:
        for i in range(self._num_blocks):
            b = (self.cursor + i) % self._num_blocks
            if self.is_free[b]:
                return b
        raise RuntimeError("no free block")  # never: allocate_slots checks the count first

    def allocate_slots(self, request_id, num_total_tokens, cached_blocks=(), write_start=None) -> bool:
        table = self.block_tables.get(request_id, [])
        need = -(-num_total_tokens // self.block_size) - len(table)  # blocks still missing
        if need <= 0:
            return True
        if need > self.num_free_blocks:
            return False  # refuse, changing nothing
        for _ in range(need):
            b = self._next_free()
            self.is_free[b] = False
            table.append(b)
            self.cursor = (b + 1) % self._num_blocks
        self.block_tables[request_id] = table
        return True

    def free(self, request_id) -> None:
        for b in self.block_tables.pop(request_id, []):
            self.is_free[b] = True

    def check_invariants(self) -> None:
        held = [b for t in self.block_tables.values() for b in t]
        assert len(held) == len(set(held)), "a block in two tables"
        assert all(not self.is_free[b] for b in held), "a held block is marked free"
        assert len(held) + self.num_free_blocks == self._num_blocks, "blocks neither held nor free"


class LeakyNextFit(NextFitKVManager):
    """A bug: ``free`` forgets a request's last block (it stays marked used: leaked)."""

    name = "leaky next-fit"

    def free(self, request_id) -> None:
        for b in self.block_tables.pop(request_id, [])[:-1]:
            self.is_free[b] = True

    def check_invariants(self) -> None:  # its author's check only looks at the tables
        held = [b for t in self.block_tables.values() for b in t]
        assert len(held) == len(set(held)), "a block in two tables"


class DoubleHandNextFit(NextFitKVManager):
    """A bug: a new block is the one at the cursor, free or not (after a wrap-around it may already be held)."""

    name = "double-hand next-fit"

    def _next_free(self) -> int:
        return self.cursor

    def check_invariants(self) -> None:  # its author's check only counts
        assert self.num_free_blocks <= self._num_blocks, "more free blocks than the pool"


def finished(cls: type[KVManager]) -> type[KVManager]:
    """``cls`` if none of its methods is still a stub (a body of only ``...``), else :class:`NextFitKVManager`
    (printing which one the rest of the chapter uses)."""
    from workbench.labs.exercise_registry import _is_stub

    stubs = [n for n, v in vars(cls).items() if _is_stub(v)]
    if stubs:
        print(
            f"{cls.__name__} still has TODOs ({', '.join(stubs)}): the rest of the chapter uses the reference,\n"
            f"    {NextFitKVManager.__module__}.NextFitKVManager"
        )
        return NextFitKVManager
    print(f"the rest of the chapter uses your {cls.__name__}")
    return cls


def check(manager, schedules: int = 40, seed: int = 0) -> ConformanceReport:
    """:func:`~workbench.conformance.check_kv_manager`, printed and returned."""
    report = check_kv_manager(manager, schedules=schedules, seed=seed)
    print(report)
    return report


# ---------------------------------------------------------------- the interface, as the scheduler uses it
#: the interface's methods, who calls them and when (the rows of :func:`interface_table`)
INTERFACE = (
    ("num_blocks, num_free_blocks, block_size", "engine, accounting", "every step: the pool and what is free"),
    ("block_tables", "scheduler, model runner", "every step: each request's blocks, in logical order"),
    (
        "allocate_slots(id, n)",
        "scheduler",
        "admission, each prefill chunk, a decode that crosses a block boundary; False = wait or preempt",
    ),
    ("free(id)", "scheduler", "a request finishes, is aborted, or is preempted by recompute"),
    ("declare(id, ...), forget(id)", "engine", "before a request is queued / after it ends (reserving managers)"),
    ("reservation_blocks(id), free_runs()", "accounting", "external fragmentation: holes too small for the next"),
    ("check_invariants()", "tests, conformance check", "after every step"),
)


def interface_table(counts: Counter | None = None) -> Table:
    """The methods a manager implements, who calls them and when; with ``counts`` (from :func:`call_trace`),
    how often a real run called each."""
    rows = []
    for method, who, when in INTERFACE:
        row = {"method": method, "who": who, "when": when}
        if counts is not None:
            key = method.split("(")[0]
            row["calls"] = str(counts[key]) if key in ("allocate_slots", "free", "declare") else ""
        rows.append(row)
    cols = [
        Column("method", "method", align="left"),
        Column("who", "called by", align="left"),
        Column("when", "when", align="left", prose=True),
    ]
    if counts is not None:
        cols.append(Column("calls", "calls in the run"))
    return Table(cols, rows, title="The KV-manager interface: what the engine calls")


def call_trace(allocator: type[KVManager] = NextFitKVManager, records=None, **engine_args: Any) -> dict[str, Any]:
    """A real run through ``allocator`` with every ``declare``, ``allocate_slots`` and ``free`` call recorded.

    Default: 3 requests of :func:`~workbench.labs.runs.lab_trace` (outputs up to 6 tokens) over a pool of
    ``num_gpu_blocks_override=12`` blocks of 16 tokens (so that a request waits for memory).

    Returns:
        ``{"calls": [{"step", "method", "request", "tokens", "result", "free_after"}], "counts": Counter,
        "result": JobResult}``; ``step`` is the engine step the call belongs to.
    """
    calls: list[dict[str, Any]] = []
    box = {"step": 0}

    class Traced(allocator):  # a subclass that records its calls (the allocator's code runs unchanged)
        def declare(self, request_id, num_prompt_tokens, max_tokens, max_model_len, true_output_len=None):
            out = super().declare(request_id, num_prompt_tokens, max_tokens, max_model_len, true_output_len)
            calls.append(_call(box, "declare", request_id, num_prompt_tokens, out, self))
            return out

        def allocate_slots(self, request_id, num_total_tokens, cached_blocks=(), write_start=None):
            ok = super().allocate_slots(request_id, num_total_tokens, cached_blocks, write_start)
            calls.append(_call(box, "allocate_slots", request_id, num_total_tokens, ok, self))
            return ok

        def free(self, request_id):
            held = len(self.block_tables.get(request_id, []))
            super().free(request_id)
            calls.append(_call(box, "free", request_id, None, f"{held} blocks back", self))

    Traced.__name__ = Traced.__qualname__ = f"Traced{allocator.__name__}"
    name = register_allocator(Traced)

    class _Steps:  # a recorder sink: the step number of the calls that follow
        def on_step(self, s) -> None:
            box["step"] = s.step + 1

        def on_block_map(self, m) -> None:
            pass

        def on_request(self, r) -> None:
            pass

        def close(self) -> None:
            pass

    records = list(records) if records is not None else lab_trace(3, mean_output=4, max_output=6)
    args = {"num_gpu_blocks_override": 12, "block_size": 16, "max_model_len": 192} | engine_args
    res = lab_run(records, kv_allocator=name, sinks=[_Steps()], **args)
    counts = Counter(c["method"] for c in calls)
    return {"calls": calls, "counts": counts, "result": res}


def _call(box, method, rid, tokens, result, kv) -> dict[str, Any]:
    return {
        "step": box["step"],
        "method": method,
        "request": rid,
        "tokens": tokens,
        "result": result,
        "table": list(kv.block_tables.get(rid, [])),
        "free_after": kv.num_free_blocks,
    }


def calls_table(calls: Sequence[dict[str, Any]], limit: int = 24) -> Table:
    """The first ``limit`` calls of :func:`call_trace`: step, method, request, tokens, result, its block table
    and the free blocks after the call."""
    short = {}

    def rid(v: str) -> str:  # the trace's ids are long: r0, r1, ... in order of appearance
        return short.setdefault(v, f"r{len(short)}")

    rows = [c | {"request": rid(c["request"])} for c in calls[:limit]]
    return Table(
        [
            Column("step", "step"),
            Column("method", "method", align="left"),
            Column("request", "request", align="left"),
            Column("tokens", "tokens", lambda v: "" if v is None else str(v)),
            Column("result", "returned", str, align="left"),
            Column("table", "its block table after", lambda t: str(t) if t else "-", align="left"),
            Column("free_after", "free blocks after"),
        ],
        rows,
        title=f"The manager's calls in a real run (the first {len(rows)} of {len(calls)})",
    )


# ---------------------------------------------------------------- side by side
ALLOCATORS = ("paged", "orca-max", "best-fit", "buddy")


def compare_runs(mine: str, records=None, allocators: Sequence[str] = ALLOCATORS, **engine_args: Any) -> dict:
    """The same requests through the built-in ``allocators`` and ``mine`` (a ``kv_allocator`` name); real runs
    with a block map every step. Default trace: :func:`~workbench.labs.runs.lab_trace` (10 requests), a pool of
    48 blocks of 16 tokens. Returns ``{label: JobResult}`` (``mine`` labelled by its manager's ``name``)."""
    from workbench.kv import plugin_class

    records = list(records) if records is not None else lab_trace()
    args = {"num_gpu_blocks_override": 48, "block_map_every": 1} | engine_args
    out = {a: lab_run(records, kv_allocator=a, **args) for a in allocators}
    label = getattr(plugin_class(mine), "name", mine) if ":" in mine else mine
    out[label] = lab_run(records, kv_allocator=mine, **args)
    return out


def busiest_step(result) -> int:
    """The engine step at which the run held the most blocks (the first such step)."""
    steps = result.recorder.steps
    return max(steps, key=lambda s: (s.blocks_used, -s.step)).step


def block_maps_figure(results: dict, step: int | None = None, max_cols: int = 48):
    """One block map per run at the same engine ``step`` (default: the busiest step of the first run), stacked:
    which physical blocks each allocator gave to which request. Colours as
    :func:`workbench.viz.figures.block_map_figure` (one colour per request, lighter when partly filled or
    reserved and empty; grey free, purple external fragmentation)."""
    from plotly.subplots import make_subplots

    from workbench.viz.figures import _block_heatmap, _block_legend_traces, block_map_cells

    names = list(results)
    if step is None:
        step = busiest_step(results[names[0]])
    cells = []
    for n in names:
        maps = results[n].recorder.block_maps
        snap = min(maps, key=lambda m: (abs(m["step"] - step), m["step"]))
        cells.append((n, snap, block_map_cells(snap, max_cols)))
    rows_each = [len(c["y"]) for _, _, c in cells]
    titles = [
        f"{n}: {c['counts']['used']} used, {c['counts']['external']} external (step {snap['step']})"
        for n, snap, c in cells
    ]
    fig = make_subplots(
        rows=len(cells), cols=1, subplot_titles=titles, vertical_spacing=0.12 / max(1, len(cells) - 1) * 2,
        row_heights=rows_each,
    )  # fmt: skip
    for i, (n, _, c) in enumerate(cells, start=1):
        fig.add_trace(_block_heatmap(c, n), row=i, col=1)
        if len(c["y"]) > 1:
            fig.update_yaxes(
                autorange="reversed", showgrid=False, zeroline=False, title_text="first block", tickvals=c["y"],
                row=i, col=1,
            )  # fmt: skip
        else:  # one row of blocks: no row axis
            fig.update_yaxes(showticklabels=False, showgrid=False, zeroline=False, row=i, col=1)
        fig.update_xaxes(showgrid=False, zeroline=False, showticklabels=i == len(cells), row=i, col=1)
    for t in _block_legend_traces():
        fig.add_trace(t, row=1, col=1)
    one_row = all(r == 1 for r in rows_each)
    fig.update_xaxes(title_text="block id" if one_row else "block id − row start", row=len(cells), col=1)
    fig.update_layout(
        title={"text": f"Block maps at engine step {step}: the same requests, five allocators", "font": {"size": 15}},
        height=140 + sum(60 + 28 * r for r in rows_each),
        plot_bgcolor="white",
        legend={
            "orientation": "h",
            "y": 1.08,
            "yanchor": "bottom",
            "x": 0,
            "title": {"text": ""},
        },  # above the first title
        margin={"t": 150, "l": 70, "r": 20, "b": 50},
    )
    return fig


def source(cls: type, *methods: str) -> None:
    """Print the source of ``cls``'s ``methods`` (all of its own if none are named)."""
    names = methods or [n for n, v in vars(cls).items() if inspect.isfunction(v) or isinstance(v, property)]
    for n in names:
        v = vars(cls)[n]
        print(inspect.getsource(v.fget if isinstance(v, property) else v))


# ---------------------------------------------------------------- exercises
@_register(
    "12.1",
    "Complete the skeleton (allocate_slots, free) so that your allocator passes the conformance check: "
    "the real scheduler over random schedules, invariants every step, nothing leaked (the answer is the class)",
    "allocate_slots adds blocks until the table covers num_total_tokens slots, and refuses (returning False, "
    "changing nothing) when too few are free; free gives every block of the request back and drops its table.",
)
class _OwnAllocator:
    @staticmethod
    def solution(schedules: int, seed: int):

        return NextFitKVManager

    @staticmethod
    def judge(answer, schedules: int, seed: int) -> tuple[bool, str]:
        from workbench.conformance import check_kv_manager
        from workbench.kv.interface import KVManager

        cls = getattr(answer, "fn", answer)  # a class arrives wrapped by check()'s return-value probe
        if not (isinstance(cls, type) and issubclass(cls, KVManager)):
            return False, f"give the class itself (a KVManager subclass), got {answer!r}"
        report = check_kv_manager(cls, schedules=schedules, seed=seed)
        if report.passed:
            return True, str(report)
        f = report.failure
        return False, (
            f"schedule {report.schedules} of {schedules} failed at step {f.step}: {f.problem} (print "
            "check_kv_manager(YourClass) for the schedule and the calls before it)"
        )
