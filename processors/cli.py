"""`kvpipe processor`, `kvpipe route`, `kvpipe sql`."""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

from schemas.settings import SettingsError, load_settings


def main_processor(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe processor", description=(
        "Run the Faust processor: consume KV events, keep the per-group cache index, serve "
        "/route /nodes /stats /metrics /sql, write analytics. Every setting is also a KVPIPE_* "
        "environment variable; these flags override them."))
    parser.add_argument("--web-port", type=int, help="HTTP port of the route API (KVPIPE_WEB_PORT)")
    parser.add_argument("--state-dir", help="local state directory (KVPIPE_STATE_DIR)")
    parser.add_argument("--topic", help="events topic to consume (KVPIPE_EVENTS_TOPIC)")
    parser.add_argument("--processor-id", help="Faust app id = consumer group (KVPIPE_PROCESSOR_ID)")
    parser.add_argument("--no-analytics", action="store_true", help="do not write analytics to ClickHouse")
    parser.add_argument("--loglevel", default="warning", help="Faust log level (default: warning)")
    args = parser.parse_args(argv)
    flags = {"KVPIPE_WEB_PORT": args.web_port, "KVPIPE_STATE_DIR": args.state_dir,
             "KVPIPE_EVENTS_TOPIC": args.topic, "KVPIPE_PROCESSOR_ID": args.processor_id}
    os.environ.update({k: str(v) for k, v in flags.items() if v is not None})
    try:
        settings = load_settings()
    except SettingsError as exc:
        print(f"kvpipe processor: {exc}", file=sys.stderr)
        return 2
    from faust.worker import Worker

    from processors import agents, views  # noqa: F401  (registers the agent, timers and pages)
    from processors.app import app
    from processors.state import Options

    Options.analytics = not args.no_analytics
    os.makedirs(settings.state_path("processor"), exist_ok=True)
    # Worker installs SIGTERM/SIGINT handlers that stop the app cleanly (final snapshot included).
    Worker(app, loglevel=args.loglevel, quiet=True).execute_from_commandline()
    return 0


def _base_url(url: str | None) -> str:
    if url:
        return url.rstrip("/")
    s = load_settings()
    return f"http://{s.web_host}:{s.web_port}"


def _post(url: str, body: Any, timeout: float = 30.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def _hash_arg(text: str) -> int | str:
    text = text.strip()
    return text if text.lower().startswith("0x") else int(text)


def main_route(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe route", description="Ask a running processor which nodes hold a prefix.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--hashes", help="comma-separated block hashes (ints, or 0x... hex for bytes hashes)")
    what.add_argument("--file", help='JSON request body: {"block_hashes": {"<group>": [...]}} or {"block_hashes": [...]}')
    parser.add_argument("--group", type=int, help="group index of --hashes (default: the same hashes for every group)")
    parser.add_argument("--url", help="processor base URL (default: http://<web_host>:<web_port> from the settings)")
    args = parser.parse_args(argv)
    if args.file:
        with open(args.file) as f:
            body = json.load(f)
    else:
        try:
            hashes = [_hash_arg(h) for h in args.hashes.split(",") if h.strip()]
        except ValueError as exc:
            parser.error(f"--hashes: {exc}")
        body = {"block_hashes": hashes if args.group is None else {str(args.group): hashes}}
    try:
        status, answer = _post(_base_url(args.url) + "/route", body)
    except OSError as exc:
        print(f"kvpipe route: no processor answers at {_base_url(args.url)} ({exc}); start one with `kvpipe processor`",
              file=sys.stderr)
        return 1
    print(json.dumps(answer, indent=2))
    return 0 if status == 200 else 1


def _print_table(result: dict) -> None:
    columns, rows = result.get("columns", []), result.get("rows", [])
    cells = [[str(c) for c in columns]] + [["" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    for n, row in enumerate(cells):
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))
    print(f"({len(rows)} rows)")


def main_sql(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvpipe sql", description=(
        "Run a read-only query on the analytics store: embedded chDB through the running processor "
        "(the only process that may open it), a ClickHouse server (http/https DSN) directly."))
    parser.add_argument("sql", help="SELECT / WITH / SHOW / DESCRIBE / EXPLAIN statement")
    parser.add_argument("--json", action="store_true", help="print {columns, rows} as JSON")
    parser.add_argument("--url", help="processor base URL (embedded mode)")
    args = parser.parse_args(argv)
    from processors.api import ApiError, check_sql

    try:
        check_sql({"sql": args.sql})
    except ApiError as exc:
        print(f"kvpipe sql: {exc.error}: {exc.detail}", file=sys.stderr)
        return 2
    settings = load_settings()
    dsn = settings.clickhouse()
    if dsn.startswith(("http://", "https://")):
        from processors.analytics.sink import AnalyticsSink

        sink = AnalyticsSink(dsn)
        try:
            result = sink.query(args.sql)
        finally:
            sink.close()
    else:
        try:
            status, result = _post(_base_url(args.url) + "/sql", {"sql": args.sql})
        except OSError as exc:
            print(f"kvpipe sql: the embedded store is read through the running processor, and none answers at "
                  f"{_base_url(args.url)} ({exc}); start one with `kvpipe processor`", file=sys.stderr)
            return 1
        if status != 200:
            print(f"kvpipe sql: {result.get('error')}: {result.get('detail')}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return 0
