"""What the real-browser tests and the chapter review share: JupyterLab on loopback over a copy of
``labs/`` (outputs cleared, the news prompt off, every cell in the DOM), a headless Chromium driven
by Playwright, and the page checks (error outputs, plotly traces, wrapped table cells).

Chromium is Debian's ``chromium`` (``apt-get install chromium``) or ``$WORKBENCH_CHROMIUM``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]


def find_chromium() -> str | None:
    """Path of a Chromium binary (``$WORKBENCH_CHROMIUM``, ``chromium``, ``chromium-browser``), or ``None``."""
    for c in (os.environ.get("WORKBENCH_CHROMIUM"), shutil.which("chromium"), shutil.which("chromium-browser")):
        if c and Path(c).exists():
            return c
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_labs(dest: Path) -> Path:
    """A copy of ``labs/`` whose notebooks have no stored outputs (the browser sees only what it runs)."""
    shutil.copytree(REPO / "labs", dest)
    for path in dest.glob("*.ipynb"):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                cell["outputs"], cell["execution_count"] = [], None
        path.write_text(json.dumps(nb, indent=1))
    return dest


@contextlib.contextmanager
def jupyterlab(workdir: Path) -> Iterator[tuple[str, str, Path]]:
    """Start JupyterLab on 127.0.0.1 over a cleared copy of ``labs/`` in ``workdir``; yield
    ``(base url, token, notebooks folder)``; stop it by its PID on leaving, also on failure."""
    root = copy_labs(workdir / "labs")
    # every cell in the DOM (JupyterLab 4 virtualises off-screen cells by default), no news prompt
    settings = workdir / "settings" / "@jupyterlab"
    (settings / "notebook-extension").mkdir(parents=True)
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text('{"windowingMode": "none"}')
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    port, token = free_port(), "workbench-browser-test"
    env = os.environ | {"JUPYTER_CONFIG_DIR": str(workdir / "cfg"), "JUPYTER_RUNTIME_DIR": str(workdir / "rt")}
    log = workdir / "jupyterlab.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                f"--port={port}",
                "--ip=127.0.0.1",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root}",
                f"--LabApp.user_settings_dir={workdir / 'settings'}",
                "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands without menus
                "--allow-root",
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError("JupyterLab exited: " + log.read_text()[-2000:]) from None
                time.sleep(1)
        yield base, token, root
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen) -> None:
    """Stop a process we started, by its PID: SIGTERM, then SIGKILL after 20 s."""
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def error_texts(page) -> list[str]:
    """Texts of error outputs (tracebacks) on the page."""
    errors = page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
    return [t for t in errors.all_inner_texts() if "Traceback" in t or "Error" in t]


#: The notebook on screen (JupyterLab keeps other, hidden panels in the DOM).
CURRENT = ".jp-NotebookPanel:not(.lm-mod-hidden)"


def open_notebook(page, base: str, token: str, name: str) -> None:
    """Open ``name`` alone, in a fresh workspace of its own (so no earlier notebook is restored
    beside it), and wait until its kernel is idle."""
    workspace = "review-" + "".join(c if c.isalnum() else "-" for c in Path(name).stem)
    page.goto(f"{base}/lab/workspaces/{workspace}/tree/{name}?reset&token={token}", timeout=120_000)
    page.wait_for_selector(f"{CURRENT} .jp-Notebook .jp-Cell", timeout=120_000)
    # The status indicator reads "idle" before any kernel exists; with the app exposed, wait for the
    # notebook's own session: ready, its kernel connected and idle (cells run before that are dropped).
    if page.evaluate("() => !!window.jupyterapp"):
        page.wait_for_function(KERNEL_READY, timeout=180_000, polling=500)
    page.wait_for_selector(f"{CURRENT} .jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=180_000)


#: True once the notebook on screen has a ready session whose kernel is connected and idle.
KERNEL_READY = """() => {
    const w = window.jupyterapp.shell.currentWidget;
    const sc = w && w.sessionContext;
    const k = sc && sc.session && sc.session.kernel;
    return !!(sc && sc.isReady && k && k.connectionStatus === 'connected' && k.status === 'idle');
}"""


def save_notebook(page, timeout_s: float = 60) -> None:
    """File > Save on the notebook on screen (through the app's command registry), and wait until its model is no
    longer dirty: the file on disk then holds the outputs this run produced.

    Raises:
        RuntimeError: the app is not exposed, or the notebook is still unsaved after ``timeout_s``.
    """
    if not page.evaluate("() => !!window.jupyterapp"):
        raise RuntimeError("JupyterLab was started without --LabApp.expose_app_in_browser: cannot save from a test")
    page.evaluate("async () => { await window.jupyterapp.commands.execute('docmanager:save'); }")
    try:
        page.wait_for_function(
            "() => { const w = window.jupyterapp.shell.currentWidget;"
            " return !!(w && w.context && !w.context.model.dirty); }",
            timeout=timeout_s * 1000,
            polling=250,
        )
    except Exception as e:  # playwright's TimeoutError: say what did not happen
        raise RuntimeError(f"the notebook was not saved within {timeout_s} s") from e


def shutdown_kernels(base: str, token: str) -> int:
    """Shut down every kernel of the server through its REST API (no dialog); returns how many."""
    with urllib.request.urlopen(f"{base}/api/kernels?token={token}", timeout=10) as r:
        kernels = json.load(r)
    for k in kernels:
        req = urllib.request.Request(f"{base}/api/kernels/{k['id']}?token={token}", method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()
    return len(kernels)


def cell_prompts(page) -> list[str]:
    return [t.strip() for t in page.locator(f"{CURRENT} .jp-CodeCell .jp-InputPrompt").all_inner_texts()]


def _run_all_command(page) -> None:
    """Run > Run All Cells on the notebook on screen: through the app's command registry when the
    app is exposed (no menu to hit under load), else through the menus."""
    if page.evaluate("() => !!window.jupyterapp"):
        # not awaited: the command's promise settles only when every cell has run (never, if dropped)
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        return
    page.keyboard.press("Escape")  # a dialog or menu left open
    page.locator(f"{CURRENT} .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def all_ran(prompts: list[str]) -> bool:
    return bool(prompts) and all(t not in ("[*]:", "[ ]:", "") for t in prompts)


def run_all_cells(page, timeout_s: float = 600) -> tuple[bool, int]:
    """Run > Run All Cells, and wait until every code cell shows an execution count.

    A kernel that is still connecting can drop the queued cells (they end as ``[ ]`` with the kernel
    idle, nothing run); then the command is given again, at most 3 times. Returns ``(all cells ran,
    attempts)``; stops early when a cell raised (see :func:`error_texts`).
    """
    deadline = time.time() + timeout_s
    tries = 0
    for tries in range(1, 4):  # noqa: B007  (returned)
        _run_all_command(page)
        started = time.time()
        idle_since = None
        dropped = False
        while time.time() < deadline:
            prompts = cell_prompts(page)
            if all_ran(prompts):
                return True, tries
            idle = page.locator(f"{CURRENT} .jp-Notebook-ExecutionIndicator[data-status='idle']").count() > 0
            idle_since = (idle_since or time.time()) if idle else None
            if idle and "[*]:" not in prompts and time.time() - started > 20:
                dropped = True  # nothing running, cells not run: an error stopped it, or it was dropped
                break
            if idle_since and time.time() - idle_since > 45:
                dropped = True  # cells queued ([*]) but the kernel idle for 45 s: the requests were lost
                break
            time.sleep(2)
        if not dropped or error_texts(page):
            break
    return all_ran(cell_prompts(page)), tries


def empty_plots(page) -> list[int]:
    """Indexes of the plotly figures on the page that have no trace, or only traces without data."""
    return page.evaluate(
        """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map((el, i) => {
              const data = el.data || [];
              const has = data.some(t => ['x', 'y', 'z', 'values', 'cells', 'header']
                  .some(k => t[k] !== undefined && t[k] !== null && (t[k].length === undefined || t[k].length > 0)));
              return has ? -1 : i;
           }).filter(i => i >= 0)"""
    )


def wrapped_table_cells(page) -> list[str]:
    """Texts of HTML table cells in outputs whose content wraps onto a second line (a number split in
    two). Headers and prose cells (``wb-prose``: sentences) are made to wrap between words, so they
    are not counted."""
    return page.evaluate(
        """() => Array.from(document.querySelectorAll('.jp-OutputArea-output table td:not(.wb-prose)'))
              .filter(c => {
                  const text = c.innerText.trim();
                  if (!text) return false;
                  const lh = parseFloat(getComputedStyle(c).lineHeight) || 1.2 * parseFloat(getComputedStyle(c).fontSize);
                  const r = document.createRange(); r.selectNodeContents(c);
                  const lines = new Set(Array.from(r.getClientRects()).map(q => Math.round(q.top)));
                  return lines.size > 1 && /\\d/.test(text);
              }).map(c => c.innerText.trim()).slice(0, 20)"""
    )


def text_tables(page) -> list[str]:
    """Plain-text outputs that look like aligned tables (three or more lines with runs of spaces
    between columns): tables must be HTML, so that numbers never wrap."""
    return page.evaluate(
        """() => Array.from(document.querySelectorAll(
                '.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stdout"], ' +
                '.jp-OutputArea-output[data-mime-type="text/plain"]'))
              .map(el => el.innerText)
              .filter(t => t.split('\\n').filter(l => /\\S {2,}\\S+ {2,}\\S/.test(l)).length >= 3)
              .map(t => t.slice(0, 200))"""
    )


def show_file_browser(page) -> None:
    """Open the left sidebar's file browser (as a learner's JupyterLab has it)."""
    if page.locator("#filebrowser").is_visible():
        return
    tab = page.locator(".jp-SideBar [data-id='filebrowser']")
    if tab.count():
        tab.first.click()
        page.locator("#filebrowser").wait_for(state="visible", timeout=10_000)


def full_notebook_screenshot(page, path: Path, width: int, max_height: int = 30_000) -> None:
    """A screenshot of the whole notebook at ``width`` px: the viewport is made as tall as the
    notebook's scrolled content (up to ``max_height``), so nothing is cut off at the fold."""
    page.set_viewport_size({"width": width, "height": 900})
    page.wait_for_timeout(500)
    content = page.evaluate(
        """() => Math.max(...Array.from(document.querySelectorAll(
                '.jp-NotebookPanel .jp-WindowedPanel-outer, .jp-NotebookPanel .jp-Notebook'))
              .map(el => el.scrollHeight), 0)"""
    )
    height = min(max_height, max(900, int(content) + 200))
    page.set_viewport_size({"width": width, "height": height})
    page.wait_for_timeout(1500)  # plotly relayouts to the new size
    page.evaluate(
        """() => document.querySelectorAll('.jp-NotebookPanel .jp-WindowedPanel-outer, .jp-NotebookPanel .jp-Notebook')
              .forEach(el => { el.scrollTop = 0; })"""
    )
    page.wait_for_timeout(300)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))


