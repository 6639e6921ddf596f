"""The report page's template (processors/analytics/report_page.py): values escaped by the engine, the
plots' SVG passed through, tables compact and capped."""
from __future__ import annotations

from kvpipe.processors.analytics.report_page import render_page


def _section(**kw):
    base = {"name": "q", "title": "T", "means": "", "plot": None, "bucket_s": None, "span": "", "method": "",
            "table": {"columns": ["a"], "rows": [["1"]], "more": 0}}
    return {**base, **kw}


def test_values_are_escaped_and_the_svg_is_not():
    evil = "<script>alert(1)</script>"
    page = render_page("now", {"columns": ["table"], "rows": [[evil]], "more": 0},
                       [_section(title=evil, means=evil, plot="<svg><path d='M 0 0'/></svg>",
                                 table={"columns": [evil], "rows": [["x&y", evil]], "more": 0})])
    assert "<script>" not in page and page.count("&lt;script&gt;") == 5
    assert "<figure class='plot' data-query='q'><svg><path d='M 0 0'/></svg></figure>" in page
    assert "<td>x&amp;y</td>" in page


def test_tables_are_one_line_of_cells_and_say_how_many_rows_were_left_out():
    page = render_page("now", {"columns": [], "rows": [], "more": 0},
                       [_section(table={"columns": ["m", "n"], "rows": [["GPU", "3"], ["CPU", ""]], "more": 7},
                                 bucket_s=1, span="1.000 2.000", plot="<svg/>")])
    assert "<tr><td>GPU</td><td>3</td></tr><tr><td>CPU</td><td></td></tr>" in page
    assert "7 more rows: run the saved query for all" in page
    assert "data-bucket-s='1' data-span='1.000 2.000'" in page
    assert "<section id='store'><h2>What the store holds</h2><p><em>no rows</em></p></section>" in page
