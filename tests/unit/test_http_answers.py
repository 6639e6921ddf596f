"""Both apps' HTTP answers are Structs and their OpenAPI documents cover every route.

- Every route a Faust app registers has its operation in that app's `/openapi.json` document: adding an
  endpoint without a spec fails here.
- `/stats` read into its Struct keeps every key and value the app reports, on a worker whose records are all
  filled (an applied message, a DLQ copy, a restore, a failed snapshot): a key added to the stats without a
  field would be silently dropped from the answer.
- `/nodes` rows carry every field of the node's group specs; a group page across workers knows about the rows
  past a worker's own page.
- `/sql` cells keep the text they had before the answer was typed.

The apps are imported in a subprocess, as a worker imports them (their settings are read at import).
"""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
from openapi_spec_validator import validate

from kvpipe.processors.analytics import apidoc as analytics_doc
from kvpipe.processors.analytics.answers import SqlAnswer, StoreState, encode_sql
from kvpipe.processors.core.answers import ErrorBody
from kvpipe.processors.core.index import Index
from kvpipe.processors.routing import apidoc as routing_doc
from kvpipe.processors.routing.answers import LocalNodesPage, NodeRow
from kvpipe.processors.routing.api import node_rows, page_rows
from kvpipe.processors.routing.scatter import http_asker, merge_nodes, nodes as scatter_nodes
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec

ROOT = Path(__file__).resolve().parents[2]

# Fills every record of a worker's stats, then prints its routes and its stats before and after typing.
_WORKER = """
import asyncio, json, sys
import msgspec
from kvpipe.processors.core import durability
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import BlockStored

APP = sys.argv[1]
if APP == "routing":
    from kvpipe.processors.routing import agents, routeserve, views  # noqa: F401 (every page)
    from kvpipe.processors.routing.app import app
    from kvpipe.processors.routing.answers import RoutingStats as Stats
    from kvpipe.processors.routing.state import runtime
    stats = views.stats_mapping
else:
    from kvpipe.processors.analytics import agents, views  # noqa: F401
    from kvpipe.processors.analytics.app import app
    from kvpipe.processors.analytics.answers import AnalyticsStats as Stats
    from kvpipe.processors.analytics.state import runtime
    stats = views._stats

stored = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                     medium="GPU", lora_name=None, group_idx=0)
batch = msgspec.Raw(encode_vllm_batch([stored], 1000.0))
message = encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id="n", epoch=1, seq=0, ts=1000.0, sent_ts=1000.0, batch=batch))
runtime.ingest.handle(message, KAFKA_HEADERS, 0, 0, 1000.0)
runtime.ingest.handle(b"\\xc1", KAFKA_HEADERS, 0, 1, 1000.0)  # not msgpack: a DLQ copy


async def no_snapshot(consumer, topic, partition):
    return None


class Refusing:
    async def send(self, **kwargs):
        raise RuntimeError("the cluster refused the snapshot")


async def flushed():
    pass


async def restore_and_fail():
    await runtime.durability._restore_one(None, 1)  # partition 1 restored (from nothing: rebuilt from the log)
    try:
        await runtime.durability.snapshot(Refusing(), [0], flushed)
    except RuntimeError:
        pass

durability.read_latest = no_snapshot
asyncio.run(restore_and_fail())
raw = stats()  # once: its clocks move (views.stats_answer is this mapping read into `Stats`)
routes = sorted({(r.method, r.resource.canonical) for r in app.web.web_app.router.routes() if r.method != "HEAD"})
print(json.dumps({"routes": routes, "raw": msgspec.to_builtins(raw),
                  "typed": msgspec.to_builtins(msgspec.convert(raw, Stats)),
                  "answer": msgspec.to_builtins(views.stats_answer())}))
"""