_PLOT_PARTS_JS = """
() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(div => {
  const box = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
  const svg = div.querySelector('svg.main-svg').getBoundingClientRect();
  const size = div._fullLayout._size;  // the plot area, in px from the figure's top left corner
  const out = {
    title: (div.querySelector('.g-gtitle text') || {}).textContent || '',
    svg: [svg.left, svg.top, svg.right, svg.bottom],
    plot: [svg.left + size.l, svg.top + size.t, svg.left + size.l + size.w, svg.top + size.t + size.h],
    parts: {},
    y2ticks: Array.from(div.querySelectorAll('.y2tick text')).map(box),
  };
  for (const [name, sel] of [['title', '.g-gtitle'], ['x title', '.g-xtitle'], ['y title', '.g-ytitle'],
                             ['right-axis title', '.g-y2title'], ['legend', '.legend']]) {
    const e = div.querySelector(sel);
    if (e && e.getBBox && e.getBBox().width > 0) out.parts[name] = box(e);
  }
  return out;
})
"""


def plot_layout_problems(page, tolerance: float = 1.0) -> list[str]:
    """What a reader would see cut or covered in the page's plotly figures (rendered, in the browser):
    a title, axis title or legend outside its figure; a right-axis title longer than the plot area
    (it runs into the legend and the tick labels); the legend over the figure's title, the right-axis
    title or a right-axis tick label. ``[]`` when every figure is clean."""

    def outside(a, b):
        return a[0] < b[0] - tolerance or a[1] < b[1] - tolerance or a[2] > b[2] + tolerance or a[3] > b[3] + tolerance

    def overlap(a, b):
        return min(a[2], b[2]) - max(a[0], b[0]) > tolerance and min(a[3], b[3]) - max(a[1], b[1]) > tolerance

    problems = []
    for fig in page.evaluate(_PLOT_PARTS_JS):
        parts, name = fig["parts"], repr(fig["title"])
        problems += [f"{name}: the {k} is cut by the figure's edge" for k, v in parts.items() if outside(v, fig["svg"])]
        y2, legend = parts.get("right-axis title"), parts.get("legend")
        if y2 and (y2[1] < fig["plot"][1] - tolerance or y2[3] > fig["plot"][3] + tolerance):
            problems.append(f"{name}: the right-axis title is taller than the plot area")
        if legend:
            for k in ("title", "right-axis title"):
                if k in parts and overlap(legend, parts[k]):
                    problems.append(f"{name}: the legend covers the {k}")
            if any(overlap(legend, t) for t in fig["y2ticks"]):
                problems.append(f"{name}: the legend covers a right-axis tick label")
    return problems


