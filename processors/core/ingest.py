"""One Kafka message → index update, as a plain function shared by the Faust agents and the bench;
`Ingest.handle_batch` runs it over a partition's fetched records (kvpipe.processors.core.batchdelivery),
the records of the common case in native runs with the same results (kvpipe.processors.core.ingestrun).

No I/O here: the caller sends DLQ messages and analytics rows with what `Ingest.handle` returns.
The per-partition bookkeeping (`applied_offset`, stream time) is what makes snapshots exact: a
snapshot of partition p covers exactly the messages up to `applied_offset[p]`, and after a restore
a message at or below that offset is skipped without touching the index (it is already in).

Clocks (RELIABILITY.md, probe 1). A node's `ts`/`sent_ts` move only its own liveness, and never
past a trusted clock: the Kafka record's timestamp when the events topic appends with the broker's
clock (`message.timestamp.type=LogAppendTime`, set by `infra/topics.py`), else the processor's
wall clock at handling time. A node timestamp beyond trusted + `max_skew_s` is clamped to it
(counted; the node's largest excess is its `skew_s` in `/nodes`) *before* the index sees the
envelope, so lifetimes, liveness, `stream_ts` and snapshots only ever hold clamped times. The
partition clock `stream_ts` (what expiry uses while a backlog is replayed) advances with the
record timestamps themselves under LogAppendTime, with clamped node times otherwise.

Replay equals live processing under LogAppendTime: the record timestamps are stored with the
messages, so a replay clamps exactly as the live run did. With CreateTime (a producer-set value,
not trusted) the bound is the processor's wall clock, which is later on a replay: envelopes that
were clamped live may be clamped less (or not) when replayed, so only there can a replay differ,
and only for a node whose clock ran ahead by more than `max_skew_s`.
"""
from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping, Sequence


from kvpipe.processors.core import ingestrun, native, slots
from kvpipe.processors.core.index import APPLIED, REFUSED, Index
from kvpipe.processors.core.outcomes import DLQ, SKIPPED, Batch, EventWatcher, KafkaRecord, Result
from kvpipe.schemas.codec import INVALID, LAYOUT_MAP, DecodeError, check_headers, decode_envelope, envelope_events
from kvpipe.schemas.envelope import Envelope
from kvpipe.schemas.events import BlockRemoved, BlockStored, Event

HEADER_DLQ_REASON = "kvpipe-dlq-reason"
HEADER_SOURCE_TOPIC = "kvpipe-source-topic"
HEADER_SOURCE_PARTITION = "kvpipe-source-partition"
HEADER_SOURCE_OFFSET = "kvpipe-source-offset"
HEADER_ORIGINAL_SIZE = "kvpipe-original-size"
HEADER_TRUNCATED = "kvpipe-truncated"


def _check_events(env: Envelope, events: list[Event]) -> None:
    for i, ev in enumerate(events):
        if (ev.__class__ is BlockStored or ev.__class__ is BlockRemoved) and ev.group_idx is not None and ev.group_idx < 0:
            raise DecodeError(INVALID, f"node {env.node_id!r} epoch {env.epoch} seq {env.seq}: event {i} has group_idx "
                                       f"{ev.group_idx}; expected >= 0 or None")


def _header_pairs(headers: Mapping[str, bytes] | Iterable[tuple[str, bytes]] | None) -> Iterable[tuple[str, bytes]]:
    if headers is None:
        return ()
    return headers.items() if isinstance(headers, Mapping) else headers


