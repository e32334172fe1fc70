"""Chapter 14 of the labs: KV defragmentation by block copies, and when it pays.

*Real runs on the bundled model* (float32, CPU): a contiguous allocator (``orca-max``, first-fit) whose waiting
request fits no hole; a compaction pass (:mod:`workbench.kv.defrag`) recorded exactly as it ran — the block
map just before it, its moves, the map just after (:class:`RecordingDefragmenter`) — and the request admitted in the
next step (the step records' ``defrag_unblocked``); every trigger on the same trace, cost (blocks and bytes copied,
copy seconds) against benefit (requests admitted, steps to finish) (:func:`trigger_rows`); the same on the paged
allocator, where no request ever waits on a hole, and what compaction still changes there — the highest used block
id, hence the tail of the pool that could be handed back (:func:`tail_rows`); a paged-attention gather over a
scattered vs a contiguous block table (:func:`gather_timing`); each pass of the ``fragmentation`` trigger against
the part of the rate a move can remove (:func:`pass_rows`); a panel (:class:`DefragPanel`).

*At GPU scale* (the simulator: the real scheduler and KV managers, a cost model for time; the same rows as
``benchmarks/defrag.py``): :func:`sim_trigger_row`.

Engines are built once per allocator and pool (:func:`lab_engine`) and the trigger is swapped between runs
(:func:`set_trigger`), so that a chapter's runs pay for one model load each.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import plotly.graph_objects as go

from workbench.kv.defrag import Defragmenter, plan_compaction
from workbench.labs.exercise_registry import _number, _register
from workbench.labs.multigpu_common import _Panel
from workbench.labs.runs import LAB_ENGINE_DEFAULTS, check_engine_args, lab_run, lab_trace
from workbench.viz.common import LEGEND_ABOVE, count_axis, plural
from workbench.viz.table import Column, Table

__all__ = [
    "DEFRAG_TRACE",
    "POOL_BLOCKS",
    "TRIGGERS",
    "DefragPanel",
    "RecordingDefragmenter",
    "EXERCISE_14_1",
    "regions_map",
    "defrag_run",
    "defrag_runs",
    "defrag_trace",
    "gather_table",
    "gather_timing",
    "highest_block_figure",
    "lab_engine",
    "map_pair_figure",
    "moves_table",
    "pass_rows",
    "pass_table",
    "regions_of",
    "set_trigger",
    "sim_trigger_row",
    "sim_trigger_table",
    "story",
    "tail_rows",
    "tail_table",
    "trigger_rows",
    "trigger_table",
]

MiB = 1 << 20
TRIGGERS = ("none", "fragmentation", "waiting", "highest-block")

#: the chapter's trace: ten short real prompts, long-tailed output lengths (seeded), on a 16-block pool
DEFRAG_TRACE: dict[str, Any] = {
    "num_requests": 10,
    "mean_output": 12,
    "max_output": 40,
    "seed": 1,
    "max_prompt_chars": 200,
}
POOL_BLOCKS = 16


def defrag_trace(**overrides: Any):
    """:func:`~workbench.labs.runs.lab_trace` with :data:`DEFRAG_TRACE` (and ``overrides``)."""
    return lab_trace(**(DEFRAG_TRACE | overrides))


# ====================================================================== engines and passes
class RecordingDefragmenter(Defragmenter):
    """A :class:`~workbench.kv.defrag.Defragmenter` that also keeps, for every pass, its moves and the
    block map just before and just after it (:func:`workbench.metrics.accounting.block_map`, the free runs too
    short for the first waiting request marked ``external``), and the fragmentation rate the trigger saw.

    Attributes:
        records: one dict per pass: ``step`` (the engine step that carries it), ``pass`` (the
            :class:`~workbench.kv.defrag.DefragPass`), ``moves`` (``(src, dst)`` in order), ``need``
            (blocks the first waiting request reserves, 0 when none waits), ``before`` / ``after`` (block maps),
            ``usage`` (the pool split after the previous step, or ``None``).
    """

    def __init__(self, *args: Any, engine=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine = engine
        self.records: list[dict[str, Any]] = []

    def _map(self, need: int) -> dict:
        from workbench.metrics.accounting import block_map

        eng = self.engine
        computed = {rid: r.num_computed_tokens for rid, r in eng.requests.items()} if eng is not None else {}
        return block_map(self.kv, computed, need, eng._step if eng is not None else 0)

    def run_pass(self, trigger: str, max_moves: int, need_blocks: int = 0, waiting=()):
        kv = self.kv
        head = kv.reservation_blocks(waiting[0].request_id) if waiting else 0
        moves = plan_compaction(kv, max_moves, need_blocks)
        before = self._map(head) if moves else None
        usage = self.usage() if self.usage is not None else None
        p = super().run_pass(trigger, max_moves, need_blocks, waiting)
        if p is not None:
            step = self.engine._step if self.engine is not None else len(self.records)
            self.records.append(
                {
                    "step": step,
                    "pass": p,
                    "moves": moves,
                    "need": head,
                    "before": before,
                    "after": self._map(head),
                    "usage": usage,
                }
            )
        return p


_ENGINES: dict[tuple, Any] = {}


def lab_engine(kv_allocator: str = "orca-max", num_gpu_blocks_override: int = POOL_BLOCKS, **engine_args: Any):
    """A real engine (:class:`workbench.LLM`, the lab defaults, a block map every step), built once per set of
    arguments and reused: the chapter's runs differ in their trigger only (:func:`set_trigger`).

    Raises:
        ValueError: bad engine arguments (before any model loads).
    """
    from workbench import LLM

    args = LAB_ENGINE_DEFAULTS | {
        "kv_allocator": kv_allocator,
        "num_gpu_blocks_override": num_gpu_blocks_override,
        "block_map_every": 1,
    }
    args |= engine_args
    key = tuple(sorted((k, repr(v)) for k, v in args.items()))
    if key not in _ENGINES:
        check_engine_args(args)
        _ENGINES[key] = LLM(**args)
    return _ENGINES[key]


def set_trigger(llm, trigger: str = "none", threshold: float | None = None, max_moves: int = 512):
    """Give a built engine another compaction trigger (``kv_defrag_*`` as engine arguments) and restart its step
    count, so that its next run is numbered from step 0 like a fresh engine's. Returns the new
    :class:`RecordingDefragmenter`.

    Raises:
        ValueError: what the engine refuses (an unknown trigger, a rate threshold above 1, ``max_moves < 1``).
    """
    eng = llm.llm_engine
    cfg = dataclasses.replace(
        eng.config, kv_defrag_trigger=trigger, kv_defrag_threshold=threshold, kv_defrag_max_moves=max_moves
    )
    cfg.validate()
    usage = lambda: getattr(eng.accounting, "last_usage", None)  # noqa: E731  (as Defragmenter.from_config)
    d = RecordingDefragmenter(eng.kv, trigger, threshold, max_moves, eng.memory.block_bytes, usage, engine=eng)
    eng.config, eng.defrag, eng._step = cfg, d, 0
    eng.accounting.last_usage = None  # the previous run's last split is not this run's
    return d


def defrag_run(
    kv_allocator: str = "orca-max",
    trigger: str = "none",
    threshold: float | None = None,
    max_moves: int = 512,
    records=None,
    num_gpu_blocks_override: int = POOL_BLOCKS,
    **engine_args: Any,
) -> SimpleNamespace:
    """One real run of ``records`` (default :func:`defrag_trace`) under a trigger.

    Returns:
        ``SimpleNamespace(name, allocator, trigger, threshold, result, passes)``: ``result`` the
        :class:`~workbench.bench.run.JobResult` (step records, block maps), ``passes`` the
        :attr:`RecordingDefragmenter.records`.
    """
    llm = lab_engine(kv_allocator, num_gpu_blocks_override, **engine_args)
    d = set_trigger(llm, trigger, threshold, max_moves)
    res = lab_run(defrag_trace() if records is None else records, llm=llm)
    name = trigger if threshold is None else f"{trigger} > {threshold:g}"
    return SimpleNamespace(
        name=name, allocator=kv_allocator, trigger=trigger, threshold=d.threshold, result=res, passes=d.records
    )


def defrag_runs(
    thresholds: dict[str, float | None], kv_allocator: str = "orca-max", progress: bool = True, **kw: Any
) -> dict[str, SimpleNamespace]:
    """:func:`defrag_run` under each trigger of ``thresholds`` (``{trigger: threshold or None}``), in order, with a
    progress bar of the runs (each is a real engine run of several seconds)."""
    from tqdm.auto import tqdm

    runs = {}
    with tqdm(list(thresholds.items()), desc="defragmentation runs", unit="run", disable=not progress) as bar:
        for trigger, threshold in bar:
            bar.set_postfix_str(f"trigger {trigger}")
            runs[trigger] = defrag_run(kv_allocator, trigger, threshold, **kw)
    return runs


# ====================================================================== one pass, shown
def regions_of(snapshot: dict) -> list[tuple[int, int, str]]:
    """Runs of consecutive blocks of one owner in a block map: ``(start, num_blocks, request id)`` in address
    order (a contiguous allocator's regions)."""
    out: list[tuple[int, int, str]] = []
    owner, ids = snapshot["owner"], snapshot["owner_ids"]
    for b, o in enumerate(owner):
        if o < 0:
            continue
        if out and out[-1][2] == ids[o] and out[-1][0] + out[-1][1] == b:
            s, n, r = out[-1]
            out[-1] = (s, n + 1, r)
        else:
            out.append((b, 1, ids[o]))
    return out


def _short(rid: str) -> str:
    return rid if len(rid) <= 18 else rid[:8] + "…" + rid[-8:]


def story(run: SimpleNamespace) -> dict[str, Any]:
    """The first pass of ``run`` that admitted a blocked request: its record (:class:`RecordingDefragmenter`),
    the step records of the steps before, of and after it, and the admitted request's block map in the next step.

    Raises:
        LookupError: no pass of the run admitted a request.
    """
    rec = next((r for r in run.passes if r["pass"].unblocked), None)
    if rec is None:
        raise LookupError(f"no compaction pass of the {run.name!r} run admitted a waiting request")
    steps = {s.step: s for s in run.result.recorder.steps}
    maps = {m["step"]: m for m in run.result.recorder.block_maps}
    k = rec["step"]
    before_ids = set(rec["before"]["owner_ids"])
    nxt = maps.get(k + 1)
    admitted = [r for r in regions_of(nxt) if r[2] not in before_ids] if nxt else []
    return rec | {"steps": [steps[i] for i in (k - 1, k, k + 1) if i in steps], "next_map": nxt, "admitted": admitted}


def moves_table(rec: dict[str, Any]) -> Table:
    """The moves of one pass, grouped by request: each region's blocks before and after."""
    before = {rid: (s, n) for s, n, rid in regions_of(rec["before"])}
    after = {rid: (s, n) for s, n, rid in regions_of(rec["after"])}
    rows = []
    for rid, (s, n) in before.items():
        s2 = after[rid][0]
        if s2 != s:
            rows.append(
                {
                    "request": _short(rid),
                    "blocks": n,
                    "from": f"{s}–{s + n - 1}",
                    "to": f"{s2}–{s2 + n - 1}",
                    "mib": n * rec["pass"].bytes_moved / max(1, rec["pass"].blocks_moved) / MiB,
                }
            )
    rows.append(
        {
            "request": "the pass",
            "blocks": rec["pass"].blocks_moved,
            "from": "",
            "to": "",
            "mib": rec["pass"].bytes_moved / MiB,
        }
    )
    return Table(
        [
            Column("request", "request", align="left"),
            Column("blocks", "blocks moved"),
            Column("from", "blocks before", align="left"),
            Column("to", "blocks after", align="left"),
            Column("mib", "copied (MiB)", lambda v: f"{v:.2f}"),
        ],
        rows,
        title=f"step {rec['step']}: the pass's moves (the waiting request needs {rec['need']} consecutive blocks)",
    )


def map_pair_figure(
    maps: Sequence[tuple[str, dict]],
    max_cols: int = 32,
    title: str = "KV block map around a compaction pass (orca-max, first-fit)",
) -> go.Figure:
    """Block maps one above the other (one heatmap each, the block-map colours of
    :func:`workbench.viz.figures.block_map_figure`), each titled with its label and counts; a map of one row has
    no row axis."""
    from plotly.subplots import make_subplots

    from workbench.viz.figures import _block_heatmap, _block_legend_traces, block_map_cells

    cells = [block_map_cells(m, max_cols) for _, m in maps]
    titles = []
    for (label, _m), c in zip(maps, cells):
        cn = c["counts"]
        titles.append(
            f"{label}: {cn['used']} used, {cn['free'] + cn['external']} free "
            f"({cn['external']} in holes too small for the waiting request), {plural(cn['owners'], 'request')}"
        )
    fig = make_subplots(rows=len(maps), cols=1, subplot_titles=titles, vertical_spacing=0.22)
    for i, c in enumerate(cells, start=1):
        fig.add_trace(_block_heatmap(c, f"map {i}"), row=i, col=1)
        fig.update_xaxes(title_text="block id (column)", row=i, col=1, dtick=4)
        if len(c["z"]) > 1:
            fig.update_yaxes(title_text="first block of the row", row=i, col=1, autorange="reversed", tickformat=",d")
        else:  # one row of blocks: a row axis would only show meaningless ticks
            fig.update_yaxes(showticklabels=False, row=i, col=1)
    for t in _block_legend_traces():
        fig.add_trace(t)
    fig.update_annotations(font_size=12)
    fig.update_layout(
        title={"text": title, "y": 0.98},
        height=170 + 150 * len(maps),
        legend=LEGEND_ABOVE | {"y": 1.18},
        margin={"t": 130, "l": 70, "r": 20},
    )
    return fig


# ====================================================================== cost against benefit
def trigger_rows(runs: Sequence[SimpleNamespace]) -> list[dict[str, Any]]:
    """Per run: steps to finish every request, mean batch, steps with external fragmentation, passes, blocks and
    bytes moved, requests admitted in the step after a pass that no hole held before it, the copy seconds of the
    steps that carried a pass (measured; they vary), and the moved bytes as a share of the weights a step reads."""
    rows = []
    for run in runs:
        res = run.result
        steps = res.recorder.steps
        ps = [r["pass"] for r in run.passes]
        moved = sum(p.bytes_moved for p in ps)
        rows.append(
            {
                "run": run.name,
                "allocator": run.allocator,
                "finished": res.summary["requests_finished"],
                "steps": len(steps),
                "mean_running": statistics.fmean(s.num_running for s in steps),
                "steps_external": sum(s.external_fragmentation > 0 for s in steps),
                "passes": len(ps),
                "blocks_moved": sum(p.blocks_moved for p in ps),
                "mib_moved": moved / MiB,
                "unblocked": sum(p.unblocked for p in ps),
                "useless": sum(p.unblocked == 0 for p in ps),
                "copy_ms": 1e3 * sum(s.copy_time_s for s in steps if s.defrag_passes),
                "weights_share": moved / (res.memory["weights_bytes"] * max(1, len(steps))),
                "block_bytes": res.memory["block_bytes"],
            }
        )
    return rows


def trigger_table(rows: Sequence[dict[str, Any]], times: bool = False) -> Table:
    """:func:`trigger_rows` as a table; ``times``: add the measured copy milliseconds (they vary)."""
    cols = [
        Column("run", "trigger", align="left"),
        Column("steps", "steps to finish"),
        Column("mean_running", "mean batch (requests)", lambda v: f"{v:.2f}"),
        Column("steps_external", "steps with external frag."),
        Column("passes", "passes"),
        Column("blocks_moved", "blocks moved"),
        Column("mib_moved", "copied (MiB)", lambda v: f"{v:.1f}"),
        Column("unblocked", "requests admitted by a pass"),
        Column("useless", "passes admitting none"),
    ]
    if times:
        cols.append(Column("copy_ms", "copy time (ms, measured)", lambda v: f"{v:.1f}"))
    alloc = rows[0]["allocator"] if rows else "?"
    return Table(cols, rows, title=f"{alloc}: the same {plural(rows[0]['finished'], 'request')} under each trigger")


def sim_trigger_row(
    allocator: str,
    trigger: str,
    rate: float = 6.0,
    duration: float = 60.0,
    num_blocks: int = 500,
    max_tokens: int = 512,
    seed: int = 0,
) -> dict[str, Any]:
    """One simulated run (Llama-2-7B on one A100-80GB, the real scheduler and KV manager, a cost model for time):
    a ShareGPT-like Poisson trace against a deliberately tight pool of ``num_blocks`` blocks of 16 tokens, under
    ``kv_defrag_trigger=trigger``. Counts are exact (a deterministic replay), times the cost model's.

    Returns:
        requests finished, simulated seconds to finish them, request throughput, mean queueing seconds, steps
        with external fragmentation, passes, blocks and GiB moved, modelled copy seconds and their share of the
        run, requests a pass admitted, the highest-block gap and the highest used block id (mean and peak over
        steps), the replay's wall seconds.
    """
    from workbench.catalog import MODELS
    from workbench.config import EngineConfig
    from workbench.kv.defrag import highest_block_gap
    from workbench.metrics import CallbackSink
    from workbench.sim import SimEngine, SimSpec, find_hardware, make_trace

    spec = SimSpec(MODELS["llama-2-7b"], find_hardware("A100-80GB"))
    cfg = EngineConfig(
        kv_allocator=allocator,
        num_gpu_blocks_override=num_blocks,
        block_size=16,
        max_model_len=2048,
        max_num_seqs=64,
        kv_defrag_trigger=trigger,
    )
    eng = SimEngine(cfg, spec)
    eng.record_itl = False
    gaps, highest = [], []

    def watch(_st):
        used = {b for t in eng.kv.block_tables.values() for b in t}
        gaps.append(highest_block_gap(eng.kv))
        highest.append(max(used) if used else -1)

    eng.recorder.add_sink(CallbackSink(watch))
    trace = make_trace(rate, duration, "sharegpt", "poisson", seed)
    eng.add_trace(trace, max_tokens=max_tokens)
    t0 = time.perf_counter()
    eng.run()
    wall = time.perf_counter() - t0
    steps, reqs = eng.recorder.steps, eng.recorder.requests
    moved = [s for s in steps if s.defrag_passes]
    done = [r for r in reqs if r.finish_reason in ("stop", "length")]
    return {
        "allocator": allocator,
        "trigger": trigger,
        "requests": len(trace),
        "finished": len(done),
        "sim_duration_s": round(eng.now, 2),
        "req_per_s": round(len(done) / eng.now, 3),
        "mean_queue_s": round(statistics.fmean(r.queue_time_s for r in done), 2),
        "steps": len(steps),
        "steps_external_frag": sum(s.external_fragmentation > 0 for s in steps),
        "passes": len(eng.defrag.passes),
        "blocks_moved": sum(p.blocks_moved for p in eng.defrag.passes),
        "gib_moved": round(sum(p.bytes_moved for p in eng.defrag.passes) / 2**30, 2),
        "copy_s": round(sum(s.copy_time_s for s in moved), 3),
        "copy_share": round(sum(s.copy_time_s for s in moved) / eng.now, 5),
        "unblocked": sum(p.unblocked for p in eng.defrag.passes),
        "gap_mean": round(statistics.fmean(gaps), 1),
        "gap_max": max(gaps),
        "highest_used_mean": round(statistics.fmean(highest), 1),
        "highest_used_max": max(highest),
        "replay_wall_s": round(wall, 1),
    }


def sim_trigger_table(rows: Sequence[dict[str, Any]], paged: bool = False) -> Table:
    """:func:`sim_trigger_row` rows as a table (``paged``: the highest-block columns instead of the copy share)."""
    cols = [
        Column("trigger", "trigger", align="left"),
        Column("finished", "requests"),
        Column("sim_duration_s", "time to finish (s)", lambda v: f"{v:.1f}"),
        Column("req_per_s", "throughput (req/s)", lambda v: f"{v:.3f}"),
        Column("mean_queue_s", "mean queueing (s)", lambda v: f"{v:.2f}"),
        Column("steps_external_frag", "steps with external frag.", lambda v: f"{v:,}"),
        Column("passes", "passes"),
        Column("blocks_moved", "blocks moved", lambda v: f"{v:,}"),
        Column("gib_moved", "copied (GiB)", lambda v: f"{v:.1f}"),
    ]
    if paged:
        cols += [
            Column("highest_used_mean", "highest used id (mean)", lambda v: f"{v:.0f}"),
            Column("highest_used_max", "highest used id (peak)"),
        ]
    else:
        cols += [
            Column("copy_share", "copy time (% of run)", lambda v: f"{100 * v:.2f}%"),
            Column("unblocked", "requests admitted by a pass"),
        ]
    r0 = rows[0]
    return Table(
        cols,
        rows,
        title=f"simulated: Llama-2-7B on one A100-80GB, {r0['allocator']}, {r0['requests']} ShareGPT-like requests",
    )


# ====================================================================== paged: the pool's tail, locality
def _highest_used(snapshot: dict) -> int:
    return max((b for b, o in enumerate(snapshot["owner"]) if o >= 0), default=-1)


def tail_rows(runs: Sequence[SimpleNamespace]) -> list[dict[str, Any]]:
    """Per paged run: the highest used block id and the free tail above it (blocks a shrinking pool could hand
    back without moving anything), mean and worst over steps, in blocks and MiB."""
    rows = []
    for run in runs:
        res = run.result
        n = res.memory["num_blocks"]
        bb = res.memory["block_bytes"]
        hi = [_highest_used(m) for m in res.recorder.block_maps]
        busy = [h for h in hi if h >= 0]
        tails = [n - 1 - h for h in busy]
        used = [s.blocks_used for s in res.recorder.steps if s.blocks_used]
        ps = [r["pass"] for r in run.passes]
        rows.append(
            {
                "run": run.name,
                "steps": len(res.recorder.steps),
                "steps_external": sum(s.external_fragmentation > 0 for s in res.recorder.steps),
                "passes": len(ps),
                "blocks_moved": sum(p.blocks_moved for p in ps),
                "mean_used": statistics.fmean(used),
                "mean_highest": statistics.fmean(busy),
                "mean_tail": statistics.fmean(tails),
                "min_tail": min(tails),
                "mean_tail_mib": statistics.fmean(tails) * bb / MiB,
                "num_blocks": n,
            }
        )
    return rows


def tail_table(rows: Sequence[dict[str, Any]]) -> Table:
    return Table(
        [
            Column("run", "trigger", align="left"),
            Column("steps", "steps to finish"),
            Column("steps_external", "steps with external frag."),
            Column("passes", "passes"),
            Column("blocks_moved", "blocks moved"),
            Column("mean_used", "blocks used (mean)", lambda v: f"{v:.1f}"),
            Column("mean_highest", "highest used id (mean)", lambda v: f"{v:.1f}"),
            Column("mean_tail", "free tail (blocks, mean)", lambda v: f"{v:.1f}"),
            Column("min_tail", "free tail (blocks, least)"),
            Column("mean_tail_mib", "free tail (MiB, mean)", lambda v: f"{v:.1f}"),
        ],
        rows,
        title=f"paged, {rows[0]['num_blocks']} blocks: the tail above the highest used block (could be handed back)",
    )


def highest_block_figure(runs: Sequence[SimpleNamespace]) -> go.Figure:
    """Per step: blocks used, and the highest used block id + 1 of each run (the pool can shrink down to it)."""
    fig = go.Figure()
    dashes = ("solid", "dash", "dot", "dashdot")
    first = runs[0].result
    fig.add_scatter(
        x=[s.step for s in first.recorder.steps],
        y=[s.blocks_used for s in first.recorder.steps],
        name="blocks used",
        line={"color": "#2ca02c", "width": 3},
    )
    top = 0
    for i, run in enumerate(runs):
        maps = run.result.recorder.block_maps
        y = [_highest_used(m) + 1 for m in maps]
        top = max(top, *y)
        fig.add_scatter(
            x=[m["step"] for m in maps],
            y=y,
            name=f"highest used id + 1: {run.name}",
            line={"dash": dashes[i % len(dashes)], "shape": "hv"},
        )
    n = first.memory["num_blocks"]
    fig.add_hline(y=n, line={"color": "#888", "dash": "dot"}, annotation_text=f"pool: {n} blocks")
    fig.update_layout(
        title={"text": "Paged: how far up the pool is in use, with and without compaction", "y": 0.97},
        xaxis={"title": "engine step", "tickformat": ",d"},
        yaxis=count_axis(n + 1, "blocks"),
        legend=LEGEND_ABOVE | {"y": 1.12},
        margin={"t": 110},
        height=420,
    )
    return fig


def gather_timing(
    num_blocks: int = 2048, seq_blocks: int = 64, batch: int = 8, repeats: int = 20, seed: int = 0
) -> list[dict[str, Any]]:
    """The paged-attention gather (``index_select`` of a decode group's blocks, as
    :func:`workbench.attention.torch_ref.paged_attention` does per layer, K and V) over one layer's cache of the
    bundled model's shape, with each sequence's blocks contiguous vs scattered at random over the pool; median
    seconds of ``repeats`` rounds (the two layouts in turn, after one warm-up round; they vary from run to run), and
    the bytes gathered.
    """
    import random

    import torch

    hf = lab_engine().llm_engine.hf_config  # the bundled model's
    nkv = hf.num_key_value_heads
    d = hf.hidden_size // hf.num_attention_heads
    bs = LAB_ENGINE_DEFAULTS["block_size"]
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, bs, nkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, nkv, d, generator=g)
    rng = random.Random(seed)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = {
        "contiguous": torch.arange(batch * seq_blocks).view(batch, seq_blocks),
        "scattered": torch.tensor(ids[: batch * seq_blocks]).view(batch, seq_blocks),
    }
    times: dict[str, list[float]] = {name: [] for name in tables}
    for i in range(repeats + 1):  # the two layouts in turn; the first round warms up and is dropped
        for name, table in tables.items():
            flat = table.flatten()
            t0 = time.perf_counter()
            k_cache.index_select(0, flat)
            v_cache.index_select(0, flat)
            if i:
                times[name].append(time.perf_counter() - t0)
    rows = []
    for name, table in tables.items():
        flat = table.flatten()
        nbytes = 2 * flat.numel() * bs * nkv * d * 4
        t = statistics.median(times[name])
        rows.append(
            {"layout": name, "blocks": flat.numel(), "mib": nbytes / MiB, "us": 1e6 * t, "gib_s": nbytes / t / 2**30}
        )
    base = rows[0]["us"]
    for r in rows:
        r["ratio"] = r["us"] / base
    return rows


