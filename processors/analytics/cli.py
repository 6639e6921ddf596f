"""`kvpipe analytics` (the analytics app) and `kvpipe sql` (analyst SQL and the report)."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

from kvpipe.processors.analytics import formats
from kvpipe.processors.core.appcli import app_logging, run_worker, worker_settings
from kvpipe.schemas.cliopts import (Command, apply_bootstrap, bootstrap_server_option, configure_logging,
                                    datadir_option, json_option, log_level_option, output_option, web_bind_option)
from kvpipe.schemas.settings import SettingsError, load_settings

SCALING = (
    "Two apps, one topic: `kvpipe processor` (routing index, consumer group KVPIPE_PROCESSOR_ID) and "
    "`kvpipe analytics` (this app, consumer group KVPIPE_ANALYTICS_ID) each read every events partition "
    "and keep their own progress. Each scales on its own: run more workers with the same id, up to one "
    "per events partition. With embedded chDB (the default DSN) one process owns the store, so run one "
    "analytics worker; with a ClickHouse server (KVPIPE_CLICKHOUSE_DSN=http(s)://...) run several.")


@click.command("analytics", cls=Command, help=(
    "Run the analytics app (Faust): consume KV events with the same index code as the routing app, "
    "derive event and block-lifetime rows, write them to ClickHouse exactly once, and serve analyst "
    "SQL (POST /sql) plus /stats /metrics /health.\n\nNo row is dropped: while the store refuses, "
    "inserts are retried with back-off and consumption pauses (the events topic's retention must "
    "cover the outage); progress advances only over rows the store acknowledged.\n\n" + SCALING))
@click.option("--web-port", type=int, help="HTTP port of this app, /sql and /stats (KVPIPE_ANALYTICS_WEB_PORT; "
              "the routing app's is KVPIPE_WEB_PORT)")
@datadir_option("analytics-app")
@click.option("--topic", help="events topic to consume (KVPIPE_EVENTS_TOPIC)")
@click.option("--analytics-id", help="Faust app id = consumer group (KVPIPE_ANALYTICS_ID)")
@click.option("--clickhouse-dsn", help="chdb:///path or http(s)://user:pass@host:8123 (KVPIPE_CLICKHOUSE_DSN; "
              "default: embedded chDB under DIR/analytics of --datadir)")
@web_bind_option()
@click.option("--insecure", is_flag=True,
              help="allow a non-loopback --web-bind without an API token (KVPIPE_API_TOKEN)")
@bootstrap_server_option()
@log_level_option()
def analytics(web_port: int | None, state_dir: str | None, topic: str | None, analytics_id: str | None,
              clickhouse_dsn: str | None, web_host: str | None, insecure: bool, bootstrap_server: str | None,
              log_level: str) -> int:
    apply_bootstrap(bootstrap_server)
    # log_level is resolved (flag, KVPIPE_LOG_LEVEL, default): Faust's Worker configures logging at it (run_worker)
    flags = {"KVPIPE_ANALYTICS_WEB_PORT": web_port, "KVPIPE_WEB_HOST": web_host, "KVPIPE_STATE_DIR": state_dir,
             "KVPIPE_EVENTS_TOPIC": topic, "KVPIPE_ANALYTICS_ID": analytics_id,
             "KVPIPE_CLICKHOUSE_DSN": clickhouse_dsn}
    settings = worker_settings("kvpipe analytics", flags, insecure)
    if settings is None:
        return 2
    os.makedirs(settings.state_path("analytics-app"), exist_ok=True)
    app_logging(log_level)
    from kvpipe.processors.analytics import agents, views  # noqa: F401  (registers the agent, timers and pages)
    from kvpipe.processors.analytics.app import app
    from kvpipe.processors.analytics.state import runtime

    try:  # migrations before the first message; the writer thread starts here too
        runtime.sink.start()
    except Exception as exc:
        print(f"kvpipe analytics: the analytics store at {_safe_dsn(settings.clickhouse())} cannot be opened "
              f"({type(exc).__name__}: {_safe_text(exc, settings.clickhouse())}); check KVPIPE_CLICKHOUSE_DSN and that the store is up", file=sys.stderr)
        return 1
    run_worker(app, log_level)
    return 0


def _needs_the_analytics_extra(*more: str) -> None:
    """Import what the `analytics` extra brings before anything else, so a base install stops at once
    with kvpipe's one-line hint (kvpipe/cli.py: EXTRA_FOR_MODULE) rather than somewhere on an error path."""
    import importlib

    for name in ("clickhouse_connect", "sqlglot", *more):
        importlib.import_module(name)


