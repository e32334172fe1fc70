"""Plug-ins named by where their class lives: ``"package.module:ClassName"`` (an engine argument such as
``kv_allocator`` accepts one besides its built-in names)."""

from __future__ import annotations

import importlib


def is_plugin_name(value) -> bool:
    """``"package.module:ClassName"``: a plug-in named by where its class lives."""
    return isinstance(value, str) and value.count(":") == 1 and all(p.strip() for p in value.split(":"))


def load_plugin(option: str, name: str, base: type) -> type:
    """The class ``name`` (``"package.module:ClassName"``) points to, checked to subclass ``base``.

    Raises:
        ValueError: the module cannot be imported, has no such class, or the class is not a ``base``
            subclass; the message names ``option=name`` and the fix.
    """
    module, _, cls_name = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"{option}={name!r}: cannot load {cls_name!r} from module {module!r} ({e}); give "
            f"'package.module:ClassName' of an importable {base.__name__} subclass (its folder on PYTHONPATH), "
            "or a built-in name"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(
            f"{option}={name!r} is not a {base.__name__} subclass; implement {base.__module__}.{base.__name__}"
        )
    return cls


# ---------------------------------------------------------------- classes defined at run time
_REGISTERED: dict[str, type] = {}


def register_class(cls: type, base: type | None = None, name: str | None = None) -> str:
    """Make a class defined at run time (a notebook cell, a script's ``__main__``) loadable by the
    ``"package.module:ClassName"`` name a plug-in engine argument takes, and return that name:
    ``"workbench.plugins:<name>"``.

    An engine argument names a plug-in by where its class lives, because the configuration is plain data (validated,
    printed, written into run folders); a class from a notebook cell lives in the kernel's ``__main__``, which no
    import can reach. Registered classes live in this module for the process's lifetime (another process, such as
    ``workbench run`` from a shell, does not see them); registering a name again (the cell edited and run again)
    replaces the class.

    Args:
        cls: the class, e.g. a :class:`~workbench.kv.interface.KVManager` or
            :class:`~workbench.kv.eviction.EvictionPolicy` subclass.
        base: if given, ``cls`` must subclass it.
        name: the name to file it under (a public identifier; default: the class's ``__name__``).

    Raises:
        TypeError: ``cls`` is not a class, or not a ``base`` subclass.
        ValueError: ``name`` is not a public identifier, or is one of this module's own names.
    """
    if not isinstance(cls, type):
        raise TypeError(f"register_class() takes a class, got {cls!r}; pass the class itself, not an instance")
    if base is not None and not issubclass(cls, base):
        raise TypeError(f"{cls.__name__} is not a {base.__name__} subclass; subclass {base.__module__}.{base.__name__}")
    name = name or cls.__name__
    if not name.isidentifier() or name.startswith("_") or name in globals():
        raise ValueError(f"cannot register a class as {name!r}: give a public identifier not used by {__name__}")
    _REGISTERED[name] = cls
    return f"{__name__}:{name}"


def registered(base: type | None = None) -> dict[str, type]:
    """The classes registered so far (subclasses of ``base`` if given), by the name each is filed under (loadable
    as ``"workbench.plugins:<name>"``)."""
    return {n: c for n, c in _REGISTERED.items() if base is None or issubclass(c, base)}


def __getattr__(name: str):  # what load_plugin's getattr(module, "<ClassName>") reaches
    try:
        return _REGISTERED[name]
    except KeyError:
        raise AttributeError(
            f"no class {name!r} registered in {__name__}; run the code that defines it and calls register_class()"
        ) from None
