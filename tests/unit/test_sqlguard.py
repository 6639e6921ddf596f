"""The analyst SQL gate: every attack refused with a reason, every legitimate analyst query accepted.

Pure logic (sqlglot only, no engine); tests/integration/test_sql_attacks.py runs the same attacks on real chDB.
"""
from __future__ import annotations

import logging

import pytest

from kvpipe.processors.analytics.query import (
    ANALYST_BLOCK_ROWS,
    QueryError,
    QueryLimits,
    check_params,
    check_statement,
    dsn_database,
    engine_error,
    parse_sql_request,
    redact_dsn,
)
from kvpipe.processors.analytics.saved import list_queries
from kvpipe.processors.analytics.sqlfunctions import ALLOWED_FUNCTIONS, MAX_AGGREGATE_PARAMETERS, UNBOUNDED_FUNCTIONS
from kvpipe.processors.analytics.sqlguard import SqlRefused, SqlSyntaxError, allowed_tables, check_sql, function_allowed
from kvpipe.schemas.settings import load_settings

logging.getLogger("sqlglot").setLevel(logging.ERROR)

URL = "http://127.0.0.1:9/x"

# (statement, a word the refusal must name)
ATTACKS = [
    # the three statements of the issue
    ("DESCRIBE file('/etc/passwd', 'TSVWithNames')", "DESCRIBE"),
    (f"DESCRIBE url('{URL}', 'JSONEachRow')", "DESCRIBE"),
    ("SELECT groupArray(number) FROM numbers(100000000)", "numbers"),
    # table functions in every position
    ("SELECT * FROM file('/etc/passwd')", "file"),
    ("SELECT * FROM kv_events WHERE x IN (SELECT * FROM file('/etc/passwd'))", "file"),
    (f"WITH t AS (SELECT * FROM url('{URL}', 'CSV')) SELECT * FROM t", "url"),
    (f"SELECT * FROM kv_events JOIN s3('{URL}', 'CSV') AS s ON kv_events.node_id = s.node_id", "s3"),
    ("DESCRIBE TABLE file('/etc/passwd', 'CSV')", "DESCRIBE"),
    ("EXPLAIN SELECT * FROM remote('127.0.0.1', 'system', 'one')", "remote"),
    ("EXPLAIN PLAN SELECT * FROM remoteSecure('127.0.0.1', 'system.one')", "remoteSecure"),
    ("SELECT * FROM s3Cluster('c', 'http://x/y', 'CSV')", "s3Cluster"),
    ("SELECT * FROM cluster('default', system.one)", "cluster"),
    ("SELECT * FROM mysql('h:3306', 'db', 't', 'u', 'p')", "mysql"),
    ("SELECT * FROM postgresql('h:5432', 'db', 't', 'u', 'p')", "postgresql"),
    ("SELECT * FROM hdfs('hdfs://h/f', 'CSV')", "hdfs"),
    ("SELECT * FROM input('a UInt8')", "input"),
    ("SELECT * FROM zeros(10)", "zeros"),
    ("SELECT * FROM generateRandom('a UInt8')", "generateRandom"),
    ("SELECT * FROM executable('x.sh', 'CSV', 'a UInt8')", "executable"),
    ("SELECT * FROM jdbc('ds', 't')", "jdbc"),
    ("SELECT * FROM odbc('dsn', 't')", "odbc"),
    ("SELECT * FROM sqlite('/tmp/x.db', 't')", "sqlite"),
    ("SELECT * FROM mongodb('h', 'db', 'c', 'u', 'p', 'a UInt8')", "mongodb"),
    ("SELECT * FROM redis('h:6379', 'k', 'k String')", "redis"),
    ("SELECT * FROM iceberg('http://x/t')", "iceberg"),
    ("SELECT * FROM deltaLake('http://x/t')", "deltaLake"),
    ("SELECT * FROM azureBlobStorage('c', 'x', 'y')", "azureBlobStorage"),
    ("SELECT * FROM gcs('http://x/y', 'CSV')", "gcs"),
    ("SELECT * FROM view(SELECT * FROM kv_events)", "view"),
    ("SELECT * FROM merge('default', '.*')", "merge"),
    ("SELECT * FROM values('a UInt8', 1, 2)", "VALUES"),
    ("SELECT * FROM format(CSV, 'a\n1')", "format"),
    ("SELECT * FROM dictionary('d')", "dictionary"),
    ("SELECT * FROM numbers(10)", "numbers"),
    ("SELECT (SELECT count() FROM url('http://x/y', 'CSV')) AS c", "url"),
    ("SELECT h FROM kv_events ARRAY JOIN file('/etc/passwd') AS h", "file"),
    ("SELECT * FROM kv_events AS a, file('/etc/passwd') AS b", "file"),
    ("SELECT * FROM kv_events WHERE node_id IN (SELECT c1 FROM url('http://x/y', 'CSV'))", "url"),
    # scalar functions that read the host, the network or other tables
    ("SELECT file('/etc/passwd')", "file"),
    ("SELECT dictGet('d', 'a', toUInt64(1))", "dictGet"),
    ("SELECT joinGet('kv_events', 'node_id', 1)", "joinGet"),
    ("SELECT getMacro('shard')", "getMacro"),
    ("SELECT filesystemAvailable()", "filesystemAvailable"),
    ("SELECT hostName()", "hostName"),
    ("SELECT currentUser()", "currentUser"),
    ("SELECT getSetting('readonly')", "getSetting"),
    ("SELECT sleepEachRow(1) FROM kv_events", "sleepEachRow"),
    ("SELECT aiGenerate('hello')", "aiGenerate"),
    ("SELECT hasColumnInTable('system', 'users', 'name')", "hasColumnInTable"),
    # other databases, names that are not kvpipe's
    ("SELECT * FROM system.tables", "system"),
    ("SELECT * FROM system.users", "system"),
    ("SELECT * FROM other.kv_events", "other"),
    ("SELECT * FROM default.passwords", "passwords"),
    ("SELECT * FROM kvpipe_migration", "kvpipe_migration"),
    ("SELECT node_id IN system.tables FROM kv_events", "system"),
    ("SELECT * FROM (WITH s AS (SELECT 1) SELECT 1) AS a, s", "'s'"),
    ("SELECT * FROM {t:Identifier}", "parameter"),
    ("SELECT 1 WHERE 1 IN {t:Identifier}", "parameter"),
    # clauses and statement shapes
    ("SELECT 1 SETTINGS readonly=0", "SETTINGS"),
    ("SELECT count() FROM kv_events SETTINGS max_memory_usage = 0", "SETTINGS"),
    ("SELECT * FROM (SELECT 1 SETTINGS max_result_rows = 0)", "SETTINGS"),
    ("SELECT 1 FORMAT JSON", "FORMAT"),
    ("SELECT 1; DROP TABLE kv_events", "2 statements"),
    ("SELECT 1; SELECT 2", "2 statements"),
    ("EXPLAIN SELECT 1; DROP TABLE kv_events", "2 statements"),
    ("DESCRIBE (SELECT * FROM kv_events)", "DESCRIBE"),
    ("SHOW CREATE TABLE system.users", "SHOW"),
    ("SHOW DATABASES", "SHOW"),
    ("SHOW GRANTS", "SHOW"),
    # writes and administration
    ("INSERT INTO kv_events SELECT * FROM kv_events", "INSERT"),
    ("ALTER TABLE kv_events DELETE WHERE 1", "ALTER"),
    ("OPTIMIZE TABLE kv_events FINAL", "OPTIMIZE"),
    ("SYSTEM RELOAD DICTIONARIES", "SYSTEM"),
    ("KILL QUERY WHERE 1", "KILL"),
    ("SET readonly = 0", "SET"),
    ("ATTACH TABLE x FROM '/etc'", "ATTACH"),
    ("DROP TABLE kv_events", "DROP"),
    ("TRUNCATE TABLE kv_events", "TRUNCATE"),
    ("CREATE TABLE x (a UInt8) ENGINE = Memory", "CREATE"),
    ("GRANT ALL ON *.* TO default", "GRANT"),
    ("USE system", "USE"),
    # comments, case and quoting games
    ("SELECT 1 /* harmless */ FROM file('/etc/passwd')", "file"),
    ("SELECT 1 -- a comment\n FROM file('/etc/passwd')", "file"),
    ("/* leading */ INSERT INTO kv_events SELECT * FROM kv_events", "INSERT"),
    ("sElEcT * fRoM FiLe('/etc/passwd')", "FiLe"),
    ("SELECT FILE('/etc/passwd')", "FILE"),
    ("SELECT * FROM `file`('/etc/passwd')", "file"),
    ("SELECT `file`('/etc/passwd')", "quoted"),
    ('SELECT "file"(\'/etc/passwd\')', "quoted"),
    ("SELECT * FROM `system`.`tables`", "system"),
    ("SELECT 1 INTO OUTFILE '/tmp/x'", "OUTFILE"),
    ("SELECT (1", "parse"),
    ("", "empty"),
    ("   -- only a comment", "empty"),
]


