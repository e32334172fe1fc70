"""KV-cache managers behind one interface (:class:`~workbench.kv.interface.KVManager`): paged
allocation (block pool, block tables, prefix caching, swap) and the contiguous baselines."""

from workbench.kv.block_pool import BlockPool
from workbench.kv.interface import KVManager
from workbench.kv.manager import KVCacheManager


def make_kv_manager(config, num_blocks: int, num_cpu_blocks: int = 0) -> KVManager:
    """The manager ``config.kv_allocator`` names, over a pool of ``num_blocks`` blocks of
    ``config.block_size`` slots (and ``num_cpu_blocks`` of CPU swap space, paged only).

    Raises:
        ValueError: an unknown allocator name.
    """
    if config.kv_allocator == "paged":
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks)
    from workbench.kv.contiguous import ContiguousKVCacheManager

    return ContiguousKVCacheManager(num_blocks, config.block_size, config.kv_allocator)


__all__ = ["BlockPool", "KVCacheManager", "KVManager", "make_kv_manager"]
