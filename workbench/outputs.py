"""What the engine returns: :class:`RequestOutput` with its :class:`CompletionOutput` s, as vLLM's
``vllm/outputs.py``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence: ``text`` (decoded when the request finishes) and ``token_ids``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


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
