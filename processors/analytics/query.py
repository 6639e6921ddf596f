"""Analyst SQL as a service: the request, the guard, the engine's limits, bounded concurrency, clean errors.

One path for every reader. The analytics app's `/sql` view decodes the body with `parse_sql_request` and awaits
`AnalystQueries.execute`; `kvpipe sql` against a ClickHouse server calls `run_checked` with a runner built by
`client_runner` on its own clickhouse-connect client. Both go through `sqlguard.check_sql` (only kvpipe's tables,
allowlisted functions, the regenerated text is what runs), both send the same per-query limits as engine
settings, so the engine itself throws when a query runs too long, takes too much memory or answers too much, and
both read the answer through `run_on_client`, which counts the result caps itself (`reads.read_capped`):

- `readonly=1` (embedded chDB; on a server the analyst user's own `readonly=2`): reads only, and the query cannot
  change a setting (checked on chDB 4.4 / ClickHouse 26.9: with readonly=1 sent *with* the query the other limits
  still apply, and a `SETTINGS` clause is refused by the engine as well as by the guard). readonly=1 also refuses table functions such as `file()` in FROM; it does not refuse
  the scalar `file()` function, which is why the guard's function allowlist exists.
- `max_execution_time` + `timeout_overflow_mode='throw'`, `max_memory_usage`, `max_result_rows` /
  `max_result_bytes` + `result_overflow_mode='throw'` (a truncated answer would look complete),
  `allow_introspection_functions=0`.
  `max_rows_to_read` is left unset: the saved queries scan whole tables by design, and time and memory bound a scan.

Where the engine does not hold a limit, the app does (RELIABILITY.md has the figures). Result caps are counted
while reading (`reads.read_capped`; the engine checks them per finished block). Time: the engine checks its limit
between blocks (`ANALYST_BLOCK_ROWS` keeps those short) and nothing interrupts a step inside one, not `KILL QUERY`
nor chDB's cancel; the guard refuses the functions one call of which has no bound (`sqlfunctions`), and
`AnalystQueries` answers 422 `DEADLINE_GRACE_S` after the limit whatever the engine does, the slot staying taken
until the query ends.

On a server, limits sent by a client are only as strong as the user they run as: analysts must connect as a
read-only user (`readonly = 2`, so the client may send these limits, with SELECT granted on kvpipe's tables only);
`docs/analyst-sql.md` has the statements. A password never appears in an error: `redact_dsn` and `_clean` scrub
what the engine or the transport says before it reaches the analyst.

Parameters bind in the engine only. The guard returns the `{name:Type}` placeholders of the checked tree; a request's
`params` must name exactly those (`bind_values`: any other name, or a placeholder left without a value, is a 400 that
names it). `check_binding`, before every call into clickhouse-connect with analyst text (`engine_query`,
`run_on_client`), asks the library's own binder what it would send and refuses unless that is the checked
text unchanged plus one `param_<name>` per value: clickhouse-connect formats `%(name)s` into the text itself when it
sees no placeholder, after the guard, so a `%(s)s` inside a string literal once turned a parameter into SQL.

Concurrency. At most `max_concurrent` queries run at once, each on this module's own thread pool (never on the
event loop, never on the loop's default executor that ingest uses); at most `max_waiting` more wait; beyond that a
request is answered 429 at once. A request whose client goes away keeps its slot until its query ends, so the
bound counts what the engine is really doing.
"""
from __future__ import annotations

import asyncio
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable
from urllib.parse import urlsplit

import msgspec

from kvpipe.processors.analytics.sqlguard import DEFAULT_DATABASE, CheckedSql, SqlRefused, SqlSyntaxError, checked_sql
from kvpipe.processors.analytics.reads import ResultTooLarge, read_capped
from kvpipe.schemas.redact import masked_dsn as redact_dsn  # the one DSN masking, re-exported for callers

# run(statement, parameters, engine_settings) -> {"columns", "types", "rows"}; blocking.
Runner = Callable[[str, "dict | None", dict], dict]

_PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_PARAM_CHARS = 65_536
# ClickHouse's own max_query_size (262144 bytes): a longer statement could never run, and parsing one takes
# seconds, so it is refused before the parser sees it
MAX_STATEMENT_BYTES = 256 * 1024
# a /sql body: the statement, its parameters and the JSON around them
MAX_BODY_BYTES = MAX_STATEMENT_BYTES + 64 * MAX_PARAM_CHARS // 16
# How long past max_execution_s an answer is awaited (the engine stops at the end of a block); then the analyst is
# answered and the query ends on its own (AnalystQueries.execute).
DEADLINE_GRACE_S = 1.0
# Rows per analyst block (the engine's default is 65 409): a query whose rows are each expensive overruns the time
# limit by one block's work; 8x smaller blocks cut that about 4x and cost the saved queries nothing measurable.
ANALYST_BLOCK_ROWS = 8192
# Engine error codes that mean "a per-query limit was hit" → the setting that set it.
_LIMIT_CODES = {
    159: "max_execution_time",  # TIMEOUT_EXCEEDED
    241: "max_memory_usage",  # MEMORY_LIMIT_EXCEEDED
    396: "max_result_rows / max_result_bytes",  # TOO_MANY_ROWS_OR_BYTES (result)
    158: "max_rows_to_read",  # TOO_MANY_ROWS
    307: "max_bytes_to_read",  # TOO_MANY_BYTES
}
_SYNTAX_CODES = {62, 47, 46, 43, 36, 6, 27, 53}  # syntax, unknown identifier/function, bad arguments, parse, type
_CODE = re.compile(r"Code:\s*(\d+)\.\s*(?:DB::Exception:\s*)?")
class QueryError(Exception):
    """An analyst-facing failure: `status` (4xx), `error` (short), `detail` (what to change)."""

    def __init__(self, status: int, error: str, detail: str = "") -> None:
        super().__init__(f"{error}: {detail}" if detail else error)
        self.status, self.error, self.detail = status, error, detail

    def body(self) -> dict:
        return {"error": self.error, "detail": self.detail}


class SqlRequest(msgspec.Struct, forbid_unknown_fields=True):
    sql: str
    params: dict[str, int | float | str] = {}


_REQUEST = msgspec.json.Decoder(SqlRequest)


def parse_sql_request(body: bytes) -> SqlRequest:
    """`{"sql": "...", "params": {"name": value}}` → SqlRequest, or QueryError(400) saying what is wrong."""
    try:
        request = _REQUEST.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise QueryError(400, "bad sql request", f'{exc}; expected {{"sql": "SELECT ...", "params": '
                                                  f'{{"<name>": <int, float or string>}}}}') from None
    check_params(request.params)
    if not request.sql.strip():
        raise QueryError(400, "bad sql request", "sql is empty")
    return request


def check_params(params: dict) -> dict[str, int | float | str]:
    """Parameter names and values fit for server-side binding (`{name:Type}`), or QueryError(400)."""
    if not isinstance(params, dict):
        raise QueryError(400, "bad sql params", 'expected {"params": {"<name>": <int, float or string>}}')
    for name, value in params.items():
        if not isinstance(name, str) or not _PARAM_NAME.fullmatch(name):
            raise QueryError(400, "bad sql params", f"parameter name {name!r}: letters, digits and _ only, "
                                                    f"not starting with a digit, at most 64 characters")
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise QueryError(400, "bad sql params", f"params[{name!r}] is {value!r}; expected an int, float or string")
        if isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
            raise QueryError(400, "bad sql params", f"params[{name!r}] does not fit in 64 bits")
        if isinstance(value, str) and len(value) > MAX_PARAM_CHARS:
            raise QueryError(400, "bad sql params", f"params[{name!r}] is longer than {MAX_PARAM_CHARS} characters")
    return params


def check_statement(sql: str, database: str = DEFAULT_DATABASE) -> CheckedSql:
    """The text to run for an analyst's statement and its placeholders, or QueryError: 403 refused, 400 does not
    parse (or nests deeper than the parser can follow), 413 longer than the engine would take."""
    size = len(sql.encode("utf-8", "surrogatepass")) if isinstance(sql, str) else 0
    if size > MAX_STATEMENT_BYTES:
        raise QueryError(413, "statement too large", f"{size} bytes; the limit is {MAX_STATEMENT_BYTES} (the engine's "
                                                     "max_query_size): aggregate, or use a parameter")
    try:
        return checked_sql(sql, database=database)
    except RecursionError:
        raise QueryError(400, "sql nested too deep", "the statement nests deeper than the SQL parser follows; "
                                                     "flatten it (CTEs instead of nested subqueries)") from None
    except SqlSyntaxError as exc:
        raise QueryError(400, "sql does not parse", str(exc)) from None
    except SqlRefused as exc:
        raise QueryError(403, "statement not allowed", str(exc)) from None


class QueryLimits(msgspec.Struct, frozen=True):
    max_execution_s: float = 30.0
    max_memory_bytes: int = 1 << 30
    max_result_rows: int = 100_000
    max_result_bytes: int = 64 << 20
    max_concurrent: int = 2
    max_waiting: int = 8
    database: str = DEFAULT_DATABASE  # the one database analysts may name (`default.kv_events`)
    # Embedded chDB: send readonly=1 with each query. A server user with readonly=2 may not change `readonly`
    # (ClickHouse refuses it), so for a server DSN the user's own profile carries it (docs/analyst-sql.md).
    send_readonly: bool = True

    @classmethod
    def from_settings(cls, settings: Any) -> "QueryLimits":
        concurrent = max(1, int(settings.sql_max_concurrent))
        return cls(max_execution_s=float(settings.sql_max_execution_s),
                   max_memory_bytes=int(settings.sql_max_memory_bytes),
                   max_result_rows=int(settings.sql_max_result_rows),
                   max_result_bytes=int(settings.sql_max_result_bytes),
                   max_concurrent=concurrent, max_waiting=4 * concurrent,
                   database=dsn_database(settings.clickhouse()),
                   send_readonly=not settings.clickhouse().startswith(("http://", "https://")))

    def engine_settings(self) -> dict:
        readonly = {"readonly": 1} if self.send_readonly else {}
        return {
            **readonly,
            "max_execution_time": self.max_execution_s,
            "timeout_overflow_mode": "throw",
            "max_memory_usage": self.max_memory_bytes,
            "max_result_rows": self.max_result_rows,
            "max_result_bytes": self.max_result_bytes,
            "result_overflow_mode": "throw",
            "allow_introspection_functions": 0,
            "max_block_size": ANALYST_BLOCK_ROWS,
            # the lowest CPU priority for the engine's threads running it (where the process may set it:
            # CAP_SYS_NICE, else the engine ignores it): the app's writer and ingest come first on a busy host
            "os_thread_priority": 19,
        }


def bind_values(checked: CheckedSql, params: dict | None) -> dict[str, int | float | str]:
    """The values to bind for `checked`: every parameter names a placeholder of the checked tree and every
    placeholder has a value, or QueryError(400) naming the parameter."""
    values = check_params(dict(params or {}))
    for name in values:
        if name not in checked.placeholders:
            where = (f"its placeholders are {', '.join('{%s:%s}' % p for p in checked.placeholders.items())}"
                     if checked.placeholders else "it has no {name:Type} placeholder")
            raise QueryError(400, "bad sql params", f"params[{name!r}] is not a placeholder of the statement ({where}); "
                                                    f"parameters bind only to {{{name}:Type}} placeholders")
    for name, type_name in checked.placeholders.items():
        if name not in values:
            raise QueryError(400, "bad sql params", f"placeholder {{{name}:{type_name}}} has no value in params")
    return values


def engine_query(client: Any, statement: str, values: dict | None, settings: dict) -> Any:
    """`client.query` for checked analyst text, with parameters that the engine binds; never formatted into the text.

    Fails closed: if clickhouse-connect's binder would change the text or not send every value as a `param_`, or
    cannot be found at all, the parameters are refused (400) rather than sent.
    """
    check_binding(statement, values)
    return client.query(statement, parameters=dict(values) if values else None, settings=settings)


