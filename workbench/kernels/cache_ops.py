"""KV-cache writes and block copies in Triton.

* :func:`reshape_and_cache` — the step's new K/V ``[num_tokens, num_kv_heads, head_dim]`` scattered
  into their slots (vLLM's ``reshape_and_cache``, ``csrc/cache_kernels.cu``). Slot ``s`` is row
  ``s % block_size`` of block ``s // block_size``; a negative slot (padding) is skipped, as in vLLM.
* :func:`copy_blocks` — copy blocks ``src[i] -> dst[i]`` inside one layer's cache, K and V (vLLM's
  ``copy_blocks``): copy-on-write of a shared last block (parallel sampling, Kwon et al. SOSP 2023,
  §4.4) and defragmentation (moving blocks to compact the pool).
* :func:`gather_blocks` / :func:`scatter_blocks` — the device side of swapping (§4.5): blocks are
  gathered into one packed buffer that crosses to host memory in one transfer (swap out), and a
  packed buffer that came from host memory is scattered into its blocks (swap in). vLLM's
  ``swap_blocks`` does one ``cudaMemcpyAsync`` per block instead; one packed copy amortises the
  per-transfer cost over the whole step.

All three block operations are one kernel, :func:`_copy_blocks_kernel`: program ``(i, kv, chunk)``
copies ``CHUNK`` elements of block ``src_ids[i]`` of ``src[kv]`` into block ``dst_ids[i]`` of ``dst[kv]``.
A block of a contiguous cache ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` is one run of
``block_size * num_kv_heads * head_dim`` elements, so a copy is a strided memcpy.

The oracles are ``reshape_and_cache_ref``, ``copy_blocks_ref``, ``gather_blocks_ref`` and
``scatter_blocks_ref`` in :mod:`workbench.kernels.reference`.
"""

from __future__ import annotations

import torch

from workbench.kernels import load_triton, next_power_of_2
from workbench.kernels.reference import copy_blocks_ref, gather_blocks_ref, reshape_and_cache_ref, scatter_blocks_ref
from workbench.kernels.runtime import launch, wants_interpreter

triton = load_triton()
import triton.language as tl  # noqa: E402

__all__ = [
    "reshape_and_cache",
    "copy_blocks",
    "gather_blocks",
    "scatter_blocks",
    "reshape_and_cache_ref",
    "copy_blocks_ref",
    "gather_blocks_ref",
    "scatter_blocks_ref",
]


