"""Kafka with authentication: a local broker of its own (own ports, own state dir, stopped at the
end; the shared broker is never touched) listening with SASL_PLAINTEXT and SASL_SSL for one user
(PLAIN and SCRAM-SHA-512), TLS from the CA `infra/kafka/tls.py` made.

The scenario an operator runs: a node's publisher (SASL_SSL + SCRAM-SHA-512) publishes, `kvpipe
processor` configured by the same KVPIPE_KAFKA_* variables consumes, `/route` answers the
published blocks; PLAIN works for a plain admin/consumer; a wrong password is a clear
authentication error; the password is in no log.
"""
from __future__ import annotations

import logging
import secrets
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from kvpipe.infra.kafka.config import BrokerConfig
from kvpipe.infra.kafka.local import LocalKafka
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.producer.publisher import Publisher
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.events import BlockStored
from kvpipe.schemas.settings import Settings, load_settings

pytestmark = pytest.mark.integration

USER = "kvpipe-it"
PASSWORD = "pw-" + secrets.token_hex(12)  # searched for in every log below
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> BrokerConfig:
    cfg = BrokerConfig(state_dir=tmp_path_factory.mktemp("secure-kafka"), port=free_port(), controller_port=free_port(),
                       sasl_port=free_port(), sasl_ssl_port=free_port(), users=((USER, PASSWORD),), heap="512m")
    kafka = LocalKafka(cfg)
    kafka.up(timeout=180)
    try:
        yield cfg
    finally:
        kafka.down(purge=True)


def secured_env(cfg: BrokerConfig, protocol: str = "SASL_SSL", mechanism: str = "SCRAM-SHA-512",
                password: str = PASSWORD) -> dict[str, str]:
    port = cfg.sasl_ssl_port if protocol == "SASL_SSL" else cfg.sasl_port
    env = {"KVPIPE_KAFKA_BOOTSTRAP": f"127.0.0.1:{port}", "KVPIPE_KAFKA_SECURITY_PROTOCOL": protocol,
           "KVPIPE_KAFKA_SASL_MECHANISM": mechanism, "KVPIPE_KAFKA_SASL_USERNAME": USER,
           "KVPIPE_KAFKA_SASL_PASSWORD": password}
    if protocol == "SASL_SSL":
        env["KVPIPE_KAFKA_SSL_CAFILE"] = str(cfg.tls_dir / "ca.pem")
    return env


def create_topics(settings: Settings, *specs: tuple[str, int, dict]) -> None:
    admin = AdminClient(settings.kafka_confluent_config())
    for future in admin.create_topics([NewTopic(n, p, 1, config=c) for n, p, c in specs], operation_timeout=30).values():
        future.result(timeout=30)


def end_offsets(settings: Settings, topic: str, partitions: int) -> dict[int, int]:
    consumer = Consumer({**settings.kafka_confluent_config(), "group.id": "offsets"})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        consumer.close()


def stored(hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=0)


class LogFile:
    """Every log record of this process (DEBUG and up) into a file, as a deployment would keep it."""

    def __init__(self, path: Path) -> None:
        self.path, self.handler = path, logging.FileHandler(path)
        self.handler.setLevel(logging.DEBUG)

    def __enter__(self) -> "LogFile":
        root = logging.getLogger()
        self.level = root.level
        root.setLevel(logging.DEBUG)
        root.addHandler(self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self.handler)
        root.setLevel(self.level)
        self.handler.close()


