"""The Publisher against the real broker: what a consumer of kv-events actually sees."""
from __future__ import annotations

import logging
import threading
import time

import pytest

from kvpipe.producer.publisher import Publisher
from tests.integration.kafka_reading import client_config, consume
from kvpipe.schemas.codec import KAFKA_HEADERS, decode_envelope, encode_vllm_batch, envelope_events
from kvpipe.schemas.envelope import Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvpipe.schemas.settings import Settings, load_settings

pytestmark = pytest.mark.integration

SPECS = [GroupSpec(0, "full_attention", 16), GroupSpec(1, "sliding_window", 16, sliding_window=64)]
HASH = HashConfig(algorithm="sha256", hash_block_size=16)


def settings(**overrides: object) -> Settings:
    return load_settings(overrides={"heartbeat_s": 60.0, **overrides})


def step(i: int) -> list:
    return [
        BlockStored([i * 10 + 1, i * 10 + 2], None, list(range(32)), 16, None, "GPU", None,
                    extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved([i * 10 + 1], "GPU", group_idx=1),
    ]


def envelopes(bootstrap: str, topic: str, count: int) -> list[Envelope]:
    msgs = consume(bootstrap, topic, count)
    assert len(msgs) == count, f"expected {count} envelopes on {topic}, got {len(msgs)}"
    return [decode_envelope(m.value()) for m in msgs]


def test_steps_arrive_in_order_with_contiguous_seq_specs_headers_and_key(kafka_bootstrap, unique_topic) -> None:
    topic = unique_topic("pub-order")
    steps = [step(i) for i in range(20)]
    with Publisher(settings(), "node-a", model="m", group_specs=SPECS, hash_config=HASH, topic=topic) as pub:
        for i, events in enumerate(steps):
            assert pub.publish(events, ts=1000.0 + i)
        assert pub.flush(10) == 0
        counters = pub.counters()
        epoch = pub.epoch
    assert counters["delivered"] == counters["sent"] == 20 and counters["failed"] == counters["dropped"] == 0

    msgs = consume(kafka_bootstrap, topic, 20)
    assert [m.key() for m in msgs] == [b"node-a"] * 20
    assert all(m.headers() == KAFKA_HEADERS for m in msgs)
    envs = [decode_envelope(m.value()) for m in msgs]
    assert [e.seq for e in envs] == list(range(20))
    assert {(e.node_id, e.epoch, e.model, e.dp_rank) for e in envs} == {("node-a", epoch, "m", 0)}
    assert envs[0].group_specs == SPECS and envs[0].hash_config == HASH
    assert all(e.group_specs is None for e in envs[1:])
    assert [envelope_events(e) for e in envs] == steps
    assert [e.ts for e in envs] == [1000.0 + i for i in range(20)]
    assert all(e.num_events == 2 and e.dropped == 0 and e.sent_ts > 0 for e in envs)


def test_full_queue_drops_the_step_and_the_next_envelope_reports_it(kafka_bootstrap, unique_topic) -> None:
    topic = unique_topic("pub-drop")
    pub = Publisher(settings(producer_queue_batches=2), "node-b", topic=topic)
    # Hold the sender inside its first step so the queue fills up deterministically.
    gate = threading.Event()
    stamp = pub._seq.stamp

    def held_stamp(**kw):
        gate.wait(10)
        return stamp(**kw)

    pub._seq.stamp = held_stamp  # type: ignore[method-assign]
    try:
        assert pub.publish(step(0))
        deadline = time.monotonic() + 5
        while pub.counters()["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.01)  # the sender takes step 0 and blocks
        assert pub.publish(step(1)) and pub.publish(step(2))
        assert pub.publish(step(3)) is False  # queue full: dropped, not blocked
        assert pub.counters()["dropped"] == 2 and pub.counters()["dropped_batches"] == 1
        gate.set()
        assert pub.flush(10) == 0
        assert pub.publish(step(4))
        assert pub.flush(10) == 0
    finally:
        gate.set()
        pub.close()
    envs = envelopes(kafka_bootstrap, topic, 4)
    assert [e.seq for e in envs] == [0, 1, 2, 3]  # no gap where step 3 was dropped
    assert [e.dropped for e in envs] == [0, 0, 0, 2]
    assert [envelope_events(e) for e in envs] == [step(0), step(1), step(2), step(4)]


def test_idle_node_sends_heartbeats(kafka_bootstrap, unique_topic) -> None:
    topic = unique_topic("pub-heartbeat")
    with Publisher(settings(heartbeat_s=0.3), "node-c", group_specs=SPECS, topic=topic) as pub:
        pub.publish(step(0))
        time.sleep(1.0)
        counters = pub.counters()
    assert counters["heartbeats"] >= 2
    envs = envelopes(kafka_bootstrap, topic, 3)
    assert [e.seq for e in envs] == [0, 1, 2]
    assert not envs[0].is_heartbeat
    assert envs[1].is_heartbeat and envs[2].is_heartbeat
    assert envs[1].num_events == 0 and envelope_events(envs[1]) == []


def test_new_epoch_restarts_seq_and_resends_specs(kafka_bootstrap, unique_topic) -> None:
    topic = unique_topic("pub-epoch")
    with Publisher(settings(), "node-d", group_specs=SPECS, epoch=5, topic=topic) as pub:
        pub.publish(step(0))
        pub.publish(step(1))
        new = pub.new_epoch()
        assert new > 5 and pub.epoch == new
        pub.publish([AllBlocksCleared()])
        pub.publish(step(2))
        with pytest.raises(ValueError):
            pub.new_epoch(new)
    envs = envelopes(kafka_bootstrap, topic, 4)
    assert [(e.epoch, e.seq) for e in envs] == [(5, 0), (5, 1), (new, 0), (new, 1)]
    assert envs[2].group_specs == SPECS and envs[3].group_specs is None


def test_set_group_specs_rides_on_the_next_envelope(kafka_bootstrap, unique_topic) -> None:
    topic = unique_topic("pub-specs")
    new = [GroupSpec(0, "full_attention", 32)]
    with Publisher(settings(), "node-e", group_specs=SPECS, topic=topic) as pub:
        pub.publish(step(0))
        pub.publish(step(1))
        pub.set_group_specs(new, HASH)
        pub.publish(step(2))
    envs = envelopes(kafka_bootstrap, topic, 3)
    assert [e.group_specs for e in envs] == [SPECS, None, new]
    assert envs[2].hash_config == HASH


def test_publish_raw_embeds_the_vllm_payload_byte_identical(kafka_bootstrap, unique_topic) -> None:
    topic = unique_topic("pub-raw")
    array_payload = encode_vllm_batch(step(0), 12.5, dp_rank=1, layout="array")
    map_payload = encode_vllm_batch(step(1), 13.5, dp_rank=1)
    with Publisher(settings(), "node-f", source="vllm-bridge", topic=topic) as pub:
        assert pub.publish_raw(array_payload, num_events=2, ts=12.5, layout="array", upstream_seq=7, dp_rank=1)
        assert pub.publish_raw(map_payload, num_events=2, ts=13.5, upstream_seq=8, lost_batches=3, dp_rank=1)
    envs = envelopes(kafka_bootstrap, topic, 2)
    assert bytes(envs[0].batch) == array_payload and bytes(envs[1].batch) == map_payload
    assert [(e.layout, e.upstream_seq, e.lost_batches, e.dp_rank, e.source) for e in envs] == [
        ("array", 7, 0, 1, "vllm-bridge"), ("map", 8, 3, 1, "vllm-bridge")]
    assert envelope_events(envs[1]) == step(1)


def test_close_flushes_everything(kafka_bootstrap, unique_topic) -> None:
    topic = unique_topic("pub-close")
    pub = Publisher(settings(), "node-g", topic=topic)
    for i in range(300):
        pub.publish(step(i))
    pub.close()  # no explicit flush
    pub.close()  # idempotent
    assert pub.counters()["delivered"] == 300
    assert pub.publish(step(0)) is False  # closed: dropped, never blocks
    envs = envelopes(kafka_bootstrap, topic, 300)
    assert [e.seq for e in envs] == list(range(300))


def test_delivery_failure_is_counted_and_logged(kafka_bootstrap, caplog) -> None:
    missing = f"no-such-topic-{time.time_ns()}"  # the broker does not auto-create topics
    caplog.set_level(logging.ERROR, logger="kvpipe.producer.publisher")
    pub = Publisher(settings(), "node-h", topic=missing, producer_config={"message.timeout.ms": 1500})
    pub.publish(step(0))
    remaining = pub.flush(10)
    pub.close(1)
    counters = pub.counters()
    assert remaining == 0 and counters["failed"] == 1 and counters["delivered"] == 0
    failures = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert failures and "node-h" in failures[0] and "seq=0" in failures[0] and missing in failures[0]


def test_a_producer_whose_envelopes_wait_asks_the_cluster_for_metadata_again(kafka_bootstrap, caplog) -> None:
    # The broker answers but the envelope cannot leave the client (its topic does not exist and the
    # broker does not create topics): the publisher asks for the topic's metadata and says so.
    missing = f"no-such-topic-{time.time_ns()}"
    caplog.set_level(logging.WARNING, logger="kvpipe.producer.publisher")
    pub = Publisher(settings(producer_stall_s=0.3), "node-i", topic=missing,
                    producer_config={"message.timeout.ms": 4000})
    pub.publish(step(0))
    deadline = time.monotonic() + 3.5
    while pub.counters()["metadata_requests"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    asked = pub.counters()["metadata_requests"]
    remaining = pub.flush(10)
    pub.close(1)
    assert asked >= 1, "no metadata request while the envelope waited 3.5 s"
    warnings = [r.getMessage() for r in caplog.records if "metadata again" in r.getMessage()]
    assert warnings and "node-i" in warnings[0] and missing in warnings[0] and "no such topic" in warnings[0], warnings
    # asking changed nothing else: the envelope still fails once, when its timeout comes
    assert remaining == 0 and pub.counters()["failed"] == 1


def test_a_producer_with_no_broker_asks_with_backoff_and_keeps_accepting_steps(caplog) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    caplog.set_level(logging.WARNING, logger="kvpipe.producer.publisher")
    pub = Publisher(settings(producer_stall_s=0.2, kafka_bootstrap=f"127.0.0.1:{port}"), "node-j",
                    topic="anything", producer_config={"message.timeout.ms": 60000})
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 4.0:
            assert pub.publish(step(0)) is True  # publish never blocks behind the metadata requests
            time.sleep(0.05)
        asked = pub.counters()["metadata_requests"]
        # 0.2 s, then doubling (each request also waits up to 2 s for an answer): a few, not one per poll
        assert 1 <= asked <= 4, asked
        warnings = [r.getMessage() for r in caplog.records if "metadata again" in r.getMessage()]
        assert warnings and "no answer" in warnings[0], warnings
    finally:
        pub.close(0.5)


class _BrokerlessClient:
    """Kafka's client as it is after librdkafka dropped every broker (a metadata answer from a broker in its
    controlled shutdown lists none): nothing answers its metadata requests. Everything else is the real client."""

    def __init__(self, client) -> None:
        self._client = client

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    def __len__(self) -> int:
        return len(self._client)

    def list_topics(self, *args, **kwargs):
        from confluent_kafka import KafkaError, KafkaException

        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata: Local: Broker transport failure"))


def _ten_steps_through(wrap, node: str, topic: str) -> dict[str, int]:
    """A publisher's counters after ten steps through `wrap(its Kafka client)`, flushed."""
    # linger: the envelopes wait in the client, none delivered, so the stall watch asks (0.3 s, then 0.9 s)
    pub = Publisher(settings(producer_stall_s=0.3), node, topic=topic, producer_config={"linger.ms": 2500})
    pub._producer = wrap(pub._producer)
    try:
        for i in range(10):
            assert pub.publish(step(i))
        assert pub.flush(20) == 0
        return pub.counters()
    finally:
        pub.close()


def test_a_client_left_without_brokers_is_replaced_and_what_it_held_goes_out_once_in_order(kafka_bootstrap,
                                                                                           unique_topic, caplog):
    topic = unique_topic("pub-replace")
    caplog.set_level(logging.WARNING, logger="kvpipe.producer.publisher")
    counters = _ten_steps_through(_BrokerlessClient, "node-r", topic)
    # the second unanswered request, with the cluster answering a new client, replaced it; nothing failed
    assert counters["client_replacements"] == 1 and counters["metadata_requests"] >= 2
    assert counters["failed"] == counters["dropped"] == 0 and counters["delivered"] == 10
    replaced = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    assert replaced and "node-r" in replaced[0] and "10 envelope(s) moved" in replaced[0], replaced
    envs = envelopes(kafka_bootstrap, topic, 10)
    assert [e.seq for e in envs] == list(range(10))  # once each, in order
    assert [envelope_events(e) for e in envs] == [step(i) for i in range(10)]


class _HalfSentClient(_BrokerlessClient):
    """A client left without brokers after its first `sent` envelopes reached the broker unanswered: those are
    written to the topic (through a client of their own) as well as held, as an in-flight request that the broker
    wrote and whose answer never came back leaves them."""

    def __init__(self, client, bootstrap: str, sent: int) -> None:
        from confluent_kafka import Producer

        super().__init__(client)
        self._side, self._left = Producer(client_config(bootstrap)), sent

    def produce(self, *args, **kwargs):
        if self._left > 0:
            self._left -= 1
            self._side.produce(*args, **kwargs)
            assert self._side.flush(10) == 0
        return self._client.produce(*args, **kwargs)


def test_a_replaced_client_does_not_send_again_what_the_log_already_has(kafka_bootstrap, unique_topic, caplog):
    topic = unique_topic("pub-replace-half")
    caplog.set_level(logging.WARNING, logger="kvpipe.producer.publisher")
    counters = _ten_steps_through(lambda client: _HalfSentClient(client, kafka_bootstrap, 4), "node-h", topic)
    assert counters["client_replacements"] == 1 and counters["already_written"] == 4
    assert counters["failed"] == counters["dropped"] == 0 and counters["delivered"] == 10
    replaced = [r.getMessage() for r in caplog.records if "replaced" in r.getMessage()]
    assert replaced and "10 envelope(s) moved to it, 4 of them found in the log already" in replaced[0], replaced
    envs = envelopes(kafka_bootstrap, topic, 10)
    assert [e.seq for e in envs] == list(range(10))  # the four the broker had are not there twice
    assert len(consume(kafka_bootstrap, topic, 11, timeout=3)) == 10  # and nothing after them


def test_the_log_is_read_back_to_a_nodes_newest_record(kafka_bootstrap, unique_topic) -> None:
    from confluent_kafka import Producer

    from kvpipe.producer.logtail import LogTailError, newest_position, reader_config

    topic = unique_topic("pub-logtail")
    producer = Producer(client_config(kafka_bootstrap))
    for i in range(5):
        producer.produce(topic, value=b"%d" % i, key=b"node-a")
    for i in range(50):  # other nodes' records after node-a's newest: more than the first windows
        producer.produce(topic, value=b"%d" % i, key=b"node-b")
    assert producer.flush(10) == 0
    config = reader_config({**client_config(kafka_bootstrap), "linger.ms": 5, "acks": "all"}, "t")
    assert "linger.ms" not in config and "acks" not in config  # the producer's own properties stay behind

    def position(value: bytes) -> tuple[int, int]:
        return 1, int(value)

    assert newest_position(config, topic, 0, b"node-a", position, first_window=4) == (1, 4)  # windows 4, 16, 64
    assert newest_position(config, topic, 0, b"node-b", position, first_window=4) == (1, 49)
    assert newest_position(config, topic, 0, b"node-c", position, first_window=4) is None  # read to the start
    with pytest.raises(LogTailError, match="no record of b'node-a' in the last 20"):
        newest_position(config, topic, 0, b"node-a", position, first_window=4, max_records=20)
    with pytest.raises(LogTailError, match="unreadable"):  # a record of the key that is no envelope of ours
        newest_position(config, topic, 0, b"node-a", lambda value: (1, int(b"x" + value)))


def test_a_client_is_not_replaced_while_the_cluster_is_down(monkeypatch) -> None:
    import socket

    from kvpipe.producer import publisher

    monkeypatch.setattr(publisher, "_METADATA_TIMEOUT_S", 0.5)  # each unanswered request (and the new client's) ends sooner

    with socket.socket() as s:  # a port nothing listens on: no new client reaches a cluster either
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pub = Publisher(settings(producer_stall_s=0.2, kafka_bootstrap=f"127.0.0.1:{port}"), "node-s",
                    topic="anything", producer_config={"message.timeout.ms": 60000})
    try:
        pub.publish(step(0))
        # the second unanswered request is where a client would be replaced: the third comes after it
        deadline = time.monotonic() + 12
        while pub.counters()["metadata_requests"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        counters = pub.counters()
    finally:
        pub.close(0.5)
    assert counters["metadata_requests"] >= 3 and counters["client_replacements"] == 0
