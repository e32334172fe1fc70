"""The C++ CPU decode-attention kernel (workbench/kernels/cpu_attention.py) against its PyTorch reference, the
``"cpu"`` attention backend in the engine, and how ``attention_backend`` chooses and refuses it."""

from __future__ import annotations

import os
import random

import pytest
import torch

from workbench import LLM, LLMEngine, SamplingParams
from workbench.attention import backend as backend_mod
from workbench.attention import get_backend, resolve_backend
from workbench.config import EngineConfig
from workbench.kernels import cpu_attention
from workbench.kernels.reference import paged_decode_attention_ref, paged_prefill_attention_ref

MISSING = cpu_attention.toolchain_missing()
REQUIRE = os.environ.get("WORKBENCH_REQUIRE_CPU_KERNEL") == "1"  # .ci/run sets it: the kernel must build there
needs_toolchain = pytest.mark.skipif(MISSING is not None and not REQUIRE, reason=f"cannot build: {MISSING}")


def _benchmark(name: str):
    """The script ``benchmarks/<name>.py`` as a module (its folder is not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

def _case(seed, dtype, num_heads, num_kv_heads, block_size, lens, head_dim=64, num_blocks=64):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    width = max(-(-n // block_size) for n in lens) + 1  # one spare column: entries past a sequence are never read
    perm = random.Random(seed).sample(range(num_blocks), num_blocks)  # blocks anywhere, in any order
    tables = torch.tensor([[perm[(i * width + j) % num_blocks] for j in range(width)] for i in range(len(lens))])
    return q, kc, vc, tables, torch.tensor(lens)


@needs_toolchain
@pytest.mark.parametrize(
    "dtype,num_heads,num_kv_heads,block_size,lens,head_dim",
    [
        (torch.float32, 4, 4, 16, [1, 17, 40], 64),  # multi-head, a one-token context, a partial last block
        (torch.float32, 9, 3, 16, [5, 32, 33, 64], 64),  # grouped-query (3 query heads per KV head), full blocks
        (torch.float32, 8, 1, 1, [3, 9], 64),  # block_size 1, multi-query
        (torch.bfloat16, 9, 3, 16, [1, 100, 200], 64),
        (torch.bfloat16, 8, 2, 8, [7, 64], 64),
        # bfloat16 with head_dim 64/128 takes 16 positions per step: lengths around 16's multiples, a length of one,
        # block sizes below and above 16, multi-query, head_dim 128
        (torch.bfloat16, 9, 3, 4, [1, 15, 16, 17, 31, 33], 64),
        (torch.bfloat16, 8, 1, 32, [2, 47, 48, 300], 64),
        (torch.bfloat16, 4, 4, 16, [5, 129], 128),
        (torch.bfloat16, 6, 2, 1, [3, 18], 96),  # head_dim 96: the row-wise path
    ],
)
@pytest.mark.parametrize("rowwise", [False, True], ids=["kernel", "rowwise"])
def test_the_kernel_equals_its_reference(dtype, num_heads, num_kv_heads, block_size, lens, head_dim, rowwise):
    q, kc, vc, tables, ctx = _case(len(lens) + num_heads, dtype, num_heads, num_kv_heads, block_size, lens, head_dim)
    got = cpu_attention.paged_decode_attention(q, kc, vc, tables, ctx, 0.125, rowwise=rowwise)
    assert got.dtype == dtype and got.shape == q.shape
    ref32 = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, ctx, 0.125)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref32, atol=2e-6, rtol=1e-5)  # float32 throughout: the order of sums only
    else:  # float32 sums; p in bfloat16 (as SDPA's bfloat16 kernel) for the 16-position kernel; one final rounding
        ref16 = paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.125).float()
        assert (got.float() - ref32).abs().max().item() <= 1e-2
        assert (got.float() - ref32).abs().max() <= (ref16 - ref32).abs().max() + 1e-2


@needs_toolchain
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_sequence_is_attended_once_when_threads_claim_the_next_one_early(threads):
    """decode_rows hands sequences out longest first and each thread claims its next one a sequence early, to
    prefetch it while it computes the current one (only the first 384 KiB of K and V: 512 positions here). With
    more sequences than threads, contexts past that cap, partial blocks and one-token contexts, every row must
    still be its own sequence's attention."""
    lens = [1, 700, 16, 513, 33, 1, 260, 90, 511, 17, 2, 1024, 48]
    q, kc, vc, tables, ctx = _case(7, torch.bfloat16, 9, 3, 16, lens, 64, num_blocks=256)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_attention.paged_decode_attention(q, kc, vc, tables, ctx, 0.125)
    finally:
        torch.set_num_threads(before)
    ref32 = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, ctx, 0.125)
    ref16 = paged_decode_attention_ref(q, kc, vc, tables, ctx, 0.125).float()
    errors = (got.float() - ref32).abs().amax(dim=(1, 2))  # one figure per sequence: a swapped row would stand out
    assert errors.max().item() <= (ref16 - ref32).abs().max().item() + 1e-2, errors


