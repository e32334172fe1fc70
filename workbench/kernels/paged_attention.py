"""Paged decode attention in Triton: one query token per sequence, K/V read through the block table.

Two variants, as in vLLM:

* **single pass** (vLLM's ``paged_attention_v1``): one program per (sequence, KV head) walks the
  whole context with an online softmax.
* **split-KV** (vLLM's ``paged_attention_v2``; FlashDecoding, Dao et al. 2023): the context is cut
  into partitions of ``partition_size`` tokens, one program per (sequence, KV head, partition);
  each writes its normalised partial output and its log-sum-exp, and a second kernel merges the
  partitions. It keeps the GPU busy when there are few sequences but long contexts (batch 1 at
  32k tokens has only ``num_kv_heads`` programs in the single-pass grid).

Grouped-query attention: a program serves *all* the query heads that share its KV head (the
``num_heads // num_kv_heads`` of a group, padded to 16 rows so that ``tl.dot`` can use tensor
cores; the grouping follows SGLang's ``decode_attention_fwd_grouped``), so each K/V byte is read
once per sequence, not once per query head. Decode is bound by that read: the bytes of K/V per
second are the figure of merit (``benchmarks/bench_kernels.py``).

Algorithm sources: PagedAttention, Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023 (block tables, §4.1; kernels in vLLM's
``csrc/attention/attention_kernels.cu``); online softmax, Milakov & Gimelshein 2018, as used in
FlashAttention (Dao et al., NeurIPS 2022) and FlashDecoding (Dao, Haziza, Massa, Sizov, 2023);
the log-sum-exp merge of partial softmaxes is FlashAttention-2's (Dao, 2023) rescaling.

The oracle is :func:`kernels.reference.paged_decode_attention_ref`.
"""

from __future__ import annotations

import torch

from workbench.kernels import load_triton, next_power_of_2
from workbench.kernels.reference import paged_decode_attention_ref
from workbench.kernels.runtime import launch, wants_interpreter

triton = load_triton()
import triton.language as tl  # noqa: E402

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "DEFAULT_PARTITION_SIZE"]

#: Tokens per partition of the split-KV variant (vLLM's ``PARTITION_SIZE`` for v2 is 512).
DEFAULT_PARTITION_SIZE = 512
#: fewest partitions a context must span before split-KV pays for its second (reduce) launch (:func:`use_split_kv`)
SPLIT_KV_MIN_PARTITIONS = 8
LOG2E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2(e)), exp2 is one instruction


@triton.jit
def _paged_decode_kernel(
    Q,  # [num_seqs, num_heads, head_dim]
    K,  # [num_blocks, block_size, num_kv_heads, head_dim]
    V,  # same shape and strides as K
    Out,  # [num_seqs, num_heads, head_dim]             (single pass)
    PartOut,  # [num_seqs, num_heads, num_parts, head_dim] float32 (split-KV)
    PartLse,  # [num_seqs, num_heads, num_parts] float32          (split-KV)
    BlockTables,  # [num_seqs, max_blocks] int32/int64
    ContextLens,  # [num_seqs] int32/int64
    qk_scale,  # softmax scale * log2(e)
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_ls,
    stride_lh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per iteration (independent of BLOCK_SIZE)
    SPLIT: tl.constexpr,  # False: single pass; True: this program does one partition
    UPCAST: tl.constexpr,  # dot products in float32 (see _upcast)
    PARTITION_SIZE: tl.constexpr,  # tokens per partition (a multiple of BLOCK_N)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(ContextLens + seq)  # tokens of context, the query's own token included
    if SPLIT:
        part = tl.program_id(2)
        start = part * PARTITION_SIZE
        end = tl.minimum(start + PARTITION_SIZE, ctx)  # start >= ctx: an empty partition
    else:
        start = 0
        end = ctx

    # the query heads of this KV head: rows kv_head*GROUP .. kv_head*GROUP + GROUP-1
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)  # K, V and p follow q's dtype below

    # online softmax state per query head: running max m, running sum l, unnormalised output acc
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = BlockTables + seq * stride_bt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)  # logical token positions of this tile
        n_mask = offs_n < end
        # block-table indirection: position p lives in physical block table[p // BLOCK_SIZE], row
        # p % BLOCK_SIZE. Entries past the context are never read (masked), so the table's tail
        # may hold anything.
        blocks = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_offs = (
            blocks[:, None] * stride_kb
            + (offs_n % BLOCK_SIZE)[:, None] * stride_kt
            + kv_head * stride_kh
            + offs_d[None, :]
        )
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # rescale what was accumulated under the old max to the new max, then add this tile
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        m_i = m_new

    o_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # this partition's softmax-normalised output and its log-sum-exp (base 2): the merge kernel
        # needs nothing else. An empty partition (start >= ctx) has l = 0 and lse = -inf.
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = m_i + tl.log2(l_safe)
        po = PartOut + seq * stride_ps + heads[:, None] * stride_ph + part * stride_pp + offs_d[None, :]
        tl.store(po, acc / l_safe[:, None], mask=o_mask)
        tl.store(PartLse + seq * stride_ls + heads * stride_lh + part, lse, mask=h_mask)
    else:
        out = acc / l_i[:, None]
        tl.store(
            Out + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(Out.dtype.element_ty),
            mask=o_mask,
        )