@pytest.mark.parametrize("statement,named", ATTACKS, ids=[a[0][:60] for a in ATTACKS])
def test_attack_is_refused_with_a_reason(statement: str, named: str) -> None:
    with pytest.raises(ValueError) as caught:
        check_sql(statement)
    assert named.lower() in str(caught.value).lower(), str(caught.value)


def test_attack_list_is_long_enough_and_distinct() -> None:
    statements = [a[0] for a in ATTACKS]
    assert len(set(statements)) == len(statements) >= 40


LEGIT = [
    "SELECT count() FROM kv_events_final",
    "SELECT * FROM kv_events LIMIT 10",
    "select node_id, count() from kv_events group by node_id order by node_id",
    "SELECT * FROM default.kv_block_lifetimes_final LIMIT 5",
    "WITH c AS (SELECT node_id FROM kv_events_final) SELECT count() FROM c",
    "WITH a AS (SELECT 1 AS x), b AS (SELECT x FROM a) SELECT * FROM b",
    "SELECT e.node_id, l.lifetime_s FROM kv_events AS e INNER JOIN kv_block_lifetimes AS l ON e.node_id = l.node_id",
    "SELECT node_id, row_number() OVER (PARTITION BY node_id ORDER BY ts) AS n FROM kv_events",
    "SELECT node_id, lagInFrame(ts) OVER (PARTITION BY node_id ORDER BY ts) FROM kv_events",
    "SELECT uniqExactIf(node_id, kind = 'stored'), sumIf(num_blocks, 1), quantilesExact(0.5, 0.9)(num_blocks) "
    "FROM kv_events",
    "SELECT quantileExactInclusiveIf(0.5)(lifetime_s, reason = 'evicted') FROM kv_block_lifetimes",
    "SELECT quantilesExactInclusive(0.5, 0.9, 0.99)(lifetime_s) AS q, q[1] FROM kv_block_lifetimes",
    "SELECT count() FROM kv_events WHERE group_idx = {g:Int32} AND ts > now() - toIntervalSecond({s:UInt32})",
    "SELECT h FROM kv_events ARRAY JOIN block_hashes AS h LIMIT 3",
    "SELECT node_id FROM kv_events WHERE node_id IN (SELECT node_id FROM kv_group_kinds)",
    "SELECT node_id FROM kv_events WHERE node_id IN kv_group_kinds",
    "SELECT 1 UNION ALL SELECT 2",
    "SELECT if(kind = 'stored', 1, -1) * num_blocks, CASE WHEN medium = 'GPU' THEN 1 ELSE 0 END FROM kv_events",
    "SELECT arrayMap(x -> x % 7, block_hashes) FROM kv_events LIMIT 1",
    "SELECT toStartOfInterval(ts, INTERVAL 1 MINUTE) AS m, count() FROM kv_events GROUP BY m",
    "SELECT formatReadableSize(sum(num_blocks) * 16) FROM kv_events",
    "SELECT * FROM kv_events FINAL LIMIT 1",
    "SHOW TABLES",
    "SHOW CREATE TABLE kv_events",
    "show create view kv_group_kinds",
    "DESCRIBE TABLE kv_events",
    "DESC kv_block_lifetimes_final",
    "EXPLAIN SELECT * FROM kv_events",
    "EXPLAIN PLAN SELECT count() FROM kv_events_final",
    "EXPLAIN SYNTAX SELECT count() FROM kv_events_final",
    "-- a note\nSELECT 1 /* inline */ + 1",
]


