"""Paged prefill / chunked-prefill attention in Triton: causal attention of a chunk of new query tokens
over a context that is partly (or wholly) in the paged cache already.

Sequence ``i`` brings ``qlen`` new query tokens at positions ``ctx - qlen .. ctx - 1`` of its
``ctx``-token context. Their K/V have been written to the cache (:func:`kernels.cache_ops.reshape_and_cache`)
before this kernel runs, so every key — the earlier context computed by previous chunks or shared
through the prefix cache, and the chunk's own — is read through the block table the same way.
Query token at position ``p`` sees keys ``0..p`` (causal). With ``qlen == ctx`` this is an ordinary
prefill; with ``qlen < ctx`` it is a chunk of a chunked prefill, or the uncached rest of a prompt
after a prefix-cache hit.

Algorithm: FlashAttention's tiled online softmax (Dao et al., NeurIPS 2022; FlashAttention-2, Dao
2023; the Triton tutorial "Fused Attention"), with K/V tiles gathered through the block table as in
vLLM's ``context_attention_fwd`` (``vllm/attention/ops/prefix_prefill.py``) and PagedAttention (Kwon et
al., SOSP 2023). One program computes ``BLOCK_M`` query tokens of one query head of one sequence,
and stops at the last key its tokens can see (tiles wholly in their future are skipped).

The oracle is :func:`kernels.reference.paged_prefill_attention_ref`.
"""

from __future__ import annotations

import torch

from workbench.kernels import load_triton, next_power_of_2
from workbench.kernels.paged_attention import LOG2E, _check, _upcast
from workbench.kernels.reference import paged_prefill_attention_ref
from workbench.kernels.runtime import launch, wants_interpreter

triton = load_triton()
import triton.language as tl  # noqa: E402

__all__ = ["paged_prefill_attention", "paged_prefill_attention_ref"]


@triton.jit
def _paged_prefill_kernel(
    Q,  # [num_tokens, num_heads, head_dim]
    K,  # [num_blocks, block_size, num_kv_heads, head_dim]
    V,  # same shape and strides as K
    Out,  # [num_tokens, num_heads, head_dim]
    BlockTables,  # [num_seqs, max_blocks] int32/int64
    QueryStartLoc,  # [num_seqs + 1] int32/int64: rows of sequence i are QueryStartLoc[i] .. QueryStartLoc[i+1]-1
    ContextLens,  # [num_seqs]: tokens of context, the new ones included
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV-cache block
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    BLOCK_N: tl.constexpr,  # keys per iteration
    UPCAST: tl.constexpr,  # dot products in float32 (see kernels.paged_attention._upcast)
):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(QueryStartLoc + seq)
    qlen = tl.load(QueryStartLoc + seq + 1) - q_start
    if m_block * BLOCK_M >= qlen:  # the grid is sized for the longest chunk of the step
        return
    ctx = tl.load(ContextLens + seq)
    first_pos = ctx - qlen  # position of the chunk's first token: keys before it are cached context
    kv_head = head // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows within the chunk
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < qlen
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)  # K, V and p follow q's dtype below
    q_pos = first_pos + offs_m  # each row's position in its sequence (rows past qlen: >= ctx, all keys visible)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BlockTables + seq * stride_bt
    # causal: the tile's last row sees keys up to its position; later keys are nobody's business here
    end = tl.minimum(ctx, first_pos + (m_block + 1) * BLOCK_M)
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_offs = (
            blocks[:, None] * stride_kb
            + (offs_n % BLOCK_SIZE)[:, None] * stride_kt
            + kv_head * stride_kh
            + offs_d[None, :]
        )
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        # the first tile holds key 0, visible to every row, so m_i is finite from then on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_offs, mask=kv_mask, other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        Out + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context (prefill or a prefill chunk).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` float32 / float16 / bfloat16, the sequences' new tokens
            one after another; ``head_dim`` contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, holding every context
            token's K/V, the new tokens' included.
        block_tables: ``[num_seqs, max_blocks]`` int32 / int64; entries past a sequence's blocks are not read.
        query_start_loc: ``[num_seqs + 1]`` int32 / int64, ``0, qlen_0, qlen_0 + qlen_1, ...``.
        context_lens: ``[num_seqs]`` int32 / int64, tokens of context including the new ones (``>= qlen``).
        scale: softmax scale (``head_dim ** -0.5``).
        max_query_len: the longest ``qlen`` (tokens), for the grid; default ``num_tokens`` (correct, but
            launches idle programs).
        out: optional ``[num_tokens, num_heads, head_dim]`` output.
        block_m, block_n: query rows and keys per tile (powers of two >= 16; default 64 and 64, 32 keys
            for ``head_dim > 128``).
        interpret: run in Triton's interpreter; ``None`` = on CPU tensors only (:mod:`workbench.kernels.runtime`).

    Returns:
        ``out``: ``[num_tokens, num_heads, head_dim]``.

    Raises:
        ValueError: inconsistent shapes. RuntimeError: compiled mode asked for CPU tensors.
    """
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(
            f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}], got {tuple(query_start_loc.shape)}"
        )
    _check(q, k_cache, v_cache, block_tables, context_lens, num_seqs)
    interpret = wants_interpreter(q, interpret)
    num_tokens, nh, d = q.shape
    bs, nkv = k_cache.shape[1], k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    max_query_len = max_query_len or num_tokens
    block_m = block_m or 64
    block_n = block_n or (64 if d <= 128 else 32)
    grid = (-(-max_query_len // block_m), nh, num_seqs)
    launch(
        _paged_prefill_kernel, grid,
        q, k_cache, v_cache, out, block_tables, query_start_loc, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=nh // nkv, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_D=max(16, next_power_of_2(d)),
        BLOCK_N=block_n, UPCAST=_upcast(q, interpret), num_warps=4, interpret=interpret,
    )  # fmt: skip
    return out
