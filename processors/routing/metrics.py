"""Prometheus metrics of the routing app (`/metrics`), through prometheus_client.

Counts and gauges are read from the `/stats` dict at scrape time by a custom collector, so there is
one set of numbers, not a second set of counters to keep in step with the index. The two things
`/stats` cannot answer, distributions, are real histograms observed where they happen: the route
latency (in the `/route` view) and the freshness of each applied envelope (publish → applied, in
the agent). Every app owns a registry of its own (no global default registry: the tests build many),
with prometheus_client's process collector for `process_*`.

Naming (the same for the analytics app and the bridge): `kvpipe_<app>_<what>_<unit>`, counters end
in `_total` (prometheus_client adds it), one family per concept with labels for the variants.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, Info, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvpipe.processors.core import native
from kvpipe.processors.routing.api import NODE_STATES


# counter key in /stats → outcome label of kvpipe_processor_envelopes_total. Together they account
# for every message the agent handled: applied (heartbeats included), duplicate, stale, refused
# (node cap), dlq (undecodable) and replayed (already covered by a restored snapshot).
ENVELOPE_OUTCOMES = {"envelopes": "applied", "duplicates": "duplicate", "stale": "stale",
                     "refused_envelopes": "refused", "dlq": "dlq", "skipped_replayed": "replayed"}
# counter key → op label of kvpipe_processor_blocks_total (block hashes in applied events)
BLOCK_OPS = {"stored": "stored", "removed": "removed", "unknown_removes": "removed_unknown",
             "partial_unknown_removes": "removed_unknown_partial", "capped_stores": "refused_capped"}
# counter key → kind label of kvpipe_processor_stream_anomalies_total: what a node's stream did that
# the index had to repair or note (each one an occurrence, whatever its size)
ANOMALIES = {"gaps": "seq_gap", "new_epochs": "new_epoch", "resyncs": "resync", "clears": "all_cleared",
             "clock_clamped": "clock_clamped", "offset_holes": "offset_hole"}
# counter key → (family suffix, help) of the plain counters left
PLAIN = {
    "messages": ("messages", "Kafka messages the agent handled (every outcome)"),
    "heartbeats": ("heartbeats", "applied envelopes that carried no events"),
    "events": ("kv_events", "vLLM KV events in applied envelopes"),
    "dropped_events": ("producer_dropped_events", "events the publishers report they had to drop"),
    "lost_batches": ("producer_lost_batches", "vLLM batches the bridges report lost"),
    "lifetimes": ("lifetimes_closed", "block lifetimes closed (a block's last copy removed)"),
    "agent_errors": ("agent_errors", "messages that broke the ingest path (a bug; sent to the DLQ)"),
    "dlq_send_errors": ("dlq_send_errors", "DLQ copies the broker refused or could not be sent"),
    "dlq_sent": ("dlq_records_written", "DLQ copies the broker acknowledged"),
    "dlq_already_written": ("dlq_already_written", "DLQ copies not sent because a replay after a restore met a "
                            "bad message whose copy the DLQ already held (processors/routing/dlqtail.py)"),
}
NODE_TRANSITIONS = {"expired_nodes": "expired", "forgotten_nodes": "forgotten"}

# Route answers are an in-memory lookup plus, for the group view, one HTTP hop per peer worker.
ROUTE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Publish → applied: milliseconds when caught up; minutes to hours while a backlog is replayed.
FRESHNESS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0)


class StatsCollector:
    """Families built from one `/stats` dict (`kvpipe.processors.routing.state.collect_stats`) per scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]], prefix: str = "kvpipe_processor") -> None:
        self.stats = stats
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        yield from stats_families(self.stats(), self.prefix)


