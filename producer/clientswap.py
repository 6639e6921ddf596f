"""Replacing a node's Kafka client that has lost every broker, with what it held, sent once.

Why a new client: librdkafka drops every broker a metadata answer leaves out, and a single broker in its
controlled shutdown answers with none. A client that asked just then has no broker left to ask. Its re-bootstrap is
meant to add the bootstrap servers back; reproduced here (six producers polling metadata, one broker restarted over
and over), one client in six stayed without any for good after one restart in five, and with re-bootstrap off three
in six after the second (RELIABILITY.md §8). A new client starts from the bootstrap servers.

The publisher (`producer/publisher.py`) decides when: its stall watch got no answer twice and a new client does
(`ClientSwap.cluster_answers`); while the cluster is really down the old client keeps its brokers and reconnects by
itself. An envelope the old client had sent may have reached the broker: sent again it is a duplicate (same epoch
and seq), which consumers skip; so the log is read back first (`producer/logtail.py`), and what it already holds is
not sent again.

Threading: everything here runs on the publisher's sender thread, except `in_transfer`, which `Publisher.flush`
reads (a plain int).
"""
from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kvpipe.producer.logtail import LogTailError, newest_position, reader_config
from kvpipe.schemas.codec import KAFKA_HEADERS, decode_envelope

log = logging.getLogger(__name__)

# How long reading the log back after a client replacement may block the sender thread.
LOG_TAIL_TIMEOUT_S = 10.0


def envelope_position(data: bytes) -> tuple[int, int]:
    """(epoch, seq) of an envelope the publisher encoded."""
    env = decode_envelope(data)
    return env.epoch, env.seq


class ClientSwap:
    """The client replacements of one node's publisher: `config` is the Kafka client's (its delivery callback
    hands purge reports to `collect`), `key` the node's message key."""

    def __init__(self, config: dict, topic: str, key: bytes, node_id: str) -> None:
        self._config = config
        self._topic = topic
        self._key = key
        self._node_id = node_id
        # While a client is replaced: the envelopes its purge hands back, and the partitions they had been given
        # (those may have been sent).
        self._moving: list[bytes] | None = None
        self._moving_partitions: set[int] = set()
        self.in_transfer = 0  # envelopes between the old client and the new one (a flush waits for them)
        self.already_written = 0  # held by a replaced client, found in the log, not sent again
        self.replacements = 0

    def cluster_answers(self, timeout_s: float) -> bool:
        """Whether a new client, from the bootstrap servers, gets the topic's metadata: the cluster is up, so a client
        that gets none has lost its brokers, where one waiting out an outage has not."""
        probe = Producer({k: v for k, v in self._config.items() if k not in ("on_delivery", "error_cb")})
        try:
            probe.list_topics(self._topic, timeout=timeout_s)
            return True
        except KafkaException:
            return False
        finally:
            probe.close()

    def collect(self, err: KafkaError, msg: Message) -> bool:
        """Take a failed delivery report that is an envelope handed back by `replace`'s purge (not a failure: it goes
        out again); False for any other report."""
        moving = self._moving
        if moving is None or err.code() not in (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT):
            return False
        value = msg.value()
        if value is None:
            return False
        moving.append(value)
        partition = msg.partition()
        if partition is not None and partition >= 0:
            self._moving_partitions.add(partition)
        return True

    def replace(self, old: Producer, purge_wait_s: float) -> tuple[Producer, int]:
        """A new client in place of `old`, with the envelopes `old` held, in their order, less the ones the log
        already has; returns it and how many `old` held."""
        moving: list[bytes] = []
        self.in_transfer = len(old)
        self._moving = moving
        self._moving_partitions = set()
        try:
            old.purge(in_queue=True, in_flight=True, blocking=True)
            deadline = time.monotonic() + purge_wait_s
            while len(old) and time.monotonic() < deadline:
                old.poll(0.01)  # serves the purge reports: `collect` takes the envelopes
        finally:
            self._moving = None
        new = Producer(self._config)
        old.close()
        # a node's envelopes are one partition's, so the reports come in order; sorted all the same
        held = sorted(((envelope_position(data), data) for data in moving), key=lambda p: p[0])
        written = self._written_prefix([p for p, _ in held])
        self.already_written += written
        self.in_transfer -= written
        for _, data in held[written:]:
            while True:
                try:
                    new.produce(self._topic, data, self._key, headers=KAFKA_HEADERS)
                    break
                except BufferError:  # the moved envelopes fit the old client's queue; this one's is the same size
                    new.poll(0.05)
            self.in_transfer -= 1
        self.in_transfer = 0
        self.replacements += 1
        return new, len(moving)

    def _written_prefix(self, positions: list[tuple[int, int]]) -> int:
        """How many of the held envelopes (their sorted (epoch, seq)) the log already has: the ones up to the node's
        newest record in the partitions they had been given. 0 when none had one (none was sent) or the log could
        not be read back (then all go out again, and a duplicate is one consumers skip)."""
        if not positions or not self._moving_partitions:
            return 0
        config = reader_config(self._config, self._node_id)
        try:
            found = [newest_position(config, self._topic, p, self._key, envelope_position,
                                     timeout_s=LOG_TAIL_TIMEOUT_S)
                     for p in sorted(self._moving_partitions)]
        except LogTailError as exc:
            log.warning("node %s: the log could not be read back after replacing Kafka's client (%s): all %d held "
                        "envelope(s) go out again", self._node_id, exc, len(positions))
            return 0
        newest = max((f for f in found if f is not None), default=None)
        return 0 if newest is None else sum(1 for p in positions if p <= newest)
