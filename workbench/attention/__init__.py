"""Paged-attention backends behind one interface: the PyTorch reference (:mod:`workbench.attention.torch_ref`)
and the Triton kernels of :mod:`kernels` (:mod:`workbench.attention.triton_backend`); the choice is
:mod:`workbench.attention.backend` (engine option ``attention_backend``). Importing this package imports no Triton."""

from workbench.attention import torch_ref
from workbench.attention.backend import TORCH_BACKEND, get_backend, resolve_backend
from workbench.attention.torch_ref import AttentionMetadata, DecodeGroup

__all__ = ["AttentionMetadata", "DecodeGroup", "TORCH_BACKEND", "get_backend", "resolve_backend", "torch_ref"]
