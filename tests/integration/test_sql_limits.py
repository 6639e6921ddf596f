"""Analyst-query limits the app holds where the engine does not, and writes that never wait for a query (real chDB).

One store for the module: an `AnalyticsSink` started on a fresh chDB path, kvpipe's migrations, 200 000 block
lifetimes and their events from the benchmark's trusted fill; the analyst service runs on the sink's read side, as
in the app. Each limit has a control showing the engine alone lets the query through (or run on), so the app's
refusal is the thing under test.
"""
from __future__ import annotations

import asyncio
import threading
import time
import tracemalloc

import pytest

from kvpipe.bench.analytics_queries import BYTES_OVER_CAP, RUNAWAY, event_message
from kvpipe.bench.saved_queries import fill
from kvpipe.processors.analytics.query import DEADLINE_GRACE_S, AnalystQueries, QueryError, QueryLimits, \
    SqlRequest, engine_query
from kvpipe.processors.analytics.sink import AnalyticsSink


@pytest.fixture(scope="module")
def sink(tmp_path_factory):
    sink = AnalyticsSink(f"chdb://{tmp_path_factory.mktemp('sql-limits') / 'store'}", flush_s=0.05)
    sink.start()
    try:
        with sink._client_lock:
            fill(sink._client, 200_000)
        yield sink
    finally:
        sink.close()


def _ask(sink: AnalyticsSink, limits: QueryLimits, sql: str) -> dict:
    queries = AnalystQueries(sink.query, limits)
    try:
        return asyncio.run(queries.execute(SqlRequest(sql=sql)))
    finally:
        queries.close()


def _heap_peak(call) -> tuple[object, int]:
    """(what `call` returned or raised, the Python heap's peak in bytes while it ran)."""
    tracemalloc.start()
    try:
        try:
            out: object = call()
        except QueryError as exc:
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _engine_alone(sink: AnalyticsSink, limits: QueryLimits, sql: str) -> list:
    with sink.readers.client() as client:
        return engine_query(client, sql, None, limits.engine_settings()).result_rows


CAPPED = QueryLimits(max_result_rows=10_000, max_result_bytes=4 << 20)  # the caps the issue measured


def test_one_block_of_300k_rows_past_a_10k_row_cap_is_refused_without_reading_it(sink) -> None:
    sql = "SELECT arrayJoin(range(300000)) AS x"  # one block: the engine checks its row limit after a block
    control, control_peak = _heap_peak(lambda: _engine_alone(sink, CAPPED, sql))
    assert isinstance(control, list) and len(control) == 300_000, "the engine alone lets the block through"
    refused, peak = _heap_peak(lambda: _ask(sink, CAPPED, sql))
    assert isinstance(refused, QueryError) and refused.status == 422 and "max_result_rows" in refused.error
    assert peak < control_peak / 10, (peak, control_peak)


def test_a_constant_column_past_the_byte_cap_is_refused_before_it_is_decoded(sink) -> None:
    # 8 rows of one 2 MB array: the engine counts a constant once, so its byte limit lets 16 MB through
    control, control_peak = _heap_peak(lambda: _engine_alone(sink, CAPPED, BYTES_OVER_CAP))
    assert isinstance(control, list) and len(control) == 8 and len(control[0][0]) == 500_000
    refused, peak = _heap_peak(lambda: _ask(sink, CAPPED, BYTES_OVER_CAP))
    assert isinstance(refused, QueryError) and refused.status == 422 and refused.error.endswith("max_result_bytes")
    assert f"more than {4 << 20} bytes" in refused.detail
    # what stays is the one engine block in flight (16 MB Native), never the decoded result (~200 MB of objects)
    assert peak < control_peak / 4, (peak, control_peak)


def test_results_at_the_caps_answer_whole_and_the_read_client_serves_the_next_query(sink) -> None:
    rows = _ask(sink, CAPPED, "SELECT block_hash FROM kv_block_lifetimes ORDER BY block_hash LIMIT 10000")["rows"]
    assert len(rows) == 10_000 and rows == sorted(rows)
    big = _ask(sink, CAPPED, "SELECT range(900000) AS r")["rows"]  # 3.6 MB Native, under 4 MiB
    assert big[0][0][-1] == 899_999
    with pytest.raises(QueryError):
        _ask(sink, CAPPED, BYTES_OVER_CAP)  # a read stopped half way ...
    assert _ask(sink, CAPPED, "SELECT count() AS n FROM kv_block_lifetimes")["rows"] == [[200_000]]  # ... ends cleanly
    empty = _ask(sink, CAPPED, "SELECT node_id, block_hash FROM kv_block_lifetimes WHERE 0")
    assert empty == {"columns": ["node_id", "block_hash"], "types": ["LowCardinality(String)", "UInt64"], "rows": []}


