"""Tensor parallelism over ``torch.distributed``: worker processes, each holding one shard.

The engine's process is rank 0: it runs the scheduler and the KV-cache manager, lays out
each step's inputs (:func:`~workbench.executor.local.prepare_inputs`) and sends them to
ranks 1..N-1, then runs its own shard. Every rank holds its slice of the weights
(:mod:`workbench.model.parallel`) and of the KV cache — its KV heads only — and computes
the same step; the row-parallel layers all-reduce, the LM head gathers the logits, so
every rank ends the step with the same ``[num_sampling, vocab]`` logits and rank 0 samples.

Processes and groups:

* launched by the engine: ``torch.multiprocessing`` with the ``spawn`` start method (a
  fresh interpreter per worker; the calling script needs the usual
  ``if __name__ == "__main__":`` guard), rendezvous over TCP on a free local port;
* launched by ``torchrun``: every process runs ``python -m workbench.entrypoints.torchrun``
  (see :func:`main`); rank 0 builds the engine, the others serve it (``RANK`` /
  ``WORLD_SIZE`` / ``MASTER_ADDR`` from the environment);
* the compute group uses gloo on CPU and NCCL on CUDA, with ``distributed_timeout_s`` on every
  collective; step messages travel on a separate gloo group (pickled, length first) whose
  timeout is long, so an idle engine does not time its workers out;
* a spawned worker has ``LOAD_TIMEOUT_S`` (or ``distributed_timeout_s`` if longer) to start, and after
  loading their shards the ranks meet on that group (``monitored_barrier``, the same timeout), so
  starting a Python process and loading, whose times differ by rank and by how busy the machine is,
  never count against a collective's timeout (vLLM likewise waits minutes for its engine to be ready).

Failure behaviour: a spawned worker first tells rank 0 over a pipe that it has bootstrapped;
one that dies before (a script without the ``__main__`` guard, for one) fails the engine at
once, with a message naming the guard, instead of leaving rank 0 in the rendezvous for
``distributed_timeout_s``. After that a watchdog thread in rank 0 polls the workers; when one exits it kills
the others, so the collective rank 0 is in fails at once (gloo reports the closed
connection); a worker that hangs makes rank 0's next collective time out after
``distributed_timeout_s``. Either way the engine raises :class:`TensorParallelError` naming
the rank and exit code and reaps every worker. Workers exit when rank 0's process goes away
(they watch their parent). :meth:`TensorParallelExecutor.shutdown` (also at garbage
collection and interpreter exit) stops and reaps them and destroys the process group, so an
engine can be built again in the same process (one tensor-parallel engine at a time).

Communication buffers (the memory budget's ``comm_buffer_bytes``): on CUDA measured — free
device memory (``torch.cuda.mem_get_info``) before and after the group's first collectives,
the largest over the ranks; elsewhere modelled by :func:`workbench.comm.nccl_buffer_bytes`
from the ``NCCL_*`` options (what the same group would take on GPUs).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from workbench.comm import CommStats, Timed, nccl_buffer_bytes
from workbench.executor.local import ModelExecutor, ModelInput, ModelRunner
from workbench.model.loader import build_model
from workbench.model.parallel import TensorParallelGroup, check_tensor_parallel

log = logging.getLogger("workbench")

#: Timeout of the step-message group: workers wait on it while the engine is idle.
CONTROL_TIMEOUT = timedelta(days=7)
#: how long rank 0 waits for a spawned worker to start, and the ranks for each other to finish loading their shards
#: (seconds; at least distributed_timeout_s)
LOAD_TIMEOUT_S = 600.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker died, hung past the timeout, or failed; the group is shut down."""


def nccl_env(config) -> dict[str, str]:
    """The ``NCCL_*`` environment variables an :class:`~workbench.config.EngineConfig` sets
    (``nccl_buffsize``, ``nccl_min_nchannels``, ``nccl_max_nchannels``, ``nccl_proto``)."""
    pairs = {
        "NCCL_BUFFSIZE": config.nccl_buffsize,
        "NCCL_MIN_NCHANNELS": config.nccl_min_nchannels,
        "NCCL_MAX_NCHANNELS": config.nccl_max_nchannels,
        "NCCL_PROTO": config.nccl_proto,
    }
    return {k: str(v) for k, v in pairs.items() if v is not None}


