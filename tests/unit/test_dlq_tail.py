"""The routing app's DLQ read-back at restore (processors/routing/dlqtail.py), without Kafka: which records
count as already written, where the read starts, what the replay skips, and that a restore does not return
before the read is done. The real kill -9 is tests/fault/test_dlq_after_kill.py."""
from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

import pytest

from kvpipe.processors.core import durability
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest, dlq_headers
from kvpipe.processors.routing import dlqtail
from kvpipe.processors.routing.dlqtail import AlreadyWritten, RoutingDurability, read_start, snapshot_time, source_of
from kvpipe.schemas.codec import DecodeError

EVENTS = "kv-events"


def headers(topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    return dlq_headers(DecodeError("not_msgpack", "x"), topic, partition, offset)


def test_a_record_names_its_source_through_the_headers_the_dlq_writer_sets():
    assert source_of(headers(EVENTS, 3, 41), EVENTS) == (3, 41)
    assert source_of(headers("other-topic", 3, 41), EVENTS) is None, "another topic's record is not ours"
    assert source_of(headers(EVENTS, 3, 41)[:3], EVENTS) is None, "no offset header"
    assert source_of([(k, b"x" if k.endswith("offset") else v) for k, v in headers(EVENTS, 3, 41)], EVENTS) is None
    assert source_of(None, EVENTS) is None


def test_a_snapshot_time_comes_from_its_generation_when_that_is_a_plausible_time():
    now = time.time()
    assert snapshot_time(int((now - 5) * 1e9), now) == pytest.approx(now - 5)
    assert snapshot_time(None, now) is None
    assert snapshot_time(7, now) is None, "a counter, not a clock"
    assert snapshot_time(int((now + 3600) * 1e9), now) is None, "in the future"


def test_the_read_starts_at_the_time_asked_but_never_more_than_cap_records_before_the_end():
    assert read_start(0, 100, 40, cap=1000) == (40, False)
    assert read_start(0, 100, None, cap=1000) == (100, False), "no record that new: nothing to read"
    assert read_start(50, 100, 10, cap=1000) == (50, False), "retention removed the older ones"
    assert read_start(0, 100, 40, cap=25) == (75, True), "capped: the newest 25"
    assert read_start(0, 100, 90, cap=25) == (90, False)


def test_the_replay_skips_exactly_the_offsets_read_back_and_frees_them_as_it_passes():
    w = AlreadyWritten()
    w.replace(0, {5, 9, 12})
    w.replace(1, set())
    assert w.entries() == 3
    assert not w.take(1, 5), "nothing read back for partition 1"
    assert not w.take(0, 4)
    assert w.take(0, 5) and not w.take(0, 5), "each record skips one send"
    assert w.take(0, 9) and w.entries() == 1
    assert not w.take(0, 13) and w.entries() == 0, "past the highest offset read back: the set is dropped"
    assert not w.take(0, 12)
    w.replace(2, {1, 2})
    w.forget(2)
    assert w.entries() == 0 and not w.take(2, 1)


def test_a_snapshot_generation_is_the_wall_clock_when_its_slice_was_taken():
    """dlqtail reads from this moment on (minus a margin): the DLQ records of the replayed tail were sent
    after it. If Durability stops using time.time_ns() for a generation, this fails."""
    class AckTopic:
        async def send(self, **kwargs):
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            return fut

    async def no_flush() -> None:
        return None

    ingest = Ingest(Index(ttl_s=60.0), 1 << 20)
    ingest.applied_offset[0] = 41
    d = durability.Durability(ingest, "unused:0", EVENTS, "snap", "p")
    before = time.time_ns()
    asyncio.run(d.snapshot(AckTopic(), [0], no_flush))
    assert before <= d.last_gen[0][0] <= time.time_ns()


# -- read_written against a fake consumer ----------------------------------------------------------------


class TP(NamedTuple):
    topic: str
    partition: int


class Record(NamedTuple):
    offset: int
    timestamp: int
    headers: list


class Found(NamedTuple):
    offset: int
    timestamp: int


class FakeConsumer:
    """The aiokafka consumer calls `read_written` and `first_record_time` make, over in-memory partitions."""

    def __init__(self, topics: dict[str, list[list[Record]]]) -> None:
        self.topics = topics
        self.assigned: list[TP] = []
        self.pos: dict[TP, int] = {}
        self.stopped = False

    def _log(self, tp) -> list[Record]:
        return self.topics[tp.topic][tp.partition]

    def partitions_for_topic(self, topic):
        return set(range(len(self.topics[topic]))) if topic in self.topics else None

    def assign(self, tps) -> None:
        self.assigned = [TP(*tp) for tp in tps]
        self.pos = {}

    async def beginning_offsets(self, tps):
        return {tp: (self._log(tp)[0].offset if self._log(tp) else 0) for tp in tps}

    async def end_offsets(self, tps):
        return {tp: (self._log(tp)[-1].offset + 1 if self._log(tp) else 0) for tp in tps}

    async def offsets_for_times(self, times):
        out = {}
        for tp, ms in times.items():
            hit = [r for r in self._log(tp) if r.timestamp >= ms]
            out[tp] = Found(hit[0].offset, hit[0].timestamp) if hit else None
        return out

    def seek(self, tp, offset: int) -> None:
        assert TP(*tp) in self.assigned
        self.pos[TP(*tp)] = offset

    async def position(self, tp) -> int:
        return self.pos[TP(*tp)]

    async def getmany(self, *tps, timeout_ms: int = 0, max_records: int | None = None):
        out = {}
        for tp in tps:
            tp = TP(*tp)
            batch = [r for r in self._log(tp) if r.offset >= self.pos[tp]][:max_records or 3]  # small fetches
            if batch:
                out[tp] = batch
                self.pos[tp] = batch[-1].offset + 1
        return out

    async def stop(self) -> None:
        self.stopped = True


def rec(offset: int, ts_s: float, partition: int, source_offset: int, topic: str = EVENTS) -> Record:
    return Record(offset, int(ts_s * 1000), headers(topic, partition, source_offset))


def test_the_read_keeps_offsets_above_each_floor_of_the_given_partitions_from_every_dlq_partition():
    dlq = [
        [rec(0, 100, 0, 3), rec(1, 200, 0, 8), rec(2, 201, 1, 4), rec(3, 202, "x", 0), rec(4, 203, 0, 9)],
        [rec(0, 150, 1, 2), rec(1, 205, 1, 7), rec(2, 206, 2, 50), rec(3, 207, 0, 10, topic="other")],
        [],
    ]
    consumer = FakeConsumer({"dlq": dlq})
    found, cost = asyncio.run(dlqtail.read_written(consumer, "dlq", EVENTS, {0: 5, 1: 4}, since=199.0,
                                                   deadline=time.monotonic() + 5))
    # partition 0: 3 is below the time asked; 8 and 9 above its floor 5. Partition 1: 4 is the floor itself,
    # 2 is older than the time asked; 7 kept. Partition 2 is not ours; "x" and the other topic's record parse
    # to nothing.
    assert found == {0: {8, 9}, 1: {7}}
    assert cost == {"records_read": 7, "capped_partitions": 0, "dlq_partitions": 3}

    consumer = FakeConsumer({"dlq": dlq})
    found, cost = asyncio.run(dlqtail.read_written(consumer, "dlq", EVENTS, {0: -1, 1: -1}, since=None,
                                                   deadline=time.monotonic() + 5, cap=2))
    assert found == {0: {9}, 1: set()} and cost["capped_partitions"] == 2, "the newest 2 records of each"


def test_the_first_record_time_of_an_events_partition_bounds_a_read_without_a_snapshot():
    consumer = FakeConsumer({EVENTS: [[rec(7, 123.5, 0, 0), rec(8, 124, 0, 0)], []]})
    assert asyncio.run(dlqtail.first_record_time(consumer, EVENTS, 0, time.monotonic() + 5)) == 123.5
    assert asyncio.run(dlqtail.first_record_time(consumer, EVENTS, 1, time.monotonic() + 5)) is None


# -- the restore ------------------------------------------------------------------------------------------


def routing_durability(monkeypatch, read_written) -> tuple[RoutingDurability, AlreadyWritten, list]:
    async def no_snapshot(consumer, topic, partition):
        return None

    consumers: list[FakeConsumer] = []

    async def reader(bootstrap):
        consumers.append(FakeConsumer({}))
        return consumers[-1]

    async def first_record_time(consumer, topic, partition, deadline):
        return {0: 1000.0, 1: 2000.0}.get(partition)  # partition 2: empty

    async def flush() -> None:
        return None

    monkeypatch.setattr(durability, "read_latest", no_snapshot)
    monkeypatch.setattr(durability, "snapshot_reader", reader)
    monkeypatch.setattr(dlqtail, "snapshot_reader", reader)
    monkeypatch.setattr(dlqtail, "first_record_time", first_record_time)
    monkeypatch.setattr(dlqtail, "read_written", read_written)
    written = AlreadyWritten()
    d = RoutingDurability(Ingest(Index(ttl_s=60.0), 1 << 20), "unused:0", EVENTS, "snap", "p", dlq_topic="dlq",
                          written=written, flush=flush)
    return d, written, consumers


def test_a_restore_returns_only_after_the_read_back_and_reads_once_per_partition_given(monkeypatch):
    calls = []
    gate: list[asyncio.Event] = []

    async def read_written(consumer, dlq_topic, events_topic, floors, since, deadline):
        calls.append((dlq_topic, events_topic, dict(floors), since))
        await gate[0].wait()  # the read takes a while: the second hook's restore must wait for it
        return {0: {3, 4}, 1: set()}, {"records_read": 9, "capped_partitions": 0, "dlq_partitions": 1}

    async def scenario():
        gate.append(asyncio.Event())
        first = asyncio.create_task(d.restore([0, 1, 2]))  # on_partitions_assigned
        second = asyncio.create_task(d.restore([0, 1, 2]))  # on_rebalance_complete, before positioning
        await asyncio.sleep(0.05)
        assert not second.done() and not first.done()
        gate[0].set()
        await asyncio.gather(first, second)
        await d.restore([0, 1])  # owned already: no second read

    d, written, consumers = routing_durability(monkeypatch, read_written)
    asyncio.run(scenario())
    # no snapshot: every offset counts (floor -1), from the first events record's time less the margin;
    # partition 2 is empty, nothing to replay there
    assert calls == [("dlq", EVENTS, {0: -1, 1: -1}, 1000.0 - dlqtail.MARGIN_S)]
    assert written.take(0, 3) and written.take(0, 4) and not written.take(1, 0)
    assert d.dlq_tail["reads"] == 1 and d.dlq_tail["found"] == 2 and d.dlq_tail["records_read"] == 9
    assert d.dlq_tail["last"]["partitions"] == [0, 1, 2] and all(c.stopped for c in consumers)


def test_a_failed_read_back_is_counted_and_the_restore_completes_without_skips(monkeypatch):
    async def read_written(consumer, dlq_topic, events_topic, floors, since, deadline):
        raise RuntimeError("DLQ topic 'dlq' does not exist")

    d, written, consumers = routing_durability(monkeypatch, read_written)
    written.replace(0, {1})  # from an earlier ownership: not trusted after a new restore
    asyncio.run(d.restore([0]))
    assert d.owned == {0} and d.pending_seek == {0: 0}, "the partition is restored all the same"
    assert d.dlq_tail["errors"] == 1 and "does not exist" in d.dlq_tail["last_error"]["error"]
    assert not written.take(0, 1) and all(c.stopped for c in consumers)


def test_metrics_say_what_the_read_back_did_and_how_many_sends_it_spared():
    from prometheus_client.parser import text_string_to_metric_families

    from kvpipe.processors.routing.metrics import ProcessorMetrics
    from tests.unit.test_metrics_exposition import _stats

    def stats() -> dict:
        s = _stats()
        s["counters"] |= {"dlq_sent": 5, "dlq_already_written": 7}
        s["dlq_readback"] = {"reads": 2, "errors": 1, "last_error": None, "records_read": 40, "found": 7,
                             "pending": 0, "last": {"partitions": [0, 1], "found": 7, "records_read": 36,
                                                    "capped_partitions": 0, "dlq_partitions": 3, "ms": 46.2,
                                                    "ts": 1.7e9}}
        return s

    m = ProcessorMetrics()
    m.watch(stats)
    samples = {s.name: s.value for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples["kvpipe_processor_dlq_already_written_total"] == 7
    assert samples["kvpipe_processor_dlq_records_written_total"] == 5
    assert samples["kvpipe_processor_dlq_readback_records_total"] == 40
    assert samples["kvpipe_processor_dlq_readback_errors_total"] == 1
    assert samples["kvpipe_processor_dlq_readback_last_duration_seconds"] == pytest.approx(0.0462)
