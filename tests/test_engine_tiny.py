"""The engine on a tiny random-weight Llama (built from transformers' LlamaConfig; no download)."""

from __future__ import annotations

import json
import random
import re

import pytest
from conftest import hf_greedy

from workbench import LLM, SamplingParams


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(model=str(tiny_model), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)


def test_batched_greedy_equals_transformers_one_at_a_time(tiny_llm, tiny_hf):
    ps = prompts(10)
    outs = tiny_llm.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(ps, outs):
        assert o.outputs[0].token_ids == hf_greedy(tiny_hf, p, 24)
        assert o.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "args",
    [
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 256},
        {"max_num_batched_tokens": 8, "long_prefill_token_threshold": 3},
        {"block_size": 1},
        {"block_size": 32},
        {"num_gpu_blocks_override": 40, "block_size": 4},  # 160 slots for 8 x ~80 tokens: preemption
    ],
)
@pytest.mark.slow
def test_greedy_is_the_same_under_every_scheduling(tiny_model, tiny_llm, args):
    ps = prompts(8, seed=1)
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in tiny_llm.generate(ps, sp)]
    base = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    llm = LLM(model=str(tiny_model), **(base | args))
    got = [o.outputs[0].token_ids for o in llm.generate(ps, sp)]
    assert got == ref
    steps = llm.llm_engine.recorder.steps
    if "num_gpu_blocks_override" in args:
        assert sum(s.num_preemptions for s in steps) > 0
    eng = llm.llm_engine
    assert eng.kv.num_free_blocks == eng.kv.num_blocks  # nothing leaked


def test_prompt_too_long_is_refused_and_others_finish(tiny_llm):
    ok1, ok2 = prompts(2, seed=3)
    long = [5] * 300  # max_model_len = 256
    outs = tiny_llm.generate([ok1, long, ok2], SamplingParams(max_tokens=5, ignore_eos=True))
    assert outs[1].outputs[0].finish_reason == "error"
    assert "300" in outs[1].error and "max_model_len=256" in outs[1].error
    assert outs[1].outputs[0].token_ids == []
    for o in (outs[0], outs[2]):
        assert o.error is None and len(o.outputs[0].token_ids) == 5


def test_pool_too_small_for_one_sequence_is_a_startup_error(tiny_model):
    with pytest.raises(ValueError) as e:
        LLM(model=str(tiny_model), block_size=4, num_gpu_blocks_override=10, max_model_len=256)
    msg = str(e.value)
    assert "40 tokens" in msg and "max_model_len=256" in msg and "max_model_len <= 40" in msg


def test_memory_budget_too_small_is_a_startup_error(tiny_model):
    # 0.9 x 800 kB - weights 427,264 B - profiled activations (~0.1 MB) leaves room for fewer than 512
    # tokens of 512 B: the error names the pool (whole blocks of 16) and the largest max_model_len that fits
    with pytest.raises(ValueError) as e:
        LLM(model=str(tiny_model), device_memory=800_000, max_model_len=512, max_num_batched_tokens=64)
    m = re.search(
        r"holds ([\d,]+) tokens \((\d+) blocks x 16\).*max_model_len=512.*max_model_len <= ([\d,]+)", str(e.value)
    )
    assert m, str(e.value)
    pool = int(m.group(1).replace(",", ""))
    assert pool == int(m.group(2)) * 16 < 512 and int(m.group(3).replace(",", "")) == pool


def test_empty_prompt_and_bad_token_ids_raise_before_anything_is_queued(tiny_llm):
    eng = tiny_llm.llm_engine
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[1, 2, 3], []])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_llm.generate([[1, 2, 3], [999]])
    with pytest.raises(ValueError, match="no tokenizer"):
        tiny_llm.generate(["text needs a tokenizer"])
    assert not eng.has_unfinished_requests()


def test_seeded_sampling_reproduces_and_seeds_differ(tiny_llm):
    ps = prompts(4, seed=5)
    sp = [
        SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=s, max_tokens=16, ignore_eos=True)
        for s in (1, 2, 1, 3)
    ]
    a = [o.outputs[0].token_ids for o in tiny_llm.generate(ps, sp)]
    b = [o.outputs[0].token_ids for o in tiny_llm.generate(ps, sp)]
    assert a == b
    assert a[0] != a[1] or a[0] != a[3]