def _safe_dsn(dsn: str) -> str:
    """The DSN without its password or token parameters (error messages never carry secrets)."""
    from kvpipe.processors.analytics.query import redact_dsn

    return redact_dsn(dsn)


def _safe_text(exc: BaseException, dsn: str) -> str:
    """An exception's message without the DSN's password (a transport may quote its URL whole)."""
    from kvpipe.processors.analytics.query import redact_text

    return redact_text(str(exc), dsn)


def _analytics_url(url: str | None) -> str:
    if url:
        return url.rstrip("/")
    s = load_settings()
    return f"http://{s.web_host}:{s.analytics_web_port}"


@click.command("sql", cls=Command, context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
               help=(
    "Run a read-only query on the analytics store, or a saved capacity-planning query by name "
    "(infra/clickhouse/queries; --list shows them): embedded chDB is read through the running "
    "analytics app (`kvpipe analytics`, the only process that may open it), a ClickHouse server "
    "(http/https DSN) directly. Like clickhouse-client: the statement as -q/--query (or an argument, "
    "or on standard input: `-` or none given), parameters as --param_NAME=VALUE bound to the "
    "statement's {NAME:Type} placeholders, ClickHouse's format names.\n\n"
    "STATEMENT: SELECT / WITH / SHOW / DESCRIBE / EXPLAIN."))
@click.argument("statement", required=False)
@click.option("-q", "--query", "query_text", metavar="SQL", help="the statement (as clickhouse-client's --query)")
@click.option("--saved", metavar="NAME", help="run the saved query NAME instead of a statement")
@click.option("--param", "param_items", multiple=True, metavar="NAME=VALUE",
              help="a parameter (repeatable), the same as --param_NAME=VALUE; --list shows each saved query's")
@click.option("--list", "list_saved", is_flag=True, help="list the saved queries with their parameters")
@click.option("--format", "fmt", type=click.Choice(formats.NAMES), default=None,
              help="output format: ClickHouse's TabSeparated (TSV), TabSeparatedWithNames, CSV, CSVWithNames, "
                   "JSON ({meta, data, rows, statistics}), JSONEachRow, PrettyCompact, Markdown; or table "
                   "(the default), markdown, csv (with a header) or json")
@click.option("-o", "--output", type=click.Choice(("table", "json")), default=None,
              help="table or json, as every kvpipe command that prints data takes it")
@json_option(help="same as --output json")
@click.option("--url", help="analytics app base URL (embedded mode; default: "
                            "http://<web_host>:<analytics_web_port>)")
