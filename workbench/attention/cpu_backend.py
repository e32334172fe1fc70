"""The CPU backend: decode rows by the C++ kernel of :mod:`workbench.kernels.cpu_attention`, the rest by the
PyTorch reference.

Decode dominates a CPU step's attention (one query token per running sequence, every step); the reference's
gather-then-SDPA copies each sequence's whole context per layer for it. Prefill chunks keep the reference's SDPA,
which is shaped for them. Cache writes and block copies are the reference's."""

from __future__ import annotations

import dataclasses

import torch

from workbench.attention import torch_ref
from workbench.kernels import cpu_attention


class CpuBackend:
    """Paged attention with the C++ decode kernel (built, or loaded from its cache, at construction: the engine's
    start-up pays the one-off build, never a step). Raises ``RuntimeError`` if the kernel cannot be built."""

    name = "cpu"
    write_kv = staticmethod(torch_ref.write_kv)

    def __init__(self) -> None:
        cpu_attention.load()
        self._decode = cpu_attention.paged_decode_attention

    def __repr__(self) -> str:
        return "CpuBackend()"

    def paged_attention(self, q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        """Same arguments and result as :func:`~workbench.attention.torch_ref.paged_attention`. Decode groups whose
        cache is not q's dtype, or not contiguous, fall back to the reference."""
        if not meta.decode_groups or not _fits(q, k_cache, v_cache):
            return torch_ref.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
        out = torch_ref.paged_attention(q, k, v, k_cache, v_cache, dataclasses.replace(meta, decode_groups=[]), scale)
        for g in meta.decode_groups:
            lens = g.context_lens if g.context_lens is not None else g.mask.reshape(g.size, -1).sum(-1)
            out[g.start : g.start + g.size] = self._decode(
                q[g.start : g.start + g.size], k_cache, v_cache, g.block_tables, lens, scale
            )
        return out


def _fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )
