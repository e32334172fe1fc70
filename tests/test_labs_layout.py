"""One module per chapter: ``labs/NN_name.ipynb`` imports ``workbench.labs.chNN_name``, that module holds the
chapter's exercises (and no other chapter's), and no chapter's module imports another chapter's (what
chapters share lives in ``runs``, ``panel``, ``multigpu_common``, ``exercise_registry``)."""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

from workbench.labs import exercise_registry

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "workbench" / "labs"
NOTEBOOKS = sorted((ROOT / "labs").glob("[0-9][0-9]_*.ipynb"))


def test_every_notebook_has_its_chapter_module():
    assert len(NOTEBOOKS) == 19
    for nb in NOTEBOOKS:
        assert (LABS / f"ch{nb.stem}.py").exists(), f"{nb.name} has no workbench/labs/ch{nb.stem}.py"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebook_imports_its_own_chapter_module_and_no_other(nb):
    code = "\n".join("".join(c["source"]) for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")
    chapters = set(re.findall(r"\bch(\d\d)_\w+", code))
    assert chapters == {nb.stem[:2]}, f"{nb.name} uses the modules of chapters {sorted(chapters)}"


@pytest.mark.parametrize("path", sorted(LABS.glob("ch[0-9][0-9]_*.py")), ids=lambda p: p.stem)
def test_a_chapter_module_imports_no_other_chapter(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            others = [n for n in names if re.search(r"\bch\d\d_", n) and path.stem not in n]
            assert not others, f"{path.name} imports {others}"


def test_each_chapter_module_registers_exactly_its_own_exercises():
    exercises = exercise_registry.load_all()
    assert len(exercises) >= 18
    for eid, ex in exercises.items():
        chapter = int(eid.split(".")[0])
        module = importlib.import_module(ex.solution.__module__)
        assert module.__name__ == exercise_registry.chapter_module(chapter), (eid, module.__name__)
    for path in LABS.glob("ch[0-9][0-9]_*.py"):
        assert any(k.split(".")[0] == str(int(path.stem[2:4])) for k in exercises), f"{path.name} has no exercise"
