"""PyTorch reference paged attention: gather K/V through block tables, then SDPA.

The cache of one layer is two tensors ``[num_blocks, block_size, num_kv_heads, head_dim]`` (K and V). A token at
position ``p`` of a request lives in slot ``block_table[p // block_size] * block_size + p % block_size``
(PagedAttention, Kwon et al., SOSP 2023, §4.1).

The step's tokens are ordered: first the ``num_decode`` sequences that run one query token (a decode, or a
one-token chunk), then the sequences that run several (prefills and prefill chunks), each contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class DecodeGroup:
    """Consecutive one-query-token sequences of similar context length, attended in one batched call. Grouping by
    length bounds the padding of the gathered K/V (a 50-token and a 1,500-token context in one batch would pad the
    first 30-fold).

    Attributes:
        start: row of the group's first token in the step's flat tokens.
        block_tables: ``[n, max_blocks]`` int64 (padded with 0).
        mask: ``[n, 1, 1, max_blocks * block_size]`` bool, True where a key position is valid.
        context_lens: ``[n]`` int64 context tokens (query included); when absent, the Triton backend counts ``mask``.
    """

    start: int
    block_tables: torch.Tensor
    mask: torch.Tensor
    context_lens: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.block_tables.shape[0]


@dataclass
class AttentionMetadata:
    """Where each sequence's query tokens and context lie.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, the cache slot each new token's K/V is written to.
        num_decode: number of leading one-query-token sequences.
        decode_groups: those sequences, in groups of similar context length.
        prefill_query_lens: query tokens of each multi-token sequence.
        prefill_context_lens: context lengths (tokens, the new ones included) of those sequences.
        prefill_block_tables: int64 block tables of those sequences (used when part of the context is cached).
        backend: the backend the model calls (:mod:`workbench.attention.backend`; ``None`` = the PyTorch reference).
        extras: per-step data a backend derives once and reuses across layers.
    """

    slot_mapping: torch.Tensor
    num_decode: int
    decode_groups: list[DecodeGroup]
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]
    prefill_block_tables: list[torch.Tensor]
    backend: Any = None
    extras: dict = field(default_factory=dict, repr=False)


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V into their slots (vLLM's ``reshape_and_cache``).

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``.
        slot_mapping: ``[num_tokens]`` int64.
    """
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: ``[length, num_kv_heads, head_dim]``."""
    _, bs, h, d = cache.shape
    return cache[block_table].reshape(-1, h, d)[:length]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of the step's tokens over their paged context: ``[num_tokens, num_heads, head_dim]``.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``.
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, already written to the cache.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        meta: the step's layout.
        scale: softmax scale, usually ``head_dim ** -0.5``.
    """
    num_tokens, nh, d = q.shape
    nkv = k_cache.shape[2]
    group = nh // nkv
    out = torch.empty_like(q)
    for g in meta.decode_groups:
        n, end = g.size, g.start + g.size
        # gather whole blocks: [n * max_blocks, bs, nkv, d] -> [n, nkv, L, d]
        flat = g.block_tables.flatten()
        kd = k_cache.index_select(0, flat).view(n, -1, nkv, d).transpose(1, 2)
        vd = v_cache.index_select(0, flat).view(n, -1, nkv, d).transpose(1, 2)
        qd = q[g.start : end].view(n, nkv, group, d)  # the query heads sharing a KV head
        o = F.scaled_dot_product_attention(qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=g.mask, scale=scale)
        out[g.start : end] = o.reshape(n, nh, d)
    start = meta.num_decode
    for qlen, ctx, table in zip(meta.prefill_query_lens, meta.prefill_context_lens, meta.prefill_block_tables):
        end = start + qlen
        qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, nh, qlen, d]
        if ctx == qlen:  # nothing cached before this chunk: use the fresh K/V
            ks, vs = k[start:end], v[start:end]
            mask, causal = None, True
        else:
            ks = gather_kv(k_cache, table, ctx).to(q.dtype)
            vs = gather_kv(v_cache, table, ctx).to(q.dtype)
            qpos = torch.arange(ctx - qlen, ctx, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [qlen, ctx]
            causal = False
        ks = ks.transpose(0, 1).unsqueeze(0)
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1
        )
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out
