"""One DLQ record per bad message across kill -9 of the routing app (RELIABILITY.md section 13).

A restart after SIGKILL restores the last snapshot and replays the events past it; the bad messages in
that tail reach `send_to_dlq` again. Their records are already in the DLQ, and the restore read them back
(processors/routing/dlqtail.py), so the replay writes none twice. Real broker, `kvpipe processor` as a child
process, the DLQ topic with 3 partitions (a record's DLQ partition follows its key, not its events
partition), the across-apps test's messages: good nodes' envelopes among bad messages of every reason.

The story (one test, phases in order; the stream is cut in four consecutive parts A-D):
1. A fresh worker handles A, every DLQ record acknowledged; no snapshot is ever written (snapshots every
   hour). SIGKILL.
2. The restart finds no snapshot and replays A from offset 0: every bad message of A meets its record and
   is skipped. B is handled, then a graceful stop: the shutdown snapshot covers A and B.
3. A restart restores it (nothing replayed); C is handled and the worker SIGKILLed as soon as its offsets
   are handled, the DLQ sends perhaps still in flight: a record may or may not have reached the DLQ.
4. The restart restores the A+B snapshot, replays C and skips exactly the records the DLQ held after the
   kill. D, published after it, gets its records written as usual.
After each restart: the DLQ holds one record per bad message so far (by source partition and offset), with
the pure path's reason; the good nodes hold exactly their blocks; nothing failed, nothing skipped a hole.
"""
from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from kvpipe.bench.fuzz import MAX_BYTES
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import (HEADER_DLQ_REASON, HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION,
                                           HEADER_SOURCE_TOPIC, Ingest)
from kvpipe.schemas.codec import ERROR_KINDS
from tests.integration.kafka_reading import client_config
from tests.integration.test_dlq_across_apps import Message, good_stream, hostile_messages, publish

pytestmark = pytest.mark.integration

EVENTS_PARTITIONS, DLQ_PARTITIONS = 2, 3


class Topics:
    def __init__(self, unique_topic, events_partitions: int = EVENTS_PARTITIONS) -> None:
        self.partitions = events_partitions
        self.events = unique_topic("dlqkill-ev", events_partitions, {"message.timestamp.type": "LogAppendTime"})
        self.dlq = unique_topic("dlqkill-dlq", DLQ_PARTITIONS)
        self.snapshots = unique_topic("dlqkill-snap", events_partitions, {"cleanup.policy": "compact"})

    def end_offsets(self, bootstrap: str) -> dict[int, int]:
        consumer = Consumer(client_config(bootstrap, **{"group.id": "unused"}))
        try:
            return {p: consumer.get_watermark_offsets(TopicPartition(self.events, p), timeout=10)[1]
                    for p in range(self.partitions)}
        finally:
            consumer.close()


def worker_env(bootstrap: str, topics: Topics, processor_id: str, state: Path) -> dict[str, str]:
    """A routing worker on these topics that never snapshots on its own (snapshots every hour)."""
    return {"KVPIPE_KAFKA_BOOTSTRAP": bootstrap, "KVPIPE_EVENTS_TOPIC": topics.events,
            "KVPIPE_DLQ_TOPIC": topics.dlq, "KVPIPE_SNAPSHOT_TOPIC": topics.snapshots,
            "KVPIPE_PARTITIONS": str(topics.partitions), "KVPIPE_PROCESSOR_ID": processor_id,
            "KVPIPE_WEB_PORT": str(free_port()), "KVPIPE_STATE_DIR": str(state),
            "KVPIPE_NODE_TTL_S": "3600", "KVPIPE_SNAPSHOT_EVERY_S": "3600", "KVPIPE_MAX_MESSAGE_BYTES": str(MAX_BYTES)}


def wait_owned(workers: list[ProcessorProcess], partitions: int, timeout: float = 90.0) -> list[set[int]]:
    """Each worker's partitions (restored and assigned) once each owns some and together they own every one,
    each exactly once."""
    deadline = time.monotonic() + timeout
    owned: list[set[int]] = []
    while time.monotonic() < deadline:
        owned = [set(w.get("/stats")["cluster"]["owned_partitions"]) for w in workers]
        if all(owned) and sorted(p for o in owned for p in o) == list(range(partitions)):
            return owned
        time.sleep(0.1)
    raise TimeoutError(f"partitions not settled between the workers: {owned}")


