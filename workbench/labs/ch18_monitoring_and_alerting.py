"""Chapter 18: monitoring and alerting with a real Prometheus, and an alert that acts on the server.

What it drives (all real, all on 127.0.0.1, every process stopped by PID in :meth:`MonitoringStack.stop`, also
when the notebook's kernel stops):

- ``workbench serve --enable-admin-api`` (:class:`workbench.server.launcher.ServerProcess`): ``/metrics`` with the
  ``vllm:`` names and ours (``workbench:``), and the admin actions an alert can call;
- Debian's ``prometheus`` (:class:`workbench.server.prometheus_process.PrometheusProcess`), scraping it every half second
  and evaluating the shipped alert rules (``deploy/prometheus/vllm_alerts.yml`` and ``workbench_alerts.yml``) with their time windows
  shortened for a demonstration (:func:`demo_rules`: minutes become seconds, thresholds unchanged);
- the alert receiver (:class:`workbench.server.alert_receiver.AlertReceiver`) that Prometheus pushes firing alerts
  to, and that calls the server's admin API (``WaitingQueueGrowing`` -> cap the requests in flight, vLLM's
  ``--max-num-queued-reqs``; :func:`compare_actions` measures that action against none and against halving
  ``max_num_seqs`` on the same overload);
- ``promtool check rules`` / ``promtool test rules`` on the shipped files (:func:`promtool`);
- the Grafana dashboard's panel queries (``deploy/grafana/workbench_dashboard.json``) evaluated against the live
  Prometheus (:func:`dashboard_rows`).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.labs.exercise_registry import _register
from workbench.server.prometheus_process import ALERT_RULES, RULES_DIR
from workbench.viz.table import Column, Table

DEPLOY = RULES_DIR.parent  # the repository's deploy/
#: the promtool unit tests of each shipped rule file
RULE_TESTS = tuple(p.with_name(p.stem + "_test.yml") for p in ALERT_RULES)
DASHBOARD = DEPLOY / "grafana" / "workbench_dashboard.json"
_METRIC = re.compile(r"\b((?:vllm|workbench):[a-z_]+?)(?:_bucket|_sum|_count)?\b")
#: the series the chapter's live plot follows: (PromQL, label, subplot row)
LIVE_SERIES = (
    ("sum(vllm:num_requests_waiting)", "waiting", 1),
    ("sum(vllm:num_requests_running)", "running", 1),
    ("max(vllm:kv_cache_usage_perc)", "KV cache usage (0..1)", 2),
    ('count(ALERTS{alertstate="firing"}) or vector(0)', "alerts firing", 3),
)


# ---------------------------------------------------------------- the shipped rules
def _paths(path: str | Path | Sequence[str | Path]) -> list[Path]:
    return [Path(path)] if isinstance(path, (str, Path)) else [Path(p) for p in path]


def load_rules(path: str | Path | Sequence[str | Path] = ALERT_RULES) -> list[dict[str, Any]]:
    """The alerting rules of one Prometheus rules file or several (default: both shipped files, the vLLM one
    first), in file order (``alert``, ``expr``, ``for``, ``labels``, ``annotations``, and ``file``: its file name).

    Raises:
        FileNotFoundError: no such file. ValueError: a file without ``groups``.
    """
    import yaml

    rules = []
    for p in _paths(path):
        doc = yaml.safe_load(p.read_text())
        if not isinstance(doc, dict) or "groups" not in doc:
            raise ValueError(f"{p} has no 'groups': not a Prometheus rules file")
        rules += [r | {"file": p.name} for g in doc["groups"] for r in g.get("rules", []) if "alert" in r]
    return rules


def works_on(rule: dict[str, Any]) -> str:
    """Where a rule can fire: ``"any vLLM"`` when it reads only ``vllm:`` metrics, else ``"workbench only"``."""
    return "workbench only" if any(m.startswith("workbench:") for m in metrics_read(rule["expr"])) else "any vLLM"


def metrics_read(expr: str) -> list[str]:
    """The metric names an expression reads (``vllm:`` and ``workbench:``; histogram suffixes dropped)."""
    return list(dict.fromkeys(_METRIC.findall(expr)))


def rules_table(path: str | Path | Sequence[str | Path] = ALERT_RULES, expr: bool = False) -> Table:
    """Every shipped alert: its file, where it works (:func:`works_on`), the metrics it reads, how long it must
    hold, severity, and why (its ``description``);
    with ``expr=True`` its PromQL expression instead of the metrics and the why (two tables fit a laptop's
    notebook column where one would run off its side)."""
    rows = [
        {
            "alert": r["alert"],
            "file": r["file"],
            "works_on": works_on(r),
            "reads": ", ".join(metrics_read(r["expr"])),
            "expr": " ".join(r["expr"].split()),
            "for": r.get("for", "0s"),
            "severity": r.get("labels", {}).get("severity", "-"),
            "why": r.get("annotations", {}).get("description", ""),
        }
        for r in load_rules(path)
    ]
    middle = (
        [Column("expr", "expression (PromQL)", align="left", prose=True)]
        if expr
        else [Column("reads", "metric(s) it reads", align="left", prose=True)]
    )
    last = [] if expr else [Column("why", "why this threshold (its description)", align="left", prose=True)]
    return Table(
        [
            Column("alert", "alert", align="left"),
            *([] if expr else [Column("works_on", "works on", align="left")]),
            *middle,
            Column("for", "for"),
            Column("severity", "severity", align="left"),
            *last,
        ],  # fmt: skip
        rows,
    )


def promtool(*args: str, timeout: float = 120.0) -> tuple[int, str]:
    """Run ``promtool`` (it comes with Debian's ``prometheus`` package) in the repository's root, so that paths
    such as ``deploy/prometheus/vllm_alerts.yml`` read the same on every machine; return its exit code and
    output.

    Raises:
        FileNotFoundError: no ``promtool`` on PATH (``apt-get install prometheus``).
    """
    binary = shutil.which("promtool")
    if binary is None:
        raise FileNotFoundError("no promtool on PATH: apt-get install prometheus (it ships promtool)")
    p = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, cwd=DEPLOY.parent)
    return p.returncode, (p.stdout + p.stderr).strip()


def _seconds(duration: str) -> float:
    units = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total = 0.0
    for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", duration):
        total += float(n) * units[u]
    return total


def demo_rules(
    out: str | Path,
    scale: float = 1 / 40,
    min_window_s: float = 4.0,
    path: str | Path | Sequence[str | Path] = ALERT_RULES,
) -> Path:
    """Write one copy of the shipped rules (every group of every file in ``path``) whose time windows are ``scale`` times as long — every ``for:`` and every
    range selector (``[5m]`` -> ``[8s]`` at 1/40, never under ``min_window_s``) — so that a minutes-long condition
    shows within a notebook cell. Expressions and thresholds stay as shipped.

    Returns:
        the path written.
    """
    import yaml

    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:
        raise ValueError(f"scale={scale!r} must be in (0, 1]: the windows' factor (1/100 turns 10m into 6s)")
    if not min_window_s > 0:
        raise ValueError(f"min_window_s={min_window_s!r} must be > 0 seconds")
    doc = {"groups": [g for p in _paths(path) for g in yaml.safe_load(p.read_text())["groups"]]}

    def short(d: str) -> str:
        return f"{round(max(min_window_s, _seconds(d) * scale))}s"

    for g in doc["groups"]:
        g["name"] = g["name"] + "-demo"
        for r in g["rules"]:
            if "for" in r:
                r["for"] = short(r["for"])
            notes = r.get("annotations") or {}
            if "description" in notes:  # the shipped text speaks of minutes: say which windows this copy uses
                notes["description"] = f"[demo copy: time windows x{scale:.3g}] " + notes["description"]
            r["expr"] = re.sub(r"\[(\d+[smhd])\]", lambda m: f"[{short(m.group(1))}]", r["expr"])
    out = Path(out)
    out.write_text(yaml.safe_dump(doc, sort_keys=False, width=120))
    return out


def demo_rules_table(path: str | Path) -> Table:
    """The demo copy's alerts: expression and ``for``, side by side with nothing else (to compare with the shipped)."""
    rows = [
        {"alert": r["alert"], "expr": " ".join(r["expr"].split()), "for": r.get("for", "0s")} for r in load_rules(path)
    ]
    return Table(
        [
            Column("alert", "alert", align="left"),
            Column("expr", "expression", align="left", prose=True),
            Column("for", "for"),
        ],  # fmt: skip
        rows,
    )


# ---------------------------------------------------------------- the stack
def _call(url: str, method: str = "GET", body: dict | None = None) -> dict:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


class MonitoringStack:
    """A server, an alert receiver and Prometheus, started together and stopped together.

    Args:
        rule_files: the rules Prometheus evaluates (e.g. :func:`demo_rules`' output).
        actions: the receiver's ``{alertname: action}`` (default: ``WaitingQueueGrowing`` sheds load).
        scrape_interval: seconds between scrapes and rule evaluations.
        cooldown_s: the receiver acts on an alert name at most once per this many seconds.
        **engine_args: the server's engine arguments (e.g. ``max_num_seqs=4``).

    Raises:
        RuntimeError / FileNotFoundError: (on :meth:`start`) what the parts raise; whatever started is stopped.
    """

    def __init__(
        self,
        rule_files: Sequence[str | Path],
        actions: dict[str, str] | None = None,
        scrape_interval: float = 0.5,
        cooldown_s: float = 600.0,
        **engine_args: Any,
    ) -> None:
        self.rule_files, self.scrape_interval, self.cooldown_s = list(rule_files), scrape_interval, cooldown_s
        self.actions = {"WaitingQueueGrowing": "shed_load"} if actions is None else dict(actions)
        self.engine_args = engine_args
        self.server = self.receiver = self.prometheus = None
        self._finalizer = None

    def start(self) -> MonitoringStack:
        from workbench.server.alert_receiver import AlertReceiver
        from workbench.server.launcher import ServerProcess
        from workbench.server.prometheus_process import PrometheusProcess

        self.check()  # before the server's 10-20 s start: what can be refused now is refused now
        try:
            self.server = ServerProcess(threads=1, extra_args=["--enable-admin-api"], **self.engine_args).start()
            self.receiver = AlertReceiver(self.server.base_url, actions=self.actions, cooldown_s=self.cooldown_s)
            self.receiver.start()
            self.prometheus = PrometheusProcess(
                [self.server.base_url], rule_files=self.rule_files, scrape_interval=self.scrape_interval,
                alertmanager=self.receiver.address,
            ).start()  # fmt: skip
            self.prometheus.wait_for_scrape()
        except BaseException:
            self.stop()
            raise
        # the kernel may stop (or a later cell fail) before the stop cell: stop the processes then too
        self._finalizer = weakref.finalize(self, _stop_all, self.server, self.receiver, self.prometheus)
        return self

    def check(self) -> None:
        """What :meth:`start` would fail on later, checked before anything starts.

        Raises:
            FileNotFoundError: no prometheus binary (``apt-get install prometheus``), or a rule file that does not
                exist.
            ValueError: a rule file that is not a rules file, a bad scrape interval, or an action for an alert name
                no rule file defines (a typo would never act).
        """
        from workbench.server.alert_receiver import ACTIONS
        from workbench.server.prometheus_process import prometheus_binary

        prometheus_binary()
        if not self.scrape_interval >= 0.1:
            raise ValueError(f"scrape_interval={self.scrape_interval!r} must be >= 0.1 seconds")
        names = set()
        for f in self.rule_files:
            if not Path(f).is_file():
                raise FileNotFoundError(f"rule file {f} does not exist")
            names |= {r["alert"] for r in load_rules(f)}
        unknown = sorted(set(self.actions) - names)
        if unknown:
            raise ValueError(f"actions for {unknown}, which no rule file defines; the alerts are {sorted(names)}")
        bad = {k: v for k, v in self.actions.items() if v not in ACTIONS}
        if bad:
            raise ValueError(f"actions {bad}: each must be one of {', '.join(ACTIONS)}")

    def stop(self) -> None:
        """Stop Prometheus, the receiver and the server (idempotent)."""
        _stop_all(self.server, self.receiver, self.prometheus)
        if self._finalizer is not None:
            self._finalizer.detach()

    def __enter__(self) -> MonitoringStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def admin_state(self) -> dict[str, Any]:
        """The server's ``GET /admin/state`` (``max_num_seqs`` now and as configured, compaction counters, ...)."""
        return _call(self.server.base_url + "/admin/state")

    def pids(self) -> dict[str, int | None]:
        return {"server": self.server.pid if self.server else None,
                "prometheus": self.prometheus.proc.pid if self.prometheus and self.prometheus.proc else None}  # fmt: skip


def _stop_all(server, receiver, prometheus) -> None:
    for part in (prometheus, receiver, server):
        if part is not None:
            try:
                part.stop()
            except Exception:  # noqa: BLE001 - stopping the rest matters more than one part's error
                pass


# ---------------------------------------------------------------- load and the live plot
#: The overload's requests (``workbench bench serve``'s random dataset): prompt and output tokens, seeded.
OVERLOAD_REQUESTS = dict(dataset_name="random", random_input_len=32, random_output_len=16, seed=0, temperature=0.0)


def measure_capacity(stack: MonitoringStack, num_prompts: int | None = None, **bench_args: Any) -> float:
    """Requests per second the stack's server completes, measured now: ``num_prompts`` of the overload's requests
    (default twice the server's ``max_num_seqs``) sent at once, vLLM's ``request_throughput`` of that run.

    The overload is sized from this figure (:meth:`Overload.above`), so that it overloads the server on a fast
    machine and on a slow or busy one alike.

    Raises:
        RuntimeError: no request completed.
    """
    n = num_prompts or 2 * int(stack.admin_state()["max_num_seqs"])
    return float(_probe(stack, num_prompts=n, **bench_args)["request_throughput"])


def _probe(stack: MonitoringStack, **bench_args: Any) -> dict[str, Any]:
    """``workbench bench serve`` with the overload's requests, sent at once, against the stack's server; its result.

    Raises:
        RuntimeError: no request completed.
    """
    from workbench.bench.serve import run_bench_serve

    args = OVERLOAD_REQUESTS | dict(request_rate=float("inf"), disable_tqdm=True, print_result=False) | bench_args
    result = run_bench_serve(base_url=stack.server.base_url, **args)
    if not result.get("completed"):
        raise RuntimeError(
            f"a probe completed no request of {args['num_prompts']}: is the server up? ({stack.server.base_url})"
        )
    return result


class Overload:
    """``workbench bench serve`` against the stack's server in a background thread (:meth:`start`), at a request
    rate above what the server completes, so that its waiting queue grows; :attr:`result` is vLLM's result dict
    once :meth:`join` returns. :meth:`above` sizes it from a measured capacity."""

    def __init__(self, stack: MonitoringStack, num_prompts: int = 40, request_rate: float = 6.0, **bench_args: Any):
        self.stack, self.result, self.error = stack, None, None
        self.num_prompts, self.request_rate = num_prompts, request_rate
        self.args = OVERLOAD_REQUESTS | dict(num_prompts=num_prompts, request_rate=request_rate, disable_tqdm=True,
                                             print_result=False) | bench_args  # fmt: skip
        self.thread = threading.Thread(target=self._run, name="overload", daemon=True)

    @classmethod
    def above(
        cls, stack: MonitoringStack, capacity: float, factor: float = 3.0, arrivals_s: float = 10.0, **bench_args: Any
    ) -> Overload:
        """An overload of ``factor`` times ``capacity`` (requests/s, :func:`measure_capacity`) for ``arrivals_s``
        seconds of arrivals: the waiting queue grows by about ``(factor - 1) * capacity`` requests a second
        while they last, whatever the machine's speed.

        Raises:
            ValueError: a capacity that is not a positive number, or ``factor <= 1`` (no overload).
        """
        if not capacity > 0:
            raise ValueError(f"capacity={capacity!r} must be > 0 requests/s (measure it: mon.measure_capacity(stack))")
        if not factor > 1:
            raise ValueError(f"factor={factor!r} must be > 1: at or below the capacity the queue does not grow")
        rate = factor * capacity
        return cls(stack, num_prompts=max(8, round(rate * arrivals_s)), request_rate=rate, **bench_args)

    def _run(self) -> None:
        from workbench.bench.serve import run_bench_serve

        try:
            self.result = run_bench_serve(base_url=self.stack.server.base_url, **self.args)
        except Exception as e:  # noqa: BLE001 - shown by join()
            self.error = e

    def start(self) -> Overload:
        self.started_at = time.time()
        self.thread.start()
        return self

    def running(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait for the load to end; its result. Raises what the load raised."""
        self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.result


def alert_outcome(
    stack: MonitoringStack, load: Overload, alertname: str = "WaitingQueueGrowing", timeout_s: float = 30.0
) -> str:
    """What the overload made the alert loop do, in sentences: the receiver's first action on ``alertname`` (waited
    for up to ``timeout_s`` more seconds), ``max_num_seqs`` as configured and now, and whether every request
    completed. When the alert never acted, says so plainly, with the highest waiting queue Prometheus saw."""
    first = stack.receiver.wait_for_action(alertname, timeout_s)
    state = stack.admin_state()
    result = load.result or {}
    if first is None:
        peak = stack.prometheus.query("max_over_time(sum(vllm:num_requests_waiting)[5m:1s])")
        seen = f"{float(peak[0]['value'][1]):.0f}" if peak else "no sample of"
        lines = [f"{alertname} did not act within the run and {timeout_s:.0f} s after it: the waiting queue peaked at "
                 f"{seen} requests; the alert needs it growing for the demo's whole window and `for:`. "
                 "Rerun the overload cell with a larger factor or longer arrivals."]  # fmt: skip
    else:
        taken = stack.receiver.actions_taken()
        lines = [f"the receiver acted {len(taken)} time(s); first: {first['alertname']} -> {first['action']}"]
    lines.append(f"max_num_seqs: configured {state['configured_max_num_seqs']}, now {state['max_num_seqs']}")
    lines.append(
        f"max_num_queued_reqs: configured {state['configured_max_num_queued_reqs']}, now {state['max_num_queued_reqs']}"
    )
    answered = result.get("completed", 0) + result.get("failed", 0) == load.num_prompts
    lines.append(f"every request answered (completed, or refused with 503 once shedding): {answered}")
    return "\n".join(lines)


# ---------------------------------------------------------------- which action helps, measured
#: the server states an alert's action can leave (the receiver's actions, and none)
ACTION_CHOICES = ("none", "lower_admission", "shed_load")


def lone_ttft_ms(stack: MonitoringStack, num_prompts: int = 3) -> float:
    """The median TTFT (ms) of the overload's requests sent one at a time (``max_concurrency=1``): what a request
    waits on this machine now with no queue, the unit :func:`compare_actions` sizes its SLO in.

    Raises:
        RuntimeError: no request completed.
    """
    return float(_probe(stack, num_prompts=num_prompts, max_concurrency=1)["median_ttft_ms"])


def set_action(stack: MonitoringStack, action: str) -> dict[str, Any]:
    """Put the server in the state ``action`` leaves it in, from its configured state: ``"none"`` (as configured),
    ``"lower_admission"`` (``max_num_seqs`` halved) or ``"shed_load"`` (requests in flight capped at
    ``max_num_seqs``: no queue), through the same receiver methods an alert calls. Returns ``GET /admin/state`` after.

    Raises:
        ValueError: an action that is not one of :data:`ACTION_CHOICES`.
    """
    if action not in ACTION_CHOICES:
        raise ValueError(f"action={action!r} must be one of {', '.join(ACTION_CHOICES)}")
    url, rx = stack.server.base_url, stack.receiver
    _call(url + "/admin/max_num_seqs", "POST", {"max_num_seqs": int(stack.admin_state()["configured_max_num_seqs"])})
    _call(url + "/admin/max_num_queued_reqs", "POST", {"max_num_queued_reqs": None})
    if action != "none":
        getattr(rx, action)()
    return stack.admin_state()


def compare_actions(
    stack: MonitoringStack,
    capacity: float,
    actions: Sequence[str] = ACTION_CHOICES,
    factor: float = 3.0,
    arrivals_s: float = 10.0,
    slo_ttft_ms: float | None = None,
    progress=print,
) -> list[dict[str, Any]]:
    """The same overload (:meth:`Overload.above`: ``factor`` times ``capacity`` for ``arrivals_s`` seconds, the
    same seeded requests) once per action, the action in force from the start (:func:`set_action`), with the
    receiver's own actions paused so that only the chosen one acts. One row per action: requests sent, completed
    and refused (503), request throughput (completed/s), TTFT median and p99 of the completed ones, and goodput
    (completed requests/s whose TTFT met ``slo_ttft_ms``; default four times :func:`lone_ttft_ms` measured first,
    so that the SLO scales with this machine's speed and load, and each row carries it as ``slo_ttft_ms``). The
    server is left as configured.

    Raises:
        ValueError: an unknown action, or a capacity that is not positive.
    """
    for a in actions:
        if a not in ACTION_CHOICES:
            raise ValueError(f"action={a!r} must be one of {', '.join(ACTION_CHOICES)}")
    if slo_ttft_ms is None:
        lone = lone_ttft_ms(stack)
        slo_ttft_ms = 4 * lone
        progress(f"a lone request's TTFT now: {lone:,.0f} ms; the SLO of goodput: 4 x that = {slo_ttft_ms:,.0f} ms")
    paused, stack.receiver.actions = stack.receiver.actions, {}
    rows = []
    try:
        for i, action in enumerate(actions):
            state = set_action(stack, action)
            load = Overload.above(stack, capacity, factor, arrivals_s, goodput=[f"ttft:{slo_ttft_ms:g}"])
            progress(f"[{i + 1}/{len(actions)}] {action}: {load.num_prompts} requests at {load.request_rate:.2f}/s "
                     f"(max_num_seqs {state['max_num_seqs']}, max_num_queued_reqs {state['max_num_queued_reqs']}) ...")  # fmt: skip
            r = load.start().join()
            rows.append({
                "action": action,
                "sent": load.num_prompts,
                "completed": r["completed"],
                "refused": r["failed"],
                "request_throughput": r["request_throughput"],
                "median_ttft_ms": r["median_ttft_ms"],
                "p99_ttft_ms": r["p99_ttft_ms"],
                "request_goodput": r["request_goodput"],
                "slo_ttft_ms": slo_ttft_ms,
                "duration": r["duration"],
            })  # fmt: skip
    finally:
        set_action(stack, "none")
        stack.receiver.actions = paused
    return rows


def _num(digits: int):
    return lambda v: "-" if v is None else f"{v:,.{digits}f}"


def actions_effect_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`compare_actions`' rows as a table (the goodput's header names the rows' SLO)."""
    slo_ttft_ms = rows[0]["slo_ttft_ms"] if rows else float("nan")
    return Table(
        [
            Column("action", "action in force", align="left"),
            Column("sent", "sent"),
            Column("completed", "completed"),
            Column("refused", "refused (503)"),
            Column("request_throughput", "completed req/s", fmt=_num(2)),
            Column("median_ttft_ms", "TTFT p50 (ms)", fmt=_num(0)),
            Column("p99_ttft_ms", "TTFT p99 (ms)", fmt=_num(0)),
            Column("request_goodput", f"goodput (req/s, TTFT ≤ {slo_ttft_ms:,.0f} ms)", fmt=_num(2)),
        ],
        list(rows),
    )


def action_verdict(rows: Sequence[dict[str, Any]]) -> str:
    """The verdicts a run supports, as sentences with True/False: against no action, does shedding raise the
    goodput and lower the TTFT p99 of what it serves, and does halving ``max_num_seqs`` lower the throughput."""
    by = {r["action"]: r for r in rows}
    none = by["none"]
    lines = []
    if "shed_load" in by:
        shed = by["shed_load"]
        lines.append(f"shed_load raises goodput over no action: {shed['request_goodput'] > none['request_goodput']}")
        lines.append(f"shed_load lowers the TTFT p99 of the requests it serves: {shed['p99_ttft_ms'] < none['p99_ttft_ms']}")  # fmt: skip
    if "lower_admission" in by:
        low = by["lower_admission"]
        lines.append(f"lower_admission raises goodput over no action: {low['request_goodput'] > none['request_goodput']}")  # fmt: skip
    return "\n".join(lines)


def _mark(fig: go.Figure, x: float, text: str) -> None:
    """A dashed vertical line across all subplots at ``x`` with a label on top (``add_vline`` fails on a
    FigureWidget with subplots)."""
    fig.add_shape(type="line", x0=x, x1=x, xref="x", yref="paper", y0=0, y1=1,
                  line={"color": "red", "dash": "dash", "width": 1.5})  # fmt: skip
    fig.add_annotation(x=x, xref="x", yref="paper", y=1.0, yanchor="top", xanchor="left", text=text,
                       showarrow=False, font={"color": "red"}, bgcolor="rgba(255,255,255,0.8)")  # fmt: skip


class LivePlot:
    """A plotly ``FigureWidget`` fed by instant queries to Prometheus' HTTP API (:data:`LIVE_SERIES`), one point
    per :meth:`poll`, with the receiver's actions and the server's ``max_num_seqs`` marked as they happen.

    Raises:
        ImportError: ipywidgets / anywidget missing.
    """

    def __init__(self, stack: MonitoringStack):
        self.stack = stack
        self.t0 = time.time()
        self.samples: list[dict[str, Any]] = []
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                            subplot_titles=("requests", "KV cache usage", "alerts firing / max_num_seqs"))  # fmt: skip
        self.figure = go.FigureWidget(fig)
        for _, label, row in LIVE_SERIES:
            self.figure.add_scatter(x=[], y=[], mode="lines", name=label, row=row, col=1)
        self.figure.add_scatter(x=[], y=[], mode="lines", name="max_num_seqs (server)", line={"dash": "dot"},
                                row=3, col=1)  # fmt: skip
        self.figure.update_layout(height=660,
                                  title={"text": "The server through Prometheus, live (instant queries, 1 s)",
                                         "y": 0.98, "yanchor": "top"},
                                  hovermode="x unified", margin={"t": 140},
                                  legend={"orientation": "h", "y": 1.08, "yanchor": "bottom", "x": 0})  # fmt: skip
        self.figure.update_xaxes(title="seconds since the load started", row=3, col=1)
        self.figure.update_yaxes(rangemode="tozero")
        self._marked: set[int] = set()
        self.actions: list[dict[str, Any]] = []

    def poll(self) -> dict[str, Any]:
        """One instant query per series now; append to the figure; mark new receiver actions."""
        t = time.time() - self.t0
        prom = self.stack.prometheus
        sample = {"t": t}
        for expr, label, _ in LIVE_SERIES:
            res = prom.query(expr)
            sample[label] = float(res[0]["value"][1]) if res else None
        sample["max_num_seqs"] = self.stack.admin_state()["max_num_seqs"]
        self.samples.append(sample)
        with self.figure.batch_update():
            for i, (_, label, _) in enumerate(LIVE_SERIES):
                tr = self.figure.data[i]
                tr.x, tr.y = (*tr.x, t), (*tr.y, sample[label])
            tr = self.figure.data[len(LIVE_SERIES)]
            tr.x, tr.y = (*tr.x, t), (*tr.y, sample["max_num_seqs"])
        for k, a in enumerate(self.stack.receiver.actions_taken()):
            if k not in self._marked:
                self._marked.add(k)
                self.actions.append({"t": a["time"] - self.t0, **a})
                _mark(self.figure, a["time"] - self.t0, f"{a['alertname']} → {a['action']}")
        return sample

    def follow(self, load: Overload, interval: float = 1.0, after_s: float = 5.0, limit_s: float = 240.0) -> None:
        """Poll every ``interval`` seconds while the load runs, then ``after_s`` more (at most ``limit_s`` in all)."""
        if not self.samples:  # times count from the load's start, as the x axis says (not from the plot's creation)
            self.t0 = getattr(load, "started_at", self.t0)
        end = None
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self.poll()
            if end is None and not load.running():
                end = time.monotonic() + after_s
            if end is not None and time.monotonic() >= end:
                break
            time.sleep(interval)


def actions_table(live: LivePlot) -> Table:
    """What the receiver received and did during the live run: every alert event (firing or resolved) with the
    seconds since the load started, the action run and its result. Prometheus re-sends active and recently
    resolved alerts, so an alert can appear more than once; only a firing one is acted on, once per cooldown."""
    rows = []
    for e in live.stack.receiver.events:
        res = e.get("result") or {}
        if "max_num_seqs" in res:
            what = f"max_num_seqs {res['previous']} → {res['max_num_seqs']}"
        elif res:
            what = ", ".join(f"{k}={v}" for k, v in res.items())
        else:
            what = e.get("error", "")
        rows.append({"t": e["time"] - live.t0, "alert": e["alertname"], "state": "firing" if e["firing"] else "resolved",
                     "action": e["action"] or ("— (none mapped, or cooling down)" if e["firing"] else "—"),
                     "result": what})  # fmt: skip
    return Table(
        [
            Column("t", "s since load start", fmt=lambda v: f"{v:.1f}"),
            Column("alert", "alert", align="left"),
            Column("state", "state", align="left"),
            Column("action", "action", align="left", prose=True),
            Column("result", "result", align="left", prose=True),
        ],  # fmt: skip
        rows,
    )


def range_figure(stack: MonitoringStack, start: float, end: float, step: float = 1.0) -> go.Figure:
    """The whole run afterwards, from ``query_range``: waiting and running requests, TTFT p99 over the demo window
    against the 500 ms SLO, and which alerts fired when (``ALERTS``)."""
    prom = stack.prometheus
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("requests", "TTFT p99 (s), 10 s window", "alerts while firing"))  # fmt: skip
    for expr, name, row in (
        ("sum(vllm:num_requests_waiting)", "waiting", 1),
        ("sum(vllm:num_requests_running)", "running", 1),
        ("histogram_quantile(0.99, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket[10s])))", "TTFT p99", 2),
    ):
        for s in prom.query_range(expr, start, end, step):
            fig.add_scatter(x=[float(t) - start for t, _ in s["values"]], y=[float(v) for _, v in s["values"]],
                            mode="lines", name=name, row=row, col=1)  # fmt: skip
    fig.add_hline(y=0.5, row=2, col=1, line={"dash": "dot", "color": "grey"}, annotation_text="SLO 500 ms")
    for s in prom.query_range('ALERTS{alertstate="firing"}', start, end, step):
        name = s["metric"].get("alertname", "?")
        fig.add_scatter(x=[float(t) - start for t, _ in s["values"]], y=[name for _ in s["values"]],
                        mode="markers", name=name, row=3, col=1)  # fmt: skip
    fig.update_layout(height=620, title={"text": "The run, from Prometheus' query_range", "y": 0.98, "yanchor": "top"},
                      hovermode="x unified", margin={"t": 120, "l": 150},
                      legend={"orientation": "h", "y": 1.06, "yanchor": "bottom", "x": 0})  # fmt: skip
    fig.update_xaxes(title="seconds since the load started", row=3, col=1)
    return fig


