"""Memory sizes written by people: ``"2GiB"``, ``"80GB"``, ``"24e9"``, ``"512 MiB"``, ``1024`` -> bytes.

The one size parser of the project (bottom layer: no click, no torch). The CLI's byte options
(``--device-memory``, ``--kv-cache-memory-bytes``, ``--nccl-buffsize``) and ``workbench kv-calc`` /
``workbench simulate`` sizes all go through :func:`parse_size`.
"""

from __future__ import annotations

import re

#: unit suffix (lower case) -> bytes; binary ``KiB``/``MiB``/``GiB``/``TiB``, decimal ``k``/``KB``/``M``/``G``/``T``
SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}  # fmt: skip

SIZE_FORMS = "80GiB (2**30 bytes each), 80GB or 80G (10**9), 24e9, 512MiB or a plain number of bytes"

_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: str | int | float, allow_zero: bool = False) -> int:
    """A memory size -> bytes: ``"80GiB"`` (binary), ``"80GB"`` / ``"1.5G"`` (decimal), ``"24e9"``,
    ``"512 MiB"``, ``"1000"``, ``1024``; units are case-insensitive.

    Raises:
        ValueError: not a size, or negative (or zero unless ``allow_zero``); names the value and the accepted forms.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = float(value)
    else:
        m = _SIZE.fullmatch(str(value))
        if not m or m.group(2).lower() not in SIZE_UNITS:
            raise ValueError(f"{value!r} is not a memory size; write e.g. {SIZE_FORMS}")
        n = float(m.group(1)) * SIZE_UNITS[m.group(2).lower()]
    if not (n >= 0 if allow_zero else n > 0):
        raise ValueError(
            f"memory size {value!r} must be {'>= 0' if allow_zero else 'positive'}; write e.g. {SIZE_FORMS}"
        )
    return int(n)