def dlq_records(bootstrap: str, topic: str, timeout: float = 30.0) -> list[tuple[int, dict[str, bytes]]]:
    """(DLQ partition, headers) of every record of every partition, up to each one's end offset now."""
    consumer = Consumer(client_config(bootstrap, **{"group.id": "unused", "enable.auto.commit": False}))
    try:
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in range(DLQ_PARTITIONS)}
        consumer.assign([TopicPartition(topic, p, 0) for p in range(DLQ_PARTITIONS)])
        out: list[tuple[int, dict[str, bytes]]] = []
        deadline = time.monotonic() + timeout
        while len(out) < sum(ends.values()) and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None and msg.offset() < ends[msg.partition()]:
                out.append((msg.partition(), dict(msg.headers() or [])))
        assert len(out) == sum(ends.values()), f"read {len(out)} of the DLQ's {sum(ends.values())} records"
        return out
    finally:
        consumer.close()


def sources(records: list[tuple[int, dict[str, bytes]]], events: str) -> Counter:
    """How many DLQ records there are per source (events partition, offset)."""
    seen: Counter = Counter()
    for _, h in records:
        assert h[HEADER_SOURCE_TOPIC] == events.encode()
        seen[(int(h[HEADER_SOURCE_PARTITION]), int(h[HEADER_SOURCE_OFFSET]))] += 1
    return seen


def settled(proc: ProcessorProcess, ends: dict[int, int], timeout: float = 60.0) -> dict:
    """/stats once the worker handled everything up to `ends` and every DLQ send it started was acknowledged,
    failed or skipped as already written (sends are not awaited one by one)."""
    stats = proc.wait_offsets(ends, timeout)
    deadline = time.monotonic() + timeout
    while True:
        c = stats["counters"]
        if c["dlq_sent"] + c["dlq_send_errors"] + c["dlq_already_written"] == c["dlq"] + c["agent_errors"]:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"DLQ sends not settled: {c}")
        time.sleep(0.05)
        stats = proc.get("/stats")


def restored(proc: ProcessorProcess, ends: dict[int, int], timeout: float = 60.0) -> dict:
    """/stats once the worker is at `ends` and its restore read the DLQ back (a restore with nothing to
    replay shows its offsets before that read is over; the consumer starts only after it)."""
    stats = proc.wait_offsets(ends, timeout)
    deadline = time.monotonic() + timeout
    while stats["dlq_readback"]["reads"] + stats["dlq_readback"]["errors"] == 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no DLQ read back: {stats['dlq_readback']}")
        time.sleep(0.05)
        stats = proc.get("/stats")
    return stats


