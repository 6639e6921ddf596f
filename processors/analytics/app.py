"""The analytics app: a second Faust app, in its own consumer group, on the events topic.

It runs the same pure index code as the routing app (`kvpipe.processors.core.ingest`, `kvpipe.processors.core.index`) to
derive event rows and block lifetimes, and writes them to ClickHouse through `AnalyticsSink`. It
shares no process, no consumer group and no progress with the routing app: a slow or failing
store makes this app lag, never the index stall or drop (docs/architecture.md §1).

Reading order: app (this module, with the topics) → state → agents → views. Settings are read
once, here, at import (the CLI puts its flags into the `KVPIPE_*` environment first). Nothing here
imports `kvpipe.processors.routing.app` (the routing app): the two apps never share a Faust app object.
"""
from __future__ import annotations

import faust

from kvpipe.processors.core import batchdelivery, fastpath, webauth
from kvpipe.processors.core.kafkaconf import faust_broker_kwargs
from kvpipe.schemas.settings import load_settings

settings = load_settings()

# A stall while the store refuses may last as long as the outage. aiokafka drops a member whose
# fetcher has not polled for max_poll_interval (Faust's default: 1000 s), and our drain loop stops
# polling once the agent waits for the sink and the stream buffer is full. A week keeps the worker
# in its group through any outage the events topic's retention can cover; a worker that really
# dies is still noticed by the session timeout (heartbeats run on their own task). Checked with a
# 75 s outage (ANALYTICS_OUTAGE_S=75 tests/fault/test_analytics_store_outage.py): no rebalance, no
# restore, every row written after recovery.
MAX_STALL_S = 7 * 24 * 3600.0

app = faust.App(
    settings.analytics_id,
    broker=f"kafka://{settings.bootstrap()}",
    store="memory://",  # progress is snapshots of our own index (kvpipe.processors.core.durability), not tables
    datadir=str(settings.state_path("analytics-app", settings.analytics_id)),
    web_host=settings.web_host,
    web_bind=settings.web_host,
    web_port=settings.analytics_web_port,
    topic_partitions=settings.partitions,
    topic_disable_leader=True,
    consumer_auto_offset_reset="earliest",
    broker_max_poll_records=1000,
    stream_buffer_maxsize=4096,
    broker_session_timeout=10.0,
    broker_max_poll_interval=MAX_STALL_S,
    # A rebalance must not wait for an agent that awaits the store: the message it holds is
    # covered by no snapshot, so the partition's next owner replays it.
    stream_wait_empty=False,
    # `faust -A <this module> worker` imports only this module; discovery imports the agents and
    # views so Faust's own worker runs what `kvpipe` runs (a list, not the package: scanning the
    # whole package would import the other app too).
    autodiscover=["kvpipe.processors.analytics.agents", "kvpipe.processors.analytics.views"],
    Monitor=fastpath.QuietMonitor,
    **faust_broker_kwargs(settings),
)

webauth.install(app, settings)  # bearer token on /sql, /stats, /metrics; Faust's own pages off

# Before anything builds the consumer: how fetched messages reach the row path, as in the routing app
# (processors/routing/app.py): "batch", a partition's fetched run per call to the handler agents.py puts in
# `batch_handlers`; "message", or a Faust version that was not checked: one at a time through the agent's stream.
# Either way with fuller fetches under load.
batch_handlers: dict[str, batchdelivery.BatchHandler] = {}
fetch = (settings.fetch_min_bytes, settings.fetch_max_wait_ms)
if not (settings.processor_delivery == "batch" and batchdelivery.install(app, batch_handlers, fetch)):
    fastpath.install(app, fetch)

# -- topics: values stay raw bytes (decoding is ours, `kvpipe.schemas.codec`) --------------------------------

events_topic = app.topic(settings.events_topic, key_type=bytes, value_type=bytes,
                         key_serializer="raw", value_serializer="raw")

# Compacted; this app's own index snapshots, one manifest key per events partition (`kvpipe.processors.core.snapshot`).
snapshot_topic = app.topic(settings.analytics_snapshot_topic, key_type=bytes, value_type=bytes,
                           key_serializer="raw", value_serializer="raw")
