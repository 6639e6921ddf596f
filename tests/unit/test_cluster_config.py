"""`--brokers N` configs without starting anything: ports, quorum, replication, bootstrap, specs."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvpipe.infra.errors import InfraError
from kvpipe.infra.kafka.cluster import node_configs, present_nodes
from kvpipe.infra.kafka.config import BrokerConfig, server_properties
from kvpipe.infra.topics import default_specs
from kvpipe.schemas.settings import load_settings


def props(cfg: BrokerConfig) -> dict[str, str]:
    return dict(line.split("=", 1) for line in server_properties(cfg).splitlines() if "=" in line and not line.startswith("#"))


def test_the_single_broker_keeps_one_voter_and_replication_one(tmp_path: Path) -> None:
    p = props(BrokerConfig(state_dir=tmp_path))
    assert p["node.id"] == "1" and p["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert p["default.replication.factor"] == p["min.insync.replicas"] == p["offsets.topic.replication.factor"] == "1"
    assert BrokerConfig(state_dir=tmp_path).kafka_dir == tmp_path / "kafka"


def test_three_nodes_share_a_quorum_on_their_own_ports_and_dirs(tmp_path: Path) -> None:
    nodes = node_configs(BrokerConfig(state_dir=tmp_path, port=40000, controller_port=40001, heap="256m"), 3)
    assert [c.bootstrap for c in nodes] == ["127.0.0.1:40000", "127.0.0.1:40002", "127.0.0.1:40004"]
    assert len({c.kafka_dir for c in nodes}) == 3 and all(c.heap == "256m" for c in nodes)
    for k, cfg in enumerate(nodes, 1):
        p = props(cfg)
        assert p["node.id"] == str(k)
        assert p["controller.quorum.voters"] == "1@127.0.0.1:40001,2@127.0.0.1:40003,3@127.0.0.1:40005"
        assert p["listeners"] == f"PLAINTEXT://127.0.0.1:{40000 + 2 * (k - 1)},CONTROLLER://127.0.0.1:{40001 + 2 * (k - 1)}"
        assert (p["default.replication.factor"], p["min.insync.replicas"], p["offsets.topic.replication.factor"],
                p["transaction.state.log.min.isr"]) == ("3", "2", "3", "2")
    for cfg in nodes:
        cfg.kafka_dir.mkdir(parents=True)
    assert present_nodes(nodes[0]) == 3


def test_a_secured_cluster_is_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(InfraError, match="--secure"):
        node_configs(BrokerConfig(state_dir=tmp_path, sasl_port=40010), 3)


def test_clients_bootstrap_from_every_node_of_the_local_cluster() -> None:
    s = load_settings(env={"KVPIPE_KAFKA_LOCAL_BROKERS": "3", "KVPIPE_KAFKA_PORT": "40000"})
    assert s.bootstrap() == "127.0.0.1:40000,127.0.0.1:40002,127.0.0.1:40004"
    assert load_settings(env={}).bootstrap() == "127.0.0.1:19092"


def test_replicated_specs_ask_two_in_sync_replicas_for_every_topic() -> None:
    specs = default_specs("ev", "dlq", "snap", 4, "asnap", replication=3)
    assert {s.name: (s.replication, s.config.get("min.insync.replicas")) for s in specs} == \
        {n: (3, "2") for n in ("ev", "dlq", "snap", "asnap")}
    assert specs[0].config["message.timestamp.type"] == "LogAppendTime"
    assert all(s.replication == 1 and "min.insync.replicas" not in s.config
               for s in default_specs("ev", "dlq", "snap", 4, "asnap"))


def test_topic_creation_retries_what_a_settling_cluster_answers_and_nothing_else() -> None:
    from confluent_kafka import KafkaError

    from kvpipe.infra.topics import _settling

    for code in (KafkaError._DESTROY, KafkaError._DESTROY_BROKER, KafkaError._TRANSPORT,
                 KafkaError.NOT_CONTROLLER, KafkaError.INVALID_REPLICATION_FACTOR):
        assert _settling(KafkaError(code)), code
    for code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.INVALID_CONFIG,
                 KafkaError.POLICY_VIOLATION):
        assert not _settling(KafkaError(code)), code
