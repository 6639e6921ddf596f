"""One DLQ record per bad message across a crash of the routing app (RELIABILITY.md section 13).

The routing app writes the DLQ (`agents.send_to_dlq`). A snapshot claims an offset only after the DLQ
records of the messages it covers are durable (`agents.flush_side_effects`), so a graceful stop or a
rebalance never writes a record twice. A kill -9 does: the restart restores the last snapshot and replays
the tail past it (`kvpipe.processors.core.durability`), and the bad messages in that tail reach
`send_to_dlq` again, though their records are already in the DLQ (measured: 86 records for 43 bad
messages when no snapshot covered them).

The fix, at restore (`RoutingDurability.restore`), before the replay starts: read the DLQ records written
since the restored snapshot and remember, per events partition this worker now owns, the source offsets
they carry (the `kvpipe-source-*` headers, `kvpipe.processors.core.ingest.dlq_headers`) above the
snapshot's offset; the replay then skips `send_to_dlq` for those (`AlreadyWritten.take`). Decisions:

- Reading the DLQ back, not keeping a record of our own sends: a send in flight when the worker was
  killed may or may not have reached the log, and the log is the one place that knows. A restore reads
  it after the killed member left the group (its session expired), so what the dead worker sent is in the
  log or never will be. Records this worker itself sent earlier are flushed before the read.
- Where to start reading: the DLQ records of the replayed tail were sent after the restored snapshot's
  slice was taken; its generation is that moment's `time.time_ns()` (`Durability._snapshot`; pinned by
  tests/unit/test_dlq_tail.py), so the read starts at `offsets_for_times(that - MARGIN_S)` in every DLQ
  partition. With no snapshot the replay starts at the events partition's first record, and so does the
  read (that record's timestamp): DLQ records about an older topic of the same name are never matched.
- Bounded: at most `MAX_RECORDS_PER_PARTITION` records of each DLQ partition (its newest ones) and
  `READ_TIMEOUT_S` in all; only offsets above the snapshot's, of partitions this worker was just given,
  are kept, and each is dropped once the replay met it or passed the highest one. Every partition of
  the DLQ topic is read: a record's DLQ partition follows its key (the node id), not its events partition.
- Never wrong, at worst a duplicate: a send is skipped only for a record read back with the same source
  topic, partition and offset. A read that fails or ends early costs duplicates (counted), never a
  missing record, and never stops the restore.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kvpipe.processors.core.durability import Durability, snapshot_reader
from kvpipe.processors.core.ingest import HEADER_SOURCE_OFFSET, HEADER_SOURCE_PARTITION, HEADER_SOURCE_TOPIC

log = logging.getLogger(__name__)

# Clocks of the snapshot's writer, the DLQ's writer and the broker may disagree (a restart on another host);
# a minute is far past NTP's error, and costs reading one more minute of the DLQ.
MARGIN_S = 60.0
# The newest records of each DLQ partition read at most: ~2 s of reading on a busy 2-core machine
# (RELIABILITY.md section 13); a tail longer than this is a flood of bad input, which may see duplicates.
MAX_RECORDS_PER_PARTITION = 200_000
READ_TIMEOUT_S = 30.0


def source_of(headers: Iterable[tuple[str, bytes]] | None, events_topic: str) -> tuple[int, int] | None:
    """(partition, offset) of the events message a DLQ record copies, or None (another topic's, or headers
    that do not parse: a record not written by `dlq_headers`)."""
    topic = partition = offset = None
    for key, value in headers or ():
        if key == HEADER_SOURCE_TOPIC:
            topic = value
        elif key == HEADER_SOURCE_PARTITION:
            partition = value
        elif key == HEADER_SOURCE_OFFSET:
            offset = value
    if topic is None or partition is None or offset is None or topic != events_topic.encode():
        return None
    try:
        return int(partition), int(offset)
    except ValueError:
        return None


def snapshot_time(gen_ns: int | None, now: float) -> float | None:
    """When a snapshot's slice was taken, from its generation (`time.time_ns()` then), or None when the
    generation is not a plausible time (absent, before 2001 or in the future)."""
    if gen_ns is None:
        return None
    t = gen_ns / 1e9
    return t if 1e9 < t <= now + MARGIN_S else None


def read_start(begin: int, end: int, at_time: int | None, cap: int) -> tuple[int, bool]:
    """Where to start reading a DLQ partition holding [begin, end): at `at_time` (the first offset at or after
    the start time; None: no record that new, so nothing to read), but no more than `cap` records before the
    end. Returns (start, capped): capped when older records the time asked for are left unread."""
    wanted = end if at_time is None else max(begin, at_time)
    start = max(wanted, end - cap)
    return start, start > wanted


class AlreadyWritten:
    """Source offsets, per events partition, whose DLQ record is already in the DLQ topic. Filled at restore
    for the partitions just given to this worker (offsets above the restored snapshot's only), emptied as the
    replay meets them. Memory: one int per record read back, released once the replay passed them."""

    def __init__(self) -> None:
        self._offsets: dict[int, set[int]] = {}
        self._last: dict[int, int] = {}

    def replace(self, partition: int, offsets: Iterable[int]) -> None:
        found = set(offsets)
        if found:
            self._offsets[partition], self._last[partition] = found, max(found)
        else:
            self.forget(partition)

    def forget(self, partition: int) -> None:
        self._offsets.pop(partition, None)
        self._last.pop(partition, None)

    def take(self, partition: int, offset: int) -> bool:
        """True if the record of (partition, offset) is already written (so its send is skipped). The replay
        runs in offset order: once it reached the highest offset known, the partition's set is dropped."""
        offsets = self._offsets.get(partition)
        if offsets is None:
            return False
        present = offset in offsets
        offsets.discard(offset)
        if offset >= self._last[partition] or not offsets:
            self.forget(partition)
        return present

    def entries(self) -> int:
        return sum(map(len, self._offsets.values()))


async def first_record_time(consumer, topic: str, partition: int, deadline: float) -> float | None:
    """The timestamp (s) of the first record of `topic`/`partition`, or None when it holds none."""
    from aiokafka import TopicPartition

    tp = TopicPartition(topic, partition)
    consumer.assign([tp])
    begin = (await consumer.beginning_offsets([tp]))[tp]
    end = (await consumer.end_offsets([tp]))[tp]
    if begin >= end:
        return None
    consumer.seek(tp, begin)
    while time.monotonic() < deadline:
        batch = await consumer.getmany(tp, timeout_ms=100, max_records=1)
        for record in batch.get(tp, []):
            return record.timestamp / 1000.0
    raise TimeoutError(f"reading the first record of {topic}/{partition} timed out")


async def read_written(consumer, dlq_topic: str, events_topic: str, floors: dict[int, int], since: float | None,
                       deadline: float, cap: int = MAX_RECORDS_PER_PARTITION) -> tuple[dict[int, set[int]], dict]:
    """Source offsets of the DLQ records about `events_topic`'s partitions in `floors` above each one's floor,
    read from every DLQ partition from `since` (s; None: the beginning) to its end now, `cap` records each at
    most. Returns them per events partition, and what the read cost."""
    from aiokafka import TopicPartition

    # the reader's metadata tracks only the topics it was assigned so far: ask the cluster for the DLQ's
    parts = consumer.partitions_for_topic(dlq_topic) or (await consumer._client.fetch_all_metadata()
                                                         ).partitions_for_topic(dlq_topic)
    if not parts:
        raise RuntimeError(f"DLQ topic {dlq_topic!r} does not exist")
    tps = [TopicPartition(dlq_topic, i) for i in sorted(parts)]
    consumer.assign(tps)
    begin = await consumer.beginning_offsets(tps)
    end = await consumer.end_offsets(tps)
    if since is None:
        at: dict[Any, int | None] = dict(begin)
    else:
        found = await consumer.offsets_for_times({tp: max(0, int(since * 1000)) for tp in tps})
        at = {tp: (None if found.get(tp) is None else found[tp].offset) for tp in tps}
    starts: dict[Any, int] = {}
    capped = 0
    for tp in tps:
        start, cut = read_start(begin[tp], end[tp], at[tp], cap)
        capped += cut
        if start < end[tp]:
            starts[tp] = start
    todo = {tp: end[tp] for tp in starts}  # DLQ partition → where its read stops
    if todo:
        consumer.assign(list(todo))  # only the partitions with something to read
        for tp, start in starts.items():
            consumer.seek(tp, start)
    written: dict[int, set[int]] = {p: set() for p in floors}
    read = 0
    while todo:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"reading the DLQ tail of {dlq_topic} timed out with {read} records read")
        batch = await consumer.getmany(*todo, timeout_ms=100)
        for tp, records in batch.items():
            stop = todo.get(tp)
            for record in records:
                if stop is None or record.offset >= stop:
                    break
                read += 1
                source = source_of(record.headers, events_topic)
                if source is not None and source[0] in floors and source[1] > floors[source[0]]:
                    written[source[0]].add(source[1])
        for tp in list(todo):
            if await consumer.position(tp) >= todo[tp]:
                del todo[tp]
    return written, {"records_read": read, "capped_partitions": capped, "dlq_partitions": len(tps)}


