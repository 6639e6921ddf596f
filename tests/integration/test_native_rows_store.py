"""Native blocks of `kvpipe_native.NativeRows` inserted into a real chDB store (no broker needed): the same random
rows go into one migrated store through `raw_insert(..., fmt="Native")` of `encode()`, in several blocks, and into
another through clickhouse-connect's own `insert`; each table reads back from both as the rows that went in, for all
four analytics tables. The blocks declare exactly the types the migrations give the columns, and the engine reads
LowCardinality indexes of every width (one, two and four bytes, and one byte for exactly 256 values, where
clickhouse-connect writes two)."""
from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import clickhouse_connect
import pytest

from kvpipe.processors.analytics.chclient import client_kwargs
from kvpipe.processors.analytics.migrations import apply_migrations
from kvpipe.processors.analytics.tables import TABLES
from kvpipe.processors.core import native
from tests.nativecheck import require_native_core
from tests.nativerows import names_and_types, random_columns, rows_of

require_native_core()

pytestmark = pytest.mark.integration

# rows and distinct strings per table: two-byte indexes (300), one-byte with 256 keys, four-byte (70 000)
SIZES = {"kv_events": (3000, 300), "kv_block_lifetimes": (2000, 12), "kv_restores": (1000, 256),
         "kv_node_load": (70_000, 70_000)}


def blocks(n: int) -> list[tuple[int, int]]:
    """The native inserts' blocks: several, each with a dictionary of its own."""
    return [(0, 1), (1, 2), (2, n)]


@pytest.fixture(scope="module")
def data() -> dict[str, tuple[list[tuple[str, str]], list[list]]]:
    rng = random.Random(20)
    out = {}
    for table in TABLES:
        types = names_and_types(native.native_rows(table.name).encode(0, 0))
        rows, distinct = SIZES[table.name]
        out[table.name] = (types, random_columns(rng, types, rows, distinct))
    return out


def _store(path: str, fill: Callable[[Any], None]) -> dict[str, Any]:
    """A fresh migrated store at `path`, filled by `fill(client)`; what each table holds, read back, and its
    declared column types. The client is closed before returning: a process opens one chDB path at a time."""
    dsn = f"chdb://{path}"
    client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))
    try:
        apply_migrations(client)
        fill(client)
        got: dict[str, Any] = {}
        for table in TABLES:
            declared = client.query("SELECT name, type FROM system.columns WHERE database = currentDatabase() "
                                    "AND table = {t:String}", parameters={"t": table.name}).result_rows
            types = dict(declared)
            # DateTime64 read back as the microseconds that went in, not as datetimes
            select = ", ".join(f"toUnixTimestamp64Micro({c})" if types[c].startswith("DateTime64") else c
                               for c in table.columns)
            got[table.name] = (types, client.query(f"SELECT {select} FROM {table.name}").result_rows)
        return got
    finally:
        client.close()


@pytest.fixture(scope="module")
def stores(tmp_path_factory, data) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    def native_fill(client: Any) -> None:
        for name, (types, columns) in data.items():
            rows = native.native_rows(name)
            rows.extend_columns(columns)
            n = len(rows)
            for start, end in blocks(n):
                client.raw_insert(name, rows.column_names, insert_block=rows.encode(start, end), fmt="Native")

    def connect_fill(client: Any) -> None:
        for name, (types, columns) in data.items():
            client.insert(name, columns, column_names=[n for n, _ in types], column_oriented=True)

    base = tmp_path_factory.mktemp("native_rows")
    yield _store(str(base / "native"), native_fill), _store(str(base / "connect"), connect_fill)


def test_the_last_blocks_cross_every_index_width(data):
    distinct = {}
    for name, (types, columns) in data.items():
        at = [n for n, _ in types].index("node_id")
        start, end = blocks(len(columns[at]))[-1]
        distinct[name] = len(set(columns[at][start:end]))
    assert distinct == {"kv_events": 300, "kv_block_lifetimes": 12, "kv_restores": 256, "kv_node_load": 69_998}


def test_the_blocks_declare_the_types_the_migrations_give_the_columns(stores, data):
    native_store, _ = stores
    for name, (types, _) in data.items():
        assert dict(types) == native_store[name][0], name


@pytest.mark.parametrize("table", [t.name for t in TABLES])
def test_native_blocks_store_the_rows_that_clickhouse_connect_stores(stores, data, table):
    native_store, connect_store = stores
    want = rows_of(data[table][1])
    assert len(want) == SIZES[table][0]
    assert sorted(map(tuple, native_store[table][1]), key=repr) == want
    assert sorted(map(tuple, connect_store[table][1]), key=repr) == want
