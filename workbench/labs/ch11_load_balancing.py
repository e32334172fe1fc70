"""Chapter 11: load balancing across replicas — ``workbench serve`` replicas behind vLLM's router, one policy at a
time, measured per replica.

- :func:`start_replicas` — :class:`workbench.server.replicas.Replicas` with the chapter's small engines (each its own
  KV pool, publishing its KV-cache events so that ``kv_aware`` works), registered so that every process is stopped
  by PID when the kernel exits, also after a failed cell (:func:`stop_all` stops them now);
- :func:`make_workload` — the three workloads (:data:`WORKLOADS`): a multi-tenant trace with Zipf-distributed
  tenants, each with its own system prompt; a skewed mix of a few long requests among many short ones; multi-turn
  sessions whose every turn repeats the conversation so far. Seeded, token counts from the bundled tokenizer;
- :class:`PolicyRuns` — one ``bench serve`` run per (policy, workload) through a router with that policy, the
  replicas' ``/metrics`` read every half second (:class:`workbench.bench.replica_metrics.ReplicaMonitor`) and drawn
  live per replica (KV-cache usage, waiting requests, fragmentation rate) with the KV imbalance; :meth:`PolicyRuns.table`
  side by side;
- :class:`PolicyPanel` — policy, replica count and workload as widgets and a Run button over the same;
- :func:`lose_a_replica` — a run during which one replica is SIGKILLed: what each request saw, by send time;
- :func:`best_policy` and :func:`workbench.bench.replica_metrics.kv_imbalance` — the rules the exercises check.

Latencies and throughputs are measured on whatever CPU runs the notebook: they vary run to run. Which replica
served what, hit rates and token counts follow from the policy and the workload.
"""

from __future__ import annotations

import atexit
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.bench.replica_metrics import ReplicaMonitor, kv_imbalance
from workbench.bench.samples import SampleRequest
from workbench.labs.exercise_registry import _register
from workbench.viz.table import Column, Table

#: each replica's engine: a small pool (so KV usage and its imbalance are visible), four sequences per step
REPLICA_DEFAULTS: dict[str, Any] = {"max_model_len": 1024, "max_num_seqs": 4, "num_gpu_blocks_override": 96}
#: the policies the chapter compares (the router has also ``random``, ``consistent_hash``, ``sticky_least_loaded``)
POLICIES = ("round_robin", "power_of_two", "cache_aware", "kv_aware")
#: what each workload is, in one line
WORKLOADS = {
    "multi-tenant": "Zipf-distributed tenants (exponent 1.5), each with its own ~200-token system prompt",
    "skewed": "one request in five is long (~500 prompt tokens, 48 out), the rest short (~20 tokens, 8 out)",
    "multi-turn": "sessions of four turns, interleaved; each turn's prompt is the conversation so far plus a question",
}
_REPLICAS: list = []
_WORDS = (
    "invoice shipment ledger refund warranty contract audit payroll tariff quota roster voucher manifest "
    "inventory pension mortgage premium dividend subsidy rebate surcharge deposit escrow lease"
).split()


def start_replicas(n: int = 2, **engine_args: Any):
    """``n`` replicas of ``workbench serve`` (:data:`REPLICA_DEFAULTS` updated by ``engine_args``) with KV events
    and prefix caching on, behind a ``round_robin`` router; started, and stopped at kernel exit.

    Raises:
        RuntimeError: ``vllm-router`` not installed, or a process did not come up (everything started is stopped).
    """
    from workbench.server.replicas import Replicas

    rs = Replicas(n, kv_events=True, threads=1, **(REPLICA_DEFAULTS | engine_args))
    _REPLICAS.append(rs)  # registered before it starts: stop_all / atexit stop it even if start fails half-way
    return rs.start()


def stop_all() -> int:
    """Stop every replica set this module started (router and replicas, by PID); how many sets."""
    n = 0
    while _REPLICAS:
        _REPLICAS.pop().stop()
        n += 1
    return n


atexit.register(stop_all)


# ---------------------------------------------------------------- workloads
def _tokenizer():
    from workbench.bench.samples import load_tokenizer

    return load_tokenizer(None)[0]


def _sentence(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS, n_words)) + "."


def _system_prompt(tenant: int, rng: np.random.Generator) -> str:
    rules = " ".join(f"Rule {i + 1}: {_sentence(rng, 8)}" for i in range(12))
    return f"You are the assistant of tenant {tenant}. Answer in one short paragraph. {rules}\n"


