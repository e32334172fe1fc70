"""Every Triton kernel equals its PyTorch reference: in Triton's interpreter on CPU tensors, and compiled on
a CUDA GPU when the machine has one (the same grids; ``dev`` is ``cpu`` and, with CUDA, ``cuda``).

Grids: block sizes 1, 8, 16, 32; GQA ratios 1, 3, 8; head dims 64 and 128; context lengths 1,
block_size - 1, block_size, block_size + 1 and a few hundred, mixed in one batch; block tables
whose tails point at a block full of NaN (a kernel that reads past a sequence's blocks fails);
every unwritten cache slot is NaN too (a kernel that lets a masked slot through fails). fp32 to
1e-4; fp16 / bf16 against a float32 reference with looser tolerances. Sizes are kept small: the
interpreter runs each program in NumPy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from workbench import kernels

if not kernels.triton_available():
    pytest.skip("Triton is not installed (pip install triton)", allow_module_level=True)

from workbench.kernels.cache_ops import (  # noqa: E402
    copy_blocks,
    copy_blocks_ref,
    gather_blocks,
    gather_blocks_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
    scatter_blocks,
    scatter_blocks_ref,
)
from workbench.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from workbench.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
#: CPU tensors run the kernels in the interpreter, CUDA tensors compiled (CI has no GPU: cpu only)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
on_devices = pytest.mark.parametrize("dev", DEVICES)


def to(dev: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(dev) for t in tensors]


LONG = 300  # "a few hundred" tokens


def kv_heads(group: int) -> int:
    return 2 if group == 1 else 1  # 2, 3 or 8 query heads: enough to test the head mapping, cheap to interpret


def paged_cache(ctx_lens, bs, nkv, d, dtype, seed=0, spare=3):
    """A NaN-filled cache with each sequence's tokens written in randomly placed blocks.

    Returns (k_cache, v_cache, block_tables [n, width] int32 with NaN-block tails, dense K, dense V)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // bs) for c in ctx_lens]
    nb = sum(need) + spare
    k_cache = torch.full((nb, bs, nkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((nb, bs, nkv, d), float("nan"), dtype=dtype)
    perm = torch.randperm(nb, generator=g)
    nan_block = int(perm[-1])  # never written: stays NaN, and every table tail points at it
    width = max(need) + 2
    tables = torch.full((len(ctx_lens), width), nan_block, dtype=torch.int32)
    dense_k, dense_v = [], []
    used = 0
    for i, (c, n) in enumerate(zip(ctx_lens, need)):
        blocks = perm[used : used + n]
        used += n
        tables[i, :n] = blocks.int()
        k = torch.randn(c, nkv, d, generator=g).to(dtype)
        v = torch.randn(c, nkv, d, generator=g).to(dtype)
        slots = blocks.repeat_interleave(bs)[:c] * bs + torch.arange(c) % bs
        k_cache.view(-1, nkv, d)[slots] = k
        v_cache.view(-1, nkv, d)[slots] = v
        dense_k.append(k)
        dense_v.append(v)
    return k_cache, v_cache, tables, dense_k, dense_v


def context_lengths(bs: int) -> list[int]:
    return sorted({1, max(1, bs - 1), bs, bs + 1, LONG}, key=lambda c: (c * 7) % 11)  # mixed order


def assert_close(got, ref, dtype):
    assert not torch.isnan(got).any(), "NaN in the kernel output: a masked or unused slot leaked in"
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype], f"max abs error {err:.3g} > {TOL[dtype]}"


# ---------------------------------------------------------------------------- decode
@pytest.mark.parametrize("variant", ["single", "split"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("bs", [1, 8, 16, 32])
@on_devices
def test_decode_matches_reference_fp32(dev, bs, group, head_dim, variant):
    ctx = context_lengths(bs)
    nkv = kv_heads(group)
    kc, vc, tables, _, _ = paged_cache(ctx, bs, nkv, head_dim, torch.float32, seed=bs * 31 + group)
    q = torch.randn(len(ctx), nkv * group, head_dim, generator=torch.Generator().manual_seed(1))
    lens = torch.tensor(ctx)
    kc, vc, tables, q, lens = to(dev, kc, vc, tables, q, lens)
    scale = head_dim**-0.5
    # split: 64-token partitions of two 32-key tiles, so LONG spans 5 partitions and bs+1 may straddle two
    extra = dict(partition_size=64, block_n=32) if variant == "split" else dict(partition_size=0)
    got = paged_decode_attention(q, kc, vc, tables, lens, scale, **extra)
    ref = paged_decode_attention_ref(q, kc, vc, tables, lens, scale)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("variant", ["single", "split"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@on_devices
def test_decode_half_precision(dev, dtype, variant):
    bs, group, d = 16, 3, 128
    ctx = context_lengths(bs)
    kc, vc, tables, _, _ = paged_cache(ctx, bs, 1, d, dtype, seed=5)
    q = torch.randn(len(ctx), group, d, generator=torch.Generator().manual_seed(2)).to(dtype)
    lens = torch.tensor(ctx)
    kc, vc, tables, q, lens = to(dev, kc, vc, tables, q, lens)
    extra = dict(partition_size=64) if variant == "split" else dict(partition_size=0)
    got = paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, **extra)
    assert got.dtype == dtype
    ref = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, lens, d**-0.5)
    assert_close(got, ref, dtype)


def test_decode_automatic_variant_and_output_slice():
    """partition_size=None (the automatic choice); ``out`` may be a row slice; int64 tables."""
    ctx = [1200, 7]
    kc, vc, tables, _, _ = paged_cache(ctx, 16, 2, 64, torch.float32, seed=9)
    q = torch.randn(2, 4, 64)
    big = torch.full((5, 4, 64), 7.0)
    got = paged_decode_attention(q, kc, vc, tables.long(), torch.tensor(ctx).long(), 0.125, out=big[1:3])
    assert got.data_ptr() == big[1].data_ptr()
    assert (big[0] == 7).all() and (big[3:] == 7).all()
    assert_close(big[1:3], paged_decode_attention_ref(q, kc, vc, tables, torch.tensor(ctx), 0.125), torch.float32)


def test_split_kv_is_chosen_for_few_long_contexts():
    from workbench.kernels.paged_attention import SPLIT_KV_MIN_PARTITIONS, use_split_kv

    cpu, long = torch.device("cpu"), SPLIT_KV_MIN_PARTITIONS * 512
    assert use_split_kv(1, 8, long, cpu) and not use_split_kv(1, 8, long - 1, cpu)
    assert not use_split_kv(4096, 8, 10 * long, cpu)  # enough programs for every SM already


def test_decode_rejects_bad_shapes():
    kc = torch.zeros(4, 8, 2, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.zeros(2, 3, 64), kc, kc, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2), 1.0)
    with pytest.raises(ValueError, match="num_seqs=2"):
        paged_decode_attention(torch.zeros(2, 4, 64), kc, kc, torch.zeros(3, 1, dtype=torch.int32), torch.ones(2), 1.0)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        paged_decode_attention(
            torch.zeros(2, 4, 64), kc, kc, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2), 1.0, interpret=False
        )


# ---------------------------------------------------------------------------- prefill
def prefill_batch(bs: int) -> tuple[list[int], list[int]]:
    """(query lens, context lens): a whole prefill, chunks over cached context (short and a few hundred
    tokens, the long one spanning two 64-row query tiles), a one-token chunk."""
    ctx = [max(1, bs - 1), bs + 1, 2 * bs, 1, LONG]
    q = [max(1, bs - 1), 5 if bs + 1 >= 5 else bs + 1, bs, 1, 70]
    return q, ctx


# every block size and GQA ratio, each head dim with every block size (the interpreter makes the
# full 4 x 3 x 2 cross product too slow for CI)
PREFILL_GRID = [(bs, g, d) for bs in (1, 8, 16, 32) for g in (1, 3, 8) for d in ((64, 128) if g == 3 else (64,) if bs in (1, 16) else (128,))]  # fmt: skip


@pytest.mark.parametrize(("bs", "group", "head_dim"), PREFILL_GRID)
@on_devices
def test_prefill_matches_reference_fp32(dev, bs, group, head_dim):
    qlens, ctx = prefill_batch(bs)
    nkv = kv_heads(group)
    kc, vc, tables, _, _ = paged_cache(ctx, bs, nkv, head_dim, torch.float32, seed=bs + 7 * group)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    q = torch.randn(int(qsl[-1]), nkv * group, head_dim, generator=torch.Generator().manual_seed(3))
    lens = torch.tensor(ctx)
    kc, vc, tables, qsl, q, lens = to(dev, kc, vc, tables, qsl, q, lens)
    got = paged_prefill_attention(q, kc, vc, tables, qsl, lens, head_dim**-0.5, max_query_len=max(qlens))
    ref = paged_prefill_attention_ref(q, kc, vc, tables, qsl, lens, head_dim**-0.5)
    assert_close(got, ref, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@on_devices
def test_prefill_half_precision(dev, dtype):
    qlens, ctx = prefill_batch(16)
    kc, vc, tables, _, _ = paged_cache(ctx, 16, 2, 64, dtype, seed=4)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), 4, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    lens = torch.tensor(ctx, dtype=torch.int32)
    kc, vc, tables, qsl, q, lens = to(dev, kc, vc, tables, qsl, q, lens)
    got = paged_prefill_attention(q, kc, vc, tables, qsl, lens, 0.125, max_query_len=max(qlens))
    ref = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, qsl, lens, 0.125)
    assert_close(got, ref, dtype)


