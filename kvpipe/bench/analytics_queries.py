"""`kvpipe bench analytics-queries`: analytics writes while analysts' heaviest queries run, and the query limits.

One run, one fresh embedded chDB store: kvpipe's migrations, `--rows` block lifetimes and their events (the
benchmark's trusted fill, `saved_queries.fill`), an `AnalyticsSink` writing to it and an `AnalystQueries` service over
the sink, as the analytics app wires them (its `/sql` path less HTTP), with a `--query-limit-s` time limit.

- writer latency: every `--interval-ms`, one message's rows are submitted and flushed; the latency is submit to
  acknowledged by the store. Three phases of `--seconds` each: `idle`; `heavy`, while `max_concurrent` analysts
  run the heaviest allowed queries back to back through the service (a scan-and-join the engine ends at its time
  limit, and a query whose every row scans a constant array, which runs past the limit inside one block); and
  `shared_client`, the same queries run on the writer's own client under its lock, as the sink shared one client
  before reads had clients of their own: the stall the split removes.
- caps: a single-block result over the row cap, one over the byte cap, each through the service and, as the
  control, through the engine's own limits alone (`engine_query`): outcome, seconds, Python heap peak (tracemalloc).
- time: an unbounded function (`hasAny` over 100 000-element arrays): refused by the guard, against the engine
  alone with the same time limit; the runaway per-row scan: when the analyst is answered, when the engine frees
  the slot; and how long the engine alone takes to end such a scan with analysts' blocks and with its default ones.

value = writer p99 (ms) in `heavy`; baseline = writer p99 idle; ratio = baseline / value (1: the queries cost the
writes nothing); `meets_target`: heavy p99 <= 100 ms.
"""
from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import threading
import time
import tracemalloc
from typing import Any, Callable

import click

from kvpipe.bench.saved_queries import fill
from kvpipe.processors.analytics import tables
from kvpipe.processors.analytics.query import ANALYST_BLOCK_ROWS, AnalystQueries, QueryError, QueryLimits, \
    SqlRequest, engine_query
from kvpipe.processors.analytics.rows import KIND_STORED, EventRow
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.schemas.cliopts import Command, run as run_command

TARGET_P99_MS = 100.0
# The heaviest allowed queries: one the engine ends at its limit, one it cannot end there (each row scans a
# constant array; the time limit is checked only between blocks).
HEAVY_SCAN = ("SELECT count() FROM kv_events AS a CROSS JOIN kv_block_lifetimes AS b "
              "WHERE cityHash64(a.ts, b.block_hash) % 7 = 3")
RUNAWAY = ("SELECT count() FROM kv_block_lifetimes "
           "WHERE indexOf(range({n}), toUInt64(group_idx) + 1000000) > 0")
UNBOUNDED = ("SELECT hasAny(groupArray(block_hash), arrayMap(h -> h + 1, groupArray(block_hash))) "
             "FROM (SELECT block_hash FROM kv_block_lifetimes LIMIT 100000)")
ROWS_OVER_CAP = "SELECT arrayJoin(range(2000000)) AS x"  # one block of 2 M rows
BYTES_OVER_CAP = "SELECT range(500000) AS r FROM kv_events LIMIT 8"  # a constant column: 8 rows, 16 MB
CAPS = {"max_result_rows": 10_000, "max_result_bytes": 4 << 20}
DEFAULT_BLOCK_ROWS = 65_409  # the engine's own max_block_size


def event_message(i: int) -> dict[str, list]:
    """One message's rows for the writer: a stored event with its own Kafka coordinates."""
    row = EventRow("bench-node", 1, i, 0, 0, "GPU", KIND_STORED, [i * 16 + k for k in range(8)], None, 8, 128, 16,
                   "full_attention", 1_767_225_600.0 + i, time.time(), 7, 10_000_000 + i, 0)
    return {tables.EVENTS: [row]}