@log_level_option()
@click.pass_context
def sql(ctx: click.Context, statement: str | None, query_text: str | None, saved: str | None,
        param_items: tuple[str, ...], list_saved: bool, fmt: str | None, output: str | None, as_json: bool,
        url: str | None, log_level: str) -> int:
    configure_logging(log_level)
    _needs_the_analytics_extra()
    from kvpipe.processors.analytics.saved import list_queries, load_query

    if list_saved:
        for q in list_queries():
            signature = ", ".join(f"{p.name} {p.type} = {p.default!r}" for p in q.params) or "no parameters"
            print(f"{q.name:<24} {q.title}\n{'':<24} ({signature})")
        return 0
    # click leaves clickhouse-client's --param_NAME options among the positional arguments
    loose = [a for a in ([statement] if statement is not None else []) + list(ctx.args)]
    statements, param_args = _split_loose(loose)
    if len(statements) > 1:
        raise click.UsageError(f"one statement at a time; got {len(statements)} arguments")
    statement = statements[0] if statements else None
    params = _params(param_items, param_args)
    if statement is not None and query_text is not None:
        raise click.UsageError("give the statement once: as an argument or as -q/--query")
    statement = query_text if query_text is not None else statement
    if statement in (None, "-") and saved is None and (statement == "-" or not sys.stdin.isatty()):
        statement = sys.stdin.read()
    if (statement is None) == (saved is None):
        raise click.UsageError("give a statement (argument, -q/--query or standard input) or --saved NAME (or --list)")
    fmt = _output_format(fmt, output, as_json)
    if saved is not None:
        try:
            query = load_query(saved)
            text, bound = query.sql, query.bind(params)
        except (KeyError, ValueError) as exc:
            print(f"kvpipe sql: {exc.args[0] if isinstance(exc, KeyError) else exc}", file=sys.stderr)
            return 2
    else:
        assert statement is not None  # exactly one of statement / --saved, checked above
        text, bound = statement, dict(params)
    from kvpipe.processors.analytics.sqlguard import check_read_only

    try:  # checked here too, so a write is refused with a clear reason even when no store answers
        check_read_only(text)
    except ValueError as exc:
        print(f"kvpipe sql: statement not allowed: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    result = _run_remote("kvpipe sql", url, lambda target: target(text, bound))
    if result is None:
        return 1
    sys.stdout.write(formats.write(result, fmt, time.monotonic() - started))
    return 0


def _split_loose(args: list[str]) -> tuple[list[str], list[str]]:
    """`(statements, --param_NAME arguments with their values)` of the arguments click did not parse."""
    statements: list[str] = []
    params: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--param_"):
            params.append(arg)
            if "=" not in arg and i + 1 < len(args):
                i += 1
                params.append(args[i])
        elif arg.startswith("-") and arg != "-":
            raise click.UsageError(f"no such option: {arg}")
        else:
            statements.append(arg)
        i += 1
    return statements, params


def _params(items: tuple[str, ...], extra: list[str]) -> dict[str, str]:
    """`--param NAME=VALUE` items and clickhouse-client's `--param_NAME=VALUE` / `--param_NAME VALUE`
    (left in `extra` by click, which cannot declare option names made of a prefix)."""
    params: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r}: expected NAME=VALUE", param_hint="--param")
        params[name] = value
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--param_"):
            raise click.UsageError(f"unexpected argument {arg!r}")
        name, sep, value = arg[len("--param_"):].partition("=")
        if not sep:
            if i + 1 >= len(extra):
                raise click.BadParameter(f"{arg}: expected a value", param_hint=arg)
            i, value = i + 1, extra[i + 1]
        if not name:
            raise click.BadParameter(f"{arg!r}: expected --param_NAME=VALUE", param_hint="--param_NAME")
        params[name] = value
        i += 1
    return params


def _output_format(fmt: str | None, output: str | None, as_json: bool) -> str:
    """One format from --format, -o/--output and --json, which must agree."""
    wanted = {formats.canonical(f) for f in (fmt, output, "json" if as_json else None) if f is not None}
    if len(wanted) > 1:
        raise click.UsageError(f"--format, -o/--output and --json disagree ({', '.join(sorted(wanted))})")
    return wanted.pop() if wanted else "table"


def print_result(result: dict, fmt: str) -> None:
    """A query result `{columns, rows, ...}` in format `fmt` (formats.NAMES)."""
    sys.stdout.write(formats.write(result, fmt))


