"""The provisioned Grafana dashboard runs exactly the saved queries."""
from __future__ import annotations

import json

import re

from kvpipe.processors.analytics.grafana import TIME_SERIES, dashboard, grafana_sql, in_range
from kvpipe.processors.analytics.saved import list_queries
from kvpipe.processors.analytics.sqlguard import check_read_only
from kvpipe.bench.procrun import REPO


def test_committed_dashboard_is_the_generated_one():
    committed = json.loads((REPO / "infra/grafana/dashboards/kvpipe-capacity.json").read_text())
    assert committed == dashboard(), "regenerate: python -m kvpipe.processors.analytics.grafana > infra/grafana/dashboards/kvpipe-capacity.json"


def test_one_panel_per_saved_query_with_its_parameters_as_variables():
    board = dashboard()
    queries = list_queries()
    assert [p["description"] for p in board["panels"]] == [f"kvpipe sql --saved {q.name}" for q in queries]
    names = {v["name"] for v in board["templating"]["list"]}
    for q in queries:
        sql = grafana_sql(q)
        assert "{" not in sql.replace("${", "")  # every ClickHouse binding became a variable
        assert {p.name for p in q.params} <= names
        # with the defaults filled in, it is still read-only SQL the analyst guard accepts
        filled = sql
        for p in q.params:
            filled = filled.replace(f"${{{p.name}}}", p.default)
        check_read_only(filled)


def test_every_panel_honours_the_time_picker_and_stays_guard_clean():
    board = dashboard()
    for panel, query in zip(board["panels"], list_queries()):
        sql = panel["targets"][0]["rawSql"]
        assert "$__timeFilter(" in sql, f"{query.name}: ignores the dashboard's time range"
        if query.name in TIME_SERIES:
            assert sql.rstrip().endswith("WHERE $__timeFilter(bucket) ORDER BY bucket")
        else:
            assert not re.search(r"FROM kv_\w+_final(?! WHERE \$__timeFilter)", sql), sql
        # the macro as Grafana expands it, the variables at their defaults: read-only SQL the guard accepts
        filled = re.sub(r"\$__timeFilter\((\w+)\)", r"(\1 >= toDateTime(1700000000) AND \1 <= toDateTime(1800000000))",
                        sql)
        for p in query.params:
            filled = filled.replace(f"${{{p.name}}}", p.default)
        check_read_only(filled)
    assert in_range("SELECT 1 FROM kv_events_final AS e", False) == \
        "SELECT 1 FROM (SELECT * FROM kv_events_final WHERE $__timeFilter(ts)) AS e"