# ---------------------------------------------------------------- the dashboard
def dashboard_rows(stack: MonitoringStack, path: str | Path = DASHBOARD) -> list[dict[str, Any]]:
    """Every query of the Grafana dashboard evaluated now against the live Prometheus: panel, expression, the
    number of series it returns (``$__rate_interval`` as Grafana would expand it for this scrape interval)."""
    d = json.loads(Path(path).read_text())
    rows = []
    for p in d.get("panels", []):
        for t in p.get("targets", []):
            expr = " ".join(t["expr"].replace("$__rate_interval", "30s").replace("$model_name", ".*").split())
            try:
                n, err = len(stack.prometheus.query(expr)), ""
            except RuntimeError as e:
                n, err = None, str(e)[:120]
            rows.append({"panel": p["title"], "expr": expr, "series": n, "error": err})
    return rows


def dashboard_table(rows: Sequence[dict[str, Any]]) -> Table:
    """:func:`dashboard_rows` as a table (the query as evaluated; an error column only when a query failed)."""
    cols = [
        Column("panel", "panel", align="left", prose=True),
        Column("expr", "query (rate interval 30 s)", align="left", prose=True),
        Column("series", "series"),
    ]
    if any(r["error"] for r in rows):
        cols.append(Column("error", "error", align="left", prose=True))
    return Table(cols, list(rows))


