"""Snapshots of the index to Kafka, and restore + replay on partition assignment.

Why snapshots: writing a Faust table key per block (or per message) costs ~4x the ingest rate
(docs/architecture.md §6), so the index lives in memory and durability is coarse: every
`snapshot_every_s` (and when a partition is revoked or the worker stops) each owned partition's
slice is written to the compacted snapshot topic with the source offset it covers (`snapshot`
has the record layout).

Restore: on assignment of events partition p, the latest complete snapshot of p is loaded and
the consumer is positioned at its offset + 1; the log after it is replayed through the same agent
code, so the result equals a rebuild from offset 0 (no lost entries, no ghosts). No snapshot →
replay from the beginning.

How the position is set (the choice, and why): Faust seeks every assigned partition to the
consumer group's *committed* offset right after `on_rebalance_complete` (`perform_seek`), which
would undo an earlier seek, and Faust commits acked offsets on its own, which may be past the
last snapshot. So at `on_rebalance_complete` we *commit* the snapshot's offset + 1 for each
partition we restored (and seek there as well): Faust's own seek then lands on it. Faust's later
commits are harmless: on the next assignment we override them again. A committed offset is
therefore never trusted for correctness; only the snapshot's offset is. As a second guard the
agent skips messages at or below the restored offset (`Ingest.handle`).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from kvpipe.processors.core.ingest import Ingest
from kvpipe.processors.core.snapshot import (
    FORMAT,
    Chunk,
    Manifest,
    chunk_key,
    decode_chunk,
    decode_manifest,
    encode_manifest,
    export_partition,
    import_chunks,
    manifest_key,
    parse_key,
)

log = logging.getLogger(__name__)


class Durability:
    """Writes and restores snapshots for the partitions this worker owns."""

    def __init__(self, ingest: Ingest, bootstrap: str, events_topic: str, snapshot_topic: str, processor_id: str,
                 timeout_s: float = 60.0) -> None:
        self.ingest = ingest
        self.bootstrap = bootstrap
        self.events_topic = events_topic
        self.snapshot_topic = snapshot_topic
        self.processor_id = processor_id
        self.last_gen: dict[int, tuple[int, int]] = {}  # partition → (gen, chunks) of our last snapshot
        self.pending_seek: dict[int, int] = {}  # partition → offset to start from, set by restore
        self.owned: set[int] = set()  # partitions restored and not revoked since
        # A snapshot the cluster does not acknowledge within `timeout_s` (its partitions offline: a
        # full or failed log dir, a lost leader) fails, counted, instead of holding the lock — and
        # with it every later snapshot and the rebalance hooks — until the producer gives up.
        self.timeout_s = timeout_s
        self.stats: dict[str, Any] = {"snapshots": 0, "snapshot_ms_last": 0.0, "snapshot_export_ms_last": 0.0,
                                      "snapshot_bytes_last": 0,
                                      "restores": [], "restore_errors": 0, "snapshot_errors": 0,
                                      "snapshot_last_error": None, "snapshot_ok_ts": 0.0}
        self._lock = asyncio.Lock()  # one snapshot/restore at a time: they share `last_gen`

    # -- writing -------------------------------------------------------------------------------------

    async def snapshot(self, topic, partitions: list[int], flush) -> None:
        """Snapshot these partitions. `flush` (async) makes everything sent so far durable (DLQ
        messages, analytics rows): it runs after the slices are taken and before the manifests
        are written, so no snapshot claims an offset whose side effects could still be lost.
        A failure (or no acknowledgement within `timeout_s`) is counted in the stats and raised;
        the index is untouched by it and the next snapshot tries again."""
        async with self._lock:
            try:
                await asyncio.wait_for(self._snapshot(topic, partitions, flush), self.timeout_s)
            except Exception as exc:
                self.stats["snapshot_errors"] += 1
                why = f"not acknowledged within {self.timeout_s:g} s" if isinstance(exc, asyncio.TimeoutError) else repr(exc)
                self.stats["snapshot_last_error"] = {"ts": time.time(), "partitions": partitions, "error": why[:500]}
                raise

    async def _snapshot(self, topic, partitions: list[int], flush) -> None:
        started = time.perf_counter()
        taken = []
        export_ms = 0.0
        for p in partitions:
            offset = self.ingest.applied_offset.get(p)
            if offset is None:
                continue  # nothing consumed yet: nothing to cover
            gen = time.time_ns()
            t0 = time.perf_counter()
            chunks, nodes, blocks = export_partition(self.ingest.index, p, gen)
            export_ms = max(export_ms, (time.perf_counter() - t0) * 1000)
            manifest = Manifest(FORMAT, self.events_topic, p, gen, len(chunks), offset,
                                self.ingest.stream_ts.get(p, 0.0), time.time(), self.processor_id, nodes, blocks)
            taken.append((p, gen, chunks, manifest))
        if not taken:
            return
        await flush()
        size = 0
        for p, gen, chunks, manifest in taken:
            futures = [await topic.send(key=chunk_key(p, gen, i), value=c, partition=p, force=True)
                       for i, c in enumerate(chunks)]
            await asyncio.gather(*futures)
            await (await topic.send(key=manifest_key(p), value=encode_manifest(manifest), partition=p, force=True))
            size += sum(map(len, chunks))
            old = self.last_gen.get(p)
            if old is not None:  # the new generation is complete: let compaction drop the old one
                for i in range(old[1]):
                    await topic.send(key=chunk_key(p, old[0], i), value=None, partition=p, force=True)
            self.last_gen[p] = (gen, len(chunks))
        self.stats["snapshots"] += len(taken)
        self.stats["snapshot_ms_last"] = round((time.perf_counter() - started) * 1000, 1)
        self.stats["snapshot_export_ms_last"] = round(export_ms, 1)
        self.stats["snapshot_bytes_last"] = size
        self.stats["snapshot_ok_ts"] = time.time()

    # -- restoring -----------------------------------------------------------------------------------

    async def restore(self, partitions: list[int]) -> None:
        """Replace the slices of the partitions not owned yet with their latest snapshots and
        remember where to resume. Idempotent: called from both rebalance hooks (see agents)."""
        async with self._lock:
            todo = [p for p in partitions if p not in self.owned]
            if not todo:
                return
            consumer = await snapshot_reader(self.bootstrap)
            try:
                for p in todo:
                    await self._restore_one(consumer, p)
            finally:
                await consumer.stop()

    async def _restore_one(self, consumer, p: int) -> None:
        started = time.perf_counter()
        self.ingest.forget_partition(p)
        try:
            found = await read_latest(consumer, self.snapshot_topic, p)
        except Exception as exc:  # a broken snapshot must not stop the worker: rebuild from the log
            log.exception("restoring partition %s from %s failed (%r); rebuilding from offset 0", p, self.snapshot_topic, exc)
            self.stats["restore_errors"] += 1
            found = None
        if found is not None and found[0].source_topic != self.events_topic:
            log.warning("snapshot of partition %s covers topic %r, not %r; ignoring it", p, found[0].source_topic, self.events_topic)
            found = None
        blocks = 0
        if found is None:
            self.pending_seek[p] = 0
            self.last_gen.pop(p, None)
        else:
            manifest, chunks = found
            blocks = import_chunks(self.ingest.index, p, chunks, time.time() + self.ingest.max_skew_s)
            if manifest.offset >= 0:
                self.ingest.applied_offset[p] = manifest.offset
            self.ingest.stream_ts[p] = self.ingest.restored_clock(manifest.stream_ts, time.time())
            self.pending_seek[p] = manifest.offset + 1
            self.last_gen[p] = (manifest.gen, manifest.chunks)
        restore = {"partition": p, "offset": self.pending_seek[p] - 1, "blocks": blocks,
                   "ms": round((time.perf_counter() - started) * 1000, 1), "ts": time.time()}
        self.stats["restores"] = (self.stats["restores"] + [restore])[-16:]
        self.owned.add(p)
        log.info("partition %s restored: %s", p, restore)

    async def apply_seeks(self, consumer, topic_partition) -> None:
        """Position the consumer at the restored offsets (see the module docstring for why this
        commits as well as seeks). Called from `on_rebalance_complete`, before Faust's own seek."""
        pending, self.pending_seek = self.pending_seek, {}
        if not pending:
            return
        assigned = consumer.assignment()
        offsets = {topic_partition(self.events_topic, p): off for p, off in pending.items()}
        offsets = {tp: off for tp, off in offsets.items() if tp in assigned}
        if not offsets:
            return
        await consumer._commit(offsets)  # Faust's perform_seek() then seeks to these
        await consumer.seek_wait(offsets)  # and for offset 0, which perform_seek() leaves alone


