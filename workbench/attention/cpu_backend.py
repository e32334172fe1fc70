"""The CPU backend: the C++ kernels of :mod:`workbench.kernels.cpu_attention`.

Decode dominates a CPU step's attention (one query token per running sequence, every step); the reference's
gather-then-SDPA copies each sequence's whole context per layer for it. In bfloat16 on a CPU with AVX512-BF16 the
chunk kernel (:func:`~workbench.kernels.cpu_attention.paged_attention`) takes the step's prefill chunks, whole
prompts and chunks after cached context alike, reading K/V from the blocks (``WORKBENCH_CPU_CHUNK_KERNEL=0``: the
reference's gather + SDPA instead); decode rows go to the decode kernel. Cache writes and block copies are the
reference's."""

from __future__ import annotations

import dataclasses
import itertools
import os

import torch

from workbench.attention import torch_ref
from workbench.cpu_dtype import env_switch
from workbench.kernels import cpu_attention


class CpuBackend:
    """Paged attention with the C++ kernels (built, or loaded from its cache, at construction: the engine's
    start-up pays the one-off build, never a step). Raises ``RuntimeError`` if the kernel cannot be built."""

    name = "cpu"
    write_kv = staticmethod(torch_ref.write_kv)

    def __init__(self) -> None:
        decode = os.environ.get("WORKBENCH_CPU_DECODE_KERNEL", "")
        if decode not in ("", "default", "rowwise"):
            raise ValueError(
                f"WORKBENCH_CPU_DECODE_KERNEL={decode!r} is not a decode kernel: unset it (or 'default') for the "
                "16-position kernel, or set 'rowwise' for the earlier one"
            )
        self._ext = cpu_attention.load()
        self._chunks = bool(self._ext.bf16_dot_product) and env_switch("WORKBENCH_CPU_CHUNK_KERNEL", default=True)
        self._rowwise = decode == "rowwise"
        self._decode_kernel = "paged_decode_attention" + ("_rowwise" if self._rowwise else "")
        #: which kernel takes which rows (the engine's start-up log line carries it)
        self.detail = (
            "decode rows: C++ decode kernel, "
            + (
                "one position at a time (WORKBENCH_CPU_DECODE_KERNEL=rowwise)"
                if self._rowwise
                else "16 positions per step in bfloat16 with head_dim 64 or 128"
                + (" (else one position at a time)" if self._ext.bf16_dot_product else " (not here: no AVX512-BF16)")
            )
            + "; prefill chunks: "
        ) + (
            "C++ chunk kernel in bfloat16 with head_dim 64 or 128 (WORKBENCH_CPU_CHUNK_KERNEL=0 for the reference)"
            if self._chunks
            else "the reference's gather + SDPA ("
            + ("WORKBENCH_CPU_CHUNK_KERNEL=0" if self._ext.bf16_dot_product else "no AVX512-BF16 for the chunk kernel")
            + ")"
        )

    @staticmethod
    def _chunk_layout(meta, num_tokens: int, num_blocks: int, block_size: int):
        """The step's prefill chunks for the chunk kernel: block tables, query starts and context lengths, built and
        checked once per step and reused by every layer."""
        lay = meta.extras.get("cpu")
        if lay is None:
            tables = torch.nn.utils.rnn.pad_sequence([t.long() for t in meta.prefill_block_tables], batch_first=True)
            starts = torch.tensor([0, *itertools.accumulate(meta.prefill_query_lens)], dtype=torch.int64)
            lens = torch.tensor(meta.prefill_context_lens, dtype=torch.int64)
            lay = cpu_attention.check_chunks(num_tokens, num_blocks, block_size, tables, starts, lens)
            meta.extras["cpu"] = lay
        return lay

    def __repr__(self) -> str:
        return f"CpuBackend(chunk_kernel={self._chunks}, rowwise_decode={self._rowwise})"

    def paged_attention(self, q, k, v, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
        """Same arguments and result as :func:`~workbench.attention.torch_ref.paged_attention`. Decode rows go to the
        decode kernel; prefill chunks to the chunk kernel in bfloat16 where it runs (AVX512-BF16, head_dim 64 or
        128), else to the reference. Caches that are not q's dtype, or not contiguous, fall back to the reference."""
        nd = meta.num_decode
        chunks = self._chunks and q.dtype == torch.bfloat16 and q.shape[-1] in (64, 128) and q.shape[0] > nd
        if chunks and _fits(q, k_cache, v_cache):
            out = torch.empty_like(q)
            tables, starts, lens = self._chunk_layout(meta, q.shape[0] - nd, k_cache.shape[0], k_cache.shape[1])
            out[nd:] = self._ext.paged_attention(
                q[nd:].contiguous(), k_cache, v_cache, tables, starts, lens, float(scale)
            )
            self._decode_rows(q, k_cache, v_cache, meta, scale, out)
            return out
        if not meta.decode_groups or not _fits(q, k_cache, v_cache):
            return torch_ref.paged_attention(q, k, v, k_cache, v_cache, meta, scale)
        out = torch_ref.paged_attention(q, k, v, k_cache, v_cache, dataclasses.replace(meta, decode_groups=[]), scale)
        self._decode_rows(q, k_cache, v_cache, meta, scale, out)
        return out

    def _decode_rows(self, q, k_cache, v_cache, meta, scale: float, out: torch.Tensor) -> None:
        """The decode rows through the decode kernel in one call: the groups (which bound the reference's padding)
        merged into one layout, its lengths and block ids checked once per step and reused by every layer."""
        if not meta.decode_groups:
            return
        checked = meta.extras.get("cpu_decode")
        if checked is None:
            groups = meta.decode_groups  # built in row order by the executor; checked below
            width = max(g.block_tables.shape[1] for g in groups)
            tables = torch.cat(
                [torch.nn.functional.pad(g.block_tables.long(), (0, width - g.block_tables.shape[1])) for g in groups]
            )
            lens = torch.cat(
                [g.context_lens if g.context_lens is not None else g.mask.reshape(g.size, -1).sum(-1) for g in groups]
            )
            if [g.start for g in groups] != list(itertools.accumulate([0] + [g.size for g in groups[:-1]])):
                raise ValueError(
                    f"decode groups must cover rows 0..{len(lens) - 1} in order; got starts "
                    f"{[g.start for g in groups]} and sizes {[g.size for g in groups]}"
                )
            checked = cpu_attention.check_decode(k_cache.shape[0], k_cache.shape[1], tables, lens)
            meta.extras["cpu_decode"] = checked
        tables, lens = checked
        n = tables.shape[0]
        kernel = getattr(self._ext, self._decode_kernel)
        out[:n] = kernel(q[:n].contiguous(), k_cache, v_cache, tables, lens, float(scale))


def _fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    )
