"""benchmarks/suite_time.py: per-file seconds from a pytest JUnit report, with the notebooks as one part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import suite_time  # noqa: E402

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5" time="31.5">
<testcase classname="tests.test_server" name="test_a" time="10.0"/>
<testcase classname="tests.test_server.TestGroup" name="test_b" time="2.5"/>
<testcase classname="tests.test_kv" name="test_c" time="1.0"/>
<testcase classname="labs.01_kv_cache_anatomy.ipynb" name="Cell 1" time="6.0"/>
<testcase classname="labs.02_fragmentation_live.ipynb" name="Cell 3" time="11.0"/>
</testsuite></testsuites>
"""


def test_seconds_are_summed_per_file_and_the_notebooks_are_one_part(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    by_part, wall = suite_time.seconds_by_part(str(report))
    assert wall == 31.5
    assert by_part == {
        "tests/test_server.py": (12.5, 2),
        "tests/test_kv.py": (1.0, 1),
        "labs/*.ipynb under nbval": (17.0, 2),
    }
    rows = suite_time.table(by_part, wall, top=2).splitlines()
    assert rows[2] == "| `labs/*.ipynb under nbval` | 2 | 17 | 56% |"  # slowest first
    assert rows[3] == "| `tests/test_server.py` | 2 | 12 | 41% |"
    assert rows[4] == "| 1 other files | 1 | 1 | 3% |"
    assert rows[5] == "| all | 5 | 30 | wall 32 s |"


def test_a_file_that_is_not_a_junit_report_is_refused_with_the_fix(tmp_path):
    bad = tmp_path / "bad.xml"
    bad.write_text("<coverage/>")
    with pytest.raises(ValueError, match="--junitxml"):
        suite_time.seconds_by_part(str(bad))
    done = subprocess.run([sys.executable, str(BENCH / "suite_time.py"), str(bad)], capture_output=True, text=True)
    assert done.returncode != 0 and "--junitxml" in done.stderr