@pytest.mark.parametrize("statement", LEGIT, ids=[s[:60] for s in LEGIT])
def test_analyst_query_is_accepted(statement: str) -> None:
    out = check_sql(statement)
    assert out and "--" not in out and "/*" not in out  # comments never reach the engine
    assert check_sql(out) == out  # what runs passes the gate again unchanged


@pytest.mark.parametrize("saved", list_queries(), ids=lambda q: q.name)
def test_every_saved_query_passes_the_gate(saved) -> None:
    out = check_sql(saved.sql)
    for param in saved.params:
        assert "{" + param.name + ":" in out.replace(" ", "")  # parameters stay server-side placeholders


def test_parametric_aggregates_keep_their_meaning() -> None:
    out = check_sql("SELECT quantilesExactInclusive(0.5, 0.9)(lifetime_s) AS q FROM kv_block_lifetimes")
    assert "quantilesExactInclusive(0.5, 0.9)(lifetime_s) AS q" in out


def test_allowed_tables_are_those_the_migrations_create() -> None:
    assert allowed_tables() == {"kv_events", "kv_events_final", "kv_block_lifetimes", "kv_block_lifetimes_final",
                                "kv_group_kinds", "kvpipe_migrations", "kv_restores", "kv_restores_final",
                                "kv_node_minute", "kv_evictions_minute", "kv_restore_delays", "kv_node_load",
                                "kv_node_load_final", "kv_node_load_minute"}