def test_scram_over_tls_publisher_to_processor_route_and_no_password_in_logs(broker: BrokerConfig, tmp_path: Path):
    tag = uuid.uuid4().hex[:8]
    events, dlq, snaps = f"sec-ev-{tag}", f"sec-dlq-{tag}", f"sec-snap-{tag}"
    env = {**secured_env(broker), "KVPIPE_EVENTS_TOPIC": events, "KVPIPE_DLQ_TOPIC": dlq,
           "KVPIPE_SNAPSHOT_TOPIC": snaps, "KVPIPE_PARTITIONS": "2"}
    settings = load_settings(env={**env, "KVPIPE_HEARTBEAT_S": "3600"})
    create_topics(settings, (events, 2, {}), (dlq, 1, {}), (snaps, 2, {"cleanup.policy": "compact"}))

    proc = ProcessorProcess({**env, "KVPIPE_PROCESSOR_ID": f"sec-{tag}", "KVPIPE_WEB_PORT": str(free_port()),
                             "KVPIPE_STATE_DIR": str(tmp_path / "state"), "KVPIPE_SNAPSHOT_EVERY_S": "2"},
                            tmp_path / "processor.log", args=["--loglevel", "info"])
    proc.start(timeout=120)
    try:
        with LogFile(tmp_path / "publisher.log"):
            with Publisher(settings, "secure-node", group_specs=SPECS, epoch=1, model="m") as pub:
                assert pub.publish([stored([101, 102, 103])]) and pub.publish([stored([104])])
                assert pub.flush(30) == 0
                counters = pub.counters()
        assert counters["failed"] == 0 and counters["sent"] >= 2, counters
        proc.wait_offsets(end_offsets(settings, events, 2), timeout=60)
        answer = proc.route({"0": [101, 102, 103, 104, 105]}, num_tokens=81)
        assert [(r["node_id"], r["gpu_tokens"]) for r in answer["nodes"]] == [("secure-node", 64)]
        time.sleep(3)  # one snapshot round: the durability path (aiokafka producer + reader) runs secured too
        assert proc.get("/stats")["cluster"]["owned_partitions"] == [0, 1]
    finally:
        proc.stop()
    processor_log = (tmp_path / "processor.log").read_text(errors="replace")
    assert PASSWORD not in processor_log
    assert PASSWORD not in (tmp_path / "publisher.log").read_text(errors="replace")


def test_plain_over_sasl_plaintext_serves_an_admin_a_producer_and_a_consumer(broker: BrokerConfig):
    settings = load_settings(env=secured_env(broker, "SASL_PLAINTEXT", "PLAIN"))
    assert settings.kafka_confluent_config()["sasl.mechanism"] == "PLAIN"
    topic = f"sec-plain-{uuid.uuid4().hex[:8]}"
    create_topics(settings, (topic, 1, {}))
    producer = Producer(settings.kafka_confluent_config())
    producer.produce(topic, b"hello over PLAIN")
    assert producer.flush(30) == 0
    consumer = Consumer({**settings.kafka_confluent_config(), "group.id": f"g-{topic}", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    try:
        deadline, got = time.monotonic() + 30, None
        while got is None and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                got = msg.value()
    finally:
        consumer.close()
    assert got == b"hello over PLAIN"
    assert topic in AdminClient(settings.kafka_confluent_config()).list_topics(timeout=10).topics


def test_a_wrong_password_is_an_authentication_error_that_does_not_echo_the_password(broker: BrokerConfig,
                                                                                    tmp_path: Path, caplog):
    wrong = "wrong-" + secrets.token_hex(8)
    settings = load_settings(env={**secured_env(broker, password=wrong), "KVPIPE_EVENTS_TOPIC": "nowhere"})
    client_log = logging.getLogger(f"librdkafka-{uuid.uuid4().hex}")
    client_log.propagate = False
    lines: list[str] = []
    client_log.addHandler(type("Collect", (logging.Handler,), {"emit": lambda self, r: lines.append(r.getMessage())})())
    admin = AdminClient({**settings.kafka_confluent_config(), "logger": client_log})
    with pytest.raises(Exception):
        admin.list_topics(timeout=5)
    admin.poll(1)  # librdkafka hands its log lines to the logger on poll
    errors = [line for line in lines if "SASL authentication error" in line]
    assert any("Authentication failed" in e and "invalid credentials" in e for e in errors), lines[-5:]
    # the publisher reports it through its log (error_cb), with the reason and without the secret
    caplog.set_level(logging.DEBUG)
    pub = Publisher(settings, "bad-node", epoch=1)
    deadline = time.monotonic() + 20
    while "Authentication failed" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.2)
    pub.close(timeout=1)
    assert "Authentication failed" in caplog.text, caplog.text[-2000:]
    assert wrong not in caplog.text and all(wrong not in e for e in errors)
    assert wrong not in repr(settings) and PASSWORD not in repr(load_settings(env=secured_env(broker)))
