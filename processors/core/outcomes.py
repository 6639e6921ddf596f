"""What ingest makes of Kafka records: the outcome of one message (`Result`), of the front of a
run (`Batch`), and the shapes ingest reads (`KafkaRecord`) and notifies (`EventWatcher`).

Apart from `ingest`, so the native run path (`ingestrun`) builds the same values without importing
the reference path that calls it.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence

import msgspec

from kvpipe.processors.core.lifetimes import LifetimeColumns, LifetimeRow
from kvpipe.schemas.codec import DecodeError
from kvpipe.schemas.envelope import Envelope
from kvpipe.schemas.events import Event

DLQ = "dlq"
SKIPPED = "skipped"  # at or below the restored snapshot's offset


class Result(msgspec.Struct, gc=False):
    outcome: str  # index.APPLIED | DUPLICATE | STALE | DLQ | SKIPPED
    env: Envelope | None = None
    events: list[Event] = []
    lifetimes: list[LifetimeRow] | LifetimeColumns = []  # as the index's `lifetimes` mode gives them
    error: DecodeError | None = None


class EventWatcher(Protocol):
    """What ingest tells about applied events: the router's in-flight accounting
    (`kvpipe.processors.router.inflight.InFlight`) implements it. A protocol, so the shared core
    depends on no router module."""

    def on_events(self, node_id: str, events: Iterable[Event], new_epoch: bool = False) -> None: ...

    def tracks(self, node_id: str) -> bool: ...


class KafkaRecord(Protocol):
    """A fetched Kafka record as the client gives it (aiokafka's `ConsumerRecord`)."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None  # milliseconds, as Kafka stores it
    timestamp_type: int  # 1 = LogAppendTime (the broker's clock)
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] | None


class Batch(msgspec.Struct, gc=False):
    """What `Ingest.handle_batch` did with the front of a run of records.

    The run stops right after a record that needs a side effect before the next one is applied
    (a DLQ copy, or a failure of the ingest path itself): the caller sends it, then hands over
    the rest. So side effects happen in offset order, exactly as with one `handle` per message,
    and a snapshot taken while the caller waits never covers a later record than before."""

    handled: int  # records handled, from the front of the run
    published: list[float]  # publish time (`sent_ts`, else `ts`) of each applied envelope
    refused: list[Result]  # REFUSED results (a new node id past `max_nodes`), for the log
    dlq: Result | None = None  # the last handled record is bad input: its DLQ copy is due
    failed: Exception | None = None  # the last handled record broke the ingest path (a bug)
