"""Batched delivery without Kafka: `Ingest.handle_batch` equals `handle` one record at a time, and the
consumer's bookkeeping for a run (acks, gaps) is what Faust does for the same messages one by one."""
from __future__ import annotations

import asyncio
import random
import zlib
from collections import defaultdict
from types import SimpleNamespace

import msgspec

from faust.types import TP

from kvpipe.processors.core.batchdelivery import BatchDrainConsumer, ack_offsets, holes
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import DLQ, Ingest
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]


class Record(msgspec.Struct):
    """The fields of aiokafka's ConsumerRecord that the batch path reads."""
    partition: int
    offset: int
    value: bytes | None
    timestamp: int | None = None
    timestamp_type: int = 0
    headers: list = msgspec.field(default_factory=lambda: list(KAFKA_HEADERS))
    topic: str = "kv-events"
    key: bytes | None = None


def envelope(node: str, seq: int, events: list, ts: float, epoch: int = 1) -> bytes:
    return encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=ts, sent_ts=ts,
                                    group_specs=SPECS if seq == 0 else None, num_events=len(events),
                                    batch=msgspec.Raw(encode_vllm_batch(events, ts)) if events else msgspec.Raw()))


def stream(seed: int) -> list[Record]:
    """Two partitions of a few nodes storing and evicting, with a replayed envelope (duplicate), a
    skipped seq (gap), a stale epoch, undecodable bytes and records with the broker's timestamps."""
    rng = random.Random(seed)
    offsets = defaultdict(int)
    seqs = defaultdict(int)
    held = defaultdict(list)
    out = []
    h = 1
    for k in range(300):
        node = f"n{rng.randrange(5)}"
        p = zlib.crc32(node.encode()) % 2
        events = [BlockStored(block_hashes=[h, h + 1], parent_block_hash=None, token_ids=[], block_size=16,
                              lora_id=None, medium="GPU", lora_name=None, group_idx=0)]
        held[node] += [h, h + 1]
        h += 2
        if len(held[node]) > 6:
            events.append(BlockRemoved(block_hashes=held[node][:2], medium="GPU", group_idx=0))
            del held[node][:2]
        seq = seqs[node]
        if k == 100:
            seq += 1  # a gap: the node turns suspect
        seqs[node] = seq + 1
        value = envelope(node, seq, events, 1000.0 + k)
        if k == 150:
            value = b"\xc1"  # not msgpack: DLQ
        ts = int((1000.0 + k) * 1000)
        out.append(Record(p, offsets[p], value, ts, k % 2))
        offsets[p] += 1
        if k in (50, 200):  # a replay of the same bytes at a new offset: a duplicate
            out.append(Record(p, offsets[p], value, ts, 1))
            offsets[p] += 1
    return out


def one_at_a_time(records: list[Record]) -> Ingest:
    ingest = Ingest(Index(), 1 << 20, max_skew_s=5.0)
    for r in records:
        record_ts = r.timestamp / 1000.0 if r.timestamp_type == 1 else None
        ingest.handle(r.value, r.headers, r.partition, r.offset, 1200.0, record_ts)
    return ingest


def in_batches(records: list[Record], size: int) -> tuple[Ingest, list[float], int]:
    ingest = Ingest(Index(), 1 << 20, max_skew_s=5.0)
    published, dlq = [], 0
    for start in range(0, len(records), size):
        run = records[start:start + size]
        done = 0
        while done < len(run):
            batch = ingest.handle_batch(run[done:], clock=lambda: 1200.0)
            assert batch.failed is None
            published += batch.published
            done += batch.handled
            if batch.dlq is not None:
                dlq += 1
                assert batch.dlq.outcome == DLQ and run[done - 1].value == b"\xc1"
    return ingest, published, dlq


def state(ingest: Ingest) -> tuple:
    nodes = {n.node_id: (n.epoch, n.seq, n.suspect, {k: dict(s.blocks) for k, s in n.slots.items()})
             for n in ingest.index.nodes.values()}
    return nodes, dict(ingest.applied_offset), dict(ingest.stream_ts), ingest.counters, ingest.index.counters


