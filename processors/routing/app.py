"""The Faust app. Settings are read once, here, at import (the CLI puts its flags into the
`KVPIPE_*` environment first), so every module below sees one configuration.

Reading order: app (this module) → topics → state (the in-memory index: our "tables") → agents →
views. Importing `kvpipe.processors.routing.views` and `kvpipe.processors.routing.agents` registers everything on `app`.
"""
from __future__ import annotations

import faust

from kvpipe.processors.core import batchdelivery, fastpath, webauth
from kvpipe.processors.core.kafkaconf import faust_broker_kwargs
from kvpipe.processors.router.decide import set_default_search
from kvpipe.schemas.settings import load_settings

settings = load_settings()
set_default_search(settings.route_search_engine)  # native unless set to "python" or not built

app = faust.App(
    settings.processor_id,
    broker=f"kafka://{settings.bootstrap()}",
    store="memory://",  # the index is not a Faust table (see kvpipe.processors.core.durability)
    datadir=str(settings.state_path("processor", settings.processor_id)),
    web_host=settings.web_host,
    web_bind=settings.web_host,
    web_port=settings.web_port,
    topic_partitions=settings.partitions,
    topic_disable_leader=True,  # no leader-only timers; saves an internal topic the broker would not auto-create
    consumer_auto_offset_reset="earliest",
    producer_max_request_size=max(settings.max_message_bytes, 2 * 1024 * 1024),
    # One message carries a whole node step; bigger fetches keep the agent fed on 2 cores.
    broker_max_poll_records=2000,
    stream_buffer_maxsize=8192,
    # A SIGKILLed worker's partitions move (or come back to its restart) after this long, not
    # after Faust's default 60 s.
    broker_session_timeout=10.0,
    # `faust -A <this module> worker` imports only this module; discovery imports the agents and
    # views so Faust's own worker runs what `kvpipe` runs (a list, not the package: scanning the
    # whole package would import the other app too).
    autodiscover=["kvpipe.processors.routing.agents", "kvpipe.processors.routing.views", "kvpipe.processors.routing.routeserve"],
    Monitor=fastpath.QuietMonitor,  # Faust's per-event statistics: ~6% of the worker, unread
    **faust_broker_kwargs(settings),  # Kafka TLS/SASL (docs/security.md)
)
# Before anything builds the web server: the bearer token, and no Faust built-in pages.
webauth.install(app, settings)

# Before anything builds the consumer: how fetched messages reach the index. "batch": a partition's
# fetched run per call to the handler agents.py puts in `batch_handlers` (kvpipe.processors.core.batchdelivery);
# "message", or a Faust version that was not checked: one at a time through the agent's stream, without
# Faust's two tasks per message (kvpipe.processors.core.fastpath).
batch_handlers: dict[str, batchdelivery.BatchHandler] = {}
fetch = (settings.fetch_min_bytes, settings.fetch_max_wait_ms)
if not (settings.processor_delivery == "batch" and batchdelivery.install(app, batch_handlers, fetch)):
    fastpath.install(app, fetch)
