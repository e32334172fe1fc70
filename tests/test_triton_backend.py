"""The Triton backend behind the engine: same attention as the PyTorch reference on engine-shaped
metadata, same greedy tokens end to end (chunked prefill, prefix caching, copy-on-write, swapping),
backend selection and its errors, and the package without Triton."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import greedy_tokens, random_prompts

from workbench import LLM, LLMEngine, kernels
from workbench.attention import AttentionMetadata, DecodeGroup, get_backend, resolve_backend, torch_ref
from workbench.config import EngineConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed (pip install triton)")


# ---------------------------------------------------------------------------- selection and errors
def test_backend_names_and_auto():
    assert resolve_backend("auto", "cpu") == "torch"
    assert get_backend("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="attention_backend='flash'.*'auto', 'torch', 'cpu', 'triton', 'triton-interpret'"):
        EngineConfig(attention_backend="flash").validate()


@needs_triton
def test_compiled_triton_on_cpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="device='cpu'.*'triton-interpret'"):
        LLMEngine(EngineConfig(attention_backend="triton", device="cpu"))  # refused before the model loads
    assert get_backend("triton-interpret", "cpu").name == "triton-interpret"


def test_triton_backend_without_triton_names_the_install(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="pip install triton"):
        LLMEngine(EngineConfig(attention_backend="triton-interpret"))
    assert resolve_backend("auto", "cpu") == "torch"


def test_cli_has_the_option():
    from click.testing import CliRunner

    from workbench.cli.main import main

    out = CliRunner().invoke(main, ["run", "--help"]).output
    assert "--attention-backend" in out and "triton-interpret" in out


@pytest.mark.slow
def test_package_runs_without_triton(tiny_model):
    """Triton blocked from import: the package imports, 'auto' is the PyTorch reference, the engine generates,
    asking for Triton names the fix, and the kernel modules say what to install."""
    code = f"""
import sys
sys.modules["triton"] = None  # an import of triton now raises ImportError
import workbench.kernels.reference, workbench.attention
from workbench import kernels
from workbench import LLM, SamplingParams
from workbench.config import EngineConfig
from workbench.engine import LLMEngine
assert not kernels.triton_available()
llm = LLM(model={str(tiny_model)!r}, block_size=4, max_model_len=64)
assert llm.llm_engine.executor.attn_backend.name == "torch"
out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
assert len(out[0].outputs[0].token_ids) == 3
try:
    LLMEngine(EngineConfig(attention_backend="triton-interpret"))  # refused before the model loads
    raise SystemExit("no error")
except ValueError as e:
    assert "pip install triton" in str(e)
try:
    import workbench.kernels.paged_attention
    raise SystemExit("no error")
except ImportError as e:
    assert "pip install triton" in str(e)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]


