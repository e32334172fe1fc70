"""``workbench serve`` under bad input: every probe is refused before work with a 4xx naming its field (or
served, where the numbers only looked dangerous), the engine keeps serving the others, nothing blocks the
event loop, the OpenAPI document matches what the server answers (schemathesis fuzzes it), and an engine
that cannot go on makes the server exit non-zero.

One server (the bundled model, ``max_model_len=8192``) serves most tests here; it is stopped by its PID at
the end, also when a test fails. The event-loop test drives an in-process app whose tokenizer waits on it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workbench.server.launcher import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.server]

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
    with ServerProcess(threads=1, max_model_len=8192, max_num_seqs=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


def metric(http, name: str) -> float:
    fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    return sum(s.value for s in fams[name].samples)


def still_serving(http) -> None:
    """The engine serves a plain request, /health is 200, and nothing is left running or holding blocks."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert http.get("/health").status_code == 200
    deadline = time.monotonic() + 60
    while metric(http, "vllm:num_requests_running") or metric(http, "workbench:kv_blocks_used"):
        assert time.monotonic() < deadline, "requests or blocks left behind"
        time.sleep(0.2)


def test_gauges_are_set_before_the_first_step(server, http):
    fams = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    total = sum(s.value for s in fams["workbench:kv_blocks_total"].samples)
    assert total > 0 and sum(s.value for s in fams["workbench:kv_blocks_free"].samples) == total


# ----------------------------------------------------------------------------- numbers that looked dangerous
@pytest.mark.parametrize(
    "extra",
    [
        {"repetition_penalty": 1e-38},
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": 5e-324},
        {"temperature": 18446744073709551616},
        {"repetition_penalty": 18446744073709551616},
    ],
)
def test_extreme_but_valid_numbers_are_served(http, extra):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, **extra})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    still_serving(http)


# ----------------------------------------------------------------------------- refused before work: 4xx naming the field
BIG = "1" + "0" * 400  # a JSON integer no float holds
PROBES = [
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 3, "temperature": ' + BIG + "}", 400, "temperature"),
    (
        "/v1/completions",
        '{"prompt": "Hi", "max_tokens": 3, "repetition_penalty": ' + BIG + "}",
        400,
        "repetition_penalty",
    ),
    (
        "/v1/completions",
        json.dumps(
            {"prompt": "Hi", "max_tokens": 3, "temperature": 1.0, "min_tokens": 1, "stop_token_ids": list(range(49152))}
        ),
        400,
        "stop_token_ids",
    ),
    (
        "/v1/completions",
        json.dumps({"prompt": [[0]] * 64, "max_tokens": 1, "stop_token_ids": [1] * 150_000}),
        400,
        "stop_token_ids",
    ),
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1, "stop": ["x"] * 257}), 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 1, "stop": ["x" * 1025]}), 400, "stop"),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "ab " * 300_000, "content": "hi"}], "max_tokens": 2}),
        400,
        "messages",
    ),
    ("/v1/completions", "", 400, None),
    ("/v1/chat/completions", "", 400, None),
    ("/tokenize", "", 400, None),
    ("/detokenize", "", 400, None),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": 123}]}]}',
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": null}]}]}',
        400,
        "messages",
    ),
    ("/tokenize", '{"prompt": "x\\ud800"}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "x\\ud800", "max_tokens": 2}', 400, "prompt"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "request_id": "a\\ud800"}', 400, "request_id"),
    (
        "/v1/completions",
        '{"prompt": "Hi", "max_tokens": 2, "stream": true, "request_id": "a\\ud800"}',
        400,
        "request_id",
    ),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "model": "m\\ud800"}', 400, "model"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "stop": ["\\udfff"]}', 400, "stop"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "n": 100}', 400, "n"),
]


@pytest.mark.parametrize("path, body, status, param", PROBES, ids=[f"{p[0]}:{p[1][:60]}" for p in PROBES])
def test_bad_input_is_a_4xx_naming_the_field_and_the_engine_serves_on(http, path, body, status, param):
    t0 = time.monotonic()
    r = http.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"], err
    if param:
        assert param in err["message"], err
    assert time.monotonic() - t0 < 60
    still_serving(http)


