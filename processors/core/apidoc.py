"""The pieces of an OpenAPI 3.1 document that both Faust apps' documents share.

Every schema comes from a Struct the views really encode or decode (`msgspec.json.schema_components`), so a
document cannot drift from the wire; examples are Structs too, turned into JSON the same way. The routing app's
document is `kvpipe.processors.routing.apidoc` (its router endpoints: `kvpipe.processors.router.openapi`), the
analytics app's `kvpipe.processors.analytics.apidoc`; each is served at that app's `/openapi.json`, open without
the token like `/health` (`kvpipe.processors.core.webauth.OPEN_PATHS`: the document describes, it reveals no state).
A test enumerates the routes each app registers and fails on one its document lacks
(tests/unit/test_http_answers.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from kvpipe.processors.core.answers import ErrorBody

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{name}"
JSON = "application/json"
JsonObject = dict[str, Any]

# What each refusal means, for the responses a path lists; the body is always ErrorBody.
ERRORS = {
    400: "bad request: the reason says which field is wrong and what was expected",
    401: "missing or wrong bearer token",
    403: "refused: the statement is not a read-only query of the analytics tables",
    404: "not found",
    408: "the body did not arrive within the read timeout",
    413: "request too large",
    422: "the engine refused the query or a per-query limit was hit",
    429: "too many queries running and waiting; retry shortly",
    502: "the analytics store is unreachable",
    503: "the service is shutting down",
}


def ref(name: str) -> JsonObject:
    return {"$ref": REF.format(name=name)}


def content(schema: JsonObject, examples: Mapping[str, Any] | None = None, media: str = JSON) -> JsonObject:
    """`{"content": {media: {"schema", "examples"}}}`; each example a Struct (or plain value) turned into JSON."""
    entry: JsonObject = {"schema": schema}
    if examples:
        entry["examples"] = {name: {"value": msgspec.to_builtins(value)} for name, value in examples.items()}
    return {"content": {media: entry}}


def body(name: str, examples: Mapping[str, Any] | None = None) -> JsonObject:
    """A JSON request or answer body whose schema is the component `name` (a Struct's name)."""
    return content(ref(name), examples)


def answer(description: str, name: str, examples: Mapping[str, Any] | None = None) -> JsonObject:
    return {"description": description, **body(name, examples)}


def errors(*statuses: int, examples: Mapping[int, Mapping[str, ErrorBody]] | None = None,
           descriptions: Mapping[int, str] | None = None) -> JsonObject:
    """The refusals an operation can answer, each an ErrorBody (`descriptions` override `ERRORS`)."""
    out: JsonObject = {}
    for status in statuses:
        text = (descriptions or {}).get(status) or ERRORS[status]
        out[str(status)] = answer(text, "ErrorBody", (examples or {}).get(status))
    return out


def query_parameter(name: str, schema: JsonObject, description: str) -> JsonObject:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def openapi_path() -> JsonObject:
    """`GET /openapi.json`: the document itself, open without the token."""
    return {"get": {"operationId": "openapi", "summary": "This document", "security": [],
                    "responses": {"200": {"description": "OpenAPI 3.1", **content({"type": "object"})}}}}


def metrics_path(app_name: str) -> JsonObject:
    """`GET /metrics`: Prometheus text, behind the token like every stateful path."""
    return {"get": {"operationId": "metrics", "summary": f"Prometheus metrics of this {app_name} worker",
                    "responses": {"200": {"description": "Prometheus text exposition format 0.0.4",
                                          **content({"type": "string"}, media="text/plain")},
                                  **errors(401)}}}


def document(*, title: str, version: str, description: str, paths: Mapping[str, JsonObject],
             types: Iterable[type]) -> JsonObject:
    """The whole document (a plain dict, JSON-ready): `paths` as given, the components generated from `types`
    and every Struct they reach, ErrorBody always among them; bearer auth unless an operation says otherwise."""
    _, schemas = msgspec.json.schema_components([ErrorBody, *types], ref_template=REF)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version, "description": description},
        "security": [{"bearer": []}],
        "paths": dict(paths),
        "components": {"schemas": schemas, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