def make_workload(name: str, num_requests: int = 24, seed: int = 0) -> list[SampleRequest]:
    """The workload ``name`` (:data:`WORKLOADS`) as ``bench serve`` samples, in send order; ``prompt_len`` is the
    bundled tokenizer's count. Every call with the same arguments gives the same prompts; a different ``seed``
    gives different tenants and texts (so a second run does not find the first one's prefixes cached).

    Raises:
        ValueError: an unknown name, or fewer than 4 requests.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload {name!r} is not one of {', '.join(WORKLOADS)}")
    if num_requests < 4:
        raise ValueError(f"num_requests={num_requests}: give at least 4")
    rng = np.random.default_rng(seed)
    if name == "multi-tenant":
        tenants = [_system_prompt(1000 * seed + t, rng) for t in range(4)]
        who = (rng.zipf(1.5, num_requests) - 1) % len(tenants)
        items = [(tenants[t] + f"Question {i}: {_sentence(rng, 6)}", 16) for i, t in enumerate(who)]
    elif name == "skewed":
        items = []
        for i in range(num_requests):
            if i % 5 == 2:
                items.append((f"Report {seed}-{i}. " + " ".join(_sentence(rng, 12) for _ in range(30)), 48))
            else:
                items.append((f"Note {seed}-{i}: {_sentence(rng, 10)}", 8))
    else:
        sessions = max(1, num_requests // 4)
        history = [_system_prompt(1000 * seed + 500 + s, rng) for s in range(sessions)]
        order = rng.permutation(np.repeat(np.arange(sessions), 4))  # sessions interleave; each keeps its turn order
        items = []
        for s in order[:num_requests]:
            history[s] += f"User: {_sentence(rng, 8)}\nAssistant:"
            items.append((history[s], 16))
            history[s] += f" {_sentence(rng, 10)}\n"  # the answer the next turn carries
    tok = _tokenizer()
    return [SampleRequest(p, len(tok.encode(p)), out) for p, out in items]


def workload_table(workloads: dict[str, list[SampleRequest]]) -> Table:
    """One row per workload: requests, prompt tokens (mean, max), output tokens, and the share of prompt tokens
    that repeat an earlier prompt's start (what a prefix cache can save, at best)."""
    rows = []
    for name, samples in workloads.items():
        lens = [s.prompt_len for s in samples]
        rows.append(
            {
                "workload": name,
                "requests": len(samples),
                "prompt_mean": float(np.mean(lens)),
                "prompt_max": max(lens),
                "output": sum(s.expected_output_len for s in samples),
                "shared": shared_prefix_share(samples),
            }
        )
    return Table(
        [Column("workload", "workload"), Column("requests", "requests"),
         Column("prompt_mean", "prompt tokens, mean", _f(0)), Column("prompt_max", "prompt tokens, max"),
         Column("output", "output tokens, all"), Column("shared", "prompt tokens seen before (%)", _pct)],
        rows,
    )  # fmt: skip


