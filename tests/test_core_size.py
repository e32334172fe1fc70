"""The engine core stays small enough to read: at most 3,000 lines, docstrings included,
and no function over 80 lines. Accounting lives in ``workbench/metrics/``, the simulator in
``workbench/sim/``, tensor parallelism in ``workbench/executor/tensor_parallel.py``: not core. Nor are the
adapters to the optional kernels of ``workbench/kernels/`` (Triton, the C++ CPU decode kernel): the core's
attention is the PyTorch reference and the choice of backend."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "workbench"
CORE_FILES = (
    "config.py",
    "request.py",
    "sampling.py",
    "scheduler.py",
    "engine.py",
    "executor/local.py",
    "model/llama.py",
)
CORE_DIRS = ("kv", "attention")
#: in CORE_DIRS but not core: the kernel adapters (the engine runs without them, on the reference)
NOT_CORE = (
    "attention/triton_backend.py",
    "attention/cpu_backend.py",
    # the course's stage-4 extensions of the KV layer: more placements, eviction policies, defragmentation
    "kv/best_fit.py",
    "kv/buddy.py",
    "kv/eviction.py",
    "kv/defrag.py",
    "kv/moves.py",
    # KV-cache events for a router (vLLM's format): a deployment's extension of the prefix cache
    "kv/events.py",
)
MAX_CORE_LINES = 3000
MAX_FUNCTION_LINES = 80


def core_files() -> list[Path]:
    files = [PKG / f for f in CORE_FILES]
    for d in CORE_DIRS:
        files += sorted(f for f in (PKG / d).glob("*.py") if str(f.relative_to(PKG)) not in NOT_CORE)
    return files


def test_the_core_files_exist():
    missing = [str(f) for f in core_files() if not f.is_file()]
    assert not missing, f"core files moved? update CORE_FILES: {missing}"
    assert len(core_files()) >= len(CORE_FILES) + 4


def test_the_core_is_at_most_3000_lines():
    sizes = {str(f.relative_to(PKG)): len(f.read_text().splitlines()) for f in core_files()}
    total = sum(sizes.values())
    table = "\n".join(f"{n:6d}  {name}" for name, n in sorted(sizes.items(), key=lambda kv: -kv[1]))
    assert total <= MAX_CORE_LINES, f"the engine core has {total} lines (at most {MAX_CORE_LINES}):\n{table}"


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(PKG)))
def test_no_core_function_is_over_80_lines(path):
    tree = ast.parse(path.read_text())
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines, from line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"{path.name}: split these: {long}"