def test_a_batch_applies_exactly_what_the_same_records_one_at_a_time_apply():
    records = stream(7)
    expected = state(one_at_a_time(records))
    for size in (1, 7, 64, len(records)):
        ingest, published, dlq = in_batches(records, size)
        assert state(ingest) == expected, size
        assert dlq == 1 and ingest.counters["dlq"] == 1
        assert len(published) == ingest.index.counters["envelopes"]
    counters = expected[4]
    assert counters["duplicates"] == 2 and counters["gaps"] == 2  # the skipped seq, and the one lost to the DLQ


def test_a_batch_stops_after_bad_input_so_its_dlq_copy_goes_before_later_records_apply():
    good = [Record(0, i, envelope("a", i, [], 10.0 + i)) for i in range(3)]
    records = good[:1] + [Record(0, 1, b"\xc1")] + [Record(0, 2 + i, r.value) for i, r in enumerate(good[1:])]
    ingest = Ingest(Index(), 1 << 20)
    batch = ingest.handle_batch(records, clock=lambda: 20.0)
    assert (batch.handled, batch.dlq.error.kind, ingest.applied_offset[0]) == (2, "not_msgpack", 1)
    assert batch.published == [10.0]
    rest = ingest.handle_batch(records[2:], clock=lambda: 20.0)
    assert (rest.handled, rest.dlq, ingest.applied_offset[0], ingest.index.nodes["a"].seq) == (2, None, 3, 2)


def test_a_failure_of_the_ingest_path_ends_the_batch_with_the_record_that_broke_it():
    ingest = Ingest(Index(), 1 << 20)

    def broken_apply(*args, **kwargs):
        raise KeyError("boom")

    ingest.index.apply = broken_apply
    batch = ingest.handle_batch([Record(0, 0, envelope("a", 0, [], 1.0)), Record(0, 1, envelope("a", 1, [], 2.0))])
    assert batch.handled == 1 and isinstance(batch.failed, KeyError) and ingest.applied_offset[0] == 0


def test_records_at_or_below_a_restored_snapshot_are_skipped_in_a_batch_too():
    ingest = Ingest(Index(), 1 << 20)
    ingest.applied_offset[3] = 4
    batch = ingest.handle_batch([Record(3, o, envelope("a", o, [], 1.0)) for o in range(3, 7)], clock=lambda: 2.0)
    assert batch.handled == 4 and ingest.counters["skipped_replayed"] == 2 and ingest.applied_offset[3] == 6
    assert ingest.index.nodes["a"].seq == 6


class FaustBooks:
    """The consumer fields Faust's `Consumer.ack` keeps (faust/transport/consumer.py)."""

    def __init__(self, committed=None) -> None:
        self._committed_offset = defaultdict(lambda: committed)
        self._acked = defaultdict(list)
        self._acked_index = defaultdict(set)
        self._n_acked = 0
        self._waiting_for_ack = None


def test_acking_a_run_records_each_new_offset_once_as_faust_does():
    books = FaustBooks()
    assert ack_offsets(books, "tp", [5, 6, 7]) == 3
    assert ack_offsets(books, "tp", [7, 8]) == 1  # 7 was acked already (a re-delivery after a seek)
    assert books._acked["tp"] == [5, 6, 7, 8] and books._acked_index["tp"] == {5, 6, 7, 8} and books._n_acked == 4
    below = FaustBooks(committed=10)
    assert ack_offsets(below, "tp", [8, 9, 10, 11]) == 2 and below._acked["tp"] == [10, 11]


def test_gaps_are_where_faust_would_record_them_one_message_at_a_time():
    assert holes([5, 6, 7], 4) == []
    assert holes([5, 6, 7], None) == [] and holes([5, 6], 0) == []  # nothing read yet / after a seek to 0
    assert holes([8, 9, 12, 13, 20], 5) == [(6, 8), (10, 12), (14, 20)]


