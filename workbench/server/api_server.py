"""``workbench serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over :class:`AsyncLLM`,
in the shape of vLLM's ``vllm serve`` (vllm/entrypoints/openai/api_server.py).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as
server-sent events ending in ``data: [DONE]``, and ``stream_options.include_usage``),
``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``
(Prometheus: :class:`~workbench.metrics.prometheus.PrometheusSink`), ``GET /version``.

Bad input is answered before anything is queued, with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``: 400 for an invalid field (naming it and its
allowed range), a prompt longer than ``max_model_len`` or ``max_tokens`` past it (naming the numbers);
404 for an unknown model. A client that disconnects aborts its request (its KV blocks are freed at
the engine's next step). SIGINT / SIGTERM: uvicorn stops accepting, in-flight requests get
``--graceful-shutdown-timeout`` seconds to finish, the rest are aborted, and tensor-parallel workers
are stopped.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from workbench.entrypoints.async_llm import AsyncLLM, EngineDeadError
from workbench.inputs import chat_messages, max_prompt_chars
from workbench.metrics.prometheus import PrometheusSink
from workbench.outputs import RequestOutput
from workbench.sampling import SAMPLING_FAILED
from workbench.sampling_params import RequestOutputKind, SamplingParams
from workbench.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

log = logging.getLogger("workbench.server")


#: the largest request body ``workbench serve`` reads (bytes; ``--max-request-body-bytes``); vLLM has no
#: such bound. A prompt that fits ``max_model_len`` is far smaller; a larger body is answered 413 unread.
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


class BodyLimit:
    """ASGI middleware: a request whose body (declared, or as it arrives) exceeds ``max_bytes`` is
    answered 413 with OpenAI's error body, before the rest is read or parsed."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes (--max-request-body-bytes); send less"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = b"" if b"transfer-encoding" in headers else headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await JSONResponse(APIError(self._message(), 413).body(), 413)(scope, receive, send)
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:
                raise StarletteHTTPException(413, self._message())
            return msg

        return await self.app(scope, limited, send)


