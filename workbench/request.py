"""A request's state: WAITING -> RUNNING -> (PREEMPTED -> WAITING ->) FINISHED_*."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workbench.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass(eq=False)
class Request:
    """One request inside the engine; compared by identity (two requests are never equal). ``token_ids`` is the
    prompt followed by the output so far; ``num_computed_tokens`` counts the leading tokens whose K/V are in the cache.
    The tokens still to run through the model are ``token_ids[num_computed_tokens:]`` (a prompt, a prompt's remaining
    chunk, or the one token sampled last step). Times are ``time.perf_counter()`` seconds."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    eos_token_id: int | None = None
    max_total_len: int = 0  # max_model_len of the engine
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    error: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    num_prefill_chunks: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    priority: int = 0  # lower value = served first under scheduling_policy="priority" (vLLM's convention)
    true_output_len: int | None = None  # a replayed trace's output length: ends here, finish "stop" (not in vLLM)
    parent_id: str | None = None  # the user's request id, for a parallel-sampling sibling
    index: int = 0  # which of the n sequences this is
    generator: torch.Generator | None = None  # the sampler's random stream (None: greedy)
    logprobs: list = field(default_factory=list)  # per output token, token id -> Logprob (with sp.logprobs)
    prompt_logprobs: list | None = None  # None, then per prompt token so far (with sp.prompt_logprobs)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole prompt + output list (the per-step path)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_output_tokens(self) -> int:
        """Most output tokens this request can reach: ``max_tokens`` capped by ``max_model_len`` and ``true_output_len``."""
        cap = min(self.sampling_params.max_tokens, self.max_total_len - self.num_prompt_tokens)
        return cap if self.true_output_len is None else min(cap, self.true_output_len)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def check_stop(self) -> RequestStatus | None:
        """Finish status after the last appended token, or ``None`` to go on."""
        last = self.output_token_ids[-1]
        sp = self.sampling_params
        if not sp.ignore_eos and self.eos_token_id is not None and last == self.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if sp.stop_token_ids and last in sp.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        n = len(self.output_token_ids)  # >= max_output_tokens, without the properties (per-step path)
        if n >= sp.max_tokens or n >= self.max_total_len - len(self.prompt_token_ids):
            return RequestStatus.FINISHED_LENGTH
        if n == self.true_output_len:  # where the trace's model emitted EOS (after the cap, as vLLM's check_stop)
            return RequestStatus.FINISHED_STOPPED
        return None
