"""Paged KV cache: the block pool and the manager of block tables."""

from workbench.kv.block_pool import BlockPool
from workbench.kv.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
