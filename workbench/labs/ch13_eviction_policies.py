"""Chapter 13: eviction policies for shared prefixes.

Which free prefix-cached KV block the paged pool hands out next (engine argument ``prefix_cache_eviction``,
:mod:`workbench.kv.eviction`), measured on the multi-tenant prefix-repetition trace
(:func:`workbench.bench.samples.prefix_repetition_records`):

- real runs on the bundled model (one engine, its prefix cache emptied and given another policy between runs,
  :func:`reset_prefix_cache`), and the state of its free queue after a few requests (:func:`free_queue_rows`);
- the simulator at GPU scale (:func:`sim_replay`: the real scheduler and KV manager, the simulator's cost model),
  as in ``benchmarks/prefix_eviction.py``;
- per policy: hit rate, prefill tokens saved, evictions, the age of evicted blocks, TTFT, and the hot tenant's
  cached share request by request (:func:`hot_tenant_figure`);
- a hand-built sequence of pool events for the exercise (:func:`next_victims`), and :class:`EvictionPanel`, the
  simulator's runs with a policy dropdown that includes the learner's own (registered with
  :func:`workbench.plugins.register_class`).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from workbench.bench.samples import prefix_repetition_records
from workbench.kv.eviction import BUILTIN, EvictionPolicy, LRUPolicy, eviction_policy_class
from workbench.labs.exercise_registry import _register
from workbench.labs.multigpu_common import _Panel
from workbench.viz.common import percent_axis, title_and_legend_above
from workbench.viz.table import Column, Table

__all__ = [
    "EvictionPanel",
    "SIM_TRACE",
    "eviction_engine",
    "free_queue_rows",
    "free_queue_table",
    "hit_rate_figure",
    "hot_tenant_figure",
    "next_victims",
    "policy_label",
    "policy_rows",
    "policy_table",
    "popularity_figure",
    "real_run",
    "reset_prefix_cache",
    "run_figures",
    "scenario_rows",
    "sim_replay",
    "tenant_trace",
]

#: the real runs' trace: 4 tenants with a 48-token (3-block) system prompt each, 8-token suffixes, one output token
REAL_TRACE: dict[str, Any] = {
    "num_prompts": 24,
    "num_prefixes": 4,
    "prefix_len": 48,
    "suffix_len": 8,
    "zipf": 1.1,
    "scan_len": 96,
    "output_len": 1,
    "seed": 0,
}
#: the real runs' engine: a pool of 16 blocks of 16 tokens (the four system prompts take 12), two requests at a time
REAL_ENGINE: dict[str, Any] = {"num_gpu_blocks_override": 16, "max_num_seqs": 2}

#: the simulator's trace at GPU scale (``benchmarks/prefix_eviction.py``'s defaults, fewer requests)
SIM_TRACE: dict[str, Any] = {
    "num_prompts": 300,
    "num_prefixes": 12,
    "prefix_len": 320,
    "suffix_len": 48,
    "zipf": 1.1,
    "scan_len": 1536,
    "seed": 0,
}
#: the simulated deployment: Llama-2-7B on one A100-80GB, a pool of 256 blocks (4,096 tokens), 8 requests/s
SIM_SETUP: dict[str, Any] = {
    "num_blocks": 256,
    "rate": 8.0,
    "output_len": 16,
    "model": "llama-2-7b",
    "gpu": "A100-80GB",
}

TRACE_COLOURS = {"tenants": "#1f77b4", "tenants + scan": "#d62728"}
POLICY_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def policy_label(policy: str) -> str:
    """A policy's short name: the built-in name, else the class's ``name`` attribute if it set one, else its class
    name (``"module:Class"``)."""
    if policy in BUILTIN:
        return policy
    cls = eviction_policy_class(policy)
    return cls.name if cls.name != EvictionPolicy.name else cls.__name__


def tenant_trace(scan_every: int = 0, **overrides: Any):
    """The prefix-repetition records of :data:`REAL_TRACE` (``overrides`` replace its keys); ``scan_every=N``: every
    N-th request is a one-off scan prompt."""
    return prefix_repetition_records(**(REAL_TRACE | overrides), scan_every=scan_every)


def _tenant(request_id: str) -> int | None:
    """The tenant of a prefix-repetition request id (``"t<k>-<i>"``), ``None`` for a scan (``"scan-<i>"``)."""
    return int(request_id[1:].split("-")[0]) if request_id.startswith("t") else None


def popularity_figure(records, zipf: float) -> go.Figure:
    """Requests per tenant in ``records`` (bars) beside the Zipf expectation (``1 / (k + 1) ** zipf``, scaled to
    the tenants' requests); scan prompts are counted in the title."""
    counts = Counter(_tenant(r.id) for r in records)
    scans = counts.pop(None, 0)
    k = max(counts) + 1 if counts else 0
    n = sum(counts.values())
    w = [1 / (i + 1) ** zipf for i in range(k)]
    expect = [n * x / sum(w) for x in w]
    names = [f"tenant {i}" for i in range(k)]
    fig = go.Figure(
        [
            go.Bar(x=names, y=[counts.get(i, 0) for i in range(k)], name="requests drawn", marker_color="#1f77b4"),
            go.Scatter(
                x=names, y=expect, name=f"Zipf {zipf} expectation", mode="lines+markers", line={"color": "#555"}
            ),
        ]
    )
    fig.update_layout(
        **title_and_legend_above(
            f"Tenant popularity: {n} tenant requests (tenant 0: {counts.get(0, 0)})"
            + (f" and {scans} scan prompts" if scans else ""),
            400,
        ),
        xaxis_title="tenant (its own system prompt)",
        yaxis={"title": "requests", "tickformat": ",d", "rangemode": "tozero"},
    )
    return fig


# ---------------------------------------------------------------- real runs on the bundled model
def eviction_engine(**engine_args: Any):
    """A real engine (the lab defaults, :data:`REAL_ENGINE`, prefix caching on) to run every policy on: give it a
    policy and an empty cache with :func:`reset_prefix_cache` before each run."""
    from workbench.entrypoints.llm import LLM
    from workbench.labs.runs import LAB_ENGINE_DEFAULTS

    return LLM(**(LAB_ENGINE_DEFAULTS | REAL_ENGINE | {"enable_prefix_caching": True} | engine_args))


def reset_prefix_cache(llm, policy: str = "lru") -> None:
    """Empty an idle engine's prefix cache and hand its free blocks to a new ``policy`` (a built-in name or a plug-in
    ``"module:Class"``): afterwards a run is the same as on a freshly built engine with
    ``prefix_cache_eviction=policy`` (tests/test_labs_eviction.py), without loading the model again.

    Raises:
        RuntimeError: the engine has unfinished requests, or blocks still owned (nothing is reset then).
        ValueError: an unknown policy, or an engine without a paged prefix cache.
    """
    eng = llm.llm_engine
    pool = getattr(eng.kv, "pool", None)
    if pool is None or not eng.kv.enable_prefix_caching:
        raise ValueError("reset_prefix_cache needs a paged engine with enable_prefix_caching=True")
    cls = eviction_policy_class(policy)
    if eng.has_unfinished_requests() or any(pool.ref_cnt):
        raise RuntimeError("the engine still has requests or owned blocks; reset its prefix cache when it is idle")
    pool.policy = cls(pool.num_blocks)
    pool.policy.step = eng._step
    pool.block_hash = [None] * pool.num_blocks
    pool.cached = {}
    pool.num_evictions = 0
    pool.ever_shared = False
    eng.config.prefix_cache_eviction = policy


def real_run(llm, policy: str, records):
    """One real run of ``records`` on ``llm`` under ``policy``, from an empty prefix cache
    (:func:`reset_prefix_cache`, then :func:`workbench.labs.runs.lab_run`)."""
    from workbench.labs.runs import lab_run

    reset_prefix_cache(llm, policy)
    return lab_run(records, llm=llm)


def _figures(policy: str, trace: str, steps: list[dict], requests: list[dict]) -> dict[str, Any]:
    """A run's prefix-cache figures: the engine's summary (hit rate = prompt tokens served from the cache / looked
    up), the tenants' requests alone (scan prompts can never hit), the hot tenant (tenant 0), TTFT."""
    from workbench.metrics.stats import prefix_cache_summary

    s = prefix_cache_summary(steps)
    ten = [r for r in requests if _tenant(r["request_id"]) is not None]
    hot = [r for r in ten if _tenant(r["request_id"]) == 0]
    ttft = sorted(r["ttft_s"] for r in requests if r["ttft_s"] is not None)

    def share(rs):
        p = sum(r["prompt_tokens"] for r in rs)
        return sum(r["num_cached_tokens"] for r in rs) / p if p else None

    return {
        "policy": policy_label(policy),
        "trace": trace,
        "hit_rate": s["prefix_cache_hit_rate_frac"],
        "tenant_hit_rate": share(ten),
        "hot_hit_rate": share(hot),
        "saved_tokens": s["prefix_cache_hits_total"],
        "queried_tokens": s["prefix_cache_queries_total"],
        "evictions": s["prefix_cache_evictions_total"],
        "age_mean": s["evicted_block_age_mean_steps"],
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else None,
        "requests": requests,
        "steps": len(steps),
    }


def run_figures(res, policy: str, trace: str) -> dict[str, Any]:
    """:func:`_figures` of a real run (a :class:`~workbench.bench.run.JobResult`)."""
    steps = [s.to_dict() for s in res.recorder.steps]
    ids = {o.request_id: rec.id for o, rec in zip(res.outputs, res.records, strict=True)}  # "gen-7" -> "t0-3"
    reqs = [r.to_dict() | {"request_id": ids[r.request_id]} for r in res.recorder.requests]
    return _figures(policy, trace, steps, reqs)


def policy_rows(
    policies: Sequence[str], traces: dict[str, Any], *, llm=None, sim: bool = False, **sim_args: Any
) -> list[dict[str, Any]]:
    """Every policy on every trace (``{name: records}``): real runs on ``llm``, or simulator runs
    (``sim=True``, :func:`sim_replay` with ``sim_args`` over :data:`SIM_SETUP`)."""
    rows = []
    for trace, records in traces.items():
        for policy in policies:
            if sim:
                steps, reqs, _ = sim_replay(policy, records, **sim_args)
                rows.append(_figures(policy, trace, steps, reqs))
            else:
                rows.append(run_figures(real_run(llm, policy, records), policy, trace))
    return rows


def _pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def policy_table(rows: Sequence[dict[str, Any]], simulated: bool = False) -> Table:
    """Hit rate (all prompts, the tenants', the hot tenant's), prefill tokens saved, evictions, evicted-block age,
    TTFT mean (real runs: this CPU's, varies; simulated: the cost model's) per trace and policy."""
    cols = [
        Column("trace", "trace", str, align="left"),
        Column("policy", "policy", str, align="left"),
        Column("hit_rate", "hit rate (all prompts)", _pct),
        Column("tenant_hit_rate", "hit rate (tenants' prompts)", _pct),
        Column("hot_hit_rate", "hit rate (tenant 0)", _pct),
        Column("saved_tokens", "prefill tokens saved", "{:,}".format),
        Column("evictions", "evictions (blocks)", "{:,}".format),
        Column("age_mean", "evicted age mean (steps)", lambda v: "-" if v is None else f"{v:,.1f}"),
        Column("ttft_mean_ms", "TTFT mean (simulated)" if simulated else "TTFT mean (this CPU)", "{:.1f} ms".format),
    ]
    return Table(cols, rows)


def hit_rate_figure(rows: Sequence[dict[str, Any]], title: str) -> go.Figure:
    """The tenants' hit rate per policy, one bar per trace."""
    fig = go.Figure()
    for trace in dict.fromkeys(r["trace"] for r in rows):
        rs = [r for r in rows if r["trace"] == trace]
        fig.add_bar(
            x=[r["policy"] for r in rs],
            y=[r["tenant_hit_rate"] for r in rs],
            name=trace,
            marker_color=TRACE_COLOURS.get(trace),
            text=[_pct(r["tenant_hit_rate"]) for r in rs],
            textposition="outside",
            hovertemplate="%{x}: %{y:.1%}<extra>" + trace + "</extra>",
        )
    fig.update_layout(
        **title_and_legend_above(title, 400),
        barmode="group",
        xaxis_title="prefix_cache_eviction",
        yaxis=percent_axis(0, 1, "hit rate (tenants' prompt tokens from the cache)"),
    )
    return fig


def hot_tenant_figure(rows: Sequence[dict[str, Any]], title: str, window: int = 10) -> go.Figure:
    """The hot tenant's (tenant 0's) cached share of each of its prompts, in arrival order (a running mean over
    ``window`` of its requests), one line per run in ``rows``."""
    fig = go.Figure()
    for i, r in enumerate(rows):
        hot = sorted(
            (int(q["request_id"].split("-")[1]), q["num_cached_tokens"] / q["prompt_tokens"])
            for q in r["requests"]
            if _tenant(q["request_id"]) == 0
        )
        xs = [x for x, _ in hot]
        ys = [statistics.fmean(v for _, v in hot[max(0, j - window + 1) : j + 1]) for j in range(len(hot))]
        fig.add_scatter(
            x=xs,
            y=ys,
            mode="lines",
            name=r["policy"],
            line={"color": POLICY_COLOURS[i % len(POLICY_COLOURS)], "width": 2},
            hovertemplate="request %{x}: %{y:.0%}<extra>" + r["policy"] + "</extra>",
        )
    fig.update_layout(
        **title_and_legend_above(title, 400),
        xaxis={"title": "request (arrival order)", "tickformat": ",d", "rangemode": "tozero"},
        yaxis=percent_axis(0, 1, f"tenant 0's prompt from the cache (mean of {window})"),
    )
    return fig


# ---------------------------------------------------------------- the free queue of a real engine
def _labels(records, block_size: int) -> dict[bytes, str]:
    """Content hash -> a readable label of every full block of ``records``' prompts (``"t0 system 1"``, ``"t1-3
    own 0"``, ``"scan-2 0"``): the same chained hashes the KV manager registers."""
    from workbench.kv.manager import block_hash

    out: dict[bytes, str] = {}
    for r in records:
        t, parent = _tenant(r.id), None
        for i in range(len(r.prompt) // block_size):
            parent = block_hash(parent, r.prompt[i * block_size : (i + 1) * block_size])
            sys_blocks = REAL_TRACE["prefix_len"] // block_size
            if t is not None and i < sys_blocks:
                label = f"tenant {t} system prompt, block {i}"
            elif t is not None:
                label = f"request {r.id}: own suffix, block {i - sys_blocks}"
            else:
                label = f"{r.id} (one-off), block {i}"
            out.setdefault(parent, label)
    return out


def free_queue_rows(llm, records) -> list[dict[str, Any]]:
    """The free blocks of an idle engine in the order its policy would hand them out, each with what it holds
    (prefix-cached content from ``records``, or nothing), its prefix-cache hits and the step it was freed at."""
    pool = llm.llm_engine.kv.pool
    labels = _labels(records, llm.llm_engine.kv.block_size)
    pol = pool.policy
    cached = pol.eviction_order()
    empty = [b for b in pol.free if not pol.is_cached[b]]
    order = list(pol.free) if isinstance(pol, LRUPolicy) else empty + cached  # LRU: one queue, cached or not
    rows = []
    for pos, b in enumerate(order):
        h = pool.block_hash[b]
        rows.append(
            {
                "position": pos,
                "block": b,
                "content": "-" if h is None else labels.get(h, "output tokens"),
                "cached": h is not None,
                "hits": pol.hits[b] if h is not None else None,
                "freed_step": pol.freed_step[b],
            }
        )
    return rows


def free_queue_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`free_queue_rows` as a table: the first row is the next block handed out."""
    cols = [
        Column("position", "next out (0 = first)", str),
        Column("block", "block", str),
        Column("cached", "prefix-cached", lambda v: "yes" if v else "no (empty)"),
        Column("content", "content (findable by hash)", str, align="left"),
        Column("hits", "hits since cached", lambda v: "-" if v is None else str(v)),
        Column("freed_step", "freed at step", str),
    ]
    return Table(cols, rows)


# ---------------------------------------------------------------- the simulator at GPU scale
def sim_replay(
    policy: str,
    records,
    *,
    num_blocks: int = SIM_SETUP["num_blocks"],
    rate: float = SIM_SETUP["rate"],
    output_len: int = SIM_SETUP["output_len"],
    model: str = SIM_SETUP["model"],
    gpu: str = SIM_SETUP["gpu"],
    max_num_seqs: int = 16,
) -> tuple[list[dict], list[dict], float]:
    """Run token-id ``records`` through the simulated engine (:class:`~workbench.sim.SimEngine`: the real scheduler
    and KV manager, the simulator's cost model) with ``prefix_cache_eviction=policy``, arriving at a constant
    ``rate`` (simulated requests/s), each generating ``output_len`` tokens.

    Returns:
        ``(steps, requests, wall_s)``: the step records and request records (dicts; times simulated) and the
        replay's wall time here.
    """
    from workbench.catalog import MODELS
    from workbench.config import EngineConfig
    from workbench.sampling import SamplingParams
    from workbench.sim import SimEngine, SimSpec, find_hardware

    cfg = EngineConfig(
        enable_prefix_caching=True,
        prefix_cache_eviction=policy,
        num_gpu_blocks_override=num_blocks,
        max_num_seqs=max_num_seqs,
        max_model_len=4096,
    )
    eng = SimEngine(cfg, SimSpec(MODELS[model], find_hardware(gpu), 1))
    sp = SamplingParams(max_tokens=output_len, ignore_eos=True)
    pending = [(i / rate, r) for i, r in enumerate(records)]
    t0 = time.perf_counter()
    i = 0
    while i < len(pending) or eng.has_unfinished_requests():
        while i < len(pending) and pending[i][0] <= eng.now:
            arrival, r = pending[i]
            eng.add_request(r.id, None, sp, arrival_time=arrival, tokenized=(r.prompt, None))
            i += 1
        if not eng.has_unfinished_requests():
            eng.clock.jump_to(pending[i][0])
            continue
        eng.step()
    wall = time.perf_counter() - t0
    return [s.to_dict() for s in eng.recorder.steps], [r.to_dict() for r in eng.recorder.requests], wall


def sim_traces(scan_every: int = 3, **overrides: Any) -> dict[str, Any]:
    """The GPU-scale traces of :data:`SIM_TRACE`: without and with a scan every ``scan_every``-th request."""
    args = SIM_TRACE | overrides
    return {
        "tenants": prefix_repetition_records(**args),
        "tenants + scan": prefix_repetition_records(**args, scan_every=scan_every),
    }


# ---------------------------------------------------------------- exercise 13.1: a hand-built sequence
#: the exercise's pool events: requests allocate blocks for their content, hit cached content, finish (free)
EXERCISE_EVENTS: list[tuple] = [
    ("alloc", "A", ["sys 0", "sys 1", "A own"]),
    ("free", "A"),
    ("hit", "B", ["sys 0", "sys 1"]),
    ("alloc", "B", ["B own"]),
    ("free", "B"),
    ("alloc", "X", ["X 0", "X 1", "X 2", "X 3"]),
    ("free", "X"),
]
EXERCISE_POOL = 8
EXERCISE_NEED = 3


def pool_after(policy: str, events: Sequence[tuple] = EXERCISE_EVENTS, num_blocks: int = EXERCISE_POOL):
    """A :class:`~workbench.kv.block_pool.BlockPool` of ``num_blocks`` under ``policy`` after ``events``:
    ``("alloc", req, [labels])`` takes one block per label (the policy's choice) and caches the label as its
    content; ``("hit", req, [labels])`` finds cached content (a prefix hit, the block gains an owner);
    ``("free", req)`` releases the request's blocks, as the KV manager does. Returns ``(pool, {label: block})``."""
    from workbench.kv.block_pool import BlockPool

    pool = BlockPool(num_blocks, policy)
    owned: dict[str, list[int]] = {}
    where: dict[str, int] = {}
    for ev in events:
        kind, req = ev[0], ev[1]
        if kind == "alloc":
            for label, b in zip(ev[2], pool.allocate(len(ev[2])), strict=True):
                pool.cache_block(b, label.encode())
                where[label] = b
                owned.setdefault(req, []).append(b)
        elif kind == "hit":
            for label in ev[2]:
                b = pool.cached[label.encode()]
                pool.touch(b)
                owned.setdefault(req, []).append(b)
        elif kind == "free":
            pool.free(owned.pop(req))
        else:
            raise ValueError(f"unknown event {ev!r}: use 'alloc', 'hit' or 'free'")
    return pool, where


def next_victims(
    policy: str, events: Sequence[tuple] = EXERCISE_EVENTS, num_blocks: int = EXERCISE_POOL, need: int = EXERCISE_NEED
) -> list[int]:
    """The blocks a pool under ``policy`` hands out for a request of ``need`` new blocks after ``events``."""
    pool, _ = pool_after(policy, events, num_blocks)
    return pool.allocate(need)


def scenario_rows(events: Sequence[tuple] = EXERCISE_EVENTS, num_blocks: int = EXERCISE_POOL) -> list[dict]:
    """Each block after ``events`` (they allocate the same blocks under every built-in policy: only empty ones are
    handed out until the end): its content, hits, and the order it was cached and freed in."""
    pool, where = pool_after("lru", events, num_blocks)
    pol = pool.policy
    label = {b: k for k, b in where.items()}
    lru = list(pol.free)
    return [
        {
            "block": b,
            "content": label.get(b, "-"),
            "hits": pol.hits[b],
            "cached_order": sorted(where.values(), key=lambda x: pol.cached_seq[x]).index(b) if b in label else None,
            "freed_order": lru.index(b),
        }
        for b in range(num_blocks)
    ]


def scenario_table(rows: Sequence[dict]) -> Table:
    cols = [
        Column("block", "block", str),
        Column("content", "content", str, align="left"),
        Column("cached_order", "cached (1st = 0)", lambda v: "-" if v is None else str(v)),
        Column("hits", "hits since cached", str),
        Column("freed_order", "place in the free queue (0 = freed longest ago)", str),
    ]
    return Table(cols, rows)


def eviction_exercise() -> dict[str, Any]:
    """Exercise 13.1's context: the events, the pool size and the blocks the next request needs."""
    return {"events": list(EXERCISE_EVENTS), "num_blocks": EXERCISE_POOL, "need": EXERCISE_NEED}


# ---------------------------------------------------------------- the panel
class EvictionPanel(_Panel):
    """One policy on one multi-tenant trace per Run: ``prefix_cache_eviction`` (the built-in names and the classes
    registered with :func:`workbench.plugins.register_class`), the trace's knobs (``tenants``, ``zipf``,
    ``scan_every``: 0 = no scan). Without ``llm``: the simulator's runs at GPU scale (:data:`SIM_TRACE`,
    :func:`sim_replay`), with the pool (``num_gpu_blocks_override``) as a control. With ``llm`` (an engine from
    :func:`eviction_engine`): real runs of the bundled model on this CPU (:data:`REAL_TRACE`, :func:`real_run`; the
    pool is the engine's). Each Run adds its tenants' and all prompts' hit rates to the chart; the status line gives
    its figures.

    Args:
        num_prompts: requests per run (default: 200 simulated, :data:`REAL_TRACE`'s 24 real).
        llm: a paged engine with prefix caching for real runs, or ``None`` for the simulator.

    Raises:
        ImportError: ipywidgets / anywidget missing.
    """

    def __init__(self, num_prompts: int | None = None, llm=None):
        from workbench.viz.live import _require_widgets

        w = _require_widgets()
        st = {"description_width": "initial"}
        self.llm = llm
        self.num_prompts = num_prompts or (REAL_TRACE["num_prompts"] if llm is not None else 200)
        trace = REAL_TRACE if llm is not None else SIM_TRACE
        controls = {
            "prefix_cache_eviction": w.Dropdown(options=self.policy_options(), value="lru",
                                                description="prefix_cache_eviction", style=st),
            "tenants": w.IntSlider(min=1, max=8 if llm is not None else 32, value=trace["num_prefixes"],
                                   description="tenants", style=st),
            "zipf": w.FloatSlider(min=0.0, max=2.0, step=0.1, value=trace["zipf"], description="Zipf exponent",
                                  style=st),
            "scan_every": w.IntSlider(min=0, max=10, value=3, description="scan every N (0 = none)", style=st),
        }  # fmt: skip
        if llm is None:
            controls["num_gpu_blocks_override"] = w.Dropdown(
                options=[128, 256, 512, 1024], value=SIM_SETUP["num_blocks"], description="num_gpu_blocks_override",
                style=st,
            )  # fmt: skip
            where = f"simulated {SIM_SETUP['model']}"
        else:
            where = f"this CPU, {llm.llm_engine.memory.num_blocks} blocks"
        self.figure = go.FigureWidget()
        self.figure.add_bar(x=[], y=[], name="tenants' prompts", marker_color="#1f77b4")
        self.figure.add_bar(x=[], y=[], name="all prompts", marker_color="#aec7e8")
        self.figure.update_layout(
            **title_and_legend_above(f"Hit rate per run ({self.num_prompts} requests, {where})", 420),
            barmode="group",
            xaxis_title="run",
            yaxis=percent_axis(0, 1, "hit rate (prompt tokens from the cache)"),
        )
        self._build(controls, self.figure)

    @staticmethod
    def policy_options() -> list[tuple[str, str]]:
        """The dropdown's ``(label, value)`` pairs: the built-ins, then every registered notebook class."""
        from workbench.plugins import registered

        out = [(n, n) for n in BUILTIN]
        for name, cls in registered(EvictionPolicy).items():
            out.append((cls.name if cls.name != EvictionPolicy.name else name, f"workbench.plugins:{name}"))
        return out

    def refresh_policies(self) -> None:
        """Offer the classes registered since the panel was built."""
        c = self.controls["prefix_cache_eviction"]
        value = c.value
        c.options = self.policy_options()
        c.value = value

    def _run(self, values):
        n, scan = values["tenants"], values["scan_every"]
        knobs = {"num_prompts": self.num_prompts, "num_prefixes": n, "zipf": float(values["zipf"])}
        policy, name = values["prefix_cache_eviction"], "scan" if scan else "tenants"
        if self.llm is not None:
            row = run_figures(real_run(self.llm, policy, tenant_trace(scan, **knobs)), policy, name)
        else:
            records = prefix_repetition_records(**(SIM_TRACE | knobs), scan_every=scan)
            steps, reqs, _ = sim_replay(policy, records, num_blocks=values["num_gpu_blocks_override"])
            row = _figures(policy, name, steps, reqs)
        label = f"{len(self.history) + 1}: {row['policy']}" + (f", scan 1/{scan}" if scan else "")
        with self.figure.batch_update():
            for trace, key in zip(self.figure.data, ("tenant_hit_rate", "hit_rate"), strict=True):
                trace.x = (*trace.x, label)
                trace.y = (*trace.y, row[key] or 0.0)
        return row

    def _describe(self, values, row) -> str:
        age = "-" if row["age_mean"] is None else f"{row['age_mean']:,.1f}"
        return (
            f"{row['policy']}: hit rate {_pct(row['hit_rate'])} of all prompt tokens, {_pct(row['tenant_hit_rate'])} "
            f"of the tenants', {_pct(row['hot_hit_rate'])} of tenant 0's; {row['saved_tokens']:,} prefill tokens "
            f"saved, {row['evictions']:,} evictions (mean age {age} steps), TTFT mean {row['ttft_mean_ms']:,.1f} ms "
            + ("(this CPU)" if self.llm is not None else "(simulated)")
        )


# ---------------------------------------------------------------- exercises
def _victims(events, num_blocks: int, need: int) -> dict[str, list[int]]:

    return {p: next_victims(p, events, num_blocks, need) for p in ("lru", "fifo", "lfu")}


@_register(
    "13.1",
    "After these pool events, a request needs 3 new blocks. Which blocks does each policy hand out, in order? "
    '(a dict {"lru": [...], "fifo": [...], "lfu": [...]} of block ids; checked against the engine\'s BlockPool)',
    "lru: the front of the free queue, cached or not (a request's blocks are freed tail first); fifo: empty blocks "
    "first, then by the order the content was cached; lfu: empty blocks first, then fewest hits, ties to the block "
    "freed longest ago.",
)
class _NextVictims:
    @staticmethod
    def solution(events, num_blocks: int, need: int) -> dict[str, list[int]]:
        return _victims(events, num_blocks, need)

    @staticmethod
    def judge(answer, events, num_blocks: int, need: int) -> tuple[bool, str]:
        want = _victims(events, num_blocks, need)
        if not isinstance(answer, dict) or set(answer) != set(want):
            return False, f'give a dict with the keys "lru", "fifo" and "lfu", each a list of {need} block ids'
        try:
            got = {k: [int(b) for b in v] for k, v in answer.items()}
        except (TypeError, ValueError):
            return False, f"each policy's answer is a list of {need} block ids (integers)"
        wrong = [k for k in want if got[k] != want[k]]
        if not wrong:
            return True, (
                f"lru {want['lru']}, fifo {want['fifo']}, lfu {want['lfu']}: LRU hands out part of the system prompt "
                "because the scan was freed after it, FIFO the system prompt first because it was cached first, "
                "LFU the blocks nobody hit"
            )
        notes = []
        for k in wrong:
            g = got[k]
            if sorted(g) == sorted(want[k]):
                notes.append(f"{k}: the right blocks, in another order")
            elif k == "lru" and g[:1] == [4]:
                notes.append(
                    "lru: a request's blocks are freed tail first (X 3 before X 0), and A's and B's before X's"
                )
            elif k == "lru" and any(b in g for b in (4, 5, 6, 7)):
                notes.append("lru: the scan's blocks were freed last, so they sit at the back of the queue")
            elif k == "fifo" and g[:1] != want["fifo"][:1]:
                notes.append("fifo: the content cached first goes first, however often it was hit since")
            elif k == "lfu" and any(b in g for b in (0, 1)):
                notes.append("lfu: the system prompt's blocks have a hit each; blocks with 0 hits go first")
            else:
                notes.append(f"{k}: not {g}")
        return False, "; ".join(notes)
