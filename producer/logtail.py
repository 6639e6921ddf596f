"""How far one node's envelopes reached a partition's log: read back from the log's end.

`ClientSwap.replace` (producer/clientswap.py) purges a Kafka client that lost its brokers and produces what it held again
through a new one. Some of those envelopes may have been sent before the purge: the broker wrote them and the
answer never came back. Produced again they would be duplicates on the topic (a new client is a new
idempotent producer, so the broker cannot tell). A node's envelopes go to one partition in (epoch, seq)
order, so the ones already written are a prefix of what the client held, ending at the node's newest record
in that partition: `newest_position` finds it, reading windows of the partition backwards from its end
until it meets a record of the node.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

# The client properties a reader shares with the publisher's producer (address, TLS, SASL, sockets, logging).
_SHARED_PREFIXES = ("bootstrap.", "security.", "sasl.", "ssl.", "socket.", "broker.", "client.", "logger",
                    "log_level", "log.")


class LogTailError(Exception):
    """The log could not be read back far enough to say (timeout, a read error, or the scan bound)."""


def reader_config(producer_config: dict, node_id: str) -> dict:
    """A consumer's configuration from the publisher's: the same cluster and credentials, no group work."""
    config = {k: v for k, v in producer_config.items() if k.startswith(_SHARED_PREFIXES)}
    config.update({"group.id": f"kvpipe-logtail-{node_id}", "enable.auto.commit": False,
                   "enable.partition.eof": True, "auto.offset.reset": "earliest"})
    return config


def newest_position(config: dict, topic: str, partition: int, key: bytes,
                    position: Callable[[bytes], tuple[int, int]], *, timeout_s: float = 10.0,
                    first_window: int = 1024, max_records: int = 1_000_000) -> tuple[int, int] | None:
    """(epoch, seq) of the newest record with `key` in the partition, None when it holds none.

    Windows of the partition are read backwards from its end (each four times the last) until one holds a record
    with `key`; its last such record is the newest. Raises LogTailError past `timeout_s` or `max_records`."""
    deadline = time.monotonic() + timeout_s
    consumer = Consumer(config)
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=timeout_s)
        end, window, scanned = high, first_window, 0
        while end > low:
            start = max(low, end - window)
            newest = None
            for record_key, value in _read(consumer, topic, partition, start, end, deadline):
                if record_key == key and value is not None:
                    newest = value  # offset order is the node's order: the last one seen is its newest
            if newest is not None:
                try:
                    return position(newest)
                except Exception as exc:  # not an envelope of ours: nothing to say about the held ones
                    raise LogTailError(f"the newest record of {key!r} in partition {partition} is unreadable: "
                                       f"{exc}") from exc
            scanned += end - start
            if scanned >= max_records:
                raise LogTailError(f"no record of {key!r} in the last {scanned} of partition {partition}")
            end, window = start, window * 4
        return None
    except KafkaException as exc:
        raise LogTailError(f"reading partition {partition} of {topic}: {exc.args[0]}") from exc
    finally:
        consumer.close()


def _read(consumer: Consumer, topic: str, partition: int, start: int, end: int, deadline: float):
    """(key, value) of the records at offsets [start, end)."""
    consumer.assign([TopicPartition(topic, partition, start)])
    at = start
    while at < end:
        if time.monotonic() > deadline:
            raise LogTailError(f"partition {partition} of {topic} not read to offset {end} in time (at {at})")
        for msg in consumer.consume(500, timeout=0.5):
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    eof = msg.offset()
                    if eof is None or eof >= at:  # the log's end, past everything asked for (an older one is stale)
                        at = end
                    continue
                raise LogTailError(f"reading partition {partition} of {topic}: {err.str()}")
            offset = msg.offset()
            if offset is None or offset >= end:
                at = end
                break
            at = offset + 1
            yield msg.key(), msg.value()