def modelled_comm_buffer_bytes(config, world_size: int) -> int:
    """Per-rank NCCL buffer bytes the model predicts for this config's ``NCCL_*`` options."""
    return nccl_buffer_bytes(
        world_size,
        buffsize=config.nccl_buffsize,
        nchannels=None,
        protocols=config.nccl_proto,
        min_nchannels=config.nccl_min_nchannels,
        max_nchannels=config.nccl_max_nchannels,
    ).per_rank_bytes


def _move(obj, device):
    """``obj`` with every tensor inside (dataclasses, lists, tuples, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(
            obj, **{f.name: _move(getattr(obj, f.name), device) for f in dataclasses.fields(obj)}
        )
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def _broadcast(t: torch.Tensor, group, timeout: timedelta) -> None:
    """Rank 0's broadcast on the step-message group, with its own timeout (the group's is long:
    the receivers wait through idle time; the sender must not wait on a hung worker)."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    group.broadcast([t], opts).wait()


def _send(msg, group, stats: CommStats | None, timeout: timedelta) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    n = torch.tensor([len(data)], dtype=torch.int64)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if stats is None:
        _broadcast(n, group, timeout)
        _broadcast(buf, group, timeout)
        return
    with Timed(stats, "broadcast_bytes", len(data) + 8, torch.device("cpu")):
        _broadcast(n, group, timeout)
        _broadcast(buf, group, timeout)
    stats.num_collectives += 1  # two broadcasts: the length, then the message


def _recv(group):
    n = torch.empty(1, dtype=torch.int64)
    dist.broadcast(n, 0, group=group)
    buf = torch.empty(int(n.item()), dtype=torch.uint8)
    dist.broadcast(buf, 0, group=group)
    return pickle.loads(buf.numpy().tobytes())


class _Rank:
    """One rank's shard and its local cache; executes the step messages."""

    def __init__(self, rank: int, world_size: int, setup: dict, ctrl) -> None:
        self.device = _rank_device(setup["device"], rank)
        self.tp = TensorParallelGroup(rank, world_size, None, self.device)
        self.model = build_model(
            setup["hf_config"], setup["state_dict"], setup["max_model_len"], setup["dtype"], self.device, self.tp
        )
        # Loading a shard is not a collective: ranks finish at different times (rank 0 has the weights in
        # memory, the others read the checkpoint). Meet on the control group, with a loading timeout, so
        # the first collective below is not charged with another rank's loading time.
        dist.monitored_barrier(group=ctrl, timeout=timedelta(seconds=max(LOAD_TIMEOUT_S, setup["timeout_s"])))
        self.local: ModelRunner | None = None
        self.comm_buffer_bytes = self._first_collectives(setup["hf_config"].hidden_size, setup["dtype"])

    def _first_collectives(self, hidden: int, dtype) -> int | None:
        """Run the group's first collectives (an all-reduce and an all-gather of a hidden-sized
        row) and return the device memory they took outside PyTorch's allocator (free device memory
        before minus after, less the growth of ``torch.cuda.memory_reserved``), largest over the
        ranks (CUDA), else ``None``."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free0 = torch.cuda.mem_get_info(self.device)[0]
            reserved0 = torch.cuda.memory_reserved(self.device)
        x = torch.ones(hidden, dtype=dtype, device=self.device)
        dist.all_reduce(x)
        dist.all_gather([torch.empty_like(x) for _ in range(self.tp.world_size)], x)
        if not cuda:
            return None
        torch.cuda.synchronize(self.device)
        grown = torch.cuda.memory_reserved(self.device) - reserved0
        used = torch.tensor([max(0, free0 - torch.cuda.mem_get_info(self.device)[0] - grown)], device=self.device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        return int(used.item())

    def handle(self, msg):
        op = msg[0]
        if op == "execute":
            _, ids, pos, meta, idx = _move(msg, self.device)
            return self.local.execute_model(ModelInput(ids, pos, meta, idx, []))
        if op == "copy":
            return self.local.copy_blocks(*msg[1:])
        if op == "init_cache":
            num_blocks, block_size, kv_dtype, num_cpu_blocks, backend = msg[1:]
            self.local = ModelRunner(self.model, num_blocks, block_size, kv_dtype, self.device, num_cpu_blocks, backend)
            return None
        if op == "profile":
            from workbench.memory import profile_activation_peak

            peak = torch.tensor([profile_activation_peak(self.model, *msg[1:])], device=self.device)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            return int(peak.item())
        raise ValueError(f"unknown tensor-parallel op {op!r}")


def _rank_device(device, rank: int) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def _tracker_running() -> bool:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_fd", None) is not None


def _stop_tracker() -> None:
    from multiprocessing import resource_tracker

    try:
        resource_tracker._resource_tracker._stop()  # private, present since Python 3.8; guarded
    except Exception:
        pass


def loopback_env() -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` set to the loopback interface (``lo`` on Linux),
    unless the user set them: the sockets of a one-machine group then listen on 127.0.0.1 only (Gloo
    otherwise binds the address the host name resolves to)."""
    names = [n for _, n in socket.if_nameindex() if n.startswith("lo")] if hasattr(socket, "if_nameindex") else []
    if not names:
        return {}
    return {k: names[0] for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if k not in os.environ}