class OpenAIServing:
    """What the endpoints share: the engine, the served name, request checks and response shapes."""

    def __init__(self, llm: AsyncLLM, served_model_name: str, sink: PrometheusSink | None = None) -> None:
        self.llm = llm
        self.name = served_model_name
        #: ``--max-num-queued-reqs``: requests in flight beyond which a new one gets 503 (``None``: no limit);
        #: the admin API may change it while the server runs (``POST /admin/max_num_queued_reqs``)
        self.max_num_queued_reqs: int | None = getattr(llm.engine.config, "max_num_queued_reqs", None)
        self.rejected = sink.admission_rejections["max_num_queued_reqs"] if sink is not None else None
        self.created = int(time.time())
        #: tokenization and chat templating run here, one at a time, never on the event loop: a long prompt
        #: takes its time without holding up /health or other streams
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="workbench-tokenize")
        #: a text prompt longer than this cannot fit max_model_len (:func:`workbench.inputs.max_prompt_chars`)
        self.max_prompt_chars = max_prompt_chars(llm.tokenizer, llm.max_model_len)
        self.system_fingerprint = system_fingerprint(llm.engine.config)

    # ------------------------------------------------------------------ checks
    def check_request(self, req) -> None:
        """Every string encodable (400 naming the field), the model name (404 when unknown), the
        priority and a caller's request id (400)."""
        for name in _TEXT_FIELDS:
            v = getattr(req, name, None)
            if name == "prompt" and isinstance(v, list) and not (v and isinstance(v[0], str)):
                continue  # token ids (pydantic checked every one): no text to look at
            if name == "messages" and v is not None:
                v = [m.model_dump() for m in v]
            where = _unencodable(v, name)
            if where:
                raise APIError(
                    f"{where} holds a lone UTF-16 surrogate (e.g. the JSON escape \\ud800 without its pair), "
                    "which is not text; send valid Unicode",
                    400,
                    where.split(".")[0].split("[")[0],
                )
        if req.model is not None and req.model != self.name:
            raise APIError(f"The model `{req.model}` does not exist; this server serves `{self.name}`.", 404, "model")
        policy = self.llm.engine.config.scheduling_policy
        if getattr(req, "priority", 0) and policy != "priority":
            raise APIError(
                f"priority={req.priority} needs a server started with --scheduling-policy priority (this one: {policy})",
                400,
                "priority",
            )
        n, cap = getattr(req, "n", 1), self.llm.engine.config.max_num_seqs
        if isinstance(n, int) and n > cap:
            raise APIError(
                f"n={n} exceeds max_num_seqs={cap}: a request's n sequences run side by side; use n <= {cap} "
                "(or start the server with a larger --max-num-seqs)",
                400,
                "n",
            )
        if getattr(req, "model_extra", None):
            names = sorted(k[:40] for k in req.model_extra)
            log.warning("%d field(s) ignored (not part of the API): %s", len(names), ", ".join(names[:10]))
        if getattr(req, "stream_options", None) is not None and not req.stream:
            raise APIError("stream_options can only be given with stream=true", 400, "stream_options")
        pl = getattr(req, "prompt_logprobs", None)
        if getattr(req, "stream", False) and isinstance(pl, int) and (pl > 0 or pl == -1):  # (vLLM's rule and words)
            raise APIError("`prompt_logprobs` are not available when `stream=True`.", 400, "prompt_logprobs")

    def request_id(self, req, http: Request, prefix: str) -> str:
        """The request's id: the ``X-Request-Id`` header, else the body's ``request_id`` (vLLM's order), else
        ``<prefix>-<uuid>``; a given id that is already running is refused (400) before anything is queued."""
        rid = http.headers.get("x-request-id") or getattr(req, "request_id", None)
        if rid is None:
            return f"{prefix}-{uuid.uuid4().hex}"
        if any(k == rid or k.startswith(rid + "-") for k in self.llm.running_ids()):
            raise APIError(f"request_id {rid!r} is already running; use a unique id", 400, "request_id")
        return rid

    async def tokenize(
        self, prompt, param: str, add_special_tokens: bool | None = None, add_generation_prompt: bool = True
    ) -> tuple[list[int], str | None]:
        """Token ids and text of a prompt, computed on the tokenizer's thread (the event loop keeps serving);
        a text longer than :attr:`max_prompt_chars` is refused before it is tokenized.
        ``add_special_tokens``: ``/tokenize``'s own choice for a text prompt (``None``: the engine's);
        ``add_generation_prompt``: chat messages end with the assistant's turn opened (the template's)."""
        if isinstance(prompt, str):
            texts = [prompt]
        else:  # chat messages: all that the template renders
            texts = [v for m in prompt if isinstance(m, dict) for v in m.values()]
        chars = sum(len(t) for t in texts if isinstance(t, str))
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(
                f"{param} has {chars} characters, more than max_model_len={self.llm.max_model_len} tokens can "
                f"hold with this tokenizer (at most {self.max_prompt_chars}); shorten the prompt",
                400,
                param,
            )
        eng = self.llm.engine

        def work():
            if add_special_tokens is not None and isinstance(prompt, str):
                if eng.tokenizer is None:
                    raise ValueError("this model has no tokenizer: send token ids")
                return eng.tokenizer.encode(prompt, add_special_tokens=add_special_tokens), prompt
            return eng.tokenize(prompt, add_generation_prompt=add_generation_prompt)

        try:
            return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, work)
        except (ValueError, TypeError, UnicodeError) as e:
            raise APIError(str(e), 400, param) from None

    async def detokenize(self, ids: list[int]) -> str:
        """``ids`` as text, on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, self.llm.tokenizer.decode, ids)

    def max_tokens(self, n_prompt: int, max_tokens: int | None, param: str) -> int:
        """``max_tokens`` after vLLM's length checks; ``None`` = what ``max_model_len`` leaves."""
        m = self.llm.max_model_len
        if n_prompt >= m:
            raise APIError(
                f"This model's maximum context length is {m} tokens, but the prompt has {n_prompt} tokens; "
                f"shorten the prompt to at most {m - 1} tokens (one is needed for the output).",
                400,
                param,
            )
        pool = self.llm.engine.kv.pool_tokens
        if n_prompt + 1 > pool:
            raise APIError(
                f"The prompt has {n_prompt} tokens but the KV cache holds {pool} tokens; shorten the prompt.",
                400,
                param,
            )
        if max_tokens is None:
            return m - n_prompt
        if n_prompt + max_tokens > m:
            raise APIError(
                f"This model's maximum context length is {m} tokens. However, you requested {n_prompt + max_tokens} "
                f"tokens ({n_prompt} in the prompt, {max_tokens} for the completion); set max_tokens to at most "
                f"{m - n_prompt} or shorten the prompt.",
                400,
                "max_tokens",
            )
        return max_tokens

    def sampling_params(
        self, req, max_tokens: int, logprobs: int | None, stream: bool, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The request's :class:`SamplingParams`; a field out of range is a 400 naming it, and so is greedy
        sampling (``temperature`` below 1e-5) with ``n > 1``, with vLLM's message (its ``SamplingParams``
        refuses n identical copies). ``prompt_logprobs``: in place of the request's (``echo`` asks for them)."""
        if prompt_logprobs is None:
            prompt_logprobs = req.prompt_logprobs
        try:
            sp = SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=list(req.stop_token_ids or []),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            )
            self.llm.engine.check_samplable(sp)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), 400, _field_of(str(e), req)) from None
        if sp.n > 1 and sp.greedy:
            raise APIError(f"n must be 1 when using greedy sampling, got {sp.n}.", 400, "n")
        return sp

    # ------------------------------------------------------------------ running requests
    def admit(self, jobs: list[tuple]) -> None:
        """vLLM's frontend admission: refuse ``jobs`` with 503 when the requests already in flight (waiting or
        running, each prompt of a batch counted) plus these would exceed ``max_num_queued_reqs``. Checked after
        every other check and before anything is queued, so a refused request leaves nothing behind."""
        limit = self.max_num_queued_reqs
        if limit is None:
            return
        current = len(self.llm.running_ids())
        if current + len(jobs) <= limit:
            return
        if self.rejected is not None:
            self.rejected.inc()
        if len(jobs) > limit:
            msg = (f"this request's {len(jobs)} prompts exceed max_num_queued_reqs={limit} on their own, so it can "
                   f"never be admitted: send at most {limit} prompts per request")  # fmt: skip
        else:
            msg = (f"The engine is currently busy and cannot accept new requests: {current} in flight and "
                   f"max_num_queued_reqs={limit}. Please try again later or on a different instance.")  # fmt: skip
        raise APIError(msg, 503)

    async def run_all(self, http: Request, jobs: list[tuple]) -> list[RequestOutput] | None:
        """Run ``jobs`` (``(request_id, tokenized, SamplingParams, priority)``) to completion; abort all
        of them and return ``None`` if the client disconnects first."""

        async def one(rid, tok, sp, prio) -> RequestOutput:
            final = None
            async for out in self.llm.generate(_prompt_of(tok), sp, request_id=rid, priority=prio, tokenized=tok):
                final = out
            return final

        tasks = [asyncio.ensure_future(one(*j)) for j in jobs]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                for t in done:
                    if not t.cancelled() and t.exception() is not None:
                        raise t.exception()  # (the finally cancels the others: nothing runs on unread)
                if not pending:
                    return [t.result() for t in tasks]
                if await http.is_disconnected():
                    log.info("client left before its response: %s aborted", ", ".join(j[0] for j in jobs))
                    return None
        finally:
            for t in tasks:
                t.cancel()  # each generate's exit aborts its request

    async def stream_all(self, jobs: list[tuple]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The outputs of ``jobs`` as they come, tagged with the job's index; leaving early (a client
        that disconnected) cancels every job, which aborts its request."""
        if len(jobs) == 1:  # (the usual case) no task and queue between the engine's outputs and the response
            rid, tok, sp, prio = jobs[0]
            async for out in self.llm.generate(_prompt_of(tok), sp, request_id=rid, priority=prio, tokenized=tok):
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def one(i, rid, tok, sp, prio):
            try:
                async for out in self.llm.generate(_prompt_of(tok), sp, request_id=rid, priority=prio, tokenized=tok):
                    await q.put((i, out))
            except Exception as e:  # handed to the stream
                await q.put((i, e))
            finally:
                await q.put((i, None))

        tasks = [asyncio.ensure_future(one(i, *j)) for i, j in enumerate(jobs)]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                yield i, item
        finally:
            for t in tasks:
                t.cancel()


def _prompt_of(tokenized: tuple[list[int], str | None]):
    """The prompt as the engine records it: its text, or its token ids."""
    ids, text = tokenized
    return text if text is not None else ids


#: what vLLM sends for a log-probability of -inf (JSON has no infinity)
_LOGPROB_FLOOR = -9999.0


def completion_logprobs(token_ids, positions, offset: int = 0, decode=None) -> dict | None:
    """OpenAI's completions ``logprobs`` object (text_offset, token_logprobs, tokens, top_logprobs) of
    ``token_ids`` and their ``positions`` (``{token id: Logprob}`` each, or ``None``: the first prompt
    token of an ``echo``, whose text ``decode([id])`` gives, with null log-probabilities, as vLLM)."""
    if positions is None:
        return None
    tokens, values, tops, offsets = [], [], [], []
    for tid, pos in zip(token_ids, positions):
        if pos is None:
            text = decode([tid]) if decode is not None else ""
            values.append(None)
            tops.append(None)
        else:
            chosen = pos[tid]
            text = chosen.decoded_token or ""
            values.append(max(chosen.logprob, _LOGPROB_FLOOR))
            tops.append({(lp.decoded_token or ""): max(lp.logprob, _LOGPROB_FLOOR) for lp in pos.values()})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens, "top_logprobs": tops}


def prompt_logprobs_json(positions) -> list | None:
    """A request's ``prompt_logprobs`` as vLLM's responses carry them: per prompt token ``None`` (the first)
    or ``{"<token id>": {"logprob", "rank", "decoded_token"}}``."""
    if positions is None:
        return None
    return [
        None if pos is None else {
            str(tid): {"logprob": max(lp.logprob, _LOGPROB_FLOOR), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in pos.items()
        }
        for pos in positions
    ]  # fmt: skip


def system_fingerprint(config) -> str | None:
    """``system_fingerprint`` as vLLM's default (``--fingerprint-mode full``) builds it, with this server's name:
    ``workbench-<version>[-tp<N>]-<8 hex digits of the engine configuration's hash>``; ``None`` when the
    configuration cannot be read (vLLM never fails to start over it either)."""
    from workbench import __version__

    try:
        digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:8]
    except Exception:  # (a stand-in engine without a full configuration)
        return None
    tp = getattr(config, "tensor_parallel_size", 1)
    return "-".join([f"workbench-{__version__}", *([f"tp{tp}"] if tp > 1 else []), digest])


def chat_logprobs(c, top: int) -> dict | None:
    """OpenAI's chat ``logprobs`` object (``content``: token, logprob, bytes, top_logprobs)."""
    if c.logprobs is None:
        return None

    def entry(lp):
        tok = lp.decoded_token or ""
        return {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8"))}

    content = []
    for tid, pos in zip(c.token_ids, c.logprobs):
        ranked = sorted(pos.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        content.append({**entry(pos[tid]), "top_logprobs": [entry(lp) for lp in ranked[:top]]})
    return {"content": content}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(prompt_tokens: int, completion_tokens: int, details: bool = True) -> dict:
    """vLLM's ``UsageInfo``: with its (null) token details in a response, without them in a stream's last chunk."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    return usage | ({"prompt_tokens_details": None, "completion_tokens_details": None} if details else {})


#: the fields of vLLM's response bodies this server has nothing for (vLLM sends them as null too, unless a
#: feature this server lacks is on: KV transfer, per-request metrics, a service tier)
_NO_KV_TRANSFER = {"kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def _chat_messages(messages) -> list[dict]:
    """The request's messages as dicts for :func:`workbench.inputs.chat_messages` (which checks them)."""
    return [{"role": m.role, "content": m.content} | ({"name": m.name} if m.name is not None else {}) for m in messages]


def _choices_with_news(out: RequestOutput):
    """The choices of a streamed output that carry text, tokens or a finish (the others send nothing)."""
    return [c for c in out.outputs if c.text or c.token_ids or c.finish_reason is not None]


def _finish(c) -> dict:
    return {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


#: the fields of vLLM's chat message this server never fills (no tools, audio, refusals or reasoning parser)
_NO_MESSAGE_EXTRAS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}
#: vLLM's ``return_token_ids`` / ``return_prompt_text`` fields, which this server does not offer: null
_NO_PROMPT = {"prompt_token_ids": None, "prompt_text": None}


def _model_permission() -> dict:
    """vLLM's ``ModelPermission`` with its defaults (a fresh id and time on every ``/v1/models``, as vLLM)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }


def _echoed_content(message, role: str) -> str:
    """What a chat ``echo`` puts before the answer: the last message's content when its role is the answer's
    (text parts joined by newlines), else nothing, as vLLM."""
    if message.role != role or not message.content:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.get("text") or "" for part in message.content)


#: vLLM's chat usage in a stream's chunks (``continuous_usage_stats``) names its completion details, null
_NO_DETAILS = {"completion_tokens_details": None}


def _usage_options(options) -> tuple[bool, bool]:
    """``stream_options``' usage chunk at the end, and usage in every chunk (``continuous_usage_stats``, which
    needs ``include_usage``, as vLLM's ``should_include_usage``)."""
    last = bool(options and options.include_usage)
    return last, last and options.continuous_usage_stats


def _fingerprint(fp: str | None) -> dict:
    """A stream chunk's ``system_fingerprint`` (vLLM leaves it out of a chunk when it has none)."""
    return {"system_fingerprint": fp} if fp is not None else {}


async def _event_stream(serving: OpenAIServing, jobs: list[tuple], param: str, head: dict, n_prompt: int,
                        usage: bool, chunks) -> AsyncIterator[str]:  # fmt: skip
    """A streamed response's server-sent events, for completions and chat alike: ``chunks(i, out)`` gives
    the chunks of job ``i``'s output ``out``; then the usage chunk (``stream_options.include_usage``), an
    error event where the request failed, and ``data: [DONE]``."""
    n_out = 0
    try:
        async for i, out in serving.stream_all(jobs):
            if out.error:
                yield _sse(_request_error(out, param).body())
                continue
            n_out += sum(len(c.token_ids) for c in out.outputs)
            for obj in chunks(i, out):
                yield _sse(obj)
        if usage:  # (vLLM's last chunk: its null fields left out, the fingerprint in)
            last = {**head, "choices": [], "usage": _usage(n_prompt, n_out, details=False)}
            yield _sse(last | _fingerprint(serving.system_fingerprint))
    except EngineDeadError as e:
        yield _sse(APIError(str(e), 503).body())
    except ValueError as e:  # refused by the engine after the stream began (rare: checked before)
        yield _sse(APIError(str(e), 400).body())
    yield "data: [DONE]\n\n"


def _request_error(out: RequestOutput, param: str) -> APIError:
    """The error a request ended with: a prompt the engine refused (400 naming ``param``), or a failure
    while it ran that ended only it (500; :class:`~workbench.sampling.SamplingError`)."""
    if out.error.startswith(SAMPLING_FAILED):
        return APIError(out.error, 500, None)
    return APIError(out.error, 400, param)


def _checked_messages(messages) -> list[dict]:
    """:func:`_chat_messages`, checked (:func:`workbench.inputs.chat_messages`): a bad one is a 400 naming where."""
    try:
        return chat_messages(_chat_messages(messages))
    except ValueError as e:
        raise APIError(str(e), 400, "messages") from None


#: the request fields that can hold text (extra fields are ignored, so not looked at)
_TEXT_FIELDS = ("model", "request_id", "user", "stop", "prompt", "messages", "suffix")


def _field_of(message: str, req) -> str | None:
    """The request field an error message begins with (``"temperature=..."``, ``"stop lists ..."``), or ``None``."""
    m = re.match(r"\s*(\w+)", message)
    return m.group(1) if m and m.group(1) in type(req).model_fields else None


def _unencodable(value, path: str) -> str | None:
    """The path (``messages[0].content``) of the first string inside ``value`` (a request's fields, as
    ``model_dump`` gives them) that UTF-8 cannot encode: JSON's ``\\ud800`` escape gives a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        at = f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]"
        where = (_unencodable(k, path) if isinstance(k, str) else None) or _unencodable(v, at)
        if where:
            return where
    return None


def build_app(
    llm: AsyncLLM,
    served_model_name: str,
    sink: PrometheusSink | None = None,
    api_key: str | None = None,
    health_stall_s: float = 300.0,
    enable_admin_api: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """The FastAPI application over ``llm`` (see the module docstring for the endpoints). With
    ``api_key``, every ``/v1`` and ``/admin`` request needs the header ``Authorization: Bearer <api_key>``
    (401 otherwise), as ``vllm serve --api-key``. ``GET /health`` answers 503 when the engine loop has
    stopped, or has made no progress for ``health_stall_s`` seconds (one step never takes that long).
    ``enable_admin_api`` adds the operator's actions (:func:`add_admin_routes`)."""
    serving = OpenAIServing(llm, served_model_name, sink)

    @asynccontextmanager
    async def lifespan(app):
        yield
        llm.shutdown()  # in-flight requests aborted, tensor-parallel workers stopped

    app = FastAPI(title="workbench", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)

    if api_key:

        @app.middleware("http")
        async def _auth(request: Request, call_next):
            guarded = request.url.path.startswith(("/v1", "/admin"))
            if guarded and request.headers.get("Authorization") != f"Bearer {api_key}":
                err = APIError("missing or wrong API key: send the header 'Authorization: Bearer <key>'", 401)
                return JSONResponse(err.body(), status_code=401)
            return await call_next(request)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [x for x in first.get("loc", ()) if x != "body"]
        kind = first.get("type")
        if kind == "json_invalid":
            err = (first.get("ctx") or {}).get("error", "invalid JSON")
            msg = f"the body is not valid JSON ({err} at character {loc[0] if loc else '?'}); send one JSON object"
            return JSONResponse(APIError(msg, 400, None).body(), status_code=400)
        if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
            msg = "the body must be a JSON object sent with the header Content-Type: application/json"
            return JSONResponse(APIError(msg, 400, None).body(), status_code=400)
        field = str(loc[0]) if loc else None  # the request's field (not pydantic's union branch)
        where = (field or "") + "".join(f"[{x}]" for x in loc[1:] if isinstance(x, int))
        msg = f"{where or 'body'}: {first.get('msg', 'invalid value')}"
        if kind != "missing":
            msg += f" (got {json.dumps(first.get('input'), default=str)})"
        return JSONResponse(APIError(msg, 400, field).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        status = exc.status_code if exc.status_code in APIError.TYPES else 400
        body = APIError(f"{exc.detail}: {request.method} {request.url.path}", status).body()
        body["error"]["code"] = exc.status_code
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ValueError)
    async def _value_error(request, exc: ValueError):  # the engine refused a request (checked before, in the main)
        param = "request_id" if str(exc).startswith("request_id") else None
        return JSONResponse(APIError(str(exc), 400, param).body(), status_code=400)

    @app.exception_handler(EngineDeadError)
    async def _dead(request, exc):
        return JSONResponse(APIError(str(exc), 503).body(), status_code=503)

    if enable_admin_api:
        add_admin_routes(app, llm, serving)
    else:  # say why there is nothing here, rather than a bare 404

        @app.api_route("/admin/{rest:path}", methods=["GET", "POST"], include_in_schema=False)
        async def _admin_off(rest: str):
            msg = "the admin API is off: start workbench serve with --enable-admin-api to use /admin/" + rest
            return JSONResponse(APIError(msg, 404).body(), status_code=404)

    @app.get("/health")
    async def health():
        if not llm.is_running:
            return Response(status_code=503)
        stalled = llm.stalled_s()
        if stalled > health_stall_s:  # alive but wedged: let the orchestrator restart it
            log.warning("health: the engine loop has made no progress for %.0f s", stalled)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        from workbench import __version__

        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": serving.name,
            "object": "model",
            "created": serving.created,
            "owned_by": "workbench",
            "root": str(llm.engine.config.model),
            "parent": None,  # (vLLM's is a LoRA adapter's base model; there are no adapters here)
            "max_model_len": llm.max_model_len,
            "permission": [_model_permission()],
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        if sink is None:
            raise APIError("this server was started without metrics", 404)
        return Response(sink.render(), media_type=sink.CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_request(req)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give exactly one of 'prompt' and 'messages'", 400, "prompt")
        if req.messages is not None:
            msgs = _checked_messages(req.messages)
            ids, _ = await serving.tokenize(msgs, "messages", add_generation_prompt=req.add_generation_prompt)
        else:
            ids, _ = await serving.tokenize(req.prompt, "prompt", add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_request(req)
        vocab = llm.engine.hf_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", 400, "tokens")
        return {"prompt": await serving.detokenize(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        serving.check_request(req)
        if req.suffix is not None:
            raise APIError("suffix is not supported by this model; leave it out", 400, "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(f"best_of={req.best_of} is not supported; use n (got n={req.n})", 400, "best_of")
        prompts = req.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError("prompt is empty; give a string, a list of strings or token ids", 400, "prompt")
        toks = [await serving.tokenize(p, "prompt") for p in prompts]
        if req.echo and llm.tokenizer is None and any(t[1] is None for t in toks):
            raise APIError("echo of token ids needs a tokenizer to decode them; this model has none", 400, "echo")
        # echo (as vLLM): the text begins with the prompt, and the logprobs cover its tokens (prompt_logprobs
        # of the same depth, the first token's null); max_tokens=0 echoes the prompt alone (one token is
        # generated, counted in usage and not shown, as vLLM does)
        prompt_only = req.echo and req.max_tokens == 0
        limit = 1 if prompt_only else 16 if req.max_tokens is None else req.max_tokens  # (null: 16, as vLLM)
        prompt_lps = req.logprobs if req.echo and req.prompt_logprobs is None else None
        sps = [
            serving.sampling_params(
                req, serving.max_tokens(len(t[0]), limit, "prompt"), req.logprobs, req.stream, prompt_lps
            )
            for t in toks
        ]
        rid = serving.request_id(req, http, "cmpl")
        jobs = [(f"{rid}-{i}", t, sp, req.priority) for i, (t, sp) in enumerate(zip(toks, sps))]
        serving.admit(jobs)
        texts = [t[1] if t[1] is not None else await serving.detokenize(t[0]) for t in toks] if req.echo else []
        decode = llm.tokenizer.decode if llm.tokenizer is not None else None
        n = req.n
        n_prompt = sum(len(t[0]) for t in toks)
        fp = serving.system_fingerprint
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": serving.name}

        def with_echo(i: int, out: RequestOutput, c) -> tuple[str, list[int], list | None]:
            """The text, token ids and log-probability positions a choice reports (with ``echo``, the prompt's first)."""
            if not req.echo:
                return c.text, c.token_ids, c.logprobs
            ids, lps = toks[i][0], out.prompt_logprobs
            if prompt_only:
                return texts[i], ids, lps
            return texts[i] + c.text, ids + c.token_ids, (lps or []) + (c.logprobs or [])

        if req.stream:
            usage, running = _usage_options(req.stream_options)
            offsets: dict[int, int] = {}
            echoed: set[int] = set()
            counts: dict[int, int] = {}  # output tokens so far, per choice

            def chunks(i: int, out: RequestOutput):
                for c in _choices_with_news(out):  # one choice per chunk
                    idx = i * n + c.index
                    counts[idx] = counts.get(idx, 0) + len(c.token_ids)
                    if idx in echoed:
                        text, ids, positions = c.text, c.token_ids, c.logprobs
                    else:  # this choice's first chunk: with echo, the prompt comes first
                        echoed.add(idx)
                        text, ids, positions = with_echo(i, out, c)
                    lp = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(ids, positions or [], offsets.get(idx, 0), decode)
                        if lp["tokens"]:  # the next offset: after the tokens reported (text may be held back)
                            offsets[idx] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    choice = {"index": idx, "text": text, "logprobs": lp} | _finish(c)
                    chunk = {**head, "choices": [choice | {"prompt_token_ids": None, "token_ids": None}]}
                    if running:  # stream_options.continuous_usage_stats: this choice's usage so far
                        chunk["usage"] = _usage(len(toks[i][0]), counts[idx], details=False)
                    # the fingerprint in a choice's last chunk, unless a usage chunk comes last (as vLLM)
                    yield chunk | (_fingerprint(fp) if c.finish_reason is not None and not usage else {})

            events = _event_stream(serving, jobs, "prompt", head, n_prompt, usage, chunks)
            return StreamingResponse(events, media_type="text/event-stream")
        outs = await serving.run_all(http, jobs)
        if outs is None:
            return Response(status_code=499)  # (nginx's "client closed request"; nobody reads it)
        choices, n_out = [], 0
        for i, out in enumerate(outs):
            if out.error:
                raise _request_error(out, "prompt")
            for c in out.outputs:
                n_out += len(c.token_ids)
                text, ids, positions = with_echo(i, out, c)
                lp = completion_logprobs(ids, positions or [], 0, decode) if req.logprobs is not None else None
                choices.append(
                    {
                        "index": i * n + c.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                        "token_ids": None,
                        "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
                        "prompt_token_ids": None,
                        "routed_experts": None,
                    }
                )
        return {
            **head,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": fp,
            "usage": _usage(n_prompt, n_out),
            **_NO_KV_TRANSFER,
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request):
        serving.check_request(req)
        if req.tools:
            raise APIError("tools are not supported by this server; leave 'tools' out", 400, "tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", 400, "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(f"top_logprobs={req.top_logprobs} must be in [0, 20]", 400, "top_logprobs")
        msgs = _checked_messages(req.messages)
        tok = await serving.tokenize(msgs, "messages", add_generation_prompt=req.add_generation_prompt)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        top = req.top_logprobs or 0
        # vLLM's echo asks for the prompt's logprobs (top_logprobs deep) and returns them in the response; a
        # stream has no place for them, so a streamed echo does not compute them (nobody could see them)
        prompt_lps = top if req.echo and req.prompt_logprobs is None and not req.stream else None
        max_tokens = serving.max_tokens(len(tok[0]), limit, "messages")
        sp = serving.sampling_params(req, max_tokens, logprobs, req.stream, prompt_lps)
        rid = serving.request_id(req, http, "chatcmpl")
        jobs = [(rid, tok, sp, req.priority)]
        serving.admit(jobs)
        n_prompt = len(tok[0])
        fp = serving.system_fingerprint
        # the answer's role: the assistant's, or (add_generation_prompt=false) the last message's, as vLLM
        role = "assistant" if req.add_generation_prompt else req.messages[-1].role
        echo = _echoed_content(req.messages[-1], role) if req.echo else ""
        head = {"id": rid, "object": "chat.completion.chunk" if req.stream else "chat.completion"}
        head |= {"created": int(time.time()), "model": serving.name}
        if req.stream:
            usage, running = _usage_options(req.stream_options)
            started: list[bool] = []
            counts = [0] * req.n  # output tokens so far, per choice

            def so_far(k: int) -> dict:  # stream_options.continuous_usage_stats: choice k's usage so far
                return {"usage": _usage(n_prompt, counts[k], details=False) | _NO_DETAILS} if running else {}

            def chunks(i: int, out: RequestOutput):
                if not started:  # the role first, for every choice, then the echo (as vLLM)
                    started.append(True)
                    for k in range(req.n):
                        first = {"index": k, "delta": {"role": role, "content": ""}, "logprobs": None}
                        yield {**head, "choices": [first | {"finish_reason": None}]} | so_far(k) | _NO_PROMPT
                    for k in range(req.n if echo else 0):
                        choice = {"index": k, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
                        yield {**head, "choices": [choice]} | so_far(k)
                for c in _choices_with_news(out):  # one choice per chunk
                    counts[c.index] += len(c.token_ids)
                    choice = {"index": c.index, "delta": {"content": c.text}, "logprobs": chat_logprobs(c, top)}
                    if c.finish_reason is None:  # (vLLM: finish_reason null, no stop_reason, until the last)
                        yield {**head, "choices": [choice | {"finish_reason": None, "token_ids": None}]} | so_far(
                            c.index
                        )
                    else:  # the choice's last chunk: with the fingerprint, unless a usage chunk comes last
                        chunk = {**head, "choices": [choice | _finish(c) | {"token_ids": None}]} | so_far(c.index)
                        yield chunk | (_fingerprint(fp) if not usage else {})

            events = _event_stream(serving, jobs, "messages", head, n_prompt, usage, chunks)
            return StreamingResponse(events, media_type="text/event-stream")
        outs = await serving.run_all(http, jobs)
        if outs is None:
            return Response(status_code=499)
        (out,) = outs
        if out.error:
            raise _request_error(out, "messages")
        choices = [
            {
                "index": c.index,
                "message": {"role": role, "content": echo + c.text} | _NO_MESSAGE_EXTRAS,
                "logprobs": chat_logprobs(c, top),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": None,
                "routed_experts": None,
            }
            for c in out.outputs
        ]
        n_out = sum(len(c.token_ids) for c in out.outputs)
        return {
            **head,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": fp,
            "usage": _usage(n_prompt, n_out),
            "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs),
            **_NO_PROMPT,
            **_NO_KV_TRANSFER,
        }

    app.openapi = lambda: _openapi(app, guarded=bool(api_key))
    return app


#: OpenAI's error body, as :class:`APIError` writes it
_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "integer"},
            },
        }
    },
}

#: what each route answers besides 200, as the handlers above do (the OpenAPI document lists these, not
#: FastAPI's default 422, which this server never sends: a bad body is a 400 naming the field)
_ERRORS = {
    "/v1/completions": {
        400: "an invalid field (named in param), or a prompt past max_model_len",
        404: "an unknown model",
        413: "a body past --max-request-body-bytes",
        500: "the request failed while it ran (only it: the engine serves the others)",
        503: "the engine has stopped; the server is exiting",
    },
    "/tokenize": {400: "an invalid field", 404: "an unknown model", 413: "a body past --max-request-body-bytes"},
    "/metrics": {404: "the server runs without metrics"},
    "/health": {503: "the engine has stopped, or made no progress for too long"},
}
_ERRORS["/v1/chat/completions"] = _ERRORS["/v1/completions"]
_ERRORS["/detokenize"] = _ERRORS["/tokenize"]
#: the 200 answers that are not JSON
_OK_CONTENT = {"/health": None, "/metrics": "text/plain"}


def _openapi(app: FastAPI, guarded: bool) -> dict:
    """The OpenAPI document of ``app``, with the status codes and content types the server sends."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    doc.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = _ERROR_SCHEMA
    for c in ("HTTPValidationError", "ValidationError"):
        doc["components"]["schemas"].pop(c, None)
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, ops in doc["paths"].items():
        for op in ops.values():
            responses = op["responses"]
            responses.pop("422", None)
            ok = responses.get("200", {})
            if path in _OK_CONTENT:
                kind = _OK_CONTENT[path]
                ok.pop("content", None)
                if kind:
                    ok["content"] = {kind: {}}
            if path in ("/v1/completions", "/v1/chat/completions"):
                ok["content"]["text/event-stream"] = {}  # server-sent events: a stream of JSON chunks
            for status, why in _ERRORS.get(path, {}).items():
                responses[str(status)] = {"description": why} | ({"content": ref} if path != "/health" else {})
            if path.startswith("/admin/"):
                responses["400"] = {"description": "an invalid value", "content": ref}
            if guarded and path.startswith(("/v1", "/admin")):
                responses["401"] = {"description": "a missing or wrong API key", "content": ref}
    app.openapi_schema = doc
    return doc


class _GracefulServer:
    """uvicorn's server, plus the abort of requests still running ``grace`` seconds after the signal
    to stop: their streams then end with ``finish_reason="abort"`` and ``[DONE]`` instead of being
    cut by uvicorn's task cancellation."""

    def __new__(cls, config, llm: AsyncLLM, grace: float):
        import uvicorn

        class Server(uvicorn.Server):
            timer: threading.Timer | None = None

            def handle_exit(self, sig, frame) -> None:
                super().handle_exit(sig, frame)
                if self.timer is None:
                    log.info("shutting down: in-flight requests have %.0f s to finish, then are aborted", grace)
                    self.timer = threading.Timer(grace, llm.abort_all)
                    self.timer.daemon = True
                    self.timer.start()

        return Server(config)


def add_admin_routes(app: FastAPI, llm: AsyncLLM, serving: OpenAIServing | None = None) -> None:
    """The operator's actions, run on the engine thread between steps (``workbench serve --enable-admin-api``; what an
    alert's receiver calls, ``workbench.server.alert_receiver``):

    * ``GET /admin/state``: ``max_num_seqs`` now and as configured, the allocator, compaction passes so far;
    * ``POST /admin/compact`` ``{"max_moves": N}`` (optional): one KV compaction pass now (``LLMEngine.compact``);
      its blocks and bytes moved, the largest free run before and after, the copies' seconds;
    * ``POST /admin/max_num_seqs`` ``{"max_num_seqs": N}``: admit at most N running requests from the next step
      (1 .. the configured ``max_num_seqs``; running requests above N are not preempted, they finish);
    * ``POST /admin/max_num_queued_reqs`` ``{"max_num_queued_reqs": N}`` (or ``null``: no limit): from the next
      request on, refuse new requests with 503 while N are in flight (``--max-num-queued-reqs``, vLLM's load-shedding
      valve); requests already in flight are kept.

    Bad values answer 400 naming the value and the range; an allocator that cannot move blocks answers 400.
    vLLM has no such endpoints (its development endpoints, e.g. ``/reset_prefix_cache``, are behind
    ``VLLM_SERVER_DEV_MODE=1``); these exist for the course's alert-to-action loop.
    """

    def state(eng) -> dict:
        return {
            "max_num_seqs": eng.scheduler.max_num_seqs,
            "configured_max_num_seqs": eng.config.max_num_seqs,
            "kv_allocator": eng.config.kv_allocator,
            "compaction_passes": len(eng.defrag.passes),
            "num_requests_running": len(eng.scheduler.running),
            "num_requests_waiting": len(eng.scheduler.waiting),
            "max_num_queued_reqs": serving.max_num_queued_reqs if serving is not None else None,
            "configured_max_num_queued_reqs": eng.config.max_num_queued_reqs,
        }

    async def body_of(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as e:
            raise APIError(f"the body is not valid JSON ({e}); send one JSON object", 400) from None
        if not isinstance(body, dict):
            raise APIError("the body must be a JSON object", 400)
        return body

    @app.get("/admin/state")
    async def admin_state():
        return await asyncio.to_thread(llm.call, state)

    @app.post("/admin/compact")
    async def admin_compact(request: Request):
        mm = (await body_of(request)).get("max_moves")
        if mm is not None and (isinstance(mm, bool) or not isinstance(mm, int) or mm < 1):
            raise APIError(f"max_moves={mm!r} must be a whole number of block moves >= 1, or absent", 400, "max_moves")
        try:
            p = await asyncio.to_thread(llm.call, lambda eng: eng.compact(mm))
        except NotImplementedError as e:
            raise APIError(f"{e}; run the server with an allocator that moves blocks (e.g. paged)", 400) from None
        if p is None:
            return {"blocks_moved": 0, "bytes_moved": 0}
        keys = ("blocks_moved", "bytes_moved", "largest_run_before", "largest_run_after", "gap_before", "gap_after")
        return {k: getattr(p, k) for k in keys} | {"copy_time_s": p.copy_time_s}

    @app.post("/admin/max_num_seqs")
    async def admin_max_num_seqs(request: Request):
        n = (await body_of(request)).get("max_num_seqs")

        def apply(eng):
            top = eng.config.max_num_seqs
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= top:
                raise APIError(f"max_num_seqs={n!r} must be a whole number in [1, {top}] (the configured one)", 400)
            old, eng.scheduler.max_num_seqs = eng.scheduler.max_num_seqs, n
            log.warning("admin: max_num_seqs %d -> %d", old, n)
            return {"max_num_seqs": n, "previous": old}

        return await asyncio.to_thread(llm.call, apply)

    @app.post("/admin/max_num_queued_reqs")
    async def admin_max_num_queued_reqs(request: Request):
        body = await body_of(request)
        if serving is None:
            raise APIError("this app has no OpenAI serving layer to limit", 400)
        if "max_num_queued_reqs" not in body:
            raise APIError(
                'max_num_queued_reqs is missing: send {"max_num_queued_reqs": N} (N >= 0; 0 refuses every request) '
                "or null for no limit",
                400,
                "max_num_queued_reqs",
            )
        n = body["max_num_queued_reqs"]
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise APIError(
                f"max_num_queued_reqs={n!r} must be a whole number >= 0 (requests in flight), or null for no limit",
                400,
                "max_num_queued_reqs",
            )
        old, serving.max_num_queued_reqs = serving.max_num_queued_reqs, n
        log.warning("admin: max_num_queued_reqs %s -> %s", old, n)
        return {"max_num_queued_reqs": n, "previous": old}


def run_server(
    engine_args: dict,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "info",
    graceful_shutdown_timeout: float = 5.0,
    api_key: str | None = None,
    enable_admin_api: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> None:
    """Load the engine, then serve until SIGINT / SIGTERM (blocks); ``enable_admin_api``: :func:`add_admin_routes`.

    Raises:
        ValueError / FileNotFoundError: a bad engine argument, before anything listens.
        EngineDeadError: the engine stopped on an error no request can be blamed for (a tensor-parallel
            worker died, a failed forward pass); the server has shut down (``workbench serve`` exits 1,
            so that a supervisor restarts it, as vLLM's does).
    """
    import uvicorn

    llm = AsyncLLM(**engine_args)
    try:
        name = served_model_name or llm.engine.config.model
        sink = PrometheusSink(name, engine=llm.engine)
        llm.engine.recorder.add_sink(sink)
        app = build_app(
            llm, name, sink, api_key, enable_admin_api=enable_admin_api, max_request_body_bytes=max_request_body_bytes
        )
        log.info(
            "serving %s on http://%s:%d (OpenAI-compatible: /v1/completions, /v1/chat/completions; "
            "Prometheus: /metrics)",
            name,
            host,
            port,
        )
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=graceful_shutdown_timeout + 30,  # (a backstop: we abort at the timeout)
            access_log=log_level == "debug",
        )
        # uvicorn handles SIGINT / SIGTERM while it runs (graceful shutdown, then our lifespan's
        # llm.shutdown()) and re-raises the signal afterwards, to the handlers found before: these
        # no-ops, so that the process ends normally (exit 0) after a clean shutdown
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        server = _GracefulServer(config, llm, graceful_shutdown_timeout)

        def engine_died(e: BaseException) -> None:  # (on the engine thread) as vLLM: exit so a supervisor restarts us
            sink.engine_stopped()
            log.error("the engine stopped (%s: %s); the server shuts down and exits with status 1", type(e).__name__, e)
            server.should_exit = True

        llm.on_dead.append(engine_died)
        server.run()
    finally:
        llm.shutdown()
    if llm.dead is not None:
        raise EngineDeadError(f"the engine stopped: {type(llm.dead).__name__}: {llm.dead}")


__all__ = ["OpenAIServing", "add_admin_routes", "build_app", "run_server"]
