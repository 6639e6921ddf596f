"""Dead letters: raw ZMQ frames the bridge could not forward, with the reason, on the DLQ topic.

The Kafka value is the message's frames as a msgpack array of `bin` (frame count and bytes
exactly as received, so a malformed message can be studied or replayed); the reason, the node and
the format travel as headers. Sending is non-blocking: a full local queue costs the dead letter
(counted by the caller), never the live stream.
"""
from __future__ import annotations

import logging
from typing import Protocol

import msgspec
from confluent_kafka import KafkaException, Producer

HEADER_REASON = "kvpipe-dlq-reason"
HEADER_NODE = "kvpipe-node"
HEADER_SOURCE = "kvpipe-source"
HEADER_FORMAT = "kvpipe-dlq-format"
FORMAT_FRAMES = "zmq-frames+msgpack"

log = logging.getLogger("kvpipe.bridge.dlq")
_encoder = msgspec.msgpack.Encoder()


class DeadLetters(Protocol):
    def send(self, node_id: str, frames: list[bytes], reason: str) -> bool: ...


def encode_frames(frames: list[bytes]) -> bytes:
    return _encoder.encode([bytes(f) for f in frames])


def decode_frames(value: bytes) -> list[bytes]:
    return msgspec.msgpack.decode(value, type=list[bytes])


class KafkaDeadLetters:
    """Thread-safe (confluent-kafka's Producer is); shared by all ranks of a bridge."""

    def __init__(self, bootstrap: str, topic: str, producer_config: dict | None = None) -> None:
        self.topic = topic
        config = {"bootstrap.servers": bootstrap, "linger.ms": 20, "enable.idempotence": True}
        config.update(producer_config or {})
        self._producer = Producer(config)

    def send(self, node_id: str, frames: list[bytes], reason: str) -> bool:
        headers = [(HEADER_REASON, reason.encode()), (HEADER_NODE, node_id.encode()),
                   (HEADER_SOURCE, b"vllm-bridge"), (HEADER_FORMAT, FORMAT_FRAMES.encode())]
        try:
            self._producer.produce(self.topic, encode_frames(frames), key=node_id.encode(), headers=headers)
        except (BufferError, KafkaException) as exc:
            log.warning("node %s: dead letter not queued (%s): %s", node_id, exc, reason)
            return False
        finally:
            self._producer.poll(0)
        return True

    def flush(self, timeout: float = 5.0) -> int:
        return self._producer.flush(timeout)