def _torchrun_env() -> tuple[int, int] | None:
    """``(rank, world_size)`` when launched by torchrun (or any ``env://`` launcher), else ``None``."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


def _serve(rank: int, world_size: int, ctrl) -> None:
    """A worker's life after joining the groups: the setup message, then steps until "stop"."""
    setup = _recv(ctrl)
    if setup.get("state_dict") is None:
        from workbench.model.loader import load_model

        cfg = setup["engine_config"]
        loaded = load_model(cfg.model, cfg.resolved_cache_dir, cfg.tokenizer)
        setup["state_dict"] = loaded.state_dict
    rank_state = _Rank(rank, world_size, setup, ctrl)
    del setup
    while True:
        msg = _recv(ctrl)
        if msg[0] == "stop":
            return
        rank_state.handle(msg)


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:  # the engine's process is gone: nobody will stop us
            os._exit(3)
        time.sleep(0.5)


def check_not_bootstrapping() -> None:
    """Refuse to start a tensor-parallel group from a spawned process that is still importing its
    parent's main module: the parent script builds the engine at module level, without the
    ``if __name__ == "__main__":`` guard, and this process is one of its workers re-running it.

    Raises:
        TensorParallelError: in that case, naming the guard (the parent reports the same).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # what spawn itself checks
        raise TensorParallelError(
            "this process is a tensor-parallel worker that is re-running the script which started the engine "
            "(spawn imports the main module again), and that script builds the engine at module level. Put that "
            'code under if __name__ == "__main__": (Python docs, multiprocessing: "Safe importing of main module").'
        )


def _bootstrap_hint() -> str:
    """Why a spawned worker may die before it starts, when the engine's process runs a script."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path or getattr(sys, "ps1", None) is not None:
        return " Its traceback is printed on stderr."
    return (
        f" Its traceback is printed on stderr. A spawned worker is a fresh interpreter that re-runs the script "
        f"that started the engine ({os.path.basename(path)}); if that script builds the engine at module level, "
        f'each worker tries to start workers of its own and dies. Put that code under if __name__ == "__main__": '
        f'(Python docs, multiprocessing: "Safe importing of main module").'
    )