def shared_prefix_share(samples: Sequence[SampleRequest]) -> float:
    """The fraction of all prompt tokens that lie in the longest prefix a prompt shares with any earlier one
    (counted in characters, scaled to tokens): an upper bound on a prefix cache's hit rate for this send order."""
    seen: list[str] = []
    shared = total = 0.0
    for s in samples:
        p = s.prompt
        best = max((_common(p, q) for q in seen), default=0)
        shared += s.prompt_len * best / max(len(p), 1)
        total += s.prompt_len
        seen.append(p)
    return shared / total if total else 0.0


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# ---------------------------------------------------------------- one run per policy
def run_policy(replicas, policy: str, samples: list[SampleRequest], request_rate: float,
               on_reading=None, poll_s: float = 0.5) -> dict:  # fmt: skip
    """``samples`` through a router with ``policy`` in front of ``replicas`` at ``request_rate`` (Poisson, seeded):
    ``bench serve``'s result with the replicas' figures (``replicas``, ``kv_imbalance_*``, ``replica_timeline``).
    ``on_reading(monitor)`` is called every ``poll_s`` s in the caller's thread while the load runs.

    Raises:
        ValueError: an unknown policy (before anything starts).
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of the chapter's: {', '.join(POLICIES)}")
    with replicas.router_process(policy) as router:
        monitor = ReplicaMonitor(replicas.urls, interval_s=poll_s)
        th, box = _bench_in_thread(router.base_url, replicas.model_name, samples, request_rate, monitor)
        while th.is_alive():
            th.join(poll_s)
            if on_reading is not None and monitor.readings:
                on_reading(monitor)
    if "err" in box:
        raise box["err"]
    return box["res"]


def _bench_in_thread(base_url: str, model: str, samples, request_rate: float, monitor: ReplicaMonitor):
    """``bench serve`` of ``samples`` against ``base_url`` in a started daemon thread, reading the replicas with
    ``monitor``; the thread and the box that gets its result (``"res"``) or its exception (``"err"``)."""
    from workbench.bench.serve import run_bench_serve

    box: dict = {}

    def load() -> None:
        try:
            box["res"] = run_bench_serve(
                base_url=base_url, samples=samples, model=model, request_rate=request_rate, seed=0,
                temperature=0.0, save_detailed=True, disable_tqdm=True, print_result=False, replica_monitor=monitor,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - raised in the caller's thread
            box["err"] = e

    th = threading.Thread(target=load, name="bench-serve-load", daemon=True)
    th.start()
    return th, box


def summarize(res: dict, policy: str, workload: str, slo: dict | None = None) -> dict:
    """One row of the comparison: throughput, TTFT p50 / p99 (ms), goodput under ``slo`` (``{"ttft_s",
    "tpot_s"}``), prefix-cache hit rate and prefill tokens computed over all replicas, preemptions, the KV
    imbalance, and how many requests each replica answered."""
    reps = res["replicas"]
    hits = sum(r["prefix_cache_hits"] for r in reps)
    queries = sum(r["prefix_cache_queries"] for r in reps)
    ttfts = [t for t in res["ttfts"] if t is not None]
    row = {
        "policy": policy,
        "workload": workload,
        "completed": res["completed"],
        "failed": res["failed"],
        "throughput": res["request_throughput"],
        "output_throughput": res["output_throughput"],
        "ttft_p50": 1000 * float(np.percentile(ttfts, 50)) if ttfts else None,
        "ttft_p99": 1000 * float(np.percentile(ttfts, 99)) if ttfts else None,
        "hit_rate": hits / queries if queries else None,
        "prefill_computed": sum(r["prefill_tokens_computed"] for r in reps),
        "preemptions": sum(r["preemptions"] for r in reps),
        "imbalance_mean": res["kv_imbalance_mean"],
        "imbalance_max": res["kv_imbalance_max"],
        "peak_kv": [r["max_kv_cache_usage"] for r in reps],
        "split": [int(r["requests"]) for r in reps],
        "ttfts": list(res["ttfts"]),
        "tpots": _tpots(res),
        "duration": res["duration"],
    }
    if slo is not None:
        apply_slo([row], slo)
    return row


def _tpots(res: dict) -> list[float | None]:
    out = []
    for ttft, e2el, n in zip(res["ttfts"], res["latencies"], res["output_lens"]):
        out.append(None if ttft is None or e2el is None or n < 2 else (e2el - ttft) / (n - 1))
    return out


def slo_from(row: dict, ttft_factor: float = 2.0) -> dict:
    """An SLO relative to this machine: TTFT ≤ ``ttft_factor`` × the row's median TTFT, rounded up to 10 ms, and
    no TPOT target (``{"ttft_s", "tpot_s"}`` in seconds; ``tpot_s`` is ``inf``)."""
    return {"ttft_s": math.ceil(ttft_factor * row["ttft_p50"] / 10) * 10 / 1000, "tpot_s": math.inf}


def apply_slo(rows: Sequence[dict], slo: dict) -> list[dict]:
    """Add ``goodput`` (requests meeting ``slo`` per second of the run) to each row; the same rows."""
    for r in rows:
        good = sum(
            1
            for t, p in zip(r["ttfts"], r["tpots"])
            if t is not None and t <= slo["ttft_s"] and (p is None or p <= slo["tpot_s"])
        )
        r["goodput"] = good / r["duration"] if r["duration"] else 0.0
        r["slo"] = slo
    return list(rows)


class PolicyRuns:
    """Runs of policies on workloads over the same replicas, drawn live: per replica its KV-cache usage and its
    waiting requests, and the KV imbalance (fullest replica over the mean), against seconds since the first run;
    a dotted line where each run starts, named by its policy.

    Attributes:
        rows: :func:`summarize` of every run, in order. results: ``bench serve``'s result of every run.
    """

    def __init__(self, replicas, request_rate: float, num_requests: int = 24, widget: bool = True) -> None:
        self.replicas, self.request_rate, self.num_requests = replicas, request_rate, num_requests
        self.rows: list[dict] = []
        self.results: list[dict] = []
        self.slo: dict | None = None
        self._t0 = time.monotonic()
        self.figure = live_figure(len(replicas.urls), widget=widget)

    def run(self, policy: str, workload: str, seed: int | None = None) -> dict:
        """One run of ``workload`` through ``policy`` (the workload's texts seeded by the run's index unless
        ``seed`` is given, so no run finds an earlier run's prompts cached); its row."""
        seed = len(self.rows) + 1 if seed is None else seed
        samples = make_workload(workload, self.num_requests, seed=seed)
        start = time.monotonic() - self._t0
        self._mark(start, f"{policy} · {workload}")
        drawn = [0]

        def draw(monitor: ReplicaMonitor) -> None:
            new = monitor.readings[drawn[0] :]
            drawn[0] += len(new)
            add_readings(self.figure, [{**r, "t_s": start + r["t_s"]} for r in new])

        res = run_policy(self.replicas, policy, samples, self.request_rate, on_reading=draw)
        draw_final = res["replica_timeline"][drawn[0] :]
        add_readings(self.figure, [{"t_s": start + r["t_s"], "replicas": _as_replicas(r)} for r in draw_final])
        row = summarize(res, policy, workload)
        self.rows.append(row)
        self.slo = slo_from(min(self.rows, key=lambda r: r["ttft_p50"] or math.inf))
        apply_slo(self.rows, self.slo)  # every row under the same SLO, set by the fastest run so far
        self.results.append(res)
        return row

    def _mark(self, t: float, label: str) -> None:
        self.figure.add_vline(x=t, line={"dash": "dot", "color": "grey", "width": 1})
        self.figure.add_annotation(x=t, xref="x", y=1.0, yref="y domain", xanchor="left", yanchor="top",
                                   textangle=-90, showarrow=False, text=label, font={"size": 10, "color": "#555"})  # fmt: skip

    def table(self, workload: str | None = None) -> Table:
        """The runs (of ``workload``, or all) side by side; goodput under :attr:`slo` (TTFT ≤ twice the fastest
        run's median TTFT, rounded up to 10 ms)."""
        return policy_table(
            [r for r in self.rows if workload in (None, r["workload"])], workload_column=workload is None
        )

    def static(self) -> go.Figure:
        """The figure as a plain ``go.Figure`` (stored in the notebook; a widget's state is not)."""
        return go.Figure(self.figure)


def _as_replicas(reading: dict) -> list[dict]:
    keys = ("kv_cache_usage", "waiting", "fragmentation_rate")
    return [{k: reading[k][i] for k in keys} for i in range(len(reading["kv_cache_usage"]))]


_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728")


def live_figure(n_replicas: int, widget: bool = True):
    """Four panels against seconds: KV-cache usage (%), waiting requests and fragmentation rate (%) per replica, and
    the KV imbalance."""
    fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("KV-cache usage per replica (vllm:kv_cache_usage_perc)",
                                        "waiting requests per replica (vllm:num_requests_waiting)",
                                        "fragmentation rate per replica (workbench:fragmentation_rate)",
                                        "KV imbalance: fullest replica's usage / the replicas' mean"))  # fmt: skip
    f = go.FigureWidget(fig) if widget else go.Figure(fig)
    for i in range(n_replicas):
        c = {"color": _COLORS[i % len(_COLORS)]}
        f.add_scatter(x=[], y=[], mode="lines", name=f"replica {i}", line=c, legendgroup=str(i), row=1, col=1)
        for row in (2, 3):
            f.add_scatter(x=[], y=[], mode="lines", name=f"replica {i}", line=c, legendgroup=str(i),
                          showlegend=False, row=row, col=1)  # fmt: skip
    f.add_scatter(x=[], y=[], mode="lines", name="imbalance", line={"color": "black"}, row=4, col=1)
    f.update_layout(height=940, hovermode="x unified", margin={"t": 90}, width=920 if widget else None,
                    legend={"orientation": "h", "y": 1.06, "yanchor": "bottom", "x": 0})  # fmt: skip
    f.update_yaxes(title="%", rangemode="tozero", row=1, col=1)
    f.update_yaxes(title="requests", rangemode="tozero", row=2, col=1)
    f.update_yaxes(title="%", rangemode="tozero", row=3, col=1)
    f.update_yaxes(title="max / mean", range=[0.9, n_replicas + 0.1], row=4, col=1)
    f.update_xaxes(title="seconds since the first run", row=4, col=1)
    return f


