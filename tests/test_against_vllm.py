"""benchmarks/against_vllm.py's pure parts: its options, the metric names a PromQL expression reads and which of them
a server does not export, Grafana's variables, the dashboard's queries, the result checks and the markdown tables.

Nothing here starts vLLM or Prometheus (the script does, minutes long; docs/benchmarks.md has its figures).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import against_vllm as av  # noqa: E402

VLLM_METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# HELP vllm:num_preemptions Cumulative number of preemptions.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 0.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
process_open_fds 12.0
"""


def test_options():
    args = av.parse_args([])
    assert (args.quick, args.max_num_seqs, args.dtype, args.port) == (False, 4, "bfloat16", None)
    assert Path(args.out) == av.REPO / "runs" / "against_vllm"
    args = av.parse_args(["--quick", "--out", "x", "--max-model-len", "1024", "--threads", "2", "--omp-bind", "0,1"])
    assert (args.quick, args.out, args.max_model_len, args.threads, args.omp_bind) == (True, "x", 1024, 2, "0,1")
    for bad in (["--threads", "0"], ["--max-num-seqs", "0"], ["--max-model-len", "16"], ["--dtype", "fp8"]):
        with pytest.raises(SystemExit):
            av.parse_args(bad)


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("max by (model_name) (vllm:kv_cache_usage_perc) > 0.95", {"vllm:kv_cache_usage_perc"}),
        (
            "histogram_quantile(0.99, sum by (le, model_name) (rate(vllm:time_to_first_token_seconds_bucket[5m])))"
            " > 0.5",
            {"vllm:time_to_first_token_seconds_bucket"},
        ),
        (
            "deriv(vllm:num_requests_waiting[10m]) > 0 and vllm:num_requests_waiting > 0",
            {"vllm:num_requests_waiting"},
        ),
        (
            "sum by (model_name) (rate(vllm:prefix_cache_hits_total[1m])) / sum by (model_name) "
            "(rate(vllm:prefix_cache_queries_total[1m]))",
            {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"},
        ),
        (
            'max by (model_name) (workbench:fragmentation_rate{model_name=~"smol.*"}) > 0.5',
            {"workbench:fragmentation_rate"},
        ),
        ('{__name__="vllm:num_requests_running", engine="0"}', {"vllm:num_requests_running"}),
        ('label_replace(up, "dst", "$1", "instance", "(.*):.*") == bool 1', {"up"}),
        ("sum without (instance) (rate(x_total[5m] offset 1h)) * 1e3", {"x_total"}),
        ("a_metric * on (job) group_left (version) b_info unless c_metric", {"a_metric", "b_info", "c_metric"}),
        ("max_over_time(vllm:num_requests_waiting[5m:30s]) > Inf or vector(0)", {"vllm:num_requests_waiting"}),
        (
            "# a comment naming not_a_metric\nsum(rate(vllm:generation_tokens_total[1m]))",
            {"vllm:generation_tokens_total"},
        ),
    ],
)
def test_promql_metric_names(expr, names):
    assert av.promql_metric_names(expr) == names


def test_exposed_names_are_sample_names_not_families():
    exposed = av.exposed_metric_names(VLLM_METRICS)
    assert exposed == {
        "vllm:num_requests_waiting",
        "vllm:num_preemptions_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
        "process_open_fds",
    }
    # a counter's family name (from # TYPE) is not a series a query can select
    assert av.metrics_lacking("rate(vllm:num_preemptions[5m])", exposed) == ["vllm:num_preemptions"]
    assert av.metrics_lacking("sum(rate(vllm:num_preemptions_total[5m])) > 0", exposed) == []
    assert av.metrics_lacking(
        "vllm:num_requests_waiting + workbench:num_requests_swapped + workbench:kv_blocks_free", exposed
    ) == ["workbench:kv_blocks_free", "workbench:num_requests_swapped"]


def test_grafana_variables():
    q = "rate(x[$__rate_interval]) + rate(y[${__rate_interval}]) + rate(z[[[__interval]]]) + w[$__range]"
    assert av.substitute_grafana_variables(q) == "rate(x[1m]) + rate(y[1m]) + rate(z[15s]) + w[5m]"
    # $__rate_interval is not read as $__range / $__interval's prefix
    assert av.substitute_grafana_variables("$__rate_interval", {"__interval": "9s", "__rate_interval": "2m"}) == "2m"


def test_dashboard_queries_walk_rows_and_substitute():
    dashboard = {
        "panels": [
            {"id": 100, "type": "row", "title": "vLLM", "panels": []},
            {"id": 1, "title": "Waiting", "targets": [{"refId": "A", "expr": "sum(vllm:num_requests_waiting)"}]},
            {
                "id": 101,
                "type": "row",
                "title": "workbench",
                "collapsed": True,
                "panels": [
                    {
                        "id": 2,
                        "title": "Evictions [workbench]",
                        "targets": [
                            {"refId": "A", "expr": "rate(workbench:prefix_cache_evictions_total[$__rate_interval])"},
                            {"refId": "B", "datasource": "x"},  # no expr: not a query
                        ],
                    }
                ],
            },
        ]
    }
    qs = av.dashboard_queries(dashboard)
    assert [(q["panel_id"], q["ref"], q["workbench_only"]) for q in qs] == [(1, "A", False), (2, "A", True)]
    assert qs[1]["query"] == "rate(workbench:prefix_cache_evictions_total[1m])"
    assert qs[1]["expr"].endswith("[$__rate_interval])")


