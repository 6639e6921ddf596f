"""AnalyticsSink: batches analytics rows off the asyncio loop into ClickHouse (chDB or a server).

Threading. The writer's clickhouse-connect client and one background writer thread: migrations and
inserts hold `_client_lock` (chDB serves a handle one call at a time, and a query issued while
another call streams on the same handle silently returns nothing). Reads never use that client:
`query()` and `read_columns()` take a client of their own from `reads.ReadClients` (chDB serves any
number of handles to the one engine, and a read sees what the writer has committed), so an analyst
query running for seconds never holds an insert back, and an insert never holds a query back. Reads
block for the query's time: call them from a thread executor, not from the event loop.

chDB constraints (4.4, through clickhouse-connect 1.12's `chdb:///abs/path` DSN). One process
hosts one engine path at a time: opening a second path while any client on the first is open
raises; after `close()` another path may be opened. So the analytics app, not `kvpipe sql`, owns the
store, and tests that use a fresh path each must close the previous sink first.

Exactly once. An analytics worker that restarts replays from its last snapshot's offset and
submits rows it had already written. Each row carries its Kafka coordinates `(partition, offset, idx)` (plus the
block hash and a copy ordinal for lifetimes) at the end of a ReplacingMergeTree sorting key whose
other columns derive from the same message, so a replayed row is a duplicate key and collapses.
Insert dedup tokens were the alternative; they only recognise an identical block, and a replay
regroups rows into different batches (it starts at another offset and flushes on another timer),
so overlapping batches would double count. Merges are lazy: correct counts read the `*_final` views
(`FINAL`), as the saved queries do.

Durability contract: a row is in the store once `flush()` has returned True after its `submit`.
The analytics app flushes before a snapshot claims the Kafka offset covering those rows; a flush
that times out (the store refuses) means no snapshot, so a crash replays those rows.

No row is ever dropped. `submit` never blocks and never refuses; the asynchronous gate is
`wait_for_room`: while more than `max_queue_rows` rows wait, the caller (the analytics agent,
before it takes the next message) awaits on the event loop — it never blocks the loop thread,
where aiokafka's heartbeats run — so consumption stops and Kafka is the buffer.

Failures. A failed insert is retried, the same rows, with kvpipe's retry policy
(kvpipe.schemas.retrying: exponential back-off from `FIRST_RETRY_S` with jitter, each wait at most
`retry_max_s`), for as long as the store refuses (down, read-only, out of disk, slow). Nothing is
split or dropped: a row the store rejects for its content is a bug, and it stays visible —
`store_state` "refusing" with the reason, a log line per `log_every_s` — until it is fixed. The
writer thread survives all of it; `close()` gives up after its timeout and leaves the rows
unacknowledged (the Kafka offsets covering them were never snapshotted).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any

import clickhouse_connect
from tenacity import RetryCallState

from kvpipe.processors.analytics.chclient import client_kwargs
from kvpipe.processors.analytics.migrations import apply_migrations
from kvpipe.processors.analytics.query import bind_values, run_on_client
from kvpipe.processors.analytics.reads import ReadClients
from kvpipe.processors.analytics.sqlguard import checked_sql
from kvpipe.processors.analytics.tables import BY_NAME, TABLES, MessageRows, native_batch, native_take, rows_count
from kvpipe.processors.core import native
from kvpipe.schemas import retrying

log = logging.getLogger(__name__)

# The first retry of a refused insert comes after 0.05–0.1 s (the policy's jitter): a blip costs no more.
FIRST_RETRY_S = 0.1

# After a full batch, input quiet this long means the backlog is consumed: write the partial rest
# now instead of after `flush_s` (see `_run`).
BURST_IDLE_S = 0.05


class AnalyticsSink:
    def __init__(self, dsn: str, *, batch_rows: int = 20_000, flush_s: float = 1.0,
                 max_queue_rows: int | None = None, retry_max_s: float = 30.0, log_every_s: float = 30.0,
                 burst_idle_s: float = BURST_IDLE_S, native_rows: bool | None = None) -> None:
        self.dsn = dsn
        # The writer's batches as native columns, inserted as Native-format bytes the native core encodes
        # (`tables.native_batch`): None = whenever the native core runs. False: the Python columns and
        # clickhouse-connect's own encoding (the reference).
        self.native_rows = native.engine() == "native" if native_rows is None else native_rows
        self.batch_rows = max(1, batch_rows)
        self.flush_s = flush_s
        self.burst_idle_s = min(burst_idle_s, flush_s)
        self.max_queue_rows = max_queue_rows or 20 * self.batch_rows
        self.retry_max_s = max(0.05, retry_max_s)
        self.log_every_s = log_every_s
        self._client: Any = None  # the writer's
        self._client_lock = threading.Lock()
        self.readers = ReadClients(dsn)
        self._cond = threading.Condition()
        self._queue: deque[MessageRows] = deque()
        self._unwritten = 0  # rows submitted and not yet acknowledged by the store
        self._room_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []  # see wait_for_room
        self._submitted = 0  # submit calls so far; flush() waits until _done catches up
        self._done = 0
        self._flush_wanted = 0
        self._last_submit = 0.0  # monotonic time of the latest submit (the writer's idle test)
        self._stop = False
        self._abandon = False  # close() timed out: stop retrying, leave the rows unacknowledged
        self._thread: threading.Thread | None = None
        self._last_log = 0.0
        self._c: dict[str, Any] = {f"{t.name}_{k}": 0 for t in TABLES for k in ("submitted", "written")}
        self._c.update(batches=0, errors=0, retries=0, last_error="", store_up=True, store_state="up",
                       store_reason="", refusing_since=None, room_waits=0, room_wait_s=0.0)

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Open the client, apply migrations, start the writer thread."""
        if self._thread is not None:
            return
        self._client = clickhouse_connect.get_client(dsn=self.dsn, **client_kwargs(self.dsn))
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

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (for at most `timeout` s while the store refuses), stop the writer,
        close the client (which frees the chDB path)."""
        if self._thread is not None:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("analytics: closing with %d rows unacknowledged (the store refuses: %s); "
                            "they are replayed from Kafka on the next start", self._unwritten, self._c["store_reason"])
                with self._cond:
                    self._abandon = True
                    self._cond.notify_all()
                self._thread.join()
            self._thread = None
        if self._client is not None:
            with self._client_lock:
                self._client.close()
            self._client = None
        self.readers.close()

    # --- producer side (the asyncio loop) -----------------------------------------------------------

    def submit(self, rows: MessageRows) -> None:
        """Queue the rows of one message, by table name (`tables.TABLES`; submit all lifetimes a
        message ends in one call). Never blocks and never drops: the caller gates on
        `wait_for_room` before taking more input. Each table's rows come in any form its `take`
        accepts (events and lifetimes as columns or as row lists)."""
        n = rows_count(rows)
        if n == 0:
            return
        unknown = set(rows) - set(BY_NAME)
        if unknown:
            raise ValueError(f"AnalyticsSink.submit: no such analytics table {sorted(unknown)}")
        with self._cond:
            if self._stop or self._thread is None:
                raise RuntimeError("AnalyticsSink.submit: the sink is not running (start() it first)")
            self._queue.append(rows)
            self._last_submit = time.monotonic()
            self._unwritten += n
            self._submitted += 1
            for name, table_rows in rows.items():
                self._c[f"{name}_submitted"] += len(table_rows)
            self._cond.notify_all()

    def has_room(self) -> bool:
        return self._unwritten < self.max_queue_rows

    async def wait_for_room(self, poll_s: float = 0.05) -> None:
        """Await (on the event loop, never blocking its thread) until fewer than `max_queue_rows`
        rows wait for the store. A message adds its rows after this returns, so the queue may end
        a message's worth above the limit: a soft bound, never a loss.

        The writer wakes the waiter as soon as an insert makes room (`_make_room`): polled, the wait
        ended up to `poll_s` after the room, and a writer that had nothing more to write idled with
        it (py-spy on a catching-up app: both threads idle at once, ~40 waits of ~25 ms in 3 s).
        `poll_s` stays as the longest wait between looks, should a wake-up be missed."""
        if self._unwritten < self.max_queue_rows:
            return
        t0 = time.monotonic()
        self._c["room_waits"] += 1
        loop = asyncio.get_running_loop()
        try:
            while self._thread is not None:
                woken = loop.create_future()
                with self._cond:
                    if self._unwritten < self.max_queue_rows:
                        break
                    self._room_waiters.append((loop, woken))
                try:
                    await asyncio.wait_for(woken, poll_s)
                except asyncio.TimeoutError:
                    pass
                finally:  # timed out or cancelled: not to be woken on a loop that may be gone by then
                    with self._cond:
                        if (loop, woken) in self._room_waiters:
                            self._room_waiters.remove((loop, woken))
        finally:
            self._c["room_wait_s"] += time.monotonic() - t0

    def _make_room(self, n: int) -> None:
        """`n` rows acknowledged (called with `_cond` held): they leave the queue count, and an agent waiting for
        room is woken on its loop."""
        self._unwritten -= n
        self._cond.notify_all()
        if self._room_waiters and self._unwritten < self.max_queue_rows:
            for loop, woken in self._room_waiters:
                try:
                    loop.call_soon_threadsafe(_wake, woken)
                except RuntimeError:  # its loop closed meanwhile: nobody waits there any more
                    pass
            self._room_waiters.clear()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the store acknowledged every row submitted before this call; False on timeout."""
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
            out = dict(self._c, unwritten_rows=self._unwritten, max_queue_rows=self.max_queue_rows)
        if out["refusing_since"] is not None:
            out["refusing_for_s"] = round(time.time() - out["refusing_since"], 1)
        return out

    # --- read side ------------------------------------------------------------------------------

    def query(self, sql: str, parameters: dict | None = None, settings: dict | None = None) -> dict:
        """Run one read-only statement: `{"columns", "types", "rows"}`. Blocking (see module doc).
        `settings` (per-query engine limits) are merged over `readonly=1`, which always wins; its
        `max_result_rows` / `max_result_bytes` are also counted while the result is read.

        Works without start() too (no migrations, no writer): a reader's use.
        """
        checked = checked_sql(sql)  # SqlRefused / SqlSyntaxError (ValueErrors) name what is wrong
        statement, values = checked.text, bind_values(checked, parameters)
        # readonly=1 (not 2): 2 would still allow table functions such as file().
        settings = {**(settings or {}), "readonly": 1}
        with self.readers.client() as client:
            return run_on_client(client, statement, values, settings)

    def read_columns(self, sql: str, parameters: dict | None = None) -> dict[str, list]:
        """kvpipe's own read, by column (not analyst SQL: no guard, no analyst limits; `readonly=1` still).
        The app rebuilds state from its rows with it (`restore_state`). Blocking, like `query`."""
        with self.readers.client() as client:
            result = client.query(sql, parameters=parameters, settings={"readonly": 1})
            return dict(zip(result.column_names, result.result_columns))

    # --- writer thread --------------------------------------------------------------------------

    def _run(self) -> None:
        # Per table its batch (`Table.batch`: events and lifetimes as columns, so this thread only
        # concatenates and slices; with native rows a native batch, `tables.native_batch`, and the Python one
        # only for rows it could not take) and the rows pending in it plus in `incoming`.
        natives: dict[str, Any] = {t.name: native_batch(t) for t in TABLES} if self.native_rows else {}
        batches: dict[str, Any] = {t.name: t.batch() for t in TABLES}
        incoming: list[MessageRows] = []  # submits taken off the queue, merged into the batches outside the lock
        counts = dict.fromkeys(batches, 0)
        taken = 0  # submit calls drained into the pending lists
        oldest = 0.0  # monotonic time the oldest pending row was drained
        # Burst: rows arrive faster than one batch per flush_s (catching up on a backlog): the last write was
        # a full batch, or a partial write at a pause of such input. When it goes quiet for `burst_idle_s`,
        # the remainder is written at once rather than aging to `flush_s`: the tail of a backlog is not held
        # back a whole timer period. A pause mid-backlog (the agent waiting for its next fetch) writes the
        # partial batches too, so the burst outlives one partial write: else the backlog's last rows, fewer
        # than a batch, aged the whole flush_s (~1 s of a 2 s bench run, /stats sampled every 50 ms). Trickling
        # input never fills a batch, so it keeps the timer (no extra small inserts); a burst adds at most two
        # partial inserts per full batch.
        burst = False
        full_since_drain = False  # a full batch written since the last write of everything pending
        while True:
            with self._cond:
                while True:
                    if self._queue and not any(counts.values()):
                        oldest = time.monotonic()
                    while self._queue:  # only moved here: submit() waits for this lock, so no work under it
                        item = self._queue.popleft()
                        incoming.append(item)
                        for name, rows in item.items():
                            counts[name] += len(rows)
                        taken += 1
                    pending = any(counts.values())
                    now = time.monotonic()
                    quiet_at = self._last_submit + self.burst_idle_s if burst else float("inf")
                    # everything pending goes out on stop, flush(), age or a burst's end; otherwise full batches only
                    drain = pending and (self._stop or self._flush_wanted > self._done
                                         or now - oldest >= self.flush_s or now >= quiet_at)
                    if drain or max(counts.values()) >= self.batch_rows:
                        break
                    if self._stop:
                        self._done = taken
                        self._cond.notify_all()
                        return
                    self._cond.wait(min(oldest + self.flush_s, quiet_at) - now if pending else None)
            if drain:
                burst, full_since_drain = full_since_drain, False
            else:
                burst = full_since_drain = True
            for item in incoming:
                for name, rows in item.items():
                    if len(rows):
                        self._take(name, natives.get(name), batches[name], rows)
            incoming.clear()
            # Write outside the queue lock so submit() never waits for the engine.
            try:
                for name in batches:
                    self._write_batch(name, natives.get(name), True, drain)
                    self._write_batch(name, batches[name], False, drain)
            except _Abandoned:
                return
            counts = {name: len(rows) + len(natives.get(name, ())) for name, rows in batches.items()}
            with self._cond:
                if not any(counts.values()):
                    self._done = taken
                self._cond.notify_all()

    def _take(self, table: str, native_rows: Any, rows: Any, submitted: Any) -> None:
        """One submit's rows of `table` into its batch: the native one when there is one. A value the native
        columns cannot hold (a bug upstream: no insert could write it) goes to the Python batch instead, whose
        insert the store then refuses, loudly and retried, never dropped, as without native rows."""
        spec = BY_NAME[table]
        if native_rows is not None:
            try:
                native_take(spec, native_rows, submitted)
                return
            except (TypeError, ValueError, OverflowError) as exc:
                log.error("analytics: %d %s rows no native column holds (%s); written the Python way", len(submitted),
                          table, exc)
        spec.take(rows, submitted)

    def _write_batch(self, table: str, rows: Any, native_rows: bool, drain: bool) -> None:
        """Insert `rows` (a native or a Python batch of `table`): every row on `drain`, else whole batches only."""
        if rows is None:
            return
        end = len(rows) if drain else len(rows) - len(rows) % self.batch_rows
        for i in range(0, end, self.batch_rows):
            n = min(self.batch_rows, end - i)
            self._write(table, rows.encode(i, i + n) if native_rows else rows[i:i + n], n)
            # acknowledged rows leave the queue count at once: room for the agent
            with self._cond:
                self._make_room(n)
        if native_rows:
            rows.drop_front(end)
        else:
            del rows[:end]

    def _write(self, table: str, rows: Any, n: int) -> None:
        """Insert `rows` until the store acknowledges them (or close() abandons them: _Abandoned)."""
        def refused(state: RetryCallState) -> None:  # before each wait: counted, reported, rate-limited in the log
            self._store_refused(table, state.outcome.exception() if state.outcome else None, n, state.upcoming_sleep)

        retrying.retrying(first_s=FIRST_RETRY_S, max_s=self.retry_max_s, sleep=self._pause,
                          before_sleep=refused)(self._insert, table, rows, n)
        self._store_answered()

    def _pause(self, seconds: float) -> None:
        """The wait between retries, cut short by close() giving up."""
        with self._cond:
            if self._cond.wait_for(lambda: self._abandon, timeout=seconds):
                raise _Abandoned()

    def _insert(self, table: str, rows: Any, n: int) -> None:
        """One insert of `n` rows: Native-format bytes (a native batch's) or a slice of the table's Python batch."""
        spec = BY_NAME[table]
        if isinstance(rows, bytes):
            with self._client_lock:
                self._client.raw_insert(table, list(spec.columns), insert_block=rows, fmt="Native")
        else:
            data = spec.insert(rows)
            with self._client_lock:
                self._client.insert(table, data, column_names=list(spec.columns), column_oriented=True)
        with self._cond:
            self._c[f"{table}_written"] += n
            self._c["batches"] += 1

    def _store_refused(self, table: str, exc: BaseException | None, rows: int, pause: float) -> None:
        reason = f"{table}: {type(exc).__name__}: {str(exc)[:500]}"
        with self._cond:
            c = self._c
            c["errors"] += 1
            c["retries"] += 1
            c["last_error"] = c["store_reason"] = reason
            if c["store_up"]:
                c["refusing_since"] = time.time()
            c["store_up"], c["store_state"] = False, "refusing"
        now = time.monotonic()
        if now - self._last_log >= self.log_every_s:  # rate-limited: an outage is one line per interval
            self._last_log = now
            log.error("analytics: the store refuses %d %s rows (retrying every <= %.0f s, next in %.1f s; "
                      "%d rows wait, consumption pauses at %d): %s", rows, table, self.retry_max_s, pause,
                      self._unwritten, self.max_queue_rows, reason)

    def _store_answered(self) -> None:
        if self._c["store_up"]:
            return
        with self._cond:
            since = self._c["refusing_since"]
            self._c.update(store_up=True, store_state="up", refusing_since=None)
        self._last_log = 0.0
        log.warning("analytics: the store accepts rows again after %.1f s refusing (last reason: %s)",
                    time.time() - (since or time.time()), self._c["store_reason"])


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():  # the waiter may have timed out and gone on
        woken.set_result(None)


class _Abandoned(Exception):
    """close() gave up on a store that keeps refusing."""
