"""The analytics tables as data: one `Table` per ClickHouse table the app writes, in one registry.

A table is its name (the migration in infra/clickhouse/migrations creates it and its `<name>_final`
view), the row type one message yields, the columns in insert order, and three plain functions the
sink's writer thread runs: an empty batch, `take` (one submit's rows into the batch: rows become
columns, lifetimes are numbered), and `insert` (a slice of the batch as the column lists the insert
sends), plus the column that says when a row happened. The sink, the per-message derive step (`derive.message_rows` returns rows keyed by table
name) and the report's store summary iterate `TABLES`, so a new analytics table is a migration, a
row type with its column mapping, and one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sized
from typing import Any, Callable, Mapping

from kvpipe.processors.analytics.restores import RESTORE_COLUMNS, RestoreRow, restore_columns
from kvpipe.processors.analytics.rows import (
    EVENT_COLUMNS, LIFETIME_COLUMNS, LOAD_COLUMNS, EventColumns, EventRow, LoadRow, event_columns, load_columns,
    number_copies,
)
from kvpipe.processors.core import lifetimes as lifecols, native
from kvpipe.processors.core.lifetimes import LifetimeColumns, LifetimeRow


@dataclass(frozen=True)
class Table:
    name: str
    holds: str  # one line for people (the report's store summary)
    row: type  # what one row is (the reference form; the app may send the same values as columns)
    columns: tuple[str, ...]  # insert order
    batch: Callable[[], Any]  # an empty writer-side batch: supports len, extend, [a:b], del [a:b]
    take: Callable[[Any, Any], None]  # (batch, one submit's rows): add them to the batch
    insert: Callable[[Any], list[list]]  # a slice of the batch -> the column lists to insert
    time_column: str  # when a row happened (the dashboard's time picker filters on it)


def _take_events(batch: EventColumns, rows: EventColumns | list[EventRow]) -> None:
    batch.extend(rows if isinstance(rows, EventColumns) else EventColumns(event_columns(rows)))


def _take_lifetimes(batch: LifetimeColumns, rows: LifetimeColumns | list[LifetimeRow]) -> None:
    # A copy number is set per submit: a message's lifetimes of one block are numbered together.
    if isinstance(rows, LifetimeColumns):
        lifecols.number_copies(rows)
    else:
        number_copies(rows)
        rows = LifetimeColumns.from_rows(rows)
    batch.extend(rows)


def _insert_lifetimes(rows: LifetimeColumns) -> list[list]:
    return rows.insert_columns()


def _insert_events(rows: list[list]) -> list[list]:
    return rows  # an EventColumns slice is the column lists already


EVENTS = "kv_events"
LIFETIMES = "kv_block_lifetimes"
RESTORES = "kv_restores"
LOADS = "kv_node_load"

TABLES: tuple[Table, ...] = (
    Table(EVENTS, "every KV event: stored, removed, cleared", EventRow, EVENT_COLUMNS, EventColumns,
          _take_events, _insert_events, "ts"),
    Table(LIFETIMES, "block lifetimes: stored until evicted, cleared or the node expired", LifetimeRow,
          LIFETIME_COLUMNS, LifetimeColumns, _take_lifetimes, _insert_lifetimes, "removed_ts"),
    Table(RESTORES, "re-stores of evicted blocks and their reuse distances", RestoreRow, RESTORE_COLUMNS, list,
          list.extend, restore_columns, "restored_ts"),
    Table(LOADS, "the load each node reported (running, waiting, KV usage)", LoadRow, LOAD_COLUMNS, list,
          list.extend, load_columns, "ts"),
)
BY_NAME: dict[str, Table] = {t.name: t for t in TABLES}


# -- native batches: the writer's batch of a table as native columns (native/src/pychcols.rs: NativeRows), encoded
#    to ClickHouse's Native format natively; the sink inserts the bytes as they are (`sink.AnalyticsSink`) --------


def native_batch(table: Table) -> native.NativeRows:
    """An empty native batch of the table: what the sink's writer fills when the native core runs."""
    return native.native_rows(table.name)


def native_take(table: Table, batch: native.NativeRows, rows: Any) -> None:
    """`Table.take` into a native batch: a native run's rows as they are, any other form through the table's own
    `take` and `insert` (the Python row path's rows: messages the native run left to the reference)."""
    if type(rows) is type(batch):
        batch.extend(rows)
        return
    python_batch = table.batch()
    table.take(python_batch, rows)
    batch.extend_columns(table.insert(python_batch[0:len(python_batch)]))  # `insert` takes a slice, as the writer's

# The rows of one message, by table name; a table with nothing to write may be absent.
MessageRows = Mapping[str, Sized]


def rows_count(rows: MessageRows) -> int:
    return sum(len(r) for r in rows.values())


def store_summary_sql() -> str:
    """One statement counting each table's rows through its `_final` view (exactly once)."""
    return " UNION ALL ".join(f"SELECT '{t.name}' AS name, count() AS rows FROM {t.name}_final" for t in TABLES)