@triton.jit
def _reshape_and_cache_kernel(
    K,  # [num_tokens, num_kv_heads, head_dim]
    V,
    KCache,  # [num_blocks, block_size, num_kv_heads, head_dim]
    VCache,
    SlotMapping,  # [num_tokens] int32/int64
    block_size,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    num_tokens,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS padded to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
):
    # a [BLOCK_T tokens, BLOCK_H * BLOCK_D] tile: column j is head j // BLOCK_D, element j % BLOCK_D
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H * BLOCK_D)
    head = cols // BLOCK_D
    dim = cols % BLOCK_D
    t_mask = tokens < num_tokens
    slot = tl.load(SlotMapping + tokens, mask=t_mask, other=-1).to(tl.int64)
    # slot -> (block, row); a negative slot is padding and writes nothing
    block = slot // block_size
    row = slot % block_size
    mask = ((slot >= 0) & t_mask)[:, None] & ((head < NUM_KV_HEADS) & (dim < HEAD_DIM))[None, :]
    dst = block[:, None] * stride_cb + row[:, None] * stride_ct + (head * stride_ch + dim)[None, :]
    k = tl.load(K + tokens[:, None] * stride_kt + (head * stride_kh + dim)[None, :], mask=mask)
    v = tl.load(V + tokens[:, None] * stride_vt + (head * stride_vh + dim)[None, :], mask=mask)
    tl.store(KCache + dst, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + dst, v.to(VCache.dtype.element_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    Src,  # [2, *, block_size, num_kv_heads, head_dim]: K and V
    Dst,
    SrcIds,  # [n] int32/int64: block index in Src
    DstIds,  # [n] int32/int64: block index in Dst
    block_numel,  # block_size * num_kv_heads * head_dim
    src_stride_kv,
    src_stride_b,
    dst_stride_kv,
    dst_stride_b,
    CHUNK: tl.constexpr,  # elements per program
):
    pair = tl.program_id(0)
    kv = tl.program_id(1)  # 0 = K, 1 = V
    chunk = tl.program_id(2)
    src_block = tl.load(SrcIds + pair).to(tl.int64)
    dst_block = tl.load(DstIds + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < block_numel
    x = tl.load(Src + kv * src_stride_kv + src_block * src_stride_b + offs, mask=mask)
    tl.store(Dst + kv * dst_stride_kv + dst_block * dst_stride_b + offs, x.to(Dst.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    interpret: bool | None = None,
) -> None:
    """Write token ``t``'s K and V into cache slot ``slot_mapping[t]``, in place.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` (any strides with ``head_dim`` contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, equal strides; values are
            cast to the cache's dtype.
        slot_mapping: ``[num_tokens]`` int32 / int64; slot = block * block_size + row; negative = skip.
        interpret: run in Triton's interpreter; ``None`` = on CPU tensors only (:mod:`workbench.kernels.runtime`).

    Raises:
        ValueError: inconsistent shapes. RuntimeError: compiled mode asked for CPU tensors.
    """
    n, h, d = k.shape
    if v.shape != k.shape or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k {tuple(k.shape)} / v {tuple(v.shape)} and k_cache {tuple(k_cache.shape)} / v_cache "
            f"{tuple(v_cache.shape)} must match pairwise (caches with equal strides)"
        )
    if k_cache.shape[2:] != (h, d) or slot_mapping.shape != (n,):
        raise ValueError(
            f"k is [num_tokens={n}, {h}, {d}], the cache [.., .., {k_cache.shape[2]}, {k_cache.shape[3]}] and "
            f"slot_mapping {tuple(slot_mapping.shape)}: KV heads and head_dim must match, one slot per token"
        )
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches must be contiguous in head_dim (stride 1)")
    interpret = wants_interpreter(k_cache, interpret)
    if n == 0:
        return
    block_h, block_d = next_power_of_2(h), next_power_of_2(d)
    block_t = max(1, min(16, 4096 // (block_h * block_d)))  # up to 4096 elements of K (and V) per program
    launch(
        _reshape_and_cache_kernel, (-(-n // block_t),),
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), n,
        NUM_KV_HEADS=h, HEAD_DIM=d, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        interpret=interpret,
    )  # fmt: skip


def _block_layout(cache: torch.Tensor, name: str) -> tuple[int, int, int]:
    """(elements per block, stride between K and V, stride between blocks) of a ``[2, nb, ...]`` cache."""
    if cache.dim() < 3 or cache.shape[0] != 2:
        raise ValueError(
            f"{name} must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(cache.shape)}"
        )
    numel = 1  # a block must be one contiguous run: row-major strides over its dims
    for size, stride in zip(reversed(cache.shape[2:]), reversed(cache.stride()[2:])):
        if size > 1 and stride != numel:
            raise ValueError(f"each block of {name} must be contiguous, got strides {cache.stride()}")
        numel *= size
    return numel, cache.stride(0), cache.stride(1)


def _launch_copy(src, dst, src_ids, dst_ids, interpret: bool | None) -> None:
    numel, s_kv, s_b = _block_layout(src, "src")
    numel_d, d_kv, d_b = _block_layout(dst, "dst")
    if numel != numel_d or src.shape[2:] != dst.shape[2:]:
        raise ValueError(f"blocks of src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in shape")
    if src_ids.shape != dst_ids.shape or src_ids.dim() != 1:
        raise ValueError(
            f"src and dst block ids must be equal-length 1-D, got {tuple(src_ids.shape)} / {tuple(dst_ids.shape)}"
        )
    interpret = wants_interpreter(src, interpret)
    n = src_ids.shape[0]
    if n == 0:
        return
    chunk = min(4096, next_power_of_2(numel))
    grid = (n, 2, -(-numel // chunk))
    launch(
        _copy_blocks_kernel, grid, src, dst, src_ids, dst_ids, numel, s_kv, s_b, d_kv, d_b,
        CHUNK=chunk, num_warps=4, interpret=interpret,
    )  # fmt: skip


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, *, interpret: bool | None = None) -> None:
    """Copy block ``src[i]`` to block ``dst[i]`` of one layer's cache (K and V), in place.

    Args:
        cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, each block contiguous.
        src, dst: ``[n]`` int32 / int64 block ids on the cache's device. The programs run in no set
            order, so no block may be both a source and a destination of the same call (true of
            copy-on-write, whose destinations are fresh blocks; split a defragmentation into rounds).
        interpret: run in Triton's interpreter; ``None`` = on CPU tensors only (:mod:`workbench.kernels.runtime`).

    Raises:
        ValueError: bad shapes. RuntimeError: compiled mode asked for CPU tensors.
    """
    _launch_copy(cache, cache, src, dst, interpret)


def gather_blocks(
    cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None, *, interpret: bool | None = None
) -> torch.Tensor:
    """Pack blocks ``ids`` of one layer's cache: returns ``[2, n, block_size, num_kv_heads, head_dim]``
    (``out`` if given, else a new tensor on the cache's device). Swap out copies it to host memory."""
    if out is None:
        out = torch.empty((2, ids.shape[0], *cache.shape[2:]), dtype=cache.dtype, device=cache.device)
    arange = torch.arange(ids.shape[0], device=ids.device, dtype=ids.dtype)
    _launch_copy(cache, out, ids, arange, interpret)
    return out


def scatter_blocks(
    packed: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor, *, interpret: bool | None = None
) -> None:
    """Unpack ``packed [2, n, block_size, num_kv_heads, head_dim]`` into blocks ``ids`` of ``cache``
    (in place; cast to the cache's dtype). Swap in copies the packed blocks from host memory first."""
    arange = torch.arange(ids.shape[0], device=ids.device, dtype=ids.dtype)
    _launch_copy(packed, cache, arange, ids, interpret)
