"""The alert rules in ``deploy/prometheus/``, checked and unit-tested with ``promtool`` (every alert: the series that
fire it and those that must not), their metrics checked against what ``/metrics`` exports; and a real Prometheus
scraping ``workbench serve`` on loopback, read back through its HTTP API."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from workbench.server.prometheus_process import (
    ALERT_RULES,
    RULES_DIR,
    VLLM_ALERT_RULES,
    WORKBENCH_ALERT_RULES,
    PrometheusProcess,
)

PROMTOOL = shutil.which("promtool")
# CI (.ci/run) installs Debian's prometheus and sets WORKBENCH_REQUIRE_PROMETHEUS=1: there a missing binary fails
REQUIRED = os.environ.get("WORKBENCH_REQUIRE_PROMETHEUS") == "1"
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None and not REQUIRED, reason="no promtool (apt-get install prometheus; .ci/run installs it)"
)
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None and not REQUIRED,
    reason="no prometheus (apt-get install prometheus; .ci/run installs it)",
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    assert PROMTOOL, "WORKBENCH_REQUIRE_PROMETHEUS=1 but no promtool on PATH (apt-get install prometheus)"
    return subprocess.run([PROMTOOL, *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=120)


#: vLLM 0.32's metric families that the ``vllm_alerts.yml`` rules and the dashboard's vLLM panels read (from
#: ``vllm/v1/metrics/loggers.py``; counters without prometheus_client's ``_total`` suffix, histograms without
#: ``_bucket``). A rule on a name outside this list would never fire on a vLLM server.
VLLM_FAMILIES = {
    "vllm:admission_rejections",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:prefix_cache_hits",
    "vllm:prefix_cache_queries",
    "vllm:request_success",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
}
RULE_FILES = {"vllm_alerts.yml": VLLM_ALERT_RULES, "workbench_alerts.yml": WORKBENCH_ALERT_RULES}
ALERTS = {
    "vllm_alerts.yml": {"KVCacheUsageHigh", "Preempting", "TTFTp99AboveSLO", "WaitingQueueGrowing"},
    "workbench_alerts.yml": {"KVFragmentationHigh"},
}


def family(name: str) -> str:
    """A series name as its metric family: ``vllm:num_preemptions_total`` -> ``vllm:num_preemptions``."""
    return re.sub(r"(_total|_bucket|_sum|_count)$", "", name)


def metrics_read(text: str) -> set[str]:
    return set(re.findall(r"\b((?:vllm|workbench):[a-z0-9_]+)", text))


def rule_exprs(path: Path) -> list[str]:
    return [r["expr"] for g in yaml.safe_load(path.read_text())["groups"] for r in g["rules"]]


@needs_promtool
@pytest.mark.parametrize("name", sorted(RULE_FILES))
def test_promtool_checks_the_rules(name):
    r = promtool("check", "rules", name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(ALERTS[name])} rules found" in r.stdout


@needs_promtool
def test_promtool_checks_the_example_config():
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 2 rule files found" in r.stdout


@needs_promtool
@pytest.mark.parametrize("name", sorted(RULE_FILES))
def test_promtool_unit_tests_every_alert(name):
    test_file = name.replace(".yml", "_test.yml")
    r = promtool("test", "rules", test_file)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    alerts = set(re.findall(r"^\s+- alert: (\w+)", RULE_FILES[name].read_text(), re.M))
    tested = set(re.findall(r"alertname: (\w+)", (RULES_DIR / test_file).read_text()))
    assert alerts == tested == ALERTS[name]


def test_the_shipped_rule_files_are_the_two_split_ones():
    assert ALERT_RULES == (VLLM_ALERT_RULES, WORKBENCH_ALERT_RULES)
    assert sorted(p.name for p in RULES_DIR.glob("*_alerts.yml")) == sorted(RULE_FILES)


def test_the_vllm_rules_read_only_what_a_vllm_server_exports():
    read = {family(m) for m in metrics_read("\n".join(rule_exprs(VLLM_ALERT_RULES)))}
    assert read and read <= VLLM_FAMILIES, read - VLLM_FAMILIES


def test_every_workbench_rule_needs_a_workbench_metric():
    """A rule that reads only ``vllm:`` metrics belongs in vllm_alerts.yml, where vLLM users find it."""
    for expr in rule_exprs(WORKBENCH_ALERT_RULES):
        assert any(m.startswith("workbench:") for m in metrics_read(expr)), expr


@pytest.mark.parametrize("path", ALERT_RULES, ids=lambda p: p.name)
def test_every_metric_the_rules_read_is_exported(path):
    """The names in the rules' expressions exist in the exposition of the server's registry (with the
    ``_total`` / ``_bucket`` suffixes prometheus_client gives counters and histograms)."""
    from prometheus_client import generate_latest

    from workbench.metrics.prometheus import PrometheusSink

    exposed = generate_latest(PrometheusSink("m").registry).decode()
    names = set(re.findall(r"^([a-z0-9_:]+)(?:\{| )", exposed, re.M))
    read = metrics_read("\n".join(rule_exprs(path)))
    assert read and read <= names, read - names


DASHBOARD = RULES_DIR.parent / "grafana" / "workbench_dashboard.json"


def dashboard_exprs() -> list[str]:
    """The PromQL of every panel of the Grafana dashboard, Grafana's ``$__rate_interval`` as ``1m``."""
    import json

    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$__rate_interval", "1m") for p in dash["panels"] for t in p.get("targets", [])]


