"""One bad request never stops the engine: numbers the sampler cannot hold are refused or guarded, a row
that cannot be sampled ends only its request, and nothing a refused or failed call queued stays queued.

Offline, on the tiny random-weight Llama (vocabulary 256, no tokenizer).
"""

from __future__ import annotations

import math

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.inputs import chat_messages, tokenize_prompt
from workbench.sampling import SAMPLING_FAILED, SamplingError, sample

GOOD = SamplingParams(max_tokens=5)
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine = LLM(model=str(tiny_model), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    yield engine
    engine.shutdown()


def assert_idle(llm) -> None:
    """Nothing queued or running, and every KV block free."""
    eng = llm.llm_engine
    while eng.has_unfinished_requests():  # reports what an aborted call left
        eng.step()
    assert not eng.requests and not eng.groups
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("penalty", [1e-38, 1e-300, 5e-324])
def test_a_tiny_repetition_penalty_samples_instead_of_failing(llm, penalty):
    bad = SamplingParams(max_tokens=5, temperature=1.0, repetition_penalty=penalty, seed=0)
    want = llm.generate([PROMPT], GOOD)[0].outputs[0].token_ids
    good_out, bad_out = llm.generate([PROMPT, [4, 5, 6]], [GOOD, bad])
    assert good_out.outputs[0].token_ids == want
    assert bad_out.outputs[0].finish_reason == "length" and len(bad_out.outputs[0].token_ids) == 5
    assert_idle(llm)


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_integers_past_what_a_float_holds_are_refused_and_big_ones_become_floats(llm, field):
    sp = SamplingParams(**{field: 2**64}, max_tokens=3, seed=0)
    assert isinstance(getattr(sp, field), float) and getattr(sp, field) == float(2**64)
    assert len(llm.generate([PROMPT], sp)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=f"^{field}=an integer of 401 digits is not a finite number"):
        SamplingParams(**{field: 10**400})
    assert_idle(llm)


def test_min_tokens_masking_the_whole_vocabulary_is_refused_before_anything_is_queued(llm):
    sp = SamplingParams(min_tokens=1, stop_token_ids=list(range(256)), temperature=1.0, max_tokens=3)
    with pytest.raises(ValueError, match=r"min_tokens=1 masks .* all 256 tokens"):
        llm.generate([PROMPT, PROMPT], [GOOD, sp])
    assert_idle(llm)  # the first prompt, accepted, was not left queued
    assert llm.generate([PROMPT], GOOD)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("n", [10**6, 2**64])
def test_offline_n_is_bounded_by_max_num_seqs(llm, n):
    with pytest.raises(ValueError, match=f"n={n} exceeds max_num_seqs=8"):
        llm.generate([PROMPT], SamplingParams(n=n))
    assert_idle(llm)


@pytest.mark.parametrize(
    "field, value",
    [("ignore_eos", "no"), ("include_stop_str_in_output", math.nan), ("skip_special_tokens", "no"), ("ignore_eos", 1)],
)
def test_bool_fields_take_only_bools(llm, field, value):
    with pytest.raises(ValueError, match=f"^{field}=.* must be True or False"):
        SamplingParams(**{field: value})
    sp = SamplingParams()
    setattr(sp, field, value)  # changed after construction: generate checks again before queueing
    with pytest.raises(ValueError, match=field):
        llm.generate([PROMPT], sp)
    assert_idle(llm)


def test_the_sampler_reports_rows_without_a_usable_logit_and_samples_the_others():
    logits = torch.randn(3, 16)
    logits[1] = float("-inf")
    logits[2, 4] = float("nan")
    params = [SamplingParams(temperature=1.0, seed=0)] * 3
    gens = [torch.Generator().manual_seed(0) for _ in range(3)]
    errors: dict[int, str] = {}
    toks = sample(logits, params, gens, None, errors)
    assert sorted(errors) == [1, 2] and toks[1] == toks[2] == -1 and 0 <= toks[0] < 16
    assert "every token of the vocabulary is masked" in errors[1] and "NaN" in errors[2]
    assert errors[1].startswith(SAMPLING_FAILED)
    with pytest.raises(SamplingError):
        sample(logits, params, gens)
    inf = torch.tensor([[1.0, float("inf"), float("inf"), 0.0]])
    assert sample(inf, [SamplingParams(temperature=0.5, seed=0)], [torch.Generator().manual_seed(0)]) in ([1], [2])


def test_a_request_that_cannot_be_sampled_ends_alone_and_frees_its_blocks(llm):
    eng = llm.llm_engine
    eng.add_request("bad", PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=1))
    eng.add_request("ok", PROMPT, SamplingParams(max_tokens=5))
    # (past validation, as a bug would) a mask over the whole vocabulary
    sp = eng.requests["bad"].sampling_params
    sp.min_tokens, sp.stop_token_ids = 1, list(range(256))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            outs[o.request_id] = o
    assert outs["bad"].outputs[0].finish_reason == "error" and outs["bad"].error.startswith(SAMPLING_FAILED)
    assert outs["ok"].outputs[0].finish_reason == "length" and outs["ok"].error is None
    assert_idle(llm)
    assert [r.finish_reason for r in eng.recorder.requests[-2:]].count("error") == 1


