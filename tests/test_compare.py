"""``workbench compare`` on the bundled model: every variant runs the same prompts; one report."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from workbench.bench.compare import compare, variant_timeline_figure, write_compare_report
from workbench.cli.main import main

pytestmark = pytest.mark.slow
SMALL = dict(num_prompts=4, max_tokens=12, max_model_len=2048, max_num_seqs=4, num_gpu_blocks_override=200)


def test_compare_runs_every_variant_on_the_same_prompts(tmp_path):
    res = compare(
        allocators=["orca-oracle", "static", "orca-max"],
        batching_policies=["continuous"],
        output_dir=tmp_path,
        progress=False,
        **SMALL,
    )
    # the oracle needs true output lengths: a paged run is added first and provides them
    assert [r["variant"] for r in res.rows] == ["paged", "orca-oracle", "static", "orca-max"]
    outs = {k: [o.outputs[0].token_ids for o in r.outputs] for k, r in res.results.items()}
    assert outs["orca-oracle"] == outs["paged"] == outs["orca-max"]  # greedy: the allocator changes no token
    for row in res.rows:
        assert row["requests_finished"] == 4
        assert (
            abs(
                sum(
                    row[f"{c}_used_frac"]
                    for c in ("token_states", "reservation", "internal_fragmentation", "external_fragmentation")
                )
                - 1
            )
            < 1e-9
        )
    paged, static = res.rows[0], res.rows[2]
    assert paged["external_fragmentation_used_frac"] == 0
    assert static["token_states_used_frac"] < paged["token_states_used_frac"]
    assert json.loads((res.out_dir / "compare.json").read_text()) == res.rows
    page = (res.out_dir / "compare.html").read_text()
    assert "side by side" in page and "orca-oracle" in page
    assert (res.out_dir / "static" / "steps.jsonl").exists()


def test_compare_replays_long_tailed_true_lengths_under_a_larger_cap(tmp_path):
    """--true-output-lens exponential:M: no paged run is added; every variant's requests end at the same seeded
    true lengths ("stop" below the cap), and the five allocators order as the vLLM paper's Fig. 2."""
    from workbench.bench.output_lens import exponential_output_lens

    r = CliRunner().invoke(
        main,
        ["compare", "--kv-allocator", "static,orca-max,orca-pow2,orca-oracle,paged", "--num-prompts", "6",
         "--max-tokens", "96", "--true-output-lens", "exponential:12", "--max-model-len", "2048",
         "--num-gpu-blocks-override", "200", "--output-dir", str(tmp_path)],
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    (folder,) = tmp_path.iterdir()
    rows = json.loads((folder / "compare.json").read_text())
    assert [x["variant"] for x in rows] == ["static", "orca-max", "orca-pow2", "orca-oracle", "paged"]
    lens = exponential_output_lens(6, 12, seed=0, max_len=96)
    for x in rows:
        reqs = [json.loads(line) for line in (folder / x["variant"] / "requests.jsonl").open()]
        got = sorted((int(q["request_id"].removeprefix("gen-")), q["output_tokens"], q["finish_reason"]) for q in reqs)
        assert [n for _, n, _ in got] == lens and {f for _, _, f in got} == {"stop"}
    shares = [x["token_states_used_frac"] for x in rows]
    assert shares == sorted(shares) and len(set(shares)) == 5, shares
    assert "--true-output-lens" in CliRunner().invoke(main, ["compare", "--help"]).output
    bad = CliRunner().invoke(main, ["compare", "--true-output-lens", "sharegpt", "--output-dir", str(tmp_path)])
    assert bad.exit_code != 0 and "exponential:M" in bad.output


def test_compare_cli_batching_policies(tmp_path):
    r = CliRunner().invoke(
        main,
        [
            "compare",
            "--kv-allocator",
            "paged",
            "--batching-policy",
            "continuous,static",
            "--num-prompts",
            "4",
            "--max-tokens",
            "8",
            "--max-num-seqs",
            "2",
            "--max-model-len",
            "512",
            "--output-dir",
            str(tmp_path),
        ],
    )
    assert r.exit_code == 0, r.output
    assert "compare.html" in r.output
    (folder,) = tmp_path.iterdir()
    rows = json.loads((folder / "compare.json").read_text())
    assert [x["variant"] for x in rows] == ["paged", "paged / static"]
    assert all(x["batched_reqs_mean"] <= 2 for x in rows)
    # each variant's progress bars (requests, tokens) carry its name; none is an anonymous "requests:"
    bars = re.split(r"[\r\n]+", r.output)
    for label in ("paged", "paged / static"):
        assert any(x.startswith(f"{label}: requests: 100%") for x in bars), label
        assert any(x.startswith(f"{label}: tokens  : 100%") for x in bars), label
    assert not any(x.startswith(("requests:", "tokens")) for x in bars)


def test_compare_warns_once_when_the_dataset_has_fewer_prompts(tmp_path, caplog):
    ds = tmp_path / "p.jsonl"
    ds.write_text("".join(json.dumps({"prompt": f"Name {i} colours.", "chat": True}) + "\n" for i in (2, 3)))
    with caplog.at_level("WARNING"):
        r = CliRunner().invoke(
            main,
            ["compare", "--kv-allocator", "paged,static", "--dataset", str(ds), "--num-prompts", "3",
             "--max-tokens", "4", "--max-model-len", "512", "--output-dir", str(tmp_path / "out")],
        )  # fmt: skip
    assert r.exit_code == 0, r.output
    said = f"asked for 3 prompts; the dataset {ds} has 2 — running 2"
    assert r.output.count(said) == 1  # printed once, below the table
    assert [x.getMessage() for x in caplog.records if "asked for" in x.getMessage()] == [said]  # logged once
    (folder,) = (tmp_path / "out").iterdir()
    assert [x["requests_finished"] for x in json.loads((folder / "compare.json").read_text())] == [2, 2]


def test_compare_rejects_unknown_variants_before_loading(tmp_path):
    r = CliRunner().invoke(main, ["compare", "--kv-allocator", "paged,slab", "--output-dir", str(tmp_path)])
    assert r.exit_code != 0 and "slab" in r.output and "orca-oracle" in r.output


@pytest.mark.parametrize(
    "allocators, args, match",
    [
        # the last variant cannot compact: refused before paged and orca-max run
        ("paged,orca-max,buddy", {"kv_defrag_trigger": "waiting"}, r"variant buddy: .*kv_allocator='buddy'"),
        ("paged,orca-max", {"enable_prefix_caching": True}, r"variant orca-max: .*needs kv_allocator='paged'"),
        ("paged,tests.fixtures.nowhere:Alloc", {}, r"variant Alloc: .*cannot load"),
        ("paged,orca-max,paged", {}, r"paged given twice"),
    ],
)
def test_compare_checks_every_variant_before_the_first_runs(tmp_path, allocators, args, match):
    with pytest.raises(ValueError, match=match):
        compare(allocators=allocators.split(","), output_dir=tmp_path, **(SMALL | args))
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def _fake_run(pool_blocks: int, used: list[int]):
    """A variant's records as the page reads them: steps with the pool split, two finished requests."""
    from types import SimpleNamespace

    def step(i, blocks):
        slots, pool = blocks * 16, pool_blocks * 16
        d = {"step": i, "time_s": 0.1 * i, "num_blocks": pool_blocks, "block_size": 16, "kv_bytes_per_token": 1024,
             "token_states": slots - 5, "reservation": 3, "internal_fragmentation": 2, "external_fragmentation": 0,
             "free": pool - slots, "kv_utilization": (slots - 5) / pool, "fragmentation_rate": 5 / slots,
             "num_running": 2, "num_waiting": 1, "blocks_used": blocks, "blocks_free": pool_blocks - blocks}  # fmt: skip
        return SimpleNamespace(to_dict=lambda: d)

    reqs = [{"request_id": f"r{k}", "ttft_s": 0.1 * k, "e2e_s": 1.0 + k, "error": None} for k in (1, 2)]
    return SimpleNamespace(
        recorder=SimpleNamespace(
            steps=[step(i, b) for i, b in enumerate(used)],
            requests=[SimpleNamespace(to_dict=lambda r=r: r) for r in reqs],
        )
    )


@pytest.mark.browser
def test_variant_timelines_show_their_names_and_whole_right_axis_titles(tmp_path):
    """compare.html's per-variant timelines were 320 px high: the right axis' title ("utilization,
    fragmentation rate") ran past the plot, and the legend covered the 100% tick label. Each now
    keeps the timeline's own layout: title at the top, legend above the plot, plot taller than the
    title; rendered in Chromium, nothing is cut or covered."""
    from browser_support import page_layout_problems

    results = {"paged": _fake_run(300, [10, 80, 150, 40]), "paged / static": _fake_run(300, [200, 290, 120, 5])}
    fig = variant_timeline_figure("paged / static", [s.to_dict() for s in results["paged / static"].recorder.steps])
    lay = fig.layout
    assert lay.title.text == "KV pool over the run: paged / static" and lay.title.yanchor == "top"
    assert lay.legend.orientation == "h" and lay.legend.y > 1 and lay.yaxis2.automargin
    assert lay.height - lay.margin.t - lay.margin.b >= 7.5 * len(lay.yaxis2.title.text)
    rows = [{"variant": k} for k in results]
    page = write_compare_report(tmp_path / "compare.html", rows, results, {"max_tokens": 8})
    html = page.read_text()
    assert html.count("KV pool over the run: paged") == 2 and html.count("Plotly.newPlot(") == 4
    assert page_layout_problems(page, widths=(700, 1400)) == []
