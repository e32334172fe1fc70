"""The design document matches the code: ``docs/architecture.md``'s module map lists every module of
``workbench/`` (and none that is gone), and its KV-manager table names only methods the interface has.
Nothing in the repository points to the design brief outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"


def section(title_start: str) -> str:
    text = DOC.read_text()
    start = text.index(f"\n## {title_start}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def listed_modules() -> set[str]:
    """``folder/module`` of every module named in the module map's table rows."""
    out = set()
    for line in section("2. Module map").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`workbench/"):
            continue
        folder = cells[0].strip("`")
        for name in re.findall(r"`([\w]+\.py)`", cells[1]):
            out.add(folder + name)
    return out


def package_modules() -> set[str]:
    pkg = REPO / "workbench"
    return {
        "workbench/" + str(p.relative_to(pkg))
        for p in pkg.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def test_the_module_map_lists_every_module_and_only_those():
    listed, real = listed_modules(), package_modules()
    assert not real - listed, f"modules missing from docs/architecture.md §2: {sorted(real - listed)}"
    assert not listed - real, f"docs/architecture.md §2 lists modules that do not exist: {sorted(listed - real)}"


def test_the_kv_interface_table_names_real_methods():
    from workbench.kv.interface import KVManager

    names = set(re.findall(r"`(\w+)(?:\(|`)", section("6. The KV-manager interface")))  # `name(` or `name`
    names -= {"KVManager", "kv_allocator", "num_total_tokens"}  # (an argument the table quotes)
    missing = {n for n in names if not hasattr(KVManager, n)}
    assert not missing, f"docs/architecture.md §6 names methods KVManager does not have: {sorted(missing)}"


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if path.suffix in {".png", ".jpg", ".gif", ".gz"} or not path.is_file() or path == Path(__file__):
            continue
        text = path.read_text(errors="ignore")
        # (the ShareGPT prompt sets beside the checkout are data the tests use when present: named as the
        # folder beside the checkout, never by a relative path out of the repository)
        if "shared/ARCHITECTURE" in text or "ARCHITECTURE §" in text or "../" + "shared" in text:
            hits.append(name)
    assert not hits, f"references outside the repository: {hits}"
