"""The engine on a real CUDA GPU: the Triton backend inside the engine, and the memory budget's figures
against what the device itself reports.

Skipped without CUDA (CI has no GPU). Run on a GPU machine with ``pytest -o addopts="" tests/test_cuda.py
tests/test_kernels.py tests/test_tensor_parallel.py -k "cuda or nccl"``; ``benchmarks/gpu_check.sh`` runs them
with the kernel benchmark, and docs/benchmarks.md (section "Triton kernels on a GPU") records what one such run
measured.
"""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import greedy_tokens, random_prompts

from workbench import LLM, SamplingParams, kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
needs_triton = pytest.mark.skipif(not kernels.triton_available(), reason="Triton is not installed")
MIB = 1 << 20


def greedy(llm, ps, n=1):
    return greedy_tokens(llm, ps, n=n, max_tokens=12)


@needs_triton
def test_auto_picks_triton_on_cuda(tiny_model):
    llm = LLM(str(tiny_model), device="cuda", max_model_len=128, num_gpu_blocks_override=32)
    assert llm.llm_engine.executor.attn_backend.name == "triton"
    assert llm.llm_engine.executor.kv_caches[0].device.type == "cuda"


@needs_triton
def test_triton_engine_equals_torch_engine_float32(tiny_model):
    """Compiled kernels in the engine: chunked prefill over cached context (24-token budget), a shared
    prefix from the prefix cache, then parallel sampling (copy-on-write) and swap preemption (gather and
    scatter through host memory) give the reference backend's tokens."""
    base = dict(model=str(tiny_model), device="cuda", dtype="float32")
    ps = random_prompts(3, 0, 1, 50) + random_prompts(3, 1, 5, 20, shared=range(30, 50))
    args = base | dict(
        block_size=8, max_num_seqs=6, max_num_batched_tokens=24, max_model_len=128, enable_prefix_caching=True,
        num_gpu_blocks_override=256,  # the default gpu_memory_utilization=0.9 would give each engine 0.9 of the GPU
    )  # fmt: skip
    ref = greedy(LLM(attention_backend="torch", **args), ps)
    llm = LLM(attention_backend="triton", **args)
    assert greedy(llm, ps) == ref
    assert sum(s.prefix_cache_hits for s in llm.llm_engine.recorder.steps) > 0

    ps = random_prompts(4, 2, 10, 30)
    args = base | dict(
        block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=56, num_gpu_blocks_override=16,
        preemption_mode="swap", swap_space=0.001,
    )  # fmt: skip
    ref = greedy(LLM(attention_backend="torch", **args), ps, n=2)
    llm = LLM(attention_backend="triton", **args)
    assert greedy(llm, ps, n=2) == ref
    steps = llm.llm_engine.recorder.steps
    assert sum(s.swap_out_blocks for s in steps) > 0 and sum(s.cow_block_copies for s in steps) > 0


@needs_triton
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_engine_half_precision_logprobs_near_float32(tiny_model, dtype):
    """In half precision the two backends round differently, so tokens may part at near-ties; what is
    bounded is the model's distribution: every prompt token's log-probability (teacher forced, so both
    runs see the same tokens) against the float32 reference."""
    ps = random_prompts(6, 3, 20, 60)
    sp = SamplingParams(max_tokens=1, prompt_logprobs=0)
    args = dict(
        model=str(tiny_model), device="cuda", block_size=16, max_model_len=128, max_num_batched_tokens=48,
        max_num_seqs=8, num_gpu_blocks_override=256,
    )  # fmt: skip

    def logprobs(**kw):
        outs = LLM(**args, **kw).generate(ps, sp)
        return torch.tensor([
            next(iter(pos.values())).logprob for o in outs for pos in o.prompt_logprobs[1:]
        ])  # fmt: skip

    ref = logprobs(dtype="float32", attention_backend="torch")
    tri = logprobs(dtype=dtype, attention_backend="triton")
    tor = logprobs(dtype=dtype, attention_backend="torch")
    err_triton, err_torch = (tri - ref).abs().max().item(), (tor - ref).abs().max().item()
    assert err_triton < 0.1, f"{dtype} Triton engine's logprobs differ from float32 by {err_triton:.3g}"
    assert err_triton <= 2 * err_torch + 1e-3, f"Triton {err_triton:.3g} vs the torch backend's own {err_torch:.3g}"


def test_memory_budget_on_a_real_gpu(tiny_model):
    """The budget's figures (docs/architecture.md §3) against the device: capacity is the device's total, the pool
    fills what is left to within one block, the pool really allocated is the pool planned, and under a
    full-budget load PyTorch never holds more than weights + profiled activation peak + pool."""
    util = 0.1
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()  # CUDA context, other processes
    held = torch.cuda.memory_allocated()  # earlier tests' leftovers, cuBLAS's workspace: not the engine's
    llm = LLM(
        str(tiny_model), device="cuda", dtype="bfloat16", gpu_memory_utilization=util, block_size=16,
        max_model_len=512, max_num_batched_tokens=2048, max_num_seqs=64,
    )  # fmt: skip
    m = llm.llm_engine.memory
    print(f"\nbefore the engine: device used {(total - free) / MIB:,.1f} MiB, outside PyTorch {outside / MIB:,.1f} MiB")
    assert m.source == "cuda" and m.capacity_bytes == total and m.device_name
    assert m.activation_bytes > 0 and m.non_torch_bytes > 0  # the CUDA context is not PyTorch's
    assert abs(m.non_torch_bytes - outside) < 256 * MIB  # what the engine measured is what was there
    assert m.other_torch_bytes >= held
    others = m.non_torch_bytes + m.other_torch_bytes
    assert m.kv_budget_bytes == int(total * util) - m.weights_bytes - m.activation_bytes - others
    assert 0 <= m.kv_budget_bytes - m.kv_pool_bytes < m.block_bytes
    caches = llm.llm_engine.executor.kv_caches
    assert sum(t.numel() * t.element_size() for t in caches) == m.kv_pool_bytes
    weights = sum(p.numel() * p.element_size() for p in llm.llm_engine.model.parameters())
    assert weights == m.weights_bytes

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ps = random_prompts(64, 4, 100, 300)
    outs = llm.generate(ps, SamplingParams(max_tokens=64, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    steps = llm.llm_engine.recorder.steps
    assert max(s.num_prefill_tokens + s.num_decode_tokens for s in steps) > 1024  # the load reached the budget's scale
    peak = torch.cuda.max_memory_allocated()
    print(
        f"\n{m.summary_line()}\nallocated before {before / MIB:,.1f} MiB, peak under load {peak / MIB:,.1f} MiB, "
        f"planned weights + activations + pool {(m.weights_bytes + m.activation_bytes + m.kv_pool_bytes) / MIB:,.1f} MiB, "
        f"reserved {torch.cuda.memory_reserved() / MIB:,.1f} MiB, "
        f"device used {(total - torch.cuda.mem_get_info()[0]) / MIB:,.1f} MiB"
    )
    # every byte PyTorch holds under load was planned for: weights, activation peak, pool, and what was
    # already held before the engine's profile (the engine's own RoPE tables are in that last figure)
    assert peak <= m.weights_bytes + m.activation_bytes + m.kv_pool_bytes + m.other_torch_bytes + 4 * MIB
    # and the process stays within its share of the device (PyTorch's cache may round up a little)
    used = total - torch.cuda.mem_get_info()[0]
    assert used <= total * util + 64 * MIB, f"the process uses {used / MIB:,.0f} MiB of {total * util / MIB:,.0f} MiB"