def gather_table(rows: Sequence[dict[str, Any]]) -> Table:
    return Table(
        [
            Column("layout", "block table", align="left"),
            Column("blocks", "blocks gathered"),
            Column("mib", "bytes (MiB, K and V)", lambda v: f"{v:.2f}"),
            Column("us", "time (µs, median)", lambda v: f"{v:,.0f}"),
            Column("gib_s", "GiB/s", lambda v: f"{v:.1f}"),
            Column("ratio", "vs contiguous", lambda v: f"{v:.2f}×"),
        ],
        rows,
        title="one layer's paged-attention gather on this CPU (measured; varies from run to run)",
    )


# ====================================================================== the threshold claim
def pass_rows(run: SimpleNamespace) -> list[dict[str, Any]]:
    """Each pass of a run: the fragmentation rate the trigger saw (after the previous step) and its parts, the
    blocks it moved, whether a waiting request was blocked by holes, and whether the pass admitted it."""
    rows = []
    for r in run.passes:
        u, p = r["usage"], r["pass"]
        occ = (u.token_states + u.reservation + u.internal_fragmentation + u.external_fragmentation) if u else 0
        rows.append(
            {
                "step": r["step"],
                "rate": u.fragmentation_rate if u else float("nan"),
                "reservation": u.reservation / occ if occ else 0.0,
                "internal": u.internal_fragmentation / occ if occ else 0.0,
                "external": u.external_fragmentation / occ if occ else 0.0,
                "blocks_moved": p.blocks_moved,
                "mib": p.bytes_moved / MiB,
                "blocked": len(p.blocked),
                "unblocked": p.unblocked,
            }
        )
    return rows


