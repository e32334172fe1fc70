"""Per-replica figures of ``bench serve`` (workbench.bench.replica_metrics): replicas' ``/metrics`` read before,
during and after a run, served here by small loopback HTTP servers whose metrics text the test sets."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from workbench.bench.replica_metrics import ReplicaMonitor, kv_imbalance
from workbench.bench.serve import run_bench_serve


class FakeReplica:
    """A loopback server answering ``/metrics`` with ``self.text``; counts every other request in ``posts``."""

    def __init__(self) -> None:
        self.text = ""
        self.posts = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                body = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                outer.posts += 1
                self.send_response(500)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def set(self, requests=0, prompt=0, hits=0, queries=0, preempted=0, usage=0.0, waiting=0):
        self.text = (
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{finished_reason="stop"}} {requests}\n'
            f'vllm:request_success_total{{finished_reason="length"}} 0\n'
            "# TYPE vllm:prompt_tokens_total counter\n"
            f"vllm:prompt_tokens_total {prompt}\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total {hits}\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total {queries}\n"
            "# TYPE vllm:num_preemptions_total counter\n"
            f"vllm:num_preemptions_total {preempted}\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc {usage}\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting {waiting}\n"
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fakes():
    made = [FakeReplica(), FakeReplica()]
    yield made
    for f in made:
        f.close()


def test_kv_imbalance_is_the_largest_usage_over_the_mean():
    assert kv_imbalance([0.6, 0.2]) == pytest.approx(1.5)
    assert kv_imbalance([0.3, 0.3, 0.3]) == pytest.approx(1.0)
    assert kv_imbalance([0.0, 0.0]) == 1.0  # nothing in use: even
    assert kv_imbalance([None, 0.4]) == pytest.approx(1.0)  # a lost replica is left out
    assert kv_imbalance([1.0, 0.0, 0.0]) == pytest.approx(3.0)  # n replicas: n at most


def test_monitor_reports_each_replicas_increase_and_peaks(fakes):
    a, b = fakes
    a.set(requests=10, prompt=1000, hits=100, queries=1000, preempted=1, usage=0.1)
    b.set(requests=5, prompt=500, usage=0.0)
    m = ReplicaMonitor([a.url, b.url], interval_s=60)  # no reading in between: baseline and final only
    m.start()
    a.set(requests=16, prompt=1600, hits=400, queries=1600, preempted=3, usage=0.3, waiting=2)
    b.set(requests=7, prompt=700, usage=0.1)
    m.stop()
    s = m.summary()
    ra, rb = s["replicas"]
    assert (ra["requests"], ra["prompt_tokens"], ra["preemptions"]) == (6, 600, 2)
    assert ra["prefix_cache_hit_rate"] == pytest.approx(300 / 600)
    assert ra["prefill_tokens_computed"] == 300
    assert (ra["max_kv_cache_usage"], ra["max_waiting"], ra["max_fragmentation_rate"]) == (0.3, 2, None)
    assert rb["requests"] == 2 and rb["prefix_cache_hit_rate"] is None and not rb["lost"]
    # readings: (0.1, 0.0) -> 2.0; (0.3, 0.1) -> 1.5
    assert s["kv_imbalance_max"] == pytest.approx(2.0)
    assert s["kv_imbalance_mean"] == pytest.approx(1.75)
    assert [r["kv_cache_usage"] for r in s["replica_timeline"]] == [[0.1, 0.0], [0.3, 0.1]]


def test_a_replica_lost_mid_run_counts_up_to_its_last_answer(fakes):
    a, b = fakes
    a.set(requests=0)
    b.set(requests=0)
    m = ReplicaMonitor([a.url, b.url], interval_s=60)
    m.start()
    b.set(requests=3)
    m._reading()  # a reading while both answer
    b.close()
    a.set(requests=9)
    m.stop()
    ra, rb = m.summary()["replicas"]
    assert (ra["requests"], ra["lost"]) == (9, False)
    assert (rb["requests"], rb["lost"]) == (3, True)


def test_a_wrong_replica_url_is_refused_before_anything_is_sent(fakes):
    router, _ = fakes
    with pytest.raises(ValueError, match=r"--replica-url http://127\.0\.0\.1:9/?: its /metrics did not answer"):
        run_bench_serve(
            base_url=router.url,
            model="m",
            replica_urls=["http://127.0.0.1:9"],
            num_prompts=2,
            disable_tqdm=True,
            print_result=False,
        )
    assert router.posts == 0
    with pytest.raises(ValueError, match="at least one replica"):
        ReplicaMonitor([])