def test_function_allowlist_keeps_host_and_network_functions_out() -> None:
    for name in ("file", "dictGet", "joinGet", "getMacro", "hostName", "FQDN", "currentUser", "getSetting",
                 "filesystemCapacity", "sleep", "aiGenerate", "addressToSymbol", "__getScalar", "url", "s3"):
        assert not function_allowed(name), name
    for name in ("sum", "count", "quantileExactInclusive", "sumIf", "uniqExactState", "countIf", "toStartOfInterval",
                 "dateDiff", "DATE_DIFF", "if", "multiIf", "arrayJoin", "domain", "cityHash64"):
        assert function_allowed(name), name
    assert not function_allowed("fileIf")  # combinators apply to aggregates only
    assert len(ALLOWED_FUNCTIONS) > 1000


def test_database_other_than_kvpipes_is_refused_even_for_kvpipe_table_names() -> None:
    assert check_sql("SELECT * FROM kvpipe.kv_events", database="kvpipe")
    with pytest.raises(SqlRefused, match="default"):
        check_sql("SELECT * FROM default.kv_events", database="kvpipe")


def test_parse_error_is_a_syntax_error_with_a_position() -> None:
    with pytest.raises(SqlSyntaxError, match="line 1"):
        check_sql("SELECT (1 +")


# --- query.py: request, statement, limits, errors -----------------------------------------------------------------

def test_sql_request_decodes_and_validates_params() -> None:
    req = parse_sql_request(b'{"sql": "SELECT {n:UInt32}", "params": {"n": 3, "s": "x", "f": 1.5}}')
    assert req.sql == "SELECT {n:UInt32}" and req.params == {"n": 3, "s": "x", "f": 1.5}
    for body in (b"not json", b'{"sql": 3}', b'{"params": {}}', b'{"sql": "SELECT 1", "params": {"b": true}}',
                 b'{"sql": "SELECT 1", "params": {"l": [1]}}', b'{"sql": "SELECT 1", "params": {"bad name": 1}}',
                 b'{"sql": "SELECT 1", "extra": 1}', b'{"sql": "  "}'):
        with pytest.raises(QueryError) as caught:
            parse_sql_request(body)
        assert caught.value.status == 400 and caught.value.body()["error"]
    with pytest.raises(QueryError, match="64 bits"):
        check_params({"n": 1 << 70})


def test_check_statement_maps_refusal_to_403_and_parse_error_to_400() -> None:
    with pytest.raises(QueryError) as refused:
        check_statement("SELECT file('/etc/passwd')")
    assert refused.value.status == 403 and "file" in refused.value.detail
    with pytest.raises(QueryError) as bad:
        check_statement("SELECT (")
    assert bad.value.status == 400
    assert check_statement("SELECT 1").text == "SELECT 1"