def add_readings(fig, readings: list[dict]) -> None:
    """Append monitor readings (``{"t_s", "replicas": [{"kv_cache_usage", "waiting", "fragmentation_rate", ...}]}``)
    to :func:`live_figure`'s traces (three per replica, then the imbalance); a replica that did not answer adds a
    gap."""
    if not readings:
        return
    n = len(readings[0]["replicas"])
    with _batch(fig):
        d = fig.data
        ts = tuple(r["t_s"] for r in readings)
        for i in range(n):
            for j, (key, k) in enumerate((("kv_cache_usage", 100), ("waiting", 1), ("fragmentation_rate", 100))):
                tr = d[3 * i + j]
                tr.x, tr.y = (*tr.x, *ts), (*tr.y, *(_scaled(r["replicas"][i][key], k) for r in readings))
        imb = tuple(kv_imbalance([x["kv_cache_usage"] for x in r["replicas"]]) for r in readings)
        d[3 * n].x, d[3 * n].y = (*d[3 * n].x, *ts), (*d[3 * n].y, *imb)


def _scaled(v, k):
    return None if v is None else k * v


def _batch(fig):
    from contextlib import nullcontext

    return fig.batch_update() if isinstance(fig, go.FigureWidget) else nullcontext()


# ---------------------------------------------------------------- tables
def _f(n: int):
    return lambda v: "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:,.{n}f}"


def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:.0f}"