class Ingest:
    """The index plus the counters and offsets of the messages that fed it."""

    def __init__(self, index: Index, max_bytes: int, max_skew_s: float = 10.0, inflight: EventWatcher | None = None,
                 native_batches: bool = False, native_runs: bool | None = None) -> None:
        self.index = index
        on_native = index.store.kind == "native" and native.engine() == "native"
        # vLLM batches read by the native side straight into the index (`slots.parse_batch`), for a
        # caller that needs no event objects (the routing app; the analytics app derives rows from
        # them); messages the native reader leaves, and nodes with in-flight guesses, take the
        # reference decoder
        self.native_batches = native_batches and on_native
        # the router's speculative entries for blocks in flight: a real event replaces its guess
        self.inflight = inflight
        # `handle_batch` hands runs of common-case records to one native call each
        # (kvpipe.processors.core.ingestrun); False keeps the reference, one `handle` per record; None: with
        # `native_batches` (the analytics app asks for runs alone: its `handle` must give event objects)
        self.native_runs = on_native and (self.native_batches if native_runs is None else native_runs)
        self.max_bytes = max_bytes
        self.max_skew_s = max_skew_s
        self.counters: dict[str, int] = {"messages": 0, "dlq": 0, "skipped_replayed": 0, "offset_holes": 0,
                                         "lifetimes": 0, "clock_clamped": 0}
        self.dlq_by_reason: dict[str, int] = {}
        self.applied_offset: dict[int, int] = {}  # partition → last offset handled (applied, skipped or DLQ'd)
        self.stream_ts: dict[int, float] = {}  # partition → newest node timestamp applied
        self.ingest_ts: dict[int, float] = {}  # partition → processor clock when it last applied a message

    def handle(self, value: bytes | None, headers, partition: int, offset: int, now: float,
               record_ts: float | None = None) -> Result:
        """`now`: the processor's wall clock; `record_ts`: the record's broker (LogAppendTime)
        timestamp in seconds, or None when the topic's timestamps are producer-set."""
        last = self.applied_offset.get(partition)
        if last is not None:
            if offset <= last:
                self.counters["skipped_replayed"] += 1
                return Result(SKIPPED)
            if offset > last + 1:
                # Offsets of a plain topic are contiguous: a jump means the consumer started past
                # the restored snapshot. Counted so a test (and /stats) can prove it never happens.
                self.counters["offset_holes"] += 1
        self.applied_offset[partition] = offset
        self.counters["messages"] += 1
        try:
            check_headers(_header_pairs(headers))
            env = decode_envelope(value if value is not None else b"", self.max_bytes)
            events = self._native_batch(env) if self.native_batches else None
            if events is None:
                events = envelope_events(env, self.max_bytes)
                _check_events(env, events)
        except DecodeError as exc:
            self.counters["dlq"] += 1
            self.dlq_by_reason[exc.kind] = self.dlq_by_reason.get(exc.kind, 0) + 1
            return Result(DLQ, error=exc)
        trusted = now if record_ts is None else record_ts
        skew = self._clamp(env, trusted + self.max_skew_s) - trusted
        before = self.index.nodes.get(env.node_id)
        epoch_before = before.epoch if before is not None else None
        ended = self.index.ended
        outcome, lifetimes = self.index.apply(env, events, partition, offset)
        if skew > self.max_skew_s:
            self.counters["clock_clamped"] += 1
            node = self.index.nodes.get(env.node_id)
            if node is not None:
                node.counters["clock_clamped"] += 1
                if skew > node.skew_s:
                    node.skew_s = skew
        if outcome == APPLIED:
            seen = record_ts if record_ts is not None else (env.sent_ts if env.sent_ts > env.ts else env.ts)
            if seen > self.stream_ts.get(partition, 0.0):
                self.stream_ts[partition] = seen
            self.ingest_ts[partition] = now
            self.counters["lifetimes"] += self.index.ended - ended
            if self.inflight is not None:
                self.inflight.on_events(env.node_id, events,
                                        new_epoch=epoch_before is not None and env.epoch > epoch_before)
        return Result(outcome, env, events, lifetimes)

    def handle_batch(self, records: Sequence[KafkaRecord], clock: Callable[[], float] = time.time,
                     rows: ingestrun.RowsTarget | None = None) -> Batch:
        """`handle` for each record of `records` in order, until one needs a side effect (see
        `Batch`). `clock` is read per record: the trusted bound and `ingest_ts` are what a
        record-at-a-time loop would have seen. With `native_runs`, runs of common-case records
        are handled natively (kvpipe.processors.core.ingestrun), with the same results as the reference
        below, which sends every record through `handle`. `rows`: the analytics app's rows of each record
        (`ingestrun.handle_batch` says how), the reference handing every record to `rows.derive`."""
        if self.native_runs:
            return ingestrun.handle_batch(self, records, clock, rows)
        return self._handle_batch_each(records, clock, rows)

    def _handle_batch_each(self, records: Sequence[KafkaRecord], clock: Callable[[], float] = time.time,
                           rows: ingestrun.RowsTarget | None = None) -> Batch:
        """The reference `handle_batch`: one `handle` per record."""
        handle = self.handle
        published: list[float] = []
        add = published.append
        refused: list[Result] = []
        i = 0
        for r in records:
            i += 1
            ts_ms = r.timestamp
            record_ts = ts_ms / 1000.0 if r.timestamp_type == 1 and ts_ms is not None else None
            try:
                result = handle(r.value, r.headers, r.partition, r.offset, clock(), record_ts)
                if rows is not None:
                    rows.derive(r, result)
            except Exception as exc:  # noqa: BLE001 - reported by the caller, with the record
                return Batch(i, published, refused, failed=exc)
            outcome = result.outcome
            if outcome == APPLIED:
                env = result.env
                assert env is not None  # an applied message's result carries its envelope
                add(env.sent_ts or env.ts)
            elif outcome == DLQ:
                return Batch(i, published, refused, dlq=result)
            elif outcome == REFUSED:
                refused.append(result)
        return Batch(i, published, refused)

    def _native_batch(self, env: Envelope):
        """The envelope's events read natively, or None for the reference decoder."""
        if env.is_heartbeat or env.layout != LAYOUT_MAP or len(env.batch) > self.max_bytes:
            return None
        if self.inflight is not None and self.inflight.tracks(env.node_id):
            return None  # its guesses are confirmed event by event (`InFlight.on_events`)
        return slots.parse_batch(bytes(env.batch))

    @staticmethod
    def _clamp(env: Envelope, limit: float) -> float:
        """Clamp the envelope's timestamps to `limit`; returns the largest one as it came."""
        seen = env.sent_ts if env.sent_ts > env.ts else env.ts
        if seen > limit:
            if env.ts > limit:
                env.ts = limit
            if env.sent_ts > limit:
                env.sent_ts = limit
        return seen

    def restored_clock(self, stream_ts: float, now: float) -> float:
        """A snapshot's partition clock, bounded like live timestamps (a snapshot written by an
        older processor may carry an unbounded one)."""
        return min(stream_ts, now + self.max_skew_s)

    def forget_partition(self, partition: int) -> None:
        self.index.drop_partition(partition)
        self.applied_offset.pop(partition, None)
        self.stream_ts.pop(partition, None)
        self.ingest_ts.pop(partition, None)


