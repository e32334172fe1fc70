"""Iteration-level continuous batching with a per-step token budget.

Each step (Orca, Yu et al., OSDI 2022; vLLM's v1 scheduler, vllm/v1/core/sched/scheduler.py):

1. running requests first, oldest first: each gets the tokens it still has to
   compute (1 for a decode, the rest of its prompt for a chunked prefill),
   capped by the remaining budget ``max_num_batched_tokens``; when the KV pool
   cannot back them, the newest running request is preempted by recompute
   (its blocks are freed and it goes back to the front of the waiting queue);
2. waiting requests, first come first served, while fewer than
   ``max_num_seqs`` run and budget remains; with chunked prefill a prompt may
   take only part of the remaining budget; a waiting request never preempts.

The oldest running request can always proceed (the pool holds one
``max_model_len`` sequence, checked at startup), so the loop cannot deadlock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from workbench.kv.manager import KVCacheManager
from workbench.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens from position ``start``."""

    request: Request
    start: int
    num_new_tokens: int

    @property
    def is_prefill(self) -> bool:
        """True while the request is still computing its prompt (or recomputing after preemption)."""
        return self.start < self.request.num_tokens - 1 or self.request.num_output_tokens == 0

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What the model runs this step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    #: prompt tokens looked up in the prefix cache at first admission, and those found
    #: (re-admissions after preemption are not counted)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Continuous batching over a :class:`KVCacheManager`.

    Args:
        kv: the KV-cache manager.
        max_num_seqs: most running requests.
        max_num_batched_tokens: token budget of one step.
        enable_chunked_prefill: split prompts to fit the budget; when off, a prompt
            is admitted only when all of it fits the step's remaining budget.
        long_prefill_token_threshold: most prompt tokens one request takes in a step (0 = no cap).
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0

    # ------------------------------------------------------------------ queue
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request in any state and release its blocks."""
        request.status = status
        request.finish_time = time.perf_counter()
        self.kv.free(request.request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    # ------------------------------------------------------------------ step
    def _chunk(self, request: Request, budget: int, computed: int | None = None) -> int:
        """Tokens the request takes this step, or 0 when it must wait for a later step."""
        if computed is None:
            computed = request.num_computed_tokens
        remaining = request.num_tokens - computed
        n = remaining
        if self.long_prefill_token_threshold and n > 1:
            n = min(n, self.long_prefill_token_threshold)
        n = min(n, budget)
        if not self.enable_chunked_prefill and n < remaining:
            # Without chunked prefill the whole remainder must fit this step; one that can
            # never fit a step (a recompute after preemption longer than the budget) is
            # chunked anyway, else it would wait forever.
            if remaining <= self.max_num_batched_tokens:
                return 0
        return n

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.kv.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts, allocating their KV slots."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n == 0:
                i += 1  # its whole prompt does not fit the rest of the budget; next step
                continue
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                if victim.request_id in scheduled_ids:
                    raise RuntimeError("KV pool exhausted by requests already scheduled this step")
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                self._add(out, req, n)
                scheduled_ids.add(req.request_id)
                budget -= n
                i += 1
                continue
            break  # req preempted itself: every later request is newer and was preempted too

        # 2. waiting requests, FCFS, only when nothing was preempted this step
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            hits = self.kv.find_cached_prefix(req.token_ids) if req.num_computed_tokens == 0 else []
            computed = req.num_computed_tokens + len(hits) * self.kv.block_size
            n = self._chunk(req, budget, computed)
            if n == 0:
                break
            if not self.kv.allocate_slots(req.request_id, computed + n, hits):
                break
            if self.kv.enable_prefix_caching and req.num_preemptions == 0:
                out.prefix_cache_queries += req.num_prompt_tokens
                out.prefix_cache_hits += computed
                req.num_cached_tokens = computed
            req.num_computed_tokens = computed
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.perf_counter()
            self.running.append(req)
            self._add(out, req, n)
            scheduled_ids.add(req.request_id)
            budget -= n
        return out

    def _add(self, out: SchedulerOutput, req: Request, n: int) -> None:
        s = ScheduledRequest(req, req.num_computed_tokens, n)
        out.scheduled.append(s)
        if s.is_prefill:
            out.num_prefill_tokens += n
            req.num_prefill_chunks += 1
        else:
            out.num_decode_tokens += n

    def update(self, out: SchedulerOutput, sampled: dict[str, int], now: float) -> list[Request]:
        """Advance the scheduled requests after the model ran.

        Args:
            out: this step's schedule.
            sampled: the new token of each request that sampled.
            now: ``time.perf_counter()`` at the end of the step.

        Returns:
            The requests that finished this step (their blocks are already freed).
        """
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            if self.kv.enable_prefix_caching and (
                req.num_computed_tokens // self.kv.block_size > self.kv.num_hashed_blocks(req.request_id)
            ):
                self.kv.cache_full_blocks(req.request_id, req.token_ids, req.num_computed_tokens)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            req.output_token_ids.append(tok)
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            status = req.check_stop()
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished
