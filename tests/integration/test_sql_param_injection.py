"""Parameter injection through `/sql` params, on real chDB: refused with a 400 that names the parameter, and harmless.

clickhouse-connect formats `%(name)s` into the statement text itself (Python `%` formatting, values quoted) when the
statement has no `{name:Type}` placeholder — after the guard has checked the text. A `%(s)s` inside a string literal
passes the guard as text; formatted, its quotes close the literal and the value becomes SQL. chDB runs every
`;`-separated statement, and the limits sent with the query bind only the last one.

Each attack here comes with a control: the bare client, given the same statement and params, really reads the file,
calls the URL, writes the file or drops the table. Then the same request goes through both code paths that run
analyst SQL — the analytics app's store (`AnalyticsSink.query`, embedded) and the runner `kvpipe sql` uses on a
server DSN (`client_runner`) — and must be refused before anything reaches the engine.
"""
from __future__ import annotations

import asyncio
import http.server
import threading
import uuid
from pathlib import Path

import clickhouse_connect
import pytest

from kvpipe.bench.saved_queries import fill
from kvpipe.processors.analytics.migrations import apply_migrations
from kvpipe.processors.analytics.query import (AnalystQueries, QueryError, QueryLimits, SqlRequest, client_runner,
                                               engine_query)
from kvpipe.processors.analytics.sink import AnalyticsSink

pytestmark = pytest.mark.integration


class _Listener(http.server.BaseHTTPRequestHandler):
    requests = 0

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        type(self).requests += 1
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"c1\nleaked-by-url\n")

    do_POST = do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


def _chars(text: str) -> str:
    """A string as `char(...)`: the attacker's value may hold no quote (the formatter would escape it)."""
    return "char(" + ",".join(str(ord(c)) for c in text) + ")"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sql-param-injection")
    marker = f"kvpipe-secret-{uuid.uuid4().hex}"
    (tmp / "secret.tsv").write_text(f"c1\n{marker}\n")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Listener)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    sink = AnalyticsSink(f"chdb://{tmp / 'store'}")
    client = clickhouse_connect.get_client(dsn=sink.dsn)
    sink._client = client  # one engine path per process: the store and the bare client share the connection
    try:
        apply_migrations(client)
        fill(client, 20_000)
        yield {"tmp": tmp, "client": client, "sink": sink, "marker": marker, "server": _Listener,
               "url": f"http://127.0.0.1:{server.server_address[1]}/x", "lock": sink._client_lock}
    finally:
        sink.close()  # its read clients too: the engine path is free for the next module
        client.close()
        server.shutdown()


def _attacks(world, target_table: str) -> dict[str, tuple[str, dict, callable]]:
    """name -> (statement, params, harmed()): harmed() says whether the attack did what it was aimed at."""
    tmp, client = world["tmp"], world["client"]
    secret, written = str(tmp / "secret.tsv"), tmp / f"written-{uuid.uuid4().hex}.tsv"
    seen = {"rows": None}

    def file_read_harmed() -> bool:
        return world["marker"] in repr(seen["rows"])

    def url_harmed() -> bool:
        return world["server"].requests > 0

    def dropped() -> bool:
        return client.query(f"EXISTS TABLE {target_table}").result_rows[0][0] == 0

    return {
        "file read": ("SELECT '%(s)s' AS v FROM kv_events LIMIT 1",
                      {"s": f", file({_chars(secret)}) AS leaked, "}, file_read_harmed),
        "url request (SSRF)": ("SELECT '%(s)s' AS v",
                               {"s": f"; SELECT * FROM url({_chars(world['url'])}, {_chars('CSV')}, "
                                     f"{_chars('c1 String')}); SELECT "}, url_harmed),
        "file write": ("SELECT '%(s)s' AS v",
                       {"s": f"; INSERT INTO FUNCTION file({_chars(str(written))}, {_chars('TSV')}, "
                             f"{_chars('c String')}) SELECT {_chars('pwned')}; SELECT "}, written.exists),
        "drop table through a literal": ("SELECT '%(s)s' AS v", {"s": f"; DROP TABLE {target_table}; SELECT "},
                                         dropped),
        # the formatter quotes with ' and escapes only ' and \: a " in the value closes the identifier
        "drop table through a quoted identifier": ('SELECT 1 AS "%(s)s"',
                                                    {"s": f'"; DROP TABLE {target_table}; SELECT 1 AS "'}, dropped),
    }, seen


def _fresh_canary(client) -> str:
    name = f"canary_{uuid.uuid4().hex[:12]}"
    client.command(f"CREATE TABLE {name} (x UInt8) ENGINE = MergeTree ORDER BY x")
    return name


def test_control_the_bare_client_turns_each_param_into_sql_and_does_the_harm(world) -> None:
    """Without the binding rule every attack works on this engine, so the refusals below can fail."""
    client, limits = world["client"], QueryLimits()
    names = list(_attacks(world, "x")[0])
    for name in names:
        canary = _fresh_canary(client)  # the control drops a table of its own, never kvpipe's
        attacks, seen = _attacks(world, canary)
        sql, params, harmed = attacks[name]
        world["server"].requests = 0
        with world["lock"]:
            try:
                seen["rows"] = client.query(sql, parameters=params, settings=limits.engine_settings()).result_rows
            except Exception:  # noqa: BLE001 - some controls end in an error after the harm is done
                pass
        assert harmed(), f"control {name!r}: the bare client did not do the harm; the attack is not a real one"
    world["server"].requests = 0


@pytest.mark.parametrize("path", ["embedded store (AnalyticsSink.query)", "server runner (client_runner)"])
def test_every_param_injection_is_refused_naming_the_param_and_does_no_harm(world, path: str) -> None:
    client = world["client"]
    run = world["sink"].query if path.startswith("embedded") else client_runner(client, world["lock"])
    queries = AnalystQueries(run, QueryLimits())
    events_before = client.query("SELECT count() FROM kv_events").result_rows[0][0]
    canary = _fresh_canary(client)
    attacks, seen = _attacks(world, canary)
    # and the table analysts care about, aimed at directly; and a formatted param beside a real placeholder (the
    # library would bind both in the engine there, but `s` names no placeholder of the checked tree)
    attacks["drop kv_events"] = ("SELECT '%(s)s' AS v", {"s": "; DROP TABLE kv_events; SELECT "}, lambda: False)
    attacks["beside a real placeholder"] = ("SELECT {n:UInt32} AS n, '%(s)s' AS v",
                                            {"n": 1, "s": f"; DROP TABLE {canary}; SELECT "}, attacks["file read"][2])
    world["server"].requests = 0
    try:
        for name, (sql, params, harmed) in attacks.items():
            with pytest.raises(QueryError) as refused:
                asyncio.run(queries.execute(SqlRequest(sql=sql, params=params)))
            assert refused.value.status == 400, (name, refused.value.body())
            assert "params['s']" in refused.value.detail and "placeholder" in refused.value.detail, name
            assert world["marker"] not in str(refused.value.body()), name
            assert not harmed(), name
            # the store's own read path refuses it too, whoever calls it
            with pytest.raises(QueryError):
                world["sink"].query(sql, params)
            assert not harmed(), name
    finally:
        queries.close()
    assert world["server"].requests == 0
    assert client.query("SELECT count() FROM kv_events").result_rows[0][0] == events_before


def test_engine_query_fails_closed_when_the_library_would_format(world) -> None:
    """The last step itself refuses text the library would rewrite, even if a caller skipped the guard."""
    client = world["client"]
    canary = _fresh_canary(client)
    with pytest.raises(QueryError) as refused:
        engine_query(client, "SELECT '%(s)s' AS v", {"s": f"; DROP TABLE {canary}; SELECT "}, {"readonly": 1})
    assert refused.value.status == 400 and "placeholder" in refused.value.detail
    assert client.query(f"EXISTS TABLE {canary}").result_rows[0][0] == 1


def test_typed_placeholders_still_bind_in_the_engine(world) -> None:
    nasty = "x'); DROP TABLE kv_events; --%(s)s"
    for run in (world["sink"].query, client_runner(world["client"], world["lock"])):
        queries = AnalystQueries(run, QueryLimits())
        try:
            out = asyncio.run(queries.execute(SqlRequest(
                sql="SELECT {s:String} AS v, {g:Int32} AS g, '%(s)s' AS literal", params={"s": nasty, "g": 2})))
        finally:
            queries.close()
        assert out["rows"] == [[nasty, 2, "%(s)s"]]


def test_a_placeholder_without_a_value_and_a_brace_in_a_literal_are_named(world) -> None:
    queries = AnalystQueries(world["sink"].query, QueryLimits())
    try:
        with pytest.raises(QueryError) as missing:
            asyncio.run(queries.execute(SqlRequest(sql="SELECT {n:UInt32} AS n", params={})))
        assert missing.value.status == 400 and "{n:UInt32}" in missing.value.detail
        with pytest.raises(QueryError) as literal:  # a placeholder inside a string is text, not a placeholder
            asyncio.run(queries.execute(SqlRequest(sql="SELECT '{n:UInt32}' AS t", params={"n": 1})))
        assert literal.value.status == 400 and "params['n']" in literal.value.detail
    finally:
        queries.close()


def test_the_secret_file_and_listener_exist(world) -> None:
    assert Path(world["tmp"] / "secret.tsv").read_text().count(world["marker"]) == 1