def test_limits_from_settings_become_throwing_engine_settings() -> None:
    settings = load_settings({"sql_max_execution_s": 5.0, "sql_max_memory_bytes": 1000, "sql_max_result_rows": 7,
                              "sql_max_result_bytes": 900, "sql_max_concurrent": 3}, env={})
    limits = QueryLimits.from_settings(settings)
    engine = limits.engine_settings()
    assert engine["readonly"] == 1 and engine["max_execution_time"] == 5.0
    assert engine["timeout_overflow_mode"] == "throw" and engine["result_overflow_mode"] == "throw"
    assert (engine["max_memory_usage"], engine["max_result_rows"], engine["max_result_bytes"]) == (1000, 7, 900)
    assert limits.max_concurrent == 3 and limits.max_waiting > 0 and limits.database == "default"
    server = QueryLimits.from_settings(load_settings({"clickhouse_dsn": "https://ro:pw@ch:8443/kvpipe"}, env={}))
    assert server.database == "kvpipe" and "readonly" not in server.engine_settings()


def test_engine_errors_name_the_limit_and_hide_the_password() -> None:
    limits = QueryLimits(max_result_rows=10)
    err = engine_error(RuntimeError("Code: 396. DB::Exception: Limit for result exceeded, max rows: 10.00, "
                                    "current rows: 100.00. (TOO_MANY_ROWS_OR_BYTES) (version 26.9.2.1)"), limits)
    assert err.status == 422 and "max_result_rows" in err.error and "10 rows" in err.detail
    assert "version" not in err.detail
    mem = engine_error(RuntimeError("Code: 241. DB::Exception: Query memory limit exceeded: (while reading column "
                                    "h): (while reading from part /srv/kvpipe/store/e08/all_1_1_0/ in table x): "
                                    "While executing MergeTreeSelect"), limits)
    assert "max_memory_usage" in mem.error and "/srv/kvpipe" not in mem.detail
    slow = engine_error(RuntimeError("Code: 159. DB::Exception: Timeout exceeded: elapsed 2 s"), limits)
    assert "max_execution_time" in slow.error
    syntax = engine_error(RuntimeError("Code: 47. DB::Exception: Unknown expression identifier `nope`"), limits)
    assert syntax.status == 400
    dsn = "https://analyst:s3cr3t-pw@ch.example:8443/kvpipe?access_token=tok123"
    leak = engine_error(OSError(f"cannot connect to {dsn}: refused (password s3cr3t-pw)"), limits, dsn)
    assert "s3cr3t-pw" not in str(leak.body()) and "tok123" not in str(leak.body())
    other = engine_error(OSError("HTTPSConnectionPool(host=x): https://u:pw2@x:8443/ failed"), limits)
    assert "pw2" not in other.detail


def test_redact_dsn() -> None:
    assert redact_dsn("https://analyst:pw@ch:8443/kvpipe") == "https://analyst:***@ch:8443/kvpipe"
    assert redact_dsn("http://ch:8123/db?user=a&password=pw&token=t") == \
        "http://ch:8123/db?user=a&password=***&token=***"
    assert redact_dsn("chdb:///var/lib/kvpipe/analytics") == "chdb:///var/lib/kvpipe/analytics"
    assert "pw" not in redact_dsn("clickhouse://u:pw@h/db")
    assert dsn_database("http://ch:8123/kvpipe") == "kvpipe" and dsn_database("chdb:///x/y") == "default"


# --- parameters bind only to placeholders of the checked tree ----------------------------------------------------

def test_checked_sql_returns_the_placeholders_of_the_tree_not_of_literals() -> None:
    from kvpipe.processors.analytics.sqlguard import checked_sql

    checked = checked_sql("SELECT {s:String} AS v, '{t:String}' AS lit, {a:Array(Int32)} AS a FROM kv_events "
                          "WHERE group_idx = {g:Int32}")
    assert checked.placeholders == {"s": "String", "a": "Array(Int32)", "g": "Int32"}
    assert checked_sql("EXPLAIN SELECT {n:UInt32}").placeholders == {"n": "UInt32"}
    assert checked_sql("SHOW TABLES").placeholders == {}
    for untyped in ("SELECT ?", "SELECT :x"):
        with pytest.raises(SqlRefused, match="placeholder"):
            checked_sql(untyped)


