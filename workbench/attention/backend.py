"""Choosing the paged-attention backend: the PyTorch reference or the Triton kernels.

A backend has a ``name`` (``"torch"``, ``"triton"`` or ``"triton-interpret"``),
``write_kv(k_cache, v_cache, k, v, slot_mapping)`` (scatter the step's new K/V into their slots),
``paged_attention(q, k, v, k_cache, v_cache, meta, scale) -> [num_tokens, num_heads, head_dim]`` and optionally
``copy_blocks(gpu_caches, cpu_caches, swap_out, copies, swap_in)`` (the step's block copies on the device; the
executor's own PyTorch indexing when absent). The model calls ``meta.backend`` (``None`` = the PyTorch reference),
which the executor sets on each step's :class:`~workbench.attention.AttentionMetadata`.

Engine option ``attention_backend``:

| value | what runs |
|---|---|
| ``"auto"`` (default) | Triton when the device is CUDA and Triton is installed (and not forced into its interpreter), else PyTorch |
| ``"torch"`` | the PyTorch reference (:mod:`workbench.attention.torch_ref`): gather + SDPA, any device |
| ``"triton"`` | the compiled Triton kernels of :mod:`kernels`; CUDA only |
| ``"triton-interpret"`` | the same kernels in Triton's interpreter (NumPy on the CPU): slow, exact, for teaching and tests |
"""

from __future__ import annotations

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


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The concrete backend ``"auto"`` stands for on ``device`` (other names are returned as they are)."""
    check_backend(name, device)
    if name != "auto":
        return name
    if torch.device(device).type == "cuda" and kernels.triton_available() and not kernels.interpreter_forced():
        return "triton"
    return "torch"


def get_backend(name: str = "auto", device: torch.device | str = "cpu"):
    """The backend object for ``name`` on ``device``; raises ``ValueError`` if it cannot run here (see
    :func:`check_backend`)."""
    resolved = resolve_backend(name, device)
    if resolved == "torch":
        return TORCH_BACKEND
    from workbench.attention.triton_backend import TritonBackend

    return TritonBackend(interpret=resolved == "triton-interpret")
