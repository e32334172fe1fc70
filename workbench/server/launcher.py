"""Start ``workbench serve`` in a child process on loopback, wait until it answers, stop it by PID.

Used by the tests, the benchmarks and the labs (a notebook cannot run a blocking server itself)::

    from workbench.server.launcher import ServerProcess
    with ServerProcess(max_model_len=1024) as srv:       # a free port on 127.0.0.1
        print(srv.base_url)                              # http://127.0.0.1:PORT
        ...                                              # openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-")
    # stopped: SIGTERM, then SIGKILL after `stop_timeout` seconds
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port nothing listens on now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_200(url: str) -> bool:
    """``GET url`` answers 200 (within 2 s)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout: float, what: str, log_tail) -> float:
    """Poll ``url`` until it answers 200; the seconds waited. ``RuntimeError`` naming ``what`` with
    ``log_tail()`` when ``proc`` exits first or ``timeout`` seconds pass (the caller stops it)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        if answers_200(url):
            return time.monotonic() - t0
        time.sleep(0.25)
    raise RuntimeError(f"{what} did not answer {url} within {timeout} s:\n{log_tail()}")


def stop_process(proc: subprocess.Popen | None, timeout: float, sig: int = signal.SIGTERM) -> int | None:
    """Send ``sig``, wait, SIGKILL after ``timeout`` seconds; the exit code (``None``: never started)."""
    if proc is None or proc.poll() is not None:
        return proc.returncode if proc else None
    proc.send_signal(sig)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(10)


class ServerProcess:
    """``workbench serve`` in a child process.

    Args:
        port: TCP port on ``host`` (default: a free one).
        host: the address to bind (default loopback only).
        startup_timeout: seconds to wait for ``GET /health`` to answer 200.
        stop_timeout: seconds between SIGTERM and SIGKILL when stopping.
        threads: ``OMP_NUM_THREADS`` of the server (default: inherited).
        env: more environment variables of the server (e.g. ``{"WORKBENCH_CHECK_INVARIANTS": "1"}``).
        extra_args: more command-line arguments (e.g. ``["-tp", "3"]``).
        log_path: where the server's output goes (default: a temporary file).
        **engine_args: engine arguments as keyword arguments (``max_model_len=512`` becomes
            ``--max-model-len 512``; ``True`` / ``False`` become ``--x`` / ``--no-x``).

    Raises:
        RuntimeError: (on start) the process exited, or did not answer within ``startup_timeout``;
            the message carries the end of its log.
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        startup_timeout: float = 180.0,
        stop_timeout: float = 20.0,
        threads: int | None = None,
        env: dict[str, str] | None = None,
        extra_args: list[str] | None = None,
        log_path: str | Path | None = None,
        **engine_args,
    ) -> None:
        self.host, self.port = host, port or free_port()
        self.startup_timeout, self.stop_timeout = startup_timeout, stop_timeout
        self.args = [sys.executable, "-m", "workbench.cli", "serve", "--host", host, "--port", str(self.port)]
        for k, v in engine_args.items():
            flag = "--" + k.replace("_", "-")
            if isinstance(v, bool):
                self.args.append(flag if v else "--no-" + flag[2:])
            elif v is not None:
                self.args += [flag, str(v)]
        self.args += list(extra_args or [])
        self.env = {**os.environ, **(env or {})}
        if threads is not None:
            self.env["OMP_NUM_THREADS"] = str(threads)
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = Path(log_path) if log_path is not None else None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> ServerProcess:
        """Start the process and wait until ``/health`` answers 200."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the process without waiting (then :meth:`wait_ready`)."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="workbench-serve-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> float:
        """Wait until ``/health`` answers 200; return the seconds waited. Raises ``RuntimeError``
        (with the end of the log) when the process exits first or ``startup_timeout`` passes."""
        try:
            return wait_until_healthy(
                self.proc, self.base_url + "/health", self.startup_timeout, "workbench serve", self.log_tail
            )
        except RuntimeError:
            self.stop()
            raise

    def healthy(self) -> bool:
        return answers_200(self.base_url + "/health")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the server's output."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        """Send ``sig`` (SIGTERM: a graceful shutdown), wait, SIGKILL after ``stop_timeout``; return the exit code."""
        return stop_process(self.proc, self.stop_timeout, sig)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


__all__ = ["ServerProcess", "answers_200", "free_port", "stop_process", "wait_until_healthy"]
