"""Before/after comparisons of two trees of this repository, for the benchmark scripts.

A comparison is void if both runs imported the same ``workbench``: an editable install, a stale ``PYTHONPATH`` or a
working directory can all win over the tree meant. So every run here is a fresh child process that puts its tree
first on ``sys.path``, prints the ``workbench.__file__`` it imported, and is refused (``click.ClickException``) when
that file is not in the tree meant.

    export_tree("3d30c99", Path("/tmp/old"))               # a commit's files, by git archive
    run = run_workbench(Path("/tmp/old"), ["simulate", ...])
    run["workbench"], run["wall_s"], run["cpu_s"]
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]

#: Run in a child process: the tree given first goes first on ``sys.path``, the imported package's path is printed,
#: then ``workbench``'s command line runs with the other arguments.
CHILD = (
    "import sys; tree = sys.argv[1]; sys.path.insert(0, tree); import workbench; "
    "print('workbench.__file__ =', workbench.__file__, flush=True); "
    "import importlib.util as u; "  # the command's home: workbench.cli.main, or workbench.cli in older trees
    "m = 'workbench.cli.main' if u.find_spec('workbench.cli').submodule_search_locations else 'workbench.cli'; "
    "main = __import__(m, fromlist=['main']).main; sys.argv = ['workbench', *sys.argv[2:]]; main()"
)


def export_tree(ref: str, dest: Path) -> Path:
    """The files of commit ``ref`` (``git archive``) in the new folder ``dest``.

    Raises:
        click.ClickException: git cannot name or archive ``ref`` (the message is git's).
    """
    dest.mkdir(parents=True)
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, capture_output=True)
    except subprocess.CalledProcessError as e:
        raise click.ClickException(f"cannot export {ref!r}: {e.stderr.decode(errors='replace').strip()}") from None
    return dest


def run_workbench(tree: Path, args: list[str], env: dict[str, str] | None = None) -> dict:
    """``workbench ARGS`` run by ``tree``'s package in a child process (``env``: variables added to this one's).

    Returns:
        ``{"tree", "workbench" (the imported __init__.py), "wall_s", "cpu_s" (the child's user + system seconds),
        "stdout"}``.

    Raises:
        click.ClickException: the command failed, or the child imported a package outside ``tree``.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(tree), *args], capture_output=True, text=True, env=os.environ | (env or {})
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise click.ClickException(f"workbench {' '.join(args[:1])} of {tree} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    imported = proc.stdout.split("workbench.__file__ =", 1)[1].split()[0]
    if Path(imported).resolve().parents[1] != tree.resolve():
        raise click.ClickException(f"the run meant for {tree} imported {imported}: the comparison would be void")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"tree": str(tree), "workbench": imported, "wall_s": wall, "cpu_s": cpu, "stdout": proc.stdout}
