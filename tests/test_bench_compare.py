"""``workbench bench compare BASELINE NEW``: ratios of medians over repeats, verdicts with the dashboard's limits
(latency above 1.20x, throughput below 0.80x; p99 not gated), exit codes for CI, the report; and, on the bundled
model, an introduced regression (prefix caching off on a shared-prefix trace) caught while a rerun passes."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from workbench.bench.regression import compare_results, load_results, metrics_of
from workbench.cli.main import main


def serve_result(scale_latency: float = 1.0, scale_throughput: float = 1.0, p99: float = 1.0, **extra) -> dict:
    """A bench serve result (vLLM's keys) whose latencies and throughputs are scaled from a reference."""
    r = {"model_id": "m", "num_prompts": 100, "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None,
         "total_input_tokens": 12_800, "request_throughput": 3.9 * scale_throughput,
         "output_throughput": 500.0 * scale_throughput, "total_token_throughput": 1_000.0 * scale_throughput}  # fmt: skip
    for m, ms in (("ttft", 120.0), ("tpot", 20.0), ("itl", 19.0), ("e2el", 2_600.0)):
        r |= {f"mean_{m}_ms": ms * scale_latency, f"median_{m}_ms": 0.9 * ms * scale_latency,
              f"std_{m}_ms": 5.0, f"p99_{m}_ms": 3 * ms * p99}  # fmt: skip
    return r | extra


def invoke(*args):
    return CliRunner().invoke(main, ["bench", "compare", *map(str, args)])


def test_the_metrics_of_a_serve_result_and_of_a_run_summary():
    keys = {m.key: m for m in metrics_of(serve_result())}
    assert keys["median_ttft_ms"].gated and not keys["median_ttft_ms"].higher_is_better
    assert not keys["p99_ttft_ms"].gated and "std_ttft_ms" not in keys
    assert keys["output_throughput"].higher_is_better and keys["output_throughput"].gated
    run = {m.key: m for m in metrics_of({"output_throughput_tok_s": 1.0})}
    assert run["ttft_p50_s"].gated and not run["ttft_p99_s"].gated and run["total_throughput_tok_s"].higher_is_better
    with pytest.raises(ValueError, match="request_throughput"):
        metrics_of({"foo": 1})


def test_medians_over_repeats_and_the_verdicts():
    base = [serve_result(1.0), serve_result(1.1), serve_result(0.95)]
    new = [serve_result(1.5), serve_result(1.4), serve_result(1.6, p99=3.0)]
    rep = compare_results(base, new)
    rows = {r["key"]: r for r in rep.rows}
    ttft = rows["median_ttft_ms"]
    assert ttft["baseline_median"] == pytest.approx(108.0) and ttft["new_median"] == pytest.approx(0.9 * 120 * 1.5)
    assert (ttft["new_min"], ttft["new_max"]) == pytest.approx((0.9 * 120 * 1.4, 0.9 * 120 * 1.6))
    assert ttft["ratio"] == pytest.approx(1.5) and ttft["verdict"] == "regressed"
    assert rows["p99_ttft_ms"]["verdict"] == "not gated"  # 1.0x median, one repeat at 3x: reported only
    assert rows["output_throughput"]["verdict"] == "ok" and not rep.passed
    assert {r["key"] for r in rep.regressions} == {
        f"{s}_{m}_ms" for s in ("mean", "median") for m in ("ttft", "tpot", "itl", "e2el")
    }
    # throughput below 0.8x regresses; a faster run is "improved" and passes
    slow = compare_results(base, [serve_result(scale_throughput=0.75)])
    assert [r["key"] for r in slow.regressions] == ["request_throughput", "output_throughput", "total_token_throughput"]
    fast = compare_results(base, [serve_result(0.7, 1.3)])
    assert fast.passed and {r["verdict"] for r in fast.rows if r["gated"]} == {"improved"}
    # at the limits: not regressed (strictly above / below)
    edge = compare_results([serve_result()], [serve_result(1.2, 0.8)])
    assert edge.passed


def test_noise_passes_and_tail_percentiles_do_not_gate():
    base = [serve_result(1.0), serve_result(1.05)]
    noise = [serve_result(1.08, 0.95, p99=2.5), serve_result(0.97, 1.02, p99=0.4)]
    rep = compare_results(base, noise)
    assert rep.passed and not rep.warnings
    assert "PASSED" in str(rep.table())


def test_the_cli_exit_codes_the_report_and_the_inputs(tmp_path):
    base, new, noise = tmp_path / "base.json", tmp_path / "new.jsonl", tmp_path / "noise"
    base.write_text(json.dumps([serve_result(1.0), serve_result(1.02)]))  # a JSON list of repeats
    new.write_text("\n".join(json.dumps(serve_result(1.3)) for _ in range(2)))  # JSON Lines
    noise.mkdir()  # a folder of result files
    for i, s in enumerate((0.98, 1.04)):
        (noise / f"r{i}.json").write_text(json.dumps(serve_result(s)))
    ok = invoke(base, noise)
    assert ok.exit_code == 0, ok.output
    assert "PASSED" in ok.output and "TTFT median" in ok.output
    bad = invoke(base, new, "--html", tmp_path / "r.html", "--json", tmp_path / "r.json")
    assert bad.exit_code == 1, bad.output
    assert "REGRESSED: TTFT median (median_ttft_ms) 1.287x the baseline median (limit 1.20x)" in bad.output
    page = (tmp_path / "r.html").read_text()
    assert "REGRESSED" in page and "plotly" in page.lower() and "new / baseline" in page
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["passed"] is False and len(saved["rows"]) == len(metrics_of(serve_result()))
    # a looser limit lets the same change pass
    assert invoke(base, new, "--latency-threshold", "1.4").exit_code == 0
    # a different workload is refused (exit 2), unless allowed: then it is a warning under the table
    other = tmp_path / "other.json"
    other.write_text(json.dumps(serve_result(num_prompts=50)))
    refused = invoke(base, other)
    assert refused.exit_code == 2 and "the workloads differ in num_prompts: baseline 100, new 50" in refused.output
    allowed = invoke(base, other, "--allow-workload-mismatch")
    assert allowed.exit_code == 0 and "the workloads differ in num_prompts" in allowed.output
    # a run that finished nothing is not a repeat
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(serve_result(completed=0)))
    r = invoke(base, empty)
    assert r.exit_code == 2 and "empty.json: no request finished" in r.output


