"""`kvpipe nodes` and `kvpipe stats`: what a running app says about itself, without curl.

`nodes` reads the routing app's `GET /nodes` page by page (`next_after` of one page is `after` of the
next) until the last page or `--limit` nodes; `stats` reads `GET /stats` of the routing app, or of
the analytics app with `--analytics`. Both send the bearer token of the settings, as every kvpipe
client does (`kvpipe.processors.core.webauth.client_headers`), and decode the answers into the apps'
own answer types (`processors/routing/answers.py`, `processors/analytics/answers.py`): an app of
another version that answers differently is named as such, not printed half-read.

Here, in kvpipe's own package, because `stats` reads both apps and the two app packages import
neither each other (pyproject.toml's layer contract).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar, get_args
from urllib.parse import urlencode

import click
import msgspec

from kvpipe.processors.analytics.answers import AnalyticsStats
from kvpipe.processors.routing.answers import NodeHealth, NodeRow, NodesPage, RoutingStats
from kvpipe.schemas.cliopts import Command, configure_logging, log_level_option, mapping_table, output_option
from kvpipe.schemas.settings import Settings, SettingsError, load_settings

T = TypeVar("T")

# the most rows one /nodes page may hold (kvpipe.processors.routing.api.NODES_PAGE_MAX); the app's own default
# page (1000) would do, but a fleet is read in fewer requests at the largest
PAGE = 10_000
STATES: tuple[str, ...] = get_args(NodeHealth)


class AppUnreachable(Exception):
    """Nothing usable answered: the message says where and what to do."""


def _get(prog: str, url: str, settings: Settings, answer_type: type[T], start_with: str) -> T:
    """`GET url` decoded into `answer_type`; AppUnreachable with the reason otherwise."""
    from kvpipe.processors.core.remote import HttpStatusError, ok_json
    from kvpipe.processors.core.webauth import client_headers

    try:
        raw = ok_json(url, timeout=30.0, headers=client_headers(settings))
    except HttpStatusError as exc:  # it answered, and refused (401 without the right token, 400 a bad filter)
        raise AppUnreachable(f"{prog}: {exc}") from None
    except OSError as exc:
        raise AppUnreachable(f"{prog}: nothing answers at {url} ({exc}); start one with `{start_with}`") from None
    try:
        return msgspec.convert(raw, answer_type)
    except msgspec.ValidationError as exc:
        raise AppUnreachable(f"{prog}: {url} answered in a shape this kvpipe does not know ({exc}); is it "
                             f"another kvpipe version?") from None


def _settings_and_base(url: str | None, port: Callable[[Settings], int]) -> tuple[Settings, str]:
    try:
        settings = load_settings()
    except SettingsError as exc:
        raise click.UsageError(str(exc)) from None
    return settings, (url.rstrip("/") if url else f"http://{settings.web_host}:{port(settings)}")


def read_nodes(get: Callable[[str], NodesPage], limit: int | None, state: str | None) -> NodesPage:
    """Every page of /nodes (`get(query)` fetches one) merged into one: all the rows, or the first `limit`
    (then `next_after` says where the next read would start); `partial` if any page was."""
    rows: list[NodeRow] = []
    missing: set[int] = set()
    partial, after = False, None
    while True:
        want = PAGE if limit is None else min(PAGE, limit - len(rows))
        query = {"limit": str(want), **({"after": after} if after is not None else {}),
                 **({"state": state} if state is not None else {})}
        page = get(urlencode(query))
        rows += page.nodes
        partial |= page.partial
        missing |= set(page.missing_partitions)
        after = page.next_after
        if after is None or (limit is not None and len(rows) >= limit):
            return NodesPage(nodes=rows, next_after=after, partial=partial, missing_partitions=sorted(missing))


def nodes_table(page: NodesPage) -> str:
    """`-o table`: a node per row, its groups as `kind:block_size[:window]`, its index blocks summed."""
    from kvpipe.processors.core.texttable import render

    rows = []
    for n in page.nodes:
        load = n.load
        groups = ",".join(f"{g.kind}:{g.block_size}" + (f":{g.sliding_window}" if g.sliding_window else "")
                          for g in n.groups)
        rows.append([n.node_id, n.state, n.model, n.dp_rank, n.partition, n.epoch, n.seq, f"{n.silent_s:.1f}",
                     None if load is None else load.running, None if load is None else load.waiting,
                     None if load is None or load.kv_usage is None else f"{load.kv_usage:.2f}",
                     sum(n.blocks.values()), groups])
    table = render(["node", "state", "model", "rank", "part", "epoch", "seq", "silent_s", "run", "wait", "kv",
                    "blocks", "groups"], rows, right=range(3, 12))
    tail = f"({len(page.nodes)} nodes" + (f"; more after {page.next_after!r}: --limit" if page.next_after else "") + ")"
    if page.partial:
        tail += f"\nPARTIAL: no answer for events partitions {page.missing_partitions}"
    return f"{table}\n{tail}"


@click.command("nodes", cls=Command, help=(
    "List the nodes a running routing app (`kvpipe processor`) knows: its GET /nodes, every page, in "
    "node id order. The table shows each node's state, model, rank, events partition, position, "
    "silence, load, index blocks and KV cache groups; -o json the rows as /nodes has them."))
@click.option("--state", type=click.Choice(STATES), help="only nodes in this state")
@click.option("--limit", type=click.IntRange(1), help="at most this many nodes (the first in id order)")
@output_option(help="a table, or one JSON object {nodes, next_after, partial, missing_partitions}")
@click.option("--url", help="routing app base URL (default: http://<web_host>:<web_port> from the settings)")
@log_level_option()
def nodes(state: str | None, limit: int | None, output: str, url: str | None, log_level: str) -> int:
    configure_logging(log_level)
    settings, base = _settings_and_base(url, lambda s: s.web_port)
    try:
        page = read_nodes(lambda query: _get("kvpipe nodes", f"{base}/nodes?{query}", settings, NodesPage,
                                             "kvpipe processor"), limit, state)
    except AppUnreachable as exc:
        print(exc, file=sys.stderr)
        return 1
    if output == "json":
        print(msgspec.json.format(msgspec.json.encode(page), indent=2).decode())
    else:
        print(nodes_table(page))
    return 0


@click.command("stats", cls=Command, help=(
    "Print a running app's GET /stats: the routing app's (`kvpipe processor`), or with --analytics the "
    "analytics app's (`kvpipe analytics`). The table has one row per value, nested keys joined by dots "
    "(counters.messages, freshness.0.lag_s); -o json is /stats as the app answered it."))
@click.option("--analytics", "of_analytics", is_flag=True,
              help="the analytics app's /stats (at KVPIPE_ANALYTICS_WEB_PORT) instead of the routing app's")
@output_option(help="a table of key and value, or the JSON object")
@click.option("--url", help="app base URL (default: http://<web_host>:<web_port>, or <analytics_web_port> with "
                            "--analytics, from the settings)")
@log_level_option()
def stats(of_analytics: bool, output: str, url: str | None, log_level: str) -> int:
    configure_logging(log_level)
    answer: Any
    if of_analytics:
        settings, base = _settings_and_base(url, lambda s: s.analytics_web_port)
        answer_type, start_with = AnalyticsStats, "kvpipe analytics"
    else:
        settings, base = _settings_and_base(url, lambda s: s.web_port)
        answer_type, start_with = RoutingStats, "kvpipe processor"
    try:
        answer = _get("kvpipe stats", f"{base}/stats", settings, answer_type, start_with)
    except AppUnreachable as exc:
        print(exc, file=sys.stderr)
        return 1
    if output == "json":
        print(msgspec.json.format(msgspec.json.encode(answer), indent=2).decode())
    else:
        print(mapping_table(msgspec.to_builtins(answer)))
    return 0
