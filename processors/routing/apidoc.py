"""The routing app's OpenAPI 3.1 document, served at its `/openapi.json`: the router endpoints
(`kvpipe.processors.router.openapi`) and the app's own, `/nodes`, `/stats`, `/metrics` and `/health`, with
schemas generated from the answer Structs (`kvpipe.processors.routing.answers`). Every route `views` registers
has its path here (tests/unit/test_http_answers.py).
"""
from __future__ import annotations

import msgspec

from kvpipe.processors.core.apidoc import (
    JsonObject,
    answer,
    content,
    document as assemble,
    errors,
    metrics_path,
    openapi_path,
    query_parameter,
    ref,
)
from kvpipe.processors.router import openapi as router_doc
from kvpipe.processors.routing.answers import (
    LocalNodesPage,
    NodeGroup,
    NodeLoad,
    NodeRow,
    NodesPage,
    RoutingHealth,
    RoutingStats,
)
from kvpipe.processors.routing.api import NODE_STATES, NODES_PAGE_DEFAULT, NODES_PAGE_MAX

TITLE = "kvpipe router"
VERSION = "2.1"  # 2: the router endpoints; 2.1: every endpoint of the app, answers unchanged

NODES_EXAMPLE = NodesPage(
    nodes=[NodeRow(node_id="node-a", epoch=3, seq=1041, model="google/gemma-3-4b-it", dp_rank=0, partition=1,
                   state="healthy", last_seen=1767225600.25, silent_s=0.412, expired=False, suspect=False,
                   suspect_reason=None, partial=False, partial_since=None, clock_skew_s=0.0,
                   load=NodeLoad(running=2, waiting=1, kv_usage=0.31),
                   groups=[NodeGroup(group_idx=0, kind="full_attention", block_size=16),
                           NodeGroup(group_idx=1, kind="chunked_local_attention", block_size=16,
                                     attention_chunk_size=8192),
                           NodeGroup(group_idx=2, kind="full_attention", block_size=16, eagle=True)],
                   blocks={"0/GPU": 5120, "1/GPU": 512, "2/GPU": 5120},
                   counters={"envelopes": 1042, "events": 2210, "stored": 1830, "removed": 380, "gaps": 0})],
    next_after=None, partial=False, missing_partitions=[])

HEALTH_EXAMPLE = RoutingHealth(status="ok", app="index", processor_id="kvpipe-processor", owned_partitions=[0, 1],
                               uptime_s=3600.0)

TYPES: tuple[type, ...] = (*router_doc.TYPES, NodesPage, LocalNodesPage, RoutingStats, RoutingHealth)


def _nodes_path() -> JsonObject:
    parameters = [
        query_parameter("limit", {"type": "integer", "minimum": 1, "maximum": NODES_PAGE_MAX,
                                  "default": NODES_PAGE_DEFAULT}, "rows per page"),
        query_parameter("after", {"type": "string"}, "the previous page's `next_after`: rows with a greater node id"),
        query_parameter("state", {"enum": list(NODE_STATES)}, "only nodes in this state"),
        query_parameter("local", {"type": "string", "enum": ["1"]},
                        "worker to worker: this worker's rows only, with the partitions it answers for "
                        "(LocalNodesPage)"),
    ]
    page = content({"anyOf": [ref("NodesPage"), ref("LocalNodesPage")]}, {"page": NODES_EXAMPLE})
    return {"get": {"operationId": "nodes", "summary": "The nodes the index knows, one page in node id order",
                    "parameters": parameters,
                    "responses": {"200": {"description": "a page of node rows", **page}, **errors(400, 401)}}}


def paths() -> JsonObject:
    return {
        **router_doc.paths(),
        "/nodes": _nodes_path(),
        "/stats": {"get": {"operationId": "stats", "summary": "This worker's counters, index, freshness, snapshots "
                                                             "and cluster view",
                           "responses": {"200": answer("what /metrics exports too", "RoutingStats"),
                                         **errors(401)}}},
        "/metrics": metrics_path("routing"),
        "/health": {"get": {"operationId": "health", "summary": "Liveness, open without the token", "security": [],
                            "responses": {"200": answer("the worker serves", "RoutingHealth",
                                                        {"health": HEALTH_EXAMPLE})}}},
        "/openapi.json": openapi_path(),
    }


def document() -> JsonObject:
    """The whole document (a plain dict, JSON-ready)."""
    return assemble(title=TITLE, version=VERSION, paths=paths(), types=TYPES,
                    description="Which serving node holds a prompt's KV cache blocks, vLLM's hybrid hit per node, a "
                                "choice that weighs that against load, and the index behind it.")


def encoded() -> bytes:
    """The document as JSON bytes, for the server to serve as is."""
    return msgspec.json.encode(document())
