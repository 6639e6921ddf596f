"""Tables for people (`kvpipe sql`, `plan`, `route`): one terminaltables look, numbers right-aligned,
NULLs empty, Markdown that survives a `|` in a cell; CSV and JSON keep exact values."""
from __future__ import annotations

import json

import pytest

from kvpipe.processors.analytics.cli import print_result
from kvpipe.processors.analytics.plan import render as render_plan
from kvpipe.processors.core.texttable import number_columns, render

RESULT = {"columns": ["medium", "swa_evicted", "ratio"], "types": ["String", "UInt64", "Nullable(Float64)"],
          "rows": [["GPU", 3, None], ["CPU", 12345, 0.5]]}


def test_a_text_table_has_borders_and_right_aligned_numbers():
    lines = render(RESULT["columns"], RESULT["rows"]).splitlines()
    assert lines[0] == lines[2] == lines[-1] == "+--------+-------------+-------+"
    assert lines[1] == "| medium | swa_evicted | ratio |"
    assert lines[3] == "| GPU    |           3 |       |"  # NULL: an empty cell, not "None"
    assert lines[4] == "| CPU    |       12345 |   0.5 |"


def test_markdown_escapes_pipes_and_marks_alignment():
    lines = render(["q", "n"], [["a|b", 1], ["line\nbreak", 22]], style="markdown").splitlines()
    assert lines[0] == "| q          |  n |"
    assert lines[1] == "|------------|---:|"
    assert lines[2] == "| a\\|b       |  1 |"
    assert lines[3] == "| line break | 22 |"


def test_only_all_number_columns_are_right_aligned():
    assert number_columns([[1, "x", None, True], [2.5, 3, None, False]], 4) == [0]
    with pytest.raises(ValueError, match="table style"):
        render(["a"], [], style="html")


def test_sql_formats(capsys):
    print_result(RESULT, "table")
    out = capsys.readouterr().out.splitlines()
    assert out[1].split("|")[1:-1] == [" medium ", " swa_evicted ", " ratio "] and out[-1] == "(2 rows)"
    print_result(RESULT, "markdown")
    assert capsys.readouterr().out.splitlines()[1] == "|--------|------------:|------:|"
    print_result(RESULT, "csv")
    assert capsys.readouterr().out.splitlines() == ["medium,swa_evicted,ratio", "GPU,3,", "CPU,12345,0.5"]
    print_result(RESULT, "json")  # ClickHouse's JSON layout
    doc = json.loads(capsys.readouterr().out)
    assert doc["meta"] == [{"name": "medium", "type": "String"}, {"name": "swa_evicted", "type": "UInt64"},
                           {"name": "ratio", "type": "Nullable(Float64)"}]
    assert doc["data"] == [{"medium": "GPU", "swa_evicted": 3, "ratio": None},
                           {"medium": "CPU", "swa_evicted": 12345, "ratio": 0.5}]
    assert doc["rows"] == 2 and "elapsed" in doc["statistics"]


def test_the_plan_prints_one_table_per_curve():
    point = {"extra_fraction": 0.5, "extra_blocks": 64, "cache_blocks": 192, "hits": 40, "hit_fraction": 0.25,
             "tokens_saved": 640}
    plan = {"method": "LRU stack distances.", "curves": [
        {"node_id": "n1", "group_kind": "sliding_window", "medium": "GPU", "capacity": 128, "restores": 160,
         "points": [point, {**point, "extra_fraction": -0.25, "extra_blocks": -32, "hits": 0, "hit_fraction": 0.0}]}]}
    lines = render_plan(plan).splitlines()
    assert lines[0] == "n1  sliding_window  GPU: observed capacity 128 blocks, 160 re-stores"
    assert lines[2] == "| change | extra blocks | cache blocks | hits | hit % | tokens saved |"
    assert lines[4] == "|    50% |           64 |          192 |   40 | 25.0% |          640 |"
    assert lines[5] == "|   -25% |          -32 |          192 |    0 |  0.0% |          640 |"
    assert lines[-1] == "LRU stack distances."


def test_the_route_answer_is_a_table_of_nodes(capsys):
    from types import SimpleNamespace as Row

    from kvpipe.processors.routing.cli import _print_answer

    nodes = [Row(node_id="node-y", state="live", gpu_tokens=16, loadable_tokens=0, score=0.51234, speculative=False,
                 load=Row(running=2, waiting=1, kv_usage=0.3125), exact=True, reason=None),
             Row(node_id="node-x", state="suspect", gpu_tokens=0, loadable_tokens=32, score=0.1, load=None,
                 speculative=True, exact=False, reason="no hash config")]
    _print_answer(Row(chosen="node-y", semantics="hma", num_tokens=65, hashing_s=1e-4, search_s=2e-4, partial=False,
                      missing_partitions=[], nodes=nodes, no_signal=[]))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("chosen: node-y   semantics: hma")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in (lines[2], lines[4], lines[5])]
    assert cells[0] == ["node", "state", "gpu_tok", "cpu_tok", "score", "run", "wait", "kv", "note"]
    assert cells[1] == ["node-y", "live", "16", "0", "0.5123", "2", "1", "0.31", ""]
    assert cells[2][-1] == "speculative; not exact: no hash config"
