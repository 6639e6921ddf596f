"""`kvpipe infra up --brokers 3` as a user runs it: a 3-node KRaft cluster of the test's own (temp
state dir, six free ports in a row), kvpipe's topics replicated 3 times with min.insync.replicas 2,
`status` and `down` handling every node without the flag."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

from kvpipe.bench.faults import free_port_run
from tests.integration.test_infra import Infra, _alive

pytestmark = pytest.mark.integration


def test_a_three_node_cluster_comes_up_replicated_and_goes_down(tmp_path: Path) -> None:
    base = free_port_run(6)
    infra = Infra(tmp_path / "state", base, base + 1)
    env = {"KVPIPE_KAFKA_HEAP": "256m"}
    try:
        r = infra.run("up", "--brokers", "3", env=env)
        assert r.returncode == 0, r.stderr
        bootstrap = ",".join(f"127.0.0.1:{base + 2 * k}" for k in range(3))
        assert f"3-node cluster, bootstrap {bootstrap}" in r.stdout
        admin = AdminClient({"bootstrap.servers": bootstrap})
        wanted = {"kv-events", "kv-events-dlq", "kv-index-snapshots", "kv-analytics-snapshots"}
        deadline = time.monotonic() + 30
        md = admin.list_topics(timeout=30)
        # the broker answering may not have caught up with the controller's new topics yet
        while not wanted <= set(md.topics) and time.monotonic() < deadline:
            time.sleep(0.2)
            md = admin.list_topics(timeout=30)
        assert sorted(b.id for b in md.brokers.values()) == [1, 2, 3]
        for name in ("kv-events", "kv-events-dlq", "kv-index-snapshots", "kv-analytics-snapshots"):
            assert all(len(p.replicas) == 3 for p in md.topics[name].partitions.values()), name
            assert _config(admin, name, deadline)["min.insync.replicas"].value == "2"

        pids = [int((tmp_path / "state" / "kafka-cluster" / f"node-{k}" / "kafka.pid").read_text()) for k in (1, 2, 3)]
        again = infra.run("up", "--brokers", "3", env=env)
        assert again.returncode == 0 and again.stdout.count("already running") == 3

        st = infra.run("status")  # no flag: the nodes are found under the state dir
        assert st.returncode == 0, st.stdout + st.stderr
        assert all(f"pid {pid}" in st.stdout for pid in pids) and "kv-events" in st.stdout

        down = infra.run("down")
        assert down.returncode == 0 and "stopped 3 Kafka cluster node(s)" in down.stdout
        assert not any(_alive(pid) for pid in pids)
        assert infra.run("status").returncode == 3
    finally:
        infra.run("down", "--purge")


def _config(admin: AdminClient, topic: str, deadline: float) -> dict:
    """A new topic's configs; a node that has not caught up with the controller yet answers
    UNKNOWN_TOPIC_OR_PART for a moment."""
    from confluent_kafka import KafkaException

    res = ConfigResource(ResourceType.TOPIC, topic)
    while True:
        try:
            return admin.describe_configs([res])[res].result(timeout=10)
        except KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
