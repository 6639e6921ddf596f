"""The router endpoints' part of the routing app's `/openapi.json` (the whole document:
`kvpipe.processors.routing.apidoc`): their paths, with schemas generated from the Structs in
`kvpipe.processors.router.model` (`kvpipe.processors.core.apidoc`), so the document cannot drift from what the
server decodes and the client reads. The examples are built from the Structs too, and a test decodes each one back.
"""
from __future__ import annotations

import msgspec

from kvpipe.processors.core.apidoc import JsonObject, answer, body, document as assemble, errors, openapi_path
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


# the Structs the paths below name; the document's components are generated from them
TYPES: tuple[type, ...] = (RouteRequest, RouteAnswer, SentReport, FinishedReport)


def _errors() -> JsonObject:
    return errors(400, 401, 413, examples={400: {"wrong_block_size": ERROR_EXAMPLE}})


def paths() -> JsonObject:
    """`/route`, `/route/sent` and `/route/finished` (OpenAPI path items, JSON-ready)."""
    done = {"204": {"description": "recorded"}}
    return {
        "/route": {"post": {
            "operationId": "route",
            "summary": "Score the nodes for a prompt and choose one",
            "requestBody": {"required": True, **body("RouteRequest", REQUEST_EXAMPLES)},
            "responses": {"200": answer("per-node hits, scores and the chosen node", "RouteAnswer",
                                        {"answer": ANSWER_EXAMPLE}), **_errors()}}},
        "/route/sent": {"post": {
            "operationId": "route_sent",
            "summary": "Report a request sent to a node (in-flight accounting)",
            "requestBody": {"required": True, **body("SentReport", {
                "sent": SentReport("req-43", "node-a", [151644, 872, 198])})},
            "responses": {**done, **_errors(),
                          **errors(404, descriptions={404: "no worker's index holds that node (not published yet, "
                                                           "expired, or no usable group specs / hash configuration)"})}}},
        "/route/finished": {"post": {
            "operationId": "route_finished",
            "summary": "Report a request finished (it leaves the node's load)",
            "requestBody": {"required": True, **body("FinishedReport", {"finished": FinishedReport("req-42")})},
            "responses": {**done, **_errors()}}},
    }


def document(title: str = "kvpipe router", version: str = "2") -> JsonObject:
    """A document of the router endpoints alone (and `/openapi.json`), for a server that serves only those
    (the client's tests); the routing app serves `kvpipe.processors.routing.apidoc`'s, which holds these paths."""
    return assemble(title=title, version=version, paths={**paths(), "/openapi.json": openapi_path()}, types=TYPES,
                    description="Which serving node holds a prompt's KV cache blocks, vLLM's hybrid hit per node, "
                                "and a choice that weighs that against load.")


def encoded() -> bytes:
    """`document()` as JSON bytes."""
    return msgspec.json.encode(document())
