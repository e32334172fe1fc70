"""``workbench serve``'s answers in vLLM 0.32's shapes, through the official ``openai`` client and raw JSON:
the keys of every response and stream chunk (lists copied from vLLM's pydantic models, as vLLM serializes them),
``echo`` on both endpoints, ``system_fingerprint``, greedy sampling with ``n > 1`` refused, ``/v1/models``.

The app runs in-process (FastAPI's ``TestClient`` as the ``openai`` client's HTTP client) over one ``AsyncLLM``
of the bundled model; nothing is written to disk.
"""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"

# ------------------------------------------------------------------ vLLM 0.32's keys, as its server sends them
# non-streaming bodies are ``model_dump()`` (every field, null or not): vllm/entrypoints/openai/completion/protocol.py
# (CompletionResponse, CompletionResponseChoice, CompletionLogProbs), chat_completion/protocol.py
# (ChatCompletionResponse, ChatCompletionResponseChoice, ChatMessage), serve/engine/protocol.py (UsageInfo, ModelCard,
# ModelPermission)
COMPLETION = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
              "kv_transfer_params", "ec_transfer_params", "metrics"]  # fmt: skip
COMPLETION_CHOICE = ["index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                     "prompt_token_ids", "routed_experts"]  # fmt: skip
COMPLETION_LOGPROBS = ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
USAGE = ["prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details", "completion_tokens_details"]
CHAT = ["id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
        "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"]  # fmt: skip
CHAT_CHOICE = ["index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts"]
CHAT_MESSAGE = ["role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"]
MODEL_CARD = ["id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"]
MODEL_PERMISSION = ["id", "object", "created", "allow_create_engine", "allow_sampling", "allow_logprobs",
                    "allow_search_indices", "allow_view", "allow_fine_tuning", "organization", "group", "is_blocking"]  # fmt: skip
# stream chunks are ``model_dump_json(exclude_unset=True)`` of what serving_completion.py / serving.py construct;
# the usage chunk ``exclude_none=True``; the fingerprint is set on a choice's last chunk unless a usage chunk follows
COMPLETION_CHUNK = ["id", "object", "created", "model", "choices"]
COMPLETION_CHUNK_CHOICE = ["index", "text", "logprobs", "finish_reason", "stop_reason", "prompt_token_ids", "token_ids"]
USAGE_CHUNK = ["id", "object", "created", "model", "choices", "usage", "system_fingerprint"]
USAGE_IN_CHUNK = ["prompt_tokens", "total_tokens", "completion_tokens"]
CHAT_ROLE_CHUNK = ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
CHAT_ROLE_CHOICE = ["index", "delta", "logprobs", "finish_reason"]  # also the echo chunk's choice
CHAT_CHUNK = ["id", "object", "created", "model", "choices"]
CHAT_CHUNK_CHOICE = ["index", "delta", "logprobs", "finish_reason", "token_ids"]
CHAT_LAST_CHOICE = ["index", "delta", "logprobs", "finish_reason", "stop_reason", "token_ids"]


@pytest.fixture(scope="module")
def app_client():
    from fastapi.testclient import TestClient

    from workbench import AsyncLLM
    from workbench.server.api_server import build_app

    llm = AsyncLLM(max_model_len=256, max_num_seqs=8)
    try:
        yield llm, TestClient(build_app(llm, MODEL))  # (not entered: the lifespan would shut the engine down here)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def http(app_client):
    return app_client[1]


@pytest.fixture(scope="module")
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="-", http_client=http, max_retries=0)


