"""A real Prometheus on loopback, scraping ``workbench serve``: started with a generated config, stopped by PID.

It runs the distribution's ``prometheus`` binary (Debian: ``apt-get install prometheus``, which brings ``promtool``;
another binary with ``WORKBENCH_PROMETHEUS=/path/to/prometheus``), with the alert rules shipped in
``deploy/prometheus/`` (both files) unless told otherwise, and reads series back through Prometheus' HTTP API
(``/api/v1/query``, ``/api/v1/query_range``, ``/api/v1/alerts``; https://prometheus.io/docs/prometheus/latest/querying/api/)::

    from workbench.server.launcher import ServerProcess
    from workbench.server.prometheus_process import PrometheusProcess
    with ServerProcess() as srv, PrometheusProcess([srv.base_url]) as prom:
        prom.wait_for_scrape()
        prom.query('vllm:num_requests_running')      # [{"metric": {...}, "value": [t, "0"]}]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workbench.server.launcher import free_port

#: the folder of the shipped Prometheus config, alert rules and their promtool tests
RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
#: alert rules on metrics any vLLM server exports (``vllm:`` families only)
VLLM_ALERT_RULES = RULES_DIR / "vllm_alerts.yml"
#: alert rules that need workbench's extra metrics (``workbench:`` families), which vLLM does not export
WORKBENCH_ALERT_RULES = RULES_DIR / "workbench_alerts.yml"
#: every shipped rule file, the vLLM ones first
ALERT_RULES = (VLLM_ALERT_RULES, WORKBENCH_ALERT_RULES)


def prometheus_binary() -> str:
    """The ``prometheus`` executable: ``$WORKBENCH_PROMETHEUS``, else the one on ``PATH``.

    Raises:
        FileNotFoundError: none found, with how to install it.
    """
    path = os.environ.get("WORKBENCH_PROMETHEUS") or shutil.which("prometheus")
    if not path:
        raise FileNotFoundError(
            "no prometheus binary: install the distribution's package (apt-get install prometheus; it brings "
            "promtool) or set WORKBENCH_PROMETHEUS=/path/to/prometheus"
        )
    return path


class PrometheusProcess:
    """Prometheus in a child process on 127.0.0.1, scraping ``targets`` (base URLs such as
    ``http://127.0.0.1:8000``; their ``/metrics``) every ``scrape_interval`` seconds and evaluating ``rule_files``
    as often; its data in a temporary folder removed on :meth:`stop`.

    Args:
        targets: base URLs of the servers to scrape.
        rule_files: alert and recording rule files (default: :data:`ALERT_RULES`); ``()`` for none.
        scrape_interval: seconds between scrapes and between rule evaluations (>= 0.1).
        port: the web port (default: a free one).
        startup_timeout: seconds to wait for ``/-/ready``.
        alertmanager: ``host:port`` of an Alertmanager-compatible receiver to send firing alerts to, or ``None``.

    Raises:
        ValueError: no target, a target that is not ``http://host:port``, or a bad interval.
        FileNotFoundError: (on start) no prometheus binary, or a rule file that does not exist.
        RuntimeError: (on start) Prometheus exited or did not get ready; the message carries its log's end.
    """

    def __init__(
        self,
        targets: Sequence[str],
        rule_files: Sequence[str | Path] = ALERT_RULES,
        scrape_interval: float = 1.0,
        port: int | None = None,
        startup_timeout: float = 60.0,
        alertmanager: str | None = None,
    ) -> None:
        if not targets:
            raise ValueError("targets is empty: give the base URL of at least one server, e.g. http://127.0.0.1:8000")
        self.targets = []
        for t in targets:
            u = urllib.parse.urlparse(t)
            if u.scheme not in ("http", "https") or not u.hostname or not u.port:
                raise ValueError(f"target {t!r} is not a base URL with a port; give e.g. http://127.0.0.1:8000")
            self.targets.append(f"{u.hostname}:{u.port}")
        if not scrape_interval >= 0.1:
            raise ValueError(f"scrape_interval={scrape_interval} must be >= 0.1 seconds")
        self.rule_files = [Path(p).resolve() for p in rule_files]
        self.scrape_interval, self.startup_timeout, self.alertmanager = scrape_interval, startup_timeout, alertmanager
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.workdir: Path | None = None

    # ------------------------------------------------------------------ config
    def config_text(self) -> str:
        """The generated ``prometheus.yml`` (YAML is a superset of JSON: written as JSON)."""
        interval = f"{int(self.scrape_interval * 1000)}ms"
        cfg: dict[str, Any] = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "rule_files": [str(p) for p in self.rule_files],
            "scrape_configs": [
                {"job_name": "workbench", "metrics_path": "/metrics", "static_configs": [{"targets": self.targets}]}
            ],
        }
        if self.alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [self.alertmanager]}]}]}
        return json.dumps(cfg, indent=2)

    # ------------------------------------------------------------------ life
    def start(self) -> PrometheusProcess:
        """Write the config, start Prometheus, wait until ``/-/ready`` answers 200."""
        binary = prometheus_binary()
        missing = [str(p) for p in self.rule_files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"rule file(s) {missing} do not exist")
        self.workdir = Path(tempfile.mkdtemp(prefix="workbench-prometheus-"))
        (self.workdir / "prometheus.yml").write_text(self.config_text())
        self.log_path = self.workdir / "prometheus.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    binary,
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"prometheus exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.base_url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self._fail(f"prometheus did not get ready within {self.startup_timeout:.0f} s")

    def _fail(self, why: str) -> None:
        tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
        self.stop()
        raise RuntimeError(f"{why}; its log ends:\n{tail}")

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 10 s; remove the data folder. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None

    def __enter__(self) -> PrometheusProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ the HTTP API
    def api(self, path: str, **params: Any) -> Any:
        """``GET /api/v1/<path>?params``; the ``data`` of a ``"success"`` answer.

        Raises:
            RuntimeError: an ``"error"`` answer (e.g. a bad PromQL expression), with Prometheus' message.
        """
        url = f"{self.base_url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        """An instant query: ``[{"metric": {labels}, "value": [unix time, "value"]}, ...]``."""
        return self.api("query", query=promql)["result"]

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[dict]:
        """A range query (unix seconds): ``[{"metric": {labels}, "values": [[t, "v"], ...]}, ...]``."""
        return self.api("query_range", query=promql, start=start, end=end, step=step)["result"]

    def alerts(self) -> list[dict]:
        """The alerts now pending or firing (``state``, ``labels``, ``annotations``, ``activeAt``, ``value``)."""
        return self.api("alerts")["alerts"]

    def targets_up(self) -> list[dict]:
        """The scrape targets' health (``health``: ``"up"`` / ``"down"``, ``lastError``, ``lastScrape``)."""
        return self.api("targets")["activeTargets"]

    def wait_for_scrape(self, timeout: float = 30.0) -> None:
        """Wait until every target has been scraped successfully once.

        Raises:
            TimeoutError: a target still not up after ``timeout`` seconds (its last error in the message).
        """
        deadline = time.monotonic() + timeout
        while True:
            ts = self.targets_up()
            if ts and all(t["health"] == "up" for t in ts):
                return
            if time.monotonic() > deadline:
                errs = "; ".join(f"{t['scrapeUrl']}: {t['health']} {t.get('lastError', '')}" for t in ts)
                raise TimeoutError(f"no successful scrape within {timeout:.0f} s ({errs or 'no targets'})")
            time.sleep(0.25)


__all__ = ["ALERT_RULES", "PrometheusProcess", "prometheus_binary"]