def test_a_huge_body_is_refused_unread_and_a_long_prompt_before_tokenizing(server, http):
    r = http.post(
        "/v1/completions",
        content=b'{"prompt": "' + b"x" * (20 << 20) + b'"}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]
    limit = 8192 * 81  # max_model_len x the longest vocabulary entry of the bundled tokenizer
    r = http.post("/tokenize", json={"prompt": "a" * (limit + 1)})
    assert (
        r.status_code == 400 and "characters" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
    )
    r = http.post("/v1/completions", json={"prompt": "a b " * (limit // 4 + 1), "max_tokens": 1})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    still_serving(http)


def test_tokenizing_does_not_block_the_event_loop():
    """While a prompt is being tokenized, the server answers other requests: tokenization here waits until
    the test has had a /health answer, which only a free event loop can give. On the event loop, the wait
    would run out (``released`` False) before /health was even read. No timing decides the verdict."""
    from workbench import AsyncLLM
    from workbench.server.api_server import build_app

    llm = AsyncLLM(max_model_len=128, max_num_seqs=2)
    entered, release, released = threading.Event(), threading.Event(), []
    real = llm.engine.tokenize

    def slow_tokenize(*a, **kw):
        entered.set()
        released.append(release.wait(60))
        return real(*a, **kw)

    llm.engine.tokenize = slow_tokenize

    async def main():
        transport = httpx.ASGITransport(app=build_app(llm, MODEL))
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
            completion = asyncio.create_task(c.post("/v1/completions", json=body))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            health = await c.get("/health")
            release.set()
            return health, await completion

    try:
        health, completion = asyncio.run(main())
    finally:
        llm.shutdown()
    assert released == [True], "tokenization held the event loop: /health could not answer while it ran"
    assert health.status_code == 200
    assert completion.status_code == 200, completion.text


# ----------------------------------------------------------------------------- the OpenAPI document, fuzzed
def test_add_generation_prompt_reaches_the_chat_template(http):
    msgs = [{"role": "user", "content": "Hi"}]
    counts = [
        http.post("/tokenize", json={"messages": msgs, "add_generation_prompt": v}).json()["count"]
        for v in (True, False)
    ]
    assert counts[0] > counts[1]


def test_openapi_lists_the_statuses_and_content_types_the_server_sends(http):
    doc = http.get("/openapi.json").json()
    cmpl = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in cmpl and {"200", "400", "404", "413", "500", "503"} <= set(cmpl)
    assert set(cmpl["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "content" not in doc["paths"]["/health"]["get"]["responses"]["200"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def fuzz_schema(doc: dict) -> dict:
    """The server's document with every request's token counts bounded (the fuzz stays short)."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = doc["components"]["schemas"][name]["properties"]
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key] = {"type": "integer", "minimum": 1, "maximum": 4}
        props["min_tokens"] = {"type": "integer", "minimum": 0, "maximum": 2}
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        doc["components"]["schemas"][name].setdefault("required", [])
        doc["components"]["schemas"][name]["required"].append("max_tokens")
    return doc


def test_schemathesis_fuzz_finds_no_5xx_and_no_schema_mismatch(server, http):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import (
        content_type_conformance,
        not_a_server_error,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_dict(fuzz_schema(http.get("/openapi.json").json()))
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    ops = [op.ok() for op in schema.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in ops} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    calls = {"n": 0}
    for op in ops:
        examples = 150 if op.method.upper() == "POST" else 20

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=op.as_strategy())
        def run(case):
            calls["n"] += 1
            response = case.call(base_url=server.base_url, timeout=120)
            case.validate_response(response, checks=checks)

        run()
    print("fuzz calls", calls["n"])
    assert calls["n"] >= 400
    still_serving(http)


# ----------------------------------------------------------------------------- tensor parallel: loopback, and exit on a dead worker
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the workers")
def test_tensor_parallel_listens_only_on_loopback_and_exits_when_a_worker_dies():
    psutil = pytest.importorskip("psutil")
    srv = ServerProcess(threads=1, extra_args=["-tp", "3"], max_model_len=256, max_num_seqs=4)
    with srv:
        tree = [psutil.Process(srv.pid), *psutil.Process(srv.pid).children(recursive=True)]
        listening = [(p.pid, c.laddr) for p in tree for c in p.net_connections(kind="inet") if c.status == "LISTEN"]
        assert listening, "the server listens"
        assert all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), listening
        workers = [
            p
            for p in tree[1:]
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())
        ]
        assert len(workers) == 2, [p.cmdline() for p in tree]
        workers[0].kill()
        try:
            code = srv.proc.wait(120)  # the engine notices while idle, the server shuts down and exits 1
        except Exception:
            pytest.fail("the server kept running after a tensor-parallel worker died:\n" + srv.log_tail())
        assert code == 1, srv.log_tail()
        assert "exits with status 1" in srv.log_tail(60)
        assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
