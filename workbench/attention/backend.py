"""Choosing the paged-attention backend: the PyTorch reference, the C++ CPU decode kernel or the Triton kernels.

A backend has a ``name`` (``"torch"``, ``"cpu"``, ``"triton"`` or ``"triton-interpret"``),
``write_kv(k_cache, v_cache, k, v, slot_mapping)`` (scatter the step's new K/V into their slots),
``paged_attention(q, k, v, k_cache, v_cache, meta, scale) -> [num_tokens, num_heads, head_dim]`` and optionally
``copy_blocks(gpu_caches, cpu_caches, swap_out, copies, swap_in)`` (the step's block copies on the device; the
executor's own PyTorch indexing when absent). The model calls ``meta.backend`` (``None`` = the PyTorch reference),
which the executor sets on each step's :class:`~workbench.attention.AttentionMetadata`.

Engine option ``attention_backend``:

| value | what runs |
|---|---|
| ``"auto"`` (default) | Triton when the device is CUDA and Triton is installed (and not forced into its interpreter); on the CPU with a bfloat16 KV cache, ``"cpu"`` where a C++ compiler and ninja exist; else PyTorch |
| ``"torch"`` | the PyTorch reference (:mod:`workbench.attention.torch_ref`): gather + SDPA, any device |
| ``"cpu"`` | the C++ kernels of :mod:`workbench.kernels.cpu_attention` (built on first use): decode rows by the decode kernel; prefill chunks by the chunk kernel in bfloat16 with AVX512-BF16 and head_dim 64 or 128, else by the reference; CPU only |
| ``"triton"`` | the compiled Triton kernels of :mod:`kernels`; CUDA only |
| ``"triton-interpret"`` | the same kernels in Triton's interpreter (NumPy on the CPU): slow, exact, for teaching and tests |
"""

from __future__ import annotations

import warnings

import torch

from workbench import kernels
from workbench.attention import torch_ref

from workbench.config import ATTENTION_BACKENDS as BACKEND_NAMES  # isort: skip  (declared in workbench.config)


class TorchBackend:
    """The PyTorch reference: :func:`~workbench.attention.torch_ref.write_kv` and ``paged_attention``."""

    name = "torch"
    write_kv = staticmethod(torch_ref.write_kv)
    paged_attention = staticmethod(torch_ref.paged_attention)

    def __repr__(self) -> str:
        return "TorchBackend()"


#: The reference backend; also what the model uses when the metadata names none.
TORCH_BACKEND = TorchBackend()


def check_backend(name: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` (naming the value and the fix) if ``name`` cannot run on ``device``. Imports no Triton
    (``LLMEngine`` calls it before anything loads)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend={name!r} must be one of {', '.join(repr(n) for n in BACKEND_NAMES)}")
    if name in ("auto", "torch"):
        return
    if name == "cpu":
        from workbench.kernels.cpu_attention import toolchain_missing

        if torch.device(device).type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, but device={str(device)!r}; use 'auto'")
        if missing := toolchain_missing():
            raise ValueError(f"attention_backend='cpu' builds a C++ kernel, but there is {missing}; or use 'torch'")
        return
    if not kernels.triton_available():
        raise ValueError(
            f"attention_backend={name!r} needs Triton, which is not installed: `pip install triton` "
            "(or `pip install -e '.[triton]'`), or use attention_backend='torch'"
        )
    device = torch.device(device)
    if name == "triton":
        if device.type != "cuda":
            raise ValueError(
                f"attention_backend='triton' runs compiled kernels on CUDA, but device={str(device)!r}; on CPU use "
                "'triton-interpret' (the same kernels in Triton's interpreter: slow, for teaching and tests) or 'torch'"
            )
        if kernels.interpreter_forced():
            raise ValueError(
                "attention_backend='triton' needs compiled kernels, but TRITON_INTERPRET=1 is set (or was, when "
                "Triton was imported in this process), which makes every Triton kernel interpreted; unset it and "
                "start a new process, or use attention_backend='triton-interpret'"
            )


def resolve_backend(name: str, device: torch.device | str, kv_dtype: torch.dtype | None = None) -> str:
    """The concrete backend ``"auto"`` stands for on ``device`` with a KV cache of ``kv_dtype`` (other names are
    returned as they are). On the CPU ``"auto"`` takes the C++ kernels for a bfloat16 cache only: float32 stays
    on the reference, whose results the suite and the labs compare bit for bit."""
    check_backend(name, device)
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and kernels.triton_available() and not kernels.interpreter_forced():
        return "triton"
    if torch.device(device).type == "cpu" and kv_dtype == torch.bfloat16:
        from workbench.kernels.cpu_attention import toolchain_missing

        if toolchain_missing() is None:
            return "cpu"
    return "torch"


def auto_reason(resolved: str, device: torch.device | str, kv_dtype: torch.dtype | None) -> str:
    """Why ``"auto"`` resolved to ``resolved`` (for the start-up log line)."""
    if resolved == "triton":
        return "CUDA with Triton installed"
    if resolved == "cpu":
        return "a bfloat16 KV cache on the CPU, g++ and ninja found"
    if torch.device(device).type == "cpu" and kv_dtype == torch.bfloat16:
        from workbench.kernels.cpu_attention import toolchain_missing

        return f"the C++ kernel cannot be built: {toolchain_missing() or 'its build failed'}"
    return f"the reference for a {str(kv_dtype).removeprefix('torch.')} KV cache on {torch.device(device).type}"


def get_backend(name: str = "auto", device: torch.device | str = "cpu", kv_dtype: torch.dtype | None = None):
    """The backend object for ``name`` on ``device`` (``kv_dtype``: see :func:`resolve_backend`); raises
    ``ValueError`` if it cannot run here (see :func:`check_backend`). ``"auto"`` whose C++ kernel fails to build
    falls back to the reference, with a warning; an explicit ``"cpu"`` raises the build's ``RuntimeError``."""
    resolved = resolve_backend(name, device, kv_dtype)
    if resolved == "torch":
        return TORCH_BACKEND
    if resolved == "cpu":
        from workbench.attention.cpu_backend import CpuBackend

        try:
            return CpuBackend()
        except ValueError:  # a setting to fix (WORKBENCH_CPU_DECODE_KERNEL), not a failed build
            raise
        except Exception as e:  # a broken toolchain must not stop an engine that did not ask for the kernel
            if name != "auto":
                raise
            warnings.warn(f"the CPU attention kernel did not build ({e}); using the PyTorch reference", stacklevel=2)
            return TORCH_BACKEND
    from workbench.attention.triton_backend import TritonBackend

    return TritonBackend(interpret=resolved == "triton-interpret")
