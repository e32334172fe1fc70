"""What the chapter review does with a chapter's widgets after the chapter has run (all its cells, once): the
checks a learner's clicks would make. Each check takes the Playwright page of the run chapter and a screenshot
path, and returns its problems as sentences (``[]`` when all is well).

- chapter 2: the plots and the run panel rendered (its Run button, dropdowns, a slider), the chapter's text is there;
- chapter 7: a two-point grid typed into the sweep panel's boxes and Run clicked fills every heatmap with two cells;
- chapter 12: Run clicked on the panel that plugs in the learner's allocator by name starts a new run whose live
  figure holds a block map, and ends with the run's summary card.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from browser_support import CURRENT, error_texts

#: ``values(v)``: the values of a plotly data array, flattened: nested arrays, or typed arrays (plotly decodes the
#: base64 arrays of numpy data into those, which have no ``flat``); null, undefined and NaN left out.
_VALUES_JS = """const values = v => {
    const out = [];
    const walk = x => {
        if (x === null || x === undefined) return;
        if (typeof x === 'object' && typeof x.length === 'number') { for (let i = 0; i < x.length; i++) walk(x[i]); }
        else if (!Number.isNaN(x)) out.push(x);
    };
    walk(v);
    return out;
};"""


def _plot_cells_filled(page) -> list[int]:
    """Per heatmap on the page: how many of its cells hold a value (plotly's own data on the graph div)."""
    return page.evaluate(
        "() => {" + _VALUES_JS + """
            return Array.from(document.querySelectorAll('.js-plotly-plot'))
                .filter(el => el.data && el.data.length && el.data[0].type === 'heatmap')
                .map(el => values(el.data[0].z).length); }"""
    )


def _live_plot_filled(page) -> dict[str, int]:
    """Over the page's plotly graphs: filled block-map cells (heatmap values) and plotted points (the other traces)."""
    return page.evaluate(
        "() => {" + _VALUES_JS + """
            let cells = 0, points = 0;
            for (const el of document.querySelectorAll('.js-plotly-plot')) {
                for (const t of (el.data || [])) {
                    if (t.type === 'heatmap') cells += values(t.z).length;
                    else points += values(t.y).length;
                }
            }
            return {cells, points};
        }"""
    )


def _notebook_text(page) -> str:
    return page.locator(f"{CURRENT} .jp-Notebook").inner_text()


def _run_button(page):
    return page.locator(f"{CURRENT} .jupyter-widgets button", has_text="Run").first


def chapter2_panel(page, shot: Path) -> list[str]:
    found = []
    n_plots = page.locator(f"{CURRENT} .js-plotly-plot").count()
    if n_plots < 3:
        found.append(f"{n_plots} plotly figures rendered, expected at least 3")
    for what, sel in (
        ("a Run button", ".jupyter-widgets button"),
        ("a dropdown (kv_allocator / block_size)", ".jupyter-widgets select"),
        ("a slider", ".widget-slider"),
    ):
        if page.locator(f"{CURRENT} {sel}").count() < 1:
            found.append(f"the run panel shows no {what}")
    text = _notebook_text(page)
    found += [f"the chapter's text lacks {t!r}" for t in ("token states", "vLLM paper Fig. 2") if t not in text]
    _run_button(page).scroll_into_view_if_needed()
    page.screenshot(path=str(shot))
    return found


def chapter7_sweep(page, shot: Path, timeout_s: float = 300) -> list[str]:
    boxes = page.locator(f"{CURRENT} .jupyter-widgets.widget-text input")
    if boxes.count() != 2:
        return [f"the sweep panel has {boxes.count()} text boxes, expected 2 (utilization, max_num_seqs)"]
    boxes.nth(0).fill("0.9")
    boxes.nth(1).fill("4, 8")
    boxes.nth(1).press("Enter")
    _run_button(page).click()
    deadline = time.time() + timeout_s
    filled: list[int] = []
    text = ""
    while time.time() < deadline:
        filled = _plot_cells_filled(page)
        text = _notebook_text(page)
        # throughput, TTFT, KV utilization, preemptions, fragmentation: 2 cells each, and the panel says so
        if len(filled) >= 5 and all(n == 2 for n in filled[:5]) and "2 of 2 run(s) done" in text:
            break
        if error_texts(page):
            return [f"an error after Run: {error_texts(page)[0][:300]}"]
        time.sleep(1)
    _run_button(page).scroll_into_view_if_needed()
    page.screenshot(path=str(shot))
    found = []
    if not (len(filled) >= 5 and all(n == 2 for n in filled[:5])):
        found.append(f"after Run on a two-point grid the heatmaps hold {filled[:5]} cells, expected 2 each ({shot.name})")
    found += [f"the panel does not say {t!r}" for t in ("2 of 2 run(s) done", "runs 2/2") if t not in text]
    return found


#: Records, in the page, whether the status line of the chapter's run panel said "running" since it was installed.
_WATCH_STATUS = """() => {
    window.__wbRunning = false;
    const obs = new MutationObserver(() => {
        for (const el of document.querySelectorAll('.widget-html code')) {
            if (el.textContent.includes('running')) window.__wbRunning = true;
        }
    });
    obs.observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def chapter12_panel(page, shot: Path, timeout_s: float = 300) -> list[str]:
    text = _notebook_text(page)
    found = [f"the chapter's text lacks {t!r}" for t in ("PASSED 40 random schedules", "workbench.plugins:") if t not in text]
    dropdown = page.locator(f"{CURRENT} .jupyter-widgets select").first
    if "workbench.plugins:" not in dropdown.input_value():
        found.append(f"the panel's allocator is {dropdown.input_value()!r}, not the plug-in by name")
    page.evaluate(_WATCH_STATUS)
    _run_button(page).click()
    deadline = time.time() + timeout_s
    ran = False
    status = _run_button(page).locator("xpath=..").locator(".widget-html").first  # the line beside Run
    while time.time() < deadline:
        ran = page.evaluate("() => window.__wbRunning")
        line = status.inner_text()
        if ran and "run: workbench.plugins:" in line and "running" not in line:
            break
        if error_texts(page):
            return found + [f"an error after Run: {error_texts(page)[0][:300]}"]
        time.sleep(0.5)
    filled = _live_plot_filled(page)
    _run_button(page).scroll_into_view_if_needed()
    page.screenshot(path=str(shot))
    if not ran:
        found.append("Run was clicked but the panel never said it was running")
    if not (filled["cells"] >= 24 and filled["points"] > 0):
        found.append(f"the live figure holds {filled} after the run ({shot.name})")
    return found


#: The widget check of each chapter that has one, by notebook name.
WIDGET_CHECKS: dict[str, Callable[[object, Path], list[str]]] = {
    "02_fragmentation_live.ipynb": chapter2_panel,
    "07_parameter_matrix.ipynb": chapter7_sweep,
    "12_your_own_allocator.ipynb": chapter12_panel,
}