class RoutingDurability(Durability):
    """The snapshots of `kvpipe.processors.core.durability`, and: a restore also reads back the DLQ records
    written since the restored snapshot (the module docstring says why and how), so the replay after a crash
    writes no record twice. The restore returns only once that read is done: the rebalance hooks
    (`kvpipe.processors.core.rebalance`) await it before the consumer is positioned, so no replayed message
    is handled before its partition's records are known."""

    def __init__(self, *args: Any, dlq_topic: str, written: AlreadyWritten, flush: Callable[[], Awaitable[None]],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dlq_topic = dlq_topic
        self.written = written
        self.flush = flush  # the app's producer: records this worker sent before are in the log when read
        self.dlq_tail: dict[str, Any] = {"reads": 0, "errors": 0, "last_error": None, "records_read": 0,
                                         "found": 0, "last": None}
        # Both rebalance hooks call restore; the second must wait for the first's DLQ read, not only for the
        # snapshot restore (Durability's own lock is released in between).
        self._tail_lock = asyncio.Lock()

    async def restore(self, partitions: list[int]) -> None:
        async with self._tail_lock:
            before = set(self.owned)
            await super().restore(partitions)
            fresh = sorted({p for p in partitions if p in self.owned and p not in before})
            if fresh:
                await self.read_dlq_tail(fresh)

    async def read_dlq_tail(self, partitions: list[int]) -> None:
        """Fill `written` for `partitions` (just restored). Never raises, and gives up after `READ_TIMEOUT_S`:
        a failure costs duplicates, not the restore."""
        started = time.perf_counter()
        for p in partitions:
            self.written.forget(p)
        try:
            found, cost = await asyncio.wait_for(self._read(partitions), READ_TIMEOUT_S)
        except Exception as exc:  # the restore goes on; the replay may write duplicates
            self.dlq_tail["errors"] += 1
            self.dlq_tail["last_error"] = {"ts": time.time(), "partitions": partitions, "error": repr(exc)[:500]}
            log.warning("reading the DLQ back for partitions %s failed (%r): their replay may write DLQ records "
                        "that are already there", partitions, exc)
            return
        for p, offsets in found.items():
            self.written.replace(p, offsets)
        n = sum(map(len, found.values()))
        last = {"partitions": partitions, "found": n, "ms": round((time.perf_counter() - started) * 1000, 1),
                "ts": time.time(), **cost}
        self.dlq_tail["reads"] += 1
        self.dlq_tail["records_read"] += cost["records_read"]
        self.dlq_tail["found"] += n
        self.dlq_tail["last"] = last
        log.info("DLQ read back for partitions %s: %s", partitions, last)

    async def _read(self, partitions: list[int]) -> tuple[dict[int, set[int]], dict[str, Any]]:
        deadline = time.monotonic() + READ_TIMEOUT_S
        await self.flush()
        floors = {p: self.ingest.applied_offset.get(p, -1) for p in partitions}  # the restored snapshots' offsets
        consumer = await snapshot_reader(self.bootstrap)
        try:
            starts = []
            for p in partitions:
                gen = self.last_gen.get(p)  # the restored snapshot's (Durability._restore_one), if any
                t = snapshot_time(gen[0] if gen is not None else None, time.time())
                if t is None:  # no snapshot: the replay starts at the partition's first record
                    t = await first_record_time(consumer, self.events_topic, p, deadline)
                    if t is None:  # empty: nothing to replay
                        del floors[p]
                        continue
                starts.append(t - MARGIN_S)
            if not floors:
                return {}, {"records_read": 0, "capped_partitions": 0, "dlq_partitions": 0}
            return await read_written(consumer, self.dlq_topic, self.events_topic, floors, min(starts), deadline)
        finally:
            await consumer.stop()
