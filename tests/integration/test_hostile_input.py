"""A few hundred hostile messages through the real broker and `kvpipe processor` (RELIABILITY.md).

One victim node publishes normally while other ids send everything `kvpipe.bench.fuzz.Hostile`
generates, plus messages over the processor's size limit but under the events topic's (their
whole copy would be refused by the DLQ topic), and envelopes stamped far in the future. The DLQ
must get exactly the messages a local `Ingest` rejects, with the same reasons, each copy within
the broker's limit; the agent must never fail; the victim's index must stay exact and alive,
also after a restart from the shutdown snapshot; malformed HTTP bodies must be 4xx.
"""
from __future__ import annotations

import random
import socket
import time
import uuid
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Consumer, Producer

from kvpipe.bench.fuzz import Hostile
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import HEADER_DLQ_REASON, HEADER_ORIGINAL_SIZE, HEADER_TRUNCATED, Ingest
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored
from tests.integration.processor_fixture import HeldBlocks, ProcessorTopics

pytestmark = pytest.mark.integration

PROCESSOR_LIMIT = 1 << 20  # the processor's max_message_bytes
OVERSIZE = 2 << 20  # over the processor's limit, under the events topic's, over the DLQ topic's (broker default)
SKEW = 10.0


SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]  # the router needs a node's groups


def stored(hashes):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0)


def envelope(node: str, seq: int, ts: float, events) -> bytes:
    batch = msgspec.Raw(encode_vllm_batch(events, ts)) if events else msgspec.Raw()
    return encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=ts, sent_ts=ts, batch=batch,
                                    num_events=len(events), group_specs=SPECS))


def hostile_stream(rng: random.Random, model: HeldBlocks) -> list[tuple[bytes, bytes, list]]:
    """(key, value, headers): the victim's 80 envelopes among ~400 hostile messages."""
    now = time.time()
    hostile = Hostile(rng)
    cases = hostile.cases()
    out: list[tuple[bytes, bytes, list]] = []
    victim_seq = 0
    for i in range(480):
        r = rng.random()
        if i % 6 == 0:
            held = [h for (_, _, _), c in model.held.items() for h in c if c[h] > 0]
            events = [stored([rng.getrandbits(64) for _ in range(3)])]
            if held and rng.random() < 0.5:
                events.append(BlockRemoved(block_hashes=[rng.choice(sorted(held))], medium="GPU", group_idx=0))
            model.apply("victim", events)
            out.append((b"victim", envelope("victim", victim_seq, now + i * 0.01, events), KAFKA_HEADERS))
            victim_seq += 1
        elif r < 0.03:
            out.append((b"big", rng.randbytes(OVERSIZE), KAFKA_HEADERS))
        elif r < 0.08:
            ts = rng.choice([1e300, now + 120, now + 1e6])
            out.append((b"future", envelope(f"future-{i}", 0, ts, [stored([rng.getrandbits(64)])]), KAFKA_HEADERS))
        else:
            _, _, data, headers = rng.choice(cases)(now + i * 0.01)
            out.append((b"hostile", data, list(headers)))
    return out


def expected_dlq(stream) -> Counter:
    """What a processor must reject: the same pure path, run here (replay equals live)."""
    ingest = Ingest(Index(ttl_s=20.0), PROCESSOR_LIMIT, SKEW)
    for offset, (_, value, headers) in enumerate(stream):
        ingest.handle(value, headers, 0, offset, time.time())
    return Counter(ingest.dlq_by_reason)


def read_dlq(bootstrap: str, topic: str, count: int, timeout: float = 60.0) -> list:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"dlq-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest", "fetch.max.bytes": 8 << 20})
    consumer.subscribe([topic])
    seen = []
    deadline = time.monotonic() + timeout
    try:
        while len(seen) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                seen.append(msg)
        time.sleep(1.0)  # and nothing more than expected
        msg = consumer.poll(1.0)
        if msg is not None and not msg.error():
            seen.append(msg)
    finally:
        consumer.close()
    return seen