def writer_latencies(sink: AnalyticsSink, seconds: float, interval_s: float, first: int) -> list[float]:
    """Milliseconds from submit to acknowledged, one message per `interval_s` for `seconds`."""
    out: list[float] = []
    end = time.monotonic() + seconds
    i = first
    while time.monotonic() < end:
        t0 = time.monotonic()
        sink.submit(event_message(i))
        if not sink.flush(60.0):
            raise RuntimeError("the store did not acknowledge a write within 60 s")
        out.append((time.monotonic() - t0) * 1000)
        i += 1
        time.sleep(max(0.0, interval_s - (time.monotonic() - t0)))
    return out


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(len(ordered) * q))], 2)  # noqa: E731
    return {"n": len(values), "p50_ms": round(statistics.median(ordered), 2), "p99_ms": pick(0.99),
            "max_ms": round(ordered[-1], 2)}


class Heavy:
    """`workers` threads running `run(sql)` back to back until stopped; outcomes counted."""

    def __init__(self, run: Callable[[str], Any], statements: list[str], workers: int) -> None:
        self._run, self._statements = run, statements
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.outcomes: dict[str, int] = {}
        self._threads = [threading.Thread(target=self._loop, args=(w,), daemon=True) for w in range(workers)]

    def __enter__(self) -> "Heavy":
        for t in self._threads:
            t.start()
        time.sleep(0.3)  # the queries are running before the writes are timed
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _loop(self, worker: int) -> None:
        k = worker
        while not self._stop.is_set():
            try:
                self._run(self._statements[k % len(self._statements)])
                outcome = "answered"
            except QueryError as exc:
                outcome = f"{exc.status} {exc.error}"
            except Exception as exc:  # noqa: BLE001 - the shared-client phase reports the engine's own error
                outcome = type(exc).__name__
            with self._lock:
                self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            k += 1


def measured(call: Callable[[], Any]) -> dict:
    """Outcome, seconds and Python heap peak of one call."""
    tracemalloc.start()
    t0 = time.monotonic()
    try:
        out = call()
        result: dict[str, Any] = {"outcome": f"answered {len(out['rows'] if isinstance(out, dict) else out)} rows"}
    except QueryError as exc:
        result = {"outcome": f"{exc.status} {exc.error}"}
    except Exception as exc:  # noqa: BLE001 - the engine's own error in a control
        result = {"outcome": f"engine: {str(exc)[:120]}"}
    result["seconds"] = round(time.monotonic() - t0, 3)
    result["heap_peak_mb"] = round(tracemalloc.get_traced_memory()[1] / 1e6, 1)
    tracemalloc.stop()
    return result


