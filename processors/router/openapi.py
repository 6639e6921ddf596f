"""`/openapi.json` for the router endpoints, generated from the Structs in `kvpipe.processors.router.model`
(`msgspec.json.schema_components`), so the document cannot drift from what the server decodes and
the client reads. The examples are built from the Structs too, and a test decodes each one back.
"""
from __future__ import annotations

from typing import Any

import msgspec

from kvpipe.processors.router.model import (
    ErrorBody,
    FinishedReport,
    GroupHit,
    HashConfigUsed,
    Load,
    NodeRoute,
    NoSignal,
    RouteAnswer,
    RouteRequest,
    Scoring,
    SentReport,
)
from kvpipe.schemas.envelope import HashConfig

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"

REQUEST_EXAMPLES: dict[str, RouteRequest] = {
    "token_ids": RouteRequest(token_ids=[151644, 872, 198, 3838, 374, 279, 6722, 315, 9625, 30]),
    "token_ids_scored": RouteRequest(token_ids=list(range(1, 41)), model="google/gemma-3-4b-it", top_k=3,
                                     include_zero=True, request_id="req-42",
                                     scoring=Scoring(cpu_weight=0.3, temperature=0.1, seed=7)),
    "block_hashes": RouteRequest(block_hashes={0: [10429158316690216413, 5745192707610611011],
                                               1: [5745192707610611011]}, num_tokens=40),
}

ANSWER_EXAMPLE = RouteAnswer(
    chosen="node-a", model="google/gemma-3-4b-it", num_tokens=40,
    hash_configs=[HashConfigUsed(label="sha256/16/default/int", config=HashConfig(), nodes=2, hash_blocks=2,
                                 hashing_s=0.00004)],
    nodes=[NodeRoute(node_id="node-a", epoch=3, model="google/gemma-3-4b-it", gpu_tokens=32, loadable_tokens=0,
                     groups=[GroupHit(group_idx=0, kind="full_attention", block_size=16, gpu_blocks=2, blocks=2,
                                      medium="GPU"),
                             GroupHit(group_idx=1, kind="sliding_window", block_size=32, gpu_blocks=1, blocks=1,
                                      medium="GPU")],
                     score=0.770513, load=Load(running=2, waiting=1, kv_usage=0.31))],
    no_signal=[NoSignal("node-c", "hash configuration sha256/16/random: sha256 with a random per-process none-hash "
                                  "seed: its hashes cannot be recomputed elsewhere (set PYTHONHASHSEED on the node)")],
    hashing_s=0.00004, search_s=0.00012)

ERROR_EXAMPLE = ErrorBody("block hashes do not fit the groups",
                          "group 1: 2 hashes, expected 1 (num_tokens 40 // block size 32: one hash per full block "
                          "of that group)")


def _json(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


def _body(name: str, examples: dict[str, Any] | None = None) -> dict:
    media: dict[str, Any] = {"schema": {"$ref": _REF.format(name=name)}}
    if examples:
        media["examples"] = {k: {"value": _json(v)} for k, v in examples.items()}
    return {"content": {"application/json": media}}


def _errors() -> dict:
    err = {"description": "bad request: the reason says which field or group and what was expected",
           **_body("ErrorBody", {"wrong_block_size": ERROR_EXAMPLE})}
    return {"400": err, "401": {"description": "missing or wrong bearer token", **_body("ErrorBody")},
            "413": {"description": "request too large", **_body("ErrorBody")}}


def document(title: str = "kvpipe router", version: str = "2") -> dict:
    """The OpenAPI 3.1 document (a plain dict, JSON-ready)."""
    _, components = msgspec.json.schema_components(
        [RouteRequest, RouteAnswer, SentReport, FinishedReport, ErrorBody], ref_template=_REF)
    done = {"204": {"description": "recorded"}}
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version,
                 "description": "Which serving node holds a prompt's KV cache blocks, vLLM's hybrid hit per node, "
                                "and a choice that weighs that against load."},
        "security": [{"bearer": []}],
        "paths": {
            "/route": {"post": {
                "operationId": "route",
                "summary": "Score the nodes for a prompt and choose one",
                "requestBody": {"required": True, **_body("RouteRequest", REQUEST_EXAMPLES)},
                "responses": {"200": {"description": "per-node hits, scores and the chosen node",
                                      **_body("RouteAnswer", {"answer": ANSWER_EXAMPLE})}, **_errors()}}},
            "/route/sent": {"post": {
                "operationId": "route_sent",
                "summary": "Report a request sent to a node (in-flight accounting)",
                "requestBody": {"required": True, **_body("SentReport", {
                    "sent": SentReport("req-43", "node-a", [151644, 872, 198])})},
                "responses": {**done, **_errors(),
                              "404": {"description": "no worker's index holds that node (not published yet, "
                                                     "expired, or no usable group specs / hash configuration)",
                                      **_body("ErrorBody")}}}},
            "/route/finished": {"post": {
                "operationId": "route_finished",
                "summary": "Report a request finished (it leaves the node's load)",
                "requestBody": {"required": True, **_body("FinishedReport", {"finished": FinishedReport("req-42")})},
                "responses": {**done, **_errors()}}},
            "/openapi.json": {"get": {
                "operationId": "openapi", "summary": "This document", "security": [],
                "responses": {"200": {"description": "OpenAPI 3.1",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def encoded() -> bytes:
    """The document as JSON bytes, for the server to serve as is."""
    return msgspec.json.encode(document())
