"""``workbench serve`` through the official ``openai`` client, on loopback.

One server process (the bundled model, ``max_model_len=512``) serves every test here; its greedy
outputs are compared with the offline ``LLM`` of the same engine arguments, one request at a time
(the same batch shapes, so the same floating-point sums). The server is stopped by its PID at the
end, also when a test fails.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workbench import LLM, SamplingParams
from workbench.server.launcher import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.server]

ENGINE = dict(max_model_len=512, max_num_seqs=16)
PROMPTS = ["The capital of France is", "A short poem about the sea:\n", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server():
    with ServerProcess(threads=1, **ENGINE) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    llm = LLM(**ENGINE)
    yield llm
    llm.shutdown()


def metrics(server) -> dict:
    """``{name: family}`` of the server's /metrics, parsed with prometheus-client's parser."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(fams: dict, name: str, suffix: str = "", **labels) -> float:
    """Sum of the samples ``name + suffix`` whose labels include ``labels``."""
    fam = fams[name]
    return sum(
        s.value for s in fam.samples if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


def streamed_text(stream) -> tuple[dict[int, str], list]:
    texts: dict[int, str] = {}
    chunks = list(stream)
    for ch in chunks:
        for c in ch.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
    return texts, chunks


# ----------------------------------------------------------------------------- basics
def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["smollm2-135m"]
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert "version" in httpx.get(server.base_url + "/version").json()


def test_completions_greedy_equal_offline_streamed_and_not(client, offline):
    for prompt in PROMPTS:
        want = offline.generate(prompt, SamplingParams(max_tokens=24))[0].outputs[0]
        got = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == want.finish_reason
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == len(offline.llm_engine.tokenize(prompt)[0])
        assert got.id.startswith("cmpl-") and got.object == "text_completion"
        stream = client.completions.create(
            model="smollm2-135m",
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        texts, chunks = streamed_text(stream)
        assert texts[0] == want.text
        assert chunks[-1].usage.completion_tokens == len(want.token_ids)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason


def test_chat_applies_the_template_and_streams_the_same_text(client, offline):
    want = offline.chat(CHAT, SamplingParams(max_tokens=32))[0].outputs[0]
    got = client.chat.completions.create(model="smollm2-135m", messages=CHAT, max_tokens=32, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].message.role == "assistant"
    assert got.object == "chat.completion"
    stream = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=32, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    texts, chunks = streamed_text(stream)
    assert texts[0] == want.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_n_choices_with_a_seed_reproduce(client):
    kw = dict(model="smollm2-135m", prompt=PROMPTS[1], max_tokens=16, temperature=0.9, n=3, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1, "three samples at temperature 0.9 should not all agree"
    texts, _ = streamed_text(client.completions.create(**kw, stream=True))
    assert [texts[i] for i in range(3)] == [c.text for c in a.choices]


def test_a_batch_of_prompts_gets_one_choice_block_per_prompt(client, offline):
    # (temperature=0 with n=2 is refused, as vLLM; top_k=1 samples the argmax all the same)
    got = client.completions.create(
        model="smollm2-135m", prompt=PROMPTS[:2], max_tokens=8, n=2, extra_body={"top_k": 1}
    )  # fmt: skip
    assert [c.index for c in sorted(got.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in got.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # top_k=1: n copies agree


def test_stop_strings_are_trimmed_and_reported(client, offline):
    full = offline.generate(PROMPTS[0], SamplingParams(max_tokens=24))[0].outputs[0].text
    stop = full[6:9]
    got = client.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    c = got.choices[0]
    assert c.text == full[: full.index(stop)]
    assert c.finish_reason == "stop"
    assert c.model_extra["stop_reason"] == stop
    kept = client.completions.create(
        model="smollm2-135m", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=stop,
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text == full[: full.index(stop) + len(stop)]
    texts, _ = streamed_text(
        client.completions.create(
            model="smollm2-135m", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop], stream=True
        )
    )
    assert texts[0] == c.text


def test_logprobs_match_the_engine(client, offline):
    want = offline.generate(PROMPTS[2], SamplingParams(max_tokens=8, logprobs=3))[0].outputs[0]
    got = client.completions.create(model="smollm2-135m", prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == len(want.token_ids) == 8
    for tid, pos, value_, top in zip(want.token_ids, want.logprobs, lp.token_logprobs, lp.top_logprobs):
        assert value_ == pytest.approx(pos[tid].logprob, abs=1e-4)
        assert len(top) in (3, 4)  # the top 3, plus the chosen token when it is not among them
    assert "".join(lp.tokens) == got.choices[0].text
    chat = client.chat.completions.create(
        model="smollm2-135m", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 6
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)  # greedy: rank 1


def test_tokenize_and_detokenize_round_trip(server, offline):
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["tokens"] == offline.llm_engine.tokenize(PROMPTS[0])[0]
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    back = httpx.post(server.base_url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPTS[0]
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > 10


# ----------------------------------------------------------------------------- bad input
BAD_FIELDS = [
    (dict(temperature=-1), "temperature", "temperature=-1"),
    (dict(top_p=1.5), "top_p", "top_p=1.5"),
    (dict(top_k=-5), "top_k", "top_k=-5"),
    (dict(n=0), "n", "n=0"),
    (dict(presence_penalty=3), "presence_penalty", "presence_penalty=3"),
    (dict(max_tokens=0), "max_tokens", "max_tokens=0"),
    (dict(max_tokens=600), "max_tokens", "512"),
    (dict(logprobs=30), "logprobs", "logprobs=30"),
    (dict(seed=2**64), "seed", "seed"),
]


def bad_completion(client, prompt: str, fields: dict):
    """A completion with ``fields``; vLLM's extra fields (``top_k``) go in ``extra_body`` as users send them."""
    extra = {k: v for k, v in fields.items() if k == "top_k"}
    std = {k: v for k, v in fields.items() if k not in extra}
    return client.completions.create(model="smollm2-135m", prompt=prompt, extra_body=extra, **{"max_tokens": 4, **std})


@pytest.mark.parametrize("fields,param,text", BAD_FIELDS)
def test_invalid_fields_are_400_naming_the_field(client, fields, param, text):
    with pytest.raises(openai.BadRequestError) as e:
        bad_completion(client, "Hello", fields)
    err = e.value.body
    assert e.value.status_code == 400
    assert err["param"] == param and err["type"] == "BadRequestError" and err["code"] == 400
    assert text in err["message"]


def test_raw_bad_bodies_are_400_with_openai_error_shape(server):
    url = server.base_url + "/v1/completions"
    cases = [
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": "1"}, "temperature"),
        ({"prompt": [1.7, 2]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": "x", "priority": 1}, "priority"),  # the server runs scheduling_policy fcfs
        ({"prompt": "x", "n": 2, "top_p": 0}, "top_p"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "n": 1000}, "n"),  # n <= max_num_seqs
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ]
    for body, param in cases:
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param, (body, err)
    r = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, content=b'{"prompt": "x"}', headers={"Content-Type": "text/plain"}, timeout=30)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
    chat = {"messages": CHAT, "logprobs": True, "top_logprobs": 50}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    for method, path, status in (("GET", "/v1/completions", 405), ("GET", "/v1/nothing", 404)):
        r = httpx.request(method, server.base_url + path, timeout=30)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_prompt_past_max_model_len_names_both_numbers(server, client):
    prompt = "word " * 600
    n = httpx.post(server.base_url + "/tokenize", json={"prompt": prompt}).json()["count"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=4)
    msg = e.value.body["message"]
    assert "maximum context length is 512 tokens" in msg and f"the prompt has {n} tokens" in msg


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=4)
    assert "gpt-4" in e.value.body["message"] and e.value.body["code"] == 404


def test_other_requests_keep_running_while_bad_ones_come(client):
    out: dict = {}

    def long_stream():
        texts, chunks = streamed_text(
            client.completions.create(
                model="smollm2-135m", prompt=PROMPTS[1], max_tokens=64, temperature=0, stream=True,
                extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
            )
        )  # fmt: skip
        out["usage"] = chunks[-1].usage

    t = threading.Thread(target=long_stream)
    t.start()
    for fields, _, _ in BAD_FIELDS * 2:
        with pytest.raises(openai.BadRequestError):
            bad_completion(client, "Hi", fields)
    t.join(120)
    assert out["usage"].completion_tokens == 64


# ----------------------------------------------------------------------------- disconnects and metrics
def wait_idle(server, timeout: float = 60) -> dict:
    """The server's metrics once no request runs or waits."""
    deadline = time.monotonic() + timeout
    while True:
        fams = metrics(server)
        if value(fams, "vllm:num_requests_running") == 0 and value(fams, "vllm:num_requests_waiting") == 0:
            return fams
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.2)


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server):
    before = value(metrics(server), "vllm:request_success", "_total", finished_reason="abort")
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as r:
        lines = 0
        for line in r.iter_lines():
            lines += line.startswith("data: ")
            if lines == 3:
                break  # leave: the connection closes mid-stream
    deadline = time.monotonic() + 60
    while value(fams := metrics(server), "vllm:request_success", "_total", finished_reason="abort") == before:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.2)
    fams = wait_idle(server)
    assert value(fams, "workbench:kv_blocks_used") == 0
    assert value(fams, "vllm:num_requests_running") == 0


def test_a_non_streaming_client_that_leaves_aborts_too(server):
    before = value(metrics(server), "vllm:request_success", "_total", finished_reason="abort")
    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 60
    while value(metrics(server), "vllm:request_success", "_total", finished_reason="abort") == before:
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.2)
    assert value(wait_idle(server), "workbench:kv_blocks_used") == 0
    assert "Traceback" not in server.log_tail(500) and "ERROR" not in server.log_tail(500)


REQUIRED = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram",
    "workbench:kv_pool_tokens": "gauge",
    "workbench:fragmentation_rate": "gauge",
    "workbench:kv_blocks_used": "gauge",
    "workbench:kv_blocks_free": "gauge",
    "workbench:num_requests_swapped": "gauge",
    "workbench:kv_swap_bytes": "counter",
    "workbench:comm_buffer_bytes": "gauge",
}


def test_metrics_have_vllm_names_and_agree_with_the_requests(server, client):
    before = wait_idle(server)
    for name, kind in REQUIRED.items():
        assert name in before, f"/metrics lacks {name}"
        assert before[name].type == kind, (name, before[name].type)
        assert all(s.labels.get("model_name") == "smollm2-135m" for s in before[name].samples), name
    states = {s.labels["state"] for s in before["workbench:kv_pool_tokens"].samples}
    assert states == {"token_states", "reservation", "internal_fragmentation", "external_fragmentation", "free"}
    prompt = completion = 0
    for i, p in enumerate(PROMPTS * 2):
        r = client.completions.create(model="smollm2-135m", prompt=p, max_tokens=5 + i, temperature=0)
        prompt += r.usage.prompt_tokens
        completion += r.usage.completion_tokens
    after = wait_idle(server)

    def delta(name, suffix="", **labels):
        return value(after, name, suffix, **labels) - value(before, name, suffix, **labels)

    n = len(PROMPTS) * 2
    assert delta("vllm:request_success", "_total") == n
    assert delta("vllm:prompt_tokens", "_total") == prompt
    assert delta("vllm:generation_tokens", "_total") == completion
    for h in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert delta(h, "_count") == n, h
    assert delta("vllm:inter_token_latency_seconds", "_count") == completion - n
    pool = sum(s.value for s in after["workbench:kv_pool_tokens"].samples)
    assert pool == value(after, "workbench:kv_blocks_total") * value(after, "workbench:kv_block_size_tokens")


# ----------------------------------------------------------------------------- tensor parallel, shutdown
def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        out.update(int(k) for k in kids)
    return out


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the workers")
def test_tensor_parallel_behind_the_server_and_a_clean_sigterm():
    with ServerProcess(threads=1, extra_args=["-tp", "3"], max_model_len=256, max_num_seqs=4) as srv:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.completions.create(model="smollm2-135m", prompt=PROMPTS[0], max_tokens=8, temperature=0)
        assert r.usage.completion_tokens == 8 and r.choices[0].text
        tp = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.base_url + "/metrics").text)}
        assert value(tp, "workbench:collective_bytes", "_total") > 0
        workers = _children(srv.pid)
        assert len(workers) >= 1, "tensor-parallel workers run as child processes"
        done: dict = {}

        def stream():
            try:
                texts, chunks = streamed_text(
                    c.completions.create(
                        model="smollm2-135m", prompt=PROMPTS[1], max_tokens=200, temperature=0, stream=True,
                        extra_body={"ignore_eos": True},
                    )
                )  # fmt: skip
                done["finish"] = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
            except Exception as e:  # the server went away: expected after SIGTERM
                done["error"] = e

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        code = srv.stop()  # SIGTERM: 5 s of grace for the stream, then abort, stop the workers
        t.join(60)
        assert code == 0, srv.log_tail()
        assert not [w for w in workers if _alive(w)], "tensor-parallel workers outlived the server"
        assert done, "the client never returned"
        assert "Traceback" not in srv.log_tail(200), srv.log_tail(200)


def test_the_server_refuses_bad_engine_arguments_before_listening(tmp_path):
    srv = ServerProcess(threads=1, startup_timeout=120, block_size=7)
    with pytest.raises(RuntimeError) as e:
        srv.start()
    assert "block_size" in str(e.value) or "block-size" in str(e.value)
    assert srv.proc.returncode not in (0, None)


def test_launcher_log_is_written(server):
    assert server.log_path is not None and "serving smollm2-135m" in Path(server.log_path).read_text()
    assert json.loads(httpx.get(server.base_url + "/v1/models").text)["data"][0]["max_model_len"] == 512
    assert os.getpid() != server.pid


def test_api_key_is_required_when_set():
    with ServerProcess(threads=1, extra_args=["--api-key", "sekret"], max_model_len=128, max_num_seqs=2) as srv:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model="smollm2-135m", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(srv.base_url + "/health").status_code == 200  # health and metrics stay open
