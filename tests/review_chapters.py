"""The visual review loop and the chapters' proof in ``make test``: every chapter opened in JupyterLab in a headless
Chromium, run once, checked, photographed at a laptop width (1366 px, file browser open) and a wide one, saved, and
its outputs compared with the ones stored in ``labs/`` as nbval compares them (``tests/notebook_outputs.py``).

    python tests/review_chapters.py --out runs/review                 # every chapter
    python tests/review_chapters.py --out runs/review --chapter 02 --chapter 07

Writes ``<out>/<chapter>-<width>.png`` (the whole notebook, not just the first screen), ``<out>/<chapter>`` (the
notebook as this run saved it), ``<out>/review.json`` (per chapter: cells run, error outputs, plotly figures and
those without data, HTML table cells that wrap, plain-text tables, cells whose outputs differ from the stored ones,
what the chapter's widget check found) and ``<out>/index.html`` (the screenshots side by side, with the problems
found) to look at before calling a chapter done. ``tests/test_chapter_review.py`` runs it in ``make test``, one
test per chapter, and asserts what can be asserted; reading the screenshots is a person's job. Exits 1 when a
check fails.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parent))

from browser_support import (  # noqa: E402  (tests/ is not a package)
    CHROMIUM_FLAGS,
    REPO,
    empty_plots,
    error_texts,
    find_chromium,
    full_notebook_screenshot,
    jupyterlab,
    open_notebook,
    run_all_cells,
    save_notebook,
    show_file_browser,
    shutdown_kernels,
    text_tables,
    wrapped_table_cells,
)
from chapter_widgets import WIDGET_CHECKS  # noqa: E402
from notebook_outputs import compare_notebooks  # noqa: E402

# the stored outputs were made in float32 on every CPU (tests/conftest.py): the chapters' kernels inherit this
os.environ.setdefault("WORKBENCH_CPU_BFLOAT16", "0")

LAPTOP_WIDTH, WIDE_WIDTH = 1366, 1920
SANITIZE = REPO / "labs" / "sanitize.cfg"


def chapters(selected: tuple[str, ...] = ()) -> list[str]:
    """Notebook names in ``labs/``, all or those whose name starts with one of ``selected`` (e.g. ``"07"``)."""
    names = sorted(p.name for p in (REPO / "labs").glob("[0-9][0-9]_*.ipynb"))
    if selected:
        names = [n for n in names if any(n.startswith(s) for s in selected)]
        if not names:
            raise click.BadParameter(f"no chapter starts with {', '.join(selected)}; see labs/")
    return names


def problems(result: dict) -> list[str]:
    """What a chapter's review found wrong, as sentences (empty when it passed)."""
    out = []
    if not result["all_ran"]:
        out.append(f"cells not all run (after {result['attempts']} attempt(s))")
    out += [f"error output: {e[:300]}" for e in result["errors"]]
    if result["num_plots"] and result["empty_plots"]:
        out.append(f"plotly figures without data: {result['empty_plots']}")
    out += [f"table cell wraps: {c!r}" for c in result["wrapped_cells"]]
    out += [f"text table (make it HTML): {t[:120]!r}" for t in result["text_tables"]]
    out += [f"stored output differs: {m}" for m in result["output_mismatches"]]
    out += [f"widget check: {p}" for p in result["widget_problems"]]
    return out