def test_stop_token_ids_and_eos(tiny_llm, tiny_hf):
    p = prompts(1, seed=7)[0]
    ref = hf_greedy(tiny_hf, p, 12)
    stop = ref[5]
    first = ref.index(stop)
    out = tiny_llm.generate([p], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == ref[: first + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_abort_releases_blocks(tiny_llm):
    eng = tiny_llm.llm_engine
    eng.add_request("x", prompts(1, seed=9)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("y", prompts(1, seed=10)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    eng.step()
    eng.abort("x")
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert done["x"].outputs[0].finish_reason == "abort"
    assert done["y"].outputs[0].finish_reason == "length"
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_step_stats_and_request_records(tiny_model, tmp_path):
    from workbench.metrics import JsonlSink, Recorder

    rec = Recorder([JsonlSink(tmp_path)])
    llm = LLM(
        model=str(tiny_model), block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128, recorder=rec
    )
    ps = prompts(6, seed=11)
    llm.generate(ps, SamplingParams(max_tokens=10, ignore_eos=True))
    rec.close()
    steps = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    reqs = [json.loads(x) for x in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(steps) == len(rec.steps) and len(reqs) == 6
    assert sum(s["num_prefill_tokens"] for s in steps) == sum(len(p) for p in ps)
    assert sum(s["num_decode_tokens"] for s in steps) == 6 * 9  # the first token comes from the prefill
    for s in steps:
        assert s["num_prefill_tokens"] + s["num_decode_tokens"] <= 32
        assert s["num_running"] <= 4
        parts = s["token_states"] + s["reservation"] + s["internal_fragmentation"] + s["external_fragmentation"]
        assert parts + s["free"] == s["num_blocks"] * s["block_size"]
        assert s["blocks_used"] + s["blocks_free"] == s["num_blocks"]
    for r in reqs:
        assert r["output_tokens"] == 10 and len(r["itl_s"]) == 9
        assert r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] and r["tpot_s"] > 0
        assert r["queue_time_s"] >= 0


class FakeBar:
    """A tqdm-like bar that keeps what generate() shows, snapshot by snapshot."""

    made: list[FakeBar] = []
    log: list[tuple[str, int]] = []  # (desc, n) of every update of every bar, in order

    def __init__(self, total=None, desc="", unit="it", **kw):
        self.total, self.desc, self.unit, self.n, self.postfix, self.closed = total, desc, unit, 0, "", False
        self.history: list[tuple[int, float]] = []
        FakeBar.made.append(self)

    def update(self, k=1):
        self.n += k
        self.history.append((self.n, self.total))
        FakeBar.log.append((self.desc.rstrip(), self.n))

    def set_postfix(self, refresh=True, **kw):
        self.postfix = ", ".join(f"{k}={v}" for k, v in kw.items())

    def set_postfix_str(self, s="", refresh=True):
        self.postfix = s

    def close(self):
        self.closed = True


def test_progress_counts_tokens_while_no_request_has_finished(tiny_model):
    """Long prompts prefilled in chunks: the requests bar sits at 0 for steps, the tokens bar moves
    (prefill + decode tokens of every step), and ends at exactly its total."""
    from workbench.entrypoints.progress import labelled_tqdm

    llm = LLM(model=str(tiny_model), block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
    ps = prompts(3, seed=5, lo=60, hi=80)
    FakeBar.made, FakeBar.log = [], []
    outs = llm.generate(ps, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=labelled_tqdm("paged", FakeBar))
    reqs, toks = FakeBar.made
    assert (reqs.desc, reqs.unit, toks.desc.rstrip(), toks.unit) == ("paged: requests", "req", "paged: tokens", "tok")
    assert reqs.n == reqs.total == 3 and reqs.closed and toks.closed
    steps = llm.llm_engine.recorder.steps
    prefill, decode = sum(s.num_prefill_tokens for s in steps), sum(s.num_decode_tokens for s in steps)
    assert prefill == sum(map(len, ps)) and decode == 3 * 5  # 6 outputs: the first sampled by the prefill
    assert toks.n == toks.total == prefill + decode
    assert toks.postfix == f"prefill {prefill:,} + decode {decode:,}"
    assert "step=" in reqs.postfix and "kv=" in reqs.postfix
    # before the first request finished, the tokens bar moved step by step (16-token prefill chunks)
    first_done = next(i for i, (desc, n) in enumerate(FakeBar.log) if desc == "paged: requests" and n > 0)
    before = sorted({n for desc, n in FakeBar.log[:first_done] if desc == "paged: tokens" and n > 0})
    assert len(before) >= 5 and before[:3] == [16, 32, 48]
    assert all(n <= total for n, total in toks.history)  # never past its total
    # the total is the truth from the start here: every prompt, then 5 decode steps per request (the
    # 6th token is sampled, never fed back); no request stopped early
    assert {total for _, total in toks.history} == {sum(map(len, ps)) + 3 * 5}
    assert [o.outputs[0].token_ids for o in outs] and len(outs) == 3


def test_progress_total_follows_refused_requests_and_recompute(tiny_model, tiny_llm):
    FakeBar.made = []
    long = [7] * 300  # longer than max_model_len=256: refused
    seen = len(tiny_llm.llm_engine.recorder.steps)
    outs = tiny_llm.generate([long, [5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=FakeBar)
    assert outs[0].error and not outs[1].error
    reqs, toks = FakeBar.made
    steps = tiny_llm.llm_engine.recorder.steps[seen:]
    done = sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps)
    assert done == 3 + 3 and toks.n == toks.total == done
    assert reqs.n == 2 and reqs.desc == "requests"

    # recompute preemption processes prompts again: the total grows with it, and still ends exactly
    llm = LLM(model=str(tiny_model), block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=128, num_gpu_blocks_override=40)  # fmt: skip
    FakeBar.made = []
    ps = prompts(8, seed=1)
    llm.generate(ps, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=FakeBar)
    reqs, toks = FakeBar.made
    steps = llm.llm_engine.recorder.steps
    assert sum(s.num_preempted_recompute for s in steps) > 0
    done = sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps)
    assert done > sum(map(len, ps)) + 8 * 19  # more than one pass: recomputed prompts
    assert toks.n == toks.total == done and all(n <= total for n, total in toks.history)
    assert max(total for _, total in toks.history) == done  # it grew to the truth, never past it