def stats_families(s: dict[str, Any], prefix: str = "kvpipe_processor") -> Iterator[Metric]:
    c = s["counters"]

    def labelled(name: str, help_text: str, label: str, keys: dict[str, str]) -> CounterMetricFamily:
        family = CounterMetricFamily(f"{prefix}_{name}", help_text, labels=[label])
        for key, value in keys.items():
            if key in c:
                family.add_metric([value], c[key])
        return family

    yield labelled("envelopes", "messages handled, by outcome", "outcome", ENVELOPE_OUTCOMES)
    yield labelled("blocks", "block hashes in applied events, by what the index did with them", "op", BLOCK_OPS)
    yield labelled("stream_anomalies", "irregularities in the nodes' streams the index repaired or noted",
                   "kind", ANOMALIES)
    yield labelled("node_transitions", "nodes that went silent past the TTL (expired) or were dropped "
                   "(forgotten)", "to", NODE_TRANSITIONS)
    for key, (suffix, help_text) in PLAIN.items():
        if key in c:
            yield CounterMetricFamily(f"{prefix}_{suffix}", help_text, value=c[key])
    # One DLQ family: the total is its sum (no unlabelled twin counting the same messages).
    # Classifications, not records: a bad message a replay meets again counts again (in a restarted worker, whose
    # counters began at zero, once); its record is written once (dlq_already_written counts the skipped sends).
    dlq = CounterMetricFamily(f"{prefix}_dlq_messages", "bad messages classified for the dead-letter topic, "
                              "by reason", labels=["reason"])
    for reason, n in sorted(s["dlq_by_reason"].items()):
        dlq.add_metric([reason], n)
    yield dlq

    blocks = GaugeMetricFamily(f"{prefix}_index_blocks", "live block keys in the index", labels=["group", "medium"])
    for group, per in sorted(s["index"].items()):
        for medium, n in sorted(per.items()):
            blocks.add_metric([str(group), medium], n)
    yield blocks
    nodes = GaugeMetricFamily(f"{prefix}_nodes", "nodes known to this worker, by state", labels=["state"])
    for state in NODE_STATES:
        nodes.add_metric([state], s["nodes"].get(state, 0))
    yield nodes

    families = {
        "offset": GaugeMetricFamily(f"{prefix}_partition_offset", "last events offset handled", labels=["partition"]),
        "behind": GaugeMetricFamily(f"{prefix}_partition_lag_messages",
                                    "messages in the partition not yet handled (high watermark - offset - 1)",
                                    labels=["partition"]),
        "lag_s": GaugeMetricFamily(f"{prefix}_partition_lag_seconds",
                                   "worker clock minus the newest timestamp applied from the partition",
                                   labels=["partition"]),
        "since_apply_s": GaugeMetricFamily(f"{prefix}_partition_idle_seconds",
                                           "time since the worker last applied a message of the partition",
                                           labels=["partition"]),
    }
    for partition, f in sorted(s["freshness"].items()):
        for key, family in families.items():
            if f.get(key) is not None:  # unknown yet (no high watermark, nothing applied)
                family.add_metric([str(partition)], f[key])
    yield from families.values()

    d = s["durability"]
    yield CounterMetricFamily(f"{prefix}_snapshots", "partition snapshots written", value=d["snapshots"])
    yield GaugeMetricFamily(f"{prefix}_snapshot_last_duration_seconds", "time the last snapshot round took",
                            value=d["snapshot_ms_last"] / 1000.0)
    if "snapshot_export_ms_last" in d:  # the loop is held for the export: ingest and web requests wait that long
        yield GaugeMetricFamily(f"{prefix}_snapshot_last_export_seconds", "longest partition export of the last "
                                "snapshot round (ingest waited that long)", value=d["snapshot_export_ms_last"] / 1000.0)
    yield GaugeMetricFamily(f"{prefix}_snapshot_last_size_bytes", "bytes the last snapshot round wrote",
                            value=d["snapshot_bytes_last"])
    yield CounterMetricFamily(f"{prefix}_snapshot_restore_errors", "snapshots that could not be restored "
                              "(the partition was rebuilt from the events topic instead)", value=d["restore_errors"])
    if "snapshot_errors" in d:  # rounds that failed or timed out (a full disk, a broker that does not acknowledge)
        yield CounterMetricFamily(f"{prefix}_snapshot_errors", "snapshot rounds that failed; the previous snapshot "
                                  "stays the restore point", value=d["snapshot_errors"])
        if d.get("snapshot_ok_ts"):
            yield GaugeMetricFamily(f"{prefix}_snapshot_last_success_timestamp_seconds",
                                    "when the last snapshot round succeeded (Unix time)", value=d["snapshot_ok_ts"])
    readback = s.get("dlq_readback")
    if readback:  # the DLQ read back at restore (processors/routing/dlqtail.py)
        yield CounterMetricFamily(f"{prefix}_dlq_readback_records", "DLQ records read back at restores",
                                  value=readback["records_read"])
        yield CounterMetricFamily(f"{prefix}_dlq_readback_errors", "reads of the DLQ at restore that failed (the "
                                  "replay may write duplicate DLQ copies)", value=readback["errors"])
        if readback.get("last"):
            yield GaugeMetricFamily(f"{prefix}_dlq_readback_last_duration_seconds", "time the last read of the DLQ "
                                    "at restore took", value=readback["last"]["ms"] / 1000.0)
    inflight = s.get("router", {}).get("inflight")
    if inflight:  # the router's in-flight accounting (processors/router/inflight.py)
        requests = CounterMetricFamily(f"{prefix}_router_inflight_requests", "requests reported sent to a node, "
                                       "by what ended their speculation", labels=["event"])
        for event in ("sent", "finished", "expired", "evicted", "confirmed"):
            requests.add_metric([event], inflight.get(event, 0))
        yield requests
        yield GaugeMetricFamily(f"{prefix}_router_inflight_entries", "speculative (node, group, hash) entries held",
                                value=inflight.get("entries", 0))
    if "uptime_s" in s:
        yield GaugeMetricFamily(f"{prefix}_uptime_seconds", "time since the worker started", value=s["uptime_s"])