def check_binding(statement: str, values: dict | None) -> None:
    """QueryError(400) unless clickhouse-connect would send `statement` unchanged with one `param_<name>` per value
    (the same binder serves `client.query` and `client.raw_stream`)."""
    if values:
        try:
            from clickhouse_connect.driver.binding import bind_query

            text, bound = bind_query(statement, dict(values))
        except ImportError:
            text, bound = None, {}
        except Exception as exc:  # noqa: BLE001 - the binder refusing a value is the analyst's 400
            raise QueryError(400, "bad sql params", str(exc)[:300]) from None
        if text != statement or set(bound) != {f"param_{name}" for name in values}:
            raise QueryError(400, "bad sql params", "these parameters would not be bound by the engine; write each "
                                                    "as a {name:Type} placeholder of the statement")


def run_on_client(client: Any, statement: str, values: dict | None, settings: dict) -> dict:
    """Checked analyst text on one clickhouse-connect client: `{"columns", "types", "rows"}`, read within the caps
    that `settings` carry (`reads.read_capped`: counted while reading, whatever the engine enforced). Blocking; the
    caller holds the client for the call."""
    check_binding(statement, values)
    try:
        out = read_capped(client, statement, values, settings)
        if not out["columns"] and statement.upper().startswith(("SELECT", "WITH")):
            # chDB sends no header for an empty result; ask the engine for the result's shape instead.
            shape = engine_query(client, f"DESCRIBE TABLE ({statement})", values, settings)
            out["columns"], out["types"] = [r[0] for r in shape.result_rows], [r[1] for r in shape.result_rows]
    except ResultTooLarge as exc:
        what = "rows" if exc.limit == "max_result_rows" else "bytes"
        raise QueryError(422, f"query limit exceeded: {exc.limit}",
                         f"the result has more than {exc.cap} {what} (the read stopped at {exc.seen}); narrow the "
                         f"query, aggregate more, or add LIMIT") from None
    return out


def run_checked(run: Runner, sql: str, params: dict | None, limits: QueryLimits, dsn: str = "") -> dict:
    """Guard, then run with the limits; blocking. The one code path of the service and of `kvpipe sql` on a server."""
    checked = check_statement(sql, limits.database)
    values = bind_values(checked, params)
    try:
        return run(checked.text, values or None, limits.engine_settings())
    except QueryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the engine or transport says becomes a 4xx with its reason
        raise engine_error(exc, limits, dsn) from None


class AnalystQueries:
    """Runs analyst statements off the event loop, at most `limits.max_concurrent` at a time."""

    def __init__(self, run: Runner, limits: QueryLimits, dsn: str = "") -> None:
        self._run = run
        self.limits = limits
        self._dsn = dsn
        self._pool = ThreadPoolExecutor(max_workers=limits.max_concurrent, thread_name_prefix="kvpipe-sql")
        # the guard parses on a thread of its own: a long statement takes the parser a while, never the event loop
        self._guard = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpipe-sql-guard")
        self._lock = threading.Lock()
        self._admitted = 0  # running + waiting; decremented by the worker thread when the query ends

    @property
    def admitted(self) -> int:
        with self._lock:
            return self._admitted

    async def execute(self, request: SqlRequest) -> dict:
        # The guard is pure: refuse before taking a slot, so refusals never wait behind running queries.
        await asyncio.get_running_loop().run_in_executor(
            self._guard, lambda: bind_values(check_statement(request.sql, self.limits.database), request.params))
        capacity = self.limits.max_concurrent + self.limits.max_waiting
        with self._lock:
            if self._admitted >= capacity:
                raise QueryError(429, "too many queries", f"{self.limits.max_concurrent} running and "
                                                          f"{self.limits.max_waiting} waiting; retry shortly")
            self._admitted += 1
        started: Future[None] = Future()
        try:
            future = self._pool.submit(self._call, request.sql, dict(request.params), started)
        except RuntimeError:
            self._release()
            raise QueryError(503, "sql service is shutting down") from None
        answer: asyncio.Future[Any] = asyncio.wrap_future(future)
        # the deadline counts from the start of the run, not from the wait for a slot (that one is bounded by
        # max_waiting); shield: giving up on the answer must not cancel the call, whose slot is freed when it ends
        begun: asyncio.Future[Any] = asyncio.wrap_future(started)
        await asyncio.wait({answer, begun}, return_when=asyncio.FIRST_COMPLETED)
        deadline = self.limits.max_execution_s + DEADLINE_GRACE_S
        try:
            return await asyncio.wait_for(asyncio.shield(answer), deadline)
        except asyncio.TimeoutError:
            answer.add_done_callback(lambda f: f.cancelled() or f.exception())  # its end is nobody's news now
            raise QueryError(422, "query limit exceeded: max_execution_time",
                             f"no answer {deadline:g} s after the start (the limit is {self.limits.max_execution_s:g}"
                             f" s): the engine is in a step it does not interrupt and ends the query after it; "
                             f"scan smaller arrays or fewer rows") from None

    def _call(self, sql: str, params: dict, started: Future) -> dict:
        started.set_result(None)
        try:
            return run_checked(self._run, sql, params, self.limits, self._dsn)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._admitted -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._guard.shutdown(wait=False, cancel_futures=True)


