"""Batched delivery on the real broker: `kvpipe processor` (processor_delivery = "batch") over a backlog
of three partitions, then a stream published while it runs with a snapshot every 0.3 s.

The test's reference is `Ingest.handle` one record at a time in this process, over the records read
back from the topic (with the broker's timestamps). Every snapshot the worker wrote — mid-stream ones
included — must hold exactly the reference's slice of its partition after the records up to the
offset its manifest claims: not one record more or less, in offset order, each once. A duplicate, a
seq gap and undecodable bytes in the backlog are handled as one at a time: the duplicate skipped, the
node suspect, a DLQ copy with the source offset.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION, Ingest
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.processors.core.snapshot import decode_chunk, decode_manifest, export_partition, parse_key
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored
from kvpipe.schemas.settings import load_settings
from tests.integration.kafka_reading import client_config
from tests.integration.processor_fixture import ProcessorTopics

pytestmark = pytest.mark.integration

PARTITIONS = 3
NODES = 9
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]


class Fleet:
    """Nodes that store blocks and evict their oldest ones, one envelope per step."""

    def __init__(self, producer: Producer, topic: str) -> None:
        self.producer, self.topic = producer, topic
        self.seqs: dict[str, int] = defaultdict(int)
        self.held: dict[str, list[tuple[int, int]]] = defaultdict(list)
        self.next_hash = 1
        self.sent: dict[str, bytes] = {}

    def envelope(self, node: str, seq: int) -> bytes:
        events: list = []
        for g in (0, 1):
            events.append(BlockStored(block_hashes=[self.next_hash, self.next_hash + 1], parent_block_hash=None,
                                      token_ids=[], block_size=16, lora_id=None, medium="GPU", lora_name=None,
                                      group_idx=g))
            self.held[node] += [(self.next_hash, g), (self.next_hash + 1, g)]
            self.next_hash += 2
        if len(self.held[node]) > 12:
            (h1, g1), (h2, g2) = self.held[node][:2]
            del self.held[node][:2]
            events += [BlockRemoved(block_hashes=[h1], medium="GPU", group_idx=g1),
                       BlockRemoved(block_hashes=[h2], medium="GPU", group_idx=g2)]
        ts = time.time()
        return encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=ts, sent_ts=ts,
                                        group_specs=SPECS if seq == 0 else None, num_events=len(events),
                                        batch=msgspec.Raw(encode_vllm_batch(events, ts))))

    def send(self, node: str, value: bytes) -> None:
        self.producer.produce(self.topic, key=node.encode(), value=value, headers=KAFKA_HEADERS)

    def step(self, node: str, skip: int = 0) -> None:
        """The node's next envelope; `skip` seqs left out first (a gap)."""
        seq = self.seqs[node] + skip
        self.seqs[node] = seq + 1
        self.sent[node] = self.envelope(node, seq)
        self.send(node, self.sent[node])

    def round(self) -> None:
        for i in range(NODES):
            self.producer.poll(0)
            self.step(f"node-{i}")


def read_all(bootstrap: str, topic: str, ends: dict[int, int]) -> dict[int, list]:
    """Every record of `topic` below `ends` (partition → end offset), per partition in offset order."""
    consumer = Consumer(client_config(bootstrap, **{"group.id": f"reader-{topic}", "enable.auto.commit": False}))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
    out: dict[int, list] = {p: [] for p in ends}

    def done(p: int) -> bool:
        return ends[p] == 0 or bool(out[p]) and out[p][-1].offset() >= ends[p] - 1

    deadline = time.monotonic() + 30
    try:
        while not all(map(done, ends)) and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None and msg.offset() < ends[msg.partition()]:
                out[msg.partition()].append(msg)
    finally:
        consumer.close()
    assert all(map(done, ends)), f"read {[len(v) for v in out.values()]} records of {ends} from {topic}"
    return out


def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer(client_config(bootstrap, **{"group.id": "unused"}))
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        consumer.close()


def snapshots(records: list) -> list[tuple]:
    """`(manifest, chunks)` of every generation one snapshot partition's log holds, oldest first
    (a generation's chunks are read before the tombstones that follow its successor)."""
    chunks: dict[tuple[int, int], bytes] = {}
    out = []
    for msg in records:
        _, gen, idx = parse_key(msg.key())
        if gen is not None:
            if msg.value() is not None:
                chunks[(gen, idx)] = msg.value()
        elif msg.value() is not None:
            manifest = decode_manifest(msg.value())
            out.append((manifest, [decode_chunk(chunks[(manifest.gen, i)]) for i in range(manifest.chunks)]))
    return out


