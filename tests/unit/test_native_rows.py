"""The analytics rows' native columns (`kvpipe_native.NativeRows`, native/src/chcols.rs): Python columns in and
out unchanged, batch operations (extend, drop_front, encode of a range), bad values refused whole with the column
and row named, and the Native block byte for byte what clickhouse-connect's own encoder writes for the same columns
(the engine test, tests/integration/test_native_rows_store.py, inserts both into chDB)."""
from __future__ import annotations

import random
import threading
import time

import pytest
from clickhouse_connect.datatypes.registry import get_from_name
from clickhouse_connect.driver.insert import InsertContext
from clickhouse_connect.driver.transform import NativeTransform

from kvpipe.processors.analytics.tables import TABLES
from kvpipe.processors.core import native
from tests.nativecheck import require_native_core
from tests.nativerows import U64_MAX, names_and_types, random_columns

require_native_core()

NAMES = [t.name for t in TABLES]


def types_of(table: str) -> list[tuple[str, str]]:
    return names_and_types(native.native_rows(table).encode(0, 0))


def rows_with(table: str, columns: list[list]):
    rows = native.native_rows(table)
    rows.extend_columns(columns)
    return rows


def connect_block(table: str, columns: list[list]) -> bytes:
    """clickhouse-connect's Native block of the columns (what `client.insert` sends), without the INSERT line."""
    types = types_of(table)
    ctx = InsertContext(table, [n for n, _ in types], [get_from_name(t) for _, t in types], data=columns,
                        column_oriented=True, block_size=10**9)
    body = b"".join(NativeTransform.build_insert(ctx))
    assert body.startswith(b"INSERT INTO ")
    return body[body.index(b"\n") + 1:]


def test_the_tables_columns_are_the_apps_insert_columns():
    for table in TABLES:
        rows = native.native_rows(table.name)
        assert rows.table == table.name
        assert rows.column_names == list(table.columns) == [n for n, _ in types_of(table.name)]


