"""Every chapter, run in JupyterLab in a real browser, shows no error, draws every figure with data,
and prints its tables as HTML whose numbers never wrap — at a laptop width (1366 px, file browser
open) and a wide one (``tests/review_chapters.py``; screenshots go to a temporary folder, or to
``$WORKBENCH_REVIEW_DIR`` to keep them for reading).

Skipped without Chromium or Playwright (``pytest -rs`` says which); with
``WORKBENCH_REQUIRE_BROWSER=1`` (CI sets it) it fails instead.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from browser_support import find_chromium
from review_chapters import chapters, review


@pytest.fixture(scope="module")
def reviewed(tmp_path_factory):
    pytest.importorskip("jupyterlab", reason="pip install 'workbench[lab]'")
    missing = None
    if find_chromium() is None:
        missing = "no Chromium found (apt-get install chromium, or set WORKBENCH_CHROMIUM)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            missing = "playwright is not installed (pip install playwright)"
    if missing:
        if os.environ.get("WORKBENCH_REQUIRE_BROWSER", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the browser review is required here (WORKBENCH_REQUIRE_BROWSER) but {missing}")
        pytest.skip(missing)
    out = Path(os.environ.get("WORKBENCH_REVIEW_DIR") or tmp_path_factory.mktemp("review"))
    return {r["chapter"]: r for r in review(chapters(), out)}, out


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the first test's setup reviews every chapter (about 10 minutes on 2 cores)
@pytest.mark.parametrize("chapter", chapters())
def test_chapter_in_the_browser(reviewed, chapter):
    results, out = reviewed
    r = results[chapter]
    assert r["all_ran"], f"{chapter}: cells not all run ({out / 'index.html'})"
    assert not r["errors"], r["errors"][:2]
    assert not r["empty_plots"], f"{chapter}: figures without data: {r['empty_plots']}"
    assert not r["wrapped_cells"], f"{chapter}: table cells wrap: {r['wrapped_cells'][:5]}"
    assert not r["text_tables"], f"{chapter}: tables printed as text (make them HTML): {r['text_tables'][:2]}"
    for shot in r["screenshots"]:
        assert (out / shot).stat().st_size > 20_000, shot