def test_the_shipped_rule_files_and_dashboard_are_found():
    files = av.rule_files()
    assert files and all(f.name.endswith("_alerts.yml") for f in files)
    assert all(t.name.endswith("_alerts_test.yml") for t in av.rule_test_files())
    import json

    queries = av.dashboard_queries(json.loads(av.DASHBOARD.read_text()))
    assert queries and all("$" not in q["query"] for q in queries)
    assert all(av.promql_metric_names(q["query"]) for q in queries)


def test_check_result_and_figure():
    ok = {"completed": 4, "failed": 0, "num_prompts": 4, "output_lens": [16] * 4, "request_throughput": 2.0,
          "output_throughput": 32.0, "median_ttft_ms": 250.4, "median_tpot_ms": 80.0, "request_goodput": None}  # fmt: skip
    assert av.check_result(ok, 16) == []
    fig = av.result_figure(ok)
    assert fig == "4/4 completed, 2.00 req/s, 32.0 tok/s out, TTFT p50 250 ms, TPOT p50 80 ms"
    bad = ok | {
        "completed": 3,
        "failed": 1,
        "errors": ["", "HTTP 400: too long", "", ""],
        "output_lens": [16, 0, 15, 16],
    }
    problems = av.check_result(bad, 16)
    assert problems[0].startswith("1 failed (HTTP 400: too long")
    assert problems[1] == "1 outputs not 16 tokens long: [15]"
    assert av.check_result(bad | {"failed": 0}, None) == []
    assert av.check_result({"completed": 0, "failed": 0}, None) == ["no request completed"]


def test_short_command():
    cmd = ["/v/bin/python", "-m", "x", "--model", "/cache/models/m", str(av.REPO / "datasets" / "a b.jsonl")]
    assert av.short_command(cmd, {"/v/bin/python": "py", "/cache/models/m": "$MODEL"}) == (
        "py -m x --model $MODEL 'datasets/a b.jsonl'"
    )


def test_argv_quotes_values():
    assert av.argv("--path {p} --n {n}", p="/a b/c", n=3) == ["--path", "/a b/c", "--n", "3"]


def test_markdown_table():
    records = [
        {"tool": "bench serve | random", "status": "ok", "command_short": "workbench bench serve --x", "figure": "8/8"},
        {"tool": "vllm CLI", "status": "failed", "command_short": "vllm --version", "reason": "no\nmetadata",
         "figure": "ignored"},
        {"tool": "sharegpt", "status": "skipped", "reason": "skipped: no file"},
        {"tool": "compare", "status": "refused", "command_short": "c" * 500, "figure": "exit 2"},
    ]  # fmt: skip
    lines = av.markdown_table(records, max_command=50).splitlines()
    assert lines[:2] == ["| tool | command | worked? | figure or reason |", "|---|---|---|---|"]
    assert lines[2] == "| bench serve \\| random | `workbench bench serve --x` | yes | 8/8 |"
    assert lines[3] == "| vllm CLI | `vllm --version` | **no** | no metadata |"
    assert lines[4] == "| sharegpt |  | skipped | skipped: no file |"
    assert lines[5] == f"| compare | `{'c' * 49}…` | yes (refused, as designed) | exit 2 |"


def test_expressions_table():
    evals = [
        {"kind": "alert", "source": "vllm_alerts.yml", "name": "Preempting", "parses": True, "returns_data": False,
         "inputs_have_series": True, "metrics_vllm_lacks": []},
        {"kind": "alert", "source": "workbench_alerts.yml", "name": "KVFragmentationHigh", "parses": True,
         "returns_data": False, "inputs_have_series": False, "metrics_vllm_lacks": ["workbench:fragmentation_rate"]},
        {"kind": "dashboard", "source": "d.json", "name": "TTFT [A]", "parses": False, "returns_data": False,
         "metrics_vllm_lacks": []},
    ]  # fmt: skip
    lines = av.expressions_table(evals).splitlines()
    assert lines[2] == "| vllm_alerts.yml | Preempting | yes | no (not firing) | none |"
    assert lines[3] == (
        "| workbench_alerts.yml | KVFragmentationHigh | yes | no (no input series) | `workbench:fragmentation_rate` |"
    )
    assert lines[4] == "| d.json | TTFT [A] | **no** | no | none |"


def test_the_cli_shim_is_python():
    compile(av.VLLM_CLI_SHIM, "<shim>", "exec")


def test_sample_sums_add_up_every_series():
    text = VLLM_METRICS + 'vllm:request_success_total{finished_reason="stop"} 3.0\n'
    text += 'vllm:request_success_total{finished_reason="length"} 13.0\n'
    sums = av.sample_sums(text, ["vllm:request_success_total", "vllm:time_to_first_token_seconds_count", "absent"])
    assert sums == {"vllm:request_success_total": 16.0, "vllm:time_to_first_token_seconds_count": 3.0, "absent": 0.0}


def test_replica_mismatches():
    before = dict.fromkeys(av.REPLICA_COUNTERS.values(), 10.0)
    after = {name: 10.0 + i for i, name in enumerate(av.REPLICA_COUNTERS.values())}
    replica = {key: i for i, key in enumerate(av.REPLICA_COUNTERS)}
    assert av.replica_mismatches(replica, before, after) == []
    replica["prompt_tokens"] = 7
    assert av.replica_mismatches(replica, before, after) == ["prompt_tokens 7 != vllm:prompt_tokens_total increase 1"]
