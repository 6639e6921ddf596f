"""Reading a topic back from the beginning, for integration tests."""
from __future__ import annotations

import time

from confluent_kafka import OFFSET_BEGINNING, Consumer, Message, TopicPartition

from kvpipe.schemas.settings import load_settings


def client_config(bootstrap: str, **extra: object) -> dict:
    """A confluent-kafka client config for `bootstrap` with the TLS/SASL settings of the
    environment (KVPIPE_KAFKA_SECURITY_PROTOCOL, ...), so the suite runs against a secured broker."""
    return {**load_settings().kafka_confluent_security(), "bootstrap.servers": bootstrap, **extra}


def consume(bootstrap: str, topic: str, count: int, partitions: int = 1, timeout: float = 20.0) -> list[Message]:
    """The first `count` messages over `partitions` partitions (fewer if the timeout passes)."""
    consumer = Consumer(client_config(bootstrap, **{"group.id": f"reader-{topic}", "enable.auto.commit": False}))
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                out.append(msg)
    finally:
        consumer.close()
    return out
