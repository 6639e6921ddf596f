"""The analytics app's HTTP views: `/stats`, `/metrics`, `/health`, analyst SQL (`POST /sql`) and
`/openapi.json` (`kvpipe.processors.analytics.apidoc`); the answers are the Structs of
`kvpipe.processors.analytics.answers`.

This app owns the embedded chDB store (one process may open a path), so analysts' SQL — `kvpipe
sql`, `kvpipe plan`, `kvpipe report`, `kvpipe demo` — is served here, off the event loop (`AnalystQueries`), never by
the routing app.
"""
from __future__ import annotations

from typing import Any

import msgspec
from faust import web
from faust.types import TP

from kvpipe.processors.analytics import apidoc, metrics
from kvpipe.processors.analytics.answers import AnalyticsHealth, AnalyticsStats, SqlAnswer, StoreState, encode_sql
from kvpipe.processors.analytics.app import app, settings
from kvpipe.processors.analytics.query import MAX_BODY_BYTES, QueryError, parse_sql_request
from kvpipe.processors.core import fastpath
from kvpipe.processors.core.answers import ErrorBody
from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.core.httpbody import checked_body
from kvpipe.processors.analytics.state import collect_stats, runtime


def _highwater(partition: int) -> int | None:
    try:
        return app.consumer.highwater(TP(settings.events_topic, partition))
    except Exception:
        return None


def _stats() -> dict[str, Any]:
    return {**collect_stats(runtime, _highwater), "deliveries": fastpath.deliveries(app.consumer)}


def stats_answer() -> AnalyticsStats:
    """`/stats`: `collect_stats` (shared with /metrics, a plain mapping) read into its Struct, which checks every
    value's type. A key the Struct lacks would be dropped: tests/unit/test_http_answers.py holds the two equal on a
    worker with every record filled."""
    return msgspec.convert(_stats(), AnalyticsStats)


def _typed(view: web.View, value: msgspec.Struct, status: int = 200) -> web.Response:
    return view.bytes(msgspec.json.encode(value), content_type="application/json", status=status)


@app.page("/stats")
class Stats(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return _typed(self, stats_answer())


@app.page("/metrics")
class Metrics(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return self.bytes(metrics.render(_stats), content_type="text/plain; version=0.0.4")


@app.page("/health")
class Health(web.View):
    """200 while the worker runs, whatever the store does (a refusing store is lag, not death: an
    orchestrator restarting us would not help); the store's state is in the body."""

    async def get(self, request: web.Request) -> web.Response:
        # open without the token: the store's state, never the engine's error text (that is in /stats)
        store = msgspec.convert(_stats()["store"], StoreState).health()
        return _typed(self, AnalyticsHealth(status="ok", app="analytics", analytics_id=settings.analytics_id,
                                            store=store))


@app.page("/sql")
class Sql(web.View):
    async def post(self, request: web.Request) -> web.Response:
        try:
            # read as the routing app reads its bodies: size, nesting depth and time bounded, 4xx JSON otherwise
            raw = await checked_body(request, min(settings.http_max_body_bytes, MAX_BODY_BYTES),
                                     settings.http_max_json_depth, settings.http_read_timeout_s)
            answer = SqlAnswer(**await runtime.queries.execute(parse_sql_request(raw)))
        except (QueryError, ApiError) as exc:
            return _typed(self, ErrorBody(exc.error, exc.detail), status=exc.status)
        return self.bytes(encode_sql(answer), content_type="application/json")


_OPENAPI = apidoc.encoded()


@app.page("/openapi.json")
class OpenApi(web.View):
    """This app's OpenAPI 3.1 document, every endpoint, generated from the request/answer Structs."""

    async def get(self, request: web.Request) -> web.Response:
        return self.bytes(_OPENAPI, content_type="application/json")

