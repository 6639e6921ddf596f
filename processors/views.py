"""HTTP views: JSON in, JSON out; bad input is a 4xx `{"error", "detail"}`, never a 500."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from faust import web
from faust.types import TP

from processors.api import ApiError, check_sql, node_rows, parse_route_request, render_metrics, sql_params
from processors.app import app, settings
from processors.state import collect_stats, runtime


async def _json_body(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "body is not JSON", str(exc)) from None


def _error(view: web.View, exc: ApiError) -> web.Response:
    return view.json(exc.body(), status=exc.status)


def _highwater(partition: int) -> int | None:
    try:
        return app.consumer.highwater(TP(settings.events_topic, partition))
    except Exception:
        return None


@app.page("/route")
class Route(web.View):
    async def post(self, request: web.Request) -> web.Response:
        try:
            hashes, all_groups = parse_route_request(await _json_body(request), runtime.index.known_groups())
        except ApiError as exc:
            return _error(self, exc)
        answer = runtime.index.route(hashes, all_groups=all_groups)
        return self.bytes(json.dumps(answer, default=_jsonable).encode(), content_type="application/json")


@app.page("/nodes")
class Nodes(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return self.bytes(json.dumps({"nodes": node_rows(runtime.index, time.time())}, default=_jsonable).encode(),
                          content_type="application/json")


@app.page("/stats")
class Stats(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return self.json(collect_stats(runtime, _highwater))


@app.page("/metrics")
class Metrics(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return self.text(render_metrics(collect_stats(runtime, _highwater)),
                         content_type="text/plain; version=0.0.4")


@app.page("/sql")
class Sql(web.View):
    async def post(self, request: web.Request) -> web.Response:
        try:
            body = await _json_body(request)
            sql, params = check_sql(body), sql_params(body)
        except ApiError as exc:
            return _error(self, exc)
        if runtime.sink is None:
            return _error(self, ApiError(503, "analytics disabled", runtime.analytics_status))
        try:
            result = await asyncio.to_thread(runtime.sink.query, sql, params or None)
        except Exception as exc:  # the engine's message tells the analyst what is wrong with the query
            return _error(self, ApiError(400, "query failed", str(exc)))
        return self.bytes(json.dumps(result, default=_jsonable).encode(), content_type="application/json")


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return "0x" + value.hex()
    return str(value)
