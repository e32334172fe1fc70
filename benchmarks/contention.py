"""The engine on a shared machine: ``make run``'s job (``workbench run`` with its defaults: the project's prompts,
the bundled model, dtype ``auto``) alone and beside ``stress-ng --cpu N`` (Debian's package: N processes that keep a
core busy each), in fresh processes, alternated.

For each run: the whole command's wall time, the job's own (the summary's ``wall_time_s``), and the CPU time the
child used (user + system). On a 2-core machine beside two busy processes the fair share is half the machine, so a
job that used its threads well takes about twice its idle time; one whose threads spin while a partner thread is
descheduled takes far longer and burns more CPU for the same work.

    python benchmarks/contention.py --repeats 2                        # this tree, idle and beside stress-ng --cpu 2
    python benchmarks/contention.py --against 3d30c99 --repeats 2      # before/after, alternated
    python benchmarks/contention.py --variant omp-default:GOMP_SPINCOUNT=300000   # OpenMP's own spin against ours

Prints every run with the ``workbench`` package it imported, then the medians and the ratio beside load to idle.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
from pathlib import Path

import click
from trees import REPO, export_tree, run_workbench


def _stress(hogs: int) -> subprocess.Popen:
    exe = shutil.which("stress-ng")
    if exe is None:
        raise click.ClickException("stress-ng is not installed (apt-get install stress-ng)")
    return subprocess.Popen([exe, "--cpu", str(hogs), "--quiet"], start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """Stop stress-ng and its workers by the process group we started it in."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, rest = text.partition(":")
    env = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise click.BadParameter(f"{item!r}: give VAR=VALUE (e.g. omp-default:GOMP_SPINCOUNT=300000)")
        env[key] = value
    return name, env


@click.command()
@click.option("--repeats", default=2, show_default=True, help="runs of each tree or variant in each condition")
@click.option("--hogs", default=2, show_default=True, help="stress-ng --cpu N beside the loaded runs")
@click.option("--against", "ref", default=None, help="a git commit to compare with: its tree and this one alternate")
@click.option(
    "--variant",
    "variants",
    multiple=True,
    help="NAME:VAR=VALUE,... environment settings to compare on this tree (repeatable; the tree as it is, labelled "
    "'this tree', always runs too)",
)
@click.option("--idle-only", is_flag=True, help="only the idle runs (a comparison of idle speed)")
@click.option("--out", default="runs/bench-contention.json", show_default=True)
def main(repeats: int, hogs: int, ref: str | None, variants: tuple[str, ...], idle_only: bool, out: str) -> None:
    """Time make run's job idle and beside stress-ng --cpu N (Debian's stress-ng must be on PATH), each run in a fresh
    process, alternating this tree with --against REF's tree and with each --variant's settings.

    Prints every run (wall time of the whole command and of the job, the CPU time it used, the workbench package it
    imported), then per tree or variant the medians and the job's time beside load / idle (about 2x is a fair share
    of two cores beside two busy processes). Writes every run to --out as JSON."""
    with tempfile.TemporaryDirectory(prefix="bench-contention-") as tmp:
        setups = [("this tree", REPO, {})]
        if ref:
            setups.insert(0, (ref, export_tree(ref, Path(tmp) / "ref"), {}))
        setups += [(name, REPO, env) for name, env in map(_parse_variant, variants)]
        rows = []
        conditions = ("idle",) if idle_only else ("idle", f"stress-ng --cpu {hogs}")
        for k in range(repeats):
            for condition in conditions:
                for label, tree, env in setups:
                    stress = _stress(hogs) if condition != "idle" else None
                    try:
                        run_dir = Path(tmp) / f"run-{len(rows)}"
                        run = run_workbench(tree, ["run", "--output-dir", str(run_dir)], env)
                    finally:
                        if stress is not None:
                            _stop(stress)
                    summary = json.loads(next(run_dir.glob("*/summary.json")).read_text())
                    row = {"label": label, "condition": condition, "repeat": k, "env": env,
                           "workbench": run["workbench"], "whole_s": run["wall_s"], "cpu_s": run["cpu_s"],
                           "job_s": summary["wall_time_s"]}  # fmt: skip
                    rows.append(row)
                    print(f"{label:>12} {condition:>18}: whole {row['whole_s']:6.1f} s, job {row['job_s']:6.1f} s, "
                          f"CPU {row['cpu_s']:6.1f} s; workbench.__file__ = {row['workbench']}", flush=True)  # fmt: skip
    med = {}
    for label, _, _ in setups:
        for condition in conditions:
            sel = [r for r in rows if r["label"] == label and r["condition"] == condition]
            med[f"{label} | {condition}"] = {k: statistics.median(r[k] for r in sel) for k in ("whole_s", "job_s", "cpu_s")}
        idle = med[f"{label} | idle"]
        line = f"median {label:>12}: job idle {idle['job_s']:.1f} s (CPU {idle['cpu_s']:.1f} s)"
        if not idle_only:
            loaded = med[f"{label} | {conditions[1]}"]
            line += (f", beside load {loaded['job_s']:.1f} s (CPU {loaded['cpu_s']:.1f} s): "
                     f"{loaded['job_s'] / idle['job_s']:.2f}x")  # fmt: skip
        print(line)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"hogs": hogs, "against": ref, "cores": os.cpu_count(), "runs": rows,
                                     "median": med}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
