"""``AsyncLLM``: the engine behind ``async generate(...)``, as vLLM's ``AsyncLLM`` (``AsyncLLMEngine``)
(vllm/v1/engine/async_llm.py). The HTTP server (:mod:`workbench.server`) is built on it, and a notebook
can use it directly::

    from workbench import AsyncLLM, SamplingParams
    engine = AsyncLLM(max_model_len=1024)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text, end="")
    engine.shutdown()

One background thread builds and owns the :class:`~workbench.engine.LLMEngine`: it takes new requests and aborts
from a queue, steps while any request is unfinished and sleeps otherwise, and hands each step's
outputs to the asyncio queues of their callers (one ``call_soon_threadsafe`` per event loop and step). Requests stream as ``DELTA`` outputs (only what is new
since the previous one); the last has ``finished=True``. vLLM runs its engine core in another process;
one thread is enough here because the model's matmuls release the GIL and the HTTP side is light.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace

from workbench.config import EngineConfig
from workbench.engine import LLMEngine
from workbench.inputs import Prompt
from workbench.metrics import Recorder
from workbench.outputs import RequestOutput
from workbench.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("workbench")


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an error (e.g. a tensor-parallel worker died); no request can run."""


class _Stream:
    """One request's outputs on their way from the engine thread to its caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:  # from the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def _put_all(items: list) -> None:
    """(On a caller's event loop) hand each ``(queue, output)`` of one engine step to its queue."""
    for q, item in items:
        q.put_nowait(item)


class AsyncLLM:
    """An :class:`~workbench.engine.LLMEngine` stepped by a background thread, with ``async generate``.

    Args:
        model: see :class:`~workbench.config.EngineConfig` (default: the bundled SmolLM2-135M-Instruct).
        recorder: receives every StepStats and request record (default: one that keeps the last
            ``history`` of each, so that a long-running server's memory stays flat).
        history: steps and request records kept by the default recorder.
        check_invariants: check the KV manager's invariants after every step (slow; the soak test
            uses it); default: environment variable ``WORKBENCH_CHECK_INVARIANTS=1``. A violation stops
            the engine loop (:attr:`on_dead`; ``workbench serve`` then exits non-zero).
        **engine_args: any :class:`EngineConfig` field, with vLLM's names.

    Raises:
        ValueError / FileNotFoundError: a bad engine argument, before the model loads.
    """

    def __init__(
        self,
        model: str | None = None,
        recorder: Recorder | None = None,
        history: int = 10_000,
        check_invariants: bool | None = None,
        **engine_args,
    ):
        if model is not None:
            engine_args["model"] = model
        unknown = set(engine_args) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown engine argument(s) {sorted(unknown)}; see workbench.EngineConfig")
        config = EngineConfig(**engine_args)  # bad arguments raise here, in the caller
        if check_invariants is None:
            check_invariants = os.environ.get("WORKBENCH_CHECK_INVARIANTS") == "1"
        self.check_invariants = check_invariants
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stopping = False
        self.dead: BaseException | None = None  #: the error that stopped the engine loop, if any
        #: called with that error, on the engine thread, once the loop has stopped on it (the server exits)
        self.on_dead: list = []
        self._beat = time.monotonic()  # the engine loop's last sign of life
        # The engine is built on the thread that will step it (see _build_and_loop); the caller waits.
        self.engine: LLMEngine | None = None
        built = threading.Event()
        failed: list[BaseException] = []
        self._thread = threading.Thread(
            target=self._build_and_loop,
            args=(config, recorder or Recorder(history=history), built, failed),
            name="workbench-engine",
            daemon=True,
        )
        self._thread.start()
        try:
            while not built.wait(0.2):  # (a short wait, so that Ctrl-C reaches the caller)
                pass
        except BaseException:
            self._stopping = True  # the thread stops once the engine is built
            raise
        if failed:
            self._thread.join()
            raise failed[0]

    # ------------------------------------------------------------------ caller side
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    def stalled_s(self) -> float:
        """Seconds since the engine loop last made progress (a step, or a look at an empty queue);
        0 while it is idle. A step never takes minutes, so a large value means a wedged engine."""
        return time.monotonic() - self._beat

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        tokenized: tuple[list[int], str | None] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue one request and yield its outputs as they come (``DELTA``: each carries only the new
        text and tokens; ``sampling_params.output_kind`` may ask for ``CUMULATIVE`` or ``FINAL_ONLY``).
        Leaving the loop early (``break``, a cancelled task, a client that disconnected) aborts the
        request and frees its KV blocks.

        Raises:
            ValueError: the prompt or parameters are invalid, or the id is in use (before anything is queued).
            EngineDeadError: the engine loop stopped on an error.
        """
        if self.dead is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running ({self.dead or 'shut down'})")
        sp = sampling_params or SamplingParams()
        final_only = sp.output_kind == RequestOutputKind.FINAL_ONLY  # merged here from deltas
        if sp.output_kind in (None, RequestOutputKind.FINAL_ONLY):
            sp = replace(sp, output_kind=RequestOutputKind.DELTA)
        request_id = request_id or uuid.uuid4().hex
        if tokenized is None:
            tokenized = self.engine.tokenize(prompt)  # bad prompts raise here, in the caller
        stream = _Stream(asyncio.get_running_loop())
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running; use a unique id")
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt, sp, priority, tokenized))
        self._wake.set()
        finished = False
        merged: RequestOutput | None = None
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if final_only:
                    merged = _merge(merged, item)
                    if finished:
                        yield merged
                else:
                    yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort_nowait(request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort a request (its blocks are freed at the engine's next step); thread-safe, no-op when unknown."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def running_ids(self) -> list[str]:
        """Ids of the requests that have a caller now."""
        return list(self._streams)

    def abort_all(self) -> None:
        """Abort every request with a caller (thread-safe); each stream ends with ``finish_reason="abort"``."""
        for rid in list(self._streams):
            self.abort_nowait(rid)

    async def abort(self, request_id: str) -> None:
        """Abort a request, as vLLM's ``AsyncLLM.abort``."""
        self.abort_nowait(request_id)

    def call(self, fn, timeout: float = 30.0):
        """Run ``fn(engine)`` on the engine thread between steps and return its result (e.g. to read
        the KV manager's state consistently); raises what ``fn`` raises."""
        done = threading.Event()
        box: list = [None, None]
        self._inbox.put(("call", fn, box, done))
        self._wake.set()
        if not done.wait(timeout):
            raise TimeoutError(f"the engine thread did not answer within {timeout} s")
        if box[1] is not None:
            raise box[1]
        return box[0]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request, stop the engine thread, and stop tensor-parallel workers (idempotent)."""
        if not self._stopping:
            self._stopping = True
            self._wake.set()
            self._thread.join(timeout)
        self.engine.shutdown()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ engine thread
    def _build_and_loop(self, config: EngineConfig, recorder: Recorder, built: threading.Event, failed: list) -> None:
        """Build the engine (weights, KV pool, profiling) on this thread, then run :meth:`_loop`.

        Why here and not in the caller: GNU OpenMP, which runs torch's intra-op work, keeps one team of
        worker threads for every thread that has started a parallel region, and once its threads outnumber
        the CPUs it cuts the spin of a waiting worker to almost nothing. Had the caller loaded the model,
        its team would stay beside this thread's, the count would pass the CPUs (on two cores: two
        masters and two workers), and every small op of a step would wait for a sleeping worker to wake
        (:mod:`workbench.omp_wait`). Built here, a caller that never ran torch itself (``workbench
        serve``'s main thread) starts no team, and the steps run as fast as offline ``LLM.generate``.
        """
        try:
            self.engine = LLMEngine(config, recorder=recorder)
        except BaseException as e:  # handed to the caller, as if raised there
            failed.append(e)
            built.set()
            return
        built.set()
        if self._stopping:  # the caller was interrupted while the engine loaded
            self.engine.shutdown()
            return
        self._loop()

    def _loop(self) -> None:
        eng = self.engine
        check_alive = getattr(eng.executor, "check_alive", None)
        try:
            while not self._stopping:
                self._beat = time.monotonic()
                self._drain_inbox()
                if not eng.has_unfinished_requests():
                    if check_alive is not None:
                        check_alive()  # a dead tensor-parallel worker stops the loop while idle too
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                self._deliver(eng.step())
                if self.check_invariants:
                    eng.kv.check_invariants()
            for rid in list(eng.groups):  # shutting down: every request ends as aborted
                eng.abort(rid)
            while eng.has_unfinished_requests():
                self._deliver(eng.step())
        except BaseException as e:  # a worker died, a bug no request can be blamed for: every caller learns why
            self.dead = e
            log.exception("the engine loop stopped")
            for stream in list(self._streams.values()):
                stream.put(EngineDeadError(f"the engine loop stopped: {e}"))
            for fn in self.on_dead:
                fn(e)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand one step's outputs to their callers: one ``call_soon_threadsafe`` per event loop for the
        whole step (not one per output), so that a step of 64 streams wakes the loop once and the engine
        thread makes one self-pipe write, not 64."""
        by_loop: dict = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_inbox(self) -> None:
        eng = self.engine
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, sp, priority, tokenized = cmd
                try:
                    eng.add_request(rid, prompt, sp, tokenized=tokenized, priority=priority)
                except Exception as e:  # refused: only this request's caller learns why
                    if not isinstance(e, (ValueError, TypeError)):
                        log.exception("request %s could not be added", rid)
                        e = ValueError(f"the request could not be added: {type(e).__name__}: {e}")
                    stream = self._streams.get(rid)
                    if stream is not None:
                        stream.put(e)
            elif cmd[0] == "abort":
                eng.abort(cmd[1])
            elif cmd[0] == "call":
                _, fn, box, done = cmd
                try:
                    box[0] = fn(eng)
                except Exception as e:  # handed to the caller
                    box[1] = e
                done.set()


def _merge(acc: RequestOutput | None, new: RequestOutput) -> RequestOutput:
    """Fold a ``DELTA`` output into the one accumulated so far (a ``FINAL_ONLY`` caller's result)."""
    if acc is None:
        acc = replace(new, outputs=[])
    by_index = {c.index: c for c in acc.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            by_index[c.index] = replace(c, token_ids=list(c.token_ids), logprobs=list(c.logprobs or []) or None)
            continue
        old.text += c.text
        old.token_ids += c.token_ids
        if c.logprobs:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
        old.cumulative_logprob = c.cumulative_logprob
    acc.outputs = [by_index[i] for i in sorted(by_index)]
    acc.finished, acc.error, acc.metrics = new.finished, new.error, new.metrics
    return acc


#: vLLM's older name
AsyncLLMEngine = AsyncLLM

__all__ = ["AsyncLLM", "AsyncLLMEngine", "EngineDeadError"]
