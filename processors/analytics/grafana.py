"""The Grafana dashboard over the saved queries: `infra/grafana/dashboards/kvpipe-capacity.json`.

Generated, not hand-edited, so it runs the same SQL as `kvpipe sql --saved` (a unit test holds the
committed file equal to `dashboard()`). Grafana's ClickHouse data source (grafana-clickhouse-datasource)
does not know ClickHouse's `{name:Type}` parameter binding, so each parameter becomes a dashboard
variable (a text box holding the saved query's default), substituted as `${name}` — quoted for strings.
Grafana sends the text as it is, so point the data source at a read-only ClickHouse user
(docs/analyst-sql.md): the dashboard reads, it cannot be made to write.

Regenerate: `python -m kvpipe.processors.analytics.grafana > infra/grafana/dashboards/kvpipe-capacity.json`.
"""
from __future__ import annotations

import json
import re
from typing import Any

from kvpipe.processors.analytics.saved import SavedQuery, list_queries
from kvpipe.processors.analytics.tables import TABLES

DATASOURCE = {"type": "grafana-clickhouse-datasource", "uid": "${datasource}"}
TIME_SERIES = {"evictions_per_group", "node_occupancy"}  # queries with a `bucket` column plotted over time
_PARAM = re.compile(r"\{(\w+):(\w+)\}")


def grafana_sql(query: SavedQuery) -> str:
    def sub(m: re.Match) -> str:
        return f"'${{{m.group(1)}}}'" if m.group(2) == "String" else f"${{{m.group(1)}}}"

    body = "\n".join(line for line in query.sql.splitlines() if not line.startswith("--"))
    return _PARAM.sub(sub, body).strip()


def in_range(sql: str, series: bool) -> str:
    """`sql` reading only what the dashboard's time picker selects (Grafana's `$__timeFilter` macro).

    A time series keeps its query whole and drops the buckets outside the range: its values may be
    running totals from the first row (occupancy), so its input must not be cut. Any other panel
    aggregates the rows whose time falls in the range: each table's `_final` view it reads is
    narrowed on the table's time column (`tables.TABLES`)."""
    if series:
        return f"SELECT * FROM (\n{sql}\n) WHERE $__timeFilter(bucket) ORDER BY bucket"
    for table in TABLES:
        sql = re.sub(rf"\b{table.name}_final\b",
                     f"(SELECT * FROM {table.name}_final WHERE $__timeFilter({table.time_column}))", sql)
    return sql


def _panel(i: int, query: SavedQuery) -> dict:
    series = query.name in TIME_SERIES
    return {
        "id": i + 1, "title": query.title, "type": "timeseries" if series else "table", "datasource": DATASOURCE,
        "description": f"kvpipe sql --saved {query.name}",
        "gridPos": {"h": 9, "w": 12, "x": 12 * (i % 2), "y": 9 * (i // 2)},
        "targets": [{"refId": "A", "datasource": DATASOURCE, "editorType": "sql", "queryType": "sql",
                     "format": 0 if series else 1, "rawSql": in_range(grafana_sql(query), series)}],
    }


def dashboard() -> dict:
    queries = list_queries()
    params: dict[str, str] = {}
    for q in queries:
        for p in q.params:
            params.setdefault(p.name, p.default)
    variables: list[dict[str, Any]] = [{"type": "datasource", "name": "datasource", "query": "grafana-clickhouse-datasource",
                  "label": "ClickHouse"}]
    variables += [{"type": "textbox", "name": name, "label": name, "query": default,
                   "current": {"text": default, "value": default}} for name, default in sorted(params.items())]
    return {
        "title": "kvpipe capacity planning", "uid": "kvpipe-capacity", "schemaVersion": 39, "version": 1,
        "editable": True, "time": {"from": "now-24h", "to": "now"}, "tags": ["kvpipe"],
        "templating": {"list": variables},
        "panels": [_panel(i, q) for i, q in enumerate(queries)],
    }


if __name__ == "__main__":
    print(json.dumps(dashboard(), indent=2))
