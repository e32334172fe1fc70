"""``SamplingParams``: how a request picks its tokens and when it stops, as vLLM's
``vllm/sampling_params.py`` (https://docs.vllm.ai/en/latest/api/vllm/sampling_params.html).

Defaults are vLLM's except ``temperature`` (0 = greedy here, 1.0 in vLLM: the course's runs must
reproduce token for token; the README lists this difference) and ``output_kind`` (``None``: the
entry point decides: ``FINAL_ONLY`` for ``LLM`` and ``LLMEngine``, ``DELTA`` for ``AsyncLLM``, which
streams; vLLM's default is ``CUMULATIVE``).
"""

from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

#: most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20
#: temperatures below this sample greedily (vLLM's ``_SAMPLING_EPS``)
GREEDY_TEMPERATURE = 1e-5
#: most ``stop_token_ids`` and ``stop`` strings a request may list, and the longest stop string (characters).
#: vLLM has no such bounds; every step checks each of them for every sequence, so a long list sent once
#: would slow every other request down (OpenAI's API allows 4 stop strings).
MAX_STOP_TOKEN_IDS = 4096
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024


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
        temperature: 0 = greedy (argmax; as is anything below 1e-5, vLLM's rule); > 0 divides the logits.
        top_p: keep the smallest set of tokens whose probability sums to >= top_p (1 = all); the most
            likely token is always kept, so a tiny ``top_p`` is greedy.
        top_k: keep the k most likely tokens (-1 or 0 = all).
        seed: seed of this request's generator, in [-2**63, 2**64 - 1]; ``None`` = derived from the engine's
            seed and the arrival order. With ``n > 1`` sequence ``i`` uses ``(seed + i) mod 2**64``.
        stop: strings that end the request when the output text contains one; trimmed from the text
            unless ``include_stop_str_in_output``.
        stop_token_ids: token ids that end the request (kept in the output).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        ignore_eos: keep generating past the model's EOS token.
        max_tokens: most new tokens to generate.
        min_tokens: EOS (unless ``ignore_eos``) and ``stop_token_ids`` are masked until this many tokens
            are out (0 to ``max_tokens``).
        logprobs: return this many most likely tokens' log-probabilities per output token (plus the
            sampled one), 0 to 20 (vLLM's default ``max_logprobs``); ``None`` = none.
        prompt_logprobs: the same for every prompt token after the first (0 to 20); such a request
            bypasses the prefix cache (as vLLM), so that every prompt position is computed.
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
        self.verify()

    def verify(self) -> None:
        """Check every field (also after a field was changed in place); normalise ``stop`` to a list.

        Raises:
            ValueError: a field of the wrong type (``bool`` is not an integer here, a float is not
                coerced to an integer) or out of vLLM's range; the message names the field, the value
                and what is allowed.
        """
        _integer("n", self.n, 1)
        _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0, self.max_tokens, hint=f"max_tokens={self.max_tokens}")
        _integer("top_k", self.top_k, -1)
        # the sampler computes in floating point: each number is stored as the float it stands for
        self.temperature = _number("temperature", self.temperature, 0.0, None, "must be >= 0 (0 = greedy)")
        self.top_p = _number("top_p", self.top_p, 0.0, 1.0, "must be in (0, 1] (1 = no nucleus cut)", open_low=True)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, _number(name, getattr(self, name), -2.0, 2.0, "must be in [-2, 2] (0 = off)"))
        self.repetition_penalty = _number(
            "repetition_penalty", self.repetition_penalty, 0.0, None, "must be > 0 (1 = off)", open_low=True
        )
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _boolean(name, getattr(self, name))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 0, MAX_LOGPROBS, hint=f"the cap max_logprobs={MAX_LOGPROBS}")
        if self.seed is not None:
            _integer("seed", self.seed, -(2**63), 2**64 - 1)
        self.stop_token_ids = _token_ids(self.stop_token_ids)
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is None:
            stop = []
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise ValueError(f"stop={_short(self.stop)} must be a non-empty string or a list of non-empty strings")
        if len(stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_STRING_CHARS for x in stop):
            raise ValueError(
                f"stop lists {len(stop)} strings of up to {max(map(len, stop))} characters; give at most "
                f"{MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} characters each"
            )
        self.stop = list(stop)
        if self.output_kind is not None and not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind={self.output_kind!r} must be a RequestOutputKind or None")

    @property
    def greedy(self) -> bool:
        """Argmax sampling: ``temperature`` below vLLM's ``_SAMPLING_EPS`` (1e-5), which would
        overflow the division of the logits."""
        return self.temperature < GREEDY_TEMPERATURE


def _token_ids(ids) -> list[int]:
    """``stop_token_ids`` as a list of ints >= 0 (at most :data:`MAX_STOP_TOKEN_IDS`); ``ValueError`` naming
    the first bad one. Plain ints are checked in one pass (a request's list is checked once per prompt)."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids={_short(ids)} must be a list of token ids (integers >= 0)")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids lists {len(ids)} token ids; give at most {MAX_STOP_TOKEN_IDS}")
    if all(type(t) is int for t in ids) and (not ids or min(ids) >= 0):
        return list(ids)
    for t in ids:
        _integer("stop_token_ids", t, 0, hint="token ids")
    return [int(t) for t in ids]


def _short(value, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (an error message quotes what it refuses, not all of it)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _integer(name: str, value, lo: int, hi: int | None = None, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a ``bool``) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} must be an integer (got {type(value).__name__}){_where(lo, hi, hint)}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}={value!r} is out of range: must be an integer{_where(lo, hi, hint)}")


def _where(lo, hi, hint: str) -> str:
    rng = f" >= {lo}" if hi is None else f" in [{lo}, {hi}]"
    return rng + (f" ({hint})" if hint else "")


def _number(name: str, value, lo: float, hi: float | None, rule: str, open_low: bool = False) -> float:
    """``value`` as a ``float``; raise ``ValueError`` unless it is a real number (not a ``bool``) that a
    float holds finitely (an integer past about 1.8e308 does not) and within the bounds."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} must be a number (got {type(value).__name__}); it {rule}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        shown = value if isinstance(value, float) else f"an integer of {len(str(abs(value)))} digits"
        raise ValueError(f"{name}={shown} is not a finite number; it {rule}")
    if not ((x > lo if open_low else x >= lo) and (hi is None or x <= hi)):
        raise ValueError(f"{name}={value!r} {rule}")
    return x


def _boolean(name: str, value) -> None:
    """Raise ``ValueError`` unless ``value`` is a ``bool`` (``"no"`` or ``0`` would read as a truth value)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False (got {type(value).__name__})")
