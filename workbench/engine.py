"""``LLMEngine`` (add_request / step / abort), in vLLM's shape: a scheduler, a KV manager and an
executor, on a clock. The offline ``LLM`` over it is in :mod:`workbench.entrypoints.llm`.

Each step (docs/architecture.md §1): the scheduler picks requests and token counts, the executor runs
them (``execute_step``: block copies, forward, sampling) and the scheduler advances them; the
step's record (:class:`~workbench.metrics.StepStats`) gets the KV pool's split from
:class:`~workbench.metrics.accounting.PoolAccounting`. The executor and the clock are the seams:
one process (:class:`~workbench.executor.local.LocalExecutor`, ``time.perf_counter``), tensor
parallel (:class:`~workbench.executor.tensor_parallel.TensorParallelExecutor`), or a cost model on
a simulated clock (:mod:`workbench.sim`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from workbench.attention.backend import auto_reason, check_backend
from workbench.config import EngineConfig
from workbench.executor import make_executor
from workbench.inputs import Prompt, check_samplable, check_true_output_len, prompt_refusal, tokenize_prompt
from workbench.kv import make_kv_manager, plugin_class
from workbench.kv.defrag import Defragmenter
from workbench.memory import MemoryBudget, resolve_lengths, swap_pool_blocks
from workbench.metrics import Recorder, request_record
from workbench.metrics.accounting import PoolAccounting, block_map
from workbench.metrics.kv_events import start_kv_events
from workbench.metrics.stats import step_stats
from workbench.output_processor import OutputProcessor
from workbench.outputs import CompletionOutput, RequestOutput
from workbench.request import Request, RequestStatus
from workbench.sample_ops import attach_logprobs
from workbench.sampling import SamplingParams
from workbench.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("workbench")


class LLMEngine:
    """The serving engine: a scheduler, a KV manager and an executor, on a clock.

    Args:
        config: the engine arguments (validated here, before the model loads).
        recorder: where StepStats and request records go (a new in-memory one by default).
        executor: runs each step (default: :func:`make_executor`'s, which loads ``config.model``);
            the simulator passes a cost model (:class:`workbench.sim.engine.SimulatedExecutor`).
        clock: the time source of arrivals, schedules, tokens and records, in seconds
            (default ``time.perf_counter``; the simulator passes a simulated clock).

    Raises:
        ValueError / FileNotFoundError: a bad argument (see :meth:`EngineConfig.validate`),
            or a KV pool that cannot hold one ``max_model_len`` sequence.
    """

    def __init__(
        self,
        config: EngineConfig,
        recorder: Recorder | None = None,
        executor=None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.config = config.validate()
        check_backend(config.attention_backend, config.torch_device)  # Triton installed, the device right
        if ":" in config.kv_allocator:
            plugin_class(config.kv_allocator)  # a plug-in allocator that does not load fails before the model
        self.recorder = recorder or Recorder()
        torch.manual_seed(config.seed)
        t0 = time.perf_counter()
        self.executor = ex = executor if executor is not None else make_executor(config)
        self.hf_config, self.tokenizer, self.model_folder = ex.hf_config, ex.tokenizer, ex.model_folder
        self.eos_token_id = ex.eos_token_id
        self.device = ex.device
        model_max = ex.max_position_embeddings or EngineConfig.DEFAULT_MAX_MODEL_LEN
        self.max_model_len, self.max_num_batched_tokens = resolve_lengths(config, model_max, ex.model_name)
        ex.load_model(self.max_model_len)
        self.load_time_s = time.perf_counter() - t0  #: seconds to read and build the model (and start workers)
        self.memory: MemoryBudget = ex.memory_budget(self.max_model_len, self.max_num_batched_tokens)
        log.info(config.dtype_reason)
        log.info(self.memory.summary_line())
        num_cpu_blocks = swap_pool_blocks(config, self.memory)
        ex.check_fits(self.memory, num_cpu_blocks)
        self.clock = clock or time.perf_counter
        self.kv = make_kv_manager(config, self.memory.num_blocks, num_cpu_blocks)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            scheduling_policy=config.scheduling_policy,
            preemption_mode=config.preemption_mode,
            batching_policy=config.batching_policy,
            clock=self.clock,
        )
        ex.init_cache(self.memory.num_blocks, num_cpu_blocks)
        if backend := getattr(ex, "attn_backend", None):  # what attention_backend resolved to (auto: see its table)
            why = (
                ""
                if config.attention_backend != "auto"
                else ": " + auto_reason(backend.name, ex.device, config.kv_torch_dtype)
            )
            detail = f"; {backend.detail}" if getattr(backend, "detail", "") else ""
            log.info(
                "attention backend %s (attention_backend=%s%s)%s", backend.name, config.attention_backend, why, detail
            )
        #: the KV pool's split, step by step, settled when requests release their blocks
        self.accounting = PoolAccounting(self.kv)
        self.defrag = Defragmenter.from_config(config, self.kv, self.memory.block_bytes, self.accounting)
        self.kv_event_publisher = start_kv_events(config)  # None unless kv_events_config turns events on
        self.requests: dict[str, Request] = {}  # every unfinished sequence, by its own id
        self.groups: dict[str, list[Request]] = {}  # the user's request id -> its n sequences
        self._refused: list[Request] = []
        #: text, stop strings and the outputs each request's output_kind asks for
        self.output = OutputProcessor(self.tokenizer)
        self._counter = 0
        self._step = 0
        self.start_time = self.clock()
        #: seconds to build the engine: model load, workers, the profile run, the KV cache
        self.startup_time_s = time.perf_counter() - t0

    @property
    def model(self):
        """The model (rank 0's shard under tensor parallelism)."""
        return self.executor.model

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: Prompt, add_generation_prompt: bool = True) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt (:func:`workbench.inputs.tokenize_prompt`)."""
        return tokenize_prompt(self.tokenizer, self.hf_config.vocab_size, prompt, add_generation_prompt)

    def add_request(
        self,
        request_id: str | None,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        tokenized: tuple[list[int], str | None] | None = None,
        priority: int = 0,
        true_output_len: int | None = None,
    ) -> str:
        """Queue a request; return its id.

        ``tokenized`` = the ``(token_ids, text)`` of :meth:`tokenize` when the caller already has them.
        ``priority``: lower values are served first under ``scheduling_policy="priority"``.
        ``true_output_len``: a replayed trace's output length (tokens; vLLM has no such argument, as its
        model decides): the request ends there with ``finish_reason="stop"``, as if its model had emitted
        EOS, unless ``max_tokens`` ends it first; ``orca-oracle`` / ``orca-pow2`` reserve by it (kv/contiguous.py).
        With ``sampling_params.n > 1`` the request runs as n sequences that share the prompt's
        blocks; its output (one ``RequestOutput`` with n ``outputs``) comes when all n finish.

        A prompt that can never run (longer than ``max_model_len`` allows, than the KV pool
        holds, or than the KV manager can place: ``refuse``) does not raise: the request ends at the next step with ``finish_reason="error"``
        and an error naming both numbers, and the other requests go on.

        Raises:
            ValueError: a bad prompt (:func:`workbench.inputs.tokenize_prompt`), a bad sampling parameter
                (:meth:`SamplingParams.verify`), a request id in use (also as an ``n > 1`` sequence's ``<id>#<i>``),
                or a ``true_output_len`` that is not an int >= 1; nothing is queued.
        """
        sp = sampling_params or SamplingParams()
        sp.verify()  # (also a field changed after construction)
        self.check_samplable(sp)
        check_true_output_len(true_output_len)
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(
                f"priority={priority} is given but scheduling_policy={self.config.scheduling_policy!r} ignores it; "
                "create the engine with scheduling_policy='priority'"
            )
        ids, text = tokenized if tokenized is not None else self.tokenize(prompt)
        if sp.n > 1 and not self.kv.supports_fork:
            raise ValueError(
                f"n={sp.n} (parallel sampling) shares prompt blocks, which kv_allocator={self.kv.name!r} cannot; "
                "use n=1 or kv_allocator='paged'"
            )
        if request_id is None:
            request_id = str(self._counter)
        if self._id_in_use(request_id, sp.n):
            raise ValueError(
                f"request_id {request_id!r} is already in the engine (a request's or an n > 1 sequence's '<id>#<i>'); use a unique id"
            )
        cap = self.kv.declare(request_id, len(ids), sp.max_tokens, self.max_model_len, true_output_len)
        if cap is not None:  # the reservation holds no more output than this
            sp = replace(sp, max_tokens=cap, min_tokens=min(sp.min_tokens, cap))
        arrival = self.clock() if arrival_time is None else arrival_time
        group = self._make_group(request_id, ids, text, sp, arrival, priority, true_output_len)
        error = prompt_refusal(len(ids), self.max_model_len, self.kv.pool_tokens) or self.kv.refuse(len(ids))
        if error:
            for child in group:
                child.error = error
                child.status = RequestStatus.FINISHED_ERROR
                child.finish_time = child.arrival_time
                self._refused.append(child)
        else:
            self.scheduler.add_request(group[0], group[1:])
        return request_id

    def check_samplable(self, sp: SamplingParams) -> None:
        """Refuse what this engine can never run (:func:`workbench.inputs.check_samplable`); ``ValueError``."""
        check_samplable(sp, self.config.max_num_seqs, self.hf_config.vocab_size, self.eos_token_id)

    def _id_in_use(self, request_id: str, n: int) -> bool:
        """Whether ``request_id`` (and its sequences' ``<id>#<i>`` when ``n > 1``) clashes with a request's id."""
        ids = [request_id] + [f"{request_id}#{i}" for i in range(n if n > 1 else 0)]
        return any(i in self.groups or i in self.requests for i in ids) or request_id.rpartition("#")[0] in self.groups

    def _make_group(self, request_id: str, ids, text, sp: SamplingParams, arrival: float, priority: int, true_len):
        """The request's ``n`` sequences (one unless parallel sampling), each with its random stream."""
        seed = sp.seed if sp.seed is not None else self.config.seed * 1_000_003 + self._counter
        self._counter += 1
        group = []
        for i in range(sp.n):
            child = Request(
                request_id=request_id if sp.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=ids,
                sampling_params=sp,
                arrival_time=arrival,
                prompt=text,
                eos_token_id=self.eos_token_id,
                max_total_len=self.max_model_len,
                priority=priority,
                true_output_len=true_len,
                parent_id=request_id,
                index=i,
            )
            if not sp.greedy:
                child.generator = torch.Generator(device="cpu")
                child.generator.manual_seed((seed + i) % 2**64)  # in torch's range for any valid seed
            group.append(child)
            self.requests[child.request_id] = child
            self.output.add(child)
        self.groups[request_id] = group
        return group

    def abort(self, request_id: str) -> None:
        """End a request in any state (waiting, running, swapped out), releasing everything it holds.

        No-op for an unknown or already finished request.
        """
        for req in self.groups.get(request_id, ()):
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self._refused.append(req)  # reported at the next step

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and free the process group (no-op on one device;
        idempotent; also done at garbage collection and interpreter exit) and the KV-event publisher. Use
        the engine (or :class:`LLM`) as a context manager to call it on leaving the block."""
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        self.executor.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def compact(self, max_moves: int | None = None):
        """One KV compaction pass now, between steps (admin); its ``DefragPass``, or ``None`` if nothing moved."""
        return self.defrag.compact(max_moves, lambda c: self.executor.copy_blocks([], c, []), self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._refused)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Run one iteration: schedule, execute (model and sampling), update. Returns the outputs of
        the step: finished requests, and every step's progress of ``DELTA`` / ``CUMULATIVE`` ones
        (``SamplingParams.output_kind``).

        Raises:
            TensorParallelError: (``tensor_parallel_size > 1``) a worker died, or hung past
                ``distributed_timeout_s``; every worker has been stopped and the engine is unusable.
        """
        finished: list[Request] = self._refused
        self._refused = []
        t_start = self.clock()
        out = self.scheduler.schedule()
        self.defrag.after_schedule(out, self.scheduler)  # a compaction pass's moves join the step's block copies
        t_sched = self.clock()
        if out.is_empty and self.scheduler.waiting and not self.scheduler.running:
            # cannot happen while the pool holds one max_model_len sequence (checked at startup);
            # fail loudly rather than spin
            raise RuntimeError(f"scheduler made no progress with {len(self.scheduler.waiting)} waiting requests")
        result = self.executor.execute_step(out, self.kv)
        if getattr(result, "logprobs", None) or getattr(result, "prompt_logprobs", None):
            attach_logprobs(self.requests, result, self.tokenizer)
        t_model = self.clock()
        if not out.is_empty:
            finished += self.scheduler.update(out, result.sampled, t_model)
            if result.failed:
                finished += self._fail(result.failed)
            if self.output.num_detokenizing:
                finished += self.output.stop_strings([self.requests[rid] for rid in result.sampled], self.scheduler)
        t_end = self.clock()
        if self.kv_event_publisher:  # this step's stored and evicted blocks: one batch (none if nothing changed)
            self.kv_event_publisher.publish(self.kv.take_events())
        if not out.is_empty or finished or out.preempted:
            self._record_step(out, finished, t_start, t_end, t_sched - t_start + result.overhead_s, result)
        outputs = self.output.make_outputs(self.groups, finished, result.sampled, self.start_time)
        for r in finished:
            self.requests.pop(r.request_id, None)
        for o in outputs:
            if o.finished:
                del self.groups[o.request_id]
        return outputs

    def _fail(self, failed: dict[str, str]) -> list[Request]:
        """End each request of ``failed`` (sequence id -> why) and its sibling sequences with
        ``finish_reason="error"``, releasing their blocks; the other requests go on."""
        ended = []
        for rid, why in failed.items():
            req = self.requests.get(rid)
            for seq in self.groups.get(req.parent_id, ()) if req is not None else ():
                if not seq.is_finished:
                    seq.error = why
                    self.scheduler.finish(seq, RequestStatus.FINISHED_ERROR)
                    ended.append(seq)
            log.warning("request %s ended: %s", rid, why)
        return ended

    def _record_step(self, out: SchedulerOutput, finished, t_start, t_end, sched_s, result) -> None:
        """The step's StepStats (with the KV pool's split), block map, and finished requests' records."""
        kv, scheduler = self.kv, self.scheduler
        every = self.config.block_map_every
        want_map = bool(every) and self._step % every == 0
        waiting = scheduler.waiting
        need = kv.reservation_blocks(waiting[0].request_id) if waiting else 0
        cell: list = [None]  # this step's StepStats, once built: the accounting's entries refer to it
        usage, computed = self.accounting.observe(self.requests, cell, need, want_map)
        times = (t_start - self.start_time, t_end - t_start, sched_s, result.model_time_s, result.sample_time_s)
        kv_bpt = self.memory.kv_bytes_per_token
        st = cell[0] = step_stats(self._step, times, out, scheduler, kv, kv_bpt, usage, len(finished), result)
        self._step += 1
        self.accounting.settle_released()
        if want_map:
            self.recorder.record_block_map(block_map(kv, computed, need, st.step))
        self.recorder.record_step(st)
        for r in finished:
            kv.forget(r.request_id)
            self.recorder.record_request(request_record(r, self.start_time))


__all__ = ["CompletionOutput", "LLMEngine", "RequestOutput", "make_executor", "resolve_lengths"]