def policy_table(rows: Sequence[dict], workload_column: bool = True) -> Table:
    """Runs side by side: policy, workload, req/s, TTFT p50 / p99 (ms), goodput (under the rows' ``slo``),
    prefix-cache hit rate (%), prefill tokens computed, preemptions, the KV imbalance's time-mean, each replica's
    peak KV-cache usage and requests per replica (``workload_column``: name each row's workload). (The imbalance's maximum is left out: it is ``n`` at a run's
    first request, which lands on one replica while the others are still empty.)"""
    cols = [Column("policy", "policy"), *([Column("workload", "workload")] if workload_column else []),
            Column("throughput", "req/s", _f(2)), Column("ttft_p50", "TTFT p50 (ms)", _f(0)),
            Column("ttft_p99", "TTFT p99 (ms)", _f(0)), Column("goodput", "goodput (req/s)", _f(2)),
            Column("hit_rate", "prefix hits (%)", _pct), Column("prefill_computed", "prefill tokens computed", _f(0)),
            Column("preemptions", "pre-empted", _f(0)), Column("imbalance_mean", "KV imbalance (mean)", _f(2)),
            Column("peak_kv", "peak KV (%)", lambda v: " / ".join(_pct(x) for x in v)),
            Column("split", "requests", lambda v: " / ".join(map(str, v)))]  # fmt: skip
    return Table(cols, list(rows))


def split_table(rows: Sequence[dict]) -> Table:
    """Only what follows from the policy and the workload, not from timing: requests per replica, prefix-cache
    hit rate and prefill tokens computed."""
    cols = [Column("policy", "policy"), Column("workload", "workload"),
            Column("split", "requests per replica", lambda v: " / ".join(map(str, v))),
            Column("hit_rate", "prefix hits (%)", _pct),
            Column("prefill_computed", "prefill tokens computed", _f(0))]  # fmt: skip
    return Table(cols, list(rows))


# ---------------------------------------------------------------- a replica lost
def lose_a_replica(replicas, samples: list[SampleRequest], request_rate: float, kill_after_s: float,
                   victim: int = 1, policy: str = "round_robin") -> dict:  # fmt: skip
    """Send ``samples`` through ``policy`` and SIGKILL replica ``victim`` ``kill_after_s`` seconds after the first
    request. The result: ``bench serve``'s (``failed``, ``errors``, per-request latencies) with ``kill_s`` (when the
    kill came, seconds after the first request was sent), ``send_s`` (each request's send time, the same clock),
    ``failed_sent_before`` / ``sent_after`` / ``answered_after`` (failed requests sent before the kill; requests
    sent after it, and how many of those were answered), ``e2el_before_s`` / ``e2el_after_s`` (median end-to-end
    latency of the answered requests sent before / after the kill: what absorbing the load costs), ``victim_alive``
    (its ``/health`` after the run), and the
    router's ``retries`` and circuit-breaker ``breaker_open`` for the lost replica.

    The replica set has one replica less afterwards: start a new one for more runs.
    """
    from workbench.server.launcher import answers_200

    with replicas.router_process(policy) as router:
        monitor = ReplicaMonitor(replicas.urls, interval_s=0.25)
        th, box = _bench_in_thread(router.base_url, replicas.model_name, samples, request_rate, monitor)
        while not monitor.readings and th.is_alive():
            time.sleep(0.05)
        time.sleep(kill_after_s)
        killed_at = time.perf_counter()
        replicas.kill(victim)
        th.join()
        metrics = _router_metric(router.metrics_url)
    if "err" in box:
        raise box["err"]
    res = box["res"]
    lost = replicas.urls[victim]
    first = min(res["start_times"])
    res["kill_s"] = killed_at - first
    res["send_s"] = [t - first for t in res["start_times"]]
    res["victim_url"] = lost
    res["victim_alive"] = answers_200(lost + "/health")
    after = [not e for t, e in zip(res["send_s"], res["errors"]) if t >= res["kill_s"]]
    res["sent_after"], res["answered_after"] = len(after), sum(after)
    res["failed_sent_before"] = sum(1 for t, e in zip(res["send_s"], res["errors"]) if e and t < res["kill_s"])
    for side, keep in (("before", lambda t: t < res["kill_s"]), ("after", lambda t: t >= res["kill_s"])):
        e2el = [x for t, x in zip(res["send_s"], res["latencies"]) if x is not None and keep(t)]
        res[f"e2el_{side}_s"] = float(np.median(e2el)) if e2el else None
    res["retries"] = metrics.get(("vllm_router_retries_total", None), 0.0)
    res["breaker_open"] = metrics.get(("vllm_router_cb_state", lost)) == 1
    return res