@triton.jit
def _merge_partitions_kernel(
    Out,  # [num_seqs, num_heads, head_dim]
    PartOut,  # [num_seqs, num_heads, num_parts, head_dim] float32
    PartLse,  # [num_seqs, num_heads, num_parts] float32
    ContextLens,
    stride_os,
    stride_oh,
    stride_ps,
    stride_ph,
    stride_pp,
    stride_ls,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    MAX_PARTS: tl.constexpr,  # partitions of the longest context, padded to a power of two
):
    """Log-sum-exp merge: out = sum_i w_i o_i / sum_i w_i with w_i = 2^(lse_i - max_j lse_j).

    Partition i holds o_i = sum_{t in i} e^{s_t} v_t / l_i and lse_i = log2 l_i (+ its max); its share
    of the whole softmax is l_i / sum_j l_j = w_i / sum_j w_j. Subtracting the largest lse first keeps
    every 2^(.) in [0, 1] (no overflow), as in FlashAttention-2 and vLLM's v2 reduce kernel.
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    ctx = tl.load(ContextLens + seq)
    num_parts = tl.cdiv(ctx, PARTITION_SIZE)  # partitions of *this* sequence; the rest are empty
    offs_p = tl.arange(0, MAX_PARTS)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < num_parts
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(PartLse + seq * stride_ls + head * stride_lh + offs_p, mask=p_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # [MAX_PARTS]; 0 for padding
    o = tl.load(
        PartOut + seq * stride_ps + head * stride_ph + offs_p[:, None] * stride_pp + offs_d[None, :],
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(Out + seq * stride_os + head * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


def _upcast(q: torch.Tensor, interpret: bool) -> bool:
    """Whether the kernels compute their dot products in float32: only for bfloat16 in the interpreter,
    whose ``tl.dot`` multiplies bfloat16 bit patterns as integers (triton-lang/triton#11584; Triton's
    debugging guide lists bfloat16 as unsupported by the interpreter). Compiled kernels use bfloat16 MMA."""
    return interpret and q.dtype == torch.bfloat16


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter has no SMs; an H100-like figure keeps the choice deterministic
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def use_split_kv(
    num_seqs: int,
    num_kv_heads: int,
    max_context_len: int,
    device: torch.device,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> bool:
    """The variant choice: split-KV when contexts span at least :data:`SPLIT_KV_MIN_PARTITIONS` partitions
    and the single-pass grid (``num_seqs * num_kv_heads`` programs) would leave most SMs idle (fewer than
    two programs per SM). vLLM's rule is similar (v1 when one partition, or when ``num_seqs * num_heads >
    512``). The partition threshold comes from timing both variants on a GPU (``benchmarks/bench_kernels.py``;
    see docs/benchmarks.md, section "The split-KV rule")."""
    return max_context_len >= SPLIT_KV_MIN_PARTITIONS * partition_size and num_seqs * num_kv_heads < 2 * _num_sms(
        device
    )


def _check(q, k_cache, v_cache, block_tables, context_lens, num_seqs: int) -> None:
    """Shape checks shared by the attention kernels (``num_seqs`` rows in the tables and lengths)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim] with equal "
            f"strides, got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}"
        )
    nh, d = q.shape[1:]
    nkv, dc = k_cache.shape[2:]
    if d != dc or nh % nkv:
        raise ValueError(
            f"q has {nh} heads of dim {d}, the cache {nkv} KV heads of dim {dc}: head dims must match and "
            "num_heads must be a multiple of num_kv_heads"
        )
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches must be contiguous in head_dim (stride 1)")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks] and context_lens [num_seqs] with num_seqs={num_seqs}, "
            f"got {tuple(block_tables.shape)} and {tuple(context_lens.shape)}"
        )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    max_context_len: int | None = None,
    partition_size: int | None = None,
    block_n: int | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache (one query token per sequence).

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` float32 / float16 / bfloat16; ``head_dim`` contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, any of those dtypes
            (cast to ``q.dtype`` on load); ``num_heads`` a multiple of ``num_kv_heads`` (GQA).
        block_tables: ``[num_seqs, max_blocks]`` int32 or int64 physical block ids; entries past a
            sequence's ``ceil(context_len / block_size)`` blocks are never read.
        context_lens: ``[num_seqs]`` int32 or int64, tokens of context (>= 1, the query token included).
        scale: softmax scale (``head_dim ** -0.5``).
        out: optional ``[num_seqs, num_heads, head_dim]`` output (may be a row slice of a larger tensor).
        max_context_len: an upper bound on ``context_lens`` (tokens) for sizing the split-KV grid without
            reading the lengths back from the device; default ``max_blocks * block_size``.
        partition_size: ``0`` = single pass (v1); ``> 0`` = split-KV with partitions of that many tokens
            (a multiple of ``block_n``); ``None`` = choose (:func:`use_split_kv`, 512-token partitions).
        block_n: keys per loop iteration (power of two >= 16; default 64, 32 for head_dim > 128).
        interpret: run in Triton's interpreter; ``None`` = on CPU tensors only (:mod:`workbench.kernels.runtime`).

    Returns:
        ``out``: ``[num_seqs, num_heads, head_dim]`` in ``q.dtype`` (or ``out``'s dtype).

    Raises:
        ValueError: inconsistent shapes (named in the message).
        RuntimeError: compiled mode asked for CPU tensors (see :func:`kernels.runtime.wants_interpreter`).
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, q.shape[0])
    interpret = wants_interpreter(q, interpret)
    num_seqs, nh, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    group = nh // nkv
    block_n = block_n or (64 if d <= 128 else 32)
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * bs
    if partition_size is None:
        partition_size = DEFAULT_PARTITION_SIZE if use_split_kv(num_seqs, nkv, max_context_len, q.device) else 0
    if partition_size and partition_size % block_n:
        raise ValueError(f"partition_size={partition_size} must be a multiple of block_n={block_n}")
    block_h = max(16, next_power_of_2(group))
    block_d = max(16, next_power_of_2(d))
    qk_scale = scale * LOG2E
    common = dict(
        GROUP=group,
        HEAD_DIM=d,
        BLOCK_SIZE=bs,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        UPCAST=_upcast(q, interpret),
        num_warps=4,
    )
    if not partition_size:
        launch(
            _paged_decode_kernel, (num_seqs, nkv),
            q, k_cache, v_cache, out, out, out, block_tables, context_lens, qk_scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            out.stride(0), out.stride(1), 0, 0, 0, 0, 0, block_tables.stride(0),
            SPLIT=False, PARTITION_SIZE=block_n, interpret=interpret, **common,
        )  # fmt: skip
        return out
    num_parts = -(-max_context_len // partition_size)
    part_out = torch.empty(num_seqs, nh, num_parts, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, nh, num_parts, dtype=torch.float32, device=q.device)
    launch(
        _paged_decode_kernel, (num_seqs, nkv, num_parts),
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, context_lens, qk_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), block_tables.stride(0),
        SPLIT=True, PARTITION_SIZE=partition_size, interpret=interpret, **common,
    )  # fmt: skip
    launch(
        _merge_partitions_kernel, (num_seqs, nh),
        out, part_out, part_lse, context_lens,
        out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=d, BLOCK_D=block_d, PARTITION_SIZE=partition_size, MAX_PARTS=max(2, next_power_of_2(num_parts)),
        num_warps=4, interpret=interpret,
    )  # fmt: skip
    return out
