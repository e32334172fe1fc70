"""Per-replica figures of a benchmark through a router: each replica's ``/metrics`` read before, during and after.

A router hides which replica served what; the replicas' own Prometheus endpoints do not. :class:`ReplicaMonitor`
reads every replica's ``/metrics`` once before the first request (the baseline), then every ``interval_s`` seconds
in a thread while the benchmark runs, and once after the last answer. It reads vLLM's metric families only
(``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running`` / ``_waiting``, ``vllm:request_success_total``, ...),
so it works on vLLM replicas as on workbench ones; ``workbench:fragmentation_rate`` is read where a replica exports
it (``None`` on vLLM).

Per replica (:meth:`ReplicaMonitor.summary`): the counters' increase over the run — requests answered, prompt and
generation tokens, preemptions, prefix-cache hits and queries (tokens) — with the prefix-cache hit rate and the
prefill tokens computed (prompt tokens less prefix-cache hits); and the gauges' peaks. Across replicas: the
**KV imbalance**, at each reading the largest replica's KV-cache usage over the replicas' mean (1 = even; ``n``
replicas at most; 1 when all are empty), as its mean and maximum over the run's readings.
"""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

#: result key -> the counter (sample name) whose increase over the run it is
COUNTERS = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "preemptions": "vllm:num_preemptions_total",
    "prefix_cache_hits": "vllm:prefix_cache_hits_total",
    "prefix_cache_queries": "vllm:prefix_cache_queries_total",
}
#: result key -> the gauge read at every reading
GAUGES = {
    "kv_cache_usage": "vllm:kv_cache_usage_perc",
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "fragmentation_rate": "workbench:fragmentation_rate",
}


def read_replica(client: httpx.Client, url: str) -> dict[str, float | None]:
    """One reading of a replica's ``/metrics``: ``up`` (True) and every :data:`COUNTERS` and :data:`GAUGES` key,
    summed over the family's labels; a counter not exported (yet) is 0, a gauge not exported ``None``.

    Raises:
        httpx.HTTPError: the replica did not answer.
    """
    r = client.get(url.rstrip("/") + "/metrics")
    r.raise_for_status()
    wanted = {name: key for key, name in (COUNTERS | GAUGES).items()}
    out: dict = {"up": True} | dict.fromkeys(COUNTERS, 0.0) | dict.fromkeys(GAUGES)
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = wanted.get(s.name)
            if key is not None:
                out[key] = (out[key] or 0.0) + s.value
    return out


def kv_imbalance(usages: list[float | None]) -> float:
    """The largest KV-cache usage over the mean of ``usages`` (replicas' fractions in ``[0, 1]``); 1 when the
    mean is 0 or no replica reports its usage."""
    known = [u for u in usages if u is not None]
    mean = sum(known) / len(known) if known else 0.0
    return max(known) / mean if mean > 0 else 1.0


class ReplicaMonitor:
    """Reads ``urls``' ``/metrics`` before, during (every ``interval_s`` s, in a thread) and after a run.

    Args:
        urls: the replicas' base URLs (``http://host:port``), not the router's.
        interval_s: seconds between readings during the run.

    Raises:
        ValueError: no URLs or a non-positive interval; (:meth:`check`, :meth:`start`) a replica that does not
            answer, named with its URL.
    """

    def __init__(self, urls: list[str], interval_s: float = 0.5) -> None:
        if not urls:
            raise ValueError("--replica-url: give at least one replica's base URL (http://HOST:PORT)")
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s}: give a positive number of seconds between readings")
        self.urls = [u.rstrip("/") for u in urls]
        self.interval_s = interval_s
        #: every reading: ``{"t_s": seconds since start(), "replicas": [read_replica(...) per URL]}``
        self.readings: list[dict] = []
        self._client = httpx.Client(timeout=10)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _read_all(self, strict: bool = True) -> list[dict]:
        out = []
        for url in self.urls:
            try:
                out.append(read_replica(self._client, url))
            except httpx.HTTPError as e:
                if not strict:  # a replica lost mid-run: no figures from it in this reading
                    out.append({"up": False} | dict.fromkeys(COUNTERS | GAUGES))
                    continue
                raise ValueError(
                    f"--replica-url {url}: its /metrics did not answer ({type(e).__name__}); give the base URL of a "
                    "running replica (the server the router forwards to), not the router's"
                ) from None
        return out

    def check(self) -> None:
        """Read every replica once (before anything is sent, so a wrong URL fails first)."""
        self._read_all()

    def _reading(self, strict: bool = False) -> None:
        self.readings.append({"t_s": time.perf_counter() - self._t0, "replicas": self._read_all(strict)})

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._reading()

    def start(self) -> None:
        """The baseline reading, then readings in a thread."""
        self._t0 = time.perf_counter()
        self._reading(strict=True)
        self._thread = threading.Thread(target=self._loop, name="replica-monitor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take the final reading."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._reading()
        self._client.close()

    def summary(self) -> dict:
        """``replicas`` (one dict per URL: ``url``, the counters' increases, ``prefix_cache_hit_rate``,
        ``prefill_tokens_computed``, ``max_<gauge>``), ``kv_imbalance_mean`` / ``kv_imbalance_max`` and
        ``replica_timeline`` (per reading: ``t_s`` and each gauge as a list over replicas, ``None`` where a replica
        did not answer). A replica lost mid-run counts up to its last answered reading."""
        first = self.readings[0]["replicas"]
        replicas = []
        for i, url in enumerate(self.urls):
            row: dict = {"url": url}
            answered = [r["replicas"][i] for r in self.readings if r["replicas"][i]["up"]]
            row["lost"] = not self.readings[-1]["replicas"][i]["up"]
            for key in COUNTERS:  # counts of requests and tokens: whole numbers
                row[key] = round(answered[-1][key] - first[i][key])
            q, h = row["prefix_cache_queries"], row["prefix_cache_hits"]
            row["prefix_cache_hit_rate"] = h / q if q else None
            row["prefill_tokens_computed"] = row["prompt_tokens"] - h
            for key in GAUGES:
                seen = [r["replicas"][i][key] for r in self.readings if r["replicas"][i][key] is not None]
                row[f"max_{key}"] = max(seen) if seen else None
            replicas.append(row)
        ratios = [kv_imbalance([r["kv_cache_usage"] for r in reading["replicas"]]) for reading in self.readings]
        timeline = [
            {"t_s": reading["t_s"]} | {key: [r[key] for r in reading["replicas"]] for key in GAUGES}
            for reading in self.readings
        ]
        return {
            "replicas": replicas,
            "kv_imbalance_mean": sum(ratios) / len(ratios),
            "kv_imbalance_max": max(ratios),
            "replica_timeline": timeline,
        }


__all__ = ["COUNTERS", "GAUGES", "ReplicaMonitor", "kv_imbalance", "read_replica"]