def pass_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    return Table(
        [
            Column("step", "step"),
            Column("rate", "fragmentation rate", pct),
            Column("reservation", "reservation (% of occupied)", pct),
            Column("internal", "internal (% of occupied)", pct),
            Column("external", "external: removable (% of occupied)", pct),
            Column("blocks_moved", "blocks moved"),
            Column("mib", "copied (MiB)", lambda v: f"{v:.1f}"),
            Column("blocked", "requests blocked by holes"),
            Column("unblocked", "admitted next step"),
        ],
        rows,
        title=title,
    )


# ====================================================================== exercise
#: exercise 14.1's pool: four regions with holes of two blocks between them, and a request needing five
EXERCISE_14_1: dict[str, Any] = {
    "regions": [[2, 4, "a"], [8, 3, "b"], [13, 5, "c"], [20, 2, "d"]],
    "num_blocks": 24,
    "need_blocks": 5,
}


def regions_map(regions, num_blocks: int, need_blocks: int = 0, step: int = 0) -> dict:
    """A block-map snapshot (:func:`workbench.metrics.accounting.block_map`'s form) of a contiguous pool given by its
    regions ``(start, blocks, request id)``: every block full, free runs shorter than ``need_blocks`` external."""
    owner, state = [-1] * num_blocks, ["free"] * num_blocks
    ids = []
    for start, n, rid in sorted(tuple(r) for r in regions):
        ids.append(rid)
        for b in range(start, start + n):
            owner[b], state[b] = len(ids) - 1, "used"
    run = 0
    for b in range(num_blocks + 1):
        if b < num_blocks and state[b] == "free":
            run += 1
            continue
        if 0 < run < need_blocks:
            state[b - run : b] = ["external"] * run
        run = 0
    bs = LAB_ENGINE_DEFAULTS["block_size"]
    filled = [bs if o >= 0 else 0 for o in owner]
    return {
        "step": step,
        "allocator": "orca-max",
        "block_size": bs,
        "owner": owner,
        "owner_ids": ids,
        "filled": filled,
        "state": state,
    }