def engine_info(prefix: str, registry: CollectorRegistry) -> None:
    """`<prefix>_engine_info{engine, reason}` = 1: the native core or the Python engine (the reference) runs the index
    and its searches, and why not native (`kvpipe.processors.core.native`); an alert can watch for "python"."""
    status = native.status()
    Info(f"{prefix}_engine", "the engine the index runs on (native: the native core; python: the reference) and why "
         "not native", registry=registry).info({"engine": status.engine, "reason": status.reason})


class ProcessorMetrics:
    """The routing app's registry: process metrics, the two histograms and (once `watch` is
    called) the `/stats` families."""

    def __init__(self, prefix: str = "kvpipe_processor") -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        self.route_latency = Histogram(f"{prefix}_route_latency_seconds",
                                       "time to answer POST /route (the group view includes the peer workers)",
                                       ["scope"], buckets=ROUTE_BUCKETS, registry=self.registry)
        self.freshness = Histogram(f"{prefix}_freshness_seconds",
                                   "publish to applied: worker clock at apply minus the envelope's sent_ts",
                                   buckets=FRESHNESS_BUCKETS, registry=self.registry)
        engine_info(prefix, self.registry)
        self.prefix = prefix

    def watch(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(StatsCollector(stats, self.prefix))

    def observe_applied(self, sent_ts: float, ts: float, now: float) -> None:
        """One applied envelope; `sent_ts` is 0 from publishers that do not set it (then the batch's ts)."""
        published = sent_ts or ts
        if published > 0:
            self.freshness.observe(max(0.0, now - published))  # a node clock ahead of ours reads as 0

    def observe_published(self, published: list[float], now: float) -> None:
        """Applied envelopes by their publish times (`Batch.published`), all routable at `now`."""
        observe = self.freshness.observe
        for t in published:
            if t > 0:
                observe(now - t if now > t else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
