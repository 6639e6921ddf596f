"""The analytics app's state: its own index (to know when each block was stored), the ingest
bookkeeping, the snapshot machinery, the sink and the analyst query executor. One per worker."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvpipe.processors.analytics.app import settings
from kvpipe.processors.analytics.query import AnalystQueries, QueryLimits
from kvpipe.processors.analytics.cputier import CapacityTracker, CapacityTracking
from kvpipe.processors.analytics.derive import RunRows
from kvpipe.processors.core import native

from kvpipe.processors.analytics.restores import RestoreTracker
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.processors.core.durability import Durability
from kvpipe.processors.core.appindex import index_from_settings
from kvpipe.processors.core.ingest import Ingest

if TYPE_CHECKING:  # imported where it is built: it needs the native core
    from kvpipe.processors.analytics.nativetrack import NativeCapacityTracker



class AnalyticsDurability(Durability):
    """The snapshots of `kvpipe.processors.core.durability`, and: restoring a partition's index slice drops the re-store
    tracker's state for it, since that state describes whatever this worker consumed before, not the restored
    offset. The agents rebuild it for the restored offset (`agents.ensure_tracker`, `restore_state`)."""

    def __init__(self, *args, tracker: RestoreTracker | CapacityTracking | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tracker = tracker

    async def _restore_one(self, consumer, p: int) -> None:
        # Durability._restore_one is where a partition's slice is replaced; tests/integration/
        # test_capacity_restart.py fails if this stops being called there
        if self.tracker is not None:
            self.tracker.forget_partition(p)
        await super()._restore_one(consumer, p)


class AnalyticsRuntime:
    def __init__(self) -> None:
        # the routing app's bounds and clock rule too: one set of lifetimes, epochs and expiries; lifetimes as
        # columns, no object per ended block (processors/core/lifetimes.py)
        self.index = index_from_settings(settings, "kvpipe analytics", lifetimes="columns")
        # native rows: runs of common-case messages applied, tracked and turned into the tables' columns by the
        # native core (native/src/anarows.rs), the rest through `derive.message_rows` (settings.analytics_rows_engine)
        self.native_rows = (settings.analytics_rows_engine == "native" and native.engine() == "native"
                            and self.index.store.kind == "native")
        self.ingest = Ingest(self.index, settings.max_message_bytes, settings.max_clock_skew_s,
                             native_runs=self.native_rows)
        # re-stores and their stack distances (capacity curve), and the CPU tier's copies (cpu_tier_hits);
        # None: KVPIPE_ANALYTICS_CAPACITY=false (events then carry no CPU-tier count: the query's slower way).
        # With native rows its state is native too, which the runs update in place.
        self.restores: CapacityTracker | NativeCapacityTracker | None = None
        if settings.analytics_capacity and self.native_rows:
            from kvpipe.processors.analytics.nativetrack import NativeCapacityTracker  # only with the native core

            self.restores = NativeCapacityTracker()
        elif settings.analytics_capacity:
            self.restores = CapacityTracker()
        self.durability = AnalyticsDurability(self.ingest, settings.bootstrap(), settings.events_topic,
                                              settings.analytics_snapshot_topic, settings.analytics_id,
                                              tracker=self.restores)
        self.sink = AnalyticsSink(settings.clickhouse(), batch_rows=settings.analytics_batch_rows,
                                  flush_s=settings.analytics_flush_s, max_queue_rows=settings.analytics_max_queue_rows,
                                  retry_max_s=settings.analytics_retry_max_s, native_rows=self.native_rows)
        # where the rows of a batch go (processors/core/ingestrun.py: RowsTarget); None: one message at a time
        self.rows = RunRows(self.index, self.restores, self.sink.submit) if self.native_rows else None
        self.tracker_rebuilds: list[dict] = []  # the latest rebuilds of the tracker from the store (/stats)
        self.queries = AnalystQueries(self.sink.query, QueryLimits.from_settings(settings))
        self.started = time.time()
        self.agent_errors = 0
        self.snapshot_skips = 0  # snapshots not written because the store had not acknowledged the rows
        self.last_snapshot_skip = ""


runtime = AnalyticsRuntime()


def collect_stats(rt: AnalyticsRuntime, highwater) -> dict[str, Any]:
    """What `/stats` and `/metrics` report. `highwater(partition)` → end offset or None."""
    now = time.time()
    ing = rt.ingest
    sink = rt.sink.counters()
    freshness = {}
    for p, offset in sorted(ing.applied_offset.items()):
        hw = highwater(p)
        snap = rt.durability.last_gen.get(p)
        freshness[str(p)] = {
            "offset": offset,
            "lag_messages": None if hw is None else max(0, hw - offset - 1),
            "lag_s": round(now - ing.stream_ts[p], 3) if p in ing.stream_ts else None,
            "snapshotted": snap is not None,
        }
    store = {"state": sink["store_state"], "up": sink["store_up"], "reason": sink["store_reason"],
             "refusing_for_s": sink.get("refusing_for_s"), "pending_rows": sink["unwritten_rows"],
             "max_queue_rows": sink["max_queue_rows"], "consumption_paused": sink["unwritten_rows"] >= sink["max_queue_rows"]}
    return {
        "app": "analytics",
        "analytics_id": settings.analytics_id,
        "uptime_s": round(now - rt.started, 1),
        "counters": {**rt.index.counters, **ing.counters, "agent_errors": rt.agent_errors,
                     "snapshot_skips": rt.snapshot_skips, "restores": rt.restores.restores if rt.restores else None},
        "dlq_by_reason": dict(ing.dlq_by_reason),
        "store": store,
        "sink": sink,
        "freshness": freshness,
        "durability": {**rt.durability.stats, "last_skip": rt.last_snapshot_skip},
        "restore_tracker": None if rt.restores is None else {
            "loaded_partitions": sorted(rt.restores.loaded), "slots": len(rt.restores.slots),
            "rebuilds": rt.tracker_rebuilds},
    }