# ====================================================================== panel
class DefragPanel(_Panel):
    """Real runs of the chapter's trace: widgets named like the engine arguments — ``kv_allocator``,
    ``kv_defrag_trigger``, ``kv_defrag_threshold`` (0 = the trigger's default), ``kv_defrag_max_moves``,
    ``num_gpu_blocks_override``. Each Run adds the run's waiting queue per step to the figure, with a marker at
    every pass (its size: blocks moved), and says what the passes cost and bought.

    Raises:
        ImportError: ipywidgets / anywidget missing.
    """

    def __init__(self, records=None):
        from workbench.config import KV_ALLOCATORS, KV_DEFRAG_TRIGGERS
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        st = {"description_width": "initial"}
        allocs = [a for a in KV_ALLOCATORS if a != "static"]
        controls = {
            "kv_allocator": w.Dropdown(options=allocs, value="orca-max", description="kv_allocator", style=st),
            "kv_defrag_trigger": w.Dropdown(
                options=list(KV_DEFRAG_TRIGGERS), value="waiting", description="kv_defrag_trigger", style=st
            ),
            "kv_defrag_threshold": w.FloatText(value=0.0, description="kv_defrag_threshold (0: default)", style=st),
            "kv_defrag_max_moves": w.IntSlider(min=1, max=64, value=64, description="kv_defrag_max_moves", style=st),
            "num_gpu_blocks_override": w.IntSlider(
                min=12, max=48, step=2, value=POOL_BLOCKS, description="num_gpu_blocks_override", style=st
            ),
        }
        self.records = records
        self.figure = go.FigureWidget()
        self.figure.update_layout(
            title={"text": "Waiting requests per step, and the compaction passes (markers)", "y": 0.97},
            xaxis={"title": "engine step", "tickformat": ",d"},
            yaxis={"title": "waiting requests", "rangemode": "tozero", "tickformat": ",d"},
            legend=LEGEND_ABOVE | {"y": 1.14},
            margin={"t": 120},
            height=420,
        )
        self._build(controls, self.figure)

    def _run(self, values):
        th = values["kv_defrag_threshold"]
        th = None if not th else float(th)
        mm = values["kv_defrag_max_moves"]
        if isinstance(mm, bool) or not isinstance(mm, int) or mm < 1:
            raise ValueError(f"kv_defrag_max_moves={mm!r} must be a whole number of moves >= 1")
        run = defrag_run(
            values["kv_allocator"],
            values["kv_defrag_trigger"],
            th,
            mm,
            records=self.records,
            num_gpu_blocks_override=values["num_gpu_blocks_override"],
        )
        self.last_run = run
        row = trigger_rows([run])[0]
        steps = run.result.recorder.steps
        label = f"{len(self.history) + 1}: {values['kv_allocator']}, {run.name}"
        at = {r["step"]: r["pass"].blocks_moved for r in run.passes}
        by_step = {s.step: s.num_waiting for s in steps}
        with self.figure.batch_update():
            self.figure.add_scatter(x=list(by_step), y=list(by_step.values()), name=label, line={"shape": "hv"})
            self.figure.add_scatter(
                x=list(at),
                y=[by_step.get(k, 0) for k in at],
                mode="markers",
                name=f"{label}: passes",
                marker={"size": [6 + 2 * min(n, 12) for n in at.values()], "symbol": "diamond"},
                hovertemplate="step %{x}: %{text} blocks moved<extra></extra>",
                text=list(at.values()),
            )
        return row

    def _describe(self, values, r) -> str:
        return (
            f"{values['kv_allocator']}, {r['run']}: {r['steps']} steps to finish {r['finished']} requests; "
            f"{plural(r['passes'], 'pass', 'passes')} moved {r['blocks_moved']} blocks ({r['mib_moved']:.1f} MiB) "
            f"and admitted {plural(r['unblocked'], 'waiting request')}; {r['useless']} admitted none; "
            f"{r['steps_external']} steps had external fragmentation"
        )


