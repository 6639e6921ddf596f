"""Bad input across both apps (RELIABILITY.md section 13, issue 18 goal 6): one DLQ record per bad message.

Both Faust apps consume the same events topic. The routing app (`kvpipe processor`) owns the dead-letter
queue: it writes one record per undecodable message, with the classified reason and the source coordinates.
The analytics app (`kvpipe analytics`) decodes the same messages with the same code, counts them by reason in
`/stats` (`dlq_by_reason`) and writes no rows for them, and sends nothing to the DLQ: a second writer would give
every bad message two records.

The scenario: three well-behaved nodes publish envelopes among bad messages of every reason the decoders have
(`kvpipe.schemas.codec.ERROR_KINDS`): the fuzzers' generators (`kvpipe.bench.fuzz.Hostile`), kept only when the
pure path (`Ingest.handle` on a fresh index, what `tests/fuzz` classify with) rejects them, and bad messages
with a good node's id and next seq (the routing app's native run must leave them to the reference decoder). The
analytics app runs first, alone, until it has handled and written everything: the DLQ must still be empty. Then
the routing app starts beside it: the DLQ must hold exactly one record per bad message, at its coordinates,
with the pure path's reason; both apps must have applied every good envelope and counted the same reasons.
"""
from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Iterable, NamedTuple, cast

import msgspec
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kvpipe.bench.fuzz import MAX_BYTES, Hostile
from kvpipe.processors.core.index import APPLIED, Index
from kvpipe.processors.core.ingest import (DLQ, HEADER_DLQ_REASON, HEADER_ORIGINAL_SIZE, HEADER_SOURCE_OFFSET,
                                           HEADER_SOURCE_PARTITION, HEADER_SOURCE_TOPIC, HEADER_TRUNCATED, Ingest)
from kvpipe.schemas.codec import ERROR_KINDS, KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored
from tests.integration.analytics_helpers import AnalyticsSession, sql, wait_written
from tests.integration.kafka_reading import client_config

pytestmark = pytest.mark.integration

PARTITIONS = 2
PER_REASON = 4  # bad messages of each reason
GOOD_NODES, GOOD_STEPS = 3, 10
EXCERPT = 1024  # settings.dlq_excerpt_bytes (default): a too_large message's DLQ copy is its first 1 KiB
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]


def stored(hashes) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0)


def envelope(node: str, seq: int, ts: float, events: list, **kw) -> bytes:
    return encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=ts, sent_ts=ts,
                                    batch=msgspec.Raw(encode_vllm_batch(events, ts)), num_events=len(events), **kw))


def pure_outcome(ingest: Ingest, value: bytes, headers) -> tuple[str, str | None]:
    """(outcome, reason) of the pure path for one message: the classification both apps must give it.
    Decoding is stateless, so one `Ingest` serves every message (each at an offset of its own)."""
    offset = ingest.counters["messages"]
    result = ingest.handle(value, headers, 0, offset, time.time())
    return result.outcome, result.error.kind if result.error is not None else None


class Message(NamedTuple):
    key: bytes
    value: bytes
    headers: list
    reason: str | None  # the pure path's reason for a bad message; None for a good one
    events: int  # a good message's events (its analytics rows)