def _router_metric(url: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict = {}
    for f in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in f.samples:
            key = (s.name, s.labels.get("worker"))
            out[key] = out.get(key, 0.0) + s.value
    return out


def lost_figure(res: dict) -> go.Figure:
    """Each request's end-to-end latency (s) at its send time; failed ones as red crosses; the kill as a line."""
    ok_x, ok_y, bad_x = [], [], []
    for t, e2el, err in zip(res["send_s"], res["latencies"], res["errors"]):
        if err:
            bad_x.append(t)
        else:
            ok_x.append(t)
            ok_y.append(e2el)
    fig = go.Figure()
    fig.add_scatter(x=ok_x, y=ok_y, mode="markers", name="answered: end-to-end latency (s)")
    fig.add_scatter(x=bad_x, y=[0] * len(bad_x), mode="markers", name="failed (stream cut)",
                    marker={"symbol": "x", "size": 11, "color": "#d62728"})  # fmt: skip
    fig.add_vline(x=res["kill_s"], line={"color": "#d62728", "dash": "dash"})
    fig.add_annotation(x=res["kill_s"], y=1, yref="paper", text=" replica killed", showarrow=False, xanchor="left",
                       font={"color": "#d62728"})  # fmt: skip
    fig.update_layout(title="A replica lost mid-run: what each request saw, by the time it was sent", height=380,
                      xaxis_title="send time (s since the first request)", yaxis_title="seconds",
                      legend={"orientation": "h", "y": -0.3})  # fmt: skip
    return fig


# ---------------------------------------------------------------- at GPU scale, in the simulator
#: (model, request rate, seconds of arrivals, layouts as (replicas, tensor-parallel size, policy)) on 8 GPUs
GPU_LAYOUTS = (
    ("llama-2-70b", 12.0, 8.0, ((1, 8, "round_robin"), (2, 4, "round_robin"), (2, 4, "cache_aware"))),
    ("llama-3-8b", 32.0, 4.0, ((4, 2, "round_robin"), (4, 2, "cache_aware"), (8, 1, "cache_aware"))),
)


def gpu_layouts(gpu: str = "H100-80GB", layouts=GPU_LAYOUTS, progress=None) -> list[dict]:
    """Each model's layouts of the same GPUs replayed in the simulator (:func:`workbench.sim.cluster.simulate_cluster`:
    every replica the real scheduler and KV manager, the router's policy modelled) on a multi-tenant trace (16
    tenants, Zipf 1.1, 1,024-token system prompts, seeded), prefix caching on; one row per layout: per-rank memory
    (GiB), request throughput (finished requests over the replay, drain included), TTFT p50 / p99 (ms), prefill tokens computed, prefix-cache hit rate, KV imbalance
    (time-mean) and the requests each replica got (``split``). Times are simulated; the figures are the same on every machine.
    ``progress(label)`` is called before each replay."""
    from workbench.catalog import MODELS
    from workbench.sim.cluster import simulate_cluster
    from workbench.sim.engine import SimSpec
    from workbench.sim.hardware import HARDWARE
    from workbench.sim.trace import make_tenant_trace

    rows = []
    for model, rate, duration, shapes in layouts:
        trace = make_tenant_trace(rate, duration, seed=0, num_tenants=16, zipf_s=1.1, system_prompt_len=1024)
        for dp, tp, policy in shapes:
            label = f"{model}: {dp} × TP{tp}, {policy}" if dp > 1 else f"{model}: 1 × TP{tp}"
            shape = f"{dp} × TP{tp}, {policy}" if dp > 1 else f"1 × TP{tp}"
            if progress is not None:
                progress(label)
            spec = SimSpec(MODELS[model], HARDWARE[gpu], tensor_parallel_size=tp)
            res = simulate_cluster(spec, trace, data_parallel_size=dp, routing_policy=policy, output_dir=None,
                                   record_itl=False, enable_prefix_caching=True)  # fmt: skip
            s = res.summary
            mem = s["replicas"][0]["per_rank_memory"]
            q = s["prefix_cache_queries_total"]
            rows.append({
                "layout": label, "model": model, "shape": shape, "gpus": dp * tp, "requests": s["requests_finished"],
                "weights_gib": mem["weights_bytes"] / 2**30, "kv_gib": mem["kv_cache_bytes"] / 2**30,
                "nccl_mib": mem["nccl_buffer_bytes"] / 2**20, "throughput": s["request_throughput_req_s"],
                "ttft_p50": 1000 * s["ttft_p50_s"], "ttft_p99": 1000 * s["ttft_p99_s"],
                "prefill_computed": s["prefill_tokens_computed"],
                "hit_rate": s["prefix_cache_hits_total"] / q if q else None,
                "imbalance_mean": s["kv_imbalance_mean"],
                "split": [r["requests_routed"] for r in s["replicas"]],
            })  # fmt: skip
    return rows


def layout_table(rows: Sequence[dict]) -> Table:
    """:func:`gpu_layouts`' rows side by side."""
    cols = [Column("model", "model"), Column("shape", "replicas × TP, policy"),
            Column("weights_gib", "weights / rank (GiB)", _f(1)), Column("kv_gib", "KV pool / rank (GiB)", _f(1)),
            Column("nccl_mib", "NCCL / rank (MiB)", _f(0)), Column("throughput", "req/s", _f(2)),
            Column("ttft_p99", "TTFT p99 (ms)", _f(0)), Column("prefill_computed", "prefill tokens computed", _f(0)),
            Column("hit_rate", "prefix hits (%)", _pct), Column("imbalance_mean", "KV imbalance (mean)", _f(2)),
            Column("split", "requests: most / fewest replica", lambda v: f"{max(v)} / {min(v)}")]  # fmt: skip
    return Table(cols, list(rows))


# ---------------------------------------------------------------- a panel
class PolicyPanel:
    """Policy, replica count and workload as widgets, a Run button, and the live per-replica figure: each Run is
    :meth:`PolicyRuns.run` over replicas of the chosen count (started on first use, then kept).

    Raises:
        ImportError: ipywidgets missing.
    """

    def __init__(self, request_rate: float, num_requests: int = 16, replicas: dict | None = None) -> None:
        from workbench.labs.panel import RunButtonThread
        from workbench.viz.live import _require_widgets

        widgets = _require_widgets()
        self._sets = dict(replicas or {})
        self.request_rate, self.num_requests = request_rate, num_requests
        self.runs: dict[int, PolicyRuns] = {}
        self.controls = {
            "policy": widgets.Dropdown(options=POLICIES, value="kv_aware", description="policy"),
            "replicas": widgets.Dropdown(options=[2, 3], value=2, description="replicas"),
            "workload": widgets.Dropdown(options=list(WORKLOADS), value="multi-tenant", description="workload"),
        }
        panel = self

        class _Button(RunButtonThread):
            controls = panel.controls

            def current_values(self):
                return {k: w.value for k, w in panel.controls.items()}

            def _execute(self, values):
                return panel._execute(values)

        self._button = _Button()
        self._button._init_button(widgets)
        self.status = self._button.status
        self.box = widgets.Output()
        self.widget = widgets.VBox(
            [widgets.HBox(list(self.controls.values())), widgets.HBox([self._button.button, self.status]), self.box]
        )

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def run(self, **values: Any) -> dict:
        """One run with the widgets' values (``values`` override and move them), in the calling thread."""
        for k, v in values.items():
            if k not in self.controls or v not in self.controls[k].options:
                raise ValueError(f"{k}={v!r}: choose one of {list(self.controls.get(k, {}).options or self.controls)}")
        return self._button._locked(self._button.current_values() | values, shown=values)

    def wait(self, timeout: float | None = None) -> None:
        self._button.wait(timeout)

    def _execute(self, values: dict) -> dict:
        n = values["replicas"]
        with self._button._busy(f"running {values['policy']} on {values['workload']} over {n} replicas…"):
            if n not in self._sets:
                self.status.value = f"<code>starting {n} replicas…</code>"
                self._sets[n] = start_replicas(n)
            if n not in self.runs:
                self.runs[n] = PolicyRuns(self._sets[n], self.request_rate, self.num_requests)
                with self.box:
                    from IPython.display import display

                    display(self.runs[n].figure)
            row = self.runs[n].run(values["policy"], values["workload"])
        hit = "—" if row["hit_rate"] is None else f"{100 * row['hit_rate']:.0f}%"
        self.status.value = (
            f"<code>{row['policy']} on {row['workload']}: {row['throughput']:.2f} req/s, TTFT p99 "
            f"{row['ttft_p99']:.0f} ms, prefix hits {hit}, split {row['split']}, imbalance "
            f"{row['imbalance_mean']:.2f} (max {row['imbalance_max']:.2f})</code>"
        )
        return row


# ---------------------------------------------------------------- the rules the exercises check
def best_policy(rows: Sequence[dict], key: str, lowest: bool = False, tol: float = 0.01) -> list[str]:
    """The policies whose ``key`` is the best of ``rows`` (highest, or ``lowest``), within ``tol`` of it (ties:
    all of them)."""
    vals = {r["policy"]: r[key] for r in rows if r[key] is not None}
    best = min(vals.values()) if lowest else max(vals.values())
    return [p for p, v in vals.items() if abs(v - best) <= tol * max(abs(best), 1e-9)]


def _rows_of(rows: list, workload: str) -> list:
    return [r for r in rows if r["workload"] == workload]


@_register(
    "11.1",
    "On the multi-tenant workload, which policy gave the replicas the highest prefix-cache hit rate? (a policy "
    "name as a string; ties: any of the tied ones)",
    "a prefix cache hits only on the replica that computed the prefix before: which policies send a tenant back "
    "to where its system prompt already is? Read the `prefix hits (%)` column of your runs.",
)
class _BestHitRate:
    @staticmethod
    def solution(rows: list) -> str:
        return best_policy(_rows_of(rows, "multi-tenant"), "hit_rate")[0]

    @staticmethod
    def judge(answer, rows: list) -> tuple[bool, str]:
        runs = _rows_of(rows, "multi-tenant")
        best = best_policy(runs, "hit_rate")
        rates = {r["policy"]: r["hit_rate"] for r in runs}
        if not isinstance(answer, str) or answer not in rates:
            return False, f"give one of the policies you ran, as a string: {', '.join(rates)}"
        if answer in best:
            return True, (
                f"{answer}: {100 * rates[answer]:.0f}% of prompt tokens found in cache, against "
                f"{100 * min(rates.values()):.0f}% for the worst; a prefix-aware router keeps each tenant where its "
                "system prompt is cached"
            )
        return False, f"{answer} hit {100 * rates[answer]:.0f}%; another policy hit more"


@_register(
    "11.2",
    "Replicas' KV-cache usage at one moment (fractions, one per replica): what is the KV imbalance — the fullest "
    "replica's usage over the replicas' mean? (a number ≥ 1; 1 when all are empty)",
    "divide the largest usage by the mean of all of them (not by the smallest); with every replica at 0 the "
    "replicas are even: 1.",
)
class _Imbalance:
    @staticmethod
    def solution(usages: list) -> float:
        return kv_imbalance(usages)

    @staticmethod
    def judge(answer, usages: list) -> tuple[bool, str]:
        from workbench.labs.exercise_registry import _number

        want = kv_imbalance(usages)
        x = _number(answer)
        if x is None:
            return False, f"give a number, got {answer!r}"
        if abs(x - want) <= 0.005 * want:
            return True, f"{want:.2f}: the fullest replica holds {want:.2f}× the average share of KV blocks"
        lo = min(usages)
        if lo > 0 and abs(x - max(usages) / lo) <= 0.005 * x:
            return False, "that is the largest over the smallest; divide by the mean"
        if abs(x - (max(usages) - lo)) <= 1e-3:
            return False, "that is a difference; the imbalance is a ratio (largest / mean)"
        return False, f"{answer!r} is {'too high' if x > want else 'too low'}: largest / mean"


@_register(
    "11.3",
    "On the skewed workload, which policy gave the lower TTFT p99? (a policy name as a string)",
    "`round_robin` takes turns regardless of what each replica holds; `power_of_two` compares two replicas' "
    "loads. Where do the short requests behind a long prompt wait?",
)
class _SkewedTail:
    @staticmethod
    def solution(rows: list) -> str:
        return best_policy(_rows_of(rows, "skewed"), "ttft_p99", lowest=True, tol=0.0)[0]

    @staticmethod
    def judge(answer, rows: list) -> tuple[bool, str]:
        runs = {r["policy"]: r["ttft_p99"] for r in _rows_of(rows, "skewed")}
        best = best_policy(_rows_of(rows, "skewed"), "ttft_p99", lowest=True, tol=0.0)
        if not isinstance(answer, str) or answer not in runs:
            return False, f"give one of the policies you ran, as a string: {', '.join(runs)}"
        if answer in best:
            others = ", ".join(f"{p} {v:.0f} ms" for p, v in runs.items() if p != answer)
            return True, f"{answer}: TTFT p99 {runs[answer]:.0f} ms ({others}) in this run"
        return False, f"{answer}'s TTFT p99 was {runs[answer]:.0f} ms; the other's was lower in this run"


@_register(
    "11.4",
    "In the simulator's rows, how many GiB of KV pool does a layout have over all its GPUs? Give it for the "
    "layout named by `layout` (GiB, all ranks together)",
    "each rank holds `kv_gib` of KV pool; the layout has `gpus` ranks (replicas × tensor-parallel size), and "
    "every rank's pool counts — a replica's KV is split over its TP ranks, replicas each have their own.",
)
class _TotalKV:
    @staticmethod
    def solution(rows: list, layout: str) -> float:
        r = next(r for r in rows if r["layout"] == layout)
        return r["kv_gib"] * r["gpus"]

    @staticmethod
    def judge(answer, rows: list, layout: str) -> tuple[bool, str]:
        from workbench.labs.exercise_registry import _number

        r = next(r for r in rows if r["layout"] == layout)
        want = r["kv_gib"] * r["gpus"]
        x = _number(answer)
        if x is None:
            return False, f"give a number of GiB, got {answer!r}"
        if abs(x - want) <= 0.01 * want:
            return True, (
                f"{want:.0f} GiB: {r['gpus']} ranks × {r['kv_gib']:.1f} GiB; weights take {r['weights_gib']:.1f} GiB "
                "per rank here, so fewer, wider replicas leave more room for KV"
            )
        if abs(x - r["kv_gib"]) <= 0.01 * r["kv_gib"]:
            return False, "that is one rank's pool; add every rank's"
        dp = len(r["split"])
        if abs(x - r["kv_gib"] * dp) <= 0.01 * r["kv_gib"] * dp and dp != r["gpus"]:
            return False, "that counts one rank per replica; each replica has tensor-parallel-size ranks"
        return False, f"{answer!r} is {'too high' if x > want else 'too low'}: kv_gib × gpus"
