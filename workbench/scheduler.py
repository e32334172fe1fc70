"""Iteration-level continuous batching with a per-step token budget (Orca, Yu et al., OSDI 2022;
vLLM v1's scheduler, vllm/v1/core/sched/scheduler.py).

Each step, three phases share the step's ``token_budget`` (``max_num_batched_tokens``): running
requests (each gets its next tokens; when the pool cannot back them, the newest running request is
preempted), swapped-out requests coming back, and waiting requests admitted (a waiting request
never preempts). The oldest running request can always proceed (the pool holds one
``max_model_len`` sequence, checked at startup), so the loop cannot deadlock.

Baselines (``batching_policy``): ``static`` admits a batch of up to ``max_num_seqs`` waiting
requests in arrival order and no other request until every member has finished (a padded batch of
FasterTransformer or ``transformers.generate`` waits for its longest member likewise); ``grouped``
does the same with members of similar prompt length. Both run ragged batches here, without padding
tokens, so their measured gap to continuous batching is a lower bound.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.config import BATCHING_POLICIES  # noqa: F401  (values of ``batching_policy``, declared there)
from workbench.kv.interface import KVManager
from workbench.request import Request, RequestStatus


@dataclass(slots=True, init=False)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from position ``start``."""

    request: Request
    start: int
    num_new_tokens: int
    #: the request is still computing its prompt (or recomputing after preemption); fixed at scheduling
    is_prefill: bool
    #: this step reaches the request's last token, so a new token is sampled; fixed at scheduling
    samples: bool

    def __init__(self, request: Request, start: int, num_new_tokens: int, num_tokens: int | None = None) -> None:
        # one call per scheduled request per step: no __post_init__ or properties; ``num_tokens``:
        # the request's prompt + output length when the caller has it
        self.request = request
        self.start = start
        self.num_new_tokens = num_new_tokens
        if num_tokens is None:
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
        self.is_prefill = start < num_tokens - 1 or not request.output_token_ids
        self.samples = start + num_new_tokens == num_tokens