@pytest.fixture(scope="module", params=["routing", "analytics"])
def worker(request, tmp_path_factory) -> tuple[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KVPIPE_STATE_DIR": str(tmp_path_factory.mktemp("state"))}
    out = subprocess.run([sys.executable, "-c", _WORKER, request.param], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return request.param, json.loads(out.stdout.splitlines()[-1])


DOCS = {"routing": routing_doc, "analytics": analytics_doc}


def test_every_route_the_app_registers_is_in_its_document(worker):
    name, seen = worker
    doc = DOCS[name].document()
    routes = [tuple(r) for r in seen["routes"]]
    assert ("GET", "/openapi.json") in routes and len(routes) >= 5
    missing = [(method, path) for method, path in routes if method.lower() not in doc["paths"].get(path, {})]
    assert missing == [], f"{name} app routes without an OpenAPI operation: {missing}"
    extra = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if (m.upper(), p) not in routes]
    assert extra == [], f"documented but not served by the {name} app: {extra}"


def test_stats_keep_every_key_and_value_when_typed(worker):
    name, seen = worker
    raw = seen["raw"]
    # the records this test means to fill are filled, so their keys are compared too
    assert raw["freshness"]["0"] and raw["dlq_by_reason"] and raw["durability"]["restores"]
    assert raw["durability"]["snapshot_last_error"]["error"]
    assert seen["typed"] == raw
    assert seen["answer"].keys() == raw.keys()  # what /stats serves

@pytest.mark.parametrize("module", [routing_doc, analytics_doc], ids=["routing", "analytics"])
def test_the_documents_are_valid_openapi_and_their_examples_decode(module):
    doc = json.loads(module.encoded())
    validate(doc)
    structs = {cls.__name__: cls for cls in (*module.TYPES, ErrorBody)}
    assert set(structs) <= set(doc["components"]["schemas"])
    for path, ops in doc["paths"].items():
        for op in ops.values():
            for body in [op.get("requestBody", {}), *op["responses"].values()]:
                for media in body.get("content", {}).values():
                    schema = media["schema"]
                    names = [s["$ref"].rsplit("/", 1)[-1] for s in schema.get("anyOf", [schema]) if "$ref" in s]
                    for example in media.get("examples", {}).values():
                        msgspec.json.decode(json.dumps(example["value"]), type=structs[names[0]])


def test_the_analytics_document_lists_sql_refusals_and_is_open_like_the_routing_one():
    doc = analytics_doc.document()
    assert {"400", "401", "403", "413", "422", "429"} <= set(doc["paths"]["/sql"]["post"]["responses"])
    for module in (routing_doc, analytics_doc):
        paths = module.document()["paths"]
        assert paths["/openapi.json"]["get"]["security"] == [] and paths["/health"]["get"]["security"] == []
        assert "security" not in paths["/stats"]["get"]  # the document's bearer requirement holds


def _index_with(specs: list[GroupSpec], nodes: dict[str, int]) -> Index:
    index = Index(ttl_s=None)
    for node, partition in nodes.items():
        index.apply(Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=0, ts=1000.0, sent_ts=1000.0,
                             group_specs=specs), [], partition, 0)
    return index


def test_a_nodes_row_carries_every_group_spec_field_and_the_keys_it_always_had():
    specs = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
             GroupSpec(group_idx=1, kind="chunked_local_attention", block_size=16, attention_chunk_size=8192),
             GroupSpec(group_idx=2, kind="full_attention", block_size=16, eagle=True, num_layers=1)]
    [row] = node_rows(_index_with(specs, {"a": 0}), 1001.0)
    wire = msgspec.to_builtins(row)
    assert list(wire) == ["node_id", "epoch", "seq", "model", "dp_rank", "partition", "state", "last_seen", "silent_s",
                          "expired", "suspect", "suspect_reason", "partial", "partial_since", "clock_skew_s", "load",
                          "groups", "blocks", "counters"]
    assert wire["state"] == "healthy" and wire["silent_s"] == 1.0 and wire["load"] is None
    for group in wire["groups"]:
        assert set(group) == set(GroupSpec.__struct_fields__)  # nulls and defaults written out
    assert [(g["attention_chunk_size"], g["eagle"], g["sliding_window"]) for g in wire["groups"]] == [
        (None, False, None), (8192, False, None), (None, True, None)]
    assert msgspec.json.decode(msgspec.json.encode(row), type=NodeRow) == row  # what a coordinator reads back


