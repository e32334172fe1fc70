"""The chapter review's output comparison (``tests/notebook_outputs.py``) follows nbval's rules: a stored output
edited by hand is caught with its cell and a diff; times and addresses are sanitized; ``NBVAL_IGNORE_OUTPUT`` cells
and widget model ids are not compared; streams of one name are merged."""

from __future__ import annotations

import copy
from pathlib import Path

import nbformat
import pytest
from notebook_outputs import compare_notebooks, compared, flatten, read_patterns

LABS = Path(__file__).resolve().parents[1] / "labs"
SANITIZE = LABS / "sanitize.cfg"
CHAPTER = LABS / "01_kv_cache_anatomy.ipynb"


def _write(nb, path: Path) -> Path:
    nbformat.write(nb, str(path))
    return path


def _first_compared_with(nb, output_type: str):
    for i, c in enumerate(c for c in nb.cells if c.cell_type == "code"):
        if compared(c) and any(o.output_type == output_type for o in c.outputs):
            return i, c
    raise AssertionError(f"{CHAPTER.name} has no compared cell with a {output_type} output")


def test_a_stored_notebook_agrees_with_itself():
    assert compare_notebooks(CHAPTER, CHAPTER, SANITIZE) == []


def test_an_output_edited_by_hand_is_caught_with_its_cell_and_the_diff(tmp_path):
    nb = nbformat.read(str(CHAPTER), as_version=4)
    i, cell = _first_compared_with(nb, "stream")
    out = next(o for o in cell.outputs if o.output_type == "stream")
    first_line = out.text.splitlines()[0]
    out.text = out.text.replace(first_line, first_line + " (edited)", 1)
    found = compare_notebooks(_write(nb, tmp_path / "edited.ipynb"), CHAPTER, SANITIZE)
    assert len(found) == 1 and found[0].cell == i and found[0].key == "stdout"
    text = str(found[0])
    assert f"Cell {i}:" in text and cell.source.splitlines()[0] in text
    assert f"-{first_line} (edited)" in text and f"+{first_line}" in text


def test_times_and_addresses_are_sanitized_and_ignored_cells_not_compared(tmp_path):
    nb = nbformat.read(str(CHAPTER), as_version=4)
    ran = copy.deepcopy(nb)
    code = [c for c in ran.cells if c.cell_type == "code"]
    ignored = next(c for c in code if not compared(c))
    ignored.outputs = [nbformat.v4.new_output("stream", name="stdout", text="anything at all\n")]
    i, cell = _first_compared_with(ran, "stream")
    nb_cell = [c for c in nb.cells if c.cell_type == "code"][i]
    nb_cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="took 1.5 s at 0xdeadbeef\n")]
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="took 12,345.67 ms at 0x10\n")]
    assert compare_notebooks(_write(nb, tmp_path / "a.ipynb"), _write(ran, tmp_path / "b.ipynb"), SANITIZE) == []


def test_streams_merge_and_widget_ids_are_skipped():
    patterns = read_patterns(SANITIZE)
    split = [
        {"output_type": "stream", "name": "stdout", "text": "a\n"},
        {"output_type": "display_data", "metadata": {}, "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "x"}, "text/plain": "W"}},
        {"output_type": "stream", "name": "stdout", "text": "b\n"},
    ]
    whole = [
        {"output_type": "stream", "name": "stdout", "text": "a\nb\n"},
        {"output_type": "display_data", "metadata": {}, "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "y"}, "text/plain": "W"}},
    ]
    assert flatten(split, patterns) == flatten(whole, patterns) == {"stdout": ["a\nb\n"], "text/plain": ["W"]}


def test_a_run_of_another_version_of_the_chapter_is_refused(tmp_path):
    nb = nbformat.read(str(CHAPTER), as_version=4)
    next(c for c in nb.cells if c.cell_type == "code").source += "\nx = 1"
    with pytest.raises(ValueError, match="different code cells"):
        compare_notebooks(CHAPTER, _write(nb, tmp_path / "other.ipynb"), SANITIZE)
