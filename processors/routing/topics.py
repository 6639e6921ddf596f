"""The processor's topics. Values stay raw bytes: decoding is ours (`kvpipe.schemas.codec`), so a bad
message reaches the agent intact and goes to the DLQ byte for byte, instead of failing inside
Faust's deserializer."""
from __future__ import annotations

from kvpipe.processors.routing.app import app, settings

# key = node_id: all of one node's envelopes share a partition, so partitions are independent.
events_topic = app.topic(settings.events_topic, key_type=bytes, value_type=bytes,
                         key_serializer="raw", value_serializer="raw")

# Original bytes + reason headers (`kvpipe.processors.core.ingest.dlq_headers`).
dlq_topic = app.topic(settings.dlq_topic, key_type=bytes, value_type=bytes,
                      key_serializer="raw", value_serializer="raw")

# Compacted; one manifest key per events partition plus its chunks (`kvpipe.processors.core.snapshot`).
snapshot_topic = app.topic(settings.snapshot_topic, key_type=bytes, value_type=bytes,
                           key_serializer="raw", value_serializer="raw")