def test_a_function_no_time_limit_can_stop_is_refused_at_once_naming_it(sink) -> None:
    limits = QueryLimits(max_execution_s=0.5)
    sql = "SELECT hasAll(groupArray(block_hash), groupArray(block_hash)) FROM kv_block_lifetimes"
    t0 = time.monotonic()
    with pytest.raises(Exception, match="Timeout exceeded"):
        _engine_alone(sink, limits, sql)
    overran = time.monotonic() - t0
    assert overran > limits.max_execution_s + DEADLINE_GRACE_S, f"control: the engine stopped it at {overran:.2f} s"
    t0 = time.monotonic()
    with pytest.raises(QueryError) as refused:
        _ask(sink, limits, sql)
    assert time.monotonic() - t0 < limits.max_execution_s
    assert refused.value.status == 403 and "hasAll()" in refused.value.detail
    assert "arrayExcept" in refused.value.detail  # and what to write instead


def test_the_rewrites_the_refusals_suggest_answer_as_the_refused_functions_do(sink) -> None:
    cases = [([1, 2, 3], [2, 3]), ([1, 2, 3], [3, 4]), ([1, 2], []), ([], [1]), ([5, 5, 6], [6, 5])]
    for a, b in cases:  # typed as columns are (arrayExcept wants one element type on both sides)
        a_, b_ = f"CAST({a} AS Array(UInt64))", f"CAST({b} AS Array(UInt64))"
        [row] = _engine_alone(sink, QueryLimits(), f"SELECT hasAll({a_}, {b_}), empty(arrayExcept({b_}, {a_})), "
                                                   f"hasAny({a_}, {b_}), notEmpty(arrayIntersect({a_}, {b_}))")
        assert (row[0], row[2]) == (row[1], row[3]), (a, b, row)


def test_a_query_the_engine_cannot_stop_is_answered_at_the_deadline_and_keeps_its_slot(sink) -> None:
    limits = QueryLimits(max_execution_s=0.3)
    queries = AnalystQueries(sink.query, limits)
    try:
        t0 = time.monotonic()
        with pytest.raises(QueryError) as late:  # each row scans a 200 000-element constant: one block is seconds
            asyncio.run(queries.execute(SqlRequest(sql=RUNAWAY.format(n=200_000))))
        answered = time.monotonic() - t0
        assert late.value.status == 422 and "max_execution_time" in late.value.error
        assert answered < limits.max_execution_s + DEADLINE_GRACE_S + 1.0, answered
        assert queries.admitted == 1, "the query still runs in the engine and keeps its slot"
        deadline = time.monotonic() + 120
        while queries.admitted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert queries.admitted == 0 and time.monotonic() - t0 > answered, "the engine ended it after the answer"
        assert asyncio.run(queries.execute(SqlRequest(sql="SELECT 1 AS one")))["rows"] == [[1]]
    finally:
        queries.close()


def test_writes_are_acknowledged_while_an_analyst_query_runs(sink) -> None:
    limits = QueryLimits(max_execution_s=0.3)
    running = threading.Event()
    done = threading.Event()

    def analyst() -> None:
        running.set()
        try:
            sink.query(RUNAWAY.format(n=200_000), settings=limits.engine_settings())
        except Exception:  # noqa: BLE001 - the engine ends it at its time limit; the end is what is waited for
            pass
        finally:
            done.set()

    thread = threading.Thread(target=analyst)
    thread.start()
    running.wait()
    time.sleep(0.2)
    acknowledged = 0
    for i in range(5):  # each write is submitted and acknowledged by the store before the query has ended
        sink.submit(event_message(50_000_000 + i))
        assert sink.flush(60.0)
        if not done.is_set():
            acknowledged += 1
    thread.join()
    assert acknowledged == 5, "writes waited for the analyst's query"
    n = sink.query("SELECT count() FROM kv_events WHERE kafka_offset >= 60000000 AND node_id = 'bench-node'")
    assert n["rows"] == [[5]]