def raw_http(port: int, request: bytes, timeout: float = 30.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                break
        return b"".join(chunks)


def test_hostile_messages_are_dead_lettered_with_reasons_and_the_victim_stays_exact(kafka_bootstrap: str, tmp_path: Path):
    topics = ProcessorTopics(kafka_bootstrap, "hostile", 1, events_config={"max.message.bytes": str(4 << 20)})
    env = topics.env(f"kvpipe-hostile-{topics.tag}", free_port(), str(tmp_path / "state"),
                     KVPIPE_MAX_MESSAGE_BYTES=str(PROCESSOR_LIMIT), KVPIPE_NODE_TTL_S="20",
                     KVPIPE_SNAPSHOT_EVERY_S="3600", KVPIPE_MAX_CLOCK_SKEW_S=str(SKEW), KVPIPE_HTTP_READ_TIMEOUT_S="2")
    processor = ProcessorProcess(env, tmp_path / "processor.log").start()
    producer = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 5 << 20})
    try:
        model = HeldBlocks()
        stream = hostile_stream(random.Random(11), model)
        want = expected_dlq(stream)
        assert want["too_large"] >= 5 and "bad_utf8" in want and "too_deep" in want
        for key, value, headers in stream:
            producer.produce(topics.events, key=key, value=value, headers=headers)
        producer.flush(60)
        stats = processor.wait_offsets(topics.end_offsets(), timeout=120)

        # 1. every rejected message counted with the reason the pure path gives, no agent failure
        assert Counter(stats["dlq_by_reason"]) == want, processor.log_tail()
        assert stats["counters"]["agent_errors"] == 0 and stats["counters"]["dlq_send_errors"] == 0
        assert stats["counters"]["clock_clamped"] > 0
        assert stats["freshness"]["0"]["lag_s"] > -2 * SKEW  # the partition clock is not in the future

        # 2. the DLQ holds exactly those, each within the broker's limit, oversize ones as excerpts
        dlq = read_dlq(kafka_bootstrap, topics.dlq, sum(want.values()))
        assert len(dlq) == sum(want.values())
        reasons = Counter(dict(m.headers())[HEADER_DLQ_REASON].split(b":")[0].decode() for m in dlq)
        assert reasons == want
        big = [m for m in dlq if int(dict(m.headers())[HEADER_ORIGINAL_SIZE]) == OVERSIZE]
        assert len(big) == want["too_large"] and all(len(m.value()) <= 1024 and
                                                     dict(m.headers())[HEADER_TRUNCATED] == b"1" for m in big)

        # 3. the victim: alive, healthy, exact; future-stamped nodes clamped and flagged
        def victim_checks() -> None:
            rows = {r["node_id"]: r for r in processor.get("/nodes?limit=10000")["nodes"]}
            victim = rows["victim"]
            assert victim["state"] == "healthy" and not victim["expired"] and victim["clock_skew_s"] == 0, victim
            future = [r for n, r in rows.items() if n.startswith("future-")]
            assert future and all(r["clock_skew_s"] > 100 and r["last_seen"] < time.time() + 2 * SKEW for r in future)
            held = sorted(h for c in model.held.values() for h in c if c[h] > 0)
            answer = processor.route({"0": held[:1]}, num_tokens=17)
            assert [r["node_id"] for r in answer["nodes"]] == ["victim"]
            assert sum(victim["blocks"].values()) == len(held)

        victim_checks()
        time.sleep(6)  # past one liveness-timer round (ttl 20 → every 5 s)
        victim_checks()

        # 4. HTTP: a deep body is a 400, a lying Content-Length a 408, not a held connection
        status, body = processor.post("/route", b"[" * 100_000)
        assert status == 400 and body["error"] == "body nested too deep"
        started = time.monotonic()
        reply = raw_http(processor.port, b"POST /route HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                         b"Content-Length: 1000\r\n\r\n{\"block_hashes\": ")
        assert reply.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 10

        # 5. a restart (shutdown snapshot → restore) brings back no poisoned clock
        processor.stop()
        processor.start()
        stats = processor.wait_offsets(topics.end_offsets())
        assert stats["durability"]["restores"] and stats["durability"]["restores"][-1]["blocks"] > 0
        assert stats["freshness"]["0"]["lag_s"] > -2 * SKEW
        victim_checks()
    finally:
        processor.stop()
        topics.delete()
