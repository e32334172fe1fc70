"""Where the test suite's time goes: seconds per test file, from a pytest JUnit XML report.

    make test PYTEST_ARGS=--junitxml=/tmp/suite.xml          # or: PYTEST_ARGS=... bash .ci/run
    .venv/bin/python benchmarks/suite_time.py /tmp/suite.xml [--top 15]

Prints one Markdown row per part, slowest first: the chapter notebooks under nbval (``labs/``) as one
part, every file under ``tests/`` as its own, then the rest as one row. Seconds are pytest's own per-test
times (setup + call + teardown, as JUnit's ``time`` attribute records them). In one process their sum is a little
under the run's wall time, which also counts collection; ``make test`` runs two workers, so the sum is about twice
the wall time (the last row gives both). ``make test`` prints the 25 slowest tests (``--durations``)
on every run; this gives the per-file totals that a list of single tests hides.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def part_of(classname: str) -> str:
    """``tests.test_server.TestX`` -> ``tests/test_server.py``; ``labs.02_x.ipynb`` -> the notebooks as one part."""
    if classname.startswith("labs."):
        return "labs/*.ipynb under nbval"
    parts = classname.split(".")
    return f"{parts[0]}/{parts[1]}.py" if len(parts) > 1 else classname


def seconds_by_part(path: str) -> tuple[dict[str, tuple[float, int]], float]:
    """Read a JUnit XML report; return ``{part: (seconds, items)}`` and the run's wall time in seconds.

    Raises:
        ValueError: the file has no ``testcase`` element (not a pytest ``--junitxml`` report).
    """
    root = ET.parse(path).getroot()
    cases = list(root.iter("testcase"))
    if not cases:
        raise ValueError(f"{path} has no testcase elements: write it with pytest --junitxml={path}")
    seconds: dict[str, float] = collections.defaultdict(float)
    items: dict[str, int] = collections.defaultdict(int)
    for case in cases:
        part = part_of(case.get("classname", ""))
        seconds[part] += float(case.get("time", 0.0))
        items[part] += 1
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    wall = float(suite.get("time", 0.0)) if suite is not None else 0.0
    return {p: (seconds[p], items[p]) for p in seconds}, wall


def table(by_part: dict[str, tuple[float, int]], wall: float, top: int) -> str:
    """The Markdown table: the ``top`` slowest parts, then the others together, then the total."""
    ranked = sorted(by_part.items(), key=lambda kv: -kv[1][0])
    total = sum(s for s, _ in by_part.values())
    rows = ["| part | items | seconds | share of the tests' time |", "|---|---:|---:|---:|"]
    for part, (s, n) in ranked[:top]:
        rows.append(f"| `{part}` | {n:,} | {s:,.0f} | {s / total:.0%} |")
    rest = ranked[top:]
    if rest:
        s, n = sum(v[0] for _, v in rest), sum(v[1] for _, v in rest)
        rows.append(f"| {len(rest)} other files | {n:,} | {s:,.0f} | {s / total:.0%} |")
    rows.append(f"| all | {sum(n for _, n in by_part.values()):,} | {total:,.0f} | wall {wall:,.0f} s |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a pytest --junitxml report")
    ap.add_argument("--top", type=int, default=15, help="parts shown one per row (default 15)")
    args = ap.parse_args()
    print(table(*seconds_by_part(args.report), args.top))


if __name__ == "__main__":
    main()
