"""Classes defined in a notebook, made loadable by the ``"package.module:ClassName"`` name that a plug-in engine
argument takes (``prefix_cache_eviction``, ``kv_allocator``).

An engine argument that accepts a plug-in names a class by where it lives, because the configuration is plain data
(it is validated, printed, written into run folders). A class written in a notebook cell lives in ``__main__`` of
the kernel, a name that means something else in every other process. :func:`register` files the class here and
returns the name the engine can load it by, in this process::

    from workbench.allocators.eviction import EvictionPolicy
    from workbench.labs.notebook_classes import register

    class MyPolicy(EvictionPolicy):
        def victim(self):
            return next(iter(self.free))

    name = register(MyPolicy, EvictionPolicy)  # "workbench.labs.notebook_classes:MyPolicy"
    labs.lab_run(records, enable_prefix_caching=True, prefix_cache_eviction=name)

Registering a class of the same name again (the cell edited and run again) replaces it.
"""

from __future__ import annotations

__all__ = ["register", "registered"]

_CLASSES: dict[str, type] = {}


def register(cls: type, base: type | None = None) -> str:
    """File ``cls`` under its ``__name__`` and return ``"workbench.labs.notebook_classes:<name>"``.

    Args:
        cls: the class (a notebook's, or any).
        base: if given, ``cls`` must subclass it (the base the engine argument expects, e.g.
            :class:`~workbench.allocators.eviction.EvictionPolicy`).

    Raises:
        TypeError: ``cls`` is not a class, or not a ``base`` subclass.
        ValueError: its name is one of this module's own (``register``, ``registered``) or private.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register() takes a class, got {cls!r}; pass the class itself, not an instance")
    if base is not None and not issubclass(cls, base):
        raise TypeError(f"{cls.__name__} is not a {base.__name__} subclass; subclass {base.__module__}.{base.__name__}")
    name = cls.__name__
    if name.startswith("_") or name in __all__:
        raise ValueError(f"class name {name!r} is reserved here; rename the class")
    _CLASSES[name] = cls
    return f"{__name__}:{name}"


def registered() -> dict[str, type]:
    """The classes registered so far, by name (a copy)."""
    return dict(_CLASSES)


def __getattr__(name: str):  # what load_plugin's getattr(module, "<ClassName>") reaches
    try:
        return _CLASSES[name]
    except KeyError:
        raise AttributeError(
            f"no class {name!r} registered in {__name__}; run the cell that defines it and calls register()"
        ) from None