def browser_or_skip():
    """``(chromium path, playwright's sync_playwright)``, or a skip naming what is missing (a failure
    where ``WORKBENCH_REQUIRE_BROWSER`` is set, as in CI)."""
    import pytest

    def need(reason):
        if os.environ.get("WORKBENCH_REQUIRE_BROWSER", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"a browser is required here (WORKBENCH_REQUIRE_BROWSER) but {reason}")
        pytest.skip(reason)

    chromium = find_chromium()
    if chromium is None:
        need("no Chromium found (apt-get install chromium, or set WORKBENCH_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        need("playwright is not installed (pip install playwright)")
    return chromium, sync_playwright


def page_layout_problems(html_file: Path, widths=(700, 1400)) -> list[str]:
    """:func:`plot_layout_problems` of a self-contained HTML file at each page width (skips without a browser)."""
    chromium, sync_playwright = browser_or_skip()
    problems = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        try:
            for width in widths:
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(html_file.resolve().as_uri())
                page.wait_for_function(
                    "() => { const d = Array.from(document.querySelectorAll('.js-plotly-plot'));"
                    " return d.length > 0 && d.every(x => x._fullLayout && x.querySelector('.main-svg')); }"
                )
                page.wait_for_timeout(300)
                problems += [f"{width} px: {x}" for x in plot_layout_problems(page)]
                page.close()
        finally:
            browser.close()
    return problems
