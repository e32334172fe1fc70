"""Paged-attention backends. For now: the PyTorch reference (:mod:`workbench.attention.torch_ref`)."""

from workbench.attention.torch_ref import AttentionMetadata, DecodeGroup, paged_attention, write_kv

__all__ = ["AttentionMetadata", "DecodeGroup", "paged_attention", "write_kv"]
