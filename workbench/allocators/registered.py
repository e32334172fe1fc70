"""KV managers registered at run time, importable by name: ``kv_allocator="workbench.allocators.registered:Name"``.

A plug-in allocator is named ``"package.module:ClassName"`` and built by importing the module. A class defined in a
notebook cell (or a script's ``__main__``) has no module the engine can import by such a name;
:func:`register_allocator` puts it here, so that the name works wherever a ``kv_allocator`` does (``LLM``,
``lab_run``, panels, the simulator, the conformance check). The engine core is unchanged: it loads the name like any
plug-in. A name registered again (a cell run twice) points to the newest class. The module starts empty; it only
lives as long as the process (a separate process, such as ``workbench run`` from a shell, does not see it).
"""

from __future__ import annotations

import sys

from workbench.kv.interface import KVManager


def register_allocator(cls: type[KVManager], name: str | None = None) -> str:
    """Make ``cls`` loadable as ``kv_allocator="workbench.allocators.registered:<name>"`` and return that string.

    Args:
        cls: a :class:`~workbench.kv.interface.KVManager` subclass, built as ``cls(num_blocks, block_size)``.
        name: the attribute to register it under (a Python identifier; default: the class's name).

    Raises:
        TypeError: ``cls`` is not a KVManager subclass.
        ValueError: ``name`` is not an identifier, or would shadow this module's own functions.
    """
    if not (isinstance(cls, type) and issubclass(cls, KVManager)):
        raise TypeError(f"register_allocator takes a KVManager subclass, got {cls!r}")
    name = name or cls.__name__
    module = sys.modules[__name__]
    if not name.isidentifier() or name.startswith("_") or name in ("register_allocator", "KVManager", "sys"):
        raise ValueError(f"cannot register an allocator as {name!r}: give a public identifier")
    setattr(module, name, cls)
    return f"{__name__}:{name}"
