"""The confluent-kafka producer configuration kvpipe publishes with, and failure descriptions.

Shared by the Publisher and the producer benchmark's raw baseline, so the two run the same
configuration by construction.
"""
from __future__ import annotations

from typing import Any

from kvpipe.schemas.codec import DecodeError, decode_envelope
from kvpipe.schemas.logsetup import librdkafka_logging
from kvpipe.schemas.settings import Settings


def kafka_config(settings: Settings, node_id: str, overrides: dict | None = None) -> dict[str, Any]:
    """The producer configuration the publisher runs with (the benchmark's baseline uses it too)."""
    config: dict[str, Any] = {
        **settings.kafka_confluent_config(),  # bootstrap.servers + TLS/SASL (docs/security.md)
        "client.id": f"kvpipe-{node_id}",
        # Idempotence + acks=all: retries after a broker hiccup neither duplicate nor reorder.
        "enable.idempotence": True,
        "acks": "all",
        "compression.type": settings.compression,
        "linger.ms": settings.linger_ms,
        # We enforce max_message_bytes on the envelope ourselves (with a useful message); this
        # only has to leave room for the record batch overhead, as the broker config does.
        "message.max.bytes": settings.max_message_bytes + 64 * 1024,
        **librdkafka_logging(settings.log_format),
    }
    config.update(overrides or {})
    return config


def describe_envelope(value: bytes | None) -> str:
    """`epoch=… seq=…` of a failed envelope (failure path only: decoding costs)."""
    try:
        env = decode_envelope(value or b"")
    except DecodeError:
        return "(undecodable)"
    return f"epoch={env.epoch} seq={env.seq} ({env.num_events} events)"
