"""``workbench bench serve``: the load generator modelled on ``vllm bench serve``.

Unit tests (arrival process, metrics, flag checks) need no server. The client tests run against a
minimal OpenAI-style streaming server defined here (a test double for the client's parsing and
failure handling); the end-to-end test runs the real ``workbench serve``.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
from click.testing import CliRunner
from fastapi import Request  # module level: the fake server's handlers annotate with it

from workbench.bench import serve as bs
from workbench.bench.serve import RequestRecord, SampleRequest

# ---------------------------------------------------------------------------------------------
# arrival process


def test_gaps_mean_and_variance_follow_the_gamma_distribution():
    rng = np.random.default_rng(0)
    rate = 4.0
    for burstiness in (0.25, 1.0, 4.0):
        gaps = bs.sample_interarrival_gaps(200_000, rate, burstiness, rng)
        # gamma(shape=b, scale=1/(rate*b)): mean 1/rate, variance 1/(rate^2 * b)
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
        assert gaps.var() == pytest.approx(1 / (rate**2 * burstiness), rel=0.05)


def test_burstiness_one_is_poisson_and_lower_is_burstier():
    rng = np.random.default_rng(1)
    cv = {b: (g.std() / g.mean()) for b in (0.5, 1.0, 2.0) for g in [bs.sample_interarrival_gaps(100_000, 2.0, b, rng)]}
    assert cv[1.0] == pytest.approx(1.0, rel=0.03)  # exponential gaps: coefficient of variation 1
    assert cv[0.5] > cv[1.0] > cv[2.0]


def test_arrival_offsets_are_seeded_sorted_and_span_n_over_rate():
    a = bs.request_arrival_offsets(500, 10.0, 1.0, seed=7)
    b = bs.request_arrival_offsets(500, 10.0, 1.0, seed=7)
    c = bs.request_arrival_offsets(500, 10.0, 1.0, seed=8)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.all(np.diff(a) >= 0) and a[0] > 0
    # vLLM rescales the cumulative delays so the last request goes out at n / rate
    assert a[-1] == pytest.approx(500 / 10.0)


def test_rate_inf_sends_everything_at_once():
    assert np.array_equal(bs.request_arrival_offsets(5, math.inf, 1.0, seed=0), np.zeros(5))
    assert np.array_equal(bs.request_arrival_offsets(5, math.inf, 0.3, seed=0), np.zeros(5))


def test_infinite_burstiness_is_a_constant_rate():
    offsets = bs.request_arrival_offsets(4, 2.0, math.inf, seed=0)
    assert np.allclose(offsets, [0.5, 1.0, 1.5, 2.0])


# ---------------------------------------------------------------------------------------------
# metrics on synthetic request records


def _rec(ttft, latency, output_tokens, itl=None, prompt_len=10, start=0.0):
    if itl is None:
        itl = [(latency - ttft) / (output_tokens - 1)] * (output_tokens - 1) if output_tokens > 1 else []
    return RequestRecord(
        prompt_len=prompt_len,
        expected_output_len=output_tokens,
        success=True,
        ttft=ttft,
        itl=itl,
        latency=latency,
        output_tokens=output_tokens,
        generated_text="x" * output_tokens,
        start_time=start,
    )


def _failed(prompt_len=10):
    return RequestRecord(prompt_len=prompt_len, expected_output_len=5, success=False, error="HTTP 400: nope")


def test_metrics_on_synthetic_records():
    recs = [_rec(0.1, 1.1, 11), _rec(0.2, 2.2, 21), _rec(0.3, 0.3, 1), _failed()]
    m = bs.calculate_metrics(
        recs,
        duration_s=2.0,
        percentile_metrics=["ttft", "tpot", "itl", "e2el"],
        metric_percentiles=[50, 99, 99.9],
        goodput=None,
    )
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 30  # failed requests' prompts are not counted
    assert m["total_output_tokens"] == 33
    assert m["output_lens"] == [11, 21, 1, 0]
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(16.5)
    assert m["total_token_throughput"] == pytest.approx(31.5)
    assert m["request_goodput"] is None
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))
    assert m["p99_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300], 99))
    assert m["p99.9_ttft_ms"] == pytest.approx(np.percentile([100, 200, 300], 99.9))
    assert m["p50_e2el_ms"] == pytest.approx(1100.0)
    # TPOT = (e2el - ttft) / (output_tokens - 1); a 1-token request has none
    assert m["mean_tpot_ms"] == pytest.approx(100.0)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert len(m["ttfts"]) == 4 and m["ttfts"][3] is None
    assert m["errors"] == ["", "", "", "HTTP 400: nope"]


def test_goodput_counts_requests_meeting_every_slo():
    recs = [_rec(0.1, 1.1, 11), _rec(0.2, 2.2, 21), _rec(0.3, 0.3, 1), _failed()]
    kw = dict(duration_s=2.0, percentile_metrics=["ttft"], metric_percentiles=[99])
    assert bs.calculate_metrics(recs, goodput={"ttft": 250}, **kw)["request_goodput"] == pytest.approx(1.0)
    # the 1-token request has TPOT 0 for goodput (as vLLM), so it meets any TPOT SLO
    assert bs.calculate_metrics(recs, goodput={"tpot": 50}, **kw)["request_goodput"] == pytest.approx(0.5)
    both = bs.calculate_metrics(recs, goodput={"ttft": 250, "e2el": 2000}, **kw)
    assert both["request_goodput"] == pytest.approx(0.5)


def test_metrics_with_no_successful_request_are_none_not_zero():
    m = bs.calculate_metrics([_failed(), _failed()], 1.0, ["ttft", "tpot"], [99], None)
    assert m["completed"] == 0 and m["failed"] == 2
    assert m["mean_ttft_ms"] is None and m["p99_tpot_ms"] is None


def test_peaks_count_in_one_second_buckets_as_vllm():
    # vLLM: a request counts in every whole-second bucket from its send's to its end's; a token in the
    # bucket its chunk arrived in
    recs = [_rec(0.1, 1.0, 2, start=0.0), _rec(0.1, 1.0, 2, start=0.5), _rec(0.1, 1.0, 2, start=1.0)]
    m = bs.calculate_metrics(recs, 2.0, ["ttft"], [99], None)
    assert m["max_concurrent_requests"] == 3  # all three are active during second 1
    # tokens at 0.1, 1.0 | 0.6, 1.5 | 1.1, 2.0: buckets 0: 2, 1: 3, 2: 1
    assert m["max_output_tokens_per_s"] == 3.0
    assert m["rtfx"] == 0.0 and m["queue_times"] == [0.0, 0.0, 0.0]
    assert m["latencies"] == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------------------------------------
# flag checks


def test_parse_goodput():
    assert bs.parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert bs.parse_goodput(["ttft:500 e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    with pytest.raises(ValueError, match=r"itl.*ttft, tpot, e2el"):
        bs.parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match=r"'ttft=5'.*NAME:MILLISECONDS"):
        bs.parse_goodput(["ttft=5"])
    with pytest.raises(ValueError, match="non-negative"):
        bs.parse_goodput(["ttft:-1"])


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"request_rate": 0}, r"--request-rate 0.*inf"),
        ({"burstiness": 0}, r"--burstiness 0"),
        ({"max_concurrency": 0}, r"--max-concurrency 0"),
        ({"num_prompts": 0}, r"--num-prompts 0"),
        ({"percentile_metrics": "ttft,foo"}, r"'foo'.*ttft, tpot, itl, e2el"),
        ({"metric_percentiles": "99,101"}, r"101"),
        ({"dataset_name": "sharegpt"}, r"--dataset-path"),
        ({"dataset_name": "random", "dataset_path": "x.json"}, r"--dataset-path"),
        ({"dataset_name": "nope"}, r"'nope'"),
        ({"endpoint": "/v1/embeddings"}, r"/v1/embeddings.*/v1/completions"),
        ({"random_range_ratio": 1.0}, r"--random-range-ratio 1.0"),
    ],
)
def test_bad_arguments_name_the_value_and_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        bs.run_bench_serve(base_url="http://127.0.0.1:9", model="m", disable_tqdm=True, **kw)


# ---------------------------------------------------------------------------------------------
# a minimal OpenAI-style streaming server (test double for the client)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """An OpenAI-compatible streaming server: one ``"t "`` chunk per token with ``delay_s`` between
    chunks, a usage chunk, then ``[DONE]``. Prompts holding FAIL get HTTP 400; prompts holding
    MIDERR get an error object in the stream. It counts requests in flight."""

    def __init__(self, delay_s: float = 0.005, usage: bool = True):
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        self.in_flight = 0
        self.peak = 0
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model", "root": "fake-model"}]}

        async def stream(body: dict, chat: bool):
            n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            try:
                prompt = json.dumps(body.get("messages") if chat else body.get("prompt"))
                for i in range(n):
                    await asyncio.sleep(delay_s)
                    if "MIDERR" in prompt and i == 1:
                        yield 'data: {"error": {"message": "engine died", "type": "InternalError", "code": 500}}\n\n'
                        return
                    choice = {"index": 0, "delta": {"content": "t "}} if chat else {"index": 0, "text": "t "}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
                done = {"index": 0, "finish_reason": "length"}
                done.update({"delta": {}} if chat else {"text": ""})
                yield f"data: {json.dumps({'id': 'x', 'choices': [done]})}\n\n"
                if usage:
                    u = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': u})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.bodies.append(body)
            self.headers.append(dict(request.headers))
            if "FAIL" in json.dumps(body.get("messages") if chat else body.get("prompt")):
                return JSONResponse({"error": {"message": "bad prompt", "type": "BadRequestError"}}, status_code=400)
            return StreamingResponse(stream(body, chat), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await handle(request, chat=True)

        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def _samples(n, output_len=5, fail=(), miderr=()):
    out = []
    for i in range(n):
        word = "FAIL" if i in fail else "MIDERR" if i in miderr else "ok"
        out.append(SampleRequest(prompt=f"prompt {i} {word}", prompt_len=3, expected_output_len=output_len))
    return out


def test_client_measures_streams_and_counts_failures():
    with FakeServer(delay_s=0.01) as srv:
        res = bs.run_bench_serve(
            base_url=srv.base_url,
            samples=_samples(6, output_len=5, fail={1}, miderr={4}),
            disable_tqdm=True,
            print_result=False,
            percentile_metrics="ttft,tpot,itl,e2el",
            save_detailed=True,
        )
    assert res["model_id"] == "fake-model"  # asked GET /v1/models
    assert res["backend"] == "openai"
    assert res["completed"] == 4 and res["failed"] == 2
    assert "HTTP 400" in res["errors"][1] and "bad prompt" in res["errors"][1]
    assert "engine died" in res["errors"][4]
    assert res["output_lens"] == [5, 0, 5, 5, 0, 5]
    assert res["generated_texts"][0] == "t " * 5
    # vLLM's rule: every chunk with choices times a token, the closing finish_reason chunk too
    assert all(len(res["itls"][i]) == 5 for i in (0, 2, 3, 5))
    # each chunk is about 10 ms apart
    assert 5 <= res["median_itl_ms"] < 200
    assert res["mean_ttft_ms"] >= 5 and res["mean_e2el_ms"] >= res["mean_ttft_ms"]
    assert res["mean_tpot_ms"] == pytest.approx(res["mean_itl_ms"], rel=0.5)
    body = srv.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 5 and body["model"] == "fake-model"
    # as vLLM's client: no temperature unless asked, repetition_penalty 1 and logprobs null on completions
    assert "temperature" not in body and body["repetition_penalty"] == 1.0 and body["logprobs"] is None
    assert "ignore_eos" not in body


def test_client_without_usage_counts_chunks_and_speaks_chat():
    with FakeServer(delay_s=0.002, usage=False) as srv:
        res = bs.run_bench_serve(
            base_url=srv.base_url,
            endpoint="/v1/chat/completions",
            model="fake-model",
            samples=_samples(3, output_len=4),
            ignore_eos=True,
            disable_tqdm=True,
            print_result=False,
            save_detailed=True,
        )
    assert res["backend"] == "openai-chat" and res["completed"] == 3
    assert res["output_lens"] == [4, 4, 4]
    # sent all at once: they reach the server in any order
    assert sorted(b["messages"][0]["content"] for b in srv.bodies) == [f"prompt {i} ok" for i in range(3)]
    assert all(b["messages"][0]["role"] == "user" and b["ignore_eos"] is True for b in srv.bodies)
    assert all(b["max_completion_tokens"] == 4 and "max_tokens" not in b for b in srv.bodies)  # vLLM's chat body


def test_max_concurrency_is_respected():
    with FakeServer(delay_s=0.01) as srv:
        res = bs.run_bench_serve(
            base_url=srv.base_url,
            samples=_samples(12, output_len=4),
            max_concurrency=3,
            disable_tqdm=True,
            print_result=False,
        )
    assert res["completed"] == 12
    assert srv.peak <= 3
    assert res["max_concurrency"] == 3


def test_request_rate_spaces_the_requests():
    with FakeServer(delay_s=0.001) as srv:
        res = bs.run_bench_serve(
            base_url=srv.base_url,
            samples=_samples(4, output_len=2),
            request_rate=10.0,
            seed=3,
            disable_tqdm=True,
            print_result=False,
        )
    # the last request goes out at n / rate = 0.4 s
    assert res["duration"] >= 0.4 and res["request_rate"] == 10.0


#: the keys of vLLM 0.32's ``bench serve`` result (vllm/benchmarks/serve.py: ``main_async``'s setup keys, then
#: ``benchmark``'s result, then ``process_one_metric`` per metric) with its default metrics (ttft, tpot, itl),
#: percentiles (99) and no goodput, metadata, ramp-up or probe; the lists ``main_async`` deletes without
#: ``--save-detailed``
VLLM_RESULT_KEYS = (
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "latencies",
    "queue_times", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms",
    "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
)  # fmt: skip
VLLM_DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")


def test_result_keys_are_vllms_with_and_without_save_detailed(capsys):
    with FakeServer() as srv:
        plain = bs.run_bench_serve(base_url=srv.base_url, samples=_samples(4, output_len=3), disable_tqdm=True)
        detailed = bs.run_bench_serve(
            base_url=srv.base_url, samples=_samples(4, output_len=3), disable_tqdm=True, save_detailed=True
        )
    assert set(plain) == set(VLLM_RESULT_KEYS)
    assert set(detailed) == set(VLLM_RESULT_KEYS) | set(VLLM_DETAILED_KEYS)
    assert list(plain)[:10] == list(VLLM_RESULT_KEYS)[:10]  # vLLM's order, setup first
    assert plain["endpoint_type"] == plain["backend"] == "openai" and plain["label"] is None
    assert plain["rtfx"] == 0.0 and len(plain["latencies"]) == len(plain["queue_times"]) == 4
    out = capsys.readouterr().out
    assert "Peak output token throughput (tok/s):" in out and "Peak concurrent requests:" in out


def test_result_keys_and_console_block(capsys):
    with FakeServer() as srv:
        res = bs.run_bench_serve(
            base_url=srv.base_url,
            samples=_samples(4, output_len=3),
            goodput={"ttft": 10_000},
            metric_percentiles="50,99",
            disable_tqdm=True,
        )
    out = capsys.readouterr().out
    for metric in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert f"{stat}_{metric}_ms" in res
    assert "mean_e2el_ms" not in res  # not in --percentile-metrics
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["request_rate"] == "inf"
    json.dumps(res)  # serialisable as is
    assert "Serving Benchmark Result" in out
    for line in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Request goodput (req/s):",
        "P99 TTFT (ms):",
        "Median TPOT (ms):",
    ):
        assert line in out


def test_runs_inside_a_running_event_loop():
    """A notebook cell runs inside a running loop; run_bench_serve then runs in a thread."""

    async def cell(url):
        return bs.run_bench_serve(
            base_url=url, samples=_samples(2, output_len=2), disable_tqdm=True, print_result=False
        )

    with FakeServer() as srv:
        res = asyncio.run(cell(srv.base_url))
    assert res["completed"] == 2


def test_connection_refused_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"127\.0\.0\.1:\d+/v1/models.*--model"):
        bs.run_bench_serve(base_url=f"http://127.0.0.1:{_free_port()}", samples=_samples(1), disable_tqdm=True)


# ---------------------------------------------------------------------------------------------
# datasets that need the tokenizer (the bundled model's; nothing is downloaded)


@pytest.fixture(scope="module")
def tokenizer():
    return bs.load_tokenizer(None)[0]


def test_random_prompts_hit_the_input_length(tokenizer):
    samples = bs.build_samples(
        "random", tokenizer, num_prompts=8, seed=0, random_input_len=64, random_output_len=16, random_range_ratio=0.25
    )
    assert len(samples) == 8
    for s in samples:
        assert 48 <= s.prompt_len <= 80
        assert len(tokenizer(s.prompt, add_special_tokens=False).input_ids) == s.prompt_len
        assert 12 <= s.expected_output_len <= 20
    again = bs.build_samples(
        "random", tokenizer, num_prompts=8, seed=0, random_input_len=64, random_output_len=16, random_range_ratio=0.25
    )
    assert [s.prompt for s in again] == [s.prompt for s in samples]


def test_prefix_repetition_prompts_share_prefixes(tokenizer):
    knobs = dict(
        num_prompts=6,
        seed=0,
        prefix_repetition_prefix_len=32,
        prefix_repetition_suffix_len=8,
        prefix_repetition_num_prefixes=2,
        prefix_repetition_output_len=5,
    )
    samples = bs.build_samples("prefix-repetition", tokenizer, **knobs)
    assert len(samples) == 6 and all(s.expected_output_len == 5 for s in samples)
    heads = {s.prompt[:60] for s in samples}
    assert len(heads) == 2
    assert all(38 <= s.prompt_len <= 42 for s in samples)
    vllm_spelling = bs.build_samples("prefix_repetition", tokenizer, **knobs)  # vLLM's --dataset-name
    assert [s.prompt for s in vllm_spelling] == [s.prompt for s in samples]


def test_jsonl_dataset_uses_output_len_of_the_records(tokenizer, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(
        '{"prompt": "Hello there", "output_len": 7}\n{"prompt": "Tell me more", "max_tokens": 3}\n{"text": "x"}\n'
    )
    samples = bs.build_samples("jsonl", tokenizer, num_prompts=3, seed=0, dataset_path=str(p))
    assert [s.expected_output_len for s in samples] == [7, 3, bs.DEFAULT_JSONL_OUTPUT_LEN]
    assert samples[0].prompt_len == len(tokenizer("Hello there", add_special_tokens=False).input_ids)


def test_sharegpt_output_len_comes_from_the_reply(tokenizer, tmp_path):
    convs = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"question number {i} " * 3},
                {"from": "gpt", "value": "an answer " * (i + 2)},
            ],
        }
        for i in range(5)
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(convs))
    samples = bs.build_samples("sharegpt", tokenizer, num_prompts=5, seed=0, dataset_path=str(p))
    assert len(samples) == 5
    replies = {len(tokenizer("an answer " * (i + 2), add_special_tokens=False).input_ids) for i in range(5)}
    assert {s.expected_output_len for s in samples} == replies
    fixed = bs.build_samples("sharegpt", tokenizer, num_prompts=5, seed=0, dataset_path=str(p), output_len=9)
    assert {s.expected_output_len for s in fixed} == {9}
    p.write_text(json.dumps([{"id": "q", "conversations": [{"from": "human", "value": "no answer here"}]}]))
    with pytest.raises(ValueError, match="--output-len"):
        bs.build_samples("sharegpt", tokenizer, num_prompts=1, seed=0, dataset_path=str(p))


# ---------------------------------------------------------------------------------------------
# the command line


def test_cli_bench_serve_saves_the_result(tmp_path):
    from workbench.cli.main import main

    with FakeServer() as srv:
        res = CliRunner().invoke(
            main,
            [
                "bench", "serve", "--base-url", srv.base_url, "--dataset-name", "random", "--random-input-len", "16",
                "--random-output-len", "4", "--num-prompts", "5", "--request-rate", "inf", "--max-concurrency", "2",
                "--goodput", "ttft:5000", "tpot:1000", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "90,99",
                "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json",
                "--disable-tqdm",
            ],
            catch_exceptions=False,
        )  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "Serving Benchmark Result" in res.output and "P90 E2EL (ms):" in res.output
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 5 and saved["num_prompts"] == 5 and saved["max_concurrency"] == 2
    assert saved["request_goodput"] is not None and "p90_e2el_ms" in saved and "mean_itl_ms" not in saved
    assert saved["output_lens"] == [4] * 5


def test_cli_bad_flag_is_a_clear_error():
    from workbench.cli.main import main

    res = CliRunner().invoke(main, ["bench", "serve", "--request-rate", "0", "--model", "m"])
    assert res.exit_code != 0 and "--request-rate 0" in res.output
    res = CliRunner().invoke(main, ["bench", "serve", "--goodput", "ttft:5", "itl:3", "--model", "m"])
    assert res.exit_code != 0 and "itl" in res.output


#: every ``vllm bench serve`` flag this client accepts, with a value (what vLLM 0.32 would take)
ALL_FLAGS = [
    "--backend", "openai", "--label", "mylabel", "--model", "fake-model", "--served-model-name", "fake-model",
    "--tokenizer-mode", "hf", "--trust-remote-code", "--dataset-name", "random", "--num-prompts", "6",
    "--input-len", "16", "--output-len", "3", "--random-input-len", "99", "--random-output-len", "99",
    "--random-range-ratio", '{"input": 0.1, "output": 0.0}', "--random-prefix-len", "4",
    "--request-rate", "inf", "--burstiness", "1.0", "--max-concurrency", "4", "--num-warmups", "2",
    "--ready-check-timeout-sec", "5", "--probe-request-rate", "50", "--goodput", "ttft:5000", "tpot:1000",
    "--percentile-metrics", "ttft,tpot,itl,e2el,client_queue_time,e2el_including_client_queue",
    "--metric-percentiles", "50,99", "--seed", "1", "--ignore-eos", "--logprobs", "1", "--temperature", "0",
    "--top-p", "0.9", "--top-k", "5", "--min-p", "0.01", "--frequency-penalty", "0.1", "--presence-penalty", "0.2",
    "--repetition-penalty", "1.1", "--extra-body", '{"min_tokens": 1}', "--header", "x-a=1", "x-b=2",
    "--request-id-prefix", "run7-", "--insecure", "--metadata", "version=0.3.3", "tp=1", "--save-result",
    "--save-detailed", "--disable-tqdm", "--sharegpt-output-len", "5", "--disable-shuffle", "--no-oversample",
]  # fmt: skip


def test_cli_takes_every_applicable_vllm_flag(tmp_path):
    from workbench.cli.main import main

    with FakeServer(delay_s=0.001) as srv:
        args = ["bench", "serve", "--base-url", srv.base_url, *ALL_FLAGS, "--result-dir", str(tmp_path)]
        res = CliRunner().invoke(main, args, catch_exceptions=False)
        res2 = CliRunner().invoke(main, [*args, "--append-result", "--result-filename", "a.json"])
        res3 = CliRunner().invoke(main, [*args, "--append-result", "--result-filename", "a.json"])
    assert res.exit_code == 0, res.output
    assert res2.exit_code == 0 and res3.exit_code == 0, res2.output + res3.output
    (saved_path,) = [p for p in tmp_path.glob("mylabel-infqps-concurrency4-fake-model-*.json")]  # vLLM's name
    saved = json.loads(saved_path.read_text())
    keys = set(VLLM_RESULT_KEYS) | set(VLLM_DETAILED_KEYS) | {"version", "tp"}
    for m in ("e2el", "client_queue_time", "e2el_including_client_queue"):
        keys |= {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p99_{m}_ms"}
    keys = {k.replace("p99_", "p50_") for k in keys} | keys
    probe = {"probe_completed", "probe_failed", "probe_median_e2el_ms", "probe_p99_e2el_ms", "probe_max_e2el_ms"}
    assert set(saved) - probe == keys and saved["probe_completed"] >= 1
    assert saved["label"] == "mylabel" and saved["version"] == "0.3.3" and saved["tp"] == "1"
    assert saved["completed"] == 6 and saved["output_lens"] == [3] * 6 and saved["request_goodput"] is not None
    lines = (tmp_path / "a.json").read_text().splitlines()  # --append-result: one JSON per line
    assert len(lines) == 2 and all(json.loads(x)["label"] == "mylabel" for x in lines)
    run = [b for b in srv.bodies if b["prompt"] != "Hi"]  # probes are "Hi"
    body = run[-1]
    for k, v in {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.01, "frequency_penalty": 0.1,
                 "presence_penalty": 0.2, "repetition_penalty": 1.1, "min_tokens": 1, "logprobs": 1,
                 "ignore_eos": True, "model": "fake-model", "max_tokens": 3}.items():  # fmt: skip
        assert body[k] == v, k
    heads = [h for h, b in zip(srv.headers, srv.bodies) if b["prompt"] != "Hi"]
    assert heads[-1]["x-a"] == "1" and heads[-1]["x-b"] == "2"
    ids = {h.get("x-request-id") for h in heads[-6:]}
    assert ids == {f"run7-{i}" for i in range(6)}
    # three runs, each: 1 ready check + 2 warm-ups + 6 requests (ignoring probes)
    assert len(run) == 3 * 9


@pytest.mark.parametrize(
    ("flag", "why"),
    [
        (["--use-beam-search"], "no beam search"),
        (["--hf-name", "x/y"], "Hugging Face"),
        (["--lora-modules", "a"], "LoRA"),
        (["--random-mm-bucket-config", "{}"], "text-only"),
        (["--profile"], "start_profile"),
        (["--dataset-name", "custom"], "--dataset-name jsonl"),
        (["--dataset-name=sonnet"], "random or jsonl"),
    ],
)
def test_cli_refuses_vllm_flags_that_cannot_apply_and_says_why(flag, why):
    from workbench.cli.main import main

    res = CliRunner().invoke(main, ["bench", "serve", "--model", "m", *flag])
    assert res.exit_code != 0 and flag[0].split("=")[0] in res.output and why in res.output


def test_cli_reads_vllms_argument_style():
    from workbench.cli.main import main

    # underscores as dashes, several values after one --goodput, as vLLM's FlexibleArgumentParser
    res = CliRunner().invoke(main, ["bench", "serve", "--num_prompts", "0", "--model", "m"])
    assert res.exit_code != 0 and "--num-prompts 0" in res.output
    res = CliRunner().invoke(main, ["bench", "serve", "--metadata", "noequals", "--model", "m"])
    assert res.exit_code != 0 and "KEY=VALUE" in res.output


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"backend": "openai-chat"}, r"--backend openai-chat needs --endpoint /v1/chat/completions"),
        ({"backend": "openai-embeddings"}, r"no such endpoint"),
        ({"tokenizer_mode": "mistral"}, r"--tokenizer-mode mistral"),
        ({"ramp_up_strategy": "linear"}, r"--ramp-up-start-rps"),
        ({"ramp_up_strategy": "linear", "ramp_up_start_rps": 1, "ramp_up_end_rps": 2, "request_rate": 3},
         r"drop --request-rate"),
        ({"random_range_ratio": '{"input": 1.5}'}, r"not in \[0, 1\)"),
        ({"extra_body": "{nope"}, r"--extra-body"),
        ({"num_warmups": -1}, r"--num-warmups"),
    ],
)
def test_new_flags_check_their_values(kw, match):
    with pytest.raises(ValueError, match=match):
        bs.run_bench_serve(base_url="http://127.0.0.1:9", model="m", disable_tqdm=True, **kw)


def test_ramp_up_rises_from_start_to_end_rate():
    lin = bs.ramp_up_rates(5, "linear", 1.0, 5.0)
    assert np.allclose(lin, [1, 2, 3, 4, 5])
    exp = bs.ramp_up_rates(3, "exponential", 1.0, 4.0)
    assert np.allclose(exp, [1, 2, 4])
    offsets = bs.request_arrival_offsets(2000, math.inf, math.inf, seed=0, ramp_up=("linear", 1.0, 100.0))
    gaps = np.diff(offsets)
    assert gaps[0] > 5 * gaps[-1]  # constant gaps (burstiness inf) shrink as the rate rises


def test_ramp_up_result_has_vllms_keys_and_rps_change_events(capsys):
    with FakeServer(delay_s=0.001) as srv:
        res = bs.run_bench_serve(base_url=srv.base_url, samples=_samples(8, output_len=2), ramp_up_strategy="linear",
                                 ramp_up_start_rps=20, ramp_up_end_rps=23, disable_tqdm=True)  # fmt: skip
    assert (res["ramp_up_strategy"], res["ramp_up_start_rps"], res["ramp_up_end_rps"]) == ("linear", 20, 23)
    assert [e["rps"] for e in res["rps_change_events"]] == [20, 21, 22, 23] and res["completed"] == 8
    assert "Traffic ramp-up strategy: linear." in capsys.readouterr().out


def test_random_prefix_and_oversampling(tokenizer, tmp_path):
    s = bs.build_samples("random", tokenizer, num_prompts=3, seed=0, random_input_len=8, random_output_len=2,
                         random_prefix_len=20)  # fmt: skip
    assert len({x.prompt[:40] for x in s}) == 1 and all(26 <= x.prompt_len <= 30 for x in s)
    ratio = bs.build_samples("random", tokenizer, num_prompts=20, seed=0, random_input_len=40, random_output_len=10,
                             random_range_ratio=(0.5, 0.0))  # fmt: skip
    assert {x.expected_output_len for x in ratio} == {10} and len({x.prompt_len for x in ratio}) > 3
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    assert len(bs.build_samples("jsonl", tokenizer, num_prompts=5, seed=0, dataset_path=str(p))) == 5  # vLLM oversamples
    few = bs.build_samples("jsonl", tokenizer, num_prompts=5, seed=0, dataset_path=str(p), no_oversample=True)
    assert [x.prompt for x in few] == ["one", "two"]


# ---------------------------------------------------------------------------------------------
# end to end against the real `workbench serve`


@pytest.mark.slow
@pytest.mark.server
def test_end_to_end_against_workbench_serve(tmp_path):
    from workbench.cli.main import main
    from workbench.server.launcher import ServerProcess

    with ServerProcess(startup_timeout=300, max_model_len=512, max_num_seqs=8) as srv:
        res = bs.run_bench_serve(
            base_url=srv.base_url,
            dataset_name="random",
            random_input_len=32,
            random_output_len=8,
            num_prompts=16,
            max_concurrency=8,
            seed=0,
            disable_tqdm=True,
            print_result=False,
            percentile_metrics="ttft,tpot,itl,e2el",
            save_detailed=True,
        )
        model = json.loads(urllib.request.urlopen(srv.base_url + "/v1/models", timeout=10).read())["data"][0]["id"]
        flags = [model if a == "fake-model" else a for a in ALL_FLAGS]
        cli = CliRunner().invoke(
            main, ["bench", "serve", "--base-url", srv.base_url, *flags, "--result-dir", str(tmp_path)]
        )
    assert res["completed"] == 16, res["errors"]
    assert res["failed"] == 0
    assert res["output_lens"] == [8] * 16  # random prompts ignore EOS, as in vLLM
    assert res["total_input_tokens"] == sum(res["input_lens"])
    assert all(30 <= n <= 34 for n in res["input_lens"])  # 32 tokens, up to decode/re-encode merges
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"]
    assert res["mean_tpot_ms"] > 0 and res["median_itl_ms"] > 0
    assert res["max_concurrent_requests"] >= 1 and res["max_output_tokens_per_s"] >= 1
    # every accepted vLLM flag against the real server: no failure, and vLLM's keys with --save-detailed
    assert cli.exit_code == 0, cli.output
    (path,) = tmp_path.glob("mylabel-*.json")
    saved = json.loads(path.read_text())
    assert saved["failed"] == 0 and saved["completed"] == 6, saved["errors"]
    assert set(VLLM_RESULT_KEYS) | set(VLLM_DETAILED_KEYS) <= set(saved)


def test_vllms_spelling_prefix_repetition_is_accepted():
    """``--dataset-name prefix_repetition`` (vLLM's spelling, listed by ``--help``) runs as ``prefix-repetition``."""
    with FakeServer() as srv:
        res = bs.run_bench_serve(
            base_url=srv.base_url,
            dataset_name="prefix_repetition",
            num_prompts=4,
            prefix_repetition_prefix_len=16,
            prefix_repetition_suffix_len=4,
            prefix_repetition_num_prefixes=2,
            prefix_repetition_output_len=3,
            disable_tqdm=True,
            print_result=False,
        )
    assert res["completed"] == 4