def reference(records: list, upto: int, settings) -> Ingest:
    """`Ingest.handle` one record at a time over a partition's records up to offset `upto`."""
    ingest = Ingest(Index(ttl_s=settings.node_ttl_s, retention_s=settings.node_retention_s,
                          max_nodes=settings.max_nodes, max_blocks_per_slot=settings.max_blocks_per_slot,
                          max_slots_per_node=settings.max_slots_per_node), settings.max_message_bytes,
                    settings.max_clock_skew_s)
    for msg in records[:upto + 1]:
        kind, ts_ms = msg.timestamp()
        assert kind == 2, "the events topic appends with the broker's clock (LogAppendTime)"
        ingest.handle(msg.value(), msg.headers(), msg.partition(), msg.offset(), time.time(), ts_ms / 1000.0)
    return ingest


def nodes_of(chunks: list) -> dict:
    """node id → its snapshot record with the slots in a canonical order."""
    out = {}
    for chunk in chunks:
        for snap in chunk.nodes:
            slots = sorted((s.group, s.medium, sorted(zip(s.hashes, s.stored_ts)), s.dups) for s in snap.slots)
            out[snap.node_id] = (msgspec.structs.replace(snap, slots=[]), slots)
    return out


def check_every_snapshot(bootstrap: str, topics: ProcessorTopics, events: dict[int, list], ends: dict[int, int]) -> int:
    """Every generation in the snapshot topic equals the reference after exactly the records up to the
    offset its manifest claims; the last covers the end. Returns how many were taken mid-stream."""
    settings = load_settings()
    snap_records = read_all(bootstrap, topics.snapshots, end_offsets(bootstrap, topics.snapshots, len(ends)))
    mid_stream = 0
    for p in ends:
        generations = snapshots(snap_records[p])
        assert generations and generations[-1][0].offset == ends[p] - 1, "the last snapshot covers the end"
        for manifest, chunks in generations:
            assert (manifest.partition, manifest.source_topic) == (p, topics.events)
            ingest = reference(events[p], manifest.offset, settings)
            expected = [decode_chunk(c) for c in export_partition(ingest.index, p, manifest.gen)[0]]
            assert nodes_of(chunks) == nodes_of(expected), f"partition {p} snapshot at offset {manifest.offset}"
            assert manifest.stream_ts == ingest.stream_ts.get(p, 0.0)
            mid_stream += manifest.offset < ends[p] - 1
    return mid_stream


def test_batches_apply_each_message_once_in_order_and_every_snapshot_covers_exactly_its_offset(
        kafka_bootstrap: str, tmp_path: Path) -> None:
    topics = ProcessorTopics(kafka_bootstrap, "batch", PARTITIONS)
    producer = Producer(client_config(kafka_bootstrap, **{"enable.idempotence": True}))
    fleet = Fleet(producer, topics.events)
    env = topics.env(f"kvpipe-batch-{topics.tag}", free_port(), str(tmp_path / "state"),
                     KVPIPE_PROCESSOR_DELIVERY="batch", KVPIPE_SNAPSHOT_EVERY_S="0.3", KVPIPE_NODE_TTL_S="3600",
                     KVPIPE_FETCH_MIN_BYTES="4096", KVPIPE_FETCH_MAX_WAIT_MS="7")
    proc = ProcessorProcess(env, tmp_path / "processor.log")
    try:
        # The backlog, there before the worker starts: long runs per partition.
        for _ in range(30):
            fleet.round()
        fleet.send("node-1", fleet.sent["node-1"])  # a replay: the duplicate is skipped
        fleet.step("node-2", skip=2)  # two envelopes never arrive: node-2 turns suspect
        fleet.send("node-3", b"\xc1not an envelope")  # undecodable: a DLQ copy, the rest flows on
        for _ in range(30):
            fleet.round()
        producer.flush(30)
        backlog = topics.end_offsets()
        proc.start()
        deliveries = proc.wait_offsets(backlog, timeout=90)["cluster"]["deliveries"]
        assert deliveries["batches"] < sum(backlog.values()) / 10, f"the backlog goes in runs, not one by one: {deliveries}"
        # the running client's fetches follow the load with the settings' sizing: the backlog came in fetches
        # with records; the next fetch is either full-sized (4096 bytes or 7 ms) or Faust's (first byte)
        assert deliveries["fetches_with_records"] > 0, deliveries
        assert (deliveries["fetch_min_bytes"], deliveries["fetch_max_wait_ms"]) in ((4096, 7), (1, 1500))
        # Then a stream while the worker runs and snapshots every 0.3 s.
        for _ in range(25):
            fleet.round()
            producer.flush(30)
            time.sleep(0.08)
        ends = topics.end_offsets()
        stats = proc.wait_offsets(ends, timeout=90)
        total = sum(ends.values())
        assert min(ends.values()) > 50, f"every partition carries a share of the nodes: {ends}"

        counters, deliveries = stats["counters"], stats["cluster"]["deliveries"]
        time.sleep(0.5)  # nothing more is published: a fetch comes back empty, and the next waits for a first byte
        deliveries = proc.get("/stats")["cluster"]["deliveries"]
        assert deliveries["fetches_empty"] > 0 and (deliveries["fetch_min_bytes"], deliveries["fetch_max_wait_ms"]) \
            == (1, 1500), deliveries
        assert (counters["messages"], counters["skipped_replayed"], counters["offset_holes"]) == (total, 0, 0)
        assert (counters["duplicates"], counters["gaps"], counters["dlq"], counters["agent_errors"]) == (1, 1, 1, 0)
        assert deliveries["batched"] == total and deliveries["direct"] == 0 and deliveries["dropped_in_rebalance"] == 0
        nodes = {n["node_id"]: n for n in proc.get("/nodes")["nodes"]}
        assert nodes["node-2"]["suspect"] and "expected seq 30, got 32" in nodes["node-2"]["suspect_reason"]
        assert not any(n["suspect"] for name, n in nodes.items() if name != "node-2")
        proc.stop()  # the shutdown snapshot covers every partition's end
    finally:
        proc.kill()

    try:
        events = read_all(kafka_bootstrap, topics.events, ends)
        assert all([m.offset() for m in events[p]] == list(range(ends[p])) for p in ends)
        mid_stream = check_every_snapshot(kafka_bootstrap, topics, events, ends)
        assert mid_stream > 0, "some snapshot was taken while records were still arriving"

        consumer = Consumer(client_config(kafka_bootstrap, **{"group.id": f"dlq-{topics.tag}"}))
        consumer.assign([TopicPartition(topics.dlq, 0, OFFSET_BEGINNING)])
        try:
            deadline, dlq = time.monotonic() + 20, None
            while dlq is None and time.monotonic() < deadline:
                msg = consumer.poll(0.2)
                dlq = msg if msg is not None and msg.error() is None else None
        finally:
            consumer.close()
        assert dlq is not None and dlq.value() == b"\xc1not an envelope"
        headers = dict(dlq.headers())
        source = (int(headers[HEADER_SOURCE_PARTITION]), int(headers[HEADER_SOURCE_OFFSET]))
        assert events[source[0]][source[1]].value() == b"\xc1not an envelope"
    finally:
        topics.delete()