def test_prefill_without_max_query_len_and_the_decode_case():
    """Default grid (sized by num_tokens) gives the same result; one-token chunks equal decode attention."""
    ctx = [9, 40]
    kc, vc, tables, _, _ = paged_cache(ctx, 8, 1, 64, torch.float32, seed=6)
    q = torch.randn(2, 3, 64)
    lens = torch.tensor(ctx)
    pre = paged_prefill_attention(q, kc, vc, tables, torch.tensor([0, 1, 2]), lens, 0.125)
    dec = paged_decode_attention(q, kc, vc, tables, lens, 0.125)
    assert_close(pre, dec, torch.float32)


# ---------------------------------------------------------------------------- cache writes and copies
@pytest.mark.parametrize(
    ("bs", "src_dtype", "cache_dtype"),
    [(1, torch.float32, torch.float32), (8, torch.float16, torch.float16), (16, torch.float32, torch.bfloat16),
     (32, torch.float32, torch.float32)],
)  # fmt: skip
@on_devices
def test_reshape_and_cache_matches_reference(dev, bs, src_dtype, cache_dtype):
    g = torch.Generator().manual_seed(bs)
    nb, nkv, d, n = 12, 3, 64, 11
    qkv = torch.randn(n, 5, nkv, d, generator=g).to(dev, src_dtype)
    k, v = qkv[:, 1], qkv[:, 3]  # strided views, as the model's split of the fused QKV projection gives
    slots = torch.randperm(nb * bs, generator=g)[:n]
    slots[4] = -1  # padding: skipped
    slots = slots.to(dev)
    caches = [torch.randn(nb, bs, nkv, d, generator=g).to(dev, cache_dtype) for _ in range(2)]
    refs = [c.clone() for c in caches]
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    reshape_and_cache_ref(k, v, refs[0], refs[1], slots)
    if src_dtype == cache_dtype:
        assert torch.equal(caches[0], refs[0]) and torch.equal(caches[1], refs[1])
    else:  # the interpreter truncates float32 -> bfloat16 where torch rounds to nearest: 1 ulp
        for got, ref in zip(caches, refs):
            torch.testing.assert_close(got.float(), ref.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("bs", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@on_devices
def test_copy_gather_scatter_match_reference(dev, bs, dtype):
    g = torch.Generator().manual_seed(bs)
    cache = torch.randn(2, 12, bs, 2, 64, generator=g).to(dev, dtype)
    ref = cache.clone()
    src, dst = torch.tensor([3, 0, 7], device=dev), torch.tensor([5, 11, 1], device=dev)
    copy_blocks(cache, src, dst)
    copy_blocks_ref(ref, src, dst)
    assert torch.equal(cache, ref)
    copy_blocks(cache, src[:0], dst[:0])  # no pairs: nothing happens
    assert torch.equal(cache, ref)
    picked, put = torch.tensor([9, 2], device=dev), torch.tensor([4, 6], device=dev)
    packed = gather_blocks(cache, picked)
    assert packed.shape == (2, 2, bs, 2, 64) and torch.equal(packed, gather_blocks_ref(cache, picked))
    host = packed.clone()  # as swapping moves it to host memory and back
    scatter_blocks(host, cache, put)
    scatter_blocks_ref(host, ref, put)
    assert torch.equal(cache, ref)


# ---------------------------------------------------------------------------- modes
def _run(code: str, env_update: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_update
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_triton_interpret_env_mode_runs_the_kernels():
    """With TRITON_INTERPRET=1 set before Triton's first import (Triton's own switch), every kernel is
    interpreted; the wrappers accept it and refuse compiled launches."""
    code = """
import torch
from workbench import kernels
assert kernels.interpreter_forced()
from workbench.kernels.paged_attention import paged_decode_attention, paged_decode_attention_ref
from workbench.kernels.runtime import process_interprets
assert process_interprets()
kc = torch.randn(4, 8, 1, 64); vc = torch.randn(4, 8, 1, 64)
bt = torch.tensor([[2, 0, 3]]); lens = torch.tensor([20]); q = torch.randn(1, 3, 64)
got = paged_decode_attention(q, kc, vc, bt, lens, 0.125, partition_size=0)
assert (got - paged_decode_attention_ref(q, kc, vc, bt, lens, 0.125)).abs().max() < 1e-5
print("ok")
"""
    r = _run(code, {"TRITON_INTERPRET": "1"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.mark.slow
def test_kernels_compile_for_a_cuda_gpu():
    """The interpreter checks results, not compilation: compile every kernel to a cubin for sm_90 (H100/H200),
    without a GPU (Triton ships ptxas), in a process where Triton is in compiled mode."""
    r = _run(
        "from workbench.kernels.aot import main; main(['--arch', '90', '--dtype', 'fp16', '--head-dim', '64'])", {}
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sm_90 fp16: 6 kernels compiled" in r.stdout