def test_a_crash_replay_writes_no_dlq_record_twice(kafka_bootstrap: str, unique_topic, tmp_path: Path) -> None:
    rng = random.Random(186)
    now = time.time()
    pure = Ingest(Index(ttl_s=3600.0), MAX_BYTES, 10.0)
    good, held = good_stream(rng, now, pure)
    hostile = hostile_messages(rng, now, pure)
    slots = sorted(rng.randrange(len(good) + 1) for _ in hostile)
    stream: list[Message] = []
    for i, m in enumerate(good):
        stream.extend(h for h, at in zip(hostile, slots) if at == i)
        stream.append(m)
    stream.extend(h for h, at in zip(hostile, slots) if at == len(good))
    cut = [0, len(stream) // 4, len(stream) // 2, 3 * len(stream) // 4, len(stream)]
    parts = [stream[cut[i]:cut[i + 1]] for i in range(4)]
    assert all(any(m.reason for m in part) for part in parts), "bad messages in every part"

    topics = Topics(unique_topic)
    env = worker_env(kafka_bootstrap, topics, f"kvpipe-dlqkill-{topics.events[-12:]}", tmp_path / "state")
    bad: dict[tuple[int, int], str] = {}  # source (partition, offset) → the pure path's reason
    ends = {p: 0 for p in range(EVENTS_PARTITIONS)}
    procs: list[ProcessorProcess] = []
    figures: dict[str, object] = {}

    def start() -> ProcessorProcess:
        proc = ProcessorProcess(env, tmp_path / "processor.log").start(timeout=90)
        procs.append(proc)
        return proc

    def send(part: list[Message]) -> tuple[dict[int, int], set[tuple[int, int]]]:
        coords = publish(kafka_bootstrap, topics.events, [(m.key, m.value, m.headers) for m in part])
        mine = {at: m.reason for at, m in zip(coords, part) if m.reason is not None}
        bad.update(mine)
        for p, o in coords:
            ends[p] = max(ends[p], o + 1)
        return dict(ends), set(mine)

    def assert_one_record_per_bad_message() -> list[tuple[int, dict[str, bytes]]]:
        records = dlq_records(kafka_bootstrap, topics.dlq)
        seen = sources(records, topics.events)
        assert seen == Counter(bad.keys()), (
            f"{len(records)} DLQ records for {len(bad)} bad messages; twice: "
            f"{sorted(k for k, n in seen.items() if n > 1)}; missing: {sorted(set(bad) - set(seen))}")
        for _, h in records:
            at = (int(h[HEADER_SOURCE_PARTITION]), int(h[HEADER_SOURCE_OFFSET]))
            assert h[HEADER_DLQ_REASON].split(b":")[0].decode() == bad[at], (at, h[HEADER_DLQ_REASON][:200])
        return records

    def assert_healthy(stats: dict) -> None:
        c = stats["counters"]
        assert c["agent_errors"] == c["offset_holes"] == c["dlq_send_errors"] == 0, c
        assert stats["dlq_readback"]["errors"] == 0, stats["dlq_readback"]

    try:
        # -- 1. A handled by a worker that never snapshots; every record acknowledged; SIGKILL ----------
        proc = start()
        end_a, bad_a = send(parts[0])
        stats = settled(proc, end_a)
        assert stats["durability"]["snapshots"] == 0 and stats["counters"]["dlq_sent"] == len(bad_a)
        assert_one_record_per_bad_message()
        proc.kill()

        # -- 2. no snapshot: A replayed from offset 0, every record of A already there ------------------
        proc = start()
        stats = settled(proc, end_a)
        records = assert_one_record_per_bad_message()
        assert len({dlq_p for dlq_p, _ in records}) > 1, "records in more than one DLQ partition"
        assert [r["offset"] for r in stats["durability"]["restores"]] == [-1] * EVENTS_PARTITIONS
        c = stats["counters"]
        assert c["messages"] == len(parts[0]), "A replayed whole"
        assert (c["dlq_already_written"], c["dlq_sent"]) == (len(bad_a), 0)
        assert stats["dlq_readback"]["last"]["found"] == len(bad_a)
        assert Counter(stats["dlq_by_reason"]) == Counter(bad[at] for at in bad_a), "classified again, counted"
        assert_healthy(stats)
        figures["readback_no_snapshot"] = stats["dlq_readback"]["last"]

        end_b, bad_b = send(parts[1])
        stats = settled(proc, end_b)
        assert stats["counters"]["dlq_sent"] == len(bad_b)
        proc.stop()  # SIGTERM: the shutdown snapshot covers A and B

        # -- 3. restored from it; C handled, SIGKILL at once (sends maybe in flight) -------------------
        proc = start()
        stats = restored(proc, end_b)
        assert stats["counters"]["messages"] == 0, "restored from the shutdown snapshot: nothing replayed"
        assert stats["dlq_readback"]["last"]["found"] == 0
        end_c, bad_c = send(parts[2])
        proc.wait_offsets(end_c)
        proc.kill()
        there = set(sources(dlq_records(kafka_bootstrap, topics.dlq), topics.events))
        assert there <= set(bad) and bad_a | bad_b <= there

        # -- 4. restored from the A+B snapshot, C replayed: what was there is skipped, the rest written --
        proc = start()
        stats = settled(proc, end_c)
        assert_one_record_per_bad_message()
        assert sorted((r["partition"], r["offset"]) for r in stats["durability"]["restores"]) == \
            [(p, end_b[p] - 1) for p in range(EVENTS_PARTITIONS)], "restored from the shutdown snapshot"
        c = stats["counters"]
        assert c["messages"] == len(parts[2]), "C replayed, nothing before it"
        # what the restore found: C's records in the DLQ after the kill (a request the broker had received
        # whole may land just after `there` was read, hence at least those)
        found = stats["dlq_readback"]["last"]["found"]
        assert len(bad_c & there) <= found <= len(bad_c)
        assert c["dlq_already_written"] == found and c["dlq_sent"] == len(bad_c) - found
        assert_healthy(stats)
        figures["readback_snapshot"] = stats["dlq_readback"]["last"]
        figures["c_records_there_at_kill"] = f"{found} of {len(bad_c)}"

        # D, after the restart: new bad messages get their records
        end_d, bad_d = send(parts[3])
        stats = settled(proc, end_d)
        assert stats["counters"]["dlq_sent"] == len(bad_c) - found + len(bad_d)
        assert stats["dlq_readback"]["pending"] == 0, "the replay met every record read back"
        assert_healthy(stats)
        assert_one_record_per_bad_message()
        assert set(bad.values()) == set(ERROR_KINDS)

        # nothing good lost: every good node holds exactly its blocks, healthy
        nodes = {n["node_id"]: n for n in proc.get("/nodes?limit=10000")["nodes"]}
        for node, hashes in held.items():
            assert nodes[node]["state"] == "healthy" and sum(nodes[node]["blocks"].values()) == len(hashes), nodes[node]
        metrics = proc.get("/metrics")
        assert f"kvpipe_processor_dlq_already_written_total {float(found)}" in metrics
        assert proc.popen.poll() is None
        print(json.dumps({"messages": len(stream), "bad": len(bad), **figures}))
    finally:
        for p in procs:
            p.stop()


def test_a_surviving_worker_that_takes_over_a_killed_workers_partitions_writes_no_record_twice(
        kafka_bootstrap: str, unique_topic, tmp_path: Path) -> None:
    """Two workers of one group share 4 events partitions; each writes the records of its own partitions'
    bad messages. One is SIGKILLed; the survivor restores its partitions (no snapshot: from offset 0) and
    replays them: it skips exactly the dead worker's records, its own partitions replay nothing."""
    rng = random.Random(187)
    now = time.time()
    pure = Ingest(Index(ttl_s=3600.0), MAX_BYTES, 10.0)
    good, held = good_stream(rng, now, pure)
    stream = good + hostile_messages(rng, now, pure)
    topics = Topics(unique_topic, events_partitions=4)
    group = f"kvpipe-dlqkill2-{topics.events[-12:]}"
    workers = [ProcessorProcess(worker_env(kafka_bootstrap, topics, group, tmp_path / f"state-{name}"),
                                tmp_path / f"worker-{name}.log") for name in "ab"]
    try:
        for w in workers:
            w.start(timeout=90)
        owned = wait_owned(workers, 4)
        coords = publish(kafka_bootstrap, topics.events, [(m.key, m.value, m.headers) for m in stream])
        bad = {at: m.reason for at, m in zip(coords, stream) if m.reason is not None}
        ends = topics.end_offsets(kafka_bootstrap)
        for w, mine in zip(workers, owned):
            stats = settled(w, {p: ends[p] for p in mine})
            assert stats["counters"]["dlq_sent"] == sum(1 for p, _ in bad if p in mine)
        dead, survivor = workers
        dead_bad = {at for at in bad if at[0] in owned[0]}
        assert dead_bad and len(dead_bad) < len(bad), "both workers wrote records"
        dead.kill()

        assert wait_owned([survivor], 4) == [set(range(4))]
        stats = settled(survivor, ends)
        records = dlq_records(kafka_bootstrap, topics.dlq)
        seen = sources(records, topics.events)
        assert seen == Counter(bad.keys()), (
            f"{len(records)} DLQ records for {len(bad)} bad messages; twice: "
            f"{sorted(k for k, n in seen.items() if n > 1)}; missing: {sorted(set(bad) - set(seen))}")
        c = stats["counters"]
        assert c["dlq_already_written"] == len(dead_bad), "the dead worker's records, each skipped once"
        assert c["dlq_sent"] == len(bad) - len(dead_bad), "the survivor's own records, written before the kill"
        assert c["agent_errors"] == c["offset_holes"] == c["dlq_send_errors"] == 0, c
        assert stats["dlq_readback"]["errors"] == 0 and stats["dlq_readback"]["pending"] == 0
        nodes = {n["node_id"]: n for n in survivor.get("/nodes?limit=10000")["nodes"]}
        for node, hashes in held.items():
            assert nodes[node]["state"] == "healthy" and sum(nodes[node]["blocks"].values()) == len(hashes), nodes[node]
        print(json.dumps({"bad": len(bad), "dead_worker_records": len(dead_bad),
                          "readback": stats["dlq_readback"]["last"]}))
    finally:
        for w in workers:
            w.stop()
