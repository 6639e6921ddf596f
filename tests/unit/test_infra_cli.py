"""`kvpipe infra` without a broker: help, exit codes, errors that say what to install, config."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvpipe.infra.kafka.config import BrokerConfig, new_cluster_id, server_properties
from kvpipe.bench.procrun import free_port

REPO = Path(__file__).resolve().parents[2]



def _run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    base.update(PYTHONPATH=str(REPO), KVPIPE_STATE_DIR=str(tmp_path / "state"),
                KVPIPE_KAFKA_PORT=str(free_port()), KVPIPE_KAFKA_CONTROLLER_PORT=str(free_port()))
    base.update(env)
    return subprocess.run([sys.executable, "-m", "kvpipe", "infra", *args], cwd=tmp_path, env=base,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("args", [["--help"], ["up", "--help"], ["down", "--help"], ["status", "--help"]])
def test_every_subcommand_has_help(tmp_path: Path, args: list[str]) -> None:
    r = _run(tmp_path, *args)
    assert r.returncode == 0 and "usage: kvpipe infra" in r.stdout.lower()


def test_a_usage_error_exits_2_with_the_reason(tmp_path: Path) -> None:
    r = _run(tmp_path, "up", "--timeout", "soon")
    assert r.returncode == 2 and "--timeout" in r.stderr and "soon" in r.stderr
    assert _run(tmp_path).returncode == 2  # no subcommand: the help, as an error


def test_status_of_a_broker_that_never_ran_exits_3(tmp_path: Path) -> None:
    r = _run(tmp_path, "status")
    assert r.returncode == 3
    assert "not running" in r.stdout


def test_down_without_a_broker_is_harmless(tmp_path: Path) -> None:
    r = _run(tmp_path, "down")
    assert r.returncode == 0 and "no Kafka broker running" in r.stdout


def test_missing_java_names_the_package_to_install(tmp_path: Path) -> None:
    r = _run(tmp_path, "up", PATH=str(tmp_path / "empty-bin"))
    assert r.returncode == 1
    assert "`java` not found" in r.stderr and "apt-get install openjdk-17-jre-headless maven" in r.stderr


@pytest.mark.skipif(shutil.which("java") is None, reason="needs java on PATH to get past the java check")
def test_missing_maven_with_a_cold_jar_cache_names_the_package_to_install(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(shutil.which("java"))  # java present, mvn absent
    r = _run(tmp_path, "up", PATH=str(bin_dir), XDG_CACHE_HOME=str(tmp_path / "cache"))
    assert r.returncode == 1
    assert "`mvn` not found" in r.stderr and "apt-get install openjdk-17-jre-headless maven" in r.stderr


def test_a_port_taken_by_someone_else_is_reported_not_fought_over(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        r = _run(tmp_path, "up", KVPIPE_KAFKA_PORT=str(port))
    assert r.returncode == 1
    assert f"port 127.0.0.1:{port} is already in use" in r.stderr


def test_server_properties_single_node_loopback_no_auto_create(tmp_path: Path) -> None:
    props = dict(line.split("=", 1) for line in
                 server_properties(BrokerConfig(tmp_path, port=29092, controller_port=29093)).splitlines()
                 if "=" in line and not line.startswith("#"))
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:29093"
    assert props["auto.create.topics.enable"] == "false"
    assert props["offsets.topic.replication.factor"] == "1"
    assert props["log.dirs"] == str((tmp_path / "kafka" / "data").resolve())


def test_cluster_ids_look_like_kafkas() -> None:
    ids = {new_cluster_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(len(i) == 22 and not i.startswith("-") and "=" not in i for i in ids)


def test_a_stale_pid_file_is_cleaned_up_not_trusted(tmp_path: Path) -> None:
    kafka_dir = tmp_path / "state" / "kafka"
    kafka_dir.mkdir(parents=True)
    pid_max = Path("/proc/sys/kernel/pid_max")
    dead = (int(pid_max.read_text()) if pid_max.exists() else 2**22) + 1  # can never be a live process
    (kafka_dir / "kafka.pid").write_text(f"{dead}\n")
    r = _run(tmp_path, "status")
    assert r.returncode == 3 and "not running" in r.stdout
    assert not (kafka_dir / "kafka.pid").exists()
