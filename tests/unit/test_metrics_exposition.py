"""The routing app's and the bridge's /metrics: prometheus_client's own parser reads them, the
families are labelled (one per concept), names carry units, histograms and process metrics are there."""
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.processors.analytics.metrics import render as render_analytics
from kvpipe.processors.core.index import INDEX_COUNTERS
from kvpipe.processors.routing.metrics import ProcessorMetrics
from kvpipe.producer.bridge.metrics import Counters, render
from kvpipe.producer.bridge.specs import Mismatch


def _stats() -> dict:
    counters = dict.fromkeys(INDEX_COUNTERS, 0) | {"messages": 12, "dlq": 3, "skipped_replayed": 1, "offset_holes": 0,
                                                   "lifetimes": 2, "clock_clamped": 1, "agent_errors": 0,
                                                   "dlq_send_errors": 0}
    counters |= {"envelopes": 7, "duplicates": 1, "stale": 0, "refused_envelopes": 0, "stored": 40, "gaps": 2}
    return {"processor_id": "p", "uptime_s": 5.0, "counters": counters,
            "dlq_by_reason": {"not_msgpack": 2, "bad_envelope": 1},
            "index": {"0": {"GPU": 5, "CPU": 2}, "1": {"GPU": 3}},
            "nodes": {"healthy": 1, "partial": 0, "suspect": 1, "expired": 0},
            "freshness": {"0": {"offset": 9, "behind": 4, "lag_s": 0.5, "since_apply_s": 0.1},
                          "1": {"offset": 0, "behind": None, "lag_s": None, "since_apply_s": None}},
            "durability": {"snapshots": 3, "snapshot_ms_last": 12.5, "snapshot_export_ms_last": 4.0,
                           "snapshot_bytes_last": 2048,
                           "restores": [], "restore_errors": 0, "snapshot_errors": 2, "snapshot_ok_ts": 1.7e9},
            "router": {"inflight": {"sent": 4, "finished": 3, "expired": 0, "evicted": 0, "confirmed": 9,
                                    "entries": 12, "nodes": 1}}}


def _samples(text: str) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def test_processor_exposition_parses_with_labelled_families():
    m = ProcessorMetrics()
    m.watch(_stats)
    m.route_latency.labels("local").observe(0.002)
    m.observe_applied(sent_ts=100.0, ts=99.0, now=100.25)
    m.observe_applied(sent_ts=0.0, ts=99.0, now=100.0)  # an old publisher without sent_ts: the batch ts
    text = m.render().decode()
    samples, families = _samples(text), _families(text)

    assert samples[("kvpipe_processor_envelopes_total", (("outcome", "applied"),))] == 7
    assert samples[("kvpipe_processor_envelopes_total", (("outcome", "duplicate"),))] == 1
    assert samples[("kvpipe_processor_envelopes_total", (("outcome", "dlq"),))] == 3
    assert samples[("kvpipe_processor_stream_anomalies_total", (("kind", "seq_gap"),))] == 2
    # one DLQ family, labelled; its sum is the DLQ total
    assert sum(v for (n, _), v in samples.items() if n == "kvpipe_processor_dlq_messages_total") == 3
    assert not any(n.startswith("kvpipe_processor_dlq_total") for n, _ in samples)
    assert samples[("kvpipe_processor_index_blocks", (("group", "0"), ("medium", "CPU")))] == 2
    assert samples[("kvpipe_processor_nodes", (("state", "suspect"),))] == 1
    assert samples[("kvpipe_processor_partition_lag_messages", (("partition", "0"),))] == 4
    assert ("kvpipe_processor_partition_lag_messages", (("partition", "1"),)) not in samples  # unknown, not 0
    assert samples[("kvpipe_processor_snapshot_last_duration_seconds", ())] == 0.0125
    assert samples[("kvpipe_processor_snapshot_last_export_seconds", ())] == 0.004
    assert samples[("kvpipe_processor_snapshot_last_size_bytes", ())] == 2048
    assert samples[("kvpipe_processor_snapshots_total", ())] == 3
    assert samples[("kvpipe_processor_snapshot_errors_total", ())] == 2
    assert samples[("kvpipe_processor_snapshot_last_success_timestamp_seconds", ())] == 1.7e9
    assert samples[("kvpipe_processor_router_inflight_requests_total", (("event", "sent"),))] == 4
    assert samples[("kvpipe_processor_router_inflight_entries", ())] == 12
    assert families["kvpipe_processor_route_latency_seconds"] == "histogram"
    assert samples[("kvpipe_processor_route_latency_seconds_count", (("scope", "local"),))] == 1
    assert samples[("kvpipe_processor_freshness_seconds_count", ())] == 2
    assert samples[("kvpipe_processor_freshness_seconds_sum", ())] == 1.25
    assert "process_cpu_seconds_total" in {n for n, _ in samples}
    # no help text of the old generic form, every family documented
    assert "processor counter" not in text
    for family in text_string_to_metric_families(text):
        assert family.documentation, family.name
        assert family.name.startswith(("kvpipe_processor_", "process_")), family.name