def engine_error(exc: BaseException, limits: QueryLimits, dsn: str = "") -> QueryError:
    """A 4xx QueryError for an engine or transport failure: the engine's reason, trimmed, with no secret in it."""
    text = _clean(str(exc), dsn)
    match = _CODE.search(text)
    code = int(match.group(1)) if match else None
    reason = text[match.end():] if match else text
    reason = re.split(r"\s*\(version \d|\s*Stack trace", reason)[0]
    # "(while reading from part /var/lib/…/store/…)": the engine's data path is noise to an analyst
    reason = re.sub(r"\s*\(while reading from part [^)]*\)?:?", "", reason).strip()[:400]
    if code in _LIMIT_CODES:
        setting = _LIMIT_CODES[code]
        values = {"max_execution_time": f"{limits.max_execution_s:g} s",
                  "max_memory_usage": f"{limits.max_memory_bytes} bytes",
                  "max_result_rows / max_result_bytes": f"{limits.max_result_rows} rows / "
                                                        f"{limits.max_result_bytes} bytes"}
        bound = values.get(setting, "")
        return QueryError(422, f"query limit exceeded: {setting}",
                          f"{reason} (the limit is {bound}; narrow the query, aggregate more, or add LIMIT)"
                          if bound else reason)
    if code in _SYNTAX_CODES:
        return QueryError(400, "query rejected by the engine", reason)
    if code is None and isinstance(exc, OSError):
        return QueryError(502, "analytics store unreachable", reason)
    return QueryError(422, "query failed", reason)


def dsn_database(dsn: str) -> str:
    """The database a clickhouse-connect DSN names (`http://host:8123/db`), `default` for chDB or none."""
    if not dsn.startswith(("http://", "https://", "clickhouse://", "clickhouses://")):
        return DEFAULT_DATABASE
    path = urlsplit(dsn).path.strip("/")
    return path or DEFAULT_DATABASE


def redact_text(text: str, dsn: str = "") -> str:
    """`text` (an exception's message, a log line) with `dsn`'s password and any URL's credentials
    replaced by *** (the analytics CLI prints store errors through it)."""
    return _clean(text, dsn)


def _clean(text: str, dsn: str) -> str:
    """Error text with the DSN and its password removed, whatever form the transport quoted them in."""
    if dsn:
        text = text.replace(dsn, redact_dsn(dsn))
        try:
            password = urlsplit(dsn).password
        except ValueError:
            password = None
        if password:
            text = text.replace(password, "***")
    # Any URL with credentials that slipped through (a transport quoting its own URL).
    return re.sub(r"(\w+://[^:/@\s]+:)[^@\s]+@", r"\1***@", text)


# --- a runner on a clickhouse-connect client (embedded chDB or a server) ---------------------------------------------

def client_runner(client: Any, lock: threading.Lock | None = None) -> Runner:
    """A Runner over one clickhouse-connect client; `lock` serialises calls (chDB serves one call at a time)."""
    lock = lock or threading.Lock()

    def run(statement: str, parameters: dict | None, settings: dict) -> dict:
        with lock:
            return run_on_client(client, statement, parameters, settings)

    return run