@pytest.mark.parametrize(
    "content, args, match",
    [
        ('{"foo": 1}', (), r"new.json: a result with neither 'request_throughput'"),
        ("not json\n", (), "neither JSON nor JSON Lines"),
        ("[]", (), "holds no result objects"),
        (None, ("--latency-threshold", "0.9"), r"latency_limit=0.9 \(--latency-threshold\) must be > 1"),
        (
            None,
            ("--throughput-threshold", "1.5"),
            r"throughput_limit=1.5 \(--throughput-threshold\) must be in \(0, 1\)",
        ),
        ('{"output_throughput_tok_s": 5.0}', (), "different kinds"),
    ],
)
def test_bad_input_is_refused_with_exit_code_2(tmp_path, content, args, match):
    base = tmp_path / "base.json"
    base.write_text(json.dumps(serve_result()))
    new = tmp_path / "new.json"
    new.write_text(content if content is not None else json.dumps(serve_result()))
    r = invoke(base, new, *args)
    assert r.exit_code == 2 and __import__("re").search(match, r.output), r.output


def test_a_missing_path_and_mixed_kinds_in_one_side(tmp_path):
    assert invoke(tmp_path / "nope.json", tmp_path / "nope.json").exit_code == 2
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(serve_result()) + "\n" + json.dumps({"output_throughput_tok_s": 1.0}))
    with pytest.raises(ValueError, match="mixed"):
        load_results(mixed)


