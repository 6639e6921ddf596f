"""One Kafka message → index update, as a plain function shared by the Faust agent and the bench.

No I/O here: the caller sends DLQ messages and analytics rows with what `Ingest.handle` returns.
The per-partition bookkeeping (`applied_offset`, stream time) is what makes snapshots exact: a
snapshot of partition p covers exactly the messages up to `applied_offset[p]`, and after a restore
a message at or below that offset is skipped without touching the index (it is already in).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import msgspec

from processors.analytics.rows import LifetimeRow
from processors.index import APPLIED, Index
from schemas.codec import INVALID, DecodeError, check_headers, decode_envelope, envelope_events
from schemas.envelope import Envelope
from schemas.events import BlockRemoved, BlockStored, Event

DLQ = "dlq"
SKIPPED = "skipped"  # at or below the restored snapshot's offset

HEADER_DLQ_REASON = "kvpipe-dlq-reason"
HEADER_SOURCE_TOPIC = "kvpipe-source-topic"
HEADER_SOURCE_PARTITION = "kvpipe-source-partition"
HEADER_SOURCE_OFFSET = "kvpipe-source-offset"


class Result(msgspec.Struct, gc=False):
    outcome: str  # index.APPLIED | DUPLICATE | STALE | DLQ | SKIPPED
    env: Envelope | None = None
    events: list[Event] = []
    lifetimes: list[LifetimeRow] = []
    error: DecodeError | None = None


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

    def __init__(self, index: Index, max_bytes: int) -> None:
        self.index = index
        self.max_bytes = max_bytes
        self.counters: dict[str, int] = {"messages": 0, "dlq": 0, "skipped_replayed": 0, "offset_holes": 0,
                                         "lifetimes": 0}
        self.dlq_by_reason: dict[str, int] = {}
        self.applied_offset: dict[int, int] = {}  # partition → last offset handled (applied, skipped or DLQ'd)
        self.stream_ts: dict[int, float] = {}  # partition → newest node timestamp applied
        self.ingest_ts: dict[int, float] = {}  # partition → processor clock when it last applied a message

    def handle(self, value: bytes | None, headers, partition: int, offset: int, now: float) -> Result:
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
            events = envelope_events(env, self.max_bytes)
            _check_events(env, events)
        except DecodeError as exc:
            self.counters["dlq"] += 1
            self.dlq_by_reason[exc.kind] = self.dlq_by_reason.get(exc.kind, 0) + 1
            return Result(DLQ, error=exc)
        outcome, lifetimes = self.index.apply(env, events, partition, offset)
        if outcome == APPLIED:
            seen = env.sent_ts if env.sent_ts > env.ts else env.ts
            if seen > self.stream_ts.get(partition, 0.0):
                self.stream_ts[partition] = seen
            self.ingest_ts[partition] = now
            self.counters["lifetimes"] += len(lifetimes)
        return Result(outcome, env, events, lifetimes)

    def forget_partition(self, partition: int) -> None:
        self.index.drop_partition(partition)
        self.applied_offset.pop(partition, None)
        self.stream_ts.pop(partition, None)
        self.ingest_ts.pop(partition, None)


def dlq_headers(error: DecodeError, topic: str, partition: int, offset: int) -> list[tuple[str, bytes]]:
    return [
        (HEADER_DLQ_REASON, f"{error.kind}: {error.message}".encode()),
        (HEADER_SOURCE_TOPIC, topic.encode()),
        (HEADER_SOURCE_PARTITION, str(partition).encode()),
        (HEADER_SOURCE_OFFSET, str(offset).encode()),
    ]