# ---------------------------------------------------------------------------- engine-shaped metadata
def build_step(specs, bs, nkv, group, d, seed=0):
    """A step as the executor lays it out: ``specs`` = (query tokens, context tokens) per sequence, the
    one-token ones first. Returns caches (context before the step written, the rest zero), the step's
    q / k / v, and its AttentionMetadata (decode sequences in two length groups, the second group
    without ``context_lens`` so that the backend counts them from the mask)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for _, c in specs]
    nb = sum(need) + 4
    kv = torch.zeros(2, nb, bs, nkv, d)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, slots = [], []
    for (qlen, ctx), n in zip(specs, need):
        table, perm = perm[:n], perm[n:]
        tables.append(table)
        pos = torch.arange(ctx)
        sl = torch.tensor(table)[pos // bs] * bs + pos % bs
        old = sl[: ctx - qlen]
        kv[:, :].view(2, -1, nkv, d)[:, old] = torch.randn(2, len(old), nkv, d, generator=g)
        slots.append(sl[ctx - qlen :])
    t = sum(q for q, _ in specs)
    q = torch.randn(t, nkv * group, d, generator=g)
    k = torch.randn(t, nkv, d, generator=g)
    v = torch.randn(t, nkv, d, generator=g)
    nd = sum(1 for qlen, _ in specs if qlen == 1)
    groups = []
    for lo, hi, with_lens in ((0, nd // 2, True), (nd // 2, nd, False)):
        if lo == hi:
            continue
        members = range(lo, hi)
        width = max(need[i] for i in members)
        bt = torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in members])
        ctx = torch.tensor([specs[i][1] for i in members])
        mask = (torch.arange(width * bs)[None, :] < ctx[:, None])[:, None, None, :]
        groups.append(DecodeGroup(lo, bt, mask, ctx if with_lens else None))
    pre = [i for i in range(len(specs)) if i >= nd]
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode=nd,
        decode_groups=groups,
        prefill_query_lens=[specs[i][0] for i in pre],
        prefill_context_lens=[specs[i][1] for i in pre],
        prefill_block_tables=[torch.tensor(tables[i]) for i in pre],
    )
    return kv, q, k, v, meta


@needs_triton
@pytest.mark.parametrize(("bs", "group"), [(8, 3), (16, 1)])
def test_triton_backend_equals_reference_on_a_mixed_step(bs, group):
    specs = [(1, 1), (1, bs - 1), (1, bs + 1), (1, 3 * bs), (1, 150), (20, 20), (9, 2 * bs + 3), (40, 200)]
    kv, q, k, v, meta = build_step(specs, bs, nkv=2, group=group, d=64)
    triton_be = get_backend("triton-interpret", "cpu")
    kv_ref = kv.clone()
    torch_ref.write_kv(kv_ref[0], kv_ref[1], k, v, meta.slot_mapping)
    triton_be.write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
    assert torch.equal(kv, kv_ref)
    ref = torch_ref.paged_attention(q, k, v, kv_ref[0], kv_ref[1], meta, 0.125)
    got = triton_be.paged_attention(q, k, v, kv[0], kv[1], meta, 0.125)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert "triton" in meta.extras  # built once per step, reused by the other layers


# ---------------------------------------------------------------------------- end to end


@needs_triton
@pytest.mark.slow
def test_engine_greedy_tokens_equal_reference_chunked_prefill_and_prefix_caching(tiny_model):
    """Prompts of 1 to 70 tokens, a 24-token budget (long prompts arrive in chunks over cached context),
    and a shared 20-token prefix served from the prefix cache."""
    ps = random_prompts(3, 0, 1, 50) + random_prompts(3, 1, 5, 20, shared=range(30, 50))
    args = dict(
        model=str(tiny_model), block_size=8, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128,
        enable_prefix_caching=True,
    )  # fmt: skip
    ref = greedy_tokens(LLM(attention_backend="torch", **args), ps)
    llm = LLM(attention_backend="triton-interpret", **args)
    assert llm.llm_engine.executor.attn_backend.name == "triton-interpret"
    assert greedy_tokens(llm, ps) == ref
    steps = llm.llm_engine.recorder.steps
    assert sum(s.prefix_cache_hits for s in steps) > 0


@needs_triton
@pytest.mark.slow
def test_engine_block_copies_by_triton_kernels(tiny_model, monkeypatch):
    """Parallel sampling (copy-on-write of the shared last prompt block) and swap preemption (gather /
    scatter) through the Triton kernels give the reference's tokens."""
    from workbench.attention.triton_backend import TritonBackend

    calls = []
    orig = TritonBackend.copy_blocks

    def spy(self, gpu, cpu, swap_out, copies, swap_in):
        calls.append((len(swap_out), len(copies), len(swap_in)))
        return orig(self, gpu, cpu, swap_out, copies, swap_in)

    monkeypatch.setattr(TritonBackend, "copy_blocks", spy)
    ps = random_prompts(4, 2, 10, 30)
    args = dict(
        model=str(tiny_model), block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=56,
        num_gpu_blocks_override=16, preemption_mode="swap", swap_space=0.001,
    )  # fmt: skip
    ref = greedy_tokens(LLM(attention_backend="torch", **args), ps, n=2, max_tokens=12)
    llm = LLM(attention_backend="triton-interpret", **args)
    assert greedy_tokens(llm, ps, n=2, max_tokens=12) == ref
    steps = llm.llm_engine.recorder.steps
    assert sum(s.swap_out_blocks for s in steps) > 0 and sum(s.cow_block_copies for s in steps) > 0
    assert sum(c[0] for c in calls) > 0 and sum(c[1] for c in calls) > 0 and sum(c[2] for c in calls) > 0
    kv = llm.llm_engine.kv
    assert kv.num_free_blocks == kv.num_blocks
