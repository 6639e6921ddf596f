"""`Ingest.handle_batch` on the native run: a partition's records handled in one native call while
each is the common case, the others through `Ingest.handle` one at a time.

The common case (native/src/ingestrun.rs reads it, native/src/envelope.rs decodes the envelope):
a record of the run's partition past the applied offset, with acceptable headers, whose envelope
is in the native reader's strict subset (a map-layout batch or a heartbeat; no group specs, hash
configuration, dropped events or lost batches) and passes validation, from a node the index
knows, not expired, not tracked in flight, in the same epoch at seq last + 1, with the model it
has (or none), whose timestamps need no clamp and come within `ttl_s` of its last ones, every
event a store or a remove into a slot the node already has. Those are exactly the records for
which `Index.apply` takes none of its other branches, so applying them natively and adding up
their counters gives what `handle` one record at a time gives. Records at or below the applied
offset are skipped as `handle` skips them.

The first record outside the common case stops the native run before anything of it is applied:
it goes through `Ingest.handle` (with the clock reading the run already took for it, if any), and
the next run starts after it. Per node, the Python state (`NodeState`) is brought up to date once
per run from the summary the native side returns, before any `handle` call reads it.

The reference (`Ingest._handle_batch_each`, every record through `handle`) stays: it runs where
the native run cannot (the dict store, the Python engine, `native_runs=False`), and
tests/property/test_native_ingest_run.py holds the two equal.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

from kvpipe.processors.core import native
from kvpipe.processors.core.index import APPLIED, REFUSED, NodeState
from kvpipe.processors.core.slots import NativeStore
from kvpipe.processors.core.outcomes import DLQ, Batch, KafkaRecord
from kvpipe.schemas.codec import KAFKA_HEADERS

if TYPE_CHECKING:
    from kvpipe.processors.core.ingest import Ingest
    from kvpipe.processors.core.outcomes import Result

_HEADERS = [(k, bytes(v)) for k, v in KAFKA_HEADERS]


class RowsTarget(Protocol):
    """Where the analytics app wants the rows of what a batch applies (processors/analytics/agents.py): a native
    run's rows as they are (`take`), and each record the reference path handled with its result (`derive`, which
    runs the app's Python row path). `tracker`: its capacity tracker's native state, None when tracking is off."""

    tracker: native.CapacityCore | None

    def take(self, rows: native.RunRows) -> None: ...

    def derive(self, record: KafkaRecord, result: Result) -> None: ...


def handle_batch(ingest: Ingest, records: Sequence[KafkaRecord], clock: Callable[[], float] = time.time,
                 rows: RowsTarget | None = None) -> Batch:
    """`Ingest.handle_batch` with native runs (see the module doc); the same `Batch`. With `rows`, the runs also
    build the analytics rows of each record they apply (native/src/anarows.rs) and hand them to `rows.take`; a
    record left to the reference path goes to `rows.derive` with its result, whatever the outcome."""
    records = records if isinstance(records, list) else list(records)
    index = ingest.index
    store = index.store
    if not isinstance(store, NativeStore):
        raise TypeError("native ingest runs need the native index store")
    core, nodes = store.core, index.nodes
    tracks = ingest.inflight.tracks if ingest.inflight is not None else None
    published: list[float] = []
    refused: list = []
    n = len(records)
    i = 0
    while i < n:
        partition = records[i].partition
        last, since = ingest.applied_offset.get(partition), ingest.stream_ts.get(partition, 0.0)
        if rows is None:
            answer = native.ingest_run(core, records, i, partition, last, since, nodes, tracks, clock,
                                       ingest.max_bytes, ingest.max_skew_s, index.ttl_s, index.max_blocks_per_slot,
                                       _HEADERS)
        else:
            answer, run_rows = native.analytics_run(core, records, i, partition, last, since, nodes, clock,
                                                    ingest.max_bytes, ingest.max_skew_s, index.ttl_s,
                                                    index.max_blocks_per_slot, _HEADERS, rows.tracker)
            rows.take(run_rows)  # before anything of the next record: its rows follow these
        (i, now, applied, stream_ts, ingest_ts, pub, counts, changed, error) = answer
        _absorb(ingest, store, partition, applied, stream_ts, ingest_ts, counts, changed)
        published += pub
        if error is not None:
            return Batch(i, published, refused, failed=RuntimeError(f"native ingest run: {error}"))
        if i >= n:
            break
        # the record the run left: the reference path, then the next run after it
        r = records[i]
        i += 1
        ts_ms = r.timestamp
        record_ts = ts_ms / 1000.0 if r.timestamp_type == 1 and ts_ms is not None else None
        try:
            result = ingest.handle(r.value, r.headers, r.partition, r.offset, clock() if now is None else now,
                                   record_ts)
            if rows is not None:
                rows.derive(r, result)
        except Exception as exc:  # noqa: BLE001 - reported by the caller, with the record
            return Batch(i, published, refused, failed=exc)
        outcome = result.outcome
        if outcome == APPLIED:
            env = result.env
            assert env is not None  # an applied message's result carries its envelope
            published.append(env.sent_ts or env.ts)
        elif outcome == DLQ:
            return Batch(i, published, refused, dlq=result)
        elif outcome == REFUSED:
            refused.append(result)
    return Batch(i, published, refused)


def _absorb(ingest: Ingest, store: NativeStore, partition: int, applied: int | None, stream_ts: float,
            ingest_ts: float | None, counts: tuple[int, int, int, int],
            changed: list[native.RunNode[NodeState]]) -> None:
    """What one native run did, into the Python state (`Ingest`, `Index`, each `NodeState`)."""
    messages, skipped, holes, ended = counts
    c = ingest.counters
    if skipped:
        c["skipped_replayed"] += skipped
    if not messages:
        return
    c["messages"] += messages
    c["offset_holes"] += holes
    c["lifetimes"] += ended
    # a run that handled a message applied its offset, at a clock reading (native/src/ingestrun.rs)
    assert applied is not None and ingest_ts is not None
    index = ingest.index
    index.ended += ended
    ingest.applied_offset[partition] = applied
    if stream_ts > ingest.stream_ts.get(partition, 0.0):
        ingest.stream_ts[partition] = stream_ts
    ingest.ingest_ts[partition] = ingest_ts
    ic = index.counters
    cap = index.max_blocks_per_slot
    for node, seq, last_seen, last_offset, totals, dp_rank, load, spec_mismatches, capped in changed:
        node.seq = seq
        node.partition = partition
        node.last_offset = last_offset
        node.last_seen = last_seen
        if dp_rank is not None:
            node.dp_rank = dp_rank
        if load is not None:
            node.load = load
        nc = node.counters
        if spec_mismatches:
            nc["spec_mismatches"] = spec_mismatches
        envelopes, heartbeats, events, stored, removed, unknown = totals
        nc["envelopes"] += envelopes
        ic["envelopes"] += envelopes
        nc["heartbeats"] += heartbeats
        ic["heartbeats"] += heartbeats
        index.count_events(node, events, stored, removed, unknown)
        for sid, n in capped:
            index._capped(node, store.slot_by_id(sid), n, cap)
