"""Paged decode attention on the CPU, in C++ (``cpu_paged_attention.cpp``), beside its PyTorch reference.

The reference backend gathers each decode sequence's blocks into a padded tensor and calls SDPA; for one query token
per sequence most of that time is the copy and a kernel shaped for long queries (see docs/benchmarks.md, section
"The C++ decode kernel"). This kernel reads every K/V row where it lies in the cache, as vLLM's CPU
``paged_attention_v1`` does, accumulating in float32; in bfloat16 with head_dim 64 or 128 on AVX512-BF16 it takes 16
positions per step with the dot-product instruction (q·k, then p·V with p rounded to bfloat16, as SDPA's bfloat16
kernel does), and ``rowwise=True`` takes the row-wise kernel (one dot product per position and head), the
benchmarks' same-run baseline. Its reference is :func:`workbench.kernels.reference.paged_decode_attention_ref`.
Where the CPU has AVX512-BF16, :func:`paged_attention` does the same for query chunks of any length in bfloat16
(prefill, chunked prefill over cached context, decode), with an online softmax; its reference is
``paged_prefill_attention_ref``.

The source is compiled on first use with :func:`torch.utils.cpp_extension.load` (g++ and ninja; about a minute) for
this CPU (``-march=native``), and cached under ``~/.cache/torch_extensions`` (``TORCH_EXTENSIONS_DIR``) by a name that
includes a digest of the source, the CPU's flags, torch's version and where torch is installed, so a move to another
CPU or torch rebuilds instead of crashing, and two virtual environments keep a build each. A build killed midway leaves
a ``lock`` file that would make the next one wait forever; :func:`load` removes one older than 15 minutes.
``python -m workbench.kernels.cpu_attention`` builds it ahead of time (``make venv`` does).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import shutil
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
#: every source of the extension: the attention kernel, and the layer glue of :mod:`workbench.kernels.cpu_layer_ops`
SOURCES = (SOURCE, Path(__file__).with_name("cpu_layer_ops.cpp"))


def toolchain_missing() -> str | None:
    """What stops the build here (a sentence naming the fix), or ``None`` when a C++ compiler and ninja exist."""
    if not shutil.which("c++") and not shutil.which("g++"):
        return "no C++ compiler (c++ / g++) on PATH: `apt-get install g++`"
    if importlib.util.find_spec("ninja") is None:
        return "ninja is not installed: `pip install ninja`"
    return None


def _extension_name() -> str:
    from workbench.cpu_dtype import _cpu_flags

    digest = hashlib.sha256()
    for src in SOURCES:
        digest.update(src.read_bytes())
    digest.update(" ".join(sorted(_cpu_flags())).encode())
    digest.update(torch.__version__.encode())
    # and per torch installation: two virtual environments with the same torch write different build files (their
    # include paths), so sharing one build folder would rebuild it on every switch between them
    digest.update(str(Path(torch.__file__).resolve().parent).encode())
    return f"workbench_cpu_attention_{digest.hexdigest()[:12]}"


#: a build takes about a minute; a lock older than this was left by a build that was killed
STALE_LOCK_S = 900


def _remove_stale_lock(name: str) -> None:
    """torch's builder waits, forever and silently, while its build folder holds a ``lock`` file; a build killed
    midway (Ctrl-C, a timeout) leaves one behind. Remove it when it is older than :data:`STALE_LOCK_S`."""
    import logging
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logging.getLogger(__name__).warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
        lock.unlink(missing_ok=True)


@functools.lru_cache(maxsize=1)
def load():
    """The compiled module (builds it on first use in a machine's life, then loads the cached build).

    Raises:
        RuntimeError: the toolchain is missing (the message names the fix) or the build failed.
    """
    missing = toolchain_missing()
    if missing:
        raise RuntimeError(f"the CPU attention kernel cannot be built: {missing}")
    from torch.utils.cpp_extension import load as build

    name = _extension_name()
    _remove_stale_lock(name)
    return build(
        name=name,
        sources=[str(src) for src in SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    rowwise: bool = False,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context: ``[num_seqs, num_heads, head_dim]``.

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` float32 or bfloat16.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype.
        block_tables: ``[num_seqs, max_blocks]`` int64.
        context_lens: ``[num_seqs]`` int64 tokens, the query's own included (its K/V already written).
        scale: softmax scale, usually ``head_dim ** -0.5``.
        rowwise: the row-wise kernel, one dot product per position and head (a baseline for benchmarks).

    Raises:
        ValueError: a length is below 1 or beyond its block table, or a block id the sequence reads is outside the
            pool (the kernel would read outside it).
        RuntimeError: the kernel cannot be built here (see :func:`load`), or a shape or dtype does not fit.
    """
    check_caches(k_cache, v_cache)
    tables, lens = check_decode(k_cache.shape[0], k_cache.shape[1], block_tables, context_lens)
    ext = load()
    kernel = ext.paged_decode_attention_rowwise if rowwise else ext.paged_decode_attention
    return kernel(q.contiguous(), k_cache, v_cache, tables, lens, float(scale))


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches must be one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``, of one shape; raises
    ``ValueError`` naming the shapes found (the engine's per-layer ``[2, num_blocks, ...]`` tensor holds K at ``[0]``
    and V at ``[1]``). Checked before the block tables, whose bounds come from these shapes."""
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        hint = " (the engine's [2, num_blocks, ...] layer cache: pass cache[0] and cache[1])" if k_cache.dim() == 5 else ""
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], got "
            f"{list(k_cache.shape)} and {list(v_cache.shape)}{hint}"
        )


def check_decode(
    num_blocks: int, block_size: int, block_tables: torch.Tensor, context_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode layout of :func:`paged_decode_attention` as contiguous int64 tensors, after checking that every
    read stays inside the pool (the backend checks once per step, then calls the kernel for every layer).

    Raises:
        ValueError: as :func:`paged_decode_attention`.
    """
    block_tables, context_lens = _int_tensor("block_tables", block_tables), _int_tensor("context_lens", context_lens)
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    if context_lens.dim() != 1 or context_lens.numel() != block_tables.shape[0]:
        raise ValueError(
            f"context_lens must be [num_seqs] with one length per block-table row ({block_tables.shape[0]}), "
            f"got shape {tuple(context_lens.shape)}"
        )
    lens = context_lens.to(torch.int64).contiguous()
    if lens.numel():
        lo, hi = int(lens.min()), int(lens.max())
        if lo < 1 or hi > block_tables.shape[1] * block_size:
            raise ValueError(
                f"context_lens span {lo}..{hi} tokens, but each must be in 1..{block_tables.shape[1] * block_size} "
                f"(max_blocks {block_tables.shape[1]} x block_size {block_size})"
            )
    tables = block_tables.to(torch.int64).contiguous()
    _check_block_ids(tables, lens, num_blocks, block_size)
    return tables, lens


def _int_tensor(name: str, x) -> torch.Tensor:
    """``x`` as a CPU integer tensor (a list is taken as one); ``ValueError`` naming ``name`` for floats or another
    device, whose values the kernel would truncate or could not read."""
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers (int32 or int64), got {t.dtype}: convert with .long()")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}: the C++ kernels read host memory")
    return t


