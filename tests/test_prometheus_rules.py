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

from workbench.server.prometheus_process import ALERT_RULES, PrometheusProcess

RULES_DIR = ALERT_RULES.parent
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


@needs_promtool
def test_promtool_checks_the_rules():
    r = promtool("check", "rules", ALERT_RULES.name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 5 rules found" in r.stdout


@needs_promtool
def test_promtool_checks_the_example_config():
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout


@needs_promtool
def test_promtool_unit_tests_every_alert():
    r = promtool("test", "rules", "workbench_alerts_test.yml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout
    alerts = set(re.findall(r"^\s+- alert: (\w+)", ALERT_RULES.read_text(), re.M))
    tested = set(re.findall(r"alertname: (\w+)", (RULES_DIR / "workbench_alerts_test.yml").read_text()))
    assert alerts == tested == {"KVCacheUsageHigh", "KVFragmentationHigh", "Preempting", "TTFTp99AboveSLO",
                                "WaitingQueueGrowing"}  # fmt: skip


def test_every_metric_the_rules_read_is_exported():
    """The names in the rules' expressions exist in the exposition of the server's registry (with the
    ``_total`` / ``_bucket`` suffixes prometheus_client gives counters and histograms)."""
    from prometheus_client import generate_latest

    from workbench.metrics.prometheus import PrometheusSink

    exposed = generate_latest(PrometheusSink("m").registry).decode()
    names = set(re.findall(r"^([a-z0-9_:]+)(?:\{| )", exposed, re.M))
    exprs = [r["expr"] for g in yaml.safe_load(ALERT_RULES.read_text())["groups"] for r in g["rules"]]
    read = set(re.findall(r"\b((?:vllm|workbench):[a-z0-9_]+)", "\n".join(exprs)))
    assert read and read <= names, read - names


DASHBOARD = RULES_DIR.parent / "grafana" / "workbench_dashboard.json"


def dashboard_exprs() -> list[str]:
    """The PromQL of every panel of the Grafana dashboard, Grafana's ``$__rate_interval`` as ``1m``."""
    import json

    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$__rate_interval", "1m") for p in dash["panels"] for t in p["targets"]]


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
    assert '"127.0.0.1:8000"' in cfg and '"127.0.0.1:9093"' in cfg and "workbench_alerts.yml" in cfg