class SnapshotProducer:
    """The snapshot topic's own Kafka producer, for `Durability.snapshot` (which takes anything whose
    `send(key=, value=, partition=, force=)` returns an acknowledgement future, as a Faust topic's does).

    Why not the app's producer (a Faust topic's `send`): Faust flushes the app's producer before every
    offset commit (`Consumer._commit_offsets`: `await app.producer.flush()`), its commit timer commits
    every 2.8 s, and the consumer's drain loop awaits a commit every `broker_commit_every` (10,000)
    messages, waiting for a commit already under way. Snapshot records for partitions without a leader
    (a full or failed log dir) stay in a producer until its request timeout, Faust's 20 minutes; so the
    commit waited on them, and behind it the ingest: measured, applying stopped at the first of those
    10,000-message commits after the disk filled and stayed stopped until the broker was restarted
    (RELIABILITY.md §8, full disk). In a producer
    of their own they hold up nothing but the snapshot that sent them, and `Durability.snapshot`'s
    timeout bounds that. The records of a failed snapshot expire after the request timeout (the
    snapshot timeout, at least `MIN_REQUEST_TIMEOUT_S`) instead of piling up.

    Started on the first send (inside the app's event loop); `stop` at shutdown.
    """

    MIN_REQUEST_TIMEOUT_S = 10.0

    def __init__(self, bootstrap: str, topic: str, timeout_s: float, max_request_size: int = 2 * 1024 * 1024,
                 client_kwargs: dict[str, Any] | None = None) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.request_timeout_s = max(self.MIN_REQUEST_TIMEOUT_S, timeout_s)
        self.max_request_size = max_request_size
        self._client_kwargs = client_kwargs
        self._producer = None
        self._starting = asyncio.Lock()

    def config(self) -> dict[str, Any]:
        """The aiokafka producer's keyword arguments (TLS/SASL as the app's own clients)."""
        kwargs = self._client_kwargs
        if kwargs is None:
            from kvpipe.processors.core.kafkaconf import aiokafka_kwargs
            from kvpipe.schemas.settings import load_settings

            kwargs = aiokafka_kwargs(load_settings())
        # acks=all as the app's producer; not idempotent, so a batch without a leader expires after
        # the request timeout (an idempotent producer retries it for ever)
        return {"bootstrap_servers": self.bootstrap, "acks": "all", "linger_ms": 0,
                "request_timeout_ms": int(self.request_timeout_s * 1000), "max_request_size": self.max_request_size,
                "client_id": f"kvpipe-snapshots-{self.topic}"[:200], **kwargs}

    async def _started(self):
        if self._producer is None:
            async with self._starting:
                if self._producer is None:
                    from aiokafka import AIOKafkaProducer

                    producer = AIOKafkaProducer(**self.config())
                    try:
                        await producer.start()
                    except BaseException:
                        await asyncio.shield(producer.stop())
                        raise
                    self._producer = producer
        return self._producer

    async def send(self, key: bytes, value: bytes | None, partition: int, force: bool = True) -> asyncio.Future:
        """Queue one record; the returned future resolves once the cluster acknowledged it."""
        producer = await self._started()
        return await producer.send(self.topic, value=value, key=key, partition=partition)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Deliver what is pending for up to `timeout_s`, then close (pending records are dropped)."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            await asyncio.wait_for(producer.stop(), timeout_s)
        except Exception as exc:  # shutting down: a stuck snapshot must not hold the exit
            log.warning("snapshot producer did not close within %g s (%r); its pending records are dropped",
                        timeout_s, exc)


