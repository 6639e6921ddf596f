"""What both Faust apps (the routing app and the analytics app) do around partition ownership: which
events partitions a worker owns, the clock liveness is judged by per partition, and the rebalance
hooks that restore snapshots, position the consumer and hand partitions over.

Faust runs its recovery (which ends in on_rebalance_complete, its seek to the committed offsets and
resuming the streams) concurrently with the on_partitions_assigned signal. So the restore starts on
assignment, and on_rebalance_complete — which Faust awaits before resuming — makes sure it has
finished (restore is idempotent and locked) before positioning the consumer
(`kvpipe.processors.core.durability` says why the position is set by a commit).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable

from faust.types import TP

from kvpipe.processors.core.durability import Durability
from kvpipe.processors.core.ingest import Ingest


def owned_partitions(app, events_topic: str) -> list[int]:
    return sorted(tp.partition for tp in app.consumer.assignment() if tp.topic == events_topic)


def partition_now(app, ingest: Ingest, events_topic: str, partition: int, now: float) -> float:
    """The clock liveness is judged by: the wall clock once the partition is caught up, else the
    newest node time applied from it. A worker replaying a backlog must not expire nodes whose
    envelopes are merely queued behind."""
    try:
        caught_up = ingest.applied_offset[partition] + 1 >= app.consumer.highwater(TP(events_topic, partition))
    except Exception:  # not assigned / no fetch yet
        caught_up = False
    return now if caught_up else ingest.stream_ts.get(partition, 0.0)


def connect(app, durability: Durability, ingest: Ingest, events_topic: str,
            snapshot_revoked: Callable[[list[int]], Awaitable[None]]) -> None:
    """Register the three rebalance hooks on `app`. `snapshot_revoked(partitions)` writes the last
    snapshot of partitions another worker is about to own (each app has its own flush rule)."""

    @app.on_partitions_assigned.connect
    async def restore_assigned(app, assigned, **kwargs) -> None:
        await durability.restore(sorted(tp.partition for tp in assigned if tp.topic == events_topic))

    @app.on_rebalance_complete.connect
    async def seek_restored(app, **kwargs) -> None:
        await durability.restore(owned_partitions(app, events_topic))
        await durability.apply_seeks(app.consumer, TP)

    @app.on_partitions_revoked.connect
    async def hand_over_revoked(app, revoked, **kwargs) -> None:
        gone = sorted(tp.partition for tp in revoked if tp.topic == events_topic)
        if not gone:
            return
        try:
            await snapshot_revoked(gone)
        finally:
            for p in gone:  # another worker owns them now; it restores them from the snapshot
                ingest.forget_partition(p)
                durability.owned.discard(p)
