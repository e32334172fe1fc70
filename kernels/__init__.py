"""Triton kernels (paged attention, cache writes, block copies), each beside its PyTorch reference.

The engine's reference backend lives in :mod:`workbench.attention.torch_ref`; the Triton
kernels arrive with the kernels issue and are imported by :mod:`workbench.attention`.
"""