# How long a restore waits for an unreachable broker before the rebalance fails: a rebalance can land on the start
# of an outage (the group's last heartbeat before the broker went), and the partitions cannot be consumed before the
# broker is back anyway, so waiting loses nothing; crashing the worker did (RELIABILITY.md section 8).
READER_WAIT_S = 120.0


async def snapshot_reader(bootstrap: str, wait_s: float = READER_WAIT_S):
    """A group-less aiokafka consumer for reading snapshot partitions (the caller stops it). An unreachable
    broker is retried (kvpipe's one policy, `schemas/retrying.py`) for up to `wait_s`."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.errors import KafkaConnectionError
    from tenacity import retry_if_exception_type, stop_after_delay

    from kvpipe.processors.core.kafkaconf import aiokafka_kwargs
    from kvpipe.schemas.retrying import async_retrying
    from kvpipe.schemas.settings import load_settings

    kwargs = aiokafka_kwargs(load_settings())  # TLS/SASL as the Faust app's own clients
    async for attempt in async_retrying(first_s=0.2, max_s=2.0, stop=stop_after_delay(wait_s), reraise=True,
                                        retry=retry_if_exception_type(KafkaConnectionError)):
        with attempt:
            # fetch_max_wait_ms: a fetch issued before our seek long-polls at the partition's end; with
            # the default 500 ms every partition's restore waited that long for nothing.
            consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None,
                                        max_partition_fetch_bytes=4 * 1024 * 1024, fetch_max_bytes=16 * 1024 * 1024,
                                        fetch_max_wait_ms=10, **kwargs)
            try:
                await consumer.start()
            except BaseException:
                await consumer.stop()  # a client that never started still holds its connections' tasks
                raise
            if attempt.retry_state.attempt_number > 1:
                log.warning("snapshot reader connected after %d attempts", attempt.retry_state.attempt_number)
    return consumer


async def read_latest(consumer, topic: str, partition: int, timeout_s: float = 30.0) -> tuple[Manifest, list[Chunk]] | None:
    """The newest complete snapshot of events partition `partition`, or None.

    Reads backwards from the end of the snapshot partition in growing windows, so the cost is the
    size of the snapshot, not the length of the topic's uncompacted history.
    """
    from aiokafka import TopicPartition

    parts = consumer.partitions_for_topic(topic) or await _partitions(consumer, topic)
    if not parts:
        raise RuntimeError(f"snapshot topic {topic!r} does not exist")
    tp = TopicPartition(topic, partition % len(parts))
    consumer.assign([tp])
    begin = (await consumer.beginning_offsets([tp]))[tp]
    end = (await consumer.end_offsets([tp]))[tp]
    window = 64
    deadline = time.monotonic() + timeout_s
    while True:
        start = max(begin, end - window)
        records = await _read_range(consumer, tp, start, end, deadline)
        found = _newest_complete(records, partition)
        if found is not None or start == begin:
            return found
        window *= 4


async def _partitions(consumer, topic: str) -> set[int] | None:
    await consumer._client.force_metadata_update()
    return consumer.partitions_for_topic(topic)


async def _read_range(consumer, tp, start: int, end: int, deadline: float) -> dict[bytes, tuple[int, bytes | None]]:
    """Latest `(offset, value)` per key among records in [start, end)."""
    latest: dict[bytes, tuple[int, bytes | None]] = {}
    if start >= end:
        return latest
    consumer.seek(tp, start)
    while time.monotonic() < deadline:
        batch = await consumer.getmany(tp, timeout_ms=100)
        for record in batch.get(tp, []):
            if record.offset < end and record.key is not None:
                latest[record.key] = (record.offset, record.value)
        if await consumer.position(tp) >= end:
            return latest
    raise TimeoutError(f"reading snapshot records [{start}, {end}) of {tp} timed out")


def _newest_complete(records: dict[bytes, tuple[int, bytes | None]], partition: int) -> tuple[Manifest, list[Chunk]] | None:
    by_key: dict[tuple[int, int], bytes] = {}
    manifest_value = None
    for key, (_, value) in records.items():
        try:
            p, gen, idx = parse_key(key)
        except ValueError:
            continue
        if p != partition or value is None:
            continue
        if gen is None or idx is None:  # a manifest key (`parse_key` gives both or neither)
            manifest_value = value
        else:
            by_key[(gen, idx)] = value
    if manifest_value is None:
        return None
    manifest = decode_manifest(manifest_value)
    try:
        chunks = [decode_chunk(by_key[(manifest.gen, i)]) for i in range(manifest.chunks)]
    except KeyError:
        return None  # some chunks are before the window: the caller widens it
    return manifest, chunks