# ---------------------------------------------------------------- query chunks of any length (prefill and decode)
needs_bf16_dot = pytest.mark.skipif(
    MISSING is not None or not cpu_attention.chunk_kernel_available(),
    reason="the chunk kernel needs AVX512-BF16 (and a C++ toolchain) on this CPU",
)


def _chunks(seed, num_heads, num_kv_heads, block_size, qlens, ctxs, head_dim=64, num_blocks=96):
    q, kc, vc, tables, _ = _case(seed, torch.bfloat16, num_heads, num_kv_heads, block_size, ctxs, head_dim, num_blocks)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(qlens), num_heads, head_dim, generator=g).bfloat16()
    start = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()])
    return q, kc, vc, tables, start, torch.tensor(ctxs)


@needs_bf16_dot
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,block_size,head_dim,qlens,ctxs",
    [
        (9, 3, 16, 64, [1, 1, 1], [1, 17, 300]),  # decode rows only: a one-token context, a partial last block
        (9, 3, 16, 64, [40, 1, 333], [40, 90, 333]),  # whole prompts, a decode, a prompt longer than a tile
        (9, 3, 16, 64, [7, 64, 2], [100, 64, 31]),  # chunks after cached context (chunked prefill, prefix hits)
        (8, 2, 8, 64, [5, 20], [29, 20]),  # block_size 8: a 16-token group spans two blocks
        (4, 4, 32, 128, [17, 1], [50, 70]),  # head_dim 128, multi-head, block_size 32
        (8, 1, 4, 64, [3, 9], [9, 9]),  # multi-query, small blocks
        # the kernel steps 32 positions (two tiles of 16): rows that end in the first or the second tile, a context
        # one past a step, one position into the second tile, a decode at a step's end
        (9, 3, 16, 64, [20, 33, 16, 1, 40], [48, 33, 65, 32, 97]),
        (9, 3, 4, 128, [31, 47, 2], [63, 49, 17]),  # block_size 4, head_dim 128
    ],
)
def test_the_chunk_kernel_equals_the_prefill_reference(num_heads, num_kv_heads, block_size, head_dim, qlens, ctxs):
    """Causal attention of each sequence's last ``qlen`` tokens over its paged context, read from the blocks: within
    bfloat16's rounding of the exact (float32) reference, and no worse than the bfloat16 reference's own error."""
    q, kc, vc, tables, start, ctx = _chunks(sum(ctxs), num_heads, num_kv_heads, block_size, qlens, ctxs, head_dim)
    got = cpu_attention.paged_attention(q, kc, vc, tables, start, ctx, 0.125)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape
    ref32 = paged_prefill_attention_ref(q.float(), kc.float(), vc.float(), tables, start, ctx, 0.125)
    ref16 = paged_prefill_attention_ref(q, kc, vc, tables, start, ctx, 0.125).float()
    err = (got.float() - ref32).abs().max().item()
    assert err <= 1.6e-2, err
    assert err <= (ref16 - ref32).abs().max().item() * 1.5 + 4e-3


