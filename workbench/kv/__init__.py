"""KV-cache managers behind one interface (:class:`~workbench.kv.interface.KVManager`): paged
allocation (block pool, block tables, prefix caching, swap) and the contiguous baselines."""

from workbench.config import BUILTIN_ALLOCATORS
from workbench.kv.block_pool import BlockPool
from workbench.kv.events import EventedKVCacheManager, kv_events_enabled
from workbench.kv.interface import KVManager
from workbench.kv.manager import KVCacheManager
from workbench.plugins import load_plugin


def plugin_class(name: str) -> type[KVManager]:
    """The :class:`~workbench.kv.interface.KVManager` subclass a plug-in allocator name
    ``"package.module:ClassName"`` points to; ``ValueError`` naming the value if it does not load
    (:func:`workbench.plugins.load_plugin`)."""
    return load_plugin("kv_allocator", name, KVManager)


def make_kv_manager(config, num_blocks: int, num_cpu_blocks: int = 0) -> KVManager:
    """The manager ``config.kv_allocator`` names, over a pool of ``num_blocks`` blocks of
    ``config.block_size`` slots (and ``num_cpu_blocks`` of CPU swap space, paged only): ``"paged"``,
    a contiguous baseline, a built-in of ``workbench/kv/`` (``BUILTIN_ALLOCATORS``: best-fit,
    buddy; loaded as plug-ins) or a plug-in ``"package.module:ClassName"``, each built as
    ``ClassName(num_blocks, block_size)``; paged evicts prefix-cached blocks by ``config.prefix_cache_eviction``.

    Raises:
        ValueError: a plug-in that cannot be loaded (see :func:`plugin_class`).
    """
    name = config.kv_allocator
    name = f"workbench.kv.{BUILTIN_ALLOCATORS[name]}" if name in BUILTIN_ALLOCATORS else name
    if name == "paged":
        args = (config.enable_prefix_caching, num_cpu_blocks, config.prefix_cache_eviction)
        cls = EventedKVCacheManager if kv_events_enabled(config) else KVCacheManager  # --kv-events-config
        return cls(num_blocks, config.block_size, *args)
    if ":" in name:
        return plugin_class(name)(num_blocks, config.block_size)
    from workbench.kv.contiguous import ContiguousKVCacheManager

    return ContiguousKVCacheManager(num_blocks, config.block_size, name)


__all__ = ["BlockPool", "KVCacheManager", "KVManager", "make_kv_manager", "plugin_class"]