def _check_block_ids(tables: torch.Tensor, lens: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise ``ValueError`` if a block a sequence reads (the first ``ceil(len / block_size)`` of its row) is not in
    ``0 .. num_blocks - 1``."""
    if not tables.numel():
        return
    used = torch.arange(tables.shape[1]).unsqueeze(0) < (lens.unsqueeze(1) + block_size - 1) // block_size
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        i, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"sequence {i} reads block {int(tables[i, j])} (block_tables[{i}, {j}]), outside the pool of {num_blocks} "
            f"blocks (0..{num_blocks - 1})"
        )


def chunk_kernel_available() -> bool:
    """Whether :func:`paged_attention` runs here: the extension builds (or is built) and this CPU has AVX512-BF16
    (the kernel's dot products are ``vdpbf16ps``). ``False`` where the toolchain is missing or the build fails."""
    if toolchain_missing():
        return False
    try:
        return bool(load().bf16_dot_product)
    except Exception:  # noqa: BLE001 - a failed build: the attention backend's log says why
        return False


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's query chunk over its paged context, read from the blocks where they lie:
    ``[num_tokens, num_heads, head_dim]`` bfloat16. Prefill, a chunk after cached context and a decode (a chunk of
    one) are one case. Online softmax in float32 (FlashAttention, Dao et al., 2022, Algorithm 1). Its reference is
    :func:`workbench.kernels.reference.paged_prefill_attention_ref`.

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` bfloat16; head_dim 64 or 128.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` bfloat16, the chunk's K/V written.
        block_tables: ``[num_seqs, max_blocks]`` int64.
        query_start: ``[num_seqs + 1]`` int64, sequence ``i``'s rows are ``query_start[i] : query_start[i+1]``.
        context_lens: ``[num_seqs]`` int64 tokens, the chunk included: its rows are the last of them.
        scale: softmax scale, usually ``head_dim ** -0.5``.

    Raises:
        ValueError: a chunk longer than its context, a context beyond its block table, a block id outside the pool,
            query starts that do not cover ``q``, a dtype other than bfloat16, or a head_dim other than 64 or 128
            (each names the value).
        RuntimeError: the kernel cannot run here (:func:`chunk_kernel_available` is ``False``: no AVX512-BF16).
    """
    dtypes = {"q": q.dtype, "k_cache": k_cache.dtype, "v_cache": v_cache.dtype}
    if wrong := {n: d for n, d in dtypes.items() if d != torch.bfloat16}:
        raise ValueError(f"the chunk kernel takes bfloat16 q and caches, but {wrong}; convert with .bfloat16()")
    if q.dim() != 3 or q.shape[-1] not in (64, 128):
        raise ValueError(
            f"the chunk kernel takes q [num_tokens, num_heads, head_dim] with head_dim 64 or 128, got shape "
            f"{tuple(q.shape)}; use paged_prefill_attention_ref (workbench.kernels.reference) for other head dims"
        )
    check_caches(k_cache, v_cache)
    tables, starts, lens = check_chunks(q.shape[0], k_cache.shape[0], k_cache.shape[1], block_tables, query_start,
                                        context_lens)  # fmt: skip
    return load().paged_attention(q.contiguous(), k_cache, v_cache, tables, starts, lens, float(scale))


def check_chunks(
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chunk layout of :func:`paged_attention` as contiguous int64 tensors, after checking that every read stays
    inside its block table and the pool (the backend checks once per step, then calls the kernel for every layer).

    Raises:
        ValueError: as :func:`paged_attention`.
    """
    block_tables, query_start = _int_tensor("block_tables", block_tables), _int_tensor("query_start", query_start)
    context_lens = _int_tensor("context_lens", context_lens)
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be [num_seqs], got shape {tuple(context_lens.shape)}")
    starts = query_start.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    s = starts.tolist() if starts.dim() == 1 else None
    if (
        s is None
        or len(s) != lens.numel() + 1
        or s[0] != 0
        or s[-1] != num_tokens
        or any(b < a for a, b in zip(s, s[1:]))
    ):
        raise ValueError(
            f"query_start must run from 0 to {num_tokens} (q's rows), never falling, with one entry more than "
            f"context_lens ({lens.numel()}); got {query_start.tolist()}"
        )
    if block_tables.shape[0] != lens.numel():
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {lens.numel()} sequences")
    cap = block_tables.shape[1] * block_size
    for i, ctx in enumerate(lens.tolist()):
        if ctx < s[i + 1] - s[i]:
            raise ValueError(f"sequence {i} has {s[i + 1] - s[i]} query tokens but a context of {ctx}")
        if ctx > cap:
            raise ValueError(
                f"sequence {i} has a context of {ctx} tokens, beyond its block table "
                f"(max_blocks {block_tables.shape[1]} x block_size {block_size})"
            )
    tables = block_tables.to(torch.int64).contiguous()
    _check_block_ids(tables, lens.clamp_min(0), num_blocks, block_size)
    return tables, starts, lens


if __name__ == "__main__":  # python -m workbench.kernels.cpu_attention: build ahead of time
    import time

    t0 = time.perf_counter()
    missing = toolchain_missing()
    if missing:
        raise SystemExit(f"not built: {missing}")
    load()
    print(f"{_extension_name()}: built or loaded in {time.perf_counter() - t0:.1f} s")
