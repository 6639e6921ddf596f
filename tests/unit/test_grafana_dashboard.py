"""The provisioned Grafana dashboard runs exactly the saved queries."""
from __future__ import annotations

import json

from kvpipe.processors.analytics.grafana import dashboard, grafana_sql
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
