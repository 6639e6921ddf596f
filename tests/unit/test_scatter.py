"""Scatter-gather merge: several workers' local answers rank exactly as one index would."""
from __future__ import annotations

import asyncio

import pytest

import msgspec

from kvpipe.processors.router import serving
from kvpipe.processors.routing import scatter
from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.core.index import Index
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import RouteAnswer, RouteRequest, Scoring, decode_request
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockStored


def _stored(hashes, group=0, medium="GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def _apply(index: Index, node: str, partition: int, events) -> None:
    specs = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
             GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
    env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=0, ts=1.0, sent_ts=1.0, num_events=len(events),
                   group_specs=specs)
    index.apply(env, events, partition, 0)


NOW = 2.0
NODES = {  # node → (partition, events)
    "a": (0, [_stored([1, 2, 3]), _stored([1, 2], group=1)]),
    "b": (1, [_stored([1, 2, 3, 4])]),
    "c": (2, [_stored([1, 2], medium="CPU"), _stored([1], group=1)]),
    "d": (3, [_stored([1, 2, 3], group=1)]),
}


def _split(owners: dict[str, list[int]]) -> dict[str, Index]:
    out = {w: Index(ttl_s=None) for w in owners}
    for node, (p, events) in NODES.items():
        for w, parts in owners.items():
            if p in parts:
                _apply(out[w], node, p, events)
    return out


def _gather(req: RouteRequest, owners: dict[str, list[int]], down: frozenset = frozenset(),
            inflight: dict[str, InFlight] | None = None) -> RouteAnswer:
    """What views.Route does: the first worker answers locally, asks the others over the wire
    (bytes both ways, as over HTTP), merges and finishes."""
    indexes = _split(owners)
    first, *others = owners
    flight = inflight or {}

    async def ask(url: str, body: bytes) -> bytes:
        if url in down:
            raise TimeoutError(url)
        local = serving.local_answer(indexes[url], flight.get(url), decode_request(body), owners[url], None, now=NOW)
        return msgspec.json.encode(local)

    async def run() -> RouteAnswer:
        mine = serving.local_answer(indexes[first], flight.get(first), req, owners[first], None, now=NOW)
        theirs = await scatter.ask_all(others, msgspec.json.encode(req), ask)
        parts, missing = serving.merge_local([mine, *map(serving.decode_local, theirs)], range(4))
        return serving.answer(parts, missing, req, indexes[first], flight.get(first), now=NOW)

    return asyncio.run(run())


def _strip(answer: RouteAnswer) -> RouteAnswer:
    return msgspec.structs.replace(answer, hashing_s=0.0, search_s=0.0,
                                   hash_configs=[msgspec.structs.replace(h, hashing_s=0.0) for h in answer.hash_configs])


REQUESTS = [RouteRequest(block_hashes={0: [1, 2, 3, 4], 1: [1, 2, 3, 4]}, num_tokens=65, include_zero=True),
            RouteRequest(block_hashes={0: [1, 2, 3, 4]}, num_tokens=65),
            RouteRequest(block_hashes={0: [1, 2, 3]}, semantics="prefix-per-group", top_k=2),
            RouteRequest(block_hashes={0: [1, 2, 3, 4]}, num_tokens=70, scoring=Scoring(temperature=0.5, seed=3))]


def test_two_workers_merge_to_the_single_index_answer():
    for req in REQUESTS:
        single = _gather(req, {"all": [0, 1, 2, 3]})
        for owners in ({"x": [0, 2], "y": [1, 3]}, {"y": [3], "x": [0, 1, 2]}):
            merged = _gather(req, owners)
            assert _strip(merged) == _strip(single) and not merged.partial, (req, owners)


def test_the_hybrid_hit_per_node_merged():
    answer = _gather(REQUESTS[0], {"x": [0, 2], "y": [1, 3]})
    # a: FA 3 blocks, SWA run touching 0 of 2 → 32; c: CPU FA 2 + SWA 1 → 16 on "any" only
    assert [(r.node_id, r.gpu_tokens, r.loadable_tokens) for r in answer.nodes] == [
        ("a", 32, 0), ("c", 0, 16), ("b", 0, 0), ("d", 0, 0)]
    assert answer.chosen == "a"


def test_a_silent_worker_costs_its_partitions_and_a_partition_is_taken_from_one_answer_only():
    req = RouteRequest(block_hashes={0: [1, 2]}, num_tokens=33, include_zero=True)
    merged = _gather(req, {"x": [0, 2], "y": [1, 3]}, down=frozenset({"y"}))
    assert merged.partial is True and merged.missing_partitions == [1, 3]
    assert {r.node_id for r in merged.nodes} == {"a", "c"}
    # mid-rebalance both claim partition 1: its node appears once
    both = _split({"x": [0, 1], "y": [1, 2, 3]})
    parts = [serving.local_answer(both[w], None, req, ps, None, now=NOW) for w, ps in (("x", [0, 1]), ("y", [1, 2, 3]))]
    claimed, missing = serving.merge_local(parts, range(4))
    assert sorted(r.node_id for p in claimed for r in p.nodes) == ["a", "b", "c", "d"] and missing == []


def test_a_peer_refusing_the_request_refuses_the_whole_answer_not_a_partial_one():
    async def ask(url: str, body: bytes) -> bytes:
        raise ApiError(400, "block hashes do not fit the groups", "group 0: 3 hashes, expected 6")

    with pytest.raises(ApiError) as exc:
        asyncio.run(scatter.ask_all(["y"], b"{}", ask))
    assert exc.value.status == 400 and "group 0" in exc.value.detail


def test_a_sent_request_is_recorded_by_the_worker_holding_the_chosen_node():
    owners = {"x": [1, 3], "y": [0, 2]}  # x is asked; the best node, a, is y's
    flight = {"x": InFlight(), "y": InFlight()}
    req = RouteRequest(block_hashes={0: [1, 2, 3, 4]}, num_tokens=65, request_id="r1")
    answer = _gather(req, owners, inflight=flight)
    assert answer.chosen == "a" and flight["x"].running("a") == 0  # x does not hold a: views forwards
    indexes = _split(owners)
    assert serving.needs_forward(answer, req, indexes["x"])
    assert serving.sent_locally(indexes["x"], flight["x"], "r1", "a", req) is not None
    assert serving.sent_locally(indexes["y"], flight["y"], "r1", "a", req, now=NOW) is None
    assert flight["y"].running("a") == 1
    # the next request with that prefix sees a's load (one in flight) and its speculative blocks
    again = _gather(RouteRequest(block_hashes={0: [1, 2, 3, 4]}, num_tokens=65), owners, inflight=flight)
    row = next(r for r in again.nodes if r.node_id == "a")
    assert row.load.waiting == 1 and row.speculative and row.gpu_tokens == 64


def test_peers_come_from_the_assignor_map_without_self():
    dist = {"http://127.0.0.1:1/": {"ev": [2, 0]}, "http://127.0.0.1:2": {"ev": [1, 3], "other": [0]},
            "http://127.0.0.1:3": {"other": [1]}}
    assert scatter.peers(dist, "ev", "http://127.0.0.1:2") == {"http://127.0.0.1:1/": [0, 2]}
