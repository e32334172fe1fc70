"""Every chapter, run once in JupyterLab in a real browser: no error, every figure drawn with data, tables printed as
HTML whose numbers never wrap at a laptop width (1366 px, file browser open) and a wide one; the notebook as that run
saved it has the outputs stored in ``labs/`` (nbval's rules, ``labs/sanitize.cfg``: a mismatch prints the cell and
the diff); and chapters 2, 7 and 12 answer their widgets' clicks (``tests/chapter_widgets.py``). One test per
chapter (``-k 07`` runs one); screenshots and the saved notebooks go to a temporary folder, or to
``$WORKBENCH_REVIEW_DIR`` to keep them for reading.

Skipped without Chromium or Playwright (``pytest -rs`` says which); with ``WORKBENCH_REQUIRE_BROWSER=1`` (CI sets
it) it fails instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser_support import browser_or_skip
from review_chapters import Reviewer, chapters

pytestmark = [pytest.mark.slow, pytest.mark.notebook, pytest.mark.browser]


@pytest.fixture(scope="module")
def reviewer(tmp_path_factory):
    pytest.importorskip("jupyterlab", reason="pip install 'workbench[lab]'")
    browser_or_skip()
    out = Path(os.environ.get("WORKBENCH_REVIEW_DIR") or tmp_path_factory.mktemp("review"))
    with Reviewer(out, timeout_s=600) as r:
        yield r


@pytest.mark.timeout(900)
@pytest.mark.parametrize("chapter", chapters())
def test_chapter_runs_once_in_the_browser_with_its_stored_outputs(reviewer, chapter):
    r = reviewer.review_chapter(chapter)
    out = reviewer.out
    assert r["all_ran"], f"{chapter}: cells not all run after {r['attempts']} attempt(s) (see {out})"
    assert not r["errors"], r["errors"][:2]
    assert not r["output_mismatches"], f"{chapter}: outputs differ from the stored ones\n" + "\n\n".join(
        r["output_mismatches"]
    )
    assert not r["empty_plots"], f"{chapter}: figures without data: {r['empty_plots']}"
    assert not r["wrapped_cells"], f"{chapter}: table cells wrap: {r['wrapped_cells'][:5]}"
    assert not r["text_tables"], f"{chapter}: tables printed as text (make them HTML): {r['text_tables'][:2]}"
    assert not r["widget_problems"], f"{chapter}: {r['widget_problems']}"
    for shot in r["screenshots"]:
        assert (out / shot).stat().st_size > 20_000, shot