def test_the_dashboard_marks_every_panel_that_needs_workbench():
    """A panel reading any ``workbench:`` metric says so in its title and description and sits in the workbench row;
    every other panel reads only vLLM's families, so it works on any vLLM server."""
    import json

    rows, marked, plain = None, [], []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        if p["type"] == "row":
            rows = p["title"]
            continue
        read = metrics_read("\n".join(t["expr"] for t in p["targets"]))
        if any(m.startswith("workbench:") for m in read):
            assert p["title"].endswith("[workbench]") and "Needs workbench serve" in p["description"], p["title"]
            assert rows.startswith("workbench's extra metrics"), p["title"]
            marked.append(p["title"])
        else:
            assert "[workbench]" not in p["title"] and {family(m) for m in read} <= VLLM_FAMILIES, p["title"]
            assert rows.startswith("vLLM metrics"), p["title"]
            plain.append(p["title"])
    assert len(marked) == 4 and len(plain) == 10


def test_the_dashboard_reads_exported_metrics_only():
    from prometheus_client import generate_latest

    from workbench.metrics.prometheus import PrometheusSink

    exposed = generate_latest(PrometheusSink("m").registry).decode()
    names = set(re.findall(r"^([a-z0-9_:]+)(?:\{| )", exposed, re.M))
    read = set(re.findall(r"\b((?:vllm|workbench):[a-z0-9_]+)", "\n".join(dashboard_exprs())))
    assert len(read) >= 15 and read <= names, read - names


@needs_prometheus
@pytest.mark.slow
@pytest.mark.server
def test_a_real_prometheus_scrapes_the_server_and_answers_queries(tmp_path):
    """The server on loopback and Prometheus scraping it every 0.5 s: after a scrape and a request, a ``vllm:`` and a
    ``workbench:`` series come back through /api/v1/query; the rules are loaded; both processes stop by PID."""
    import openai

    from workbench.server.launcher import ServerProcess

    with ServerProcess(threads=1, max_model_len=256, max_num_seqs=4) as srv:
        with PrometheusProcess([srv.base_url], scrape_interval=0.5) as prom:
            prom.wait_for_scrape()
            client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-", max_retries=0, timeout=120)
            client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=4)
            done = []
            for _ in range(40):  # until a scrape after the request has landed
                done = prom.query("vllm:request_success_total")
                if done and sum(float(s["value"][1]) for s in done) >= 1:
                    break
                __import__("time").sleep(0.5)
            assert sum(float(s["value"][1]) for s in done) >= 1, done
            assert {s["metric"]["job"] for s in done} == {"workbench"}
            blocks = prom.query("workbench:kv_blocks_total")
            assert blocks and float(blocks[0]["value"][1]) > 0 and blocks[0]["metric"]["model_name"]
            rules = prom.api("rules")["groups"]
            assert {r["name"] for g in rules for r in g["rules"]} >= {"KVCacheUsageHigh", "WaitingQueueGrowing"}
            with pytest.raises(RuntimeError, match="bad_data"):
                prom.query("sum(")
            for expr in dashboard_exprs():  # every panel's query parses and runs on the real Prometheus
                prom.query(expr)
            proc, workdir = prom.proc, prom.workdir
        assert proc.poll() is not None and not Path(workdir).exists()  # stopped, its data removed


def test_prometheus_process_refuses_bad_targets():
    with pytest.raises(ValueError, match="targets is empty"):
        PrometheusProcess([])
    with pytest.raises(ValueError, match="not a base URL with a port"):
        PrometheusProcess(["127.0.0.1"])
    with pytest.raises(ValueError, match="scrape_interval=0"):
        PrometheusProcess(["http://127.0.0.1:8000"], scrape_interval=0)
    cfg = PrometheusProcess(["http://127.0.0.1:8000"], alertmanager="127.0.0.1:9093").config_text()
    assert (
        '"127.0.0.1:8000"' in cfg
        and '"127.0.0.1:9093"' in cfg
        and "workbench_alerts.yml" in cfg
        and "vllm_alerts.yml" in cfg
    )