class Reviewer:
    """JupyterLab over a cleared copy of ``labs/`` and a headless Chromium, started once (a context manager) and
    used for one chapter after another (:meth:`review_chapter`); everything it started is stopped on leaving.

    Raises:
        RuntimeError: (on entering) no Chromium or no Playwright (the message says how to install them).
    """

    def __init__(self, out: Path, widths=(LAPTOP_WIDTH, WIDE_WIDTH), timeout_s: float = 900) -> None:
        self.out, self.widths, self.timeout_s = Path(out), tuple(widths), timeout_s
        self._stack = ExitStack()

    def __enter__(self) -> Reviewer:
        chromium = find_chromium()
        if chromium is None:
            raise RuntimeError("no Chromium found: apt-get install chromium, or set WORKBENCH_CHROMIUM")
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            raise RuntimeError("playwright is not installed: pip install playwright") from None
        self.out.mkdir(parents=True, exist_ok=True)
        try:
            tmp = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="workbench-review-")))
            self.base, self.token, self.root = self._stack.enter_context(jupyterlab(tmp))
            p = self._stack.enter_context(sync_playwright())
            self.browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
            self._stack.callback(self.browser.close)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def review_chapter(self, name: str) -> dict:
        """Run one chapter once in the browser; check it, photograph it at each width, save it and compare its
        outputs with the stored ones; then its widget check (:data:`chapter_widgets.WIDGET_CHECKS`), if any."""
        t0 = time.time()
        page = self.browser.new_page(viewport={"width": self.widths[0], "height": 900})
        console_errors: list[str] = []
        page.on("pageerror", lambda e: console_errors.append(str(e)))
        try:
            open_notebook(page, self.base, self.token, name)
            show_file_browser(page)
            ran, attempts = run_all_cells(page, self.timeout_s)
            run_s = time.time() - t0
            page.wait_for_timeout(1000)  # the last figures draw
            result = {
                "chapter": name,
                "all_ran": ran,
                "attempts": attempts,
                "run_seconds": round(run_s, 1),
                "errors": error_texts(page),
                "num_plots": page.locator(".js-plotly-plot").count(),
                "empty_plots": empty_plots(page),
                "wrapped_cells": [],
                "text_tables": text_tables(page),
                "screenshots": [],
                "output_mismatches": [],
                "widget_problems": [],
            }
            saved = self.out / name
            if ran and not result["errors"]:
                save_notebook(page)
                shutil.copyfile(self.root / name, saved)
                result["output_mismatches"] = [str(m) for m in compare_notebooks(REPO / "labs" / name, saved, SANITIZE)]
            stem = name.removesuffix(".ipynb")
            for w in self.widths:
                shot = self.out / f"{stem}-{w}.png"
                full_notebook_screenshot(page, shot, w)
                # wrapping depends on the width: check at each
                result["wrapped_cells"] += [c for c in wrapped_table_cells(page) if c not in result["wrapped_cells"]]
                result["screenshots"].append(shot.name)
            check = WIDGET_CHECKS.get(name)
            if check is not None and ran and not result["errors"]:
                page.set_viewport_size({"width": LAPTOP_WIDTH, "height": 1100})
                result["widget_problems"] = check(page, self.out / f"{stem}-widget.png")
            widget_errors = [e for e in console_errors if "plotly" in e.lower() or "widget" in e.lower()]
            result["widget_problems"] += [f"browser console: {e[:300]}" for e in widget_errors]
        finally:
            page.close()
            shutdown_kernels(self.base, self.token)  # the next chapter starts its own
        result["seconds"] = round(time.time() - t0, 1)
        result["problems"] = problems(result)
        return result


def write_index(out: Path, results: list[dict]) -> None:
    rows = []
    for r in results:
        issues = "".join(f"<li><pre>{html.escape(p)}</pre></li>" for p in r["problems"]) or "<li>no problem found</li>"
        shots = "".join(
            f'<a href="{s}"><img src="{s}" style="width:{96 // len(r["screenshots"])}%;vertical-align:top"></a>'
            for s in r["screenshots"]
        )
        rows.append(f"<h2>{html.escape(r['chapter'])} ({r['seconds']} s)</h2><ul>{issues}</ul>{shots}")
    (out / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>chapter review</title>"
        "<body style='font-family:sans-serif'>" + "".join(rows) + "</body>"
    )


def review(names: list[str], out: Path, widths=(LAPTOP_WIDTH, WIDE_WIDTH), timeout_s: float = 900) -> list[dict]:
    """Review ``names`` (notebooks in ``labs/``) into ``out``; returns one result per chapter.

    Raises:
        RuntimeError: no Chromium or no Playwright (say how to install them).
    """
    results = []
    with Reviewer(out, widths, timeout_s) as reviewer:
        for name in names:
            results.append(reviewer.review_chapter(name))
            (out / "review.json").write_text(json.dumps(results, indent=1))
            write_index(out, results)
    return results


@click.command()
@click.option("--out", type=click.Path(path_type=Path), default=Path("runs/review"), show_default=True)
@click.option("--chapter", "selected", multiple=True, help="a chapter's number (02) or name prefix; repeatable")
@click.option("--width", "widths", multiple=True, type=int, help="viewport widths in px [default: 1366 and 1920]")
@click.option("--timeout", "timeout_s", default=900.0, show_default=True, help="seconds one chapter may run")
def main(out: Path, selected: tuple[str, ...], widths: tuple[int, ...], timeout_s: float) -> None:
    """Run every chapter once in a real browser, check it, compare its outputs with the stored ones, and save
    full-notebook screenshots."""
    results = review(chapters(selected), out, widths or (LAPTOP_WIDTH, WIDE_WIDTH), timeout_s)
    bad = 0
    for r in results:
        click.echo(
            f"{r['chapter']:<34} {r['seconds']:>6.1f} s (cells {r['run_seconds']:>6.1f} s)  {r['num_plots']:>2} figures  "
            + ("ok" if not r["problems"] else f"{len(r['problems'])} problem(s)")
        )
        for p in r["problems"]:
            click.echo(f"    - {p}")
        bad += bool(r["problems"])
    click.echo(f"screenshots and index: {out / 'index.html'}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