# ---------------------------------------------------------------- exercises
def _plan(regions, num_blocks: int, need_blocks: int):
    from types import SimpleNamespace

    from workbench.kv.defrag import plan_compaction

    kv = SimpleNamespace(regions=sorted(tuple(r) for r in regions), num_blocks=num_blocks)
    return plan_compaction(kv, num_blocks, need_blocks)


@_register(
    "14.1",
    "A contiguous pool (regions = [start, blocks, request]) and a waiting request that needs need_blocks "
    "consecutive blocks: how many blocks does a compaction pass move before a free run holds it? "
    "(an integer; checked against workbench.kv.defrag.plan_compaction)",
    "regions slide down whole, lowest first, each to the end of the one below it; after each slide look at the "
    "largest free run (the hole just opened, or any run above) and stop as soon as one holds need_blocks.",
)
class _CompactionMoves:
    @staticmethod
    def solution(regions, num_blocks: int, need_blocks: int) -> int:
        return len(_plan(regions, num_blocks, need_blocks))

    @staticmethod
    def judge(answer, regions, num_blocks: int, need_blocks: int) -> tuple[bool, str]:
        moves = _plan(regions, num_blocks, need_blocks)
        want = len(moves)
        x = _number(answer)
        if x is None:
            return False, f"give a whole number of blocks, got {answer!r}"
        full = len(_plan(regions, num_blocks, 0))
        if x == want:
            return True, f"{want} blocks, then a free run holds {need_blocks}; packing the whole pool would move {full}"
        free = num_blocks - sum(r[1] for r in regions)
        if x == full:
            return False, "that packs the whole pool; the pass stops as soon as one free run holds the request"
        if x == need_blocks:
            return False, "that is what the request needs; count the live blocks that move to open that hole"
        if x == free:
            return False, "that is the free blocks; the pass copies live blocks, not free ones"
        side = "too many" if x > want else "too few"
        return False, f"{answer!r} is {side}: slide the regions one at a time and check the free runs after each"
