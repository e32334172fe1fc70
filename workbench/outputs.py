"""What the engine returns: :class:`RequestOutput` with its :class:`CompletionOutput` s, as vLLM's
``vllm/outputs.py``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability (natural log, of the model's distribution before temperature,
    penalties and top-k/top-p, as vLLM's default ``raw_logprobs``), its rank in that distribution
    (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: one position's log-probabilities: token id -> Logprob (the top ``logprobs`` tokens and the chosen one)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence, as vLLM's ``CompletionOutput``.

    Attributes:
        text, token_ids: the output so far (``DELTA`` requests: only what is new since the last output).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"``, or ``None`` while running.
        stop_reason: the stop string or stop token id that ended it (``None``: EOS, length, or running).
        logprobs: per output token (``SamplingParams.logprobs``), else ``None``.
        cumulative_logprob: sum of the chosen tokens' log-probabilities (with ``logprobs``), else ``None``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's result, as vLLM's ``RequestOutput``.

    ``error`` is set (and ``outputs[0].finish_reason == "error"``) when the engine refused
    the request, e.g. a prompt longer than ``max_model_len``.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    error: str | None = None
    metrics: dict = field(default_factory=dict)
    #: per prompt token (``None`` for the first), with ``SamplingParams.prompt_logprobs``
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
