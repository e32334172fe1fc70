"""Alert to action: the server's admin API (``--enable-admin-api``), the alert receiver in both alert shapes, and the
whole loop — a real Prometheus fires a rule, pushes the alert to the receiver, the receiver sheds load on the
server — on loopback, every process stopped by PID; and vLLM's ``--max-num-queued-reqs`` admission valve."""

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
        assert [(e["alertname"], e["action"]) for e in taken] == [("WaitingQueueGrowing", "shed_load")]
        assert taken[0]["result"] == {"max_num_queued_reqs": 8, "previous": None}  # max_num_seqs: no queue
        assert [e["firing"] for e in rx.events] == [True, False, True, False, True]
    state = call(server.base_url + "/admin/state")[1]
    assert state["max_num_queued_reqs"] == 8 and state["configured_max_num_queued_reqs"] is None
    assert state["max_num_seqs"] == 8  # shedding leaves the batch as it was
    call(server.base_url + "/admin/max_num_queued_reqs", "POST", {"max_num_queued_reqs": None})
    with pytest.raises(ValueError, match="each must be one of compact, lower_admission, shed_load"):
        AlertReceiver(server.base_url, actions={"X": "reboot"})
    with pytest.raises(ValueError, match="shed_limit=-1"):
        AlertReceiver(server.base_url, shed_limit=-1)


def _rejections(base_url: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    line = next(x for x in text.splitlines() if x.startswith("vllm:admission_rejections_total{")
                and 'reason="max_num_queued_reqs"' in x)  # fmt: skip
    return float(line.rsplit(" ", 1)[1])


def test_max_num_queued_reqs_refuses_with_503_and_keeps_what_runs(server):
    """vLLM's valve: with N requests in flight the next gets 503 (vLLM's message, the limit named), counted in
    ``vllm:admission_rejections_total``; the request in flight finishes whole; bad limits get 400."""
    import openai

    url = server.base_url
    for bad in (-1, "2", True):
        status, err = call(url + "/admin/max_num_queued_reqs", "POST", {"max_num_queued_reqs": bad})
        assert status == 400 and f"max_num_queued_reqs={bad!r} must be a whole number >= 0" in err["error"]["message"]
    status, err = call(url + "/admin/max_num_queued_reqs", "POST", {})
    assert status == 400 and "max_num_queued_reqs is missing" in err["error"]["message"]
    before = _rejections(url)
    assert call(url + "/admin/max_num_queued_reqs", "POST", {"max_num_queued_reqs": 1})[0] == 200
    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    try:
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=64, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        chunks = iter(stream)
        first = next(chunks)  # in flight now
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=model, prompt="Hello", max_tokens=4)
        assert e.value.status_code == 503
        assert "max_num_queued_reqs=1" in e.value.message and "try again later" in e.value.message
        rest = list(chunks)
        text = first.choices[0].text + "".join(c.choices[0].text for c in rest if c.choices)
        assert rest[-1].choices[0].finish_reason == "length" and text
        assert _rejections(url) == before + 1
        with pytest.raises(openai.APIStatusError) as e:  # two prompts can never fit a limit of one
            client.completions.create(model=model, prompt=["a", "b"], max_tokens=2)
        assert e.value.status_code == 503 and "send at most 1 prompts per request" in e.value.message
        assert _rejections(url) == before + 2
        ok = client.completions.create(model=model, prompt="Hello", max_tokens=4)  # nothing in flight: admitted
        assert ok.choices[0].text is not None
    finally:
        call(url + "/admin/max_num_queued_reqs", "POST", {"max_num_queued_reqs": None})


@pytest.mark.skipif(
    shutil.which("prometheus") is None and os.environ.get("WORKBENCH_REQUIRE_PROMETHEUS") != "1",
    reason="no prometheus (apt-get install prometheus; .ci/run installs it and requires it)",
)
def test_a_real_prometheus_alert_sheds_load_on_the_server(server, tmp_path):
    """A rule that fires at once (requests running >= 0, ``for: 0s``) stands in for an overload; Prometheus pushes
    it to the receiver, which caps the server's requests in flight."""
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
    assert taken[0]["result"] == {"max_num_queued_reqs": 8, "previous": None}
    assert call(server.base_url + "/admin/state")[1]["max_num_queued_reqs"] == 8
    call(server.base_url + "/admin/max_num_queued_reqs", "POST", {"max_num_queued_reqs": None})
