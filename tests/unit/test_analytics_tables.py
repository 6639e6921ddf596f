"""The analytics table registry (processors/analytics/tables.py) against the migrations that create
the tables, and the writer-side functions each entry carries."""
from __future__ import annotations

import pytest
import sqlglot
from sqlglot import exp

from kvpipe.processors.analytics import tables
from kvpipe.processors.analytics.migrations import load_migrations
from kvpipe.processors.analytics.rows import EventRow, LoadRow
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.processors.analytics.sqlguard import DIALECT, check_sql
from kvpipe.processors.core.lifetimes import REASON_EVICTED, LifetimeRow


def _created() -> dict[str, list[str]]:
    """Table or view name -> its column names ([] for views), from the migrations' DDL (CREATE, then
    ALTER ... ADD COLUMN)."""
    out: dict[str, list[str]] = {}
    for mig in load_migrations():
        for statement in sqlglot.parse(mig.sql, read=DIALECT):
            if isinstance(statement, exp.Alter):
                out.setdefault(statement.this.name, []).extend(c.name for c in statement.find_all(exp.ColumnDef))
            elif isinstance(statement, exp.Create):
                target = statement.this
                if isinstance(target, exp.Schema):
                    out[target.this.name] = [c.name for c in target.expressions if isinstance(c, exp.ColumnDef)]
                elif isinstance(target, exp.Table):
                    out.setdefault(target.name, [])
    return out


def test_every_registered_table_is_created_with_its_columns_and_a_final_view():
    created = _created()
    assert [t.name for t in tables.TABLES] == list(tables.BY_NAME)
    for table in tables.TABLES:
        assert table.name in created, f"{table.name}: no migration creates it"
        missing = [c for c in table.columns if c not in created[table.name]]
        assert missing == [], f"{table.name}: columns the insert names but the table lacks: {missing}"
        assert f"{table.name}_final" in created, f"{table.name}: no _final view (the exactly-once read)"


def test_the_store_summary_passes_the_analyst_gate_and_names_every_table():
    sql = check_sql(tables.store_summary_sql())
    for table in tables.TABLES:
        assert f"FROM {table.name}_final" in sql


def _rows() -> dict[str, list]:
    event = EventRow("n1", 1, 0, 0, 0, "GPU", "stored", [7, 8], None, 2, 32, 16, "full_attention", 10.0, 10.5, 0, 3, 0)
    life = LifetimeRow("n1", 1, 0, "GPU", 7, 10.0, 12.0, REASON_EVICTED, 0, 4, 0)
    load = LoadRow("n1", 1, 0, 10.0, 2, 1, 0.5, 0, 3)
    twin = LifetimeRow("n1", 1, 0, "GPU", 7, 10.0, 12.0, REASON_EVICTED, 0, 4, 0)
    return {tables.EVENTS: [event], tables.LIFETIMES: [life, twin], tables.LOADS: [load], tables.RESTORES: []}


def test_each_entry_turns_a_submit_into_insert_columns_of_its_width():
    for name, rows in _rows().items():
        table = tables.BY_NAME[name]
        batch = table.batch()
        table.take(batch, rows)
        table.take(batch, rows)  # two submits concatenate
        assert len(batch) == 2 * len(rows)
        data = table.insert(batch[0:len(batch)])
        assert len(data) == len(table.columns), name
        assert all(len(column) == 2 * len(rows) for column in data), name


def test_lifetimes_of_one_block_in_one_submit_get_copy_numbers():
    table = tables.BY_NAME[tables.LIFETIMES]
    batch = table.batch()
    table.take(batch, _rows()[tables.LIFETIMES])
    copies = table.insert(batch[0:2])[table.columns.index("copy_idx")]
    assert sorted(copies) == [0, 1]


def test_the_sink_refuses_rows_for_a_table_nobody_registered():
    sink = AnalyticsSink("chdb://unused")
    with pytest.raises(ValueError, match="no such analytics table"):
        sink.submit({"kv_nothing": [1]})
    assert tables.rows_count({tables.EVENTS: [1, 2], tables.LOADS: [3]}) == 3
