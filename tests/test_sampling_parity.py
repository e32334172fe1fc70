"""SamplingParams and the Python API at parity with vLLM: validation, penalties,
min_tokens, logprobs / prompt_logprobs, prompt forms, request-id safety, tiny top_p, large seeds."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from workbench import LLM, SamplingParams
from workbench.sample_ops import process_row, top_logprobs
from workbench.sampling import sample

# ----------------------------------------------------------------------------- validation (no model)
BAD_PARAMS = [
    (dict(temperature=float("nan")), "temperature=nan"),
    (dict(temperature=float("inf")), "temperature=inf"),
    (dict(temperature=-0.5), "temperature=-0.5"),
    (dict(top_k=1.5), "top_k=1.5"),
    (dict(top_k=True), "top_k=True"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(top_p=float("nan")), "top_p=nan"),
    (dict(top_p=0.0), "top_p=0.0"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(max_tokens=True), "max_tokens=True"),
    (dict(max_tokens=2.0), "max_tokens=2.0"),
    (dict(max_tokens=0), "max_tokens=0"),
    (dict(n=True), "n=True"),
    (dict(n=0), "n=0"),
    (dict(stop_token_ids=[1.7]), "stop_token_ids=1.7"),
    (dict(stop_token_ids=["2"]), "stop_token_ids='2'"),
    (dict(stop_token_ids=[True]), "stop_token_ids=True"),
    (dict(stop_token_ids=[-1]), "stop_token_ids=-1"),
    (dict(stop_token_ids=5), "stop_token_ids=5"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5"),
    (dict(presence_penalty=float("nan")), "presence_penalty=nan"),
    (dict(frequency_penalty=-2.01), "frequency_penalty=-2.01"),
    (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
    (dict(repetition_penalty=-1.0), "repetition_penalty=-1.0"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty=inf"),
    (dict(min_tokens=-1), "min_tokens=-1"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens=20"),
    (dict(min_tokens=1.0), "min_tokens=1.0"),
    (dict(logprobs=-1), "logprobs=-1"),
    (dict(logprobs=2.0), "logprobs=2.0"),
    (dict(logprobs=21), "logprobs=21"),
    (dict(prompt_logprobs=-1), "prompt_logprobs=-1"),
    (dict(prompt_logprobs=True), "prompt_logprobs=True"),
    (dict(prompt_logprobs=21), "prompt_logprobs=21"),
    (dict(seed=1.5), "seed=1.5"),
    (dict(seed="1"), "seed='1'"),
    (dict(seed=2**64), f"seed={2**64}"),
    (dict(seed=-(2**63) - 1), f"seed={-(2**63) - 1}"),
    (dict(stop=""), "stop=''"),
    (dict(stop=["ok", ""]), "stop=['ok', '']"),
    (dict(stop=5), "stop=5"),
    (dict(stop=[5]), "stop=[5]"),
]


@pytest.mark.parametrize("kwargs,named", BAD_PARAMS, ids=[n for _, n in BAD_PARAMS])
def test_bad_sampling_params_are_refused_naming_field_and_value(kwargs, named):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert named in msg, msg
    assert any(w in msg for w in ("must", "range", "in [", ">=")), msg  # says what is allowed


def test_logprobs_cap_is_named():
    with pytest.raises(ValueError, match="max_logprobs=20"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_p=1e-46),
        dict(seed=2**64 - 1, n=2),
        dict(seed=-(2**63)),
        dict(presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01),
        dict(min_tokens=16, max_tokens=16),
        dict(logprobs=0, prompt_logprobs=20),
        dict(stop="x", stop_token_ids=(3, 4)),
        dict(top_k=0),
        dict(temperature=1),
    ],
)
def test_edge_values_that_are_valid(kwargs):
    sp = SamplingParams(**kwargs)
    assert isinstance(sp.stop, list) and isinstance(sp.stop_token_ids, list)


def test_a_field_changed_after_construction_is_checked_again():
    sp = SamplingParams()
    sp.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature=nan"):
        sp.verify()


# ----------------------------------------------------------------------------- the sampler, directly
def _req(prompt, output, eos=None):
    return SimpleNamespace(prompt_token_ids=prompt, output_token_ids=output, eos_token_id=eos)


def test_presence_and_frequency_penalties_against_a_hand_computation():
    torch.manual_seed(0)
    logits = torch.randn(1, 12)
    req = _req([5, 6], [2, 2, 3, 7, 2])
    sp = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3)
    want = logits[0].clone()
    for t, c in {2: 3, 3: 1, 7: 1}.items():
        want[t] -= 0.3 * c + 0.7
    got = process_row(logits[0], sp, req)
    torch.testing.assert_close(got, want)
    assert got.argmax().item() == sample(logits, [sp], [None], [req])[0]


def test_presence_penalty_changes_the_greedy_choice_in_sample():
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.2]])
    before = logits.clone()
    req = _req([3], [1])
    assert sample(logits, [SamplingParams()], [None], [req]) == [1]
    assert sample(logits, [SamplingParams(presence_penalty=0.05)], [None], [req]) == [1]  # 0.95 > 0.9
    assert sample(logits, [SamplingParams(presence_penalty=0.2)], [None], [req]) == [2]  # 0.8 < 0.9
    assert sample(logits, [SamplingParams(presence_penalty=0.2)], [None]) == [1]  # no histories: no penalty
    assert torch.equal(logits, before)  # the caller's logits are untouched


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 0.5])
    req = _req([0], [1])  # token 0 in the prompt, token 1 in the output
    got = process_row(logits, SamplingParams(repetition_penalty=2.0), req)
    assert got.tolist() == [1.0, -2.0, 3.0, -2.0, 0.5]
    # prompt tokens count for repetition, not for presence/frequency
    got = process_row(logits, SamplingParams(presence_penalty=1.0), req)
    assert got.tolist() == [2.0, -2.0, 3.0, -2.0, 0.5]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]])
    sp = SamplingParams(min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [sp], [None], [_req([0], [], eos=1)]) == [3]
    assert sample(logits, [sp], [None], [_req([0], [4, 4], eos=1)]) == [1]  # reached: unmasked
    ign = SamplingParams(min_tokens=2, ignore_eos=True)
    assert sample(logits, [ign], [None], [_req([0], [], eos=1)]) == [1]  # ignore_eos: EOS is not a stop


def test_tiny_top_p_keeps_the_most_likely_token():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    params = [SamplingParams(temperature=1.0, top_p=1e-46) for _ in range(4)]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for _ in range(3):
        assert sample(logits, params, gens) == logits.argmax(-1).tolist()


def test_top_logprobs_are_log_softmax_with_ranks():
    torch.manual_seed(2)
    logits = torch.randn(3, 30)
    ref = torch.log_softmax(logits, -1)
    chosen = [int(ref[0].argmax()), int(ref[1].argsort(descending=True)[7]), 4]
    rows = top_logprobs(logits, chosen, [3, 0, 5])
    for i, row in enumerate(rows):
        t, v, r = row[0]
        assert t == chosen[i] and v == pytest.approx(ref[i, t].item(), abs=1e-6)
        assert r == int((ref[i] > ref[i, t]).sum()) + 1
        order = ref[i].argsort(descending=True).tolist()
        assert [(t, r) for t, _, r in row[1:]] == [(order[j], j + 1) for j in range(len(row) - 1)]
    assert rows[0][0][2] == 1 and rows[1][0][2] == 8 and len(rows[1]) == 1


# ----------------------------------------------------------------------------- a tiny model (no tokenizer)
@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(model=str(tiny_model), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)


PROMPT = [3, 17, 42, 99, 5, 8, 120, 7, 64, 33, 2, 200]


def _greedy(llm, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", 12)
    return llm.generate([prompt], SamplingParams(ignore_eos=kw.pop("ignore_eos", True), **kw))[0].outputs[0]


BAD_PROMPTS = [
    (123, TypeError, "123"),
    (None, TypeError, "None"),
    ({"text": "hi"}, ValueError, "neither"),
    ([[1, 1.7]], ValueError, "1.7"),
    ([[1, "2"]], ValueError, "'2'"),
    ([[1, True]], ValueError, "True"),
    ([[1, -3]], ValueError, "-3"),
    ([[1, 256]], ValueError, "256"),
    ([{"prompt_token_ids": [4, 1.5]}], ValueError, "1.5"),
    ([[]], ValueError, "empty"),
]


@pytest.mark.parametrize("bad,exc,named", BAD_PROMPTS, ids=[repr(b[0]) for b in BAD_PROMPTS])
@pytest.mark.slow
def test_bad_prompts_are_refused_before_anything_is_queued(llm, bad, exc, named):
    eng = llm.llm_engine
    good = [5, 6, 7]
    prompts = [good, *bad] if isinstance(bad, list) else bad  # a good prompt first: it must not be queued
    with pytest.raises(exc) as e:
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert named in str(e.value)
    assert not eng.has_unfinished_requests() and not eng.requests and not eng.groups
    assert len(_greedy(llm, good, max_tokens=2).token_ids) == 2


def test_a_bad_sampling_param_among_several_queues_nothing(llm):
    eng = llm.llm_engine
    sp_bad = SamplingParams()
    sp_bad.top_k = 1.5  # changed after construction
    with pytest.raises(ValueError, match="top_k=1.5"):
        llm.generate([[1, 2], [3, 4]], [SamplingParams(), sp_bad])
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[1, 2]], [{"max_tokens": 3}])
    assert not eng.has_unfinished_requests() and not eng.requests
    assert len(_greedy(llm, max_tokens=3).token_ids) == 3


def test_prompt_forms(llm):
    ref = _greedy(llm).token_ids
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    forms = [PROMPT, [PROMPT], {"prompt_token_ids": PROMPT}, [{"prompt_token_ids": PROMPT}, PROMPT], (PROMPT,)]
    for form in forms:
        outs = llm.generate(form, sp)
        assert all(o.outputs[0].token_ids == ref and o.prompt_token_ids == PROMPT for o in outs)
    assert llm.generate([], sp) == []


def test_request_id_of_a_parallel_sampling_child_is_refused(llm):
    eng = llm.llm_engine
    sp2 = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2)
    eng.add_request("a", [1, 2, 3], sp2)
    for rid, sp in (("a#0", SamplingParams()), ("a#1", sp2), ("a", SamplingParams())):
        with pytest.raises(ValueError, match="already in the engine"):
            eng.add_request(rid, [1, 2, 3], sp)
    eng.add_request("b#1", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in the engine"):
        eng.add_request("b", [1, 2, 3], sp2)  # its child "b#1" would clash
    assert set(eng.requests) == {"a#0", "a#1", "b#1"}
    done = []
    while eng.has_unfinished_requests():
        done += eng.step()
    assert sorted(o.request_id for o in done) == ["a", "b#1"]
    assert [len(c.token_ids) for c in next(o for o in done if o.request_id == "a").outputs] == [2, 2]


def test_seed_at_the_top_of_the_range_with_n_2_works_and_reproduces(llm):
    sp = SamplingParams(n=2, temperature=1.0, seed=2**64 - 1, max_tokens=8, ignore_eos=True)
    a = [c.token_ids for c in llm.generate([PROMPT], sp)[0].outputs]
    b = [c.token_ids for c in llm.generate([PROMPT], sp)[0].outputs]
    assert a == b and all(len(t) == 8 for t in a)
    lp = llm.generate(
        [PROMPT], SamplingParams(n=2, temperature=1.0, seed=2**64 - 1, max_tokens=8, ignore_eos=True, logprobs=1)
    )
    assert [c.token_ids for c in lp[0].outputs] == a  # logprobs do not change what is sampled
    assert all(len(c.logprobs) == 8 and all(t in p for p, t in zip(c.logprobs, c.token_ids)) for c in lp[0].outputs)
    low = SamplingParams(n=1, temperature=1.0, seed=-1, max_tokens=8, ignore_eos=True)  # -1 == 2**64-1 mod 2**64
    assert llm.generate([PROMPT], low)[0].outputs[0].token_ids == a[0]


def test_tiny_top_p_is_greedy_on_the_engine(llm):
    ref = _greedy(llm).token_ids
    got = llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=12, ignore_eos=True, seed=5))
    assert got[0].outputs[0].token_ids == ref
    assert _greedy(llm, max_tokens=3).token_ids == ref[:3]  # and the engine goes on working


def _repeats(ids):
    return len(ids) - len(set(ids))


def test_penalties_reduce_repetition_in_greedy_output(llm):
    plain = _greedy(llm, max_tokens=40).token_ids
    assert _repeats(plain) > 0, "the tiny model repeats itself without a penalty"
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0), dict(repetition_penalty=50.0)):
        got = _greedy(llm, max_tokens=40, **kw).token_ids
        assert _repeats(got) < _repeats(plain), kw
    both = _greedy(llm, max_tokens=40, frequency_penalty=2.0, repetition_penalty=50.0).token_ids
    assert _repeats(both) == 0, both


def test_min_tokens_masks_stop_token_ids(llm):
    ref = _greedy(llm, max_tokens=12).token_ids
    stop = ref[3]
    first = ref.index(stop)
    short = _greedy(llm, max_tokens=12, stop_token_ids=[stop]).token_ids
    assert short == ref[: first + 1]
    longer = _greedy(llm, max_tokens=12, stop_token_ids=[stop], min_tokens=8).token_ids
    assert len(longer) >= 8 and stop not in longer[:7] and longer[:first] == ref[:first]


def _hf_logits(tiny_hf, ids):
    with torch.no_grad():
        return tiny_hf(torch.tensor([ids])).logits[0].float()


def test_logprobs_match_transformers(llm, tiny_hf):
    out = _greedy(llm, max_tokens=10, logprobs=5)
    ids = out.token_ids
    assert len(out.logprobs) == len(ids) == 10
    ref = torch.log_softmax(_hf_logits(tiny_hf, PROMPT + ids), -1)[len(PROMPT) - 1 : -1]
    total = 0.0
    for i, (pos, t) in enumerate(zip(out.logprobs, ids)):
        assert t in pos and pos[t].rank == 1  # greedy: the sampled token is the most likely
        assert len(pos) == 5  # top 5 (the sampled one among them)
        top = ref[i].topk(5)
        assert sorted((lp.rank, tok) for tok, lp in pos.items()) == list(enumerate(top.indices.tolist(), 1))
        for tok, lp in pos.items():
            assert lp.logprob == pytest.approx(ref[i, tok].item(), abs=1e-4)
            assert lp.decoded_token is None  # this model folder has no tokenizer
        total += ref[i, t].item()
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
    assert _greedy(llm).logprobs is None and _greedy(llm).cumulative_logprob is None


def test_sampled_token_outside_the_top_k_is_included_with_its_rank(llm, tiny_hf):
    sp = SamplingParams(temperature=5.0, seed=11, max_tokens=12, ignore_eos=True, logprobs=1)
    out = llm.generate([PROMPT], sp)[0].outputs[0]
    ref = torch.log_softmax(_hf_logits(tiny_hf, PROMPT + out.token_ids), -1)[len(PROMPT) - 1 : -1]
    assert any(len(p) == 2 for p in out.logprobs), "a high temperature samples outside the top 1"
    for i, (pos, t) in enumerate(zip(out.logprobs, out.token_ids)):
        assert pos[t].rank == int((ref[i] > ref[i, t]).sum()) + 1
        assert pos[t].logprob == pytest.approx(ref[i, t].item(), abs=1e-4)  # raw: before temperature


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.slow
def test_prompt_logprobs_match_a_teacher_forced_forward(tiny_model, tiny_hf, chunked):
    budget = 8 if chunked else 256  # 8: the 40-token prompt runs in 5 chunks
    llm = LLM(
        model=str(tiny_model),
        block_size=4,
        max_model_len=256,
        max_num_batched_tokens=budget,
        max_num_seqs=4,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=True,
    )
    prompt = (PROMPT * 4)[:40]
    ref = torch.log_softmax(_hf_logits(tiny_hf, prompt), -1)
    sp = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=3, logprobs=2)
    for _ in range(2):  # the second time its blocks are cached: the prefix cache is bypassed
        res = llm.generate([prompt, PROMPT], sp)
        plp = res[0].prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        for p in range(1, len(prompt)):
            pos, t = plp[p], prompt[p]
            assert t in pos and pos[t].logprob == pytest.approx(ref[p - 1, t].item(), abs=1e-4)
            assert pos[t].rank == int((ref[p - 1] > ref[p - 1, t]).sum()) + 1
            assert {tok for tok, lp in pos.items() if lp.rank <= 3} >= set(ref[p - 1].topk(3).indices.tolist())
        assert len(res[1].prompt_logprobs) == len(PROMPT)
        assert len(res[0].outputs[0].logprobs) == 3
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].prompt_logprobs is None


# ----------------------------------------------------------------------------- the bundled model
@pytest.mark.slow
def test_text_prompt_forms_decoded_tokens_and_min_tokens_past_eos():
    llm = LLM(max_model_len=256, max_num_seqs=4)
    tok = llm.tokenizer
    sp = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    a = llm.generate("The capital of France is", sp)[0]
    b = llm.generate({"prompt": "The capital of France is"}, sp)[0]
    c = llm.generate([{"prompt_token_ids": a.prompt_token_ids}], sp)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert a.prompt == "The capital of France is" and c.prompt is None
    for pos, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids):
        assert pos[t].decoded_token == tok.decode([t]) and pos[t].rank == 1
    assert len(a.prompt_logprobs) == len(a.prompt_token_ids) and a.prompt_logprobs[0] is None
    assert math.isfinite(a.outputs[0].cumulative_logprob)
    # a chat reply that ends with EOS early; min_tokens keeps it going past that point
    chat = [[{"role": "user", "content": "Reply with just the word yes."}]]
    short = llm.chat(chat, SamplingParams(max_tokens=64))[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 48, short.text
    n = len(short.token_ids)
    longer = llm.chat(chat, SamplingParams(max_tokens=64, min_tokens=n + 5))[0].outputs[0]
    assert len(longer.token_ids) >= n + 5
    assert llm.llm_engine.eos_token_id not in longer.token_ids[: n + 4]


@pytest.mark.slow
def test_logprobs_and_penalties_under_tensor_parallelism_equal_one_device(tiny_model, llm):
    """Rank 0 samples from the gathered logits: the prompt rows travel with the sampling rows."""
    sp = SamplingParams(
        max_tokens=8, ignore_eos=True, logprobs=3, prompt_logprobs=2, frequency_penalty=1.0, repetition_penalty=1.5
    )
    ref = llm.generate([PROMPT], sp)[0]
    with LLM(model=str(tiny_model), block_size=4, max_num_seqs=8, max_model_len=256, tensor_parallel_size=2) as tp:
        got = tp.generate([PROMPT], sp)[0]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    for a, b in zip(
        got.outputs[0].logprobs + got.prompt_logprobs[1:], ref.outputs[0].logprobs + ref.prompt_logprobs[1:]
    ):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
