"""``SamplingParams``: how a request picks its tokens and when it stops, as vLLM's
``vllm/sampling_params.py`` (https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html).

Defaults are vLLM's except ``temperature`` (0 = greedy here, 1.0 in vLLM: the course's runs must
reproduce token for token; the README lists this difference) and ``output_kind`` (``None``: the
entry point decides: ``FINAL_ONLY`` for ``LLM`` and ``LLMEngine``, ``DELTA`` for ``AsyncLLM``, which
streams; vLLM's default is ``CUMULATIVE``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """Which ``RequestOutput`` s a request yields (vLLM's names): every step with everything so far
    (``CUMULATIVE``), every step with only what is new (``DELTA``, streaming), or once when it
    finishes (``FINAL_ONLY``)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to pick each new token; raises ``ValueError`` (naming the value and the fix) when a field is out of range.

    Attributes:
        n: output sequences per prompt; they share the prompt's KV blocks (copy-on-write).
        presence_penalty: subtracted once from the logit of every token already in the output ([-2, 2]).
        frequency_penalty: subtracted from a token's logit per occurrence in the output ([-2, 2]).
        repetition_penalty: logits of tokens in the prompt or output are divided by it when positive,
            multiplied when negative (CTRL, Keskar et al. 2019); 1 = off; > 0.
        temperature: 0 = greedy (argmax); > 0 divides the logits.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p (1 = all).
        top_k: keep the k most likely tokens (-1 or 0 = all).
        seed: seed of this request's generator; ``None`` = derived from the engine's seed and the arrival order.
        stop: strings that end the request when the output text contains one; trimmed from the text
            unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the request (kept in the output).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        ignore_eos: keep generating past the model's EOS token.
        max_tokens: most new tokens to generate.
        min_tokens: EOS and ``stop_token_ids`` cannot end the request before this many tokens.
        logprobs: return this many most likely tokens' log-probabilities per output token (plus the
            sampled one); ``None`` = none.
        prompt_logprobs: the same for every prompt token after the first.
        skip_special_tokens: leave special tokens out of the text.
        output_kind: see :class:`RequestOutputKind`; ``None`` = the entry point's default.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1] (1 = no nucleus cut)")
        if self.top_k is None or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 (all tokens) or a positive count")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an integer >= 1")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an integer >= 1 (sequences per prompt)")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
