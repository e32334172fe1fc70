"""The Triton backend: the kernels of :mod:`kernels` behind the engine's attention interface.

The engine's :class:`~workbench.attention.AttentionMetadata` is shaped for the PyTorch reference (decode sequences
in length groups, prefill sequences as lists). The kernels want one padded block table per sequence and lengths as
device tensors; :meth:`TritonBackend.layout` builds them once per step (on the first layer) and keeps them on the
metadata for the other layers, so the reference path pays nothing for them."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F

from workbench.attention.torch_ref import AttentionMetadata
from workbench.kernels import load_triton
from workbench.kv.moves import copy_rounds


@dataclass
class TritonLayout:
    """Per-sequence tensors of one step, as the kernels take them.

    Attributes:
        decode_block_tables: ``[num_decode, max_blocks]`` int64 (tails padded with 0, never read).
        decode_context_lens: ``[num_decode]`` int64 tokens, the query token included.
        decode_max_context: an upper bound on those lengths (tokens), known on the host.
        prefill_block_tables: ``[num_prefill, max_blocks]`` int64.
        prefill_query_start: ``[num_prefill + 1]`` int32, cumulative query lengths from 0.
        prefill_context_lens: ``[num_prefill]`` int32 tokens, the new ones included.
        prefill_max_query: the longest chunk (tokens).
    """

    decode_block_tables: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    decode_max_context: int
    prefill_block_tables: torch.Tensor | None
    prefill_query_start: torch.Tensor | None
    prefill_context_lens: torch.Tensor | None
    prefill_max_query: int


class TritonBackend:
    """Paged attention, cache writes and block copies by the Triton kernels: compiled (CUDA), or with ``interpret``
    in Triton's interpreter (any device; slow). Raises ``ImportError`` if Triton is not installed."""

    def __init__(self, interpret: bool = False) -> None:
        load_triton()
        from workbench.kernels import cache_ops, paged_attention, prefill_attention

        self._decode = paged_attention.paged_decode_attention
        self._prefill = prefill_attention.paged_prefill_attention
        self._cache = cache_ops
        self.interpret = interpret
        self._mode = {"interpret": interpret}
        self.name = "triton-interpret" if interpret else "triton"

    def __repr__(self) -> str:
        return f"TritonBackend(interpret={self.interpret})"

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping) -> None:
        """:func:`workbench.kernels.cache_ops.reshape_and_cache` (same arguments as the reference ``write_kv``)."""
        self._cache.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, **self._mode)

    def layout(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> TritonLayout:
        """The step's per-sequence tensors (built on the first call, then cached on ``meta``)."""
        cached = meta.extras.get("triton")
        if cached is not None:
            return cached
        groups = meta.decode_groups
        dec_tables = dec_lens = None
        width = 0
        if groups:
            width = max(g.block_tables.shape[1] for g in groups)
            dec_tables = torch.cat([F.pad(g.block_tables, (0, width - g.block_tables.shape[1])) for g in groups])
            dec_lens = torch.cat([_decode_context_lens(g) for g in groups])
        pre_tables = pre_start = pre_lens = None
        qlens = meta.prefill_query_lens
        if qlens:
            pre_tables = torch.nn.utils.rnn.pad_sequence(meta.prefill_block_tables, batch_first=True)
            pre_start = torch.tensor([0, *accumulate(qlens)], dtype=torch.int32, device=device)
            pre_lens = torch.tensor(meta.prefill_context_lens, dtype=torch.int32, device=device)
        lay = TritonLayout(dec_tables, dec_lens, width * block_size, pre_tables, pre_start, pre_lens, max(qlens or [0]))
        meta.extras["triton"] = lay
        return lay

    def paged_attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Same contract as :func:`workbench.attention.torch_ref.paged_attention`: ``[num_tokens, num_heads,
        head_dim]``; the decode rows by :func:`workbench.kernels.paged_attention.paged_decode_attention`, the rest by
        :func:`workbench.kernels.prefill_attention.paged_prefill_attention` (new K/V must already be in the cache)."""
        lay = self.layout(meta, k_cache.shape[1], q.device)
        out = torch.empty_like(q)
        nd = meta.num_decode
        if nd:
            self._decode(
                q[:nd], k_cache, v_cache, lay.decode_block_tables, lay.decode_context_lens, scale,
                out=out[:nd], max_context_len=lay.decode_max_context, **self._mode,
            )  # fmt: skip
        if q.shape[0] > nd:
            self._prefill(
                q[nd:], k_cache, v_cache, lay.prefill_block_tables, lay.prefill_query_start,
                lay.prefill_context_lens, scale, max_query_len=lay.prefill_max_query, out=out[nd:], **self._mode,
            )  # fmt: skip
        return out

    def copy_blocks(
        self,
        gpu_caches: list[torch.Tensor],
        cpu_caches: list[torch.Tensor],
        swap_out: list[tuple[int, int]],
        copies: list[tuple[int, int]],
        swap_in: list[tuple[int, int]],
    ) -> None:
        """The step's block copies, in the executor's order: swap out (device blocks gathered by a kernel, then one
        transfer to host memory), copy-on-write copies (``copy_blocks`` kernel), swap in (one transfer to the device,
        then a scatter kernel). Pairs are ``(src, dst)`` block ids; caches are per layer
        ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""
        if not gpu_caches:
            return
        dev = gpu_caches[0].device

        def ids(pairs, i, where):
            return torch.tensor([p[i] for p in pairs], dtype=torch.long, device=where)

        ops = self._cache
        if swap_out:
            src, dst = ids(swap_out, 0, dev), ids(swap_out, 1, "cpu")
            for gpu, cpu in zip(gpu_caches, cpu_caches):
                cpu[:, dst] = ops.gather_blocks(gpu, src, **self._mode).to("cpu")
        for r in copy_rounds(copies, parallel=True):  # its programs run in no set order: no overlap in a round
            src, dst = ids(r, 0, dev), ids(r, 1, dev)
            for gpu in gpu_caches:
                ops.copy_blocks(gpu, src, dst, **self._mode)
        if swap_in:
            src, dst = ids(swap_in, 0, "cpu"), ids(swap_in, 1, dev)
            for gpu, cpu in zip(gpu_caches, cpu_caches):
                ops.scatter_blocks(cpu[:, src].to(dev), gpu, dst, **self._mode)


def _decode_context_lens(group) -> torch.Tensor:
    """Context lengths of a decode group: carried by the group, or counted from its key mask."""
    if group.context_lens is not None:
        return group.context_lens
    return group.mask.reshape(group.size, -1).sum(-1)