def good_stream(rng: random.Random, now: float, pure: Ingest) -> tuple[list[Message], dict[str, set[int]]]:
    """Envelopes of well-behaved nodes, every one with events (a heartbeat has no analytics row to prove
    it applied), and the hashes each node holds at the end. Halfway through, each node's next seq is
    first taken by bad messages with its id (refused whole: the good envelope after them still applies),
    which the routing app's native run must hand to the reference decoder, as the analytics app does."""
    out: list[Message] = []
    held: dict[str, set[int]] = {}
    for step in range(GOOD_STEPS):
        for n in range(GOOD_NODES):
            node = f"good-{n}"
            mine = held.setdefault(node, set())
            ts = now + step * 0.01
            if step == GOOD_STEPS // 2:
                bad_model = envelope(node, step, ts, [stored([1])], model="QQQQ").replace(b"QQQQ", b"\xff\xfe\xfd\xfc")
                for value in (envelope(node, step, float("nan"), [stored([1])]),  # invalid
                              envelope(node, step, ts, [BlockStored(block_hashes=[2], parent_block_hash=None,
                                                                    token_ids=[], block_size=16, lora_id=None,
                                                                    medium="GPU", lora_name=None, group_idx=-1)]),
                              bad_model,  # bad_utf8
                              envelope(node, step, ts, [stored(range(10**9, 10**9 + MAX_BYTES // 4))]),  # too_large
                              msgspec.msgpack.encode({"v": SCHEMA_MAJOR + 1, "node_id": node, "epoch": 1, "seq": step,
                                                      "ts": ts})):  # unknown_version
                    outcome, reason = pure_outcome(pure, value, KAFKA_HEADERS)
                    assert outcome == DLQ, (node, outcome)
                    out.append(Message(node.encode(), value, list(KAFKA_HEADERS), reason, 0))
            events: list = [stored([rng.getrandbits(63) for _ in range(rng.randint(1, 3))])]
            if mine and step % 3 == 2:
                events.append(BlockRemoved(block_hashes=[sorted(mine)[0]], medium="GPU", group_idx=0))
            for ev in events:
                (mine.update if isinstance(ev, BlockStored) else mine.difference_update)(ev.block_hashes)
            value = envelope(node, step, ts, events, group_specs=SPECS if step == 0 else None)
            assert pure_outcome(pure, value, KAFKA_HEADERS)[0] == APPLIED
            out.append(Message(node.encode(), value, list(KAFKA_HEADERS), None, len(events)))
    return out, held


def hostile_messages(rng: random.Random, now: float, pure: Ingest) -> list[Message]:
    """PER_REASON messages of every reason in ERROR_KINDS from the fuzzers' generators, each rejected by
    the pure path (generated inputs that decode are not kept)."""
    cases = Hostile(rng).cases()
    got: dict[str, list[Message]] = {kind: [] for kind in ERROR_KINDS}
    for i in range(20_000):
        if all(len(v) >= PER_REASON for v in got.values()):
            break
        label, _, value, generated = rng.choice(cases)(now)
        headers = list(cast(Iterable[tuple[str, bytes]], generated))  # the generators type their headers loosely
        outcome, reason = pure_outcome(pure, value, headers)
        if outcome == DLQ and reason is not None and len(got[reason]) < PER_REASON:
            got[reason].append(Message(f"bad-{label}-{i}".encode(), value, headers, reason, 0))
    assert all(len(v) == PER_REASON for v in got.values()), {k: len(v) for k, v in got.items()}
    return [m for kind in ERROR_KINDS for m in got[kind]]


def publish(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes, list]]) -> list[tuple[int, int]]:
    """Produce in order; returns each message's (partition, offset) from its delivery report."""
    producer = Producer(client_config(bootstrap, **{"message.max.bytes": 4 << 20, "enable.idempotence": True}))
    where: list[tuple[int, int] | None] = [None] * len(messages)
    errors: list[str] = []

    def delivered(i: int):
        def report(err, msg) -> None:
            if err is not None:
                errors.append(f"message {i}: {err}")
            else:
                where[i] = (msg.partition(), msg.offset())
        return report

    for i, (key, value, headers) in enumerate(messages):
        producer.produce(topic, key=key, value=value, headers=headers, on_delivery=delivered(i))
        producer.poll(0)
    assert producer.flush(30) == 0 and not errors, errors
    assert all(w is not None for w in where)
    return [w for w in where if w is not None]


def read_all(bootstrap: str, topic: str, timeout: float = 20.0) -> list:
    """Every record of a one-partition topic, up to its end offset now (and nothing cut off by a timeout)."""
    consumer = Consumer(client_config(bootstrap, **{"group.id": "unused", "enable.auto.commit": False,
                                                    "fetch.max.bytes": 8 << 20}))
    try:
        end = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
        consumer.assign([TopicPartition(topic, 0, 0)])
        out: list = []
        deadline = time.monotonic() + timeout
        while len(out) < end and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                out.append(msg)
        assert len(out) == end, f"read {len(out)} of the DLQ's {end} records"
        return out
    finally:
        consumer.close()


def dlq_end(bootstrap: str, topic: str) -> int:
    consumer = Consumer(client_config(bootstrap, **{"group.id": "unused"}))
    try:
        return consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1]
    finally:
        consumer.close()


def dlq_settled(processor, timeout: float = 20.0) -> dict:
    """The routing app's /stats once every DLQ send it started was acknowledged, failed or skipped as already
    written (sends are not awaited one by one): from then on the DLQ's end offset counts all of them."""
    deadline = time.monotonic() + timeout
    while True:
        stats = processor.get("/stats")
        c = stats["counters"]
        if c["dlq_sent"] + c["dlq_send_errors"] + c["dlq_already_written"] == c["dlq"] + c["agent_errors"]:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"DLQ sends not settled: {c}")
        time.sleep(0.05)


