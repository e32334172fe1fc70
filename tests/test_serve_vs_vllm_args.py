"""``benchmarks/serve_vs_vllm.py``'s before/after and server-flag options (the benchmark itself needs the vLLM
venv and an idle machine; these check what decides which code each server runs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import serve_vs_vllm as S  # noqa: E402


def test_a_baseline_tree_must_be_a_checkout(tmp_path, capsys):
    with pytest.raises(SystemExit):
        S.parse_args(["--baseline-tree", str(tmp_path)])
    assert "is not a workbench checkout" in capsys.readouterr().err


def test_a_baseline_tree_adds_the_baseline_system():
    a = S.parse_args(["--systems", "workbench", "--baseline-tree", str(REPO)])
    assert a.system_list == ["workbench", "baseline"]


def test_a_server_imports_the_tree_it_is_given_not_the_working_directory(tmp_path, monkeypatch):
    """``python -m`` puts the working directory first on the path; ``PYTHONSAFEPATH`` in the server's environment
    keeps the given tree first, and ``imported_tree`` reports the file a server with that environment imports."""
    tree = tmp_path / "other"
    (tree / "workbench").mkdir(parents=True)
    (tree / "workbench" / "__init__.py").write_text("")
    monkeypatch.chdir(REPO)
    env = S.workbench_env(tree)
    assert env["PYTHONSAFEPATH"] == "1"
    assert S.imported_tree(env) == str(tree / "workbench" / "__init__.py")
    assert S.imported_tree(S.workbench_env(REPO)) == str(REPO / "workbench" / "__init__.py")


def test_server_flags_pass_through_as_one_string():
    a = S.parse_args(["--vllm-args=--no-enable-prefix-caching --max-num-seqs 8", "--workbench-args=--enable-prefix-caching"])
    assert a.vllm_args.split() == ["--no-enable-prefix-caching", "--max-num-seqs", "8"]
    assert a.workbench_args == "--enable-prefix-caching"