def sse(http, path: str, body: dict) -> list[dict]:
    """The JSON chunks of a streamed answer (``[DONE]`` last, checked and dropped)."""
    r = http.post(path, json={"model": MODEL, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = [line[len("data: ") :] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def post(http, path: str, body: dict) -> dict:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------ key sets
def test_completion_keys_are_vllms(http):
    r = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1})
    assert list(r) == COMPLETION and list(r["usage"]) == USAGE
    (c,) = r["choices"]
    assert list(c) == COMPLETION_CHOICE and list(c["logprobs"]) == COMPLETION_LOGPROBS
    assert c["stop_reason"] is None and c["prompt_logprobs"] is None and c["token_ids"] is None
    assert r["service_tier"] is None and r["metrics"] is None

    chunks = sse(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    for ch in chunks[:-1]:
        assert list(ch) == COMPLETION_CHUNK and list(ch["choices"][0]) == COMPLETION_CHUNK_CHOICE
    assert list(chunks[-1]) == COMPLETION_CHUNK + ["system_fingerprint"]  # the last, without a usage chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    chunks = sse(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                           "stream_options": {"include_usage": True}})  # fmt: skip
    assert all(list(ch) == COMPLETION_CHUNK for ch in chunks[:-1])  # the fingerprint goes to the usage chunk
    assert list(chunks[-1]) == USAGE_CHUNK and list(chunks[-1]["usage"]) == USAGE_IN_CHUNK
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_keys_are_vllms_and_stop_reason_only_ends_a_stream(http):
    msgs = [{"role": "user", "content": "Name three colours."}]
    r = post(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "temperature": 0})
    assert list(r) == CHAT and list(r["usage"]) == USAGE
    (c,) = r["choices"]
    assert list(c) == CHAT_CHOICE and list(c["message"]) == CHAT_MESSAGE
    assert r["prompt_logprobs"] is None and r["prompt_text"] is None

    chunks = sse(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0.8, "n": 2,
                                                "seed": 7})  # fmt: skip
    roles = [ch for ch in chunks if "role" in ch["choices"][0]["delta"]]
    assert [ch["choices"][0]["index"] for ch in roles] == [0, 1] and chunks[:2] == roles
    for ch in roles:
        assert list(ch) == CHAT_ROLE_CHUNK and list(ch["choices"][0]) == CHAT_ROLE_CHOICE
        assert ch["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for k in (0, 1):
        mine = [ch for ch in chunks[2:] if ch["choices"][0]["index"] == k]
        for ch in mine[:-1]:
            assert list(ch) == CHAT_CHUNK and list(ch["choices"][0]) == CHAT_CHUNK_CHOICE
            assert ch["choices"][0]["finish_reason"] is None and list(ch["choices"][0]["delta"]) == ["content"]
        assert list(mine[-1]) == CHAT_CHUNK + ["system_fingerprint"]
        assert list(mine[-1]["choices"][0]) == CHAT_LAST_CHOICE and mine[-1]["choices"][0]["finish_reason"] == "length"

    chunks = sse(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "temperature": 0,
                                                "stream_options": {"include_usage": True}})  # fmt: skip
    assert list(chunks[-1]) == USAGE_CHUNK and list(chunks[-1]["usage"]) == USAGE_IN_CHUNK
    assert "system_fingerprint" not in chunks[-2]


def test_models_card_is_vllms(client, http):
    r = http.get("/v1/models").json()
    (card,) = r["data"]
    assert list(r) == ["object", "data"] and list(card) == MODEL_CARD
    (perm,) = card["permission"]
    assert list(perm) == MODEL_PERMISSION and perm["object"] == "model_permission"
    assert perm["id"].startswith("modelperm-") and perm["group"] is None and perm["allow_sampling"] is True
    assert card["parent"] is None and card["max_model_len"] == 256 and card["root"] == MODEL
    assert client.models.list().data[0].id == MODEL


def test_system_fingerprint_is_the_servers_and_stable(client):
    a = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert a.system_fingerprint == b.system_fingerprint
    assert a.system_fingerprint.startswith("workbench-") and len(a.system_fingerprint.rsplit("-", 1)[1]) == 8


# ------------------------------------------------------------------ greedy sampling with n > 1
@pytest.mark.parametrize("temperature", [0, 1e-6])
def test_greedy_with_n_above_one_is_refused_as_vllm(client, app_client, temperature):
    for create in (
        lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=temperature, n=2),
        lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=temperature, n=3,
            stream=True,
        ),
    ):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.status_code == 400
        assert e.value.body["message"].startswith("n must be 1 when using greedy sampling, got ")
        assert e.value.body["param"] == "n"
    assert app_client[0].running_ids() == []  # refused before anything was queued
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=temperature, n=1)
    assert len(ok.choices) == 1


