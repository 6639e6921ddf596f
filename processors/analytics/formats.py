"""Query results as `kvpipe sql --format NAME` writes them: ClickHouse's own output formats, so a
result reads the same from `clickhouse-client`, and kvpipe's text tables for people.

A result is what the store hands back (`{"columns", "types", "rows"}`, rows as lists). ClickHouse
format names are case-sensitive there and here; the lower-case names are kvpipe's own, kept with
the meaning they always had: `table` (the default bordered table), `markdown`, `csv` (a header row,
strings quoted only where needed, NULL as an empty field) and `json` (now ClickHouse's JSON layout).

Differences from the engine's writers, on purpose: 64-bit integers stay JSON numbers (ClickHouse
quotes them by default), and `statistics` carries the elapsed time measured by the client, with no
rows_read / bytes_read (the app's /sql does not report them).
"""
from __future__ import annotations

import csv
import io
import json
import math
import unicodedata
from datetime import date, datetime
from typing import Any, Callable

# ClickHouse's name -> its aliases (ClickHouse accepts TSV for TabSeparated and so on).
ALIASES = {"TSV": "TabSeparated", "TSVWithNames": "TabSeparatedWithNames", "TSVWithNamesAndTypes":
           "TabSeparatedWithNamesAndTypes", "markdown": "Markdown", "json": "JSON"}


def _text(value: Any) -> str:
    """A value as ClickHouse's text formats write it (NULL apart)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(value, date):
        return value.isoformat()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_quoted(v) for v in value) + "]"
    return str(value)


def _quoted(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return "NULL" if value is None else _text(value)


_TSV_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r", "\0": "\\0"})


def _tsv_cell(value: Any) -> str:
    return "\\N" if value is None else _text(value).translate(_TSV_ESCAPES)


def _tsv(result: dict, names: bool, types: bool) -> str:
    lines = []
    if names:
        lines.append("\t".join(c.translate(_TSV_ESCAPES) for c in result["columns"]))
    if types:
        lines.append("\t".join(result.get("types") or [""] * len(result["columns"])))
    lines += ["\t".join(_tsv_cell(v) for v in row) for row in result["rows"]]
    return "".join(line + "\n" for line in lines)


def _csv(result: dict, names: bool) -> str:
    """ClickHouse's CSV: every string in double quotes (a quote doubled), NULL as \\N, numbers bare."""
    def cell(v: Any) -> str:
        if v is None:
            return "\\N"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return _text(v)
        return '"' + _text(v).replace('"', '""') + '"'
    lines = [",".join(cell(c) for c in result["columns"])] if names else []
    lines += [",".join(cell(v) for v in row) for row in result["rows"]]
    return "".join(line + "\n" for line in lines)


def _kvpipe_csv(result: dict) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(result["columns"])
    writer.writerows([["" if v is None else v for v in row] for row in result["rows"]])
    return out.getvalue()


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf (ClickHouse writes null too, by default)
    if isinstance(value, (datetime, date)):
        return _text(value)
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    return value


def _objects(result: dict) -> list[dict]:
    cols = result["columns"]
    return [{c: _json_value(v) for c, v in zip(cols, row)} for row in result["rows"]]


def _json(result: dict, elapsed_s: float) -> str:
    types = result.get("types") or [""] * len(result["columns"])
    doc = {"meta": [{"name": c, "type": t} for c, t in zip(result["columns"], types)],
           "data": _objects(result), "rows": len(result["rows"]), "statistics": {"elapsed": round(elapsed_s, 6)}}
    return json.dumps(doc, indent="\t", default=str, ensure_ascii=False) + "\n"


def _json_each_row(result: dict) -> str:
    return "".join(json.dumps(o, default=str, ensure_ascii=False, separators=(",", ":")) + "\n"
                   for o in _objects(result))


def _width(text: str) -> int:
    """Columns a terminal gives `text` (East Asian wide characters take two)."""
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def _pretty_compact(result: dict) -> str:
    """ClickHouse's PrettyCompact: a box-drawn table, names in the top border, numbers right-aligned."""
    cols = result["columns"]
    cells = [["NULL" if v is None else _text(v) for v in row] for row in result["rows"]]
    widths = [max([_width(c)] + [_width(r[i]) for r in cells]) for i, c in enumerate(cols)]
    numeric = [bool(result["rows"]) and all(isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
                                            or r[i] is None for r in result["rows"]) for i in range(len(cols))]

    def pad(text: str, i: int) -> str:
        gap = " " * (widths[i] - _width(text))
        return gap + text if numeric[i] else text + gap

    def head(name: str, i: int) -> str:  # the name sits in the border, aligned like its column
        rule = "─" * (widths[i] - _width(name) + 1)
        return rule + name + "─" if numeric[i] else "─" + name + rule

    top = "┌" + "┬".join(head(c, i) for i, c in enumerate(cols)) + "┐"
    body = ["│ " + " │ ".join(pad(v, i) for i, v in enumerate(r)) + " │" for r in cells]
    bottom = "└" + "┴".join("─" * (w + 2) for w in widths) + "┘"
    return "\n".join([top, *body, bottom]) + "\n"


def _kvpipe_table(result: dict, style: str) -> str:
    from kvpipe.processors.core.texttable import render

    return render(result["columns"], result["rows"], style=style) + f"\n({len(result['rows'])} rows)\n"


WRITERS: dict[str, Callable[[dict, float], str]] = {
    "table": lambda r, _: _kvpipe_table(r, "text"),
    "Markdown": lambda r, _: _kvpipe_table(r, "markdown"),
    "TabSeparated": lambda r, _: _tsv(r, names=False, types=False),
    "TabSeparatedWithNames": lambda r, _: _tsv(r, names=True, types=False),
    "TabSeparatedWithNamesAndTypes": lambda r, _: _tsv(r, names=True, types=True),
    "csv": lambda r, _: _kvpipe_csv(r),
    "CSV": lambda r, _: _csv(r, names=False),
    "CSVWithNames": lambda r, _: _csv(r, names=True),
    "JSON": _json,
    "JSONEachRow": lambda r, _: _json_each_row(r),
    "PrettyCompact": lambda r, _: _pretty_compact(r),
}
NAMES = tuple(WRITERS) + tuple(a for a in ALIASES if a not in WRITERS)


def canonical(name: str) -> str:
    """The writer's name for `name` (a ClickHouse format, an alias, or kvpipe's own lower-case name)."""
    name = ALIASES.get(name, name)
    if name not in WRITERS:
        raise ValueError(f"unknown format {name!r}; one of {', '.join(NAMES)}")
    return name


def write(result: dict, name: str, elapsed_s: float = 0.0) -> str:
    return WRITERS[canonical(name)](result, elapsed_s)