def test_an_unfinished_run_folder_is_refused_and_a_missing_metric_is_named(tmp_path):
    side = tmp_path / "base"
    for i in range(2):  # two finished runs and one that stopped before its summary
        (side / f"r{i}").mkdir(parents=True)
        (side / f"r{i}" / "summary.json").write_text(json.dumps({"output_throughput_tok_s": 10.0, "ttft_p50_s": 0.1}))
    (side / "killed").mkdir()
    (side / "killed" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"base/\{killed\}: a run folder without summary.json"):
        load_results(side)
    r = invoke(side, side)
    assert r.exit_code == 2 and "did not finish" in r.output
    sparse = tmp_path / "sparse.json"
    sparse.write_text(json.dumps({"request_throughput": 1.0}))
    report = compare_results(load_results(sparse), load_results(sparse))
    assert report.passed and any("output_throughput" in w and "not compared" in w for w in report.warnings)
    assert "not compared" in str(report.table())
    with pytest.raises(ValueError, match="no gated metric is present"):  # a baseline of 0: no ratio anywhere
        compare_results([{"request_throughput": 0.0}], [{"request_throughput": 1.0}])


class PricedClock:
    """A clock that stands still except when :class:`PricedExecutor` charges a step: seconds are a fixed price per
    token the step computed, so a run's latencies and throughputs follow from the scheduler's decisions alone and
    are the same on an idle machine and a loaded one."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PricedExecutor:
    """The engine's real executor (the bundled model computes every token), charging each step to a
    :class:`PricedClock`: ``per_step_s`` plus ``per_token_s`` for every token scheduled."""

    def __init__(self, inner, clock: PricedClock, per_token_s: float = 1e-3, per_step_s: float = 5e-3) -> None:
        self.inner, self.clock, self.per_token_s, self.per_step_s = inner, clock, per_token_s, per_step_s

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute_step(self, out, kv):
        result = self.inner.execute_step(out, kv)
        self.clock.now += self.per_step_s + self.per_token_s * out.total_tokens
        return result


def priced_llm(**engine_args):
    """An ``LLM`` over an engine whose executor is priced (:class:`PricedExecutor`)."""
    from workbench.config import EngineConfig
    from workbench.engine import LLMEngine
    from workbench.entrypoints.llm import LLM
    from workbench.executor import make_executor

    config = EngineConfig(**engine_args)
    clock = PricedClock()
    llm = LLM.__new__(LLM)
    llm.llm_engine = LLMEngine(config, executor=PricedExecutor(make_executor(config), clock), clock=clock)
    return llm


@pytest.mark.slow
def test_an_introduced_regression_is_caught_and_a_rerun_passes(tmp_path):
    """Real runs of the bundled model on a shared-prefix trace, timed by a priced clock (a fixed cost per token
    computed, not the machine's seconds): the baseline with prefix caching, a rerun of it, and the regression with
    prefix caching off, which computes every prompt's shared prefix again. The regression fails the gate at the
    dashboard's limits; the rerun, the same decisions and so the same figures, passes them. The verdicts depend
    on what the engine computed, never on how busy the machine is."""
    from workbench.bench.run import run_job

    trace = {"prefix_len": 256, "suffix_len": 16, "num_prefixes": 1, "output_len": 8, "vocab_size": 2000}
    common = dict(dataset="prefix-repetition", dataset_options=trace, num_prompts=8, max_tokens=8, ignore_eos=True)

    def run(folder: str, caching: bool) -> dict:
        llm = priced_llm(dtype="float32", max_num_seqs=4, enable_prefix_caching=caching)
        return run_job(**common, llm=llm, output_dir=tmp_path / folder, run_name="r", progress=False).summary

    base, rerun, regressed = run("base", True), run("rerun", True), run("regressed", False)
    assert rerun == base | {k: rerun[k] for k in ("startup_s", "model_load_s")}  # the same figures, to the bit
    # caching off computes the 256-token prefix for all 8 prompts instead of once
    assert regressed["output_throughput_tok_s"] < 0.8 * base["output_throughput_tok_s"]
    caught = invoke(tmp_path / "base", tmp_path / "regressed")
    assert caught.exit_code == 1, caught.output
    assert "REGRESSED: output throughput (output_throughput_tok_s)" in caught.output, caught.output
    passed = invoke(tmp_path / "base", tmp_path / "rerun")
    assert passed.exit_code == 0, passed.output
