"""Tables for people, drawn by `terminaltables`: the one look of `kvpipe sql`, `kvpipe plan` and
`kvpipe route` on a terminal (`text`), and GitHub-flavoured Markdown for pasting into notes.

Machine formats (CSV, JSON) are not here: they are written by the csv and json modules, where a
reader expects exact values rather than aligned text.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

STYLES = ("text", "markdown")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def number_columns(rows: Sequence[Sequence[Any]], width: int) -> list[int]:
    """Columns whose values are all numbers (NULLs aside, at least one number): right-aligned."""
    return [i for i in range(width)
            if any(_is_number(r[i]) for r in rows) and all(r[i] is None or _is_number(r[i]) for r in rows)]


def render(header: Sequence[Any], rows: Iterable[Sequence[Any]], style: str = "text",
           right: Iterable[int] | None = None) -> str:
    """`header` and `rows` as one table; None cells are empty. `right`: the columns to right-align
    (default: the all-number ones, see `number_columns`)."""
    from terminaltables import AsciiTable, GithubFlavoredMarkdownTable

    rows = [list(r) for r in rows]
    right = number_columns(rows, len(header)) if right is None else list(right)
    cells = [[_cell(v) for v in header]] + [[_cell(v) for v in r] for r in rows]
    if style == "markdown":
        # a `|` inside a cell would end it; Markdown table rows are single lines
        cells = [[c.replace("|", "\\|").replace("\n", " ") for c in r] for r in cells]
        table = GithubFlavoredMarkdownTable(cells)
    elif style == "text":
        table = AsciiTable(cells)
    else:
        raise ValueError(f"table style {style!r}: expected one of {', '.join(STYLES)}")
    table.justify_columns = {i: "right" for i in right}
    return table.table
