"""Paged-attention backends behind one interface: the PyTorch reference (:mod:`workbench.attention.torch_ref`)
and the Triton kernels of :mod:`kernels` (:mod:`workbench.attention.triton_backend`); the choice is
:mod:`workbench.attention.backend` (engine option ``attention_backend``). Importing this package imports no Triton."""

from workbench.attention.backend import (
    BACKEND_NAMES,
    TORCH_BACKEND,
    TorchBackend,
    check_backend,
    get_backend,
    resolve_backend,
)
from workbench.attention.torch_ref import AttentionMetadata, DecodeGroup, paged_attention, write_kv

__all__ = [
    "AttentionMetadata",
    "BACKEND_NAMES",
    "DecodeGroup",
    "TORCH_BACKEND",
    "TorchBackend",
    "check_backend",
    "get_backend",
    "paged_attention",
    "resolve_backend",
    "write_kv",
]
