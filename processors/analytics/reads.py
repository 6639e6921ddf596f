"""Reading an analyst's result within its caps, and the store's read clients (apart from the writer's).

Caps counted while reading. The engine's `max_result_rows` / `max_result_bytes` are checked per block, after the
block is made, and a constant column counts once however many rows repeat it; so one block passed them whole
(`SELECT arrayJoin(range(2000000))` is one block of 2 M rows; `SELECT range(2000000)` counted 8 MiB as one value).
`read_capped` therefore does not trust them:

- rows: the engine's `limit` setting is set to the row cap + 1. It cuts the outermost query's result inside a block
  (subqueries, CTEs and `IN` sets keep their rows), so at most cap + 1 rows ever leave the engine, and cap + 1 means
  "over the cap".
- bytes: the result is read as the engine's Native bytes, as they arrive, and the read stops (the stream is closed,
  which ends the query) as soon as they pass the byte cap, before anything is decoded; Python objects are several
  times larger than Native bytes (an array of 5 M UInt32 is 20 MB Native, 310 MB of Python lists). What is decoded
  is therefore at most the cap.

Memory is then bounded by the cap plus the block in flight: the engine hands over a whole block, which the engine
itself refuses when it is over the byte cap, except a block of constant columns (the same value on every row, which
it counts once); that one is bounded by the engine's `max_memory_usage`, since the engine builds it.

The limits travel as a `SETTINGS` clause on the checked text, not as per-call settings: for per-call settings the
chDB transport sets and restores them around a non-streaming call (so the whole result would arrive at once), and
it cannot stream `DESCRIBE`/`SHOW`/`EXPLAIN` at all; those answer a few rows of metadata and are read whole, then
counted.

Read clients. The writer (migrations, inserts) has its client and lock; readers take one from `ReadClients`, which
opens one more whenever every open one is busy, so readers never queue behind the writer or behind each other (chDB
serves any number of handles to the one engine a process hosts, each one call at a time, and a read on one handle
sees what an insert on another has committed; over HTTP each client is its own session).
"""
from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from typing import Any

import clickhouse_connect

from kvpipe.processors.analytics.chclient import client_kwargs

_SETTING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENGINE_ERROR = re.compile(rb"Code: \d+\. DB::Exception: [^\x00]{1,2000}")


class ResultTooLarge(Exception):
    """The result passed a cap: `limit` names the setting, `cap` its value, `seen` how far the read got."""

    def __init__(self, limit: str, cap: int, seen: int) -> None:
        super().__init__(f"{limit}: more than {cap} ({seen} read before the read stopped)")
        self.limit, self.cap, self.seen = limit, cap, seen


def read_capped(client: Any, statement: str, values: dict | None, settings: dict) -> dict:
    """`{"columns", "types", "rows"}` of a checked statement, or ResultTooLarge. Blocking.

    `settings` are the engine settings to send; their `max_result_rows` / `max_result_bytes` (when set) are also
    the caps counted here. `values` bind to the statement's `{name:Type}` placeholders (the caller has checked
    that the library binds them in the engine).
    """
    max_rows, max_bytes = int(settings.get("max_result_rows") or 0), int(settings.get("max_result_bytes") or 0)
    if max_rows:
        settings = {**settings, "limit": max_rows + 1}
    streamable = statement.lstrip("( \t\r\n").upper().startswith(("SELECT", "WITH"))
    if streamable:
        data = _read_native(client, f"{statement}\n SETTINGS {settings_clause(settings)}", values, max_bytes)
        result = _decode_native(client, statement, data) if data else None
    else:
        result = client.query(statement, parameters=values or None, settings=settings)
    rows = [list(r) for r in result.result_rows] if result is not None else []
    if max_rows and len(rows) > max_rows:
        raise ResultTooLarge("max_result_rows", max_rows, len(rows))
    if result is None:
        return {"columns": [], "types": [], "rows": []}
    if not streamable and max_bytes and (size := _metadata_size(rows)) > max_bytes:
        raise ResultTooLarge("max_result_bytes", max_bytes, size)
    return {"columns": list(result.column_names), "types": [t.name for t in result.column_types], "rows": rows}


