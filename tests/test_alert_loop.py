"""Alert to action: the server's admin API (``--enable-admin-api``), the alert receiver in both alert shapes, and the
whole loop — a real Prometheus fires a rule, pushes the alert to the receiver, the receiver lowers the server's
admission — on loopback, every process stopped by PID."""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from workbench.server.alert_receiver import AlertReceiver
from workbench.server.launcher import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.server]


def call(url: str, method: str = "GET", body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode())
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server():
    with ServerProcess(threads=1, extra_args=["--enable-admin-api"], max_model_len=256, max_num_seqs=8) as srv:
        yield srv


def test_admin_state_compact_and_admission(server):
    status, state = call(server.base_url + "/admin/state")
    assert status == 200 and state["max_num_seqs"] == state["configured_max_num_seqs"] == 8
    assert state["kv_allocator"] == "paged"
    status, moved = call(server.base_url + "/admin/compact", "POST", {})
    assert status == 200 and moved["blocks_moved"] >= 0  # an idle paged pool has little or nothing to move
    assert call(server.base_url + "/admin/state")[1]["compaction_passes"] >= (1 if moved["blocks_moved"] else 0)
    status, res = call(server.base_url + "/admin/max_num_seqs", "POST", {"max_num_seqs": 3})
    assert status == 200 and res == {"max_num_seqs": 3, "previous": 8}
    for bad in (0, 9, "2", None):  # outside [1, configured], or not a whole number: 400 naming it, nothing changed
        status, err = call(server.base_url + "/admin/max_num_seqs", "POST", {"max_num_seqs": bad})
        assert status == 400 and f"max_num_seqs={bad!r} must be a whole number in [1, 8]" in err["error"]["message"]
    status, err = call(server.base_url + "/admin/compact", "POST", {"max_moves": 0})
    assert status == 400 and "max_moves=0" in err["error"]["message"]
    assert call(server.base_url + "/admin/state")[1]["max_num_seqs"] == 3
    call(server.base_url + "/admin/max_num_seqs", "POST", {"max_num_seqs": 8})


def test_without_the_flag_there_is_no_admin_api():
    with ServerProcess(threads=1, max_model_len=128, max_num_seqs=2) as srv:
        status, err = call(srv.base_url + "/admin/state")
        assert status == 404 and "--enable-admin-api" in err["error"]["message"]


def test_the_receiver_acts_on_firing_alerts_once_per_cooldown(server):
    call(server.base_url + "/admin/max_num_seqs", "POST", {"max_num_seqs": 8})
    past = (datetime.now(timezone.utc) - timedelta(minutes=1)).isoformat().replace("+00:00", "Z")
    with AlertReceiver(server.base_url, cooldown_s=3600) as rx:
        # Alertmanager's webhook shape: a firing and a resolved alert
        webhook = {"alerts": [{"status": "firing", "labels": {"alertname": "WaitingQueueGrowing"}},
                              {"status": "resolved", "labels": {"alertname": "KVCacheUsageHigh"}}]}  # fmt: skip
        assert call(f"http://{rx.address}/", "POST", webhook)[0] == 200
        # Prometheus' push (a list): the same alert again (cooled down: no second action), a resolved one, another
        push = [{"labels": {"alertname": "WaitingQueueGrowing"}, "endsAt": "2999-01-01T00:00:00.123456789Z"},
                {"labels": {"alertname": "Preempting"}, "endsAt": past},
                {"labels": {"alertname": "SomethingElse"}}]  # fmt: skip
        assert call(f"http://{rx.address}/api/v2/alerts", "POST", push)[0] == 200
        taken = rx.actions_taken()
        assert [(e["alertname"], e["action"]) for e in taken] == [("WaitingQueueGrowing", "lower_admission")]
        assert taken[0]["result"] == {"max_num_seqs": 4, "previous": 8}
        assert [e["firing"] for e in rx.events] == [True, False, True, False, True]
    assert call(server.base_url + "/admin/state")[1]["max_num_seqs"] == 4
    with pytest.raises(ValueError, match="each must be one of compact, lower_admission"):
        AlertReceiver(server.base_url, actions={"X": "reboot"})


@pytest.mark.skipif(
    shutil.which("prometheus") is None and os.environ.get("WORKBENCH_REQUIRE_PROMETHEUS") != "1",
    reason="no prometheus (apt-get install prometheus; .ci/run installs it and requires it)",
)
def test_a_real_prometheus_alert_lowers_the_servers_admission(server, tmp_path):
    """A rule that fires at once (requests running >= 0, ``for: 0s``) stands in for an overload; Prometheus pushes
    it to the receiver, which halves max_num_seqs on the server."""
    from workbench.server.prometheus_process import PrometheusProcess

    call(server.base_url + "/admin/max_num_seqs", "POST", {"max_num_seqs": 8})
    rules = tmp_path / "rules.yml"
    rules.write_text(
        "groups:\n  - name: test\n    rules:\n      - alert: WaitingQueueGrowing\n"
        "        expr: vllm:num_requests_running >= 0\n        for: 0s\n"
    )
    with AlertReceiver(server.base_url) as rx:
        with PrometheusProcess([server.base_url], rule_files=[rules], scrape_interval=0.5, alertmanager=rx.address):
            deadline = time.monotonic() + 60
            while not rx.actions_taken() and time.monotonic() < deadline:
                time.sleep(0.5)
    taken = rx.actions_taken()
    assert taken and taken[0]["alertname"] == "WaitingQueueGrowing", rx.events
    assert taken[0]["result"] == {"max_num_seqs": 4, "previous": 8}
    assert call(server.base_url + "/admin/state")[1]["max_num_seqs"] == 4