def limit_outcomes(sink: AnalyticsSink, limit_s: float, runaway_n: int) -> dict:
    capped = QueryLimits(max_execution_s=limit_s, max_result_rows=CAPS["max_result_rows"],
                         max_result_bytes=CAPS["max_result_bytes"])
    queries = AnalystQueries(sink.query, capped)
    ask = lambda sql: asyncio.run(queries.execute(SqlRequest(sql=sql)))  # noqa: E731
    out: dict[str, Any] = {"caps": CAPS, "time_limit_s": limit_s}
    for name, sql in (("rows_single_block", ROWS_OVER_CAP), ("bytes_single_block", BYTES_OVER_CAP)):
        with sink.readers.client() as client:
            control = measured(lambda: engine_query(client, sql, None, capped.engine_settings()).result_rows)
        out[name] = {"sql": sql, "app": measured(lambda: ask(sql)), "engine_alone": control}
    with sink.readers.client() as client:
        control = measured(lambda: engine_query(client, UNBOUNDED, None, capped.engine_settings()).result_rows)
    out["unbounded_function"] = {"sql": UNBOUNDED, "app": measured(lambda: ask(UNBOUNDED)), "engine_alone": control}
    t0 = time.monotonic()
    answer = measured(lambda: ask(RUNAWAY.format(n=runaway_n)))
    held = queries.admitted
    while queries.admitted:
        time.sleep(0.01)
    out["runaway_row_scan"] = {"sql": RUNAWAY.format(n=runaway_n), "app": answer, "slot_held_after_answer": held,
                               "engine_ends_s": round(time.monotonic() - t0, 2)}
    queries.close()
    # how far the engine alone overruns its limit on such a query, with analysts' blocks and with its default ones
    smaller = RUNAWAY.format(n=runaway_n // 3)
    overrun = {}
    for name, rows in (("analyst_blocks", ANALYST_BLOCK_ROWS), ("default_blocks", DEFAULT_BLOCK_ROWS)):
        settings = {**capped.engine_settings(), "max_block_size": rows}
        with sink.readers.client() as client:
            overrun[name] = measured(lambda: engine_query(client, smaller, None, settings).result_rows)["seconds"]
    out["engine_overrun_by_block_size"] = {"sql": smaller, "seconds": overrun}
    return out


@click.command("analytics-queries", cls=Command, help=__doc__.split("\n\n")[0])
@click.option("--rows", type=int, default=200_000, show_default=True, help="block lifetimes in the store")
@click.option("--seconds", type=float, default=10.0, show_default=True, help="length of each writer phase")
@click.option("--interval-ms", type=float, default=20.0, show_default=True, help="one write per interval")
@click.option("--query-limit-s", type=float, default=1.0, show_default=True, help="analysts' time limit")
@click.option("--runaway-elements", type=int, default=300_000, show_default=True,
              help="size of the constant array each row of the runaway query scans")
def analytics_queries_bench(rows: int, seconds: float, interval_ms: float, query_limit_s: float,
                            runaway_elements: int) -> dict:
    tmp = tempfile.mkdtemp(prefix="kvpipe-bench-queries-")
    sink = AnalyticsSink(f"chdb://{tmp}/store", flush_s=0.05)
    try:
        sink.start()
        with sink._client_lock:
            counts = fill(sink._client, rows)
        limits = QueryLimits(max_execution_s=query_limit_s)
        queries = AnalystQueries(sink.query, limits)
        heavy = [HEAVY_SCAN, RUNAWAY.format(n=runaway_elements)]
        interval = interval_ms / 1000
        idle = writer_latencies(sink, seconds, interval, 0)
        with Heavy(lambda sql: asyncio.run(queries.execute(SqlRequest(sql=sql))), heavy, limits.max_concurrent) as h:
            busy = writer_latencies(sink, seconds, interval, 1_000_000)
        queries.close()

        def on_writer_client(sql: str) -> Any:  # the old arrangement: one client, one lock, writes wait
            with sink._client_lock:
                return engine_query(sink._client, sql, None, limits.engine_settings())

        with Heavy(on_writer_client, heavy, 1) as shared:
            old = writer_latencies(sink, seconds, interval, 2_000_000)
        phases = {"idle": percentiles(idle), "heavy": percentiles(busy), "shared_client": percentiles(old)}
        return {
            "bench": "analytics-queries",
            "value": phases["heavy"]["p99_ms"], "unit": "ms writer p99 while the heaviest queries run",
            "baseline": phases["idle"]["p99_ms"],
            "ratio": round(phases["idle"]["p99_ms"] / max(phases["heavy"]["p99_ms"], 1e-6), 3),
            "target_p99_ms": TARGET_P99_MS, "meets_target": phases["heavy"]["p99_ms"] <= TARGET_P99_MS,
            "rows": counts, "writer": phases, "heavy_queries": heavy,
            "heavy_outcomes": h.outcomes, "shared_client_outcomes": shared.outcomes,
            "read_clients_opened": sink.readers.opened,
            "limits": limit_outcomes(sink, query_limit_s, runaway_elements),
        }
    finally:
        sink.close()
        shutil.rmtree(tmp, ignore_errors=True)


def run(argv: list[str]) -> dict | int:
    """`kvpipe bench analytics-queries`: the result, or an exit code after help or a usage error."""
    return run_command(analytics_queries_bench, argv, "kvpipe bench analytics-queries")