class StubConsumer:
    """The state `BatchDrainConsumer`'s delivery reads and writes, with its delivery methods."""

    _deliver_fetch = BatchDrainConsumer._deliver_fetch
    _deliver_run = BatchDrainConsumer._deliver_run
    _still_current = BatchDrainConsumer._still_current
    max_run = BatchDrainConsumer.max_run

    def __init__(self, handler) -> None:
        self.batch_handlers = {"kv-events": handler}
        self.batch_stats = {"batches": 0, "batched": 0, "dropped_in_rebalance": 0}
        self._read_offset = defaultdict(lambda: None)
        self._committed_offset = defaultdict(lambda: None)
        self._acked, self._acked_index = defaultdict(list), defaultdict(set)
        self._n_acked, self._commit_every, self._waiting_for_ack = 0, None, None
        self._buffered_partitions: set = set()
        self.gaps: list = []
        self.flow_active = True
        self.suspend_flow = asyncio.Event()
        self.app = SimpleNamespace(consumer_generation_id=1, flow_control=SimpleNamespace(is_active=lambda: True),
                                   topics=SimpleNamespace(acks_enabled_for=lambda topic: True),
                                   monitor=SimpleNamespace(track_tp_end_offset=lambda tp, offset: None,
                                                           stream_inbound_time={}))

    def highwater(self, tp) -> int:
        return 0

    async def _add_gap(self, tp, first: int, last: int) -> None:
        self.gaps.append((tp, first, last))


TP0, TP1 = TP("kv-events", 0), TP("kv-events", 1)


def records(partition: int, offsets) -> list[Record]:
    return [Record(partition, o, b"") for o in offsets]


def test_a_fetch_goes_to_the_handler_one_partition_run_at_a_time_and_is_acked_and_read_past():
    got = []

    async def handler(recs, still_current):
        got.append([(r.partition, r.offset) for r in recs])
        return len(recs)

    c = StubConsumer(handler)
    c._read_offset[TP1] = 7  # after a seek: 7 is next, 5 and 6 were delivered before
    asyncio.run(c._deliver_fetch({TP0: records(0, [0, 1, 2, 4]), TP1: records(1, [5, 6, 7, 8])}, None))
    assert got == [[(0, 0), (0, 1), (0, 2), (0, 4)], [(1, 7), (1, 8)]]
    assert c._acked == {TP0: [0, 1, 2, 4], TP1: [7, 8]} and (c._read_offset[TP0], c._read_offset[TP1]) == (4, 8)
    assert c.gaps == [(TP0, 3, 4)] and c.batch_stats == {"batches": 2, "batched": 6, "dropped_in_rebalance": 0}
    assert set(c.app.monitor.stream_inbound_time) == {TP0, TP1}  # Faust's livelock check sees the streams move


def test_a_long_run_goes_in_slices_with_the_loop_yielded_between_them():
    sizes = []

    async def handler(recs, still_current):
        sizes.append((len(recs), recs[0].offset))
        return len(recs)

    c = StubConsumer(handler)
    asyncio.run(c._deliver_fetch({TP0: records(0, range(600))}, None))
    assert sizes == [(256, 0), (256, 256), (88, 512)] and c._read_offset[TP0] == 599
    assert c._acked[TP0] == list(range(600)) and c.batch_stats["batches"] == 1


def test_a_rebalance_during_a_run_leaves_the_rest_unacked_for_the_refetch():
    async def handler(recs, still_current):
        c.app.consumer_generation_id = 2  # a rebalance began while a DLQ copy was sent after record 2
        assert not still_current()
        return 2

    c = StubConsumer(handler)
    asyncio.run(c._deliver_fetch({TP0: records(0, range(5)), TP1: records(1, range(3))}, None))
    assert c._acked == {} and c._read_offset[TP0] is None and c._n_acked == 0
    assert c.batch_stats == {"batches": 0, "batched": 0, "dropped_in_rebalance": 3 + 3}


def test_records_fetched_before_a_rebalance_began_are_not_delivered():
    async def handler(recs, still_current):
        raise AssertionError("delivered during a rebalance")

    for begin in ("suspended", "flow_control", "generation"):
        c = StubConsumer(handler)
        if begin == "suspended":
            c.suspend_flow.set()
        elif begin == "flow_control":
            c.app.flow_control = SimpleNamespace(is_active=lambda: False)
        asyncio.run(deliver_after_rebalance_began(c, begin))
        assert c.batch_stats["dropped_in_rebalance"] == 4 and c._acked == {}


async def deliver_after_rebalance_began(c: StubConsumer, begin: str) -> None:
    generation = c.app.consumer_generation_id
    if begin == "generation":  # the records came from the previous generation's fetch
        c.app.consumer_generation_id = generation + 1
        await StubConsumer._deliver_run(c, TP0, records(0, range(4)), c.batch_handlers["kv-events"],
                                        c._still_current(generation))
    else:
        await c._deliver_fetch({TP0: records(0, range(4))}, None)
