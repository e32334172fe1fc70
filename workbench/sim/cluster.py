"""Data parallelism in the simulator: ``N`` replicas of one tensor-parallel layout behind a modelled router.

Each replica is its own :class:`~workbench.sim.engine.SimEngine` (own scheduler, KV manager and
:class:`~workbench.sim.engine.SimClock`). The replicas share simulated time in this sense: arrivals
are dispatched in the trace's order; before the arrival at ``t`` is dispatched, every replica with
work is stepped while its clock is before ``t`` (a step that starts before ``t`` may end after it, as
a step in flight does). The router then picks a replica from the replicas' state at ``t`` and the
request joins it with arrival time ``t`` (a replica whose clock is already past ``t`` admits it at its
next step; its TTFT counts from ``t``). After the last arrival every replica runs to completion; the
run's duration is the latest replica clock.

The routing policies are a model of vLLM's router (``vllm-router``), by its policy names
(:data:`ROUTING_POLICIES`), not the router itself: no HTTP, no network delay, no router-side queue.
A replica's *load* is what the router counts for it: requests routed to it and not finished
(waiting, running, swapped, or dispatched and not yet admitted).
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from workbench.sim.engine import SimEngine, SimSpec
from workbench.sim.run import SimResult, finish_run, goodput, new_engine, run_folder, timeline
from workbench.sim.trace import TraceRequest

#: vllm-router 0.1.17's defaults for ``--policy cache_aware`` (``vllm-router --help``)
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5
#: points of the KV-imbalance time grid when no step is given
IMBALANCE_POINTS = 200


@dataclass
class RouterState:
    """What the modelled router knows and remembers.

    Attributes:
        num_replicas: replicas behind it.
        rng: the seeded random source of ``random`` and ``power_of_two``.
        next_rr: ``round_robin``'s next replica.
        trees: per replica, the router's record of the prefixes it sent there: ``prefix_id -> longest
            prefix_len`` (the synthetic prompts share nothing else, so this is exactly what a radix tree
            of their tokens would match).
        tree_tokens: per replica, tokens in that record (shared prefixes once, every request's own tokens).
        cache_threshold, balance_abs_threshold, balance_rel_threshold: ``cache_aware``'s rules.
    """

    num_replicas: int
    rng: random.Random
    next_rr: int = 0
    trees: list[dict[int, int]] = field(default_factory=list)
    tree_tokens: list[int] = field(default_factory=list)
    cache_threshold: float = CACHE_THRESHOLD
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD

    def __post_init__(self) -> None:
        self.trees = self.trees or [{} for _ in range(self.num_replicas)]
        self.tree_tokens = self.tree_tokens or [0] * self.num_replicas


def _least_loaded(loads: list[int], among: list[int] | None = None) -> int:
    """The replica with the fewest requests (of ``among``, default all); ties to the lowest index."""
    idx = range(len(loads)) if among is None else among
    return min(idx, key=lambda i: (loads[i], i))


def round_robin(state: RouterState, req: TraceRequest, loads: list[int]) -> int:
    """Replicas in turn: 0, 1, ..., N-1, 0, ..."""
    i = state.next_rr
    state.next_rr = (i + 1) % state.num_replicas
    return i


def random_choice(state: RouterState, req: TraceRequest, loads: list[int]) -> int:
    """A replica drawn uniformly (seeded)."""
    return state.rng.randrange(state.num_replicas)


def power_of_two(state: RouterState, req: TraceRequest, loads: list[int]) -> int:
    """Two distinct replicas drawn at random; the one with the lower load (the first drawn on a tie)."""
    if state.num_replicas == 1:
        return 0
    a, b = state.rng.sample(range(state.num_replicas), 2)
    return b if loads[b] < loads[a] else a


def least_loaded(state: RouterState, req: TraceRequest, loads: list[int]) -> int:
    """The replica with the fewest running + waiting requests; ties to the lowest index."""
    return _least_loaded(loads)


def _matched(state: RouterState, i: int, req: TraceRequest) -> int:
    """Prompt tokens of ``req`` that replica ``i``'s record already holds (its shared prefix, at most)."""
    if req.prefix_id is None or req.prefix_len <= 0:
        return 0
    return min(req.prefix_len, req.prompt_len, state.trees[i].get(req.prefix_id, 0))


def _record(state: RouterState, i: int, req: TraceRequest) -> None:
    """Insert ``req``'s prompt into replica ``i``'s record."""
    state.tree_tokens[i] += req.prompt_len - _matched(state, i, req)
    if req.prefix_id is not None and req.prefix_len > 0:
        tree = state.trees[i]
        tree[req.prefix_id] = max(tree.get(req.prefix_id, 0), min(req.prefix_len, req.prompt_len))


def cache_aware(state: RouterState, req: TraceRequest, loads: list[int]) -> int:
    """vllm-router's ``cache_aware``, on the router's own record of what it sent where.

    1. Imbalanced — ``max(loads) - min(loads) > balance_abs_threshold`` and ``max(loads) >
       min(loads) * balance_rel_threshold`` — the least-loaded replica.
    2. Otherwise the replica whose record shares the longest prefix with the prompt (ties: least
       loaded, then lowest index), if that prefix is more than ``cache_threshold`` of the prompt;
       else the replica with the smallest record (tokens; ties: least loaded, then lowest index).

    Either way the prompt is then recorded for the chosen replica. The record is never evicted (the
    router evicts past ``--max-tree-size`` characters per worker, 2^25, which short runs do not reach).
    """
    hi, lo = max(loads), min(loads)
    if hi - lo > state.balance_abs_threshold and hi > lo * state.balance_rel_threshold:
        i = _least_loaded(loads)
    else:
        n = range(state.num_replicas)
        best = min(n, key=lambda j: (-_matched(state, j, req), loads[j], j))
        if _matched(state, best, req) > state.cache_threshold * req.prompt_len:
            i = best
        else:
            i = min(n, key=lambda j: (state.tree_tokens[j], loads[j], j))
    _record(state, i, req)
    return i


#: policy name (vllm-router's ``--policy`` names, plus ``least_loaded``) -> ``(state, request, loads) -> replica``
ROUTING_POLICIES: dict[str, Callable[[RouterState, TraceRequest, list[int]], int]] = {
    "round_robin": round_robin,
    "random": random_choice,
    "power_of_two": power_of_two,
    "least_loaded": least_loaded,
    "cache_aware": cache_aware,
}


def check_cluster_args(data_parallel_size: int, routing_policy: str) -> None:
    """Refuse a bad replica count or policy name before anything runs.

    Raises:
        ValueError: ``data_parallel_size`` not an integer >= 1, or a policy not in :data:`ROUTING_POLICIES`.
    """
    if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size={data_parallel_size!r} must be an integer >= 1 (replicas)")
    if routing_policy not in ROUTING_POLICIES:
        raise ValueError(f"routing_policy={routing_policy!r} is not one of {', '.join(ROUTING_POLICIES)}")


def replica_load(eng: SimEngine) -> int:
    """Requests on a replica that have not finished: waiting, running, swapped, or not yet admitted."""
    s = eng.scheduler
    return len(s.waiting) + len(s.running) + len(s.swapped) + len(eng._pending)


def _step_until(eng: SimEngine, t: float) -> float:
    """Step ``eng`` while it has work and its clock is before ``t``; returns the wall seconds it took."""
    t0 = time.perf_counter()
    while eng.now < t and eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0


def _replay(engines: list[SimEngine], trace: list[TraceRequest], policy, state: RouterState, max_tokens, bar):
    """Dispatch ``trace`` over ``engines`` (module docstring) and run them to completion.

    Returns ``(replica of each request, wall seconds per replica)``."""
    walls = [0.0] * len(engines)
    routed = []
    for k, req in enumerate(trace):
        for i, eng in enumerate(engines):
            walls[i] += _step_until(eng, req.arrival_s)
        i = policy(state, req, [replica_load(e) for e in engines])
        engines[i].add_trace([req], max_tokens=max_tokens)
        routed.append(i)
        if bar is not None and k % 200 == 0:
            bar.update(min(round(req.arrival_s), bar.total) - bar.n)
    for i, eng in enumerate(engines):
        walls[i] += _step_until(eng, math.inf)
    return routed, walls


def kv_usage_series(steps: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """``(times, usage)`` of one replica: each step's end (simulated s) and the fraction of its KV pool
    in use after it (``blocks_used / num_blocks``)."""
    t = np.array([s["time_s"] + s["wall_time_s"] for s in steps], dtype=np.float64)
    u = np.array([s["blocks_used"] / s["num_blocks"] if s["num_blocks"] else 0.0 for s in steps], dtype=np.float64)
    return t, u


def kv_imbalance(replica_steps: list[list[dict]], duration_s: float, grid_s: float | None = None) -> dict:
    """KV imbalance of the replicas over time.

    Every replica's KV usage (:func:`kv_usage_series`; 0 before its first step) is sampled on the grid
    ``0, grid_s, 2 grid_s, ... <= duration_s`` (last value at or before each point); at each point the
    ratio is ``max / mean`` of the replicas' usage (1.0 when the mean is 0), so it is 1.0 for one replica
    and >= 1 always.

    Args:
        replica_steps: each replica's step records (``StepStats.to_dict()``).
        duration_s: the run's simulated duration.
        grid_s: grid step (simulated s); ``None``: ``duration_s / 200`` (one point when the duration is 0).

    Returns:
        ``{"grid_s", "ratio_mean", "ratio_max", "series": [{"t_s", "usage": [per replica], "ratio"}]}``.
    """
    if grid_s is None:
        grid_s = duration_s / IMBALANCE_POINTS if duration_s > 0 else 1.0
    if not grid_s > 0:
        raise ValueError(f"grid_s={grid_s!r} must be a positive number of simulated seconds")
    grid = np.arange(0.0, duration_s + grid_s * 1e-9, grid_s) if duration_s > 0 else np.zeros(1)
    cols = []
    for steps in replica_steps:
        t, u = kv_usage_series(steps)
        k = np.searchsorted(t, grid, side="right") - 1
        cols.append(np.where(k >= 0, u[np.maximum(k, 0)] if len(u) else 0.0, 0.0))
    usage = np.stack(cols, axis=1)
    mean = usage.mean(axis=1)
    ratio = np.where(mean > 0, usage.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)
    series = [
        {"t_s": float(g), "usage": [float(x) for x in row], "ratio": float(r)}
        for g, row, r in zip(grid.tolist(), usage, ratio.tolist())
    ]
    return {
        "grid_s": float(grid_s),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "series": series,
    }


def per_rank_memory(eng: SimEngine) -> dict:
    """One rank's device memory of a replica (bytes): capacity, weights, activations, KV pool, NCCL buffers."""
    m = eng.memory
    return {
        "device": m.device_name,
        "capacity_bytes": m.capacity_bytes,
        "weights_bytes": m.weights_bytes,
        "activation_bytes": m.activation_bytes,
        "kv_cache_bytes": m.kv_pool_bytes,
        "nccl_buffer_bytes": m.comm_buffer_bytes,
        "num_blocks": m.num_blocks,
    }


def replica_summary(res: SimResult, routed: int, steps: list[dict]) -> dict:
    """A replica's run summary plus what the cluster view adds: requests routed, prefill tokens computed,
    prefix-cache hit rate (``None`` without prefix caching or queries), preemptions, per-rank memory."""
    s = res.summary
    return s | {
        "requests_routed": routed,
        "prefill_tokens_computed": int(sum(st["num_prefill_tokens"] for st in steps)),
        "prefix_cache_hit_rate_frac": s.get("prefix_cache_hit_rate_frac"),
        "preemptions_total": s["preemptions_total"],
        "per_rank_memory": per_rank_memory(res.engine),
    }


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def overall_summary(reqs: list[dict], replicas: list[dict], duration: float, slo, imbalance: dict) -> dict:
    """The cluster's figures from every replica's request records and summaries (simulated s)."""
    ok = [r for r in reqs if not r.get("error")]
    fin = [r for r in ok if r.get("finish_reason") in ("stop", "length")]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
    tpot = [r["tpot_s"] for r in ok if r.get("tpot_s") is not None]
    out_tok = sum(r["output_tokens"] for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    return {
        "requests_total": len(reqs),
        "requests_finished": len(fin),
        "requests_errored": len(reqs) - len(ok),
        "simulated_duration_s": duration,
        "request_throughput_req_s": per_s(len(fin)),
        "output_throughput_tok_s": per_s(out_tok),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "request_goodput_req_s": goodput(reqs, duration, *slo) if slo is not None else None,
        "goodput_slo_s": {"ttft": slo[0], "tpot": slo[1]} if slo is not None else None,
        "prefill_tokens_computed": sum(r["prefill_tokens_computed"] for r in replicas),
        "prefix_cache_hits_total": sum(r.get("prefix_cache_hits_total") or 0 for r in replicas),
        "prefix_cache_queries_total": sum(r.get("prefix_cache_queries_total") or 0 for r in replicas),
        "preemptions_total": sum(r["preemptions_total"] for r in replicas),
        "kv_imbalance_mean": imbalance["ratio_mean"],
        "kv_imbalance_max": imbalance["ratio_max"],
    }


@dataclass
class ClusterResult:
    """A simulated data-parallel run: each replica's :class:`SimResult`, the request -> replica map, the
    overall summary (with ``replicas`` and ``imbalance``), the merged timeline and the folder."""

    replicas: list[SimResult]
    routed: list[int]
    summary: dict
    timeline: list[dict]
    run_dir: Path | None
    replay_wall_s: float
    routing_policy: str = "round_robin"


def simulate_cluster(
    spec: SimSpec,
    trace: list[TraceRequest],
    *,
    data_parallel_size: int = 2,
    routing_policy: str = "round_robin",
    seed: int = 0,
    output_dir: str | Path | None = "runs",
    run_name: str | None = None,
    progress: bool = False,
    record_itl: bool = True,
    window_s: float = 600.0,
    trace_info: dict | None = None,
    max_tokens: int | None = None,
    ttft_slo_s: float | None = None,
    tpot_slo_s: float | None = None,
    imbalance_grid_s: float | None = None,
    router_args: dict | None = None,
    **engine_args,
) -> ClusterResult:
    """Replay ``trace`` on ``data_parallel_size`` replicas of ``spec`` behind the modelled router.

    Args:
        spec: one replica's model, hardware and tensor-parallel size (GPUs in all: dp x tp).
        trace: requests in arrival order.
        data_parallel_size: replicas (>= 1).
        routing_policy: a :data:`ROUTING_POLICIES` name.
        seed: seed of the ``random`` / ``power_of_two`` choices.
        output_dir, run_name: the folder (``None``: nothing written): ``summary.json``, ``config.json``,
            ``timeline.json`` and each replica's run folder under ``replica-<i>/``.
        record_itl, window_s, max_tokens: as :func:`workbench.sim.run.simulate_job`.
        trace_info: how the trace was made (written to ``config.json``).
        ttft_slo_s, tpot_slo_s: the goodput objectives (s); both ``None``: no goodput.
        imbalance_grid_s: the KV-imbalance grid step (:func:`kv_imbalance`).
        router_args: ``cache_aware``'s ``cache_threshold``, ``balance_abs_threshold``, ``balance_rel_threshold``.
        **engine_args: each replica's :class:`~workbench.config.EngineConfig` fields.

    Raises:
        ValueError: a bad replica count or policy (before anything runs), bad engine arguments, a
            memory budget without room for one sequence.
    """
    check_cluster_args(data_parallel_size, routing_policy)
    top = run_folder(output_dir, run_name)
    engines = [new_engine(spec, None if top is None else top / f"replica-{i}", **engine_args)
               for i in range(data_parallel_size)]  # fmt: skip
    for eng in engines:
        eng.record_itl = record_itl
    state = RouterState(data_parallel_size, random.Random(seed), **(router_args or {}))
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=round(trace[-1].arrival_s if trace else 0.0), desc="simulated s (arrivals)", unit="s")
    enabled = gc.isenabled()
    gc.disable()  # as SimEngine.run: many short-lived objects without cycles
    try:
        routed, walls = _replay(engines, trace, ROUTING_POLICIES[routing_policy], state, max_tokens, bar)
    finally:
        if enabled:
            gc.enable()
        if bar is not None:
            bar.close()
    slo = None if ttft_slo_s is None and tpot_slo_s is None else (ttft_slo_s, tpot_slo_s)
    info = trace_info or {"num_requests": len(trace)}
    return _finish(engines, routed, walls, top, window_s, info, slo, imbalance_grid_s, routing_policy, state)


def _finish(engines, routed, walls, top, window_s, info, slo, grid_s, policy, state) -> ClusterResult:
    counts = [routed.count(i) for i in range(len(engines))]
    results, reps, all_steps, all_reqs = [], [], [], []
    for i, eng in enumerate(engines):
        rinfo = info | {"replica": i, "requests_routed": counts[i], "routing_policy": policy}
        res = finish_run(eng, None if top is None else top / f"replica-{i}", walls[i], window_s, rinfo, slo)
        steps = [s.to_dict() for s in eng.recorder.steps]
        all_steps.append(steps)
        all_reqs += [r.to_dict() for r in eng.recorder.requests]
        results.append(res)
        reps.append(replica_summary(res, counts[i], steps))
    duration = max(e.now for e in engines)
    imb = kv_imbalance(all_steps, duration, grid_s)
    summary = overall_summary(all_reqs, reps, duration, slo, imb)
    summary |= {"replay_wall_s": sum(walls), "replicas": reps, "imbalance": imb}
    tl = timeline(all_reqs, window_s, duration)
    if top is not None:
        _write_cluster(top, engines, summary, tl, info, policy, state)
    return ClusterResult(results, routed, summary, tl, top, sum(walls), policy)


def cluster_config(engines: list[SimEngine], info: dict, policy: str, state: RouterState) -> dict:
    """``config.json`` of a data-parallel run: the layout, the router model and one replica's engine arguments."""
    from workbench.sim.run import run_config

    tp = engines[0].spec.tensor_parallel_size
    return {
        "simulated": True,
        "data_parallel_size": len(engines),
        "tensor_parallel_size": tp,
        "num_gpus_total": len(engines) * tp,
        "routing_policy": policy,
        "router_model": {
            "cache_threshold": state.cache_threshold,
            "balance_abs_threshold": state.balance_abs_threshold,
            "balance_rel_threshold": state.balance_rel_threshold,
        },
        "replica": run_config(engines[0], info) | {"memory": engines[0].memory.to_dict()},
        "trace": info,
    }


def _write_cluster(top: Path, engines, summary: dict, tl: list[dict], info: dict, policy: str, state) -> None:
    import json

    top.mkdir(parents=True, exist_ok=True)
    (top / "summary.json").write_text(json.dumps(summary, indent=2))
    (top / "timeline.json").write_text(json.dumps(tl, indent=2))
    (top / "config.json").write_text(json.dumps(cluster_config(engines, info, policy, state), indent=2, default=str))