@dataclass
class SchedulerOutput:
    """What the model runs this step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    #: scheduled requests computing prompt tokens (the rest decode)
    num_prefill_reqs: int = 0
    num_decode_tokens: int = 0
    num_preempted_recompute: int = 0
    num_preempted_swap: int = 0
    #: ``(device_block, cpu_block)`` copies to make before the forward (preemption by swap)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    #: ``(cpu_block, device_block)`` copies to make before the forward (swapped requests resumed)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    #: ``(src, dst)`` device block copies (copy-on-write, then compaction), made after swap-out, before swap-in
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    #: prompt tokens looked up in the prefix cache at first admission, and those found
    #: (re-admissions after preemption are not counted)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    #: what KV compaction did this step (``workbench.kv.defrag.DefragStep``; its moves end block_copies)
    defrag: object | None = None

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching over a KV manager, through :class:`~workbench.kv.interface.KVManager` only.

    Args:
        kv: the KV manager.
        max_num_seqs: most running requests.
        max_num_batched_tokens: the token budget of one step.
        enable_chunked_prefill: split prompts to fit the budget; when off, a prompt is admitted
            only when all of it fits the step's remaining budget.
        long_prefill_token_threshold: most prompt tokens one request takes in a step (0 = no cap).
        scheduling_policy: ``"fcfs"`` (arrival order; the newest running request is the victim) or
            ``"priority"`` (lower ``Request.priority`` first, then arrival; the victim is the
            lowest-priority, newest running request), as in vLLM.
        preemption_mode: ``"recompute"`` or ``"swap"`` (see :meth:`preempt`).
        batching_policy: ``"continuous"``, ``"static"`` or ``"grouped"`` (module docstring).
        clock: the time source (seconds) of scheduled and finish times; the simulator's in :mod:`workbench.sim`.
    """

    def __init__(
        self,
        kv: KVManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        preemption_mode: str = "recompute",
        batching_policy: str = "continuous",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.kv = kv
        self.clock = clock
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.policy = scheduling_policy
        self.preemption_mode = preemption_mode
        self.batching_policy = batching_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        #: parallel-sampling siblings waiting for their first sibling's prompt, keyed by its id
        self.fork_pending: dict[str, list[Request]] = {}
        self.num_preemptions_total = 0
        self.batch: set[str] = set()  # ids of the current static / grouped batch's unfinished members
        self.num_batches = 0
        #: append each sampled token's time to ``Request.token_times`` (the ITL record; replays that keep none turn it off)
        self.record_token_times = True

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request, siblings: list[Request] = ()) -> None:
        """Queue a request; ``siblings`` (parallel sampling) start from its prompt blocks once it is prefilled."""
        self.waiting.append(request)
        if siblings:
            self.fork_pending[request.request_id] = list(siblings)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.fork_pending)

    def _key(self, r: Request):
        return (r.priority, r.arrival_time) if self.policy == "priority" else (0, r.arrival_time)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state and release everything it holds."""
        was_running = request.status == RequestStatus.RUNNING
        request.status = status
        request.finish_time = self.clock()
        self.batch.discard(request.request_id)
        self.kv.free(request.request_id)
        self.kv.drop_swapped(request.request_id)
        # a running request is only in `running`; the waiting queue can hold thousands under overload
        for q in (self.running,) if was_running else (self.running, self.waiting, self.swapped):
            if request in q:  # requests compare by identity
                q.remove(request)
        for sibs in self.fork_pending.values():
            if request in sibs:
                sibs.remove(request)
        self._release_siblings(request)

    def _release_siblings(self, request: Request) -> None:
        """Siblings of a request that ends before its prompt is computed start on their own."""
        sibs = self.fork_pending.pop(request.request_id, None)
        if sibs:
            self.waiting.extend(sibs)
            if self.batching_policy != "continuous":
                self.batch.update(s.request_id for s in sibs)

    def _chunk(self, request: Request, budget: int, computed: int | None = None) -> int:
        """Tokens the request takes this step, or 0 when it must wait for a later step."""
        if computed is None:
            computed = request.num_computed_tokens
        remaining = request.num_tokens - computed
        n = remaining
        if self.long_prefill_token_threshold and n > 1:
            n = min(n, self.long_prefill_token_threshold)
        n = min(n, budget)
        # without chunked prefill the whole remainder must fit this step, unless it can never fit one
        # (a recompute after preemption longer than the budget): that one is chunked, or it would wait forever
        if not self.enable_chunked_prefill and n < remaining and remaining <= self.max_num_batched_tokens:
            return 0
        return n

    def preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Preemption: take a running request off the batch to free KV memory for older ones (vLLM
        paper, Kwon et al., SOSP 2023, §4.5). By swap (``preemption_mode="swap"``, when the CPU swap
        pool has room): its blocks are copied out (``out.swap_out``) and it waits in :attr:`swapped`.
        By recompute (otherwise): its blocks are freed and it goes back to the front of the waiting
        queue to recompute its prompt and output so far."""
        self.running.remove(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        out.preempted.append(victim)
        if self.preemption_mode == "swap" and self.kv.can_swap_out(victim.request_id):
            out.swap_out.extend(self.kv.swap_out(victim.request_id))
            self.swapped.append(victim)
            out.num_preempted_swap += 1
        else:
            self.kv.free(victim.request_id)
            victim.num_computed_tokens = 0
            self.waiting.appendleft(victim)
            out.num_preempted_recompute += 1

    def _release_waiting_holder(self) -> bool:
        """Free the blocks of the newest waiting request that holds some (a forked sibling not yet
        running); it will recompute. Returns False when no waiting request holds blocks."""
        for r in reversed(self.waiting):
            if r.request_id in self.kv.block_tables:
                self.kv.free(r.request_id)
                r.num_computed_tokens = 0
                return True
        return False

    def _victim(self, scheduled_ids: set[str] | None) -> Request:
        if self.policy == "fcfs":
            victim = self.running[-1]
        else:
            # the lowest priority, newest; among equal keys (parallel-sampling siblings) the last in
            # running order, as FCFS: the first of equals is the one furthest along, and siblings could
            # then preempt each other forever
            victim = max((r for r in reversed(self.running) if r.request_id not in scheduled_ids), key=self._key)
        if scheduled_ids and victim.request_id in scheduled_ids:
            raise RuntimeError("KV pool exhausted by requests already scheduled this step")
        return victim

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV slots: running requests,
        then swapped requests coming back, then waiting requests admitted, under one ``token_budget``."""
        out = self._schedule_phases()
        if out.is_empty and not self.running and self.waiting and not out.swap_out:
            # Waiting requests that hold blocks (forked siblings) can pin the pool; release them
            # to recompute, so that the oldest request can always run.
            while self._release_waiting_holder():
                pass
            out = self._schedule_phases()
        return out

    def _schedule_phases(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.max_num_batched_tokens
        token_budget = self._schedule_running(out, token_budget)
        token_budget = self._schedule_swapped(out, token_budget)
        if self.policy == "priority" and self.waiting:
            self.waiting = deque(sorted(self.waiting, key=self._key))
        if self.batching_policy == "continuous":
            self._admit_waiting(out, token_budget)
        else:
            self._admit_batch(out, token_budget)
        out.block_copies = self.kv.take_pending_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, token_budget: int) -> int:
        """Phase 1: running requests, oldest (or highest priority) first; each gets its next
        tokens, preempting the newest running request when the pool cannot back them.
        Returns the token budget left."""
        if self.policy == "priority":
            self.running.sort(key=self._key)
        running = self.running
        tables = self.kv.block_tables
        bs = self.kv.block_size
        # the decode fast path: while no block is shared, a decode inside the blocks it holds needs
        # nothing from the KV manager (KVManager.may_share_blocks; see docs/benchmarks.md, section
        # "Replay speed")
        skip_covered = not self.kv.may_share_blocks
        # only a priority victim is chosen among the requests not scheduled yet; the FCFS victim,
        # running[-1], comes after the request being scheduled, so never is one
        scheduled_ids: set[str] | None = set() if self.policy == "priority" else None
        num_decode_tokens = 0
        i = 0
        num_running = len(running)
        while i < num_running and token_budget > 0:
            req = running[i]
            c = req.num_computed_tokens
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            if num_tokens - c == 1:
                n = 1  # a decode: what _chunk gives for one remaining token and budget > 0
                t = tables.get(req.request_id)
                covered = skip_covered and t is not None and len(t) * bs > c
            else:
                n = self._chunk(req, token_budget)
                if n == 0:
                    i += 1  # its whole prompt does not fit the rest of the budget; next step
                    continue
                covered = False
            if not covered:
                if not self._make_room(req, c, n, out, scheduled_ids):
                    break  # req preempted itself: every request after it was preempted before it
                num_running = len(running)  # preemptions removed requests
            s = ScheduledRequest(req, c, n, num_tokens)  # _add, inlined: this loop runs for every running request
            out.scheduled.append(s)
            if s.is_prefill:
                out.num_prefill_tokens += n
                out.num_prefill_reqs += 1
                req.num_prefill_chunks += 1
            else:
                num_decode_tokens += n
            if scheduled_ids is not None:
                scheduled_ids.add(req.request_id)
            token_budget -= n
            i += 1
        out.num_decode_tokens += num_decode_tokens
        return token_budget

    def _make_room(self, req: Request, c: int, n: int, out: SchedulerOutput, scheduled_ids) -> bool:
        """Back ``n`` more slots of a running request, preempting others until they fit; False when
        the request itself had to be preempted."""
        while not self.kv.allocate_slots(req.request_id, c + n, write_start=c):
            if self._release_waiting_holder():
                continue
            victim = self._victim(scheduled_ids)
            self.preempt(victim, out)
            if victim is req:
                return False
        return True

    def _schedule_swapped(self, out: SchedulerOutput, token_budget: int) -> int:
        """Phase 2: swapped-out requests come back, oldest first, before any new request is
        admitted, and only in a step that preempted nothing. Returns the token budget left."""
        if not self.swapped or out.preempted:
            return token_budget
        if self.policy == "priority":
            self.swapped = deque(sorted(self.swapped, key=self._key))
        while self.swapped and len(self.running) < self.max_num_seqs and token_budget > 0:
            req = self.swapped[0]
            n = self._chunk(req, token_budget)
            c = req.num_computed_tokens
            # come back only with room for this step's tokens too, else it would be swapped out again
            if not n or not self.kv.can_swap_in(req.request_id, c + n):
                break
            self.swapped.popleft()
            out.swap_in.extend(self.kv.swap_in(req.request_id))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if self.kv.allocate_slots(req.request_id, c + n, write_start=c):
                self._add(out, req, n)
                token_budget -= n
        return token_budget

    def _admit_waiting(self, out: SchedulerOutput, token_budget: int) -> None:
        """Phase 3: waiting requests admitted, first come first served (or by priority), while
        fewer than ``max_num_seqs`` run and budget remains, and only when nothing was preempted
        this step and none is swapped out; a prompt may start from prefix-cache hits."""
        kv = self.kv
        if out.preempted or self.swapped:
            return
        while self.waiting and token_budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # (a request with prompt_logprobs computes every prompt position: no prefix-cache hits, as vLLM)
            fresh = req.num_computed_tokens == 0 and req.sampling_params.prompt_logprobs is None
            hits = kv.find_cached_prefix(req.token_ids) if fresh else []
            computed = req.num_computed_tokens + len(hits) * kv.block_size
            n = self._chunk(req, token_budget, computed)
            if n == 0 or not kv.allocate_slots(req.request_id, computed + n, hits, write_start=computed):
                break
            if kv.enable_prefix_caching and req.num_preemptions == 0 and req.index == 0:
                out.prefix_cache_queries += req.num_prompt_tokens
                out.prefix_cache_hits += computed
                req.num_cached_tokens = computed
            req.num_computed_tokens = computed
            self.waiting.popleft()
            self._start(out, req, n)
            token_budget -= n

    def _start(self, out: SchedulerOutput, req: Request, n: int) -> None:
        """A waiting request starts running with ``n`` tokens this step."""
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        self.running.append(req)
        self._add(out, req, n)

    def _form_batch(self) -> None:
        """Choose the next static / grouped batch among the waiting requests."""
        waiting = list(self.waiting)
        k = self.max_num_seqs
        if self.batching_policy == "static":
            members = waiting[:k]
        else:
            first = waiting[0]
            rest = sorted(
                waiting[1:], key=lambda r: (abs(r.num_prompt_tokens - first.num_prompt_tokens), r.arrival_time)
            )
            members = [first, *rest[: k - 1]]
        self.batch = {r.request_id for r in members}
        self.num_batches += 1

    def _admit_batch(self, out: SchedulerOutput, token_budget: int) -> None:
        """Phase 3 of static / grouped batching: admit the current batch's waiting members only;
        form a new batch when every member of the last one has finished."""
        if not self.batch and self.waiting and not self.running and not self.swapped:
            self._form_batch()
        if out.preempted or self.swapped:
            return
        for req in [r for r in self.waiting if r.request_id in self.batch]:
            if token_budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            c = req.num_computed_tokens
            n = self._chunk(req, token_budget)
            if n == 0 or not self.kv.allocate_slots(req.request_id, c + n, write_start=c):
                break
            self.waiting.remove(req)
            self._start(out, req, n)
            token_budget -= n

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> None:
        s = ScheduledRequest(req, req.num_computed_tokens, n)
        out.scheduled.append(s)
        if s.is_prefill:
            out.num_prefill_tokens += n
            out.num_prefill_reqs += 1
            req.num_prefill_chunks += 1
        else:
            out.num_decode_tokens += n

    def update(self, out: SchedulerOutput, sampled: dict[str, int], now: float) -> list[Request]:
        """Advance the scheduled requests after the model ran.

        Args:
            out: this step's schedule.
            sampled: the new token of each request that sampled.
            now: ``self.clock()`` at the end of the step.

        Returns:
            The requests that finished this step (their blocks are already freed).
        """
        finished = []
        kv = self.kv
        prefix_caching = kv.enable_prefix_caching
        fork_pending = self.fork_pending  # _fork pops from it
        record_times = self.record_token_times
        # fork_pending only shrinks during an update: when empty now, it stays empty
        bookkeeping = prefix_caching or bool(fork_pending)
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if bookkeeping:
                if prefix_caching and (req.num_computed_tokens // kv.block_size > kv.num_hashed_blocks(req.request_id)):
                    kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
                if fork_pending and req.request_id in fork_pending and req.num_computed_tokens >= req.num_prompt_tokens:
                    self._fork(req)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            out_ids = req.output_token_ids
            out_ids.append(tok)
            if record_times:
                req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            sp = req.sampling_params
            n_out = len(out_ids)
            if (
                (tok != req.eos_token_id or sp.ignore_eos)
                and not sp.stop_token_ids
                and n_out < sp.max_tokens
                and n_out != req.true_output_len
                and n_out + len(req.prompt_token_ids) < req.max_total_len
            ):
                continue  # none of Request.check_stop's conditions holds (checked without the call)
            status = req.check_stop()
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished

    def _fork(self, first: Request) -> None:
        """Siblings share the first one's prompt blocks; each recomputes the last prompt token
        itself (so samples its own first token), which copies the shared last block on write."""
        p = first.num_prompt_tokens
        for sib in self.fork_pending.pop(first.request_id):
            if first.request_id in self.batch:
                self.batch.add(sib.request_id)
            self.kv.fork(first.request_id, sib.request_id, p)
            sib.num_computed_tokens = p - 1
            if sib.first_scheduled_time is None:
                sib.first_scheduled_time = first.first_scheduled_time
            self.waiting.appendleft(sib)
