"""Replicas of ``workbench serve`` behind vLLM's router (``vllm-router``), all on loopback, stopped by PID.

Data parallelism as deployments run it: several replicas, each its own engine and KV pool, and a router in
front that picks a replica per request by its policy (``round_robin``, ``random``, ``power_of_two``,
``cache_aware``, ``consistent_hash``, ``kv_aware``, ``sticky_least_loaded``). With ``kv_aware`` each replica
publishes its KV-cache events (``--kv-events-config``, :mod:`workbench.kv.events`) on a loopback port and the
router subscribes to them, so it knows which replica holds which prefix::

    from workbench.server.replicas import Replicas
    with Replicas(2, policy="kv_aware", max_model_len=1024) as rs:   # free ports on 127.0.0.1
        print(rs.base_url)                                            # the router: http://127.0.0.1:PORT
        ...                                                           # openai.OpenAI(base_url=rs.base_url + "/v1")
    # stopped: the router, then every replica (SIGTERM, then SIGKILL), also when the block raises
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from workbench.server.launcher import ServerProcess, free_port, stop_process, wait_until_healthy

#: the router's policies (``vllm-router --policy``)
ROUTER_POLICIES = (
    "round_robin",
    "random",
    "power_of_two",
    "cache_aware",
    "consistent_hash",
    "kv_aware",
    "sticky_least_loaded",
)


def router_binary() -> str:
    """The ``vllm-router`` command (beside this Python, or on ``PATH``).

    Raises:
        RuntimeError: not installed (the message gives the ``pip install``)."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if not found:
        raise RuntimeError("vllm-router is not installed: pip install vllm-router (vLLM's router, a Rust binary)")
    return found


