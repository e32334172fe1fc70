"""Every chapter notebook ends with an "On your vLLM deployment" section: one markdown cell, before the chapter's
``## Summary`` cell (or last, where a chapter has none), that names the vLLM engine arguments, metrics, log lines and
source files corresponding to what the chapter measured, and the workbench command that measures it on a real vLLM
server. The names it uses must exist: every ``--flag`` written after ``vllm serve`` must be in :data:`VLLM_ARGS`, every
``vllm:`` metric in :data:`VLLM_METRICS`, and where vLLM 0.32 is installed (``runs/bench/vllm-venv``, not in CI) both
lists are checked against its source."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))
HEADING = "## On your vLLM deployment"
SUMMARY = "## Summary"

# The engine arguments the sections name, as `vllm serve` spells them. Each was checked in vLLM 0.32's
# vllm/engine/arg_utils.py (EngineArgs.add_cli_args: the options of `vllm serve`).
VLLM_ARGS = frozenset(
    {
        "--attention-backend",
        "--block-size",
        "--data-parallel-size",
        "--disable-custom-all-reduce",
        "--disable-log-stats",
        "--enable-chunked-prefill",
        "--enable-prefix-caching",
        "--enable-sleep-mode",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "--kv-cache-dtype",
        "--kv-cache-memory-bytes",
        "--kv-cache-metrics",
        "--kv-offloading-size",
        "--kv-transfer-config",
        "--long-prefill-token-threshold",
        "--max-cudagraph-capture-size",
        "--max-model-len",
        "--max-num-batched-tokens",
        "--max-num-queued-reqs",
        "--max-num-seqs",
        "--no-enable-chunked-prefill",
        "--no-enable-prefix-caching",
        "--num-gpu-blocks-override",
        "--scheduler-cls",
        "--scheduling-policy",
        "--tensor-parallel-size",
    }
)

# The Prometheus metrics the sections name, as a vLLM server exports them (counters with prometheus_client's
# `_total`, histograms' `_bucket` series where a query needs them). Each was checked in vLLM 0.32's
# vllm/v1/metrics/loggers.py (PrometheusStatLogger), which declares them without those suffixes.
VLLM_METRICS = frozenset(
    {
        "vllm:admission_rejections_total",
        "vllm:cache_config_info",
        "vllm:e2e_request_latency_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:iteration_tokens_total",
        "vllm:kv_block_idle_before_evict_seconds",
        "vllm:kv_block_lifetime_seconds",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:request_generation_tokens",
        "vllm:request_generation_tokens_bucket",
        "vllm:request_params_n",
        "vllm:request_prefill_kv_computed_tokens",
        "vllm:request_queue_time_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:time_to_first_token_seconds",
    }
)

_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_FLAG = re.compile(r"(?<![\w-])--[a-z0-9][a-z0-9-]*")
_METRIC = re.compile(r"\bvllm:[a-zA-Z0-9_:]+")
_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def _markdown(nb_path: Path) -> list[str]:
    nb = nbformat.read(nb_path, as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "markdown"]


def _cells(nb_path: Path) -> list[tuple[str, str]]:
    nb = nbformat.read(nb_path, as_version=4)
    return [(c.cell_type, c.source) for c in nb.cells]


def _section(nb_path: Path) -> str:
    sections = [s for s in _markdown(nb_path) if s.startswith(HEADING)]
    assert len(sections) == 1, f"{nb_path.name}: {len(sections)} markdown cells start with {HEADING!r}, not 1"
    return sections[0]


def _vllm_serve_flags(text: str) -> set[str]:
    """The ``--flags`` of every ``vllm serve ...`` command written in an inline code span of ``text``."""
    flags = set()
    for span in _CODE_SPAN.findall(text):
        at = span.find("vllm serve")
        if at >= 0:
            flags |= set(_FLAG.findall(span[at:]))
    return flags


def test_every_chapter_is_covered():
    assert len(NOTEBOOKS) == 19


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_one_section_before_the_summary(nb):
    cells = _cells(nb)
    at = [i for i, (kind, src) in enumerate(cells) if kind == "markdown" and src.startswith(HEADING)]
    assert len(at) == 1, f"{nb.name}: {len(at)} markdown cells start with {HEADING!r}, not 1"
    summary = [i for i, (kind, src) in enumerate(cells) if kind == "markdown" and src.startswith(SUMMARY)]
    if summary:
        assert at[0] == summary[0] - 1, f"{nb.name}: the section is cell {at[0]}, the Summary cell {summary[0]}"
    else:
        assert at[0] == len(cells) - 1, f"{nb.name}: no Summary cell, so the section should be last"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_section_names_a_vllm_argument_or_metric(nb):
    text = _section(nb)
    named = {f for f in _FLAG.findall(text) if f in VLLM_ARGS} | {m for m in _METRIC.findall(text) if m in VLLM_METRICS}
    assert named, f"{nb.name}: the section names no vLLM engine argument or metric of VLLM_ARGS / VLLM_METRICS"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_vllm_serve_flags_and_metrics_are_known(nb):
    text = _section(nb)
    unknown_flags = _vllm_serve_flags(text) - VLLM_ARGS
    assert not unknown_flags, f"{nb.name}: `vllm serve` flags not in VLLM_ARGS: {sorted(unknown_flags)}"
    unknown_metrics = set(_METRIC.findall(text)) - VLLM_METRICS
    assert not unknown_metrics, f"{nb.name}: vllm: metrics not in VLLM_METRICS: {sorted(unknown_metrics)}"


def test_the_checks_catch_a_typo():
    text = "Start it with `vllm serve MODEL --max-num-seq 8 --block-size 16` and read `vllm:kv_cache_usage_pct`."
    assert _vllm_serve_flags(text) - VLLM_ARGS == {"--max-num-seq"}
    assert set(_METRIC.findall(text)) - VLLM_METRICS == {"vllm:kv_cache_usage_pct"}
    env = "`NCCL_BUFFSIZE=1048576 vllm serve MODEL --tensor-parallel-size 4`, then `workbench kv-calc --seq-len 8`"
    assert _vllm_serve_flags(env) == {"--tensor-parallel-size"}


VLLM_SITE = ROOT / "runs" / "bench" / "vllm-venv" / "lib" / "python3.11" / "site-packages" / "vllm"
needs_vllm = pytest.mark.skipif(
    not (VLLM_SITE / "engine" / "arg_utils.py").exists(),
    reason="vLLM 0.32 is not installed in runs/bench/vllm-venv (it is not in CI): the names cannot be checked "
    "against its source here",
)


@needs_vllm
def test_vllm_args_exist_in_vllm_source():
    """Import-free: each flag's dest (``--block-size`` -> ``block_size``, ``--no-X`` -> ``X``) is an ``EngineArgs``
    field in arg_utils.py, which ``add_cli_args`` turns into that option."""
    source = (VLLM_SITE / "engine" / "arg_utils.py").read_text()
    fields = set(re.findall(r"^    ([a-z_][a-z0-9_]*): ", source, flags=re.M))
    missing = []
    for flag in sorted(VLLM_ARGS):
        dest = flag.removeprefix("--").removeprefix("no-").replace("-", "_")
        if dest not in fields:
            missing.append(flag)
    assert not missing, f"not EngineArgs fields in {VLLM_SITE / 'engine' / 'arg_utils.py'}: {missing}"


@needs_vllm
def test_vllm_metrics_exist_in_vllm_source():
    """Each name is declared in loggers.py as it is written (a gauge, a histogram, an info gauge), or is a counter's
    ``_total`` series or a histogram's ``_bucket`` / ``_sum`` / ``_count`` series."""
    source = (VLLM_SITE / "v1" / "metrics" / "loggers.py").read_text()
    kinds: dict[str, set[str]] = {"counter": set(), "gauge": set(), "histogram": set()}
    for kind, name in re.findall(r'_(counter|gauge|histogram)_cls\(\s*name="(vllm:[a-z0-9_]+)"', source):
        kinds[kind].add(name)
    kinds["gauge"] |= set(re.findall(r'^\s+name = "(vllm:[a-z0-9_]+)"', source, flags=re.M))  # the info gauges
    missing = []
    for name in sorted(VLLM_METRICS):
        ok = name in kinds["gauge"] | kinds["histogram"]
        ok |= name.endswith("_total") and name.removesuffix("_total") in kinds["counter"]
        ok |= any(name.endswith(s) and name.removesuffix(s) in kinds["histogram"] for s in _SUFFIXES[1:])
        if not ok:
            missing.append(name)
    assert not missing, f"not exported under these names by {VLLM_SITE / 'v1' / 'metrics' / 'loggers.py'}: {missing}"
