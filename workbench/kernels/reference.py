"""PyTorch references of every kernel in this package: the oracles the Triton kernels are tested against.

They follow the kernels' flat, vLLM-style arguments (one padded block table per sequence,
context lengths as tensors) and are written for clarity, one sequence at a time; the K/V
gather is :func:`workbench.attention.torch_ref.gather_kv`, the engine's own reference path.
Attention is computed in float32 and returned in the query's dtype. No Triton needed.

Layout (as in the engine, docs/architecture.md §2): the cache of one layer is K and V, each
``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``p`` of a sequence lives in block
``block_table[p // block_size]``, row ``p % block_size`` (Kwon et al., SOSP 2023, §4.1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.attention.torch_ref import gather_kv


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, first_pos: int) -> torch.Tensor:
    """Causal GQA attention of ``q [qlen, nh, d]`` at positions ``first_pos..`` over ``k, v [ctx, nkv, d]``."""
    qlen, nh, _ = q.shape
    ctx = k.shape[0]
    qpos = torch.arange(first_pos, first_pos + qlen, device=q.device)[:, None]
    mask = torch.arange(ctx, device=q.device)[None, :] <= qpos  # [qlen, ctx]
    o = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=nh != k.shape[1],
    )
    return o[0].transpose(0, 1).to(q.dtype)


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its paged context.

    Args:
        q: ``[num_seqs, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int; entries past a sequence's blocks are ignored.
        context_lens: ``[num_seqs]`` int, tokens of context (the query's own token included).
        scale: softmax scale.

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``.
    """
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    for i, ctx in enumerate(context_lens.tolist()):
        table = block_tables[i, : -(-ctx // bs)].long()
        k = gather_kv(k_cache, table, ctx)
        v = gather_kv(v_cache, table, ctx)
        out[i] = _attend(q[i : i + 1], k, v, scale, ctx - 1)[0]
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its whole paged context.

    Sequence ``i`` has query rows ``query_start_loc[i] : query_start_loc[i+1]`` (``qlen`` tokens),
    which are the last ``qlen`` of its ``context_lens[i]`` tokens; their K/V are already in the cache.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]`` int.
        query_start_loc: ``[num_seqs + 1]`` int, cumulative query lengths starting at 0.
        context_lens: ``[num_seqs]`` int, tokens of context, the new ones included.
        scale: softmax scale.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    bs = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, ctx in enumerate(context_lens.tolist()):
        s, e = starts[i], starts[i + 1]
        table = block_tables[i, : -(-ctx // bs)].long()
        k = gather_kv(k_cache, table, ctx)
        v = gather_kv(v_cache, table, ctx)
        out[s:e] = _attend(q[s:e], k, v, scale, ctx - (e - s))
    return out


def reshape_and_cache_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write token ``t``'s K/V into slot ``slot_mapping[t]`` (negative slots are skipped, as in vLLM).

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: ``[num_tokens]`` int; slot = block * block_size + row.
    """
    nb, bs, h, d = k_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v[keep].to(v_cache.dtype))


def copy_blocks_ref(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` in K and V of one layer.

    Args:
        cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        src, dst: ``[n]`` int block ids.
    """
    cache[:, dst.long()] = cache[:, src.long()]


def gather_blocks_ref(cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``ids`` of one layer, packed: ``[2, n, block_size, num_kv_heads, head_dim]``."""
    return cache[:, ids.long()].clone()


def scatter_blocks_ref(packed: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor) -> None:
    """Write packed blocks ``[2, n, ...]`` into blocks ``ids`` of ``cache`` (in place)."""
    cache[:, ids.long()] = packed.to(cache.dtype)
