"""A small alert receiver that closes the loop: an alert fires in Prometheus, the receiver acts on the server.

It listens on loopback for the two shapes alerts arrive in:

* Prometheus' own push to an Alertmanager (``POST /api/v2/alerts``, a JSON list of alerts with ``labels``,
  ``annotations``, ``startsAt``, ``endsAt``; a resolved alert has ``endsAt`` in the past), so a Prometheus whose
  ``alerting.alertmanagers`` names the receiver sends to it directly;
* an Alertmanager webhook (``POST /``, ``{"alerts": [{"status": "firing" | "resolved", "labels": ...}, ...]}``;
  https://prometheus.io/docs/alerting/latest/configuration/#webhook_config), for a setup with an Alertmanager.

For each *firing* alert whose ``alertname`` has an action it calls the server's admin API (``workbench serve
--enable-admin-api``): ``"compact"`` runs one KV compaction pass (``POST /admin/compact``), ``"lower_admission"``
halves ``max_num_seqs`` (``POST /admin/max_num_seqs``, not below 1), ``"shed_load"`` caps the requests in flight
(``POST /admin/max_num_queued_reqs``, vLLM's ``--max-num-queued-reqs``: beyond it new requests get 503 and a
client or router retries elsewhere). An action runs at most once per alert name
per ``cooldown_s`` (Prometheus re-sends firing alerts every minute or so). Every alert received and every action
taken is kept in :attr:`AlertReceiver.events`::

    with AlertReceiver(srv.base_url) as rx, PrometheusProcess([srv.base_url], alertmanager=rx.address) as prom:
        ...                                   # load that makes KVFragmentationHigh fire
        rx.events                             # [{"alertname": "KVFragmentationHigh", "action": "compact", ...}]
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: which action answers which shipped alert (``deploy/prometheus/vllm_alerts.yml`` and ``workbench_alerts.yml``).
#: A growing queue is missing capacity: fewer sequences per step serve fewer requests per second and the queue
#: grows faster (chapter 18 measures both actions on its overload), so the answer is to shed what cannot be
#: served in time and let the router or client send it elsewhere. Preemption means the batch outgrows the KV pool:
#: fewer sequences. Fragmentation: a compaction pass. A full pool alone (KVCacheUsageHigh) is a well-used pool and
#: TTFT over its SLO has many causes: both page a person and act on nothing.
DEFAULT_ACTIONS: dict[str, str] = {
    "KVFragmentationHigh": "compact",
    "Preempting": "lower_admission",
    "WaitingQueueGrowing": "shed_load",
}
ACTIONS = ("compact", "lower_admission", "shed_load")


def _ends_in_past(ends_at: str | None) -> bool:
    """Whether an RFC 3339 ``endsAt`` (nanoseconds allowed) lies in the past: the alert is resolved."""
    if not ends_at or ends_at.startswith("0001-"):
        return False
    text = re.sub(r"(\.\d{6})\d+", r"\1", ends_at).replace("Z", "+00:00")
    try:
        return datetime.fromisoformat(text) < datetime.now(timezone.utc)
    except ValueError:
        return False


class AlertReceiver:
    """Receive alerts on ``127.0.0.1:port`` and run the server's admin actions (see the module docstring).

    Args:
        server_url: the workbench server's base URL (``http://127.0.0.1:8000``), started with ``--enable-admin-api``.
        actions: ``{alertname: "compact" | "lower_admission"}`` (default :data:`DEFAULT_ACTIONS`).
        port: the port to listen on (default: a free one).
        cooldown_s: seconds before the same alert name may act again.
        api_key: the server's ``--api-key``, if it has one.
        shed_limit: the in-flight cap ``"shed_load"`` sets. vLLM sizes ``--max-num-queued-reqs`` as the batch's
            slots plus the queue depth to keep; a request that waits behind a full batch waits a whole batch's
            service time, past a TTFT SLO shorter than that, so the default keeps no queue: the server's
            ``max_num_seqs`` then. With a longer SLO, add about SLO x completed requests per second.

    Raises:
        ValueError: an action that is not one of :data:`ACTIONS`.
    """

    def __init__(
        self,
        server_url: str,
        actions: dict[str, str] | None = None,
        port: int | None = None,
        cooldown_s: float = 60.0,
        api_key: str | None = None,
        shed_limit: int | None = None,
    ) -> None:
        self.actions = dict(DEFAULT_ACTIONS if actions is None else actions)
        bad = {k: v for k, v in self.actions.items() if v not in ACTIONS}
        if bad:
            raise ValueError(f"actions {bad}: each must be one of {', '.join(ACTIONS)}")
        if shed_limit is not None and (
            isinstance(shed_limit, bool) or not isinstance(shed_limit, int) or shed_limit < 0
        ):
            raise ValueError(f"shed_limit={shed_limit!r} must be a whole number of requests >= 0, or None")
        self.server_url, self.cooldown_s, self.api_key = server_url.rstrip("/"), cooldown_s, api_key
        self.shed_limit = shed_limit
        self.port = port or 0
        self.events: list[dict[str, Any]] = []
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def address(self) -> str:
        """``host:port``, as Prometheus' ``alerting.alertmanagers`` targets name it."""
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ life
    def start(self) -> AlertReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                try:
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                except json.JSONDecodeError:
                    self.send_error(400, "the body is not JSON")
                    return
                alerts = body if isinstance(body, list) else (body or {}).get("alerts", [])
                receiver.receive(alerts if isinstance(alerts, list) else [])
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args):  # quiet: events are kept in receiver.events
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, name="alert-receiver", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop listening (idempotent)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> AlertReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ alerts
    def receive(self, alerts: list[dict[str, Any]]) -> None:
        """Act on a batch of alerts (either shape); record each in :attr:`events`."""
        for a in alerts:
            labels = a.get("labels") or {}
            name = labels.get("alertname", "?")
            firing = a.get("status", "firing") == "firing" and not _ends_in_past(a.get("endsAt"))
            action = self.actions.get(name) if firing else None
            event = {"time": time.time(), "alertname": name, "firing": firing, "labels": labels, "action": None}
            with self._lock:
                due = action is not None and time.monotonic() - self._last.get(name, -1e18) >= self.cooldown_s
                if due:
                    self._last[name] = time.monotonic()
            if due:
                event["action"] = action
                try:
                    event["result"] = getattr(self, action)()
                except (OSError, ValueError) as e:
                    event["error"] = str(e)
            with self._lock:
                self.events.append(event)

    def actions_taken(self) -> list[dict[str, Any]]:
        """The events that ran an action."""
        with self._lock:
            return [e for e in self.events if e["action"]]

    def wait_for_action(self, alertname: str, timeout_s: float, poll_s: float = 0.2) -> dict[str, Any] | None:
        """The first event in which ``alertname`` ran an action, waiting up to ``timeout_s`` seconds for it;
        ``None`` if none came by then (the alert did not fire, or fired with no action mapped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            for e in self.actions_taken():
                if e["alertname"] == alertname:
                    return e
            if time.monotonic() >= deadline:
                return None
            time.sleep(poll_s)

    # ------------------------------------------------------------------ the server's admin API
    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        req = urllib.request.Request(self.server_url + path, method=method)
        if body is not None:
            req.data = json.dumps(body).encode()
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ValueError(f"{method} {path}: HTTP {e.code} {e.read().decode(errors='replace')}") from None

    def compact(self) -> dict:
        """``POST /admin/compact``: one compaction pass; what it moved."""
        return self._call("POST", "/admin/compact", {})

    def lower_admission(self) -> dict:
        """Halve the server's ``max_num_seqs`` (not below 1); ``{"max_num_seqs": new, "previous": old}``."""
        now = self._call("GET", "/admin/state")["max_num_seqs"]
        return self._call("POST", "/admin/max_num_seqs", {"max_num_seqs": max(1, now // 2)})

    def shed_load(self) -> dict:
        """Cap the requests in flight at :attr:`shed_limit` (default ``max_num_seqs``); beyond it the server
        answers 503. ``{"max_num_queued_reqs": new, "previous": old}``."""
        limit = self.shed_limit
        if limit is None:
            limit = int(self._call("GET", "/admin/state")["max_num_seqs"])
        return self._call("POST", "/admin/max_num_queued_reqs", {"max_num_queued_reqs": limit})


__all__ = ["ACTIONS", "DEFAULT_ACTIONS", "AlertReceiver"]