def test_an_error_no_request_can_be_blamed_for_leaves_nothing_queued(llm, monkeypatch):
    ex = llm.llm_engine.executor
    real = ex.execute_step
    calls = {"n": 0}

    def broken(out, kv):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("the forward pass failed")
        return real(out, kv)

    monkeypatch.setattr(ex, "execute_step", broken)
    with pytest.raises(RuntimeError, match="forward pass failed"):
        llm.generate([PROMPT, [7, 8, 9]], GOOD)
    monkeypatch.setattr(ex, "execute_step", real)
    assert_idle(llm)
    assert llm.generate([PROMPT], GOOD)[0].outputs[0].finish_reason == "length"


def test_chat_messages_are_checked_and_null_content_is_empty_text():
    msgs = chat_messages(
        [{"role": "assistant", "content": None}, {"role": "user", "content": [{"type": "text", "text": "a"}]}]
    )
    assert [m["content"] for m in msgs] == ["", "a"]
    for content, where in [
        ([{"type": "text", "text": 123}], r"messages\[0\]\.content\[0\]\.text=123"),
        ([{"type": "text", "text": None}], r"messages\[0\]\.content\[0\]\.text=None"),
        ([{"type": "image_url"}], r"messages\[0\]\.content\[0\]: only text"),
        (5, r"messages\[0\]\.content=5"),
    ]:
        with pytest.raises(ValueError, match=where):
            chat_messages([{"role": "user", "content": content}])


def test_a_failing_progress_bar_factory_leaves_nothing_queued(llm):
    def factory(*a, **k):
        raise RuntimeError("no bar")

    with pytest.raises(RuntimeError, match="no bar"):
        llm.generate([PROMPT], GOOD, use_tqdm=factory)
    assert_idle(llm)


def test_chat_refuses_a_string_and_text_refuses_lone_surrogates(llm):
    with pytest.raises(TypeError, match="must be chat messages"):
        llm.chat("hello")

    class Tok:
        chat_template = "{{ messages }}"

        def encode(self, text, add_special_tokens=True):
            return [1]

    with pytest.raises(ValueError, match=r"prompt holds a lone UTF-16 surrogate at character 1"):
        tokenize_prompt(Tok(), 10, "x\ud800")
    with pytest.raises(ValueError, match=r"messages\[0\]\.content holds a lone UTF-16 surrogate"):
        tokenize_prompt(Tok(), 10, [{"role": "user", "content": "\udfff"}])


def test_stop_lists_are_bounded_and_checked_in_one_pass():
    from workbench.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

    assert SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS))).stop_token_ids[-1] == MAX_STOP_TOKEN_IDS - 1
    with pytest.raises(ValueError, match=f"^stop_token_ids lists {MAX_STOP_TOKEN_IDS + 1} token ids"):
        SamplingParams(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(ValueError, match=r"^stop_token_ids=-1 is out of range"):
        SamplingParams(stop_token_ids=[3, -1])
    with pytest.raises(ValueError, match=r"^stop_token_ids=True must be an integer"):
        SamplingParams(stop_token_ids=[3, True])
    with pytest.raises(ValueError, match=f"^stop lists {MAX_STOP_STRINGS + 1} strings"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))


def test_a_multi_prompt_request_that_fails_cancels_its_other_prompts():
    """One prompt's job raising (e.g. an id taken between the check and the queue) aborts the others:
    nothing keeps running for a response nobody reads."""
    import asyncio

    from workbench.server.api_server import OpenAIServing

    closed = []

    class Engine:
        class config:
            scheduling_policy = "fcfs"

    class FakeLLM:
        engine = Engine()
        tokenizer = None
        max_model_len = 64

        async def generate(self, prompt, sp, request_id, priority, tokenized):
            try:
                if request_id.endswith("-1"):
                    raise ValueError("request_id 'x-1' is already running; use a unique id")
                while True:
                    await asyncio.sleep(0.01)
                    yield None
            finally:
                closed.append(request_id)

    class Http:
        async def is_disconnected(self):
            return False

    serving = OpenAIServing(FakeLLM(), "m")
    jobs = [("x-0", ([1], None), None, 0), ("x-1", ([1], None), None, 0)]

    async def main():
        with pytest.raises(ValueError, match="already running"):
            await serving.run_all(Http(), jobs)
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert sorted(closed) == ["x-0", "x-1"]