def test_two_registries_do_not_collide():
    a, b = ProcessorMetrics(), ProcessorMetrics()
    a.freshness.observe(1.0)
    assert "kvpipe_processor_freshness_seconds_count 0.0" in b.render().decode()


def test_bridge_exposition_parses():
    c = Counters(batches=5, events=40, replayed=1, dlq=2, dlq_failed=1)
    mismatch = Mismatch(group_idx=1, field="sliding_window", declared="128", observed="none")
    text = render([("n1/dp0", c, [mismatch]), ("n1/dp1", Counters(), [])])
    samples, families = _samples(text), _families(text)
    assert samples[("kvpipe_bridge_batches_total", (("node", "n1/dp0"),))] == 5
    assert samples[("kvpipe_bridge_batches_total", (("node", "n1/dp1"),))] == 0
    assert samples[("kvpipe_bridge_replayed_batches_total", (("node", "n1/dp0"),))] == 1
    assert samples[("kvpipe_bridge_dlq_messages_total", (("node", "n1/dp0"), ("outcome", "sent")))] == 2
    assert samples[("kvpipe_bridge_dlq_messages_total", (("node", "n1/dp0"), ("outcome", "failed")))] == 1
    key = ("kvpipe_bridge_spec_mismatch", (("declared", "128"), ("field", "sliding_window"), ("group", "1"),
                                           ("node", "n1/dp0"), ("observed", "none")))
    assert samples[key] == 1
    assert families["kvpipe_bridge_batches"] == "counter"
    assert "process_resident_memory_bytes" in {n for n, _ in samples}


def test_one_naming_scheme_across_the_three_apps():
    processor = ProcessorMetrics()
    processor.watch(_stats)
    analytics_stats = {"sink": {"kv_events_written": 1, "kv_events_submitted": 1, "kv_block_lifetimes_written": 0,
                                "kv_block_lifetimes_submitted": 0, "retries": 0, "room_wait_s": 0.0},
                       "store": {"up": True, "reason": "", "pending_rows": 0, "max_queue_rows": 10},
                       "freshness": {"0": {"offset": 1, "lag_messages": 0}}, "durability": {"snapshots": 0},
                       "counters": {"snapshot_skips": 0}, "dlq_by_reason": {}}
    texts = {"processor": processor.render().decode(), "analytics": render_analytics(lambda: analytics_stats).decode(),
             "bridge": render([("n/dp0", Counters(), [])])}
    for app, text in texts.items():
        families = list(text_string_to_metric_families(text))
        ours = [f for f in families if not f.name.startswith("process_")]
        assert ours and all(f.name.startswith(f"kvpipe_{app}_") for f in ours), (app, [f.name for f in ours])
        assert any(f.name == "process_cpu_seconds" for f in families), app  # prometheus_client's process collector
        for f in ours:
            if f.type == "counter":
                assert all(s.name.endswith(("_total", "_created")) for s in f.samples), f.name
