"""A bounded soak of ``workbench serve`` on loopback: 1,000 requests at concurrency 32,
with clients that disconnect mid-stream and invalid requests mixed in (seeded).

Checked: no 5xx; every valid request completed (or was aborted by its own client); every invalid
one got a 4xx with OpenAI's error body; the engine's KV invariants held after every step (the
server runs with ``WORKBENCH_CHECK_INVARIANTS=1``: a violation stops its engine loop and
``/health`` answers 503); every KV block is free at the end; the server's RSS stays flat (the
growth between the first 200 requests and the end is bounded). Stops by itself: a fixed number of
requests, and a wall-clock cap that fails the test.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from workbench.server.launcher import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.server]

NUM_REQUESTS = 1000
CONCURRENCY = 32
WALL_CAP_S = 900
RSS_GROWTH_CAP_MIB = 64
PROMPTS = [
    "The capital of France is",
    "List three fruits:",
    "Write a haiku about autumn.",
    "def add(a, b):",
    "Once upon a time",
    "The quick brown fox",
]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def kind_of(rng: random.Random) -> str:
    x = rng.random()
    return "invalid" if x < 0.075 else "disconnect" if x < 0.15 else "valid"


def invalid_body(rng: random.Random) -> tuple[dict | bytes, int]:
    choice = rng.randrange(5)
    if choice == 0:
        return {"prompt": "x", "temperature": -1, "max_tokens": 2}, 400
    if choice == 1:
        return {"prompt": "word " * 400, "max_tokens": 2}, 400
    if choice == 2:
        return {"prompt": "x", "model": "no-such-model", "max_tokens": 2}, 404
    if choice == 3:
        return {"prompt": [1.5], "max_tokens": 2}, 400
    return b"{broken json", 400


async def one(client: httpx.AsyncClient, i: int, rng: random.Random, tally: dict) -> None:
    kind = kind_of(rng)
    url = "/v1/completions"
    if kind == "invalid":
        body, want = invalid_body(rng)
        if isinstance(body, bytes):
            r = await client.post(url, content=body, headers={"Content-Type": "application/json"})
        else:
            r = await client.post(url, json=body)
        tally["status"].append(r.status_code)
        assert r.status_code == want, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        tally["invalid"] += 1
        return
    body = {
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(1, 6),
        "temperature": rng.choice([0, 0.8]),
        "seed": i,
        "n": rng.choice([1, 1, 1, 2]),
        "stream": kind == "disconnect" or rng.random() < 0.5,
    }
    if body["temperature"] == 0:
        body["n"] = 1  # greedy with n > 1 is a 400, as in vLLM
    if kind == "disconnect":
        body["max_tokens"] = 200
        body["ignore_eos"] = True
        async with client.stream("POST", url, json=body) as r:
            tally["status"].append(r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break  # leave after the first chunk
        tally["disconnect"] += 1
        return
    if body["stream"]:
        finish = {}
        async with client.stream("POST", url, json=body) as r:
            tally["status"].append(r.status_code)
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for c in json.loads(line[6:])["choices"]:
                        if c["finish_reason"]:
                            finish[c["index"]] = c["finish_reason"]
        assert len(finish) == body["n"] and set(finish.values()) <= {"stop", "length"}, finish
    else:
        r = await client.post(url, json=body)
        tally["status"].append(r.status_code)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == body["n"] and {c["finish_reason"] for c in choices} <= {"stop", "length"}
    tally["valid"] += 1


async def soak(base_url: str, pid: int) -> dict:
    rng = random.Random(20261202)
    tally = {"valid": 0, "invalid": 0, "disconnect": 0, "status": [], "rss": []}
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def guarded(i: int, seed: int):
            async with sem:
                await one(client, i, random.Random(seed), tally)
                if i == 200:
                    tally["rss"].append(rss_mib(pid))

        seeds = [rng.randrange(2**31) for _ in range(NUM_REQUESTS)]
        await asyncio.wait_for(asyncio.gather(*(guarded(i, s) for i, s in enumerate(seeds))), WALL_CAP_S)
    return tally


def metric(base_url: str, name: str) -> float:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_soak_no_5xx_no_leak_flat_rss():
    env = {"WORKBENCH_CHECK_INVARIANTS": "1"}
    with ServerProcess(threads=1, env=env, max_model_len=256, max_num_seqs=CONCURRENCY) as srv:
        t0 = time.monotonic()
        tally = asyncio.run(soak(srv.base_url, srv.pid))
        elapsed = time.monotonic() - t0
        assert not [s for s in tally["status"] if s >= 500], "5xx answers"
        assert tally["valid"] + tally["invalid"] + tally["disconnect"] == NUM_REQUESTS
        assert tally["invalid"] > 30 and tally["disconnect"] > 30
        deadline = time.monotonic() + 120
        while metric(srv.base_url, "vllm:num_requests_running") or metric(srv.base_url, "vllm:num_requests_waiting"):
            assert time.monotonic() < deadline, "requests still running after the soak"
            time.sleep(0.5)
        assert httpx.get(srv.base_url + "/health").status_code == 200, srv.log_tail()  # invariants held
        assert metric(srv.base_url, "workbench:kv_blocks_used") == 0
        aborted = metric(srv.base_url, "vllm:request_success_total") - tally["valid"]
        assert aborted >= tally["disconnect"] * 0.9  # (a disconnect after the last token finishes normally)
        growth = rss_mib(srv.pid) - tally["rss"][0]
        print(f"soak: {NUM_REQUESTS} requests in {elapsed:.0f} s; RSS growth after request 200: {growth:.1f} MiB")
        assert growth < RSS_GROWTH_CAP_MIB, f"RSS grew {growth:.1f} MiB"