def _worker_main(rank: int, world_size: int, spec: dict, ready=None) -> None:
    """Entry of a spawned worker (module level: ``spawn`` pickles it by name). ``ready``: the pipe on
    which it tells rank 0 that it has bootstrapped (see ``TensorParallelExecutor._await_workers``)."""
    if ready is not None:
        ready.send(os.getpid())
        ready.close()
    os.environ.update(spec["env"])
    threading.Thread(target=_watch_parent, args=(spec["parent_pid"],), daemon=True).start()
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    code = 0
    try:
        timeout = timedelta(seconds=spec["timeout_s"])
        dist.init_process_group(
            spec["backend"], init_method=spec["init_method"], rank=rank, world_size=world_size, timeout=timeout
        )
        ctrl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        _serve(rank, world_size, ctrl)
    except Exception:
        traceback.print_exc()
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Runtime:
    """What must be torn down, kept apart from the executor so that a finalizer can reach it."""

    def __init__(self) -> None:
        self.procs: list = []
        self.failure: str | None = None
        self.closed = False
        self.stop = threading.Event()
        self.ctrl = None
        self.saved_threads: int | None = None
        self.saved_env: dict[str, str | None] = {}
        self.lock = threading.Lock()
        self.store_dir: str | None = None  #: the rendezvous file's folder (spawned workers)
        #: whether multiprocessing's resource tracker (a helper process ``spawn`` starts) ran before us
        self.tracker_was_running = _tracker_running()

    def watch(self) -> None:
        while not self.stop.wait(0.1):
            for rank, p in enumerate(self.procs, start=1):
                if p.exitcode is not None:
                    with self.lock:
                        if self.closed or self.stop.is_set():
                            return
                        self.failure = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    log.error("%s; stopping the other workers", self.failure)
                    self.kill_all()
                    return

    def kill_all(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)

    def close(self, graceful: bool = True) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.stop.set()
        if graceful and self.failure is None and self.ctrl is not None:
            try:
                _send(("stop",), self.ctrl, None, timedelta(seconds=5))
            except Exception:  # a worker already gone
                pass
        if graceful:  # the workers got "stop": give them a moment to leave the group cleanly
            deadline = time.monotonic() + 5
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill_all()
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
        if not self.tracker_was_running and self.procs and not multiprocessing.active_children():
            _stop_tracker()  # started for our workers: stop it too, so that no process is left
        if self.store_dir is not None:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        if self.saved_threads is not None:
            torch.set_num_threads(self.saved_threads)
        for k, v in self.saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TensorParallelExecutor(ModelExecutor):
    """Rank 0 of a tensor-parallel group, in the engine's process (see the module docstring).

    Args:
        config: the engine's :class:`~workbench.config.EngineConfig` (``tensor_parallel_size``,
            ``device``, ``dtype``, ``distributed_timeout_s``, ``nccl_*``); the model's files are
            read here, the workers start in :meth:`load_model`.
        world_size: ranks; ``None`` = ``config.tensor_parallel_size`` (1 gives a one-rank group,
            e.g. to measure a single NCCL communicator).

    Attributes:
        model: rank 0's shard (:class:`~workbench.model.llama.LlamaForCausalLM`).
        stats: rank 0's cumulative :class:`~workbench.comm.CommStats`.
        comm_buffer_bytes: per-rank communication buffers (bytes), ``comm_buffer_source`` says
            whether ``"measured (cuda)"`` or ``"modelled (NCCL)"``.
        worker_pids: process ids of ranks 1..N-1 (spawned workers; empty under torchrun).

    Raises:
        ValueError: ``tensor_parallel_size`` does not split the model (names the valid sizes), or
            differs from a torchrun launch's ``WORLD_SIZE``.
        RuntimeError: another tensor-parallel engine is running in this process.
        TensorParallelError: a worker failed while starting.
    """

    def __init__(self, config, world_size: int | None = None) -> None:
        check_not_bootstrapping()  # before the weights: a worker re-running an unguarded script
        super().__init__(config)
        n = config.tensor_parallel_size if world_size is None else world_size
        check_tensor_parallel(self.hf_config, n, name=f"model={config.model!r}")
        self.world_size = n

    def load_model(self, max_model_len: int) -> None:
        """Start the workers and the process group; every rank builds its shard for ``max_model_len``."""
        config, hf_config, n = self.config, self.hf_config, self.world_size
        state_dict = self._state_dict
        del self._state_dict
        device = config.torch_device
        backend = "nccl" if device.type == "cuda" else "gloo"
        self.backend = backend
        self.timeout_s = float(config.distributed_timeout_s)
        launched = _torchrun_env()
        if launched is not None:
            rank, size = launched
            if size != n:
                raise ValueError(
                    f"tensor_parallel_size={n} but the launcher started WORLD_SIZE={size} processes; "
                    f"use --tensor-parallel-size {size} or torchrun --nproc-per-node {n}"
                )
            if rank != 0:
                raise RuntimeError(
                    f"rank {rank} must serve (workbench.executor.tensor_parallel.serve), not build an engine"
                )
        if dist.is_initialized():
            raise RuntimeError(
                "a torch.distributed process group already exists in this process (another tensor-parallel "
                "engine?); call its shutdown() (or LLM.shutdown()) before creating a new one"
            )
        rt = self._rt = _Runtime()
        self._finalizer = weakref.finalize(self, rt.close)
        env = nccl_env(config)
        if launched is None:  # our own workers, on this machine: nothing of the group listens beyond loopback
            env |= loopback_env()
        rt.saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        if device.type == "cpu":
            rt.saved_threads = torch.get_num_threads()
            threads = max(1, (os.cpu_count() or 1) // n)
            torch.set_num_threads(threads)
        else:
            threads = 0
        timeout = timedelta(seconds=self.timeout_s)
        try:
            if launched is None:
                # the rendezvous is a file (torch's FileStore), not a TCP store: TCPStore binds every interface
                rt.store_dir = tempfile.mkdtemp(prefix="workbench-tp-")
                init_method = "file://" + os.path.join(rt.store_dir, "store")
                spec = dict(
                    env=env,
                    parent_pid=os.getpid(),
                    threads=threads,
                    timeout_s=self.timeout_s,
                    backend=backend,
                    init_method=init_method,
                )
                ctx = torch.multiprocessing.get_context("spawn")
                ready = []
                for r in range(1, n):
                    recv, send = ctx.Pipe(duplex=False)
                    p = ctx.Process(target=_worker_main, args=(r, n, spec, send), daemon=True, name=f"workbench-tp-{r}")
                    p.start()
                    send.close()  # the worker holds the other copy: EOF here means it is gone
                    rt.procs.append(p)
                    ready.append(recv)
                self._await_workers(ready)
                threading.Thread(target=rt.watch, daemon=True, name="workbench-tp-watchdog").start()
                dist.init_process_group(backend, init_method=init_method, rank=0, world_size=n, timeout=timeout)
            else:
                dist.init_process_group(backend, init_method="env://", rank=0, world_size=n, timeout=timeout)
            rt.ctrl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            # workers load the checkpoint themselves: the setup message carries its name, not its tensors
            _send(
                {"engine_config": config, "state_dict": None, **self._setup(config, hf_config, max_model_len)},
                rt.ctrl,
                None,
                timeout,
            )
            self._rank = _Rank(
                0, n, {"state_dict": state_dict, **self._setup(config, hf_config, max_model_len)}, rt.ctrl
            )
        except TensorParallelError:
            raise
        except Exception as e:
            self._fail(e, "starting the tensor-parallel group")
        self.model = self._rank.model
        self.stats = self._rank.tp.stats
        self.worker_pids = [p.pid for p in rt.procs]
        if self._rank.comm_buffer_bytes is not None:
            self.comm_buffer_bytes, self.comm_buffer_source = self._rank.comm_buffer_bytes, "measured (cuda)"
        else:
            self.comm_buffer_bytes = modelled_comm_buffer_bytes(config, n)
            self.comm_buffer_source = "modelled (NCCL)"
        log.info(
            "tensor parallel: %d ranks (%s%s), communication buffers %.1f MiB per rank, %s",
            n,
            backend,
            ", torchrun" if launched else ", spawned workers",
            self.comm_buffer_bytes / 2**20,
            self.comm_buffer_source,
        )

    @staticmethod
    def _setup(config, hf_config, max_model_len) -> dict:
        return dict(
            hf_config=hf_config,
            max_model_len=max_model_len,
            dtype=config.torch_dtype,
            device=str(config.torch_device),
            timeout_s=float(config.distributed_timeout_s),
        )

    def _await_workers(self, ready: list) -> None:
        """Wait until every spawned worker has bootstrapped (it sends one message on its pipe), before
        rank 0 enters the rendezvous, which a dead worker would leave waiting for ``distributed_timeout_s``.

        Raises:
            TensorParallelError: a worker exited before it joined the group (for a script without the
                ``if __name__ == "__main__":`` guard, the message says so), or none of this within
                ``LOAD_TIMEOUT_S`` (``distributed_timeout_s`` if longer). Every worker is stopped first.
        """
        from multiprocessing.connection import wait

        rt = self._rt
        pending = dict(enumerate(zip(ready, rt.procs, strict=True), start=1))
        limit = max(LOAD_TIMEOUT_S, self.timeout_s)
        deadline = time.monotonic() + limit
        try:
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    ranks = ", ".join(f"rank {r} (pid {p.pid})" for r, (_, p) in pending.items())
                    self._refuse_start(
                        f"tensor-parallel worker {ranks} did not start within {limit:g} s; all workers were stopped. "
                        "Check that the worker processes can start (a blocked import, too little memory); "
                        "distributed_timeout_s above that extends the wait"
                    )
                wait([c for c, _ in pending.values()] + [p.sentinel for _, p in pending.values()], min(left, 1.0))
                for r, (conn, p) in list(pending.items()):
                    if conn.poll():
                        try:
                            conn.recv()
                            del pending[r]
                            continue
                        except EOFError:
                            pass
                    elif p.exitcode is None:
                        continue
                    p.join(5)
                    self._refuse_start(
                        f"tensor-parallel worker rank {r} (pid {p.pid}) exited with code {p.exitcode} "
                        f"before it joined the group; all workers were stopped.{_bootstrap_hint()}"
                    )
        finally:
            for conn in ready:
                conn.close()

    def _refuse_start(self, message: str):
        rt = self._rt
        rt.failure = message
        rt.close(graceful=False)
        raise TensorParallelError(message)

    # ------------------------------------------------------------------ failure
    def _fail(self, error: BaseException, doing: str):
        rt = self._rt
        time.sleep(0.2)  # let a worker that is dying finish, so that it can be named
        for rank, p in enumerate(rt.procs, start=1):
            if rt.failure is None and p.exitcode is not None:
                rt.failure = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
        reason = rt.failure
        rt.failure = rt.failure or str(error)
        rt.close(graceful=False)
        first = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
        detail = reason or f"{type(error).__name__}: {first}"
        raise TensorParallelError(
            f"tensor-parallel group failed while {doing}: {detail}. All workers were stopped; create a new engine "
            f"(distributed_timeout_s={self.timeout_s:g} bounds how long a hung worker is waited for)"
        ) from error

    def _run(self, msg, local, doing: str):
        rt = self._rt
        if rt.closed:
            raise TensorParallelError(
                f"the tensor-parallel group is shut down ({rt.failure or 'shutdown() was called'}); create a new engine"
            )
        try:
            _send(msg, rt.ctrl, self.stats, timedelta(seconds=self.timeout_s))
            return local()
        except Exception as e:
            self._fail(e, doing)

    # ------------------------------------------------------------------ executor interface
    def profile_activation_peak(self, num_tokens: int, max_model_len: int, max_num_seqs: int, block_size: int) -> int:
        """Peak activation bytes of one forward at ``num_tokens`` tokens, largest over the ranks
        (each rank profiles its own shard; see :func:`workbench.memory.profile_activation_peak`)."""
        msg = ("profile", num_tokens, max_model_len, max_num_seqs, block_size)
        return self._run(msg, lambda: self._rank.handle(msg), "profiling activations")

    def init_cache(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate every rank's KV cache: ``[2, num_blocks, block_size, KV heads per rank, head_dim]`` per layer."""
        c = self.config
        msg = ("init_cache", num_blocks, c.block_size, c.kv_torch_dtype, num_cpu_blocks, c.attention_backend)
        self._run(msg, lambda: self._rank.handle(msg), "allocating the KV cache")
        self.attn_backend = self._rank.local.attn_backend
        self.kv_caches = self._rank.local.kv_caches

    def execute_model(self, inp: ModelInput) -> torch.Tensor:
        """Logits ``[num_sampling, vocab_size]`` (float32) of the sampling tokens, computed by all ranks."""
        meta = dataclasses.replace(inp.meta, backend=None, extras={})
        msg = _move(("execute", inp.input_ids, inp.positions, meta, inp.logits_indices), "cpu")
        return self._run(msg, lambda: self._rank.local.execute_model(inp), "running a step")

    def copy_blocks(self, swap_out, copies, swap_in) -> None:
        """Block copies (swap out, copy-on-write, swap in) on every rank's cache."""
        msg = ("copy", swap_out, copies, swap_in)
        self._run(msg, lambda: self._rank.local.copy_blocks(swap_out, copies, swap_in), "copying blocks")

    def shutdown(self) -> None:
        """Stop and reap the workers, destroy the process group (idempotent)."""
        if hasattr(self, "_rt"):  # no workers before load_model
            self._rt.close()

    @property
    def is_alive(self) -> bool:
        return hasattr(self, "_rt") and not self._rt.closed

    def check_alive(self) -> None:
        """Raise :class:`TensorParallelError` when a worker has exited (the watchdog then stopped the
        others): an idle engine learns it without waiting for its next step."""
        rt = getattr(self, "_rt", None)
        if rt is not None and rt.failure is not None:
            raise TensorParallelError(f"tensor-parallel group failed: {rt.failure}; all workers were stopped")


# ---------------------------------------------------------------------- torchrun entry
def serve() -> None:
    """Body of a non-zero rank under torchrun: join the groups and serve rank 0 until it stops."""
    rank, n = _torchrun_env()
    backend = os.environ.get("WORKBENCH_TP_BACKEND", "gloo")
    if backend == "nccl":
        _rank_device("cuda", rank)
    timeout = timedelta(seconds=float(os.environ.get("WORKBENCH_TP_TIMEOUT", "120")))
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=n, timeout=timeout)
    ctrl = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    try:
        _serve(rank, n, ctrl)
    finally:
        dist.destroy_process_group()
