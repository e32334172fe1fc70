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
    cells = re.findall(r"<t[dh] style=\"([^\"]*)\"", h)
    assert len(cells) == 3 * 3
    assert all("white-space:nowrap" in s and "tabular-nums" in s for s in cells)
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
