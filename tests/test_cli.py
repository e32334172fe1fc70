"""``workbench run``: the main job end to end on the bundled model (small sizes)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from conftest import SHAREGPT_500

from workbench.cli.main import main, parse_bytes


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5G") == 1_500_000_000
    assert parse_bytes("1000") == 1000
    with pytest.raises(Exception, match="not a memory size"):
        parse_bytes("lots")


def _run(args):
    res = CliRunner().invoke(main, ["run", *args], catch_exceptions=False)
    return res


@pytest.mark.slow
def test_run_default_prompts_writes_the_run_folder(tmp_path):
    res = _run(["--num-prompts", "6", "--max-tokens", "8", "--max-num-seqs", "4", "--output-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    for word in ("requests", "output throughput", "TTFT p50 / p99", "TPOT p50 / p99", "KV utilization", "preemptions"):
        assert word in res.output
    (run_dir,) = list(tmp_path.iterdir())
    steps = [json.loads(x) for x in (run_dir / "steps.jsonl").read_text().splitlines()]
    reqs = [json.loads(x) for x in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(reqs) == 6 and steps
    assert max(s["num_running"] for s in steps) <= 4
    html = (run_dir / "report.html").read_text()
    assert html.count("plotly.js v") >= 1 and "KV" in html
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["requests_total"] == 6 and summary["output_tokens_total"] == sum(r["output_tokens"] for r in reqs)


@pytest.mark.slow
def test_run_jsonl_dataset_with_a_refused_prompt(tmp_path):
    ds = tmp_path / "p.jsonl"
    ds.write_text(
        json.dumps({"prompt": "Say hi.", "chat": True})
        + "\n"
        + json.dumps({"prompt": "word " * 400, "chat": False})
        + "\n"
    )
    res = _run(
        ["--dataset", str(ds), "--max-tokens", "4", "--max-model-len", "128", "--output-dir", str(tmp_path / "r")]
    )
    assert res.exit_code == 0, res.output
    assert "refused" in res.output and "max_model_len=128" in res.output


@pytest.mark.skipif(not SHAREGPT_500.exists(), reason="shared/data/sharegpt (beside the checkout) is not on this machine")
@pytest.mark.slow
def test_run_sharegpt_dataset(tmp_path):
    res = _run(
        ["--dataset", str(SHAREGPT_500), "--num-prompts", "3", "--max-tokens", "4", "--output-dir", str(tmp_path)]
    )
    assert res.exit_code == 0, res.output
    (run_dir,) = list(tmp_path.iterdir())
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 3


def test_run_bad_argument_is_a_clear_error(tmp_path):
    res = CliRunner().invoke(main, ["run", "--block-size", "12", "--output-dir", str(tmp_path)])
    assert res.exit_code != 0
    assert "block_size=12" in res.output and "power of two" in res.output


def test_run_refused_by_the_engine_leaves_no_run_folder(tmp_path):
    """A size the engine refuses (the bundled model splits over 1 or 3 ranks, not 2) fails before any
    worker starts, and the run folder made for it is removed."""
    res = CliRunner().invoke(main, ["run", "-tp", "2", "--output-dir", str(tmp_path)])
    assert res.exit_code != 0
    assert "tensor_parallel_size=2" in res.output and "use one of [1, 3]" in res.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_run_says_when_the_dataset_has_fewer_prompts_than_asked(tmp_path):
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"Count to {i}.", "chat": True}) + "\n" for i in (2, 3)))
    res = _run(["--dataset", str(ds), "--num-prompts", "5", "--max-tokens", "4", "--output-dir", str(tmp_path / "r")])
    assert res.exit_code == 0, res.output
    assert f"warning: asked for 5 prompts; the dataset {ds} has 2 — running 2" in res.output
    (run_dir,) = (tmp_path / "r").iterdir()
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == 2
