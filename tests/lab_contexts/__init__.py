"""Each exercise's context and known wrong answers, one module per chapter (``chNN.py``, as
``workbench/labs/chNN_*.py``): :data:`CONTEXTS` and :data:`WRONG` gather them, keyed by exercise id."""

import importlib
from pathlib import Path

CONTEXTS: dict = {}
WRONG: dict = {}
for _path in sorted(Path(__file__).parent.glob("ch[0-9][0-9].py")):
    _chapter = importlib.import_module(f"lab_contexts.{_path.stem}")
    CONTEXTS.update(_chapter.CONTEXTS)
    WRONG.update(_chapter.WRONG)