# ---------------------------------------------------------------- exercise contexts from the run
def ttft_buckets(stack: MonitoringStack) -> list[tuple[float, float]]:
    """The server's TTFT histogram now, from Prometheus: cumulative ``(le, count)`` pairs, ``+Inf`` last."""
    res = stack.prometheus.query("sum by (le) (vllm:time_to_first_token_seconds_bucket)")
    pairs = [(float(r["metric"]["le"]), float(r["value"][1])) for r in res]
    return sorted(pairs)


def waiting_samples(live: LivePlot) -> list[float]:
    """The waiting-queue values the live plot polled, one per second."""
    return [s["waiting"] or 0.0 for s in live.samples]


def tmp_rules_dir() -> tempfile.TemporaryDirectory:
    """A temporary folder for the demo rules (removed when the object is cleaned up or collected)."""
    return tempfile.TemporaryDirectory(prefix="wb-ch18-")


# ---------------------------------------------------------------- exercises
def _hq(q: float, buckets: list) -> float:
    """Prometheus' histogram_quantile on cumulative (le, count) buckets: linear inside the bucket the rank falls in;
    the +Inf bucket answers the largest finite bound (promql/quantile.go)."""
    bs = sorted((float(le), float(c)) for le, c in buckets)
    total = bs[-1][1]
    if total <= 0:
        return float("nan")
    rank = q * total
    prev_le, prev_c = 0.0, 0.0
    for le, c in bs:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            if c == prev_c:
                return le
            return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c)
        prev_le, prev_c = le, c
    return prev_le


