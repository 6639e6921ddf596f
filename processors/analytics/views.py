"""The analytics app's HTTP views: `/stats`, `/metrics`, `/health` and analyst SQL (`POST /sql`).

This app owns the embedded chDB store (one process may open a path), so analysts' SQL — `kvpipe
sql`, `kvpipe plan`, `kvpipe report`, `kvpipe demo` — is served here, off the event loop (`AnalystQueries`), never by
the routing app.
"""
from __future__ import annotations

import json
from typing import Any

from faust import web
from faust.types import TP

from kvpipe.processors.analytics import metrics
from kvpipe.processors.analytics.app import app, settings
from kvpipe.processors.analytics.query import MAX_BODY_BYTES, QueryError, parse_sql_request
from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.core.httpbody import checked_body
from kvpipe.processors.analytics.state import collect_stats, runtime


def _highwater(partition: int) -> int | None:
    try:
        return app.consumer.highwater(TP(settings.events_topic, partition))
    except Exception:
        return None


def _stats() -> dict:
    return collect_stats(runtime, _highwater)


@app.page("/stats")
class Stats(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return self.json(_stats())


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
        store = {k: v for k, v in _stats()["store"].items() if k != "reason"}
        return self.json({"status": "ok", "app": "analytics", "analytics_id": settings.analytics_id, "store": store})


@app.page("/sql")
class Sql(web.View):
    async def post(self, request: web.Request) -> web.Response:
        try:
            # read as the routing app reads its bodies: size, nesting depth and time bounded, 4xx JSON otherwise
            raw = await checked_body(request, min(settings.http_max_body_bytes, MAX_BODY_BYTES),
                                     settings.http_max_json_depth, settings.http_read_timeout_s)
            answer = await runtime.queries.execute(parse_sql_request(raw))
        except QueryError as exc:
            return self.json(exc.body(), status=exc.status)
        except ApiError as exc:
            return self.json(exc.body(), status=exc.status)
        return self.bytes(json.dumps(answer, default=_jsonable).encode(), content_type="application/json")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return "0x" + value.hex()
    return str(value)