MAX_REASON_BYTES = 2048


def dlq_headers(error: DecodeError, topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    reason = f"{error.kind}: {error.message}".encode()
    if len(reason) > MAX_REASON_BYTES:  # a hostile node id or field can make the message huge
        reason = reason[:MAX_REASON_BYTES - 3] + b"..."
    return [
        (HEADER_DLQ_REASON, reason),
        (HEADER_SOURCE_TOPIC, topic.encode()),
        (HEADER_SOURCE_PARTITION, str(partition).encode()),
        (HEADER_SOURCE_OFFSET, str(offset).encode()),
    ]


def dlq_record(value: bytes | None, error: DecodeError, topic: str, partition: int, offset: int,
               copy_max_bytes: int, excerpt_bytes: int) -> tuple[bytes, list[tuple[str, bytes]]]:
    """The DLQ message for a bad input: the original bytes when small enough, else its first
    `excerpt_bytes` with the original size and a truncation mark, so the DLQ copy is never one the
    broker refuses (a message can be under the events topic's limit and over the DLQ's or the
    producer's); the source coordinates say where the whole message still is."""
    data = value or b""
    headers = dlq_headers(error, topic, partition, offset)
    headers.append((HEADER_ORIGINAL_SIZE, str(len(data)).encode()))
    if len(data) > copy_max_bytes or error.kind == "too_large":
        data = bytes(data[:excerpt_bytes])
        headers.append((HEADER_TRUNCATED, b"1"))
    return data, headers
