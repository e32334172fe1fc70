"""KV-cache managers behind one interface (:class:`~workbench.kv.interface.KVManager`): paged
allocation (block pool, block tables, prefix caching, swap) and the contiguous baselines."""

import importlib

from workbench.kv.block_pool import BlockPool
from workbench.kv.interface import KVManager
from workbench.kv.manager import KVCacheManager


def plugin_class(name: str) -> type[KVManager]:
    """The class a plug-in allocator name ``"package.module:ClassName"`` points to.

    Raises:
        ValueError: the module cannot be imported, has no such class, or the class does not
            implement :class:`~workbench.kv.interface.KVManager` (the message names the value).
    """
    module, _, cls_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"kv_allocator={name!r}: cannot load {cls_name!r} from module {module!r} ({e}); give "
            "'package.module:ClassName' of an importable KVManager subclass, or a built-in allocator"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, KVManager)):
        raise ValueError(
            f"kv_allocator={name!r} is not a KVManager subclass; implement workbench.kv.interface.KVManager"
        )
    return cls


def make_kv_manager(config, num_blocks: int, num_cpu_blocks: int = 0) -> KVManager:
    """The manager ``config.kv_allocator`` names, over a pool of ``num_blocks`` blocks of
    ``config.block_size`` slots (and ``num_cpu_blocks`` of CPU swap space, paged only): ``"paged"``,
    a contiguous baseline, or a plug-in ``"package.module:ClassName"`` built as
    ``ClassName(num_blocks, block_size)``.

    Raises:
        ValueError: a plug-in that cannot be loaded (see :func:`plugin_class`).
    """
    name = config.kv_allocator
    if name == "paged":
        return KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, num_cpu_blocks)
    if ":" in name:
        return plugin_class(name)(num_blocks, config.block_size)
    from workbench.kv.contiguous import ContiguousKVCacheManager

    return ContiguousKVCacheManager(num_blocks, config.block_size, name)


__all__ = ["BlockPool", "KVCacheManager", "KVManager", "make_kv_manager", "plugin_class"]