def test_a_rebalance_while_records_flow_loses_and_repeats_nothing(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Worker B joins while worker A delivers a backlog and then a stream in runs: A drops what it
    fetched for the partitions it hands over and snapshots them at revocation; B restores and goes
    on from there. Every snapshot (A's at revocation, each one's at its stop) equals the reference
    at its offset, and neither worker saw a duplicate, a gap or an offset hole."""
    topics = ProcessorTopics(kafka_bootstrap, "batchreb", 4)
    producer = Producer(client_config(kafka_bootstrap, **{"enable.idempotence": True, "linger.ms": 5}))
    fleet = Fleet(producer, topics.events)
    workers: list[ProcessorProcess] = []
    stop = threading.Event()

    def worker(name: str) -> ProcessorProcess:
        env = topics.env(f"kvpipe-batchreb-{topics.tag}", free_port(), str(tmp_path / name),
                         KVPIPE_PROCESSOR_DELIVERY="batch", KVPIPE_SNAPSHOT_EVERY_S="3600", KVPIPE_NODE_TTL_S="3600")
        workers.append(ProcessorProcess(env, tmp_path / f"{name}.log"))
        return workers[-1]

    def stream() -> None:
        while not stop.is_set():
            fleet.round()
            time.sleep(0.004)

    publisher = threading.Thread(target=stream, daemon=True)
    try:
        for _ in range(300):
            fleet.round()
        producer.flush(60)
        a = worker("a").start()
        publisher.start()
        b = worker("b").start(timeout=120)  # the group rebalances while A works
        deadline = time.monotonic() + 60
        while not b.get("/stats")["cluster"]["owned_partitions"] and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        stop.set()
        publisher.join(30)
        producer.flush(60)
        ends = topics.end_offsets()
        counters = {}
        for w in (a, b):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                stats = w.get("/stats")
                owned = stats["cluster"]["owned_partitions"]
                if owned and all(stats["freshness"].get(str(p), {}).get("offset", -1) >= ends[p] - 1 for p in owned):
                    break
                time.sleep(0.1)
            counters[w.url] = stats["counters"]
            print(w.url, owned, stats["cluster"]["deliveries"])
        assert sorted(p for w in (a, b) for p in w.get("/stats")["cluster"]["owned_partitions"]) == [0, 1, 2, 3]
        for c in counters.values():
            assert (c["duplicates"], c["gaps"], c["offset_holes"], c["dlq"]) == (0, 0, 0, 0), c
        b.stop()  # its last snapshot; A takes every partition back, restores, snapshots at its stop
        a.wait_offsets(ends, timeout=120)
        a.stop()
    finally:
        stop.set()
        for w in workers:
            w.kill()
    try:
        events = read_all(kafka_bootstrap, topics.events, ends)
        check_every_snapshot(kafka_bootstrap, topics, events, ends)
    finally:
        topics.delete()