@_register(
    "18.1",
    "Write histogram_quantile(q, buckets) as Prometheus computes it: buckets are cumulative (le, count) pairs of a "
    "histogram (the last le is +Inf); return the q-quantile in the buckets' unit. The answer is the function.",
    "rank = q x the +Inf bucket's count; find the first bucket whose count reaches the rank; interpolate linearly "
    "between the previous bucket's bound (0 for the first) and this one's; in the +Inf bucket answer the largest "
    "finite bound.",
)
class _HistogramQuantile:
    @staticmethod
    def solution(buckets: list):
        return _hq

    @staticmethod
    def judge(answer, buckets: list) -> tuple[bool, str]:
        import math

        quantiles = (0.5, 0.9, 0.99)
        if not callable(answer):
            return False, f"give a function histogram_quantile(q, buckets), got {answer!r}"
        for q in quantiles:
            want = _hq(q, buckets)
            try:
                got = float(answer(q, [tuple(b) for b in buckets]))
            except Exception as e:  # noqa: BLE001 - the learner's code
                return False, f"histogram_quantile({q}, ...) raised {type(e).__name__}: {e}"
            if not (math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9) or (math.isnan(got) and math.isnan(want))):
                return False, (
                    f"histogram_quantile({q}) = {got:.6g}, Prometheus says {want:.6g}; interpolate inside the bucket "
                    "the rank falls in, from the previous bucket's bound"
                )
        return True, f"matches Prometheus at q = {', '.join(map(str, quantiles))} on these buckets"


