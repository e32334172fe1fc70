"""Chapter 19's library: interleaved repeats of real runs, the comparison and the CLI's exit codes on them."""

from __future__ import annotations

import pytest

from workbench import labs
from workbench.labs import ch19_regression_baseline as rb


@pytest.fixture(scope="module")
def rep(tmp_path_factory):
    sides = {"baseline": rb.SIDES["baseline"], "no_prefix_caching": rb.SIDES["no_prefix_caching"]}
    seen = []
    r = rb.record_repeats(
        tmp_path_factory.mktemp("ch19"), sides, repeats=2, job={"num_prompts": 4}, on_repeat=lambda *a: seen.append(a)
    )
    r.seen = seen
    return r


@pytest.mark.slow
def test_repeats_are_interleaved_and_each_is_a_run_folder(rep):
    assert rep.order == [("baseline", 0), ("no_prefix_caching", 0), ("baseline", 1), ("no_prefix_caching", 1)]
    assert [(s, i) for s, i, _ in rep.seen] == rep.order
    for side, folders in rep.folders.items():
        assert [f.name for f in folders] == [f"{side}-0", f"{side}-1"]
        assert all((f / "summary.json").exists() and (f / "requests.jsonl").exists() for f in folders)
    rows = rb.repeat_rows(rep)
    assert [r["side"] for r in rows] == [s for s, _ in rep.order] and len(rb.repeat_table(rows)) == 4
    assert all(r["summary"]["requests_finished"] == 4 for r in ({"summary": s} for s in rep.summaries("baseline")))


@pytest.mark.slow
def test_prefix_caching_off_is_caught_by_the_library_and_the_cli(rep, tmp_path):
    report = rb.compare_sides(rep, "baseline", "no_prefix_caching")
    verdicts = rb.gated_verdicts(report)
    assert not report.passed and verdicts["ttft_p50_s"] == "regressed"
    assert set(verdicts) == {"output_throughput_tok_s", "total_throughput_tok_s", "ttft_p50_s", "tpot_p50_s",
                             "itl_p50_s", "e2e_p50_s"}  # fmt: skip
    code, out = rb.cli_compare(rep.root / "baseline", rep.root / "no_prefix_caching", html=tmp_path / "r.html")
    assert code == 1 and "REGRESSED: TTFT median (ttft_p50_s)" in out and (tmp_path / "r.html").exists()
    same = rb.cli_compare(rep.root / "baseline", rep.root / "baseline")
    assert same[0] == 0, same[1]
    assert rb.rerun_verdict(rb.compare_sides(rep, "baseline", "baseline"), same[0]) == "passed: True | exit code: 0"
    # a rerun the machine's noise pushed past the gate is named as noise, with the ratios that moved
    said = rb.rerun_verdict(report, code)
    assert said.startswith("passed: False | exit code: 1") and "ttft_p50_s" in said and "quieter machine" in said
    bad = rb.cli_compare(rep.root / "baseline", tmp_path / "r.html")
    assert bad[0] == 2
    cases = rb.verdict_cases(rep)
    assert len(cases) == 6 and labs.check("19.1", labs.solution("19.1", cases=cases), cases=cases)
    rows = report.to_dict()["rows"]
    assert "ttft_p50_s" in labs.solution("19.2", rows=rows)


def test_bad_arguments_are_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="repeats=0"):
        rb.record_repeats(tmp_path, repeats=0)
    assert not any(tmp_path.iterdir())