class _RecordingClient:
    """Stands in for the transport only: records what would be sent (the engine side is tested on real chDB)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def query(self, statement, parameters=None, settings=None):
        self.calls.append((statement, parameters))
        return "sent"


@pytest.mark.parametrize("sql,params", [
    ("SELECT '%(s)s' AS v", {"s": "; DROP TABLE kv_events; SELECT "}),
    ('SELECT 1 AS "%(s)s"', {"s": '"; DROP TABLE kv_events; SELECT 1 AS "'}),
    ("SELECT `%(s)s` FROM kv_events", {"s": "x"}),
    ("SELECT {n:UInt32} AS n, '%(s)s' AS v", {"n": 1, "s": "x"}),
    ("SELECT '{s:String}' AS v", {"s": "x"}),
])
def test_a_param_that_names_no_placeholder_is_refused_before_the_transport(sql, params) -> None:
    from kvpipe.processors.analytics.query import QueryLimits, run_checked

    runs = []
    with pytest.raises(QueryError) as refused:
        run_checked(lambda *a: runs.append(a), sql, params, QueryLimits())
    assert refused.value.status == 400 and "params['s']" in refused.value.detail
    assert runs == []


def test_engine_query_sends_only_what_the_engine_binds() -> None:
    from kvpipe.processors.analytics.query import engine_query

    client = _RecordingClient()
    with pytest.raises(QueryError, match="bad sql params"):
        engine_query(client, "SELECT '%(s)s' AS v", {"s": "x"}, {})
    assert client.calls == []
    assert engine_query(client, "SELECT {s: String} AS v", {"s": "x'%(y)s"}, {}) == "sent"
    assert engine_query(client, "SELECT '%(s)s' AS v", None, {}) == "sent"  # no params: no formatting at all
    assert client.calls == [("SELECT {s: String} AS v", {"s": "x'%(y)s"}), ("SELECT '%(s)s' AS v", None)]


def test_a_placeholder_without_a_value_is_named() -> None:
    from kvpipe.processors.analytics.query import bind_values
    from kvpipe.processors.analytics.sqlguard import checked_sql

    with pytest.raises(QueryError, match=r"\{n:UInt32\} has no value"):
        bind_values(checked_sql("SELECT {n:UInt32}"), {})
    assert bind_values(checked_sql("SELECT {n:UInt32}"), {"n": 3}) == {"n": 3}


def test_a_statement_longer_than_the_engine_takes_is_413_before_parsing() -> None:
    from kvpipe.processors.analytics.query import MAX_STATEMENT_BYTES

    sql = "SELECT count() FROM kv_events WHERE node_id IN (" + ",".join(f"'n{i}'" for i in range(60_000)) + ")"
    assert len(sql) > MAX_STATEMENT_BYTES
    with pytest.raises(QueryError) as refused:
        check_statement(sql)
    assert refused.value.status == 413 and "max_query_size" in refused.value.detail


def test_sql_nested_past_the_parser_is_a_400_not_a_500() -> None:
    sql = "SELECT " + "(" * 3000 + "1" + ")" * 3000
    with pytest.raises(QueryError) as refused:
        check_statement(sql)
    assert refused.value.status in (400, 403)


# --- functions no time limit can stop ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(UNBOUNDED_FUNCTIONS))
def test_a_function_whose_one_call_has_no_bound_is_refused_with_its_reason(name: str) -> None:
    for spelled in (name, name.upper()):
        with pytest.raises(SqlRefused) as refused:
            check_sql(f"SELECT {spelled}(block_hashes, block_hashes) FROM kv_events")
        assert f"{name}()" in str(refused.value) and UNBOUNDED_FUNCTIONS[name] in str(refused.value)
    assert name not in ALLOWED_FUNCTIONS and not function_allowed(name)


def test_parametric_aggregates_take_at_most_the_parameter_cap() -> None:
    levels = lambda n: ", ".join(f"{(i + 1) / (n + 1):.4f}" for i in range(n))  # noqa: E731
    check_sql(f"SELECT quantilesExact({levels(MAX_AGGREGATE_PARAMETERS)})(ts) FROM kv_events")
    for aggregate in ("quantilesExact", "quantilesExactIf", "quantiles"):
        args = "(ts, group_idx = 1)" if aggregate.endswith("If") else "(ts)"
        with pytest.raises(SqlRefused, match=f"{MAX_AGGREGATE_PARAMETERS + 1} parameters; at most"):
            check_sql(f"SELECT {aggregate}({levels(MAX_AGGREGATE_PARAMETERS + 1)}){args} FROM kv_events")


def test_analyst_queries_run_in_small_blocks_at_the_lowest_cpu_priority() -> None:
    engine = QueryLimits().engine_settings()
    assert engine["max_block_size"] == ANALYST_BLOCK_ROWS < 65_409 and engine["os_thread_priority"] == 19