def test_each_bad_message_gets_one_dlq_record_from_the_routing_app_and_a_matching_count_in_analytics(
        kafka_bootstrap: str, tmp_path: Path):
    rng = random.Random(186)
    now = time.time()
    pure = Ingest(Index(ttl_s=3600.0), MAX_BYTES, 10.0)
    good, held = good_stream(rng, now, pure)
    hostile = hostile_messages(rng, now, pure)
    # the hostile messages fall at random places among the nodes' stream, which keeps its order
    slots = sorted(rng.randrange(len(good) + 1) for _ in hostile)
    stream: list[Message] = []
    for i, m in enumerate(good):
        stream.extend(h for h, at in zip(hostile, slots) if at == i)
        stream.append(m)
    stream.extend(h for h, at in zip(hostile, slots) if at == len(good))
    assert len(stream) == len(good) + len(hostile)

    session = AnalyticsSession(kafka_bootstrap, tmp_path, partitions=PARTITIONS,
                               KVPIPE_MAX_MESSAGE_BYTES=str(MAX_BYTES))
    try:
        analytics = session.analytics(snapshot_every_s=3600)
        coords = publish(kafka_bootstrap, session.events, [(m.key, m.value, m.headers) for m in stream])
        ends = session.end_offsets()
        assert sum(ends.values()) == len(stream)

        # 1. the analytics app alone handled and wrote everything, and sent nothing to the DLQ
        wait_written(analytics, ends)
        assert dlq_end(kafka_bootstrap, session.dlq) == 0, "the analytics app wrote to the DLQ"

        # 2. the routing app, started beside it, writes one DLQ record per bad message
        processor = session.processor()
        p_stats = processor.wait_offsets(ends, timeout=60)
        # (partition, offset) of each bad message → (its bytes, the pure path's reason)
        want = {coords[i]: (m.value, m.reason) for i, m in enumerate(stream) if m.reason is not None}
        want_reasons = Counter(reason for _, reason in want.values())
        assert set(want_reasons) == set(ERROR_KINDS) and len(want) == len(stream) - GOOD_NODES * GOOD_STEPS
        p_stats = dlq_settled(processor)
        assert p_stats["counters"]["dlq_sent"] == len(want) and p_stats["counters"]["dlq_already_written"] == 0
        records = dlq_end(kafka_bootstrap, session.dlq)
        dlq = read_all(kafka_bootstrap, session.dlq)
        assert records == len(dlq) == len(want), f"{len(dlq)} DLQ records for {len(want)} bad messages"
        seen: Counter = Counter()
        for rec in dlq:
            h = {k: v for k, v in rec.headers() or []}
            assert h[HEADER_SOURCE_TOPIC] == session.events.encode()
            at = (int(h[HEADER_SOURCE_PARTITION]), int(h[HEADER_SOURCE_OFFSET]))
            seen[at] += 1
            assert at in want, f"a DLQ record for {at}, which is no bad message"
            value, reason = want[at]
            assert h[HEADER_DLQ_REASON].split(b":")[0].decode() == reason, (at, h[HEADER_DLQ_REASON][:200])
            assert int(h[HEADER_ORIGINAL_SIZE]) == len(value)
            if reason == "too_large":  # an excerpt, never the whole copy
                assert rec.value() == value[:EXCERPT] and h[HEADER_TRUNCATED] == b"1"
            else:
                assert rec.value() == value and HEADER_TRUNCATED not in h
        assert seen == Counter(want.keys()), "duplicates or missing DLQ records"

        # 3. both apps classified alike: the same counts per reason, equal to the pure path's
        a_stats = analytics.get("/stats")
        assert Counter(a_stats["dlq_by_reason"]) == want_reasons
        assert Counter(p_stats["dlq_by_reason"]) == want_reasons
        assert a_stats["counters"]["dlq"] == p_stats["counters"]["dlq"] == len(want)

        # 4. the analytics rows are the good envelopes' events, one row per event, nothing from a bad message
        good_at = Counter({coords[i]: m.events for i, m in enumerate(stream) if m.reason is None})
        rows = sql(analytics, "SELECT kafka_partition AS p, kafka_offset AS o, count() AS n, any(node_id) AS node "
                              "FROM kv_events GROUP BY p, o")
        assert Counter({(r["p"], r["o"]): r["n"] for r in rows}) == good_at
        assert {r["node"] for r in rows} == set(held)

        # 5. the routing app applied every good envelope: each good node holds exactly its blocks
        nodes = {n["node_id"]: n for n in processor.get("/nodes?limit=10000")["nodes"]}
        assert set(nodes) == set(held), sorted(nodes)
        for node, hashes in held.items():
            assert nodes[node]["state"] == "healthy" and sum(nodes[node]["blocks"].values()) == len(hashes), nodes[node]

        # 6. both healthy: no agent error, no failed DLQ send, nothing skipped or missing in either
        p_stats = processor.get("/stats")
        for stats in (a_stats, p_stats):
            c = stats["counters"]
            assert c["agent_errors"] == 0 and c["offset_holes"] == 0 and c["messages"] == len(stream), c
        assert p_stats["counters"]["dlq_send_errors"] == 0 and a_stats["sink"]["errors"] == 0
        assert analytics.popen.poll() is None and processor.popen.poll() is None
        print(json.dumps({"messages": len(stream), "good": len(good_at), "bad_by_reason": dict(want_reasons),
                          "dlq_records": len(dlq), "analytics_dlq_by_reason": a_stats["dlq_by_reason"],
                          "processor_dlq_by_reason": p_stats["dlq_by_reason"],
                          "analytics_event_rows": sum(good_at.values())}))
    finally:
        session.close()
