"""The router as the processor runs it: load from the nodes' envelopes (the index keeps the latest),
in-flight accounting fed by the ingest path, and one worker's answer (`kvpipe.processors.router.serving`)."""
from __future__ import annotations

import msgspec
import pytest

from kvpipe.processors.router import serving
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import Load, RouteRequest
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from tests.unit.router.router_fixtures import LAYOUTS, group_lists, hash_config, stored

SPECS, HBS = LAYOUTS["fa"]
CFG = hash_config("sha256-int", HBS)
TOKENS = list(range(161))  # 10 full blocks of 16, cap 160
LISTS = group_lists(CFG, SPECS, TOKENS)


def message(node: str, seq: int, events: list, epoch: int = 1, **load) -> bytes:
    env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=100.0 + seq, sent_ts=100.0 + seq,
                   model="m", group_specs=SPECS, hash_config=CFG, num_events=len(events),
                   batch=msgspec.Raw(encode_vllm_batch(events, 100.0)) if events else msgspec.Raw(), **load)
    return encode_envelope(env)


def fleet() -> tuple[Ingest, InFlight]:
    inflight = InFlight(ttl_s=30.0)
    ingest = Ingest(Index(), 1 << 20, max_skew_s=1e9, inflight=inflight)
    ingest.handle(message("a", 0, [stored(LISTS[0][:10], 0)]), KAFKA_HEADERS, 0, 0, 100.0)
    ingest.handle(message("b", 0, []), KAFKA_HEADERS, 0, 1, 100.0)
    return ingest, inflight


def answer(ingest: Ingest, inflight: InFlight, req: RouteRequest, now: float = 101.0):
    local = serving.local_answer(ingest.index, inflight, req, [0], None, now=now)
    parts, missing = serving.merge_local([local], [0])
    return serving.answer(parts, missing, req, ingest.index, inflight, now=now)


def test_the_latest_reported_load_is_kept_per_node_and_moves_the_choice():
    ingest, inflight = fleet()
    req = RouteRequest(token_ids=TOKENS, include_zero=True)
    assert answer(ingest, inflight, req).chosen == "a"
    # a reports 25 waiting requests: 1.0 - 25 · 0.05 < 0, the idle empty node wins (decide's formula)
    ingest.handle(message("a", 1, [], waiting=25, running=4, kv_usage=0.9), KAFKA_HEADERS, 0, 2, 101.0)
    assert serving.node_loads(ingest.index) == {"a": Load(running=4, waiting=25, kv_usage=0.9)}
    loads = serving.NodeLoads(ingest.index)
    assert loads.get("b") is None and loads.get("nobody", Load()) == Load() and "b" not in loads
    with pytest.raises(KeyError):
        loads["b"]  # never reported: no load, as a mapping says it
    got = answer(ingest, inflight, req)
    assert got.chosen == "b" and next(r for r in got.nodes if r.node_id == "a").load == Load(4, 25, 0.9)
    # a heartbeat without load fields keeps the last report; a new report replaces it
    ingest.handle(message("a", 2, []), KAFKA_HEADERS, 0, 3, 102.0)
    assert serving.node_loads(ingest.index)["a"].waiting == 25
    ingest.handle(message("a", 3, [], waiting=0, running=1, kv_usage=0.1), KAFKA_HEADERS, 0, 4, 103.0)
    assert answer(ingest, inflight, req).chosen == "a"


def test_speculative_entries_appear_then_yield_to_real_events_from_the_ingest_path_then_expire():
    ingest, inflight = fleet()
    burst = RouteRequest(token_ids=TOKENS, include_zero=True, request_id="r1")
    # b has nothing cached; a burst of a new prompt lands on b when a is busy ...
    ingest.handle(message("a", 1, [], waiting=30), KAFKA_HEADERS, 0, 2, 101.0)
    other = list(range(1000, 1161))
    first = answer(ingest, inflight, RouteRequest(token_ids=other, request_id="r1"))
    assert first.chosen == "b" and inflight.running("b") == 1
    # ... and the next request with that prefix sticks to b before any event arrived
    second = answer(ingest, inflight, RouteRequest(token_ids=other, include_zero=True))
    row = next(r for r in second.nodes if r.node_id == "b")
    assert second.chosen == "b" and row.speculative and row.gpu_tokens == 160 and row.load.waiting == 1
    # b's real events arrive through ingest: the guess yields to the truth (b cached 4 blocks only)
    real = group_lists(CFG, SPECS, other)[0][:4]
    ingest.handle(message("b", 1, [stored(real, 0)]), KAFKA_HEADERS, 0, 3, 102.0)
    assert inflight.counters["confirmed"] == 4
    row = next(r for r in answer(ingest, inflight, RouteRequest(token_ids=other, include_zero=True)).nodes
               if r.node_id == "b")
    assert row.gpu_tokens == 160 and row.groups[0].speculative_blocks == 6  # 4 real + 6 still guessed
    # a new epoch of b (a restart) drops every guess about b
    ingest.handle(message("b", 0, [], epoch=2), KAFKA_HEADERS, 0, 4, 103.0)
    row = next(r for r in answer(ingest, inflight, RouteRequest(token_ids=other, include_zero=True)).nodes
               if r.node_id == "b")
    assert row.gpu_tokens == 0 and not row.speculative
    # and a record's load share ends at its TTL
    answer(ingest, inflight, burst)
    assert inflight.running("a") + inflight.running("b") == 1
    answer(ingest, inflight, RouteRequest(token_ids=TOKENS), now=200.0)  # sweeps
    assert inflight.running("a") + inflight.running("b") == 0 and inflight.entries == 0
