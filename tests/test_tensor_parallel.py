"""Tensor parallelism: Megatron layers and sharding, the worker processes over gloo,
their failure behaviour, the per-step communication figures and the NCCL buffer model.

CPU tests run real worker processes (spawn, gloo). CUDA tests (the NCCL path) are skipped
without GPUs."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from workbench import LLM, SamplingParams
from workbench.comm import (
    NCCL_DEFAULT_BUFFSIZE,
    NCCL_DEFAULT_LL128_BUFFSIZE,
    NCCL_DEFAULT_LL_BUFFSIZE,
    CommStats,
    nccl_buffer_bytes,
    parse_nccl_proto,
)
from workbench.config import EngineConfig
from workbench.engine import LLMEngine
from workbench.executor.tensor_parallel import TensorParallelError, modelled_comm_buffer_bytes
from workbench.model.parallel import (
    check_tensor_parallel,
    kv_head_range,
    shard_hf_state_dict,
    valid_tensor_parallel_sizes,
    vocab_range,
)

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 5, 9, 23, 77], [1, 100, 3], [1, 42, 42, 42, 7, 8, 9, 10, 11, 12]]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
TINY = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, block_size=16)


def _children() -> list[int]:
    """Live (not zombie) child processes of this process, from /proc (Linux)."""
    me, out = os.getpid(), []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] != "Z":
            out.append(int(d))
    return out


def _gone(pids) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.fixture
def no_leftovers():
    """Every test here must leave no worker and no process group behind."""
    before = set(_children())
    yield
    deadline = time.monotonic() + 10
    while set(_children()) - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not set(_children()) - before, "worker processes left behind"
    assert not multiprocessing.active_children()
    assert not torch.distributed.is_initialized()


def _logits_log(engine: LLMEngine) -> list[torch.Tensor]:
    """Record every step's logits (rank 0's) as the engine runs."""
    seen: list[torch.Tensor] = []
    run = engine.executor.execute_model

    def wrapped(inp):
        out = run(inp)
        seen.append(out.clone())
        return out

    engine.executor.execute_model = wrapped
    return seen


# ---------------------------------------------------------------- NCCL buffer model
def test_nccl_buffer_model_defaults_and_knobs():
    per_conn = NCCL_DEFAULT_BUFFSIZE + NCCL_DEFAULT_LL_BUFFSIZE + NCCL_DEFAULT_LL128_BUFFSIZE
    assert (NCCL_DEFAULT_BUFFSIZE, NCCL_DEFAULT_LL_BUFFSIZE, NCCL_DEFAULT_LL128_BUFFSIZE) == (4194304, 524288, 4915200)
    e = nccl_buffer_bytes(2)
    assert (e.nchannels, e.peers, e.per_connection_bytes) == (2, 1, per_conn)
    assert e.per_rank_bytes == 2 * per_conn and e.total_bytes == 2 * e.per_rank_bytes
    # ring: one incoming connection per channel whatever the group size; the group's total grows with it
    for n in (2, 4, 8):
        assert nccl_buffer_bytes(n, nchannels=8).per_rank_bytes == 8 * per_conn
        assert nccl_buffer_bytes(n, nchannels=8).total_bytes == n * 8 * per_conn
    assert nccl_buffer_bytes(1).per_rank_bytes == 0  # no peer, no buffer
    # NCCL_BUFFSIZE only moves the Simple protocol's share
    tuned = nccl_buffer_bytes(4, buffsize=1 << 20, nchannels=4)
    assert tuned.per_rank_bytes == 4 * (1 << 20) + 4 * (NCCL_DEFAULT_LL_BUFFSIZE + NCCL_DEFAULT_LL128_BUFFSIZE)
    assert nccl_buffer_bytes(2, protocols="Simple").per_rank_bytes == 2 * NCCL_DEFAULT_BUFFSIZE
    assert parse_nccl_proto("^LL128") == ("LL", "Simple")
    assert parse_nccl_proto("simple,ll") == ("LL", "Simple")
    # tree: parent and child inside a chain; channels clamped to [min, max]
    assert nccl_buffer_bytes(4, algorithm="ring+tree").peers == 3
    assert nccl_buffer_bytes(2, algorithm="tree").peers == 1
    assert nccl_buffer_bytes(2, min_nchannels=16).nchannels == 16
    assert nccl_buffer_bytes(2, nchannels=32, max_nchannels=4).nchannels == 4


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(buffsize=0), "NCCL_BUFFSIZE=0"),
        (dict(protocols="LL256"), "LL256"),
        (dict(protocols="^LL,LL128,Simple"), "no protocol"),
        (dict(min_nchannels=8, max_nchannels=2), "NCCL_MIN_NCHANNELS=8"),
        (dict(algorithm="mesh"), "mesh"),
    ],
)
def test_nccl_buffer_model_refuses_bad_input(kw, words):
    with pytest.raises(ValueError, match=words):
        nccl_buffer_bytes(2, **kw)


def test_engine_config_nccl_options():
    cfg = EngineConfig(nccl_buffsize=1 << 20, nccl_min_nchannels=2, nccl_max_nchannels=2, nccl_proto="Simple")
    assert modelled_comm_buffer_bytes(cfg.validate(), 4) == 2 * (1 << 20)
    from workbench.executor.tensor_parallel import nccl_env

    assert nccl_env(cfg) == {
        "NCCL_BUFFSIZE": "1048576",
        "NCCL_MIN_NCHANNELS": "2",
        "NCCL_MAX_NCHANNELS": "2",
        "NCCL_PROTO": "Simple",
    }
    for bad, words in [
        (dict(tensor_parallel_size=0), "tensor_parallel_size=0"),
        (dict(nccl_buffsize=-1), "nccl_buffsize=-1"),
        (dict(nccl_proto="fast"), "fast"),
        (dict(distributed_timeout_s=0), "distributed_timeout_s=0"),
        (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "'uni'"),
    ]:
        with pytest.raises(ValueError, match=words):
            EngineConfig(**bad).validate()


def test_comm_stats_since():
    a = CommStats(allreduce_bytes=10, num_collectives=1, comm_time_s=0.5)
    before = a.copy()
    a.allreduce_bytes += 7
    a.num_collectives += 2
    d = a.since(before)
    assert (d.allreduce_bytes, d.num_collectives, d.comm_time_s) == (7, 2, 0.0)


# ---------------------------------------------------------------- sharding rules
def test_valid_sizes_and_refusal_name_the_fix():
    smollm = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152
    )
    assert valid_tensor_parallel_sizes(smollm, 16) == [1, 3]  # 9 heads divide by 9, but 1536 does not
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide.*num_attention_heads=9.*\[1, 3\]"):
        check_tensor_parallel(smollm, 2)
    tiny = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert valid_tensor_parallel_sizes(tiny, 8) == [1, 2, 4]


def test_kv_head_and_vocab_ranges():
    assert [kv_head_range(2, r, 2) for r in range(2)] == [(0, 1), (1, 2)]
    assert [kv_head_range(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # replicated
    assert [kv_head_range(3, r, 3) for r in range(3)] == [(0, 1), (1, 2), (2, 3)]
    assert [vocab_range(10, r, 4) for r in range(4)] == [(0, 3, 3), (3, 6, 3), (6, 9, 3), (9, 10, 3)]


@pytest.mark.parametrize("n", [2, 4])
def test_shards_reassemble_the_checkpoint(tiny_hf, n):
    sd = tiny_hf.state_dict()
    cfg = tiny_hf.config
    shards = [shard_hf_state_dict(sd, cfg, r, n) for r in range(n)]
    p = "model.layers.0."
    assert torch.equal(torch.cat([s[p + "self_attn.q_proj.weight"] for s in shards]), sd[p + "self_attn.q_proj.weight"])
    assert torch.equal(
        torch.cat([s[p + "self_attn.o_proj.weight"] for s in shards], 1), sd[p + "self_attn.o_proj.weight"]
    )
    assert torch.equal(torch.cat([s[p + "mlp.up_proj.weight"] for s in shards]), sd[p + "mlp.up_proj.weight"])
    assert torch.equal(torch.cat([s[p + "mlp.down_proj.weight"] for s in shards], 1), sd[p + "mlp.down_proj.weight"])
    emb = torch.cat([s["model.embed_tokens.weight"] for s in shards])[: cfg.vocab_size]
    assert torch.equal(emb, sd["model.embed_tokens.weight"])
    k = [s[p + "self_attn.k_proj.weight"] for s in shards]
    d = cfg.hidden_size // cfg.num_attention_heads
    for r in range(n):
        lo, hi = kv_head_range(cfg.num_key_value_heads, r, n)
        assert torch.equal(k[r], sd[p + "self_attn.k_proj.weight"][lo * d : hi * d])
    assert torch.equal(shards[1][p + "input_layernorm.weight"], sd[p + "input_layernorm.weight"])


# ---------------------------------------------------------------- worker processes (gloo)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.slow
def test_tp_greedy_equals_tp1_tiny(tiny_model, n, no_leftovers):
    """TP=2 splits the 2 KV heads; TP=4 replicates them (one per rank, shared by two ranks)."""
    ref = LLMEngine(EngineConfig(model=str(tiny_model), **TINY))
    ref_logits = _logits_log(ref)
    for i, p in enumerate(PROMPTS):
        ref.add_request(str(i), p, GREEDY)
    ref_out = {}
    while ref.has_unfinished_requests():
        ref_out.update({o.request_id: o.outputs[0].token_ids for o in ref.step()})
    with LLMEngine(EngineConfig(model=str(tiny_model), tensor_parallel_size=n, **TINY)) as eng:
        logits = _logits_log(eng)
        for i, p in enumerate(PROMPTS):
            eng.add_request(str(i), p, GREEDY)
        out = {}
        while eng.has_unfinished_requests():
            out.update({o.request_id: o.outputs[0].token_ids for o in eng.step()})
        assert out == ref_out
        assert len(logits) == len(ref_logits)
        for a, b in zip(logits, ref_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        # the KV cache holds this rank's heads only: max(1, 2 // n) of 2
        assert eng.executor.kv_caches[0].shape[3] == max(1, 2 // n)
        assert eng.memory.kv_bytes_per_token == ref.memory.kv_bytes_per_token * max(1, 2 // n) // 2
        # per-step communication: (embedding + 2 per layer) all-reduces of [tokens, hidden] float32,
        # one all-gather of [sampling rows, ceil(V/n) * n] float32 logits
        cfg = eng.hf_config
        for st in eng.recorder.steps:
            tokens = st.num_prefill_tokens + st.num_decode_tokens
            assert st.allreduce_bytes == (1 + 2 * cfg.num_hidden_layers) * tokens * cfg.hidden_size * 4
            assert st.allgather_bytes > 0 and st.allgather_bytes % (-(-cfg.vocab_size // n) * n * 4) == 0
            assert st.broadcast_bytes > 0 and 0 < st.comm_time_s <= st.model_time_s
        assert eng.memory.comm_buffer_bytes == modelled_comm_buffer_bytes(eng.config, n) > 0


def test_tp_refused_before_any_worker_starts(tiny_model, no_leftovers):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide.*use one of \[1, 2, 4\]"):
        LLM(str(tiny_model), tensor_parallel_size=3, **TINY)


@pytest.mark.slow
def test_repeated_generate_and_engines_leave_nothing(tiny_model, no_leftovers):
    ref = LLM(str(tiny_model), **TINY).generate(PROMPTS, GREEDY)
    want = [o.outputs[0].token_ids for o in ref]
    with LLM(str(tiny_model), tensor_parallel_size=2, **TINY) as llm:
        pids = llm.llm_engine.executor.worker_pids
        for _ in range(2):  # the same engine, twice
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert _gone(pids)
    # a second engine in the same process; released by garbage collection, not shutdown()
    llm = LLM(str(tiny_model), tensor_parallel_size=2, **TINY)
    pids = llm.llm_engine.executor.worker_pids
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == want[:1]
    del llm
    gc.collect()
    deadline = time.monotonic() + 10
    while not _gone(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(pids)


def test_one_rank_group_runs_the_worker_path(tiny_model, no_leftovers):
    """distributed_executor_backend='mp' with one rank: the process-group path (NCCL's single-rank
    communicator on CUDA) on gloo here; same greedy tokens, collectives counted."""
    ref = [o.outputs[0].token_ids for o in LLM(str(tiny_model), **TINY).generate(PROMPTS, GREEDY)]
    with LLM(str(tiny_model), distributed_executor_backend="mp", **TINY) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref
        st = llm.llm_engine.recorder.steps[0]
        assert st.allreduce_bytes > 0 and llm.llm_engine.memory.comm_buffer_bytes == 0  # no peer, no buffer


@pytest.mark.slow
def test_killed_worker_fails_the_engine_within_timeout(tiny_model, no_leftovers):
    timeout = 30.0
    eng = LLMEngine(EngineConfig(model=str(tiny_model), tensor_parallel_size=2, distributed_timeout_s=timeout, **TINY))
    pids = eng.executor.worker_pids
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    eng.step()
    eng.step()  # mid-run: requests are decoding
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        for _ in range(100):
            eng.step()
    assert time.monotonic() - t0 < timeout
    assert _gone(pids)
    with pytest.raises(TensorParallelError, match="shut down"):  # the engine stays failed
        eng.step()
    eng.shutdown()  # idempotent


@pytest.mark.slow
def test_hung_worker_fails_the_engine_after_the_timeout(tiny_model, no_leftovers):
    timeout = 4.0
    eng = LLMEngine(EngineConfig(model=str(tiny_model), tensor_parallel_size=2, distributed_timeout_s=timeout, **TINY))
    pids = eng.executor.worker_pids
    eng.add_request("0", PROMPTS[0], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    eng.step()
    os.kill(pids[0], signal.SIGSTOP)  # alive but never answers
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match="failed while running a step"):
        for _ in range(100):
            eng.step()
    waited = time.monotonic() - t0
    assert waited < timeout + 20  # the collective's timeout, plus the time to stop the group
    assert _gone(pids)


@pytest.mark.slow
def test_script_without_main_guard_fails_fast_and_says_why(tiny_model, tmp_path):
    """A script that builds a TP engine at module level: each spawned worker re-runs it and dies while
    bootstrapping. The engine must say so at once (not after ``distributed_timeout_s``) and name the fix."""
    script = tmp_path / "no_guard.py"
    script.write_text(
        "from workbench import LLM\n"
        f"llm = LLM({str(tiny_model)!r}, tensor_parallel_size=2, distributed_timeout_s=600, **{TINY!r})\n"
        "print('engine built')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    waited = time.monotonic() - t0
    assert res.returncode != 0
    assert "engine built" not in res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("workbench.executor.tensor_parallel.TensorParallelError"), res.stderr[-3000:]
    assert "rank 1" in last and "before it joined the group" in last, last
    assert 'if __name__ == "__main__":' in last, last
    # the workers say the same, before loading any weights, and no empty error is printed
    assert res.stderr.count("is a tensor-parallel worker that is re-running the script") == 1, res.stderr[-3000:]
    assert "RuntimeError: ." not in res.stderr
    assert waited < 300  # not the 600 s distributed_timeout_s


def test_cli_flags_reach_the_engine(tiny_model):
    import click
    from click.testing import CliRunner

    from workbench.cli.main import engine_options

    seen = {}

    @click.command()
    @engine_options
    def cmd(**kw):
        from workbench.cli.main import _engine_args

        seen.update(_engine_args(kw))

    res = CliRunner().invoke(
        cmd,
        [
            "--tensor-parallel-size",
            "2",
            "--nccl-buffsize",
            "1048576",
            "--nccl-proto",
            "Simple",
            "--nccl-max-nchannels",
            "4",
        ],
    )
    assert res.exit_code == 0, res.output
    cfg = EngineConfig(**seen).validate()
    assert (cfg.tensor_parallel_size, cfg.nccl_buffsize, cfg.nccl_proto, cfg.nccl_max_nchannels) == (
        2,
        1 << 20,
        "Simple",
        4,
    )


@pytest.mark.slow
def test_torchrun_launch(tiny_model, tmp_path):
    """``torchrun --nproc-per-node 2 -m workbench.entrypoints.torchrun``: rank 0 builds the engine,
    rank 1 serves it; the tokens equal the one-process engine's."""
    ref = LLM(str(tiny_model), **TINY).generate(PROMPTS[:2], GREEDY)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "workbench.entrypoints.torchrun", "--model", str(tiny_model), "--max-tokens", "16",
        "--prompt-ids", "1,5,9,23,77", "--prompt-ids", "1,100,3",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[")]
    assert [eval(ln.split("\t")[0]) for ln in lines] == [o.outputs[0].token_ids for o in ref]


# ---------------------------------------------------------------- the bundled model
@pytest.mark.slow
def test_bundled_tp3_equals_tp1_and_tp2_is_refused(no_leftovers):
    prompts = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):"]
    kw = dict(dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide.*num_attention_heads=9.*\[1, 3\]"):
        LLM(tensor_parallel_size=2, **kw)
    one = LLMEngine(EngineConfig(**kw))
    one_logits = _logits_log(one)
    three = LLMEngine(EngineConfig(tensor_parallel_size=3, **kw))
    try:
        three_logits = _logits_log(three)
        for eng in (one, three):
            for i, p in enumerate(prompts):
                eng.add_request(str(i), p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
        outs = []
        for eng in (one, three):
            got = {}
            while eng.has_unfinished_requests():
                got.update({o.request_id: o.outputs[0].token_ids for o in eng.step()})
            outs.append(got)
        assert outs[0] == outs[1]
        assert all(len(v) == 16 for v in outs[0].values())
        for a, b in zip(three_logits, one_logits):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=1e-4)
        assert three.executor.kv_caches[0].shape[3] == 1  # 3 KV heads, one per rank
    finally:
        three.shutdown()


# ---------------------------------------------------------------- NCCL (GPU machines only)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_nccl_single_rank_group_measures_its_buffers(tiny_model, no_leftovers):
    ref = [o.outputs[0].token_ids for o in LLM(str(tiny_model), device="cuda", **TINY).generate(PROMPTS, GREEDY)]
    with LLM(str(tiny_model), device="cuda", distributed_executor_backend="mp", **TINY) as llm:
        ex = llm.llm_engine.executor
        assert ex.backend == "nccl" and ex.comm_buffer_source == "measured (cuda)"
        assert ex.comm_buffer_bytes >= 0
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL, TP=2)")
def test_nccl_tp2_equals_tp1(tiny_model, no_leftovers):
    ref = [o.outputs[0].token_ids for o in LLM(str(tiny_model), device="cuda", **TINY).generate(PROMPTS, GREEDY)]
    with LLM(str(tiny_model), device="cuda", tensor_parallel_size=2, **TINY) as llm:
        assert llm.llm_engine.executor.comm_buffer_source == "measured (cuda)"
        assert llm.llm_engine.executor.comm_buffer_bytes > 0
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref


@pytest.mark.slow
def test_failed_engine_start_after_workers_reaps_them(tiny_model, no_leftovers):
    """A bad argument found after the workers started (here: a KV pool too small for one block)."""
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1,000 holds no KV block"):
        LLM(str(tiny_model), tensor_parallel_size=2, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1000)
    gc.collect()
