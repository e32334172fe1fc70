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

    @classmethod
    def from_sequences(cls, group: list, tokenizer, metrics: dict) -> RequestOutput:
        """The output of a finished request from its ``n`` sequences (:class:`workbench.request.Request`),
        their text decoded with ``tokenizer`` (none: empty text); ``metrics``: the first one's record."""
        outs = []
        for req in group:
            text = ""
            if tokenizer is not None and req.output_token_ids:
                text = tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            outs.append(CompletionOutput(req.index, text, list(req.output_token_ids), req.status.value))
        first = group[0]
        return cls(first.parent_id, first.prompt, first.prompt_token_ids, outs, True, first.error, metrics)