def _fires_at(samples: list, threshold: float, for_s: float, interval_s: float):
    import math

    need = math.ceil(for_s / interval_s - 1e-9)
    start = None
    for i, v in enumerate(samples):
        if v is not None and v > threshold:
            start = i if start is None else start
            if i - start >= need:
                return i
        else:
            start = None
    return None


@_register(
    "18.2",
    "A rule `expr: waiting > threshold` with `for: for_s` is evaluated once per sample (every interval_s seconds). "
    "At which sample index does it first fire? (an index into samples, or None if it never fires)",
    "the alert goes pending at the first evaluation where the condition holds and fires at the first later "
    "evaluation at least for_s after that; a false evaluation in between resets it.",
)
class _FiresAt:
    @staticmethod
    def solution(samples: list, threshold: float, for_s: float, interval_s: float):
        return _fires_at(samples, threshold, for_s, interval_s)

    @staticmethod
    def judge(answer, samples: list, threshold: float, for_s: float, interval_s: float) -> tuple[bool, str]:
        want = _fires_at(samples, threshold, for_s, interval_s)
        if answer is None or want is None:
            ok = answer is None and want is None
            if ok:
                return True, "None: the condition never holds for long enough"
            if answer is None:
                return False, f"it does fire: look for a run of samples above {threshold} lasting {for_s} s"
            return False, f"it never fires: no run of samples above {threshold} lasts {for_s} s"
        if isinstance(answer, bool) or not isinstance(answer, int):
            return False, f"give a sample index (an int) or None, got {answer!r}"
        if answer == want:
            return (
                True,
                f"sample {want}: pending at sample {want - math_ceil(for_s / interval_s)}, firing {for_s} s later",
            )
        first = next((i for i, v in enumerate(samples) if v is not None and v > threshold), None)
        if answer == first:
            return False, "that is where it goes pending; it fires only once the condition has held for for_s"
        return False, f"{answer} is {'too late' if answer > want else 'too early'}"


def math_ceil(x: float) -> int:
    import math

    return math.ceil(x - 1e-9)
