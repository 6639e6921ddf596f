"""The node-side Kafka publisher: one envelope per node step, never blocking the step loop.

`publish()` is the serving node's hot path: it only appends `(events, ts, drops_so_far)` to a
bounded deque and returns. A background thread turns queued steps into envelopes (seq assigned
there, see `Sequencer`), encodes them and hands them to confluent-kafka, serves delivery reports
and sends heartbeats when the node is idle. Kafka's own ordering guarantee (idempotent producer,
key = node id) keeps a node's envelopes in seq order on one partition.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgspec
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from kvpipe.producer.clientswap import ClientSwap
from kvpipe.producer.config import describe_envelope, kafka_config
from kvpipe.producer.sequencer import Sequencer
from kvpipe.producer.stall import DeliveryWatch
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_vllm_batch
from kvpipe.schemas.envelope import Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import Event
from kvpipe.schemas.settings import Settings

log = logging.getLogger(__name__)

# Delivery reports are served every this many sends while draining a backlog, so librdkafka's
# report queue (and our counters) never lag far behind.
_POLL_EVERY = 32
# Wait while envelopes are in flight: short, because delivery reports are only served by poll().
_INFLIGHT_WAIT_S = 0.002
_IDLE_WAIT_MAX_S = 0.05
# Failure logging: every failure up to this many, then one summary line per _LOG_EVERY failures,
# so a dead broker does not turn the log into the bottleneck.
_LOG_FIRST = 20
_LOG_EVERY = 1000
# How long a metadata request made for a stalled producer may block the sender thread.
_METADATA_TIMEOUT_S = 2.0


class _RawBatch(msgspec.Struct, gc=False):
    payload: bytes
    num_events: int
    ts: float
    layout: str
    upstream_seq: int | None
    lost_batches: int
    dp_rank: int | None
    dropped_total: int


class _NewEpoch(msgspec.Struct, gc=False):
    epoch: int
    dropped_total: int


class _Specs(msgspec.Struct):
    specs: list[GroupSpec]
    hash_config: HashConfig | None


class Publisher:
    """Publishes one node's KV events to Kafka.

    Threading: one producer thread calls publish/publish_raw/new_epoch/set_group_specs; the
    background thread owns the Sequencer, the confluent-kafka producer and its callbacks. Each
    counter is written by exactly one of the two threads, so none needs a lock.
    Back-pressure: when the queue holds `producer_queue_batches` steps, publish drops the step
    (returns False) instead of blocking the GPU loop; the loss is reported as `dropped` on the next
    envelope, which tells consumers that node's index is incomplete.
    """

    def __init__(
        self,
        settings: Settings,
        node_id: str,
        *,
        model: str | None = None,
        dp_rank: int | None = 0,
        group_specs: list[GroupSpec] | None = None,
        hash_config: HashConfig | None = None,
        epoch: int | None = None,
        topic: str | None = None,
        source: str = "kvpipe",
        producer_config: dict | None = None,
    ) -> None:
        # Wall-clock ms: a restarted node gets a larger epoch without any persisted state.
        self._epoch = int(time.time() * 1000) if epoch is None else epoch
        self._node_id = node_id
        self._seq = Sequencer(
            node_id, self._epoch, model=model, dp_rank=dp_rank, group_specs=group_specs,
            hash_config=hash_config, source=source, specs_every_s=settings.specs_every_s,
        )
        self._dp_rank = dp_rank
        self._topic = topic or settings.events_topic
        self._key = node_id.encode()
        self._max_bytes = settings.max_message_bytes
        self._heartbeat_s = settings.heartbeat_s
        self._encoder = msgspec.msgpack.Encoder()
        config = kafka_config(settings, node_id, producer_config)
        config.setdefault("error_cb", self._on_kafka_error)
        # Reports for failures only: a success report costs a Python call and a copy of the
        # message value; `delivered` is derived instead (sent - failed - still in flight).
        config.setdefault("delivery.report.only.error", True)
        config["on_delivery"] = self._on_delivery
        self._config = config
        self._producer = Producer(config)
        # replaces a client that lost every broker (producer/clientswap.py); its envelopes in transfer count as
        # pending, so a flush does not end early
        self._swap = ClientSwap(config, self._topic, self._key, node_id)
        self._unanswered = 0  # the stall watch's metadata requests in a row that found no broker to ask

        self._queue: deque = deque()
        self._cap = settings.producer_queue_batches
        self._wake = threading.Event()
        self._idle = False
        self._stopping = False
        self._closed = False
        self._warned_closed = False
        # producer-thread counters
        self._enqueued = 0  # items (steps and control) appended
        self._queued = 0  # steps accepted
        self._dropped = 0  # events dropped at the queue (monotone; snapshots feed `dropped`)
        self._dropped_batches = 0
        # background-thread counters
        self._taken = 0  # items fully handled
        self._sent = 0
        self._sent_events = 0
        self._lost = 0  # events lost after the queue (encode or produce errors)
        self._bytes = 0
        self._heartbeats = 0
        self._failed = 0  # delivery reports with an error
        self._refused = 0  # produce() raised: never reached Kafka's queue
        self._last_send = time.monotonic()
        self._watch = DeliveryWatch(settings.producer_stall_s)

        self._thread = threading.Thread(target=self._run, name=f"kvpipe-publisher-{node_id}", daemon=True)
        self._thread.start()

    # -- producer-thread API -----------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def node_id(self) -> str:
        return self._node_id

    def publish(self, events: list[Event], ts: float | None = None) -> bool:
        """Queue one node step; never blocks. False = dropped because the queue is full.

        The list is encoded later, on the background thread: hand over a list you no longer mutate.
        """
        q = self._queue
        if len(q) >= self._cap:
            return self._drop(len(events))
        q.append((events, time.time() if ts is None else ts, self._dropped))
        self._enqueued += 1
        self._queued += 1
        if self._idle:
            self._wake.set()
        return True

    def publish_raw(
        self,
        payload: bytes,
        *,
        num_events: int,
        ts: float,
        layout: str = "map",
        upstream_seq: int | None = None,
        lost_batches: int = 0,
        dp_rank: int | None = None,
    ) -> bool:
        """Queue an already-encoded vLLM batch; it is embedded in the envelope byte for byte."""
        if not payload:
            raise ValueError(f"node {self._node_id!r}: publish_raw needs a non-empty vLLM batch payload")
        q = self._queue
        if len(q) >= self._cap:
            return self._drop(num_events)
        q.append(_RawBatch(bytes(payload), num_events, ts, layout, upstream_seq, lost_batches, dp_rank, self._dropped))
        self._enqueued += 1
        self._queued += 1
        if self._idle:
            self._wake.set()
        return True

    def new_epoch(self, epoch: int | None = None) -> int:
        """Start a new cache incarnation: steps queued after this call go out from seq 0 of it."""
        if epoch is None:
            epoch = max(int(time.time() * 1000), self._epoch + 1)
        elif epoch <= self._epoch:
            raise ValueError(f"node {self._node_id!r}: new epoch {epoch} must be greater than {self._epoch}")
        self._epoch = epoch
        self._control(_NewEpoch(epoch, self._dropped))
        return epoch

    def set_group_specs(self, specs: list[GroupSpec], hash_config: HashConfig | None = None) -> None:
        """The next envelope (after the steps already queued) carries these specs."""
        self._control(_Specs(list(specs), hash_config))

    def set_spec_mismatches(self, count: int) -> None:
        """Every envelope from now on reports `count` declared-vs-observed spec contradictions.

        A plain int store read by the sender thread (atomic in CPython); unlike specs it need not be
        ordered with the queued steps, since it describes the node, not one step."""
        self._seq.spec_mismatches = count

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        """Every envelope from now on reports this load (the router's score reads it), until the
        next call; one tuple store, like `set_spec_mismatches`."""
        self._seq.load = (running, waiting, kv_usage)

    def counters(self) -> dict[str, int]:
        in_flight = len(self._producer)
        return {
            "queued": self._queued,
            "sent": self._sent,
            "sent_events": self._sent_events,
            # exact once flushed; while sending it may lag or lead by the messages in transit
            "delivered": max(0, self._sent - self._failed - in_flight),
            "failed": self._failed + self._refused,
            "dropped": self._dropped + self._lost,
            "dropped_batches": self._dropped_batches,
            "bytes": self._bytes,
            "heartbeats": self._heartbeats,
            "queue_depth": len(self._queue),
            "in_flight": in_flight,
            "metadata_requests": self._watch.nudges,  # asked for because deliveries had stopped
            "client_replacements": self._swap.replacements,  # Kafka's client re-created with no broker to ask
            "already_written": self._swap.already_written,  # held by a replaced client, in the log, not sent again
        }

    def flush(self, timeout: float = 10.0) -> int:
        """Wait until everything queued so far is delivered (or failed); returns what remains."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = self._pending()
            if remaining == 0 or time.monotonic() >= deadline or not self._thread.is_alive():
                return remaining
            self._wake.set()
            time.sleep(0.002)

    def close(self, timeout: float = 10.0) -> None:
        """Flush, stop the background thread; later publishes are dropped. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._cap = -1  # every later publish takes the drop path
        remaining = self.flush(timeout)
        self._stopping = True
        self._wake.set()
        # the sender may be waiting on a metadata request for a stalled producer
        self._thread.join(timeout=max(1.0, timeout) + _METADATA_TIMEOUT_S)
        if remaining:
            # Still undelivered: purge so each message gets a (failed) delivery report we count and
            # log, instead of librdkafka warning about them at interpreter exit.
            log.error("node %s: %d envelope(s) undelivered after %.1f s; purging them", self._node_id, remaining, timeout)
            self._producer.purge()
            self._producer.flush(0)
        if not self._thread.is_alive():
            # Destroy the client now: its callbacks hold this publisher, a cycle the garbage collector
            # may never break, and a client left alive keeps reconnecting to a broker that is gone.
            self._producer.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals shared by both threads ------------------------------------------------------

    def _drop(self, num_events: int) -> bool:
        if self._closed and not self._warned_closed:
            self._warned_closed = True
            log.warning("node %s: publish after close; the step is dropped (and so are later ones)", self._node_id)
        self._dropped += num_events
        self._dropped_batches += 1
        return False

    def _control(self, item: object) -> None:
        # Control items go through the same queue (so they take effect after the steps already
        # queued) but never count against its bound: losing an epoch change would be a lie.
        self._queue.append(item)
        self._enqueued += 1
        self._wake.set()

    def _pending(self) -> int:
        return (self._enqueued - self._taken) + len(self._producer) + self._swap.in_transfer

    # -- background thread -----------------------------------------------------------------------

    def _run(self) -> None:
        q = self._queue
        handled = 0
        while True:
            if q:
                item = q.popleft()
                try:
                    self._handle(item)
                except Exception:  # never let one bad step kill the sender silently
                    log.exception("node %s: could not send a queued item; continuing", self._node_id)
                self._taken += 1
                handled += 1
                if handled % _POLL_EVERY == 0:
                    self._producer.poll(0)
                    self._check_stall()
                continue
            self._producer.poll(0)
            self._check_stall()
            if self._stopping:
                break
            idle_for = time.monotonic() - self._last_send
            if idle_for >= self._heartbeat_s:
                self._heartbeat()
                continue
            wait = _INFLIGHT_WAIT_S if len(self._producer) else min(self._heartbeat_s - idle_for, _IDLE_WAIT_MAX_S)
            self._wake.clear()
            self._idle = True
            if not q:  # re-check after raising the flag: a publish in between sets the event
                self._wake.wait(wait)
            self._idle = False

    def _handle(self, item: Any) -> None:
        if type(item) is tuple:
            events, ts, dropped_total = item
            try:
                payload = encode_vllm_batch(events, ts, self._dp_rank)
            except (TypeError, ValueError, msgspec.EncodeError) as exc:
                self._lose(len(events), f"its events do not encode as vLLM events: {exc}")
                return
            env = self._seq.stamp(
                ts=ts, sent_ts=time.time(), mono=time.monotonic(), dropped_total=dropped_total,
                batch=msgspec.Raw(payload), num_events=len(events),
            )
            self._send(env)
        elif type(item) is _RawBatch:
            env = self._seq.stamp(
                ts=item.ts, sent_ts=time.time(), mono=time.monotonic(), dropped_total=item.dropped_total,
                batch=msgspec.Raw(item.payload), num_events=item.num_events, layout=item.layout,
                upstream_seq=item.upstream_seq, lost_batches=item.lost_batches, dp_rank=item.dp_rank,
            )
            self._send(env)
        elif type(item) is _NewEpoch:
            self._seq.new_epoch(item.epoch, item.dropped_total)
        elif type(item) is _Specs:
            self._seq.set_group_specs(item.specs, item.hash_config)

    def _heartbeat(self) -> None:
        now = time.time()
        env = self._seq.heartbeat(now=now, mono=time.monotonic(), dropped_total=self._dropped)
        if self._send(env):
            self._heartbeats += 1
        else:
            self._last_send = time.monotonic()  # don't retry in a tight loop against a dead producer

    def _send(self, env: Envelope) -> bool:
        data = self._encoder.encode(env)
        if len(data) > self._max_bytes:
            self._seq.unstamp(env)
            self._lose(env.num_events, f"its envelope is {len(data)} bytes, over max_message_bytes={self._max_bytes}; publish smaller steps")
            return False
        while True:
            try:
                self._producer.produce(self._topic, data, self._key, headers=KAFKA_HEADERS)
                break
            except BufferError:
                # librdkafka's own queue is full: wait for deliveries rather than lose the
                # envelope; our bounded queue in front absorbs (and drops) the overflow. Only a
                # close that has given up waiting (broker gone) ends the wait.
                if self._stopping:
                    self._seq.unstamp(env)
                    self._refused += 1
                    self._lose(env.num_events, "the publisher closed while Kafka's queue was full")
                    return False
                self._producer.poll(0.05)
                self._check_stall()
            except KafkaException as exc:
                self._seq.unstamp(env)
                self._refused += 1
                self._lose(env.num_events, f"Kafka refused it: {exc.args[0]}")
                return False
        self._sent += 1
        self._sent_events += env.num_events
        self._bytes += len(data)
        self._last_send = time.monotonic()
        return True

    def _check_stall(self) -> None:
        """Envelopes waiting and none leaving the client for a while: ask for metadata (producer/stall.py)."""
        in_flight = len(self._producer)
        if not self._watch.stalled(time.monotonic(), self._sent, in_flight):
            return
        try:
            topic = self._producer.list_topics(self._topic, timeout=_METADATA_TIMEOUT_S).topics.get(self._topic)
            answer = ("no such topic" if topic is None or topic.error is not None and not topic.partitions else
                      "leaders " + ", ".join(f"{p}: {m.leader}" for p, m in sorted(topic.partitions.items())))
        except KafkaException as exc:
            answer = f"no answer: {exc.args[0]}"
            unreachable = isinstance(exc.args[0], KafkaError) and exc.args[0].code() == KafkaError._TRANSPORT
            self._unanswered = self._unanswered + 1 if unreachable else 0
            # twice in a row (the watch's first two asks: 3 stall_s, past librdkafka's 10 s reconnect back-off with
            # the default 5 s), and a new client reaches the cluster: this one has lost its brokers
            if self._unanswered >= 2 and self._swap.cluster_answers(_METADATA_TIMEOUT_S):
                before = self._swap.already_written
                self._producer, moved = self._swap.replace(self._producer, _METADATA_TIMEOUT_S)
                self._unanswered = 0
                answer += (f"; a new client reaches the cluster: Kafka's client replaced by one from the bootstrap "
                           f"servers, its {moved} envelope(s) moved to it, {self._swap.already_written - before} of "
                           f"them found in the log already")
        else:
            self._unanswered = 0
        log.warning("node %s: %d envelope(s) in Kafka's client and none delivered for %g s; asked the cluster for "
                    "%s's metadata again (%s)", self._node_id, in_flight, self._watch.waited, self._topic, answer)

    def _lose(self, num_events: int, reason: str) -> None:
        self._lost += num_events
        self._seq.note_lost(num_events)
        log.error("node %s: a step of %d events is lost, %s", self._node_id, num_events, reason)

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is None:  # only when a caller re-enabled success reports
            return
        if self._swap.collect(err, msg):  # handed back by a client replacement's purge: it goes out again
            return
        self._failed += 1
        if self._failed <= _LOG_FIRST or self._failed % _LOG_EVERY == 0:
            log.error("node %s: envelope %s to %s failed: %s (%d failed so far)",
                      self._node_id, describe_envelope(msg.value()), msg.topic(), err.str(), self._failed)

    def _on_kafka_error(self, err: KafkaError) -> None:
        level = logging.ERROR if err.fatal() else logging.WARNING
        log.log(level, "node %s: Kafka client error: %s", self._node_id, err.str())
