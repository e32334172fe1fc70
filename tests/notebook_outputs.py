"""Compare the outputs of a notebook as a run left them with the outputs stored in ``labs/``, cell by cell, by
nbval's rules: the stored notebook's ``# NBVAL_*`` comments and tags decide which cells are compared; streams of
one name are merged (carriage returns and backspaces applied); every output's keys are flattened (``data``'s
MIME types, ``stdout``, ``ename``, ...) leaving out what nbval leaves out (metadata, tracebacks, execution counts,
widget model ids, images); each side is sanitized with ``labs/sanitize.cfg``'s patterns; the values under each
key must then be equal, in order.

The chapter review (``tests/review_chapters.py``) runs every chapter once in JupyterLab, saves it, and checks it
with :func:`compare_notebooks`: one execution gives both the browser's checks and nbval's. ``make test-nbval`` keeps
nbval itself for a kernel-only run.
"""

from __future__ import annotations

import difflib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import nbformat
from nbval.plugin import coalesce_streams, find_comment_markers, find_metadata_tags, get_sanitize_patterns

#: Output keys nbval does not compare (its ``skip_compare`` without ``--nbdime``).
SKIP_KEYS = frozenset(
    {
        "metadata",
        "traceback",
        "prompt_number",
        "output_type",
        "name",
        "execution_count",
        "application/vnd.jupyter.widget-view+json",  # model ids are random
        "image/png",
        "image/jpeg",
    }
)


@dataclass
class Mismatch:
    """One code cell whose outputs differ: ``cell`` counts code cells from 0 (as nbval's ``Cell N``)."""

    cell: int
    source: str
    key: str
    reason: str
    diff: str

    def __str__(self) -> str:
        head = "\n".join("    " + line for line in self.source.splitlines()[:6])
        return f"Cell {self.cell}: {self.reason} ({self.key!r})\n  input:\n{head}\n  diff (- stored, + this run):\n{self.diff}"


def read_patterns(sanitize_cfg: str | Path) -> list[tuple[str, str]]:
    """The ``(regex, replacement)`` pairs of an nbval sanitize file."""
    return get_sanitize_patterns(Path(sanitize_cfg).read_text())


def _options(cell) -> dict:
    opts = defaultdict(bool, find_metadata_tags(cell.metadata))
    opts.update(dict(find_comment_markers(cell.source)))
    opts.setdefault("check", True)
    return opts


def compared(cell) -> bool:
    """Whether nbval compares this stored cell's outputs (not skipped, not ``NBVAL_IGNORE_OUTPUT``, run)."""
    opts = _options(cell)
    return cell.cell_type == "code" and not opts["skip"] and bool(opts["check"]) and cell.execution_count is not None


def _sanitize(value, patterns):
    import re

    if not isinstance(value, str):
        return value
    for regex, repl in patterns:
        value = re.sub(regex, repl, value)
    return value


def flatten(outputs, patterns) -> dict[str, list]:
    """``{key: [value, ...]}`` of a cell's outputs as nbval compares them (streams merged, keys flattened)."""
    flat: dict[str, list] = defaultdict(list)
    for out in coalesce_streams([nbformat.from_dict(o) for o in outputs]):
        if out.get("output_type") == "stream":
            flat[out["name"]].append(_sanitize(out["text"], patterns))
            continue
        for key, value in out.items():
            if key in SKIP_KEYS:
                continue
            if key == "data":
                for mime, v in value.items():
                    if mime not in SKIP_KEYS:
                        flat[mime].append(_sanitize(v, patterns))
            else:
                flat[key].append(_sanitize(value, patterns))
    return dict(flat)


def _diff(stored: list, ran: list) -> str:
    a = "\n".join(map(str, stored)).splitlines()
    b = "\n".join(map(str, ran)).splitlines()
    return "\n".join(difflib.unified_diff(a, b, "stored", "this run", lineterm="", n=2)) or "(same text)"


def compare_cell(stored_cell, ran_outputs, patterns) -> tuple[str, str, str] | None:
    """``None`` when the outputs agree, else ``(key, reason, diff)`` of the first difference."""
    want, got = flatten(stored_cell.outputs, patterns), flatten(ran_outputs, patterns)
    for key in sorted(set(want) | set(got)):
        if key not in got:
            return key, "an output stored but not produced", _diff(want[key], [])
        if key not in want:
            return key, "an output produced but not stored", _diff([], got[key])
        if len(want[key]) != len(got[key]):
            return key, f"{len(want[key])} outputs stored, {len(got[key])} produced", _diff(want[key], got[key])
        for a, b in zip(want[key], got[key]):
            if a != b:
                return key, "outputs differ", _diff([a], [b])
    return None


def compare_notebooks(stored: str | Path, ran: str | Path, sanitize_cfg: str | Path) -> list[Mismatch]:
    """Every compared cell of ``stored`` whose outputs differ from the same cell of ``ran`` (the notebook as a run
    saved it); ``[]`` when all agree.

    Raises:
        ValueError: the two notebooks do not have the same code cells (a run of another version of the chapter).
    """
    patterns = read_patterns(sanitize_cfg)
    want = [c for c in nbformat.read(str(stored), as_version=4).cells if c.cell_type == "code"]
    got = [c for c in nbformat.read(str(ran), as_version=4).cells if c.cell_type == "code"]
    if [c.source for c in want] != [c.source for c in got]:
        raise ValueError(f"{ran} and {stored} have different code cells: the run is not of this version of the chapter")
    found = []
    for i, (s, r) in enumerate(zip(want, got)):
        if compared(s) and (diff := compare_cell(s, r.outputs, patterns)) is not None:
            found.append(Mismatch(i, s.source, *diff))
    return found
