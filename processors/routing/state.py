"""The processor's state: the in-memory index (our "tables"), its ingest bookkeeping and the
snapshot machinery. One instance per worker process. No analytics here: ClickHouse rows are the
analytics app's (`kvpipe.processors.analytics`), a separate process and consumer group."""
from __future__ import annotations

import time
from collections import Counter

from kvpipe.processors.routing.api import NODE_STATES, node_state
from kvpipe.processors.routing.app import app, settings
from kvpipe.processors.routing.dlqtail import AlreadyWritten, RoutingDurability
from kvpipe.processors.core.appindex import index_from_settings
from kvpipe.processors.core.ingest import Ingest
from kvpipe.processors.routing.metrics import ProcessorMetrics
from kvpipe.processors.router.inflight import InFlight



class Runtime:
    def __init__(self) -> None:
        # lifetimes are the analytics app's (it runs its own index)
        self.index = index_from_settings(settings, "kvpipe processor", lifetimes=False)
        # one in-flight accounting per worker: it speculates only on nodes this worker's index holds
        self.inflight = InFlight(settings.route_inflight_ttl_s, settings.route_inflight_max_requests,
                                 settings.route_inflight_max_entries)
        self.ingest = Ingest(self.index, settings.max_message_bytes, settings.max_clock_skew_s, self.inflight,
                             native_batches=True)
        # DLQ records already written for messages a restore's replay meets again (processors/routing/dlqtail.py)
        self.dlq_written = AlreadyWritten()
        self.durability = RoutingDurability(self.ingest, settings.bootstrap(), settings.events_topic,
                                            settings.snapshot_topic, settings.processor_id, settings.snapshot_timeout_s,
                                            dlq_topic=settings.dlq_topic, written=self.dlq_written,
                                            flush=lambda: app.producer.flush())
        self.started = time.time()
        self.agent_errors = 0
        # DLQ sends: acknowledged, failed, and skipped because a replay met a message whose record was there
        self.dlq_sent = 0
        self.dlq_send_errors = 0
        self.dlq_already_written = 0
        self.metrics = ProcessorMetrics()  # /metrics (kvpipe.processors.routing.views); histograms observed where things happen


runtime = Runtime()


def owned_partitions() -> list[int]:
    """Partitions this worker's index answers for: restored and still assigned."""
    try:
        assigned = {tp.partition for tp in app.consumer.assignment() if tp.topic == settings.events_topic}
    except Exception:  # no consumer yet
        return []
    return sorted(runtime.durability.owned & assigned)


def expected_partitions() -> range:
    try:
        n = app.consumer.topic_partitions(settings.events_topic)
    except Exception:
        n = None
    return range(n or settings.partitions)


def collect_stats(rt: Runtime, highwater) -> dict:
    """Everything `/stats` and `/metrics` report. `highwater(partition)` → end offset or None."""
    now = time.time()
    ing = rt.ingest
    counters = {**rt.index.counters, **ing.counters, "agent_errors": rt.agent_errors, "dlq_sent": rt.dlq_sent,
                "dlq_send_errors": rt.dlq_send_errors, "dlq_already_written": rt.dlq_already_written}
    nodes = rt.index.nodes.values()
    freshness = {}
    for p, offset in sorted(ing.applied_offset.items()):
        hw = highwater(p)
        freshness[str(p)] = {
            "offset": offset,
            "behind": None if hw is None else max(0, hw - offset - 1),
            "lag_s": round(now - ing.stream_ts[p], 3) if p in ing.stream_ts else None,
            "since_apply_s": round(now - ing.ingest_ts[p], 3) if p in ing.ingest_ts else None,
        }
    return {
        "processor_id": settings.processor_id,
        "uptime_s": round(now - rt.started, 1),
        "counters": counters,
        "dlq_by_reason": dict(ing.dlq_by_reason),
        "index": rt.index.sizes(),
        "index_store": {"kind": rt.index.store.kind, "entries": rt.index.store.entries(),
                        "memory_bytes": rt.index.store.memory_bytes()},
        "nodes": {state: 0 for state in NODE_STATES} | Counter(node_state(n) for n in nodes),
        "freshness": freshness,
        "durability": rt.durability.stats,
        "dlq_readback": {**rt.durability.dlq_tail, "pending": rt.dlq_written.entries()},
        "router": {"inflight": {**rt.inflight.counters, "entries": rt.inflight.entries,
                                "nodes": len(rt.inflight.nodes())}},
    }