@needs_bf16_dot
@pytest.mark.slow
def test_the_chunk_benchmark_script_runs(capsys):
    bench = _benchmark("cpu_chunk_attention")
    assert bench.main(["--lengths", "40", "--calls", "1", "--decode-seqs", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 40 |" in out and "decode / chunk" in out


@needs_toolchain
def test_the_decode_benchmark_times_layers_with_their_own_caches(capsys):
    bench = _benchmark("cpu_attention")
    args = ["--num-seqs", "4", "--context", "40", "--num-blocks", "64", "--calls", "2", "--dtype", "float32"]
    bench.main([*args, "--layers", "3"])
    out = capsys.readouterr().out
    assert "per layer of 3, each with its own cache" in out and "largest difference" in out
    with pytest.raises(SystemExit):
        bench.main([*args, "--layers", "0"])
    assert "--layers must be at least 1, got 0" in capsys.readouterr().err

@needs_bf16_dot
def test_the_chunk_kernel_refuses_bad_layouts_before_it_reads():
    q, kc, vc, tables, start, ctx = _chunks(0, 9, 3, 16, [4, 1], [20, 30])
    with pytest.raises(ValueError, match=r"sequence 0 has 4 query tokens but a context of 3"):
        cpu_attention.paged_attention(q, kc, vc, tables, start, torch.tensor([3, 30]), 0.125)
    with pytest.raises(ValueError, match=r"context of 99 tokens.*max_blocks 3 x block_size 16"):
        cpu_attention.paged_attention(q, kc, vc, tables, start, torch.tensor([20, 99]), 0.125)
    with pytest.raises(ValueError, match=r"query_start must run from 0 to 5"):
        cpu_attention.paged_attention(q, kc, vc, tables, torch.tensor([0, 4, 6]), ctx, 0.125)
    with pytest.raises(ValueError, match=r"but \{'v_cache': torch.float32\}; convert with .bfloat16\(\)"):
        cpu_attention.paged_attention(q, kc, vc.float(), tables, start, ctx, 0.125)
    with pytest.raises(ValueError, match=r"head_dim 64 or 128, got shape \(5, 9, 32\)"):
        cpu_attention.paged_attention(q[..., :32], kc[..., :32], vc[..., :32], tables, start, ctx, 0.125)
    with pytest.raises(ValueError, match=r"query_start must run from 0 to 5 .*; got \[0, 4, 6\]"):
        cpu_attention.paged_attention(q, kc, vc, tables, torch.tensor([0, 4, 6]), ctx, 0.125)
    layer = torch.stack([kc, vc])  # the engine's [2, num_blocks, ...] layer cache: named, with the fix
    with pytest.raises(ValueError, match=r"got \[2, 96, 16, 3, 64\] and .*pass cache\[0\] and cache\[1\]"):
        cpu_attention.paged_attention(q, layer, layer, tables, start, ctx, 0.125)
    with pytest.raises(ValueError, match=r"must both be \[num_blocks, .*got \[16, 3, 64\] and \[96, 16, 3, 64\]"):
        cpu_attention.paged_attention(q, kc[0], vc, tables, start, ctx, 0.125)
    with pytest.raises(ValueError, match=r"got \[96, 16, 3, 64\] and \[50, 16, 3, 64\]"):
        cpu_attention.paged_decode_attention(q[:2, :, :], kc, vc[:50], tables, ctx, 0.125)
    bad = tables.clone()
    bad[1, 1] = 10_000  # a block id past the pool: refused, not read (it would crash the process)
    with pytest.raises(ValueError, match=r"sequence 1 reads block 10000 \(block_tables\[1, 1\]\), outside the pool of 96"):
        cpu_attention.paged_attention(q, kc, vc, bad, start, ctx, 0.125)
    bad[1, 1], bad[0, 0] = tables[1, 1], -5
    with pytest.raises(ValueError, match=r"sequence 0 reads block -5"):
        cpu_attention.paged_attention(q, kc, vc, bad, start, ctx, 0.125)
    bad[0, 0] = tables[0, 0]
    bad[0, 2] = 10_000  # past the blocks sequence 0 reads (20 tokens = 2 blocks): never read, so allowed
    cpu_attention.paged_attention(q, kc, vc, bad, start, ctx, 0.125)


@needs_bf16_dot
def test_the_backend_sends_prefill_chunks_to_the_chunk_kernel_and_the_switch_turns_it_off(monkeypatch):
    """Decode rows to the decode kernel, prefill chunks to the chunk kernel; ``WORKBENCH_CPU_CHUNK_KERNEL=0`` sends
    the chunks to the reference. Either way the step's output is the reference's, within bfloat16 rounding."""
    from workbench.attention import cpu_backend
    from workbench.attention.torch_ref import AttentionMetadata, DecodeGroup
    from workbench.attention.torch_ref import paged_attention as reference

    q, kc, vc, tables, start, ctx = _chunks(7, 9, 3, 16, [1, 1, 30, 12], [40, 17, 30, 50])
    k, v = torch.zeros(2, q.shape[0], 3, 64, dtype=torch.bfloat16)  # the reference reads fresh K/V for whole prompts:
    for i, row in enumerate(range(2, 32)):  # give it the cached rows of the 30-token prompt
        k[row], v[row] = kc[tables[2, i // 16], i % 16], vc[tables[2, i // 16], i % 16]
    width = tables.shape[1]
    mask = (torch.arange(width * 16) < ctx[:2, None]).view(2, 1, 1, -1)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64), num_decode=2,
        decode_groups=[DecodeGroup(0, tables[:2], mask, ctx[:2])],
        prefill_query_lens=[30, 12], prefill_context_lens=[30, 50], prefill_block_tables=[tables[2], tables[3]],
    )  # fmt: skip
    want = reference(q, k, v, kc, vc, meta, 0.125).float()
    calls = []

    class Spy:  # the extension module, counting chunk-kernel calls
        def __getattr__(self, name):
            fn = getattr(cpu_attention.load(), name)
            return (lambda *a: calls.append(name) or fn(*a)) if name == "paged_attention" else fn

    for flag, chunk_calls in (("1", 1), ("0", 0), ("off", 0), ("", 1)):
        monkeypatch.setenv("WORKBENCH_CPU_CHUNK_KERNEL", flag)
        backend = cpu_backend.CpuBackend()
        backend._ext = Spy()
        calls.clear()
        meta.extras.clear()
        got = backend.paged_attention(q, k, v, kc, vc, meta, 0.125).float()
        assert len(calls) == chunk_calls
        assert ("C++ chunk kernel" in backend.detail) == (chunk_calls == 1)
        assert (got - want).abs().max().item() <= 2e-2
    monkeypatch.setenv("WORKBENCH_CPU_CHUNK_KERNEL", "of")  # a typo is refused, not taken for "on"
    with pytest.raises(ValueError, match="WORKBENCH_CPU_CHUNK_KERNEL='of' is not an on/off switch.*unset it for the default \\(on\\)"):
        cpu_backend.CpuBackend()


@needs_toolchain
@pytest.mark.parametrize("flag,kernel", [("", "paged_decode_attention"), ("rowwise", "paged_decode_attention_rowwise")])
def test_the_backend_runs_all_decode_groups_in_one_kernel_call(monkeypatch, flag, kernel):
    """The executor's decode groups (two widths here) go to the decode kernel merged, one call per layer;
    ``WORKBENCH_CPU_DECODE_KERNEL=rowwise`` picks the row-wise kernel. The rows equal the reference's."""
    from workbench.attention import cpu_backend
    from workbench.attention.torch_ref import AttentionMetadata, DecodeGroup

    q, kc, vc, tables, ctx = _case(3, torch.bfloat16, 9, 3, 16, [5, 40, 70])
    groups = []
    for start, size, width in ((0, 1, 1), (1, 2, 5)):
        mask = (torch.arange(width * 16) < ctx[start : start + size, None]).view(size, 1, 1, -1)
        groups.append(DecodeGroup(start, tables[start : start + size, :width], mask, ctx[start : start + size]))
    meta = AttentionMetadata(torch.zeros(3, dtype=torch.int64), 3, groups, [], [], [])
    ext, calls = cpu_attention.load(), []

    class Spy:  # the extension module, recording which decode kernel runs
        def __getattr__(self, name):
            fn = getattr(ext, name)
            return (lambda *a: calls.append(name) or fn(*a)) if name.startswith("paged_decode") else fn

    monkeypatch.setattr(cpu_backend.cpu_attention, "load", Spy)
    monkeypatch.setenv("WORKBENCH_CPU_DECODE_KERNEL", flag)
    backend = cpu_backend.CpuBackend()
    got = backend.paged_attention(q, None, None, kc, vc, meta, 0.125).float()
    assert calls == [kernel]
    assert ("rowwise" in backend.detail) == (flag == "rowwise")
    want = paged_decode_attention_ref(q.float(), kc.float(), vc.float(), tables, ctx, 0.125)
    assert (got - want).abs().max().item() <= 1e-2


@needs_toolchain
def test_both_kernels_refuse_what_would_crash_the_process_and_name_it():
    """Found by a new-user trial: no KV heads divided by zero (SIGFPE) and caches off the CPU were read (segfault).
    Both kernels now refuse them, and the layout's own faults, naming the value."""
    q, kc, vc, tables, ctx = _case(1, torch.bfloat16, 6, 2, 16, [5, 40])
    no_heads = torch.zeros(64, 16, 0, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"num_heads \(6\) must be a multiple of the caches' num_kv_heads \(0\)"):
        cpu_attention.paged_decode_attention(q, no_heads, no_heads, tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match=r"k_cache is on meta: the CPU kernels read host memory"):
        cpu_attention.paged_decode_attention(q, kc.to("meta"), vc.to("meta"), tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match=r"q's num_heads \(5\) must be a multiple"):
        cpu_attention.paged_decode_attention(q[:, :5], kc, vc, tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match=r"q's head_dim \(32\) differs from the caches' \(64\)"):
        cpu_attention.paged_decode_attention(q[..., :32].contiguous(), kc, vc, tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match=r"one dtype, got BFloat16, Float and BFloat16"):
        cpu_attention.paged_decode_attention(q, kc.float(), vc, tables, ctx, 0.125)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16, got Half"):
        cpu_attention.paged_decode_attention(q.half(), kc.half(), vc.half(), tables, ctx, 0.125)
    with pytest.raises(ValueError, match=r"context_lens must hold integers \(int32 or int64\), got torch.float32"):
        cpu_attention.paged_decode_attention(q, kc, vc, tables, torch.tensor([5.7, 40.2]), 0.125)
    with pytest.raises(ValueError, match=r"one length per block-table row \(2\), got shape \(3,\)"):
        cpu_attention.paged_decode_attention(q, kc, vc, tables, torch.tensor([5, 40, 1]), 0.125)
    with pytest.raises(RuntimeError, match=r"q has 1 rows, block_tables is \[2, 4\]"):
        cpu_attention.paged_decode_attention(q[:1], kc, vc, tables, ctx, 0.125)
    got = cpu_attention.paged_decode_attention(q, kc, vc, tables.tolist(), [5, 40], 0.125)  # lists are taken
    assert torch.equal(got, cpu_attention.paged_decode_attention(q, kc, vc, tables, ctx, 0.125))
    if cpu_attention.chunk_kernel_available():
        start = torch.tensor([0, 1, 2])
        with pytest.raises(RuntimeError, match=r"num_kv_heads \(0\), which must be at least 1"):
            cpu_attention.paged_attention(q, no_heads, no_heads, tables, start, ctx, 0.125)
        with pytest.raises(RuntimeError, match=r"v_cache is on meta"):
            cpu_attention.paged_attention(q, kc, vc.to("meta"), tables, start, ctx, 0.125)


def test_a_misspelled_decode_kernel_switch_is_refused(monkeypatch):
    from workbench.attention import cpu_backend

    monkeypatch.setenv("WORKBENCH_CPU_DECODE_KERNEL", "RowWise")
    with pytest.raises(ValueError, match=r"WORKBENCH_CPU_DECODE_KERNEL='RowWise' is not a decode kernel.*'rowwise'"):
        cpu_backend.CpuBackend()


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_fresh_one_kept(monkeypatch, tmp_path):
    """torch's builder waits forever on a ``lock`` file; one left by a killed build (older than STALE_LOCK_S)
    would hang every later load."""
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_build" / "lock"
    lock.parent.mkdir()
    lock.touch()
    cpu_attention._remove_stale_lock("some_build")
    assert lock.exists()  # a build may be running
    old = time.time() - cpu_attention.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    cpu_attention._remove_stale_lock("some_build")
    assert not lock.exists()


def test_two_torch_installations_get_two_build_folders(monkeypatch):
    name = cpu_attention._extension_name()
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert cpu_attention._extension_name() != name


@needs_toolchain
def test_a_length_outside_the_table_is_refused_before_the_kernel_reads():
    q, kc, vc, tables, _ = _case(0, torch.float32, 4, 4, 16, [20])
    with pytest.raises(ValueError, match=r"context_lens span 0\.\.0 tokens, but each must be in 1\.\.48"):
        cpu_attention.paged_decode_attention(q, kc, vc, tables, torch.tensor([0]), 0.125)
    with pytest.raises(ValueError, match=r"max_blocks 3 x block_size 16"):
        cpu_attention.paged_decode_attention(q, kc, vc, tables, torch.tensor([49]), 0.125)
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_attention.paged_decode_attention(q.bfloat16(), kc, vc, tables, torch.tensor([20]), 0.125)
    bad = tables.clone()
    bad[0, 1] = 10_000  # a block id past the pool (64 blocks): refused before the kernel reads (it would crash)
    with pytest.raises(ValueError, match=r"sequence 0 reads block 10000 \(block_tables\[0, 1\]\), outside the pool of 64"):
        cpu_attention.paged_decode_attention(q, kc, vc, bad, torch.tensor([20]), 0.125)


def test_auto_takes_the_kernel_for_a_bfloat16_cache_on_the_cpu_only(monkeypatch):
    monkeypatch.setattr(cpu_attention, "toolchain_missing", lambda: None)
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "cpu"
    assert resolve_backend("auto", "cpu", torch.float32) == "torch"  # float32 stays on the exact reference
    assert resolve_backend("auto", "cpu") == "torch"
    monkeypatch.setattr(cpu_attention, "toolchain_missing", lambda: "no C++ compiler (c++ / g++) on PATH: `apt-get install g++`")
    assert resolve_backend("auto", "cpu", torch.bfloat16) == "torch"
    with pytest.raises(ValueError, match="apt-get install g\\+\\+.*or use 'torch'"):
        get_backend("cpu", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="runs on the CPU, but device='cuda'"):
        backend_mod.check_backend("cpu", "cuda")


def test_auto_falls_back_to_the_reference_when_the_build_fails(monkeypatch):
    monkeypatch.setattr(cpu_attention, "toolchain_missing", lambda: None)

    def broken():
        raise RuntimeError("Error building extension")

    monkeypatch.setattr(cpu_attention, "load", broken)
    with pytest.warns(UserWarning, match="did not build .*Error building extension.*PyTorch reference"):
        assert get_backend("auto", "cpu", torch.bfloat16).name == "torch"
    with pytest.raises(RuntimeError, match="Error building extension"):  # asked for by name: the error, not a fallback
        get_backend("cpu", "cpu", torch.bfloat16)


def test_an_unknown_backend_names_the_cpu_one():
    with pytest.raises(ValueError, match="'cpu'"):
        EngineConfig(attention_backend="cuda").validate()


@needs_toolchain
@pytest.mark.slow
def test_the_engine_with_the_kernel_generates_what_the_reference_does(tiny_model, caplog):
    """Greedy tokens of decodes beside chunked prefills, kernel vs reference, in float32: the two differ only in the
    order of float32 sums (about 1e-7), so they agree token for token. In bfloat16 the tiny model's random weights put
    near ties everywhere; the bundled model's bfloat16 run through the kernel is checked against transformers with
    the suite's near-tie rule in tests/test_bfloat16.py."""
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for name in ("torch", "cpu"):
        caplog.clear()
        with caplog.at_level("INFO", logger="workbench"):
            llm = LLM(model=str(tiny_model), dtype="float32", attention_backend=name, block_size=4, max_model_len=128,
                      max_num_batched_tokens=32, max_num_seqs=8)  # fmt: skip
        assert llm.llm_engine.executor.attn_backend.name == name
        assert f"attention backend {name} (attention_backend={name})" in caplog.text
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outs["cpu"] == outs["torch"]


@needs_toolchain
@pytest.mark.slow
def test_auto_in_bfloat16_runs_the_kernel_in_the_engine_and_says_why(tiny_model, caplog):
    with caplog.at_level("INFO", logger="workbench"):
        eng = LLMEngine(EngineConfig(model=str(tiny_model), dtype="bfloat16", block_size=4, max_model_len=64))
    assert eng.executor.attn_backend.name == "cpu"
    assert "attention backend cpu (attention_backend=auto: a bfloat16 KV cache on the CPU, g++ and ninja found)" in caplog.text
    assert "decode rows: C++ decode kernel, " in caplog.text and "; prefill chunks: " in caplog.text  # which kernel takes which rows
    caplog.clear()
    with caplog.at_level("INFO", logger="workbench"):
        eng32 = LLMEngine(EngineConfig(model=str(tiny_model), dtype="float32", block_size=4, max_model_len=64))
    assert eng32.executor.attn_backend.name == "torch"
    assert "attention backend torch (attention_backend=auto: the reference for a float32 KV cache on cpu)" in caplog.text


@needs_toolchain
def test_the_benchmark_script_runs_and_checks_agreement(capsys):
    bench = _benchmark("cpu_attention")
    bench.main(["--num-seqs", "3", "--context", "40", "--num-blocks", "32", "--calls", "2"])
    out = capsys.readouterr().out
    assert "| cpu (C++ kernel) |" in out and "reference / kernel, medians:" in out and "(bound 0.01)" in out


# ---------------------------------------------------------------- the layer glue in C++ (cpu_layer_ops)
def _steps_apart(got: torch.Tensor, want: torch.Tensor) -> None:
    """bfloat16 results equal, except where a float32 sum or exp taken in another order tips a rounding: then one
    bfloat16 step, or two where a product follows the tipped rounding (SiLU(gate) rounded, then times up)."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    step = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    assert ((got.float() - want.float()).abs() <= 2 * step * 1.01).all()
    assert (got == want).float().mean().item() > 0.99  # and almost every element is exactly the eager one


@needs_toolchain
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_the_layer_ops_equal_the_eager_ops(tokens):
    from workbench.kernels import cpu_layer_ops
    from workbench.model.llama import RMSNorm, apply_rotary

    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, 576, generator=g) * 3).bfloat16()
    norm = RMSNorm(576, 1e-5).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576, generator=g) + 0.5)
        _steps_apart(cpu_layer_ops.rms_norm(x, norm.weight, 1e-5), norm(x))

    gate_up = (torch.randn(tokens, 2 * 1536, generator=g) * 4).bfloat16()
    gate, up = gate_up.split(1536, dim=-1)
    _steps_apart(cpu_layer_ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up)

    # RoPE on the q and k heads of a fused QKV output: a view whose rows are wider than its heads
    qkv = torch.randn(tokens, (9 + 3 + 3) * 64, generator=g).bfloat16()
    qk = qkv[:, : 12 * 64].view(tokens, 12, 64)
    angle = torch.rand(tokens, 1, 64, generator=g) * 6.3
    cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
    got = cpu_layer_ops.rotary(qk, cos, sin)
    assert torch.equal(got, apply_rotary(qk, cos, sin))  # the same roundings, in the same order: bit for bit


@needs_toolchain
def test_a_bfloat16_model_takes_the_layer_ops_and_stays_within_rounding(tiny_model, monkeypatch):
    """bfloat16 on the CPU: every RMSNorm, attention and MLP module gets the C++ ops; float32 and
    ``WORKBENCH_CPU_LAYER_OPS=0`` keep the eager ones. The model's distribution with them (teacher-forced
    log-probabilities of every prompt token) is the eager bfloat16 one's, to within bfloat16's rounding."""
    monkeypatch.setenv("WORKBENCH_CPU_BFLOAT16", "1")
    ps = [[random.Random(i).randrange(2, 250) for _ in range(30 + 7 * i)] for i in range(5)]
    sp = SamplingParams(max_tokens=4, prompt_logprobs=0, ignore_eos=True)
    args = dict(model=str(tiny_model), block_size=8, max_model_len=128, num_gpu_blocks_override=64)

    def run(**kw):
        llm = LLM(**args, **kw)
        fused = [m.fused_ops is not None for m in llm.llm_engine.model.modules() if hasattr(m, "fused_ops")]
        outs = llm.generate(ps, sp)
        lps = torch.tensor([next(iter(p.values())).logprob for o in outs for p in o.prompt_logprobs[1:]])
        return fused, lps, [o.outputs[0].token_ids for o in outs]

    fused, with_ops, tokens = run(dtype="bfloat16")
    assert fused and all(fused)
    monkeypatch.setenv("WORKBENCH_CPU_LAYER_OPS", "0")
    eager_fused, eager, eager_tokens = run(dtype="bfloat16")
    assert not any(eager_fused)
    f32_fused, ref, _ = run(dtype="float32")
    assert not any(f32_fused)
    assert (with_ops - eager).abs().max().item() <= 0.05
    assert (with_ops - ref).abs().max().item() <= 2 * (eager - ref).abs().max().item() + 1e-2
    assert sum(a == b for a, b in zip(tokens, eager_tokens)) >= 4  # greedy tokens: a near-tie may part one
