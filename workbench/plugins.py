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
            f"'package.module:ClassName' of an importable {base.__name__} subclass, or a built-in name"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(
            f"{option}={name!r} is not a {base.__name__} subclass; implement {base.__module__}.{base.__name__}"
        )
    return cls
