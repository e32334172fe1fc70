"""Request bodies of the OpenAI-compatible API, with OpenAI's and vLLM's field names
(https://platform.openai.com/docs/api-reference/completions,
https://docs.vllm.ai/en/latest/serving/openai_compatible_server.html), and the error body.

Numbers are strict: ``true`` is not ``1`` and ``"2"`` is not ``2``. Unknown fields are ignored, as
vLLM does. Fields the engine does not have (``suffix``, ``best_of`` other than ``n``, ``tools``) are
refused with a 400 naming them rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

#: a JSON number (an integer is a number; ``true`` and ``"1"`` are not)
Number = StrictFloat | StrictInt


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's, plus vLLM's extras). Unknown fields are
    kept in ``model_extra``, ignored and logged, as vLLM does."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    n: StrictInt = 1
    temperature: Number | None = None  # OpenAI's default 1.0
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    repetition_penalty: Number = 1.0
    skip_special_tokens: StrictBool = True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    request_id: StrictStr | None = None
    priority: StrictInt = 0
    prompt_logprobs: StrictInt | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, token ids, or a list of
    token-id lists (one completion per prompt, ``n`` choices each)."""

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16  # null is 16 too (vLLM's normalize_null_max_tokens)
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``: the model's chat template is applied to ``messages``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: StrictInt | None = None  # default: what max_model_len leaves after the prompt
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    tools: list | None = None
    #: vLLM's extra: the answer begins with the last message's content when that message has the answer's role
    echo: StrictBool = False


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]


class APIError(Exception):
    """An error the server answers with OpenAI's body ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "RequestEntityTooLargeError",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES[self.status],
                "param": self.param,
                "code": self.status,
            }
        }