@pytest.mark.parametrize("table", NAMES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_columns_come_back_as_they_went_in(table, seed):
    rng = random.Random(seed)
    columns = random_columns(rng, types_of(table), rng.choice([1, 7, 500]))
    assert rows_with(table, columns).columns() == columns


@pytest.mark.parametrize("table", NAMES)
@pytest.mark.parametrize("rows, distinct", [(1, 1), (600, 5), (600, 300)])
def test_a_block_is_byte_for_byte_clickhouse_connects(table, rows, distinct):
    # 300 distinct strings: two-byte indexes in every LowCardinality column
    columns = random_columns(random.Random(rows + distinct), types_of(table), rows, distinct)
    assert rows_with(table, columns).encode(0, rows) == connect_block(table, columns)


def test_a_block_with_more_than_65536_distinct_strings_is_byte_for_byte_clickhouse_connects():
    columns = random_columns(random.Random(5), types_of("kv_node_load"), 70_000, 70_000)
    assert len(set(columns[1])) == 70_000
    assert rows_with("kv_node_load", columns).encode(0, 70_000) == connect_block("kv_node_load", columns)


def test_exactly_256_distinct_strings_take_one_byte_indexes_where_clickhouse_connect_takes_two():
    # the one place the two encoders differ: clickhouse-connect sizes indexes by the count of keys, not the
    # largest index (the engine reads both: tests/integration/test_native_rows_store.py)
    columns = random_columns(random.Random(6), types_of("kv_node_load"), 256, 256)
    ours = rows_with("kv_node_load", columns).encode(0, 256)
    theirs = connect_block("kv_node_load", columns)
    assert len(theirs) - len(ours) == 256  # one LowCardinality column (node_id), one byte less per row
    assert rows_with("kv_node_load", columns).columns() == columns


@pytest.mark.parametrize("table", NAMES)
def test_a_range_of_a_batch_encodes_as_those_rows_alone(table):
    rng = random.Random(11)
    types = types_of(table)
    parts = [random_columns(rng, types, n, 20) for n in (40, 1, 60)]
    batch = native.native_rows(table)
    for part in parts:
        piece = native.native_rows(table)
        piece.extend_columns(part)
        batch.extend(piece)
    whole = [sum(cols, []) for cols in zip(*parts)]
    assert len(batch) == 101 and batch.columns() == whole
    for start, end in [(0, 101), (0, 40), (40, 41), (30, 90)]:
        assert batch.encode(start, end) == connect_block(table, [c[start:end] for c in whole]), (start, end)
    assert batch.encode(101, 101) == native.native_rows(table).encode(0, 0)  # names and types, no data
    batch.drop_front(35)
    assert len(batch) == 66 and batch.columns() == [c[35:] for c in whole]
    assert batch.encode(0, 66) == connect_block(table, [c[35:] for c in whole])
    batch.drop_front(66)
    assert len(batch) == 0 and batch.columns() == [[] for _ in types]
    batch.extend_columns(parts[0])
    assert batch.columns() == parts[0]


def test_a_batch_extended_with_itself_holds_its_rows_twice():
    columns = random_columns(random.Random(3), types_of("kv_events"), 9)
    rows = rows_with("kv_events", columns)
    rows.extend(rows)
    assert rows.columns() == [c + c for c in columns]


def test_columns_may_be_any_sequences():
    columns = random_columns(random.Random(4), types_of("kv_events"), 5)
    rows = native.native_rows("kv_events")
    rows.extend_columns(tuple(tuple(tuple(v) if isinstance(v, list) else v for v in c) for c in columns))
    assert rows.columns() == columns


def test_an_unknown_table_is_refused():
    says = 'no analytics table "kv_events_final": NativeRows holds one of kv_events, kv_block_lifetimes'
    with pytest.raises(ValueError, match=says):
        native.native_rows("kv_events_final")


def test_rows_of_another_table_are_refused():
    with pytest.raises(ValueError, match="cannot extend kv_events rows with kv_node_load rows"):
        native.native_rows("kv_events").extend(native.native_rows("kv_node_load"))


# (column, bad value, error type, what the message says)
BAD = [
    ("ts", 1.5, TypeError, "kv_events.ts row 3: expected an int (microseconds), got 1.5 (float)"),
    ("ts", 2**63, ValueError, "kv_events.ts row 3: expected an int"),
    ("node_id", None, TypeError, "kv_events.node_id row 3: expected a str, got None (NoneType)"),
    ("node_id", b"n", TypeError, "kv_events.node_id row 3: expected a str"),
    ("node_id", "\udc80", ValueError, "kv_events.node_id row 3: expected a str"),
    ("epoch", -1, ValueError, "kv_events.epoch row 3: expected an int in UInt64 range, got -1 (int)"),
    ("epoch", 2**64, ValueError, "kv_events.epoch row 3: expected an int in UInt64 range"),
    ("epoch", "1", TypeError, "kv_events.epoch row 3: expected an int in UInt64 range, got '1' (str)"),
    ("dp_rank", 2**31, ValueError, "kv_events.dp_rank row 3: expected an int in Int32 range"),
    ("block_hashes", [1, -1], ValueError, "kv_events.block_hashes row 3: expected a list of ints in UInt64 range"),
    ("block_hashes", 5, TypeError, "kv_events.block_hashes row 3: expected a list of ints"),
    ("has_parent", 256, ValueError, "kv_events.has_parent row 3: expected a bool or an int in UInt8 range"),
    ("num_blocks", 2**32, ValueError, "kv_events.num_blocks row 3: expected an int in UInt32 range"),
    ("num_blocks", None, TypeError, "kv_events.num_blocks row 3: expected an int in UInt32 range"),
    ("from_cpu_blocks", -1, ValueError, "kv_events.from_cpu_blocks row 3: expected None or an int in UInt32 range"),
]


@pytest.mark.parametrize("column, value, error, says", BAD, ids=[f"{c}={v!r}" for c, v, *_ in BAD])
def test_a_bad_value_appends_nothing_and_names_its_column_and_row(column, value, error, says):
    types = types_of("kv_events")
    rows = rows_with("kv_events", random_columns(random.Random(8), types, 2))
    before = rows.columns()
    columns = random_columns(random.Random(9), types, 5)
    columns[[n for n, _ in types].index(column)][3] = value
    with pytest.raises(error) as raised:
        rows.extend_columns(columns)
    assert says in str(raised.value)
    assert len(rows) == 2 and rows.columns() == before


@pytest.mark.parametrize("table, value, error, says", [
    ("kv_block_lifetimes", 65_536, ValueError, "kv_block_lifetimes.copy_idx row 3: expected an int in UInt16 range"),
    ("kv_block_lifetimes", "x", TypeError, "kv_block_lifetimes.lifetime_s row 3: expected a float, got 'x'"),
    ("kv_node_load", "x", TypeError, "kv_node_load.kv_usage row 3: expected None or a float, got 'x'"),
])
def test_bad_values_of_the_other_types_are_refused(table, value, error, says):
    types = types_of(table)
    columns = random_columns(random.Random(9), types, 5)
    column = says.split(".")[1].split(" ")[0]
    columns[[n for n, _ in types].index(column)][3] = value
    rows = native.native_rows(table)
    with pytest.raises(error, match=says.replace("(", r"\(")):
        rows.extend_columns(columns)
    assert len(rows) == 0


def test_columns_of_the_wrong_count_or_unequal_lengths_are_refused():
    types = types_of("kv_node_load")
    columns = random_columns(random.Random(1), types, 4)
    rows = native.native_rows("kv_node_load")
    with pytest.raises(ValueError, match=r"kv_node_load takes 9 columns \(ts, node_id, epoch, .*\), got 8"):
        rows.extend_columns(columns[:-1])
    columns[2].append(1)
    with pytest.raises(ValueError, match="kv_node_load: column epoch has 5 rows, column ts has 4"):
        rows.extend_columns(columns)
    assert len(rows) == 0


def test_ranges_past_the_rows_are_refused():
    rows = rows_with("kv_node_load", random_columns(random.Random(1), types_of("kv_node_load"), 4))
    for start, end in [(0, 5), (3, 2), (-1, 2)]:
        with pytest.raises(ValueError, match=rf"kv_node_load: no rows \[{start}, {end}\) in 4 rows"):
            rows.encode(start, end)
    with pytest.raises(ValueError, match="kv_node_load: cannot drop 5 of 4 rows"):
        rows.drop_front(5)
    assert len(rows) == 4


def test_uint64_max_and_empty_arrays_survive():
    types = types_of("kv_events")
    columns = random_columns(random.Random(2), types, 3)
    columns[[n for n, _ in types].index("block_hashes")] = [[], [U64_MAX], []]
    assert rows_with("kv_events", columns).columns() == columns


def test_one_thread_extends_while_another_encodes_and_drops():
    """The analytics app's shape: its event loop makes rows, a writer thread takes, encodes and drops them."""
    types = types_of("kv_events")
    pieces = [random_columns(random.Random(i), types, 50, 8) for i in range(200)]
    batch = native.native_rows("kv_events")
    done = threading.Event()
    written: list[int] = []
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            while not (done.is_set() and len(batch) == 0):
                n = len(batch)
                if n:
                    assert batch.encode(0, n)
                    batch.drop_front(n)
                    written.append(n)
                else:
                    time.sleep(0.0005)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    for piece in pieces:
        rows = native.native_rows("kv_events")
        rows.extend_columns(piece)
        batch.extend(rows)
        assert len(batch) >= 0 and batch.columns()
    done.set()
    thread.join(60)
    assert not errors and not thread.is_alive()
    assert sum(written) == 200 * 50