def _paged(index: Index, partitions: list[int], limit: int, after: str | None) -> LocalNodesPage:
    """What a worker answers `GET /nodes?local=1&limit=&after=`."""
    rows, next_after = page_rows(node_rows(index, 1000.0, limit + 1, after), limit, after, None)
    return LocalNodesPage(nodes=rows, next_after=next_after, partitions=partitions)


def test_a_group_page_goes_on_while_a_worker_holds_more_nodes_than_it_gave():
    specs = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]
    mine = _index_with(specs, {f"m{i}": 0 for i in range(7)})  # pages of three; the other worker holds one node
    theirs = _index_with(specs, {"a": 1})
    pages, after = [], None
    while True:
        merged = merge_nodes([_paged(mine, [0], 3, after), _paged(theirs, [1], 3, after)], range(2))
        page, after = page_rows(merged.rows, 3, after, None, merged.more)
        pages.append([r.node_id for r in page])
        if after is None:
            break
    # the second page holds three rows of one worker only: that worker's cut page says more follow
    assert pages == [["a", "m0", "m1"], ["m2", "m3", "m4"], ["m5", "m6"]]


def _peer(asked: list[tuple[str, str, bytes | None]]) -> httpx.AsyncClient:
    """A peer answering every request with an empty `/nodes` page of partition 1 (httpx's mock transport)."""
    def answer(request: httpx.Request) -> httpx.Response:
        asked.append((request.method, str(request.url), request.content or None))
        return httpx.Response(200, content=b'{"nodes": [], "next_after": null, "partitions": [1]}')

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


def test_a_peer_is_asked_for_the_page_the_client_asked_for():
    asked: list[tuple[str, str, bytes | None]] = []
    session = _peer(asked)
    ask = http_asker(lambda: session, "/nodes?limit=2&after=m1&state=healthy", "GET")
    answer = asyncio.run(scatter_nodes(_paged(_index_with([], {}), [0], 2, "m1"), ["http://w2:6066/"], ask, range(2)))
    assert asked == [("GET", "http://w2:6066/nodes?limit=2&after=m1&state=healthy&local=1", None)]
    assert answer.missing == [] and answer.rows == []  # partition 1 came from the peer's (empty) page
    post = http_asker(lambda: session, "/route", "POST")
    asyncio.run(post("http://w2:6066", b"{}"))
    assert asked[-1] == ("POST", "http://w2:6066/route?local=1", b"{}")


def test_sql_cells_keep_the_text_they_had_before_the_answer_was_typed():
    when = datetime.datetime(2025, 1, 2, 3, 4, 5, 600000)
    answer = SqlAnswer(columns=["ts", "hash", "n", "tags"], types=["DateTime64(6)", "String", "UInt64", "Array(String)"],
                       rows=[[when, b"\x01\xff", 7, ["a"]]])
    before = json.dumps({"columns": answer.columns, "types": answer.types, "rows": answer.rows},
                        default=lambda v: "0x" + v.hex() if isinstance(v, bytes) else str(v)).encode()
    assert encode_sql(answer) == before
    assert json.loads(encode_sql(answer))["rows"] == [["2025-01-02 03:04:05.600000", "0x01ff", 7, ["a"]]]


def test_health_shows_the_store_without_the_engine_error_text():
    store = StoreState(state="refusing", up=False, refusing_for_s=3.5, pending_rows=10, max_queue_rows=100,
                       consumption_paused=False, reason="Code: 241. DB::Exception: memory limit (for query) exceeded")
    shown = msgspec.to_builtins(store.health())
    assert "reason" not in shown and shown == {k: v for k, v in msgspec.to_builtins(store).items() if k != "reason"}
