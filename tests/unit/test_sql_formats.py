"""`kvpipe sql --format`: ClickHouse's output formats written the way the engine writes them, and
the command's clickhouse-client spellings (processors/analytics/formats.py, analytics/cli.py)."""
from __future__ import annotations

import json

import click
import pytest

from kvpipe.processors.analytics import formats
from kvpipe.processors.analytics.cli import _output_format, _params, _split_loose

RESULT = {"columns": ["name", "n", "ratio"], "types": ["String", "UInt64", "Nullable(Float64)"],
          "rows": [["a\tb\\c", 3, None], ["line\nbreak", 12345, 0.5]]}


def test_tab_separated_escapes_like_the_engine_and_writes_null_as_backslash_n():
    assert formats.write(RESULT, "TSV") == "a\\tb\\\\c\t3\t\\N\nline\\nbreak\t12345\t0.5\n"
    assert formats.write(RESULT, "TabSeparatedWithNamesAndTypes").splitlines()[:2] == [
        "name\tn\tratio", "String\tUInt64\tNullable(Float64)"]


def test_csv_quotes_strings_and_writes_null_as_the_engine_does_while_kvpipes_csv_stays_as_it_was():
    assert formats.write(RESULT, "CSV").splitlines() == ['"a\tb\\c",3,\\N', '"line', 'break",12345,0.5']
    assert formats.write(RESULT, "CSVWithNames").splitlines()[0] == '"name","n","ratio"'
    assert formats.write({"columns": ["m", "r"], "types": [], "rows": [["GPU", None]]}, "csv") == "m,r\nGPU,\n"


def test_json_has_clickhouses_layout_and_json_each_row_one_object_per_line():
    doc = json.loads(formats.write(RESULT, "JSON", elapsed_s=0.25))
    assert list(doc) == ["meta", "data", "rows", "statistics"]
    assert doc["meta"][1] == {"name": "n", "type": "UInt64"} and doc["rows"] == 2
    assert doc["data"][0] == {"name": "a\tb\\c", "n": 3, "ratio": None} and doc["statistics"] == {"elapsed": 0.25}
    lines = formats.write({"columns": ["x"], "types": ["Float64"], "rows": [[float("nan")], [1.5]]},
                          "JSONEachRow").splitlines()
    assert [json.loads(line) for line in lines] == [{"x": None}, {"x": 1.5}]


def test_pretty_compact_draws_a_box_with_numbers_right_aligned_and_null_spelled_out():
    out = formats.write({"columns": ["k", "v"], "types": [], "rows": [["ab", 1], ["c", None], ["日本", 100]]},
                        "PrettyCompact").splitlines()
    assert out == ["┌─k────┬────v─┐",
                   "│ ab   │    1 │",
                   "│ c    │ NULL │",
                   "│ 日本 │  100 │",
                   "└──────┴──────┘"]


def test_names_are_case_sensitive_and_unknown_ones_refused():
    assert formats.canonical("TSV") == "TabSeparated" and formats.canonical("json") == "JSON"
    assert formats.canonical("csv") == "csv" != formats.canonical("CSV")
    with pytest.raises(ValueError, match="unknown format 'tsv'"):
        formats.canonical("tsv")


def test_clickhouse_client_parameters_and_statements_from_loose_arguments():
    statements, loose = _split_loose(["--param_a=1", "SELECT {a:UInt8} + {b:UInt8}", "--param_b", "2"])
    assert statements == ["SELECT {a:UInt8} + {b:UInt8}"]
    assert _params(("c=3",), loose) == {"c": "3", "a": "1", "b": "2"}
    with pytest.raises(click.UsageError, match="no such option"):
        _split_loose(["--nope"])
    with pytest.raises(click.BadParameter):
        _params(("novalue",), [])


def test_one_output_format_from_the_three_flags():
    assert _output_format(None, None, False) == "table"
    assert _output_format(None, "json", True) == "JSON" == _output_format("JSON", None, False)
    with pytest.raises(click.UsageError, match="disagree"):
        _output_format("CSV", "table", False)
