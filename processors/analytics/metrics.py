"""Prometheus exposition of the analytics app's `/stats`, through prometheus_client.

A custom collector reads the stats dict at scrape time (no second set of counters to keep in
step): one family per concept, labelled by table and partition, base units in the names.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvpipe.processors.core import native

TABLES = ("kv_events", "kv_block_lifetimes")


class AnalyticsCollector:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        sink, store = s["sink"], s["store"]
        written = CounterMetricFamily("kvpipe_analytics_rows_written", "rows the store acknowledged", labels=["table"])
        submitted = CounterMetricFamily("kvpipe_analytics_rows_submitted", "rows derived and queued for the store",
                                        labels=["table"])
        for t in TABLES:
            written.add_metric([t], sink[f"{t}_written"])
            submitted.add_metric([t], sink[f"{t}_submitted"])
        yield written
        yield submitted
        yield CounterMetricFamily("kvpipe_analytics_write_retries", "inserts retried because the store refused",
                                  value=sink["retries"])
        up = GaugeMetricFamily("kvpipe_analytics_store_up", "1 while the store acknowledges inserts; 0 while it "
                               "refuses (label: the reason)", labels=["reason"])
        up.add_metric(["" if store["up"] else store["reason"][:200]], 1.0 if store["up"] else 0.0)
        yield up
        yield GaugeMetricFamily("kvpipe_analytics_queue_rows", "rows waiting for the store's acknowledgement",
                                value=store["pending_rows"])
        yield GaugeMetricFamily("kvpipe_analytics_queue_limit_rows", "queued rows at which consumption pauses",
                                value=store["max_queue_rows"])
        yield CounterMetricFamily("kvpipe_analytics_room_wait_seconds", "time the agent waited for room in the sink",
                                  value=sink["room_wait_s"])
        lag = GaugeMetricFamily("kvpipe_analytics_partition_lag_messages", "events not yet turned into rows",
                                labels=["partition"])
        offset = GaugeMetricFamily("kvpipe_analytics_partition_offset", "last events offset handled",
                                   labels=["partition"])
        for p, f in s["freshness"].items():
            if f["lag_messages"] is not None:
                lag.add_metric([p], f["lag_messages"])
            offset.add_metric([p], f["offset"])
        yield lag
        yield offset
        yield CounterMetricFamily("kvpipe_analytics_snapshots", "snapshots written (each claims acknowledged rows only)",
                                  value=s["durability"]["snapshots"])
        yield CounterMetricFamily("kvpipe_analytics_snapshot_skips",
                                  "snapshots not written because the store had not acknowledged the rows",
                                  value=s["counters"]["snapshot_skips"])
        dlq = CounterMetricFamily("kvpipe_analytics_undecodable_messages", "messages without rows (bad input)",
                                  labels=["reason"])
        for reason, n in sorted(s["dlq_by_reason"].items()):
            dlq.add_metric([reason], n)
        yield dlq


def render(stats: Callable[[], dict[str, Any]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)  # process_* (the same on every kvpipe app)
    # the native core or the Python engine (the reference) runs this app's index, and why not native
    status = native.status()
    Info("kvpipe_analytics_engine", "the engine the index runs on (native: the native core; python: the reference) "
         "and why not native", registry=registry).info({"engine": status.engine, "reason": status.reason})
    registry.register(AnalyticsCollector(stats))
    return generate_latest(registry)
