"""workbench sets OpenMP's spin count before torch loads, unless the user chose one or a wait policy
(workbench/omp_wait.py): each case in a fresh interpreter, since OpenMP reads it once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workbench.omp_wait import OMP_SPIN_COUNT

PROBE = "import os, workbench.omp_wait as w; print(os.environ.get('GOMP_SPINCOUNT'), w.spin_default_applied())"


def _run(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.slow  # four interpreters that import torch
@pytest.mark.parametrize(
    "code, env, expected",
    [
        ("import workbench; " + PROBE, {}, f"{OMP_SPIN_COUNT} True"),
        ("import workbench; " + PROBE, {"GOMP_SPINCOUNT": "77"}, "77 False"),  # the user's count stays
        ("import workbench; " + PROBE, {"OMP_WAIT_POLICY": "ACTIVE"}, "None False"),  # the user's policy decides
        ("import torch, workbench; " + PROBE, {}, "None False"),  # too late: OpenMP loaded with torch
    ],
    ids=["default", "user-count", "user-policy", "torch-first"],
)
def test_the_spin_count_is_set_before_torch_loads_unless_chosen(code, env, expected):
    assert _run(code, **env) == expected