class RouterProcess:
    """``vllm-router`` in a child process on loopback, in front of ``worker_urls``.

    Args:
        worker_urls: the replicas' base URLs.
        policy: one of :data:`ROUTER_POLICIES`.
        kv_event_sources: ``{worker_url: zmq_endpoint}`` for ``kv_aware`` (the replicas' KV-event publishers).
        block_size: the replicas' ``block_size`` (``--kv-event-block-size``).
        model: the served model name (``--kv-event-model``).
        port: the router's port (default: a free one); its Prometheus exporter gets another free port.
        startup_timeout: seconds to wait for the router's ``/health``.
        extra_args: more ``vllm-router`` arguments.

    Raises:
        ValueError: an unknown policy, or ``kv_aware`` without event sources.
        RuntimeError: (on start) not installed, exited, or no answer within ``startup_timeout`` (with its log).
    """

    def __init__(
        self,
        worker_urls: list[str],
        policy: str = "round_robin",
        kv_event_sources: dict[str, str] | None = None,
        block_size: int = 16,
        model: str | None = None,
        port: int | None = None,
        startup_timeout: float = 120.0,
        extra_args: list[str] | None = None,
    ) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy={policy!r} is not one of the router's: {', '.join(ROUTER_POLICIES)}")
        if policy == "kv_aware" and not kv_event_sources:
            raise ValueError("policy='kv_aware' needs the replicas' KV-event endpoints (kv_event_sources)")
        if kv_event_sources and policy != "kv_aware":
            raise ValueError(f"kv_event_sources are read only by policy='kv_aware', not {policy!r}: leave them out")
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.policy, self.startup_timeout = policy, startup_timeout
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--prometheus-port", str(self.metrics_port)]
        args += ["--worker-urls", *worker_urls, "--policy", policy]
        for url, endpoint in (kv_event_sources or {}).items():
            args += ["--kv-event-source", f"{url}={endpoint}"]
        if kv_event_sources:
            args += ["--kv-event-block-size", str(block_size)]
            if model:
                args += ["--kv-event-model", model]
        self.args = args + list(extra_args or [])
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """The router's own Prometheus metrics (``vllm_router_*``)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def start(self) -> RouterProcess:
        fd, name = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [router_binary(), *self.args], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_COLOR": "1"}
            )
        try:
            wait_until_healthy(self.proc, self.base_url + "/health", self.startup_timeout, "vllm-router", self.log_tail)
        except RuntimeError:
            self.stop()
            raise
        return self

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code."""
        return stop_process(self.proc, timeout)

    def __enter__(self) -> RouterProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class Replicas:
    """``n`` replicas of ``workbench serve`` (started side by side) and the router in front of them.

    Args:
        n: replicas (each its own engine and KV pool).
        policy: the router's policy (:data:`ROUTER_POLICIES`).
        kv_events: each replica publishes its KV-cache events on a free loopback port (always with ``kv_aware``;
            turns prefix caching on).
        threads: ``OMP_NUM_THREADS`` of each replica (default: the machine's cores shared out, at least 1).
        router_args: more ``vllm-router`` arguments.
        **engine_args: every replica's engine arguments (as :class:`~workbench.server.launcher.ServerProcess`).

    Raises:
        RuntimeError: (on start) a replica or the router did not come up; everything started is stopped.
    """

    def __init__(
        self,
        n: int = 2,
        policy: str = "round_robin",
        kv_events: bool = False,
        threads: int | None = None,
        router_args: list[str] | None = None,
        **engine_args,
    ) -> None:
        if n < 1:
            raise ValueError(f"n={n} replicas: give at least 1")
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"policy={policy!r} is not one of the router's: {', '.join(ROUTER_POLICIES)}")
        self.kv_events = kv_events or policy == "kv_aware"
        if self.kv_events:
            engine_args["enable_prefix_caching"] = True
        self.block_size = engine_args.get("block_size", 16)
        from workbench.config import DEFAULT_MODEL

        # the served name, as workbench serve picks it (--kv-event-model: the router's identity of the model)
        self.model_name = engine_args.get("served_model_name") or engine_args.get("model", DEFAULT_MODEL)
        threads = threads or max(1, (os.cpu_count() or 1) // n)
        self.event_endpoints: list[str | None] = []
        self.servers: list[ServerProcess] = []
        for _ in range(n):
            args = dict(engine_args)
            endpoint = None
            if self.kv_events:
                endpoint = f"tcp://127.0.0.1:{free_port()}"
                args["kv_events_config"] = json.dumps({"enable_kv_cache_events": True, "endpoint": endpoint})
            self.event_endpoints.append(endpoint)
            self.servers.append(ServerProcess(threads=threads, **args))
        self.policy, self.router_args = policy, router_args
        self.router: RouterProcess | None = None

    @property
    def urls(self) -> list[str]:
        """The replicas' base URLs."""
        return [s.base_url for s in self.servers]

    @property
    def base_url(self) -> str:
        """The router's base URL: where clients send requests."""
        return self.router.base_url

    @property
    def pids(self) -> dict[str, int | None]:
        """Every process's PID by name: ``replica-<i>`` and ``router`` (``ps`` names the router ``vllm::router``);
        ``None`` for one not started."""
        out = {f"replica-{i}": s.pid for i, s in enumerate(self.servers)}
        out["router"] = self.router.proc.pid if self.router is not None and self.router.proc else None
        return out

    def start(self) -> Replicas:
        try:
            for s in self.servers:
                s.launch()
            for s in self.servers:
                s.wait_ready()
            self.router = self.router_process(self.policy, self.router_args).start()
        except BaseException:
            self.stop()
            raise
        return self

    def router_process(self, policy: str, extra_args: list[str] | None = None) -> RouterProcess:
        """A router (not started) in front of these replicas with ``policy``, subscribed to their KV-cache events
        with ``kv_aware`` (the router refuses event sources with any other policy): another policy over the same
        replicas, e.g. to compare policies on one workload (``with replicas.router_process("cache_aware") as r:``)."""
        sources = dict(zip(self.urls, self.event_endpoints)) if self.kv_events and policy == "kv_aware" else None
        return RouterProcess(self.urls, policy, sources, self.block_size, self.model_name, extra_args=extra_args)

    def kill(self, i: int) -> int | None:
        """Lose replica ``i`` as a crashed host loses it: SIGKILL by its PID, no graceful drain; its exit code.
        The router is not told: it finds out from failed requests (retries, circuit breaker) and health checks."""
        return self.servers[i].stop(signal.SIGKILL)

    def stop(self) -> None:
        """Stop the router, then every replica (each by its PID)."""
        if self.router is not None:
            self.router.stop()
        for s in self.servers:
            s.stop()

    def __enter__(self) -> Replicas:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["ROUTER_POLICIES", "Replicas", "RouterProcess", "router_binary"]
