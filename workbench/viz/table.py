"""Tables that read the same in a notebook and in a terminal.

A :class:`Table` holds rows of raw values and, per column, a header (with its unit), an alignment and
a formatter. In JupyterLab it shows as an HTML ``<table>`` whose cells never wrap (a number such as
``761.17`` stays on one line; a table wider than the page scrolls sideways), numbers right-aligned in
tabular figures; ``str()``/``repr()`` give the same cells as a fixed-width text table, which is what a
terminal, ``print`` and nbval see. Both renderings are deterministic: the same rows give the same text
and the same HTML (no random ids, no timestamps).

Example::

    Table([Column("run", "run", align="left"), Column("tok_s", "throughput (tok/s)", fmt="{:,.2f}".format)],
          [{"run": "paged", "tok_s": 761.17}], title="Output throughput")
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Column", "Table", "plain"]


def plain(value: Any) -> str:
    """The default cell text: ``-`` for ``None``, ``str(value)`` otherwise."""
    return "-" if value is None else str(value)


@dataclass(frozen=True)
class Column:
    """One column: ``key`` into each row, ``header`` (with the unit, e.g. ``"TPOT p50 (ms)"``),
    ``align`` (``"right"`` for numbers, ``"left"`` for names and text), ``fmt`` (raw value -> cell
    text) and ``prose`` (sentences: its cells wrap between words, class ``wb-prose``, instead of
    running off the side; number columns never wrap)."""

    key: str
    header: str | None = None
    fmt: Callable[[Any], str] = plain
    align: str = "right"
    prose: bool = False

    def __post_init__(self) -> None:
        if self.align not in ("left", "right"):
            raise ValueError(f"align={self.align!r}: use 'left' or 'right'")

    @property
    def title(self) -> str:
        """The header text (the key when no header was given)."""
        return self.key if self.header is None else self.header


_TABLE_STYLE = "border-collapse:collapse;table-layout:auto;margin-left:0;margin-right:auto;width:auto"
_CELL_STYLE = "white-space:nowrap;font-variant-numeric:tabular-nums;padding:2px 10px"
# headers may wrap between words (never inside one), so a wide table fits a laptop's notebook column
_HEADER_STYLE = "white-space:normal;vertical-align:bottom;padding:2px 10px"
# a prose column (sentences) wraps between words, never inside one
_PROSE_STYLE = "white-space:normal;overflow-wrap:normal;padding:2px 10px;text-align:left;min-width:16em"


class Table:
    """Rows of raw values shown as a table: HTML in a notebook (cells never wrap), fixed-width text in
    ``str()``/``repr()``.

    Args:
        columns: :class:`Column` objects, or plain keys (a right-aligned column headed by the key).
        rows: one mapping per row, from column key to raw value (extra keys are kept in :attr:`rows`).
        title: a line above the table (what it shows).
        notes: lines below the table (units, footnotes, a summary).
        header: show the header line (``False`` for a table of labelled values, whose labels are cells).

    The values stay readable: :attr:`rows` / :meth:`to_rows` give the raw rows, :meth:`column` one
    column's raw values, :meth:`cells` the formatted text of every cell.
    """

    def __init__(
        self,
        columns: Sequence[Column | str],
        rows: Sequence[Mapping[str, Any]],
        *,
        title: str | None = None,
        notes: Sequence[str] | str = (),
        header: bool = True,
    ) -> None:
        self.columns = [c if isinstance(c, Column) else Column(c) for c in columns]
        self._rows = [dict(r) for r in rows]
        self.title = title
        self.notes = [notes] if isinstance(notes, str) else list(notes)
        self.header = header

    # ---------------------------------------------------------------- values
    @property
    def rows(self) -> list[dict[str, Any]]:
        """The raw rows (copies), as given."""
        return [dict(r) for r in self._rows]

    def to_rows(self) -> list[dict[str, Any]]:
        """The raw rows (copies), as given: what an exercise or a test reads."""
        return self.rows

    def column(self, key: str) -> list[Any]:
        """The raw values of one column, row by row."""
        return [r.get(key) for r in self._rows]

    @property
    def headers(self) -> list[str]:
        """The column headers, left to right."""
        return [c.title for c in self.columns]

    def cells(self) -> list[list[str]]:
        """The formatted text of every cell, row by row."""
        return [[c.fmt(r.get(c.key)) for c in self.columns] for r in self._rows]

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Table):
            return NotImplemented
        return str(self) == str(other) and self._rows == other._rows

    __hash__ = None  # type: ignore[assignment]

    # ---------------------------------------------------------------- renderings
    def text(self) -> str:
        """The fixed-width text table: the title, the header, one line per row (columns two spaces
        apart, aligned as the columns say), then the notes."""
        head = self.headers
        body = self.cells()
        widths = [max(len(x) for x in col) for col in zip(head if self.header else [""] * len(head), *body)]

        def line(cells: Sequence[str]) -> str:
            return "  ".join(
                x.ljust(w) if c.align == "left" else x.rjust(w) for x, w, c in zip(cells, widths, self.columns)
            ).rstrip()

        lines = ([self.title] if self.title else []) + ([line(head)] if self.header else []) + [line(r) for r in body]
        return "\n".join(lines + self.notes)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle: bool) -> None:  # IPython's text/plain
        p.text(self.text())

    def _repr_html_(self) -> str:
        """A deterministic HTML ``<table>``: the title as its caption; cells with ``white-space:nowrap``
        and tabular figures, numbers right-aligned; headers that wrap between words only where the
        table would not fit otherwise; text escaped."""
        esc = html.escape
        out = [f'<div class="wb-table" style="overflow-x:auto;max-width:100%"><table style="{_TABLE_STYLE}">']
        if self.title:
            out.append(
                f'<caption style="text-align:left;caption-side:top;white-space:normal">{esc(self.title)}</caption>'
            )
        if self.header:
            out.append("<thead><tr>")
            for c in self.columns:
                out.append(f'<th style="{_HEADER_STYLE};text-align:{c.align}">{esc(c.title)}</th>')
            out.append("</tr></thead>")
        out.append("<tbody>")
        for row in self.cells():
            out.append("<tr>")
            for x, c in zip(row, self.columns):
                if c.prose:
                    out.append(f'<td class="wb-prose" style="{_PROSE_STYLE}">{esc(x)}</td>')
                else:
                    out.append(f'<td style="{_CELL_STYLE};text-align:{c.align}">{esc(x)}</td>')
            out.append("</tr>")
        out.append("</tbody></table>")
        for n in self.notes:
            out.append(f'<div style="margin-top:4px">{esc(n)}</div>')
        out.append("</div>")
        return "".join(out)

    def to_html(self) -> str:
        """The HTML of :meth:`_repr_html_` (for a widget's ``value`` or a report)."""
        return self._repr_html_()
