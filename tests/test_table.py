"""workbench.viz.table: HTML that never wraps, a text rendering that lines up, both deterministic."""

import re

import pytest

from workbench.viz.table import Column, Table


def _table(**kw):
    return Table(
        [
            Column("run", "run", align="left"),
            Column("tok_s", "throughput (tok/s)", fmt="{:,.2f}".format),
            Column("blocks", "peak blocks"),
        ],
        [{"run": "paged", "tok_s": 761.17, "blocks": 12}, {"run": "orca-max <b>", "tok_s": 1234.5, "blocks": None}],
        **kw,
    )


def test_html_cells_never_wrap_and_numbers_are_right_aligned():
    h = _table(title="Throughput")._repr_html_()
    cells = re.findall(r"<td style=\"([^\"]*)\"", h)
    assert len(cells) == 2 * 3
    assert all("white-space:nowrap" in s and "tabular-nums" in s for s in cells)
    # headers may wrap between words so that a wide table fits a laptop's notebook column
    headers = re.findall(r"<th style=\"([^\"]*)\"", h)
    assert len(headers) == 3 and all("white-space:normal" in s for s in headers)
    assert (
        '<td style="white-space:nowrap;font-variant-numeric:tabular-nums;padding:2px 10px;text-align:right">761.17</td>'
        in h
    )
    assert 'text-align:left">paged</td>' in h
    assert "<caption" in h and "Throughput</caption>" in h
    assert "throughput (tok/s)" in h


def test_html_escapes_text():
    h = _table(title="a < b", notes=["x & y"])._repr_html_()
    assert "orca-max &lt;b&gt;" in h and "<b>" not in h
    assert "a &lt; b" in h and "x &amp; y" in h


def test_renderings_are_deterministic():
    assert _table()._repr_html_() == _table()._repr_html_()
    assert str(_table()) == repr(_table()) == _table().text()
    assert "id=" not in _table()._repr_html_()


def test_text_rendering_is_aligned():
    lines = _table(title="T", notes=["note"]).text().splitlines()
    assert lines[0] == "T" and lines[-1] == "note"
    head, a, b = lines[1:4]
    assert head == "run           throughput (tok/s)  peak blocks"
    assert a == "paged                     761.17           12"
    assert b == "orca-max <b>            1,234.50            -"
    assert len(head) == len(a) == len(b)


def test_values_stay_readable():
    t = _table()
    assert t.to_rows()[0] == {"run": "paged", "tok_s": 761.17, "blocks": 12}
    assert t.rows == t.to_rows() and t.column("blocks") == [12, None] and len(t) == 2
    assert t.cells()[1] == ["orca-max <b>", "1,234.50", "-"]
    t.rows[0]["run"] = "changed"
    assert t.column("run")[0] == "paged"


def test_plain_keys_and_bad_alignment():
    t = Table(["a", "b"], [{"a": 1, "b": "x"}])
    assert t.headers == ["a", "b"] and t.text() == "a  b\n1  x"
    with pytest.raises(ValueError, match="align"):
        Column("a", align="centre")


def test_a_table_of_labelled_values_has_no_header():
    t = Table(
        [Column("k", align="left"), Column("v")], [{"k": "steps", "v": 12}, {"k": "peak blocks", "v": 7}], header=False
    )
    assert t.text() == "steps        12\npeak blocks   7"
    assert "<th" not in t._repr_html_() and "<thead" not in t._repr_html_()


# ---------------------------------------------------------------- the labs' tables
def test_lab_tables_keep_their_values_and_units():
    from workbench.labs import ch01_kv_cache_anatomy as ch
    from workbench.labs import ch05_batching_strategies as ch5
    from workbench.labs import ch07_parameter_matrix as sweep
    from workbench.labs import ch08_chunked_prefill as chunked
    from workbench.labs import ch10_nccl_buffers as nccl_buffers
    from workbench.labs.panel import summary_card

    kv = ch.kv_table(["llama-2-7b"])
    assert kv.to_rows()[0]["kv_bytes_per_token"] == 524288 and "512.00 KiB" in str(kv)
    pad = ch5.padding_table([128, 256, 384, 512], group_size=2)
    assert pad.column("slots") == [2048, 1536, 1280] and "saves (% of one batch)" in pad.headers
    buf = nccl_buffers.buffer_table(nccl_buffers.buffer_rows(sizes=(2,)))
    assert "per rank (MiB)" in buf.headers and "white-space:nowrap" in buf._repr_html_()
    rows = [
        {"label": "a", "error": None, "kv_utilization": 0.5, "output_throughput_tok_s": 761.17},
        {"label": "b", "error": "refused: too small", "kv_utilization": None, "output_throughput_tok_s": None},
    ]
    t = sweep.sweep_table(rows, ["kv_utilization", "output_throughput_tok_s"])
    assert t.cells() == [["a", "50.0%", "761.17"], ["b", "refused", "-"]]
    assert t.notes == ["b: refused: too small"] and "output throughput (tok/s)" in t.headers
    tr = chunked.tradeoff_table(
        [{"label": "B=64 chunked", "ttft_p99_s": 0.1234, "long_chunks": [2, 3]}], ["ttft_p99_s", "long_chunks"]
    )
    assert tr.cells() == [["B=64 chunked", "123", "2/3"]] and "TTFT p99 (ms)" in tr.headers
    summ = {"steps": 10, "mean_running": 2.5, "peak_blocks_used": 4, "preemptions": 0, "token_states": 0.9,
            "reservation": 0.0, "internal_fragmentation": 0.1, "external_fragmentation": 0.0}  # fmt: skip
    card = summary_card("paged", summ)
    assert "external frag. (% of used)" in card.to_html() and "<th" not in card.to_html()