def _run_remote(prog: str, url: str | None, work):
    """`work(target)` against the store (see `_sql_target`); None after printing why it failed."""
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    dsn = settings.clickhouse()
    server = dsn.startswith(("http://", "https://"))
    where = _safe_dsn(dsn) if server else _analytics_url(url)
    close = lambda: None  # noqa: E731  (nothing to close until a client exists)
    try:  # a server client connects when made: its failure is reported (and redacted) like a query's
        target, close = _sql_target(dsn, url)
        return work(target)
    except OSError as exc:
        hint = "" if server else ("; the embedded store is read through the running analytics app: "
                                  "start one with `kvpipe analytics`")
        print(f"{prog}: nothing answers at {where} ({_safe_text(exc, dsn)}){hint}", file=sys.stderr)
    except Exception as exc:  # the store's (or the app's) reason is what the analyst needs
        print(f"{prog}: {_safe_text(exc, dsn)}", file=sys.stderr)
    finally:
        close()
    return None


@click.command("plan", cls=Command, help=(
    "The capacity curve: per node, group kind and medium (GPU and the CPU tier), how many re-stores "
    "(evicted blocks stored again) an LRU cache of X more or fewer blocks would have turned into hits, "
    "and the recompute that saves, with the method and its assumptions. Reads the saved query "
    "capacity_curve through the analytics app (or a ClickHouse server DSN)."))
@click.option("--node", default="", help="only this node id")
@click.option("--group-kind", default="", help="only this group kind (full_attention, sliding_window, mamba, ...)")
@click.option("--extra", default="-0.5,-0.25,0,0.25,0.5,1,2,4", show_default=True,
              help="cache size changes as fractions of the observed capacity (comma-separated)")
@output_option(help="the curves as tables, or with the method as JSON")
@click.option("--url", help="analytics app base URL (embedded mode)")
@log_level_option()
def plan(node: str, group_kind: str, extra: str, output: str, url: str | None, log_level: str) -> int:
    configure_logging(log_level)
    _needs_the_analytics_extra()
    from kvpipe.processors.analytics.plan import curves, render

    params = {"node": node, "group_kind": group_kind, "extra": extra}
    result = _run_remote("kvpipe plan", url, lambda target: curves(target, params))
    if result is None:
        return 1
    print(json.dumps(result, default=str) if output == "json" else render(result))
    return 0


@click.command("report", cls=Command, help=(
    "Write the capacity-planning report: one self-contained HTML page (plots inline, no network needed "
    "to view it) with every saved query's table, read through the analytics app (or a server DSN)."))
@click.option("--out", default="report.html", help="output file (default: report.html)")
@click.option("--url", help="analytics app base URL (embedded mode)")
@log_level_option()
def report(out: str, url: str | None, log_level: str) -> int:
    configure_logging(log_level)
    _needs_the_analytics_extra("matplotlib", "jinja2")
    from kvpipe.processors.analytics.report import build_report

    path = _run_remote("kvpipe report", url, lambda target: build_report(target, out))
    if path is None:
        return 1
    print(path)
    return 0


def _sql_target(dsn: str, url: str | None) -> tuple[Any, Any]:
    """`(QueryFn, close)`: on a server DSN the same guard and limits as the analytics app, applied
    here (the analyst's ClickHouse user should be read-only as well: docs/analyst-sql.md); else the
    analytics app's /sql."""
    if dsn.startswith(("http://", "https://")):
        import clickhouse_connect

        from kvpipe.processors.analytics.chclient import client_kwargs
        from kvpipe.processors.analytics.query import QueryLimits, client_runner, run_checked

        client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))
        run, limits = client_runner(client), QueryLimits.from_settings(load_settings())

        def query(sql: str, params: dict | None = None) -> dict:
            return run_checked(run, sql, params, limits, dsn)

        return query, client.close
    from kvpipe.processors.core.remote import ProcessorSql

    return ProcessorSql(_analytics_url(url)), lambda: None