def test_prompt_logprobs_cannot_stream_as_vllm(http):
    r = http.post("/v1/completions", json={"prompt": PROMPT, "stream": True, "prompt_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert "not available when `stream=True`" in r.json()["error"]["message"]


# ------------------------------------------------------------------ echo
def test_completion_echo_begins_with_the_prompt_and_its_logprobs(client, http):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=2)
    n_prompt = r.usage.prompt_tokens
    c = r.choices[0]
    assert c.text == PROMPT + plain.choices[0].text and r.usage.completion_tokens == 4
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 4 and "".join(lp.tokens) == c.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first prompt token has none
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[n_prompt] == len(PROMPT)
    assert all(len(t) in (2, 3) for t in lp.top_logprobs[1:])  # the top 2, plus the chosen token
    pl = c.model_extra["prompt_logprobs"]  # vLLM's choice field: the prompt's, as the engine gave them
    assert len(pl) == n_prompt and pl[0] is None
    for tok_text, value, pos in zip(lp.tokens[1:n_prompt], lp.token_logprobs[1:n_prompt], pl[1:]):
        chosen = [x for x in pos.values() if x["decoded_token"] == tok_text]
        assert chosen and chosen[0]["logprob"] == pytest.approx(value)

    # streamed: the prompt comes in the first chunk with the first token; the rest as without echo
    chunks = sse(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True,
                                           "logprobs": 2})  # fmt: skip
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == c.text
    tokens = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for ch in chunks for o in ch["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == lp.tokens and offsets == lp.text_offset

    # without logprobs: only the text
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text == c.text and r.choices[0].logprobs is None


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    for prompt, text in ((PROMPT, PROMPT), (ids, http.post("/detokenize", json={"tokens": ids}).json()["prompt"])):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0, temperature=0)
        c = r.choices[0]
        assert c.text == text and c.finish_reason == "length"
        assert len(c.logprobs.tokens) == len(ids) and c.logprobs.token_logprobs[0] is None
        assert r.usage.completion_tokens == 1  # vLLM generates one token it does not show, and counts it
    chunks = sse(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert [ch["choices"][0]["text"] for ch in chunks] == [PROMPT]
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(openai.BadRequestError):  # without echo, max_tokens=0 stays refused (as vLLM)
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)


def test_chat_echo_repeats_the_last_message_of_the_answers_role(client, http):
    user = [{"role": "user", "content": "Name three colours."}]
    plain = client.chat.completions.create(model=MODEL, messages=user, max_tokens=4, temperature=0)
    same = client.chat.completions.create(model=MODEL, messages=user, max_tokens=4, temperature=0,
                                          extra_body={"echo": True})  # fmt: skip
    assert same.choices[0].message.content == plain.choices[0].message.content  # a user message is not echoed
    assert same.model_extra["prompt_logprobs"][0] is None  # vLLM's echo asks for the prompt's logprobs

    prefill = user + [{"role": "assistant", "content": [{"type": "text", "text": "Red,"}, {"type": "text",
                                                                                          "text": "green"}]}]  # fmt: skip
    body = {"messages": prefill, "max_tokens": 4, "temperature": 0, "add_generation_prompt": False}
    bare = post(http, "/v1/chat/completions", body)
    r = post(http, "/v1/chat/completions", {**body, "echo": True})
    (c,) = r["choices"]
    assert c["message"]["role"] == "assistant"  # the last message's role, without a generation prompt
    assert c["message"]["content"] == "Red,\ngreen" + bare["choices"][0]["message"]["content"]

    chunks = sse(http, "/v1/chat/completions", {**body, "echo": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["delta"] == {"content": "Red,\ngreen"}
    assert list(chunks[1]["choices"][0]) == CHAT_ROLE_CHOICE and list(chunks[1]) == CHAT_CHUNK
    assert "".join(ch["choices"][0]["delta"]["content"] for ch in chunks) == c["message"]["content"]


# ------------------------------------------------------------------ usage in every chunk, max_tokens null
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(http):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream_options": opts})
    n_prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert [list(ch) for ch in chunks[:-1]] == [COMPLETION_CHUNK + ["usage"]] * 3
    assert [ch["usage"] for ch in chunks[:-1]] == [
        {"prompt_tokens": n_prompt, "total_tokens": n_prompt + k, "completion_tokens": k} for k in (1, 2, 3)
    ]
    msgs = [{"role": "user", "content": "Hi"}]
    chunks = sse(http, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "temperature": 0,
                                                "stream_options": opts})  # fmt: skip
    assert list(chunks[0]) == CHAT_CHUNK + ["usage", "prompt_token_ids", "prompt_text"]
    assert [ch["usage"]["completion_tokens"] for ch in chunks[:-1]] == [0, 1, 2]
    assert list(chunks[1]["usage"]) == USAGE_IN_CHUNK + ["completion_tokens_details"]
    assert list(chunks[-1]) == USAGE_CHUNK
    chunks = sse(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                           "stream_options": {"continuous_usage_stats": True}})  # fmt: skip
    assert all("usage" not in ch for ch in chunks)  # (it needs include_usage, as vLLM)


def test_a_null_max_tokens_is_16_on_completions_as_vllm(http):
    r = post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": None, "temperature": 0, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == 16


def test_x_request_id_header_names_the_request_as_vllm(http):
    # vLLM takes the id from the X-Request-Id header first (``vllm bench serve`` sends <prefix><index> there)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                  headers={"X-Request-Id": "bench-abc-7"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "bench-abc-7"
    r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}, headers={"X-Request-Id": "bench-abc-8"})  # fmt: skip
    assert r.status_code == 200 and r.json()["id"] == "bench-abc-8"