def settings_clause(settings: dict) -> str:
    """`name = value, ...` for a SETTINGS clause: names checked, strings quoted (the values are the service's)."""
    parts = []
    for name, value in settings.items():
        if not _SETTING_NAME.fullmatch(name):
            raise ValueError(f"not a setting name: {name!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"setting {name}: expected a number or a string, got {value!r}")
        if isinstance(value, str):
            value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        parts.append(f"{name} = {value}")
    return ", ".join(parts)


def _read_native(client: Any, text: str, values: dict | None, max_bytes: int) -> bytes:
    """The result's Native bytes, read as they arrive; ResultTooLarge past `max_bytes` (0: no cap)."""
    stream = client.raw_stream(text, parameters=values or None, fmt="Native")
    data = bytearray()
    try:
        if not max_bytes:
            return stream.read()
        while True:
            # one read may return many blocks; asking for one byte past the cap is enough to know it is passed
            chunk = stream.read(max_bytes + 1 - len(data))
            if not chunk:
                return bytes(data)
            data += chunk
            if len(data) > max_bytes:
                raise ResultTooLarge("max_result_bytes", max_bytes, len(data))
    finally:
        stream.close()  # ends the query in the engine when the read stopped early


class _OneChunk:
    """The byte source clickhouse-connect's Native decoder reads from: the bytes already read, in one piece."""

    last_message = None
    exception_tag = None

    def __init__(self, data: bytes) -> None:
        self._data = data

    @property
    def gen(self) -> Iterator[bytes]:
        yield self._data

    def close(self) -> None:
        pass


def _decode_native(client: Any, statement: str, data: bytes) -> Any:
    """clickhouse-connect's own decoding of Native bytes (the same as `client.query` applies to a response), so
    values come back as they always did: a QueryResult."""
    from clickhouse_connect.driver.ctypes import RespBuffCls
    from clickhouse_connect.driver.transform import NativeTransform

    context = client.create_query_context(query=statement)
    try:
        return NativeTransform.parse_response(RespBuffCls(_OneChunk(data)), context)
    except Exception:  # noqa: BLE001 - the decoder's message quotes the bytes; never pass those on
        # a server that fails half way appends its error as text after the Native bytes it had sent
        error = _ENGINE_ERROR.search(data[-65_536:])
        raise RuntimeError(error.group(0).decode("utf-8", "replace") if error else
                           "the engine's answer could not be decoded") from None


def _metadata_size(rows: list[list]) -> int:
    """A DESCRIBE/SHOW/EXPLAIN answer's size in bytes, about as Native counts it (its text and 8 per number)."""
    return sum(len(v) if isinstance(v, (str, bytes)) else 8 for row in rows for v in row)


class ReadClients:
    """Clients for reads, none of them the writer's: one per concurrent reader, opened when all are busy.

    A reader holds its client for one call (`with readers.client() as c`). The number open is the most readers
    there have been at once (the analyst service's concurrency bound plus the app's own reads). `close()` closes
    them all; a later reader opens new ones (a sink may be started again).
    """

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._lock = threading.Lock()
        self._idle: list[Any] = []
        self._open: list[Any] = []
        self._generation = 0  # close() moves it on: a client handed out before then is not taken back

    @contextlib.contextmanager
    def client(self) -> Iterator[Any]:
        with self._lock:
            generation = self._generation
            client = self._idle.pop() if self._idle else None
        if client is None:
            client = clickhouse_connect.get_client(dsn=self.dsn, **client_kwargs(self.dsn))
            with self._lock:
                closed = generation != self._generation
                if not closed:
                    self._open.append(client)
            if closed:
                client.close()
                raise RuntimeError("the store's read clients were closed while one was opening")
        try:
            yield client
        finally:
            with self._lock:
                if generation == self._generation:
                    self._idle.append(client)

    @property
    def opened(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        """Close every read client (a chDB path is free again once the writer's is closed too). A read still
        running on one finishes first: chDB closes a handle once its call has returned."""
        with self._lock:
            self._generation += 1
            clients, self._open, self._idle = self._open, [], []
        for client in clients:
            client.close()
