"""The analytics app's OpenAPI 3.1 document, served at its `/openapi.json`: `/sql`, `/stats`, `/metrics` and
`/health`, with schemas generated from the request and answer Structs (`kvpipe.processors.analytics.answers`,
`kvpipe.processors.analytics.query.SqlRequest`). Every route `views` registers has its path here
(tests/unit/test_http_answers.py).
"""
from __future__ import annotations

import msgspec

from kvpipe.processors.analytics.answers import AnalyticsHealth, AnalyticsStats, SqlAnswer, StoreHealth
from kvpipe.processors.analytics.query import SqlRequest
from kvpipe.processors.core.answers import ErrorBody
from kvpipe.processors.core.apidoc import JsonObject, answer, body, document as assemble, errors, metrics_path, openapi_path

TITLE = "kvpipe analytics"
VERSION = "1"

SQL_EXAMPLES = {
    "count": SqlRequest(sql="SELECT count() AS n FROM kv_events_final"),
    "params": SqlRequest(sql="SELECT node_id, count() AS stored FROM kv_events_final WHERE kind = {kind:String} "
                             "GROUP BY node_id ORDER BY stored DESC LIMIT {k:UInt32}",
                         params={"kind": "stored", "k": 5}),
}
SQL_ANSWER_EXAMPLE = SqlAnswer(columns=["node_id", "stored"], types=["String", "UInt64"],
                               rows=[["node-a", 18234], ["node-b", 9120]])
SQL_REFUSED_EXAMPLE = ErrorBody("statement not allowed", "INSERT statements are not allowed: analyst SQL is read-only "
                                                         "(allowed: SELECT, WITH ... SELECT, SHOW, DESCRIBE, EXPLAIN)")
HEALTH_EXAMPLE = AnalyticsHealth(status="ok", app="analytics", analytics_id="kvpipe-analytics",
                                 store=StoreHealth(state="up", up=True, refusing_for_s=None, pending_rows=0,
                                                   max_queue_rows=200_000, consumption_paused=False))

TYPES: tuple[type, ...] = (SqlRequest, SqlAnswer, AnalyticsStats, AnalyticsHealth)


def paths() -> JsonObject:
    return {
        "/sql": {"post": {
            "operationId": "sql",
            "summary": "Run one read-only statement over the analytics tables (bounded in time, memory and size)",
            "requestBody": {"required": True, **body("SqlRequest", SQL_EXAMPLES)},
            "responses": {"200": answer("the result", "SqlAnswer", {"answer": SQL_ANSWER_EXAMPLE}),
                          **errors(400, 401, 403, 408, 413, 422, 429, 502, 503,
                                   examples={403: {"refused": SQL_REFUSED_EXAMPLE}})}}},
        "/stats": {"get": {"operationId": "stats", "summary": "This worker's counters, store, sink, freshness and "
                                                             "snapshots",
                           "responses": {"200": answer("what /metrics exports too", "AnalyticsStats"),
                                         **errors(401)}}},
        "/metrics": metrics_path("analytics"),
        "/health": {"get": {"operationId": "health", "summary": "Liveness and the store's state, open without the "
                                                               "token", "security": [],
                            "responses": {"200": answer("the worker runs (whatever the store does)", "AnalyticsHealth",
                                                        {"health": HEALTH_EXAMPLE})}}},
        "/openapi.json": openapi_path(),
    }


def document() -> JsonObject:
    """The whole document (a plain dict, JSON-ready)."""
    return assemble(title=TITLE, version=VERSION, paths=paths(), types=TYPES,
                    description="Analyst SQL over the KV cache events and block lifetimes kvpipe stores, and the "
                                "state of the app that writes them.")


def encoded() -> bytes:
    """The document as JSON bytes, for the server to serve as is."""
    return msgspec.json.encode(document())
