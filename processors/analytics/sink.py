"""AnalyticsSink: batches analytics rows off the asyncio loop into ClickHouse (chDB or a server).

Threading. One clickhouse-connect client, one background writer thread. Every use of the client —
migrations, inserts, `query()` — holds `_client_lock`: chDB serves a handle from one call at a
time, and a query issued while another call streams on the same handle silently returns nothing.
`query()` therefore blocks while an insert runs (at most one batch): call it from a thread
executor, not from the event loop.

chDB constraints (4.4, through clickhouse-connect 1.12's `chdb:///abs/path` DSN). One process
hosts one engine path at a time: opening a second path while any client on the first is open
raises; after `close()` another path may be opened. So the processor, not `kvpipe sql`, owns the
store, and tests that use a fresh path each must close the previous sink first.

Exactly once. A processor that restarts replays from its last committed offset and submits rows it
had already written. Each row carries its Kafka coordinates `(partition, offset, idx)` (plus the
block hash and a copy ordinal for lifetimes) at the end of a ReplacingMergeTree sorting key whose
other columns derive from the same message, so a replayed row is a duplicate key and collapses.
Insert dedup tokens were the alternative; they only recognise an identical block, and a replay
regroups rows into different batches (it starts at another offset and flushes on another timer),
so overlapping batches would double count. Merges are lazy: correct counts read the `*_final` views
(`FINAL`), as the saved queries do.

Durability contract: a row is in the store once `flush()` has returned True after its `submit`.
The processor must flush before it commits (or snapshots) the Kafka offset covering those rows;
otherwise a crash loses rows still queued here.

Back-pressure. `submit` is O(1) and never drops: while more than `max_queue_rows` rows wait, it
blocks the caller (counted in `submit_blocked`/`submit_blocked_s`), which holds back consumption —
Kafka is the buffer. After `block_s` without room it raises SinkOverflow: a stuck store is a loud
failure and the processor restarts from its committed offset, not a silent loss.

Failures. A failed insert is split in halves and retried, so one bad row costs ~2·log2(batch)
inserts and only that row is lost — counted in `<table>_failed`, with `errors` and `last_error`;
an engine that is down (ping fails) is retried with back-off first. The writer thread survives all
of it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

import clickhouse_connect

from processors.analytics.migrations import apply_migrations
from processors.analytics.rows import (
    EVENT_COLUMNS,
    LIFETIME_COLUMNS,
    event_columns,
    lifetime_columns,
    number_copies,
)
from processors.analytics.sqlguard import check_read_only, first_keyword

log = logging.getLogger(__name__)

EVENTS_TABLE = "kv_events"
LIFETIMES_TABLE = "kv_block_lifetimes"
_TABLES: dict[str, tuple[tuple[str, ...], Callable[[list], list[list]]]] = {
    EVENTS_TABLE: (EVENT_COLUMNS, event_columns),
    LIFETIMES_TABLE: (LIFETIME_COLUMNS, lifetime_columns),
}
_SPLIT_BUDGET = 64  # inserts one batch may spend isolating bad rows
_ENGINE_RETRIES = (0.5, 1.0, 2.0, 4.0)  # seconds between retries while the engine does not answer


class SinkOverflow(RuntimeError):
    pass


class AnalyticsSink:
    def __init__(self, dsn: str, *, batch_rows: int = 5000, flush_s: float = 1.0,
                 max_queue_rows: int | None = None, block_s: float = 5.0) -> None:
        self.dsn = dsn
        self.batch_rows = max(1, batch_rows)
        self.flush_s = flush_s
        self.max_queue_rows = max_queue_rows or 20 * self.batch_rows
        self.block_s = block_s
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._cond = threading.Condition()
        self._queue: deque[tuple[list, list]] = deque()
        self._unwritten = 0  # rows submitted and neither written nor failed yet
        self._submitted = 0  # submit calls so far; flush() waits until _done catches up
        self._done = 0
        self._flush_wanted = 0
        self._stop = False
        self._thread: threading.Thread | None = None
        self._c: dict[str, Any] = {f"{t}_{k}": 0 for t in _TABLES for k in ("submitted", "written", "failed")}
        self._c.update(batches=0, errors=0, last_error="", submit_blocked=0, submit_blocked_s=0.0)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the client, apply migrations, start the writer thread."""
        if self._thread is not None:
            return
        self._client = clickhouse_connect.get_client(dsn=self.dsn)
        try:
            with self._client_lock:
                apply_migrations(self._client)
        except Exception:
            self._client.close()  # an open chDB client would keep the path locked for this process
            self._client = None
            raise
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvpipe-analytics-writer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Write what is queued, stop the writer, close the client (which frees the chDB path)."""
        if self._thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
            self._thread = None
        if self._client is not None:
            with self._client_lock:
                self._client.close()
            self._client = None

    # --- producer side (the asyncio loop) -----------------------------------------------------------

    def submit(self, event_rows: list, lifetime_rows: list) -> None:
        """Queue rows of one message (submit all lifetimes a message ends in one call)."""
        n = len(event_rows) + len(lifetime_rows)
        if n == 0:
            return
        with self._cond:
            if self._stop or self._thread is None:
                raise RuntimeError("AnalyticsSink.submit: the sink is not running (start() it first)")
            if self._unwritten and self._unwritten + n > self.max_queue_rows:
                self._wait_for_room(n)
            self._queue.append((event_rows, lifetime_rows))
            self._unwritten += n
            self._submitted += 1
            self._c[f"{EVENTS_TABLE}_submitted"] += len(event_rows)
            self._c[f"{LIFETIMES_TABLE}_submitted"] += len(lifetime_rows)
            self._cond.notify_all()

    def _wait_for_room(self, n: int) -> None:
        t0 = time.monotonic()
        self._c["submit_blocked"] += 1
        deadline = t0 + self.block_s
        while self._unwritten and self._unwritten + n > self.max_queue_rows:
            left = deadline - time.monotonic()
            if left <= 0:
                self._c["submit_blocked_s"] += time.monotonic() - t0
                raise SinkOverflow(f"analytics store is not keeping up: {self._unwritten} rows unwritten for "
                                   f"{self.block_s:.1f} s (last error: {self._c['last_error'] or 'none'})")
            self._cond.wait(left)
        self._c["submit_blocked_s"] += time.monotonic() - t0

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every row submitted before this call is written (or counted failed)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._submitted
            self._flush_wanted = max(self._flush_wanted, target)
            self._cond.notify_all()
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
        return True

    def counters(self) -> dict:
        with self._cond:
            return dict(self._c, unwritten_rows=self._unwritten, max_queue_rows=self.max_queue_rows)

    # --- read side ------------------------------------------------------------------------------

    def query(self, sql: str, parameters: dict | None = None) -> dict:
        """Run one read-only statement: `{"columns", "types", "rows"}`. Blocking (see module doc).

        Works without start() too (opens the client, no migrations, no writer): a reader's use.
        """
        statement = check_read_only(sql)
        # readonly=1 (not 2): 2 would still allow table functions such as file().
        settings = {"readonly": 1}
        with self._client_lock:
            if self._client is None:  # read-only use without start(): `kvpipe sql` against a server
                self._client = clickhouse_connect.get_client(dsn=self.dsn)
            result = self._client.query(statement, parameters=parameters, settings=settings)
            columns, types = list(result.column_names), [t.name for t in result.column_types]
            if not columns and first_keyword(statement) in ("SELECT", "WITH"):
                # chDB sends no header for an empty result; ask for the result's shape instead.
                shape = self._client.query(f"DESCRIBE TABLE ({statement})", parameters=parameters, settings=settings)
                columns, types = [r[0] for r in shape.result_rows], [r[1] for r in shape.result_rows]
        return {"columns": columns, "types": types, "rows": [list(r) for r in result.result_rows]}

    # --- writer thread --------------------------------------------------------------------------

    def _run(self) -> None:
        events: list = []
        lifetimes: list = []
        taken = 0  # submit calls drained into the pending lists
        oldest = 0.0  # monotonic time the oldest pending row was drained
        while True:
            with self._cond:
                while True:
                    if self._queue and not (events or lifetimes):
                        oldest = time.monotonic()
                    while self._queue:
                        ev, lt = self._queue.popleft()
                        events.extend(ev)
                        if lt:
                            number_copies(lt)
                            lifetimes.extend(lt)
                        taken += 1
                    pending = bool(events or lifetimes)
                    # everything pending goes out on stop, flush() or age; otherwise full batches only
                    drain = pending and (self._stop or self._flush_wanted > self._done
                                         or time.monotonic() - oldest >= self.flush_s)
                    if drain or len(events) >= self.batch_rows or len(lifetimes) >= self.batch_rows:
                        break
                    if self._stop:
                        self._done = taken
                        self._cond.notify_all()
                        return
                    self._cond.wait(oldest + self.flush_s - time.monotonic() if pending else None)
            # Write outside the queue lock so submit() never waits for the engine.
            written = 0
            for table, rows in ((EVENTS_TABLE, events), (LIFETIMES_TABLE, lifetimes)):
                end = len(rows) if drain else len(rows) - len(rows) % self.batch_rows
                for i in range(0, end, self.batch_rows):
                    self._write(table, rows[i:min(i + self.batch_rows, end)])
                del rows[:end]
                written += end
            with self._cond:
                self._unwritten -= written
                if not (events or lifetimes):
                    self._done = taken
                self._cond.notify_all()

    def _write(self, table: str, rows: list) -> None:
        try:
            self._insert(table, rows)
        except Exception as exc:  # noqa: BLE001 - the writer must outlive any insert failure
            self._note_error(table, exc)
            if not self._engine_answers():
                self._retry_while_down(table, rows)
                return
            budget = [_SPLIT_BUDGET]
            self._split(table, rows, budget)

    def _insert(self, table: str, rows: list) -> None:
        columns, to_columns = _TABLES[table]
        data = to_columns(rows)
        with self._client_lock:
            self._client.insert(table, data, column_names=list(columns), column_oriented=True)
        with self._cond:
            self._c[f"{table}_written"] += len(rows)
            self._c["batches"] += 1

    def _split(self, table: str, rows: list, budget: list[int]) -> None:
        """Isolate bad rows by halving; rows left when the budget is spent are counted failed."""
        if len(rows) == 1 or budget[0] <= 0:
            self._fail(table, rows)
            return
        mid = len(rows) // 2
        for half in (rows[:mid], rows[mid:]):
            budget[0] -= 1
            try:
                self._insert(table, half)
            except Exception as exc:  # noqa: BLE001
                self._note_error(table, exc)
                self._split(table, half, budget)

    def _retry_while_down(self, table: str, rows: list) -> None:
        for pause in _ENGINE_RETRIES:
            time.sleep(pause)
            try:
                self._insert(table, rows)
                return
            except Exception as exc:  # noqa: BLE001
                self._note_error(table, exc)
        self._fail(table, rows)

    def _engine_answers(self) -> bool:
        try:
            with self._client_lock:
                return bool(self._client.ping())
        except Exception:  # noqa: BLE001
            return False

    def _note_error(self, table: str, exc: Exception) -> None:
        with self._cond:
            self._c["errors"] += 1
            self._c["last_error"] = f"{table}: {type(exc).__name__}: {str(exc)[:500]}"

    def _fail(self, table: str, rows: list) -> None:
        with self._cond:
            self._c[f"{table}_failed"] += len(rows)
        log.error("analytics: %d %s rows could not be written and are dropped: %s",
                  len(rows), table, self._c["last_error"])
