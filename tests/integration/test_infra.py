"""`kvpipe infra` against a real Apache Kafka broker of its own.

The broker under test gets its own state dir and free ports, so the shared dev broker on 19092 (and
any other engineer's test run) is never touched. Tests run in file order and share that broker:
they read as one session — up, up again, use it, stop it, bring it back.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from kvpipe.infra.errors import InfraError
from kvpipe.infra.topics import TopicSpec, delete_topics, ensure_topics, list_topics
from kvpipe.bench.procrun import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


class Infra:
    """Runs `python -m kvpipe infra …` as a user would, with this test's settings in the env."""

    def __init__(self, state_dir: Path, port: int, controller_port: int) -> None:
        self.state_dir, self.port = state_dir, port
        self.bootstrap = f"127.0.0.1:{port}"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
        self.env.update(KVPIPE_STATE_DIR=str(state_dir), KVPIPE_KAFKA_PORT=str(port),
                        KVPIPE_KAFKA_CONTROLLER_PORT=str(controller_port),
                        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        # cwd = the state dir's parent, so no kvpipe.toml of the checkout leaks into the test
        return subprocess.run([sys.executable, "-m", "kvpipe", "infra", *args], cwd=self.state_dir.parent,
                              env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=timeout)

    @property
    def pid_file(self) -> Path:
        return self.state_dir / "kafka" / "kafka.pid"

    def pid(self) -> int:
        return int(self.pid_file.read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


@pytest.fixture(scope="module")
def infra(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("infra")
    inf = Infra(root / "state", free_port(), free_port())
    yield inf
    inf.run("down", "--purge")


def test_up_starts_a_broker_and_creates_kvpipes_topics(infra: Infra) -> None:
    r = infra.run("up")
    assert r.returncode == 0, r.stderr
    assert "started" in r.stdout
    assert list_topics(infra.bootstrap) == {"kv-events": 4, "kv-events-dlq": 1, "kv-index-snapshots": 4,
                                            "kv-analytics-snapshots": 4}
    assert (infra.state_dir / "kafka" / "server.log").stat().st_size > 0, "broker logs to <state>/kafka/server.log"


def test_second_up_is_fast_and_returns_the_same_pid(infra: Infra) -> None:
    pid = infra.pid()
    t0 = time.monotonic()
    r = infra.run("up")
    elapsed = time.monotonic() - t0
    assert r.returncode == 0, r.stderr
    assert f"already running, pid {pid}" in r.stdout
    assert "topic kv-events: exists" in r.stdout
    assert infra.pid() == pid
    assert elapsed < 5.0, f"a second `up` took {elapsed:.1f} s"


def test_the_broker_holds_its_whole_heap_and_logs_its_gc_pauses(infra: Infra) -> None:
    from kvpipe.infra.kafka.gclog import read_pauses

    argv = Path(f"/proc/{infra.pid()}/cmdline").read_bytes().split(b"\0")
    xms = [a for a in argv if a.startswith(b"-Xms")]
    assert xms and [a for a in argv if a.startswith(b"-Xmx")] == [b"-Xmx" + xms[0][4:]], argv
    log = infra.state_dir / "kafka" / "kafkaServer-gc.log"
    deadline = time.monotonic() + 30
    while not read_pauses(log) and time.monotonic() < deadline:  # the first collection comes with the first load
        _produce_some(infra.bootstrap, 2000)
    pauses = read_pauses(log)
    assert pauses, log.read_text()[-2000:]
    assert all(p.ms >= 0 and p.kind.startswith("Pause ") for p in pauses)
    assert abs(pauses[-1].end_unix_s - time.time()) < 600


def _produce_some(bootstrap: str, n: int) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for i in range(n):
        p.produce("kv-events", b"x" * 1000, key=str(i).encode())
        p.poll(0)
    p.flush(30)


def test_status_shows_pid_bootstrap_and_topics(infra: Infra) -> None:
    r = infra.run("status")
    assert r.returncode == 0, r.stderr
    assert f"pid {infra.pid()}, bootstrap {infra.bootstrap}" in r.stdout
    assert "kv-index-snapshots" in r.stdout and "4 partitions" in r.stdout


def test_snapshot_topics_are_compacted_and_events_carry_the_brokers_time(infra: Infra) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    admin = AdminClient({"bootstrap.servers": infra.bootstrap})
    for topic, key, value in [("kv-index-snapshots", "cleanup.policy", "compact"),
                              ("kv-analytics-snapshots", "cleanup.policy", "compact"),
                              ("kv-events", "message.timestamp.type", "LogAppendTime")]:
        res = ConfigResource(ResourceType.TOPIC, topic)
        entries = admin.describe_configs([res])[res].result(timeout=10)
        assert entries[key].value == value, topic


def test_a_message_produced_with_a_node_key_comes_back(infra: Infra) -> None:
    p = Producer({"bootstrap.servers": infra.bootstrap})
    p.produce("kv-events", key=b"node-a", value=b"step-1", headers=[("schema", b"1")])
    assert p.flush(15) == 0
    c = Consumer({"bootstrap.servers": infra.bootstrap, "group.id": f"t-{uuid.uuid4().hex}",
                  "auto.offset.reset": "earliest"})
    c.subscribe(["kv-events"])
    try:
        deadline, got = time.monotonic() + 30, None
        while got is None and time.monotonic() < deadline:
            m = c.poll(1.0)
            if m is not None and m.error() is None:
                got = m
    finally:
        c.close()
    assert got is not None, "no message within 30 s"
    assert (got.key(), got.value(), got.headers()) == (b"node-a", b"step-1", [("schema", b"1")])


def test_ensure_topics_creates_once_and_is_a_noop_afterwards(infra: Infra) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    specs = [TopicSpec(name, 3), TopicSpec(name + "-c", 2, {"cleanup.policy": "compact"})]
    try:
        assert ensure_topics(infra.bootstrap, specs) == {name: "created", name + "-c": "created"}
        assert ensure_topics(infra.bootstrap, specs) == {name: "exists", name + "-c": "exists"}
        topics = list_topics(infra.bootstrap)
        assert (topics[name], topics[name + "-c"]) == (3, 2)
    finally:
        delete_topics(infra.bootstrap, [name, name + "-c"])


def test_a_different_partition_count_is_reported_not_ignored(infra: Infra) -> None:
    with pytest.raises(InfraError, match="exists with 4 partitions.*configured for 6"):
        ensure_topics(infra.bootstrap, [TopicSpec("kv-events", 6)])
    r = infra.run("up", "--partitions", "6")
    assert r.returncode == 1
    assert "kv-events" in r.stderr and "--partitions 4" in r.stderr
    assert list_topics(infra.bootstrap)["kv-events"] == 4, "nothing was altered"


def test_a_config_kvpipe_needs_is_set_on_an_existing_topic(infra: Infra) -> None:
    from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType

    name = f"t-{uuid.uuid4().hex[:8]}"
    try:
        ensure_topics(infra.bootstrap, [TopicSpec(name, 1)])  # created as `delete`, CreateTime
        needed = {"cleanup.policy": "compact", "message.timestamp.type": "LogAppendTime"}
        assert ensure_topics(infra.bootstrap, [TopicSpec(name, 1, needed)]) == {name: "configured"}
        res = ConfigResource(ResourceType.TOPIC, name)
        admin = AdminClient({"bootstrap.servers": infra.bootstrap})  # referenced until the future resolves
        entries = admin.describe_configs([res])[res].result(timeout=10)
        assert {k: entries[k].value for k in needed} == needed
        assert ensure_topics(infra.bootstrap, [TopicSpec(name, 1, needed)]) == {name: "exists"}
    finally:
        delete_topics(infra.bootstrap, [name])


def test_external_bootstrap_starts_nothing(infra: Infra, tmp_path: Path) -> None:
    other_state = tmp_path / "other"
    env = {"KVPIPE_KAFKA_BOOTSTRAP": infra.bootstrap, "KVPIPE_STATE_DIR": str(other_state)}
    r = infra.run("up", env=env)
    assert r.returncode == 0, r.stderr
    assert "external cluster" in r.stdout and "topic kv-events: exists" in r.stdout
    assert not other_state.exists(), "nothing local is created for an external cluster"
    s = infra.run("status", env=env)
    assert s.returncode == 0 and f"external cluster, bootstrap {infra.bootstrap}" in s.stdout
    d = infra.run("down", env=env)
    assert d.returncode == 0 and _alive(infra.pid()), "`down` never stops an external cluster"


def test_an_unreachable_external_bootstrap_is_a_clear_error(infra: Infra) -> None:
    r = infra.run("up", "--timeout", "3", env={"KVPIPE_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}"})
    assert r.returncode == 1
    assert "does not answer" in r.stderr


def test_down_stops_only_its_pid_and_up_brings_the_data_back(infra: Infra) -> None:
    pid = infra.pid()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    try:
        r = infra.run("down")
        assert r.returncode == 0 and f"stopped Kafka broker pid {pid}" in r.stdout
        assert not _alive(pid) and not infra.pid_file.exists()
        assert bystander.poll() is None
        assert infra.run("status").returncode == 3

        # A stale pid file naming someone else's live process: `down` must leave that process alone.
        infra.pid_file.write_text(f"{bystander.pid}\n")
        r = infra.run("down")
        assert r.returncode == 0 and "no Kafka broker running" in r.stdout
        assert bystander.poll() is None and not infra.pid_file.exists()

        r = infra.run("up")
        assert r.returncode == 0 and "started" in r.stdout, r.stderr
        assert infra.pid() != pid
    finally:
        bystander.kill()
        bystander.wait()
    c = Consumer({"bootstrap.servers": infra.bootstrap, "group.id": f"t-{uuid.uuid4().hex}"})
    try:
        total = 0
        for p in range(4):
            lo, hi = c.get_watermark_offsets(TopicPartition("kv-events", p), timeout=10)
            total += hi - lo
    finally:
        c.close()
    assert total == 1, "the message produced before the restart is still there"


def test_down_purge_deletes_the_data(infra: Infra) -> None:
    r = infra.run("down", "--purge")
    assert r.returncode == 0 and "deleted" in r.stdout
    assert not (infra.state_dir / "kafka" / "data").exists()
    r = infra.run("up")
    assert r.returncode == 0, r.stderr
    assert "topic kv-events: created" in r.stdout, "a purged broker starts empty"


def test_a_broker_that_dies_at_startup_is_reported_with_its_log(tmp_path: Path) -> None:
    inf = Infra(tmp_path / "state", free_port(), free_port())
    r = inf.run("up", env={"KVPIPE_KAFKA_HEAP": "1k"})  # the JVM refuses a 1 KiB heap
    assert r.returncode == 1
    assert "exited during startup" in r.stderr and "console.out" in r.stderr
    assert "heap" in r.stderr.lower(), "the JVM's own complaint is shown"
    assert not inf.pid_file.exists()
