"""`kvpipe infra up|down|status`: the local Kafka broker and kvpipe's topics.

With `KVPIPE_KAFKA_BOOTSTRAP` set, the cluster is someone else's: `up` only checks that it answers
and provisions topics, `down` does nothing, `status` reports that cluster.
"""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvpipe.infra.errors import InfraError
from kvpipe.schemas.cliopts import (Group, apply_bootstrap, bootstrap_server_option, configure_logging,
                                    log_level_option, output_option, run)
from kvpipe.schemas.settings import Settings, SettingsError, load_settings

EXIT_DOWN = 3  # `status` when nothing answers, like `systemctl status` (LSB: "program is not running")


def broker_config(s: Settings):  # -> kvpipe.infra.kafka.config.BrokerConfig
    from kvpipe.infra.kafka.config import BrokerConfig

    secure = {}
    if s.kafka_local_secure:
        if not (s.kafka_sasl_username and s.kafka_password()):
            raise SettingsError("the secured local broker (--secure / kafka_local_secure) needs the user clients log "
                                "in as: set KVPIPE_KAFKA_SASL_USERNAME and KVPIPE_KAFKA_SASL_PASSWORD (or _FILE)")
        secure = {"sasl_port": s.kafka_sasl_port, "sasl_ssl_port": s.kafka_sasl_ssl_port,
                  "users": ((s.kafka_sasl_username, s.kafka_password()),)}
    return BrokerConfig(state_dir=Path(s.state_dir), port=s.kafka_port, controller_port=s.kafka_controller_port,
                        version=s.kafka_version, heap=s.kafka_heap, max_message_bytes=s.max_message_bytes, **secure)


def _specs(s: Settings, brokers: int = 1):
    from kvpipe.infra.topics import default_specs

    return default_specs(s.events_topic, s.dlq_topic, s.snapshot_topic, s.partitions, s.analytics_snapshot_topic,
                         replication=min(brokers, 3))


def _cluster_nodes(s: Settings) -> int:
    """Nodes of the local cluster: as configured (`--brokers`, kafka_local_brokers), else as found under
    the state dir, so `down` and `status` need no flag."""
    from kvpipe.infra.kafka.cluster import present_nodes

    return s.kafka_local_brokers if s.kafka_local_brokers > 1 else present_nodes(broker_config(s))


def cmd_up_cluster(s: Settings, timeout: float) -> int:
    from kvpipe.infra.kafka.cluster import LocalCluster
    from kvpipe.infra.topics import ensure_topics

    t0 = time.monotonic()
    cluster = LocalCluster(broker_config(s), s.kafka_local_brokers)
    for node, st in zip(cluster.nodes, cluster.up(timeout=timeout)):
        verb = "started" if st.started else "already running"
        print(f"kafka node {node.cfg.node_id}: {verb}, pid {st.pid}, {node.cfg.bootstrap} "
              f"(controller {node.cfg.controller_port})")
    print(f"kafka: {len(cluster.nodes)}-node cluster, bootstrap {cluster.bootstrap} "
          f"({time.monotonic() - t0:.1f} s); clients: KVPIPE_KAFKA_LOCAL_BROKERS={len(cluster.nodes)}")
    for name, state in ensure_topics(cluster.bootstrap, _specs(s, len(cluster.nodes))).items():
        print(f"topic {name}: {state}")
    return 0


def cmd_up(s: Settings, timeout: float) -> int:
    from kvpipe.infra.kafka.local import LocalKafka, broker_answers
    from kvpipe.infra.topics import ensure_topics

    if s.is_local_kafka() and s.kafka_local_brokers > 1:
        return cmd_up_cluster(s, timeout)
    t0 = time.monotonic()
    if s.is_local_kafka():
        st = LocalKafka(broker_config(s)).up(timeout=timeout)
        verb = "started" if st.started else "already running"
        print(f"kafka: {verb}, pid {st.pid}, bootstrap {st.bootstrap} ({time.monotonic() - t0:.1f} s)")
        if s.kafka_local_secure:
            cfg = broker_config(s)
            print(f"kafka: SASL_PLAINTEXT on {cfg.host}:{cfg.sasl_port}, SASL_SSL on {cfg.host}:{cfg.sasl_ssl_port} "
                  f"(PLAIN, SCRAM-SHA-512; user {s.kafka_sasl_username}); CA for clients: {cfg.tls_dir / 'ca.pem'}")
    else:
        if not broker_answers(s.bootstrap(), timeout=min(timeout, 15.0), security=s.kafka_confluent_security()):
            raise InfraError(f"--bootstrap-server (KVPIPE_KAFKA_BOOTSTRAP) {s.bootstrap()} does not answer a metadata request; "
                             f"check the address, or unset it to run the local broker")
        print(f"kafka: external cluster at {s.bootstrap()} answers (nothing started)")
    for name, state in ensure_topics(s.bootstrap(), _specs(s)).items():
        print(f"topic {name}: {state}")
    return 0


def cmd_down(s: Settings, purge: bool) -> int:
    from kvpipe.infra.kafka.local import LocalKafka

    if not s.is_local_kafka():
        print(f"kafka: external cluster {s.bootstrap()} is not managed by kvpipe; nothing to stop")
        return 0
    nodes = _cluster_nodes(s)
    if nodes > 1:
        from kvpipe.infra.kafka.cluster import LocalCluster

        print(LocalCluster(broker_config(s), nodes).down(purge=purge))
    single = LocalKafka(broker_config(s))
    if nodes <= 1 or single.running_pid() is not None or purge:
        print(single.down(purge=purge))
    return 0


def status_report(s: Settings, all_topics: bool) -> dict[str, Any]:
    """What runs where, as data (`-o json` prints it as it is): `kafka` is local, local-cluster or
    external; `answers` whether `bootstrap` answered a metadata request (not asked when nothing local
    runs); `topics` name → partitions once it answered."""
    from kvpipe.infra.kafka.local import LocalKafka, broker_answers
    from kvpipe.infra.topics import list_topics

    nodes = _cluster_nodes(s) if s.is_local_kafka() else 0
    report: dict[str, Any] = {"kafka": "external", "bootstrap": s.bootstrap(), "running": True}
    if nodes > 1:
        from kvpipe.infra.kafka.cluster import LocalCluster

        cluster = LocalCluster(broker_config(s), nodes)
        rows = [{"node_id": node.cfg.node_id, "pid": pid, "bootstrap": node.cfg.bootstrap,
                 "log": str(node.cfg.server_log)} for node, pid in zip(cluster.nodes, cluster.pids())]
        report.update(kafka="local-cluster", bootstrap=cluster.bootstrap, state=str(cluster.root), nodes=rows,
                      running=any(row["pid"] is not None for row in rows))
    elif s.is_local_kafka():
        cfg = broker_config(s)
        pid = LocalKafka(cfg).running_pid()
        report.update(kafka="local", state=str(cfg.kafka_dir), log=str(cfg.server_log), pid=pid,
                      running=pid is not None)
    report["answers"] = report["running"] and broker_answers(report["bootstrap"], timeout=5.0,
                                                             security=s.kafka_confluent_security())
    report["topics"] = list_topics(report["bootstrap"], internal=all_topics) if report["answers"] else None
    return report


def print_status(report: dict[str, Any]) -> None:
    """`-o table`: the report as lines for people."""
    if report["kafka"] == "local-cluster":
        print(f"kafka: local {len(report['nodes'])}-node cluster, state {report['state']}")
        for row in report["nodes"]:
            print(f"kafka node {row['node_id']}: " + (f"pid {row['pid']}, {row['bootstrap']}" if row["pid"] else
                  f"not running ({row['bootstrap']}); log {row['log']}"))
        if not report["running"]:
            print("kafka: not running (start it with `kvpipe infra up --brokers N`)")
            return
    elif report["kafka"] == "local":
        print(f"kafka: local broker, state {report['state']}, log {report['log']}")
        if not report["running"]:
            print("kafka: not running (start it with `kvpipe infra up`)")
            return
        print(f"kafka: pid {report['pid']}, bootstrap {report['bootstrap']}")
    else:
        print(f"kafka: external cluster, bootstrap {report['bootstrap']}")
    if not report["answers"]:
        print(f"kafka: {report['bootstrap']} does not answer a metadata request")
        return
    topics = report["topics"]
    print(f"topics ({len(topics)}):")
    width = max((len(n) for n in topics), default=0)
    for name, n in topics.items():
        print(f"  {name:<{width}}  {n:>4} partition{'s' if n != 1 else ''}")


def cmd_status(s: Settings, all_topics: bool, output: str = "table") -> int:
    report = status_report(s, all_topics)
    if output == "json":
        print(json.dumps(report))
    else:
        print_status(report)
    return 0 if report["answers"] else EXIT_DOWN


def _run(name: str, overrides: dict, work: Callable[[Settings], int]) -> int:
    """Settings with the command's flags over them, checked; `work(settings)`; errors → exit 1."""
    try:
        s = load_settings(overrides)
        if s.partitions < 1:
            raise SettingsError(f"partitions must be >= 1, got {s.partitions}")
        if s.kafka_local_brokers < 1:
            raise SettingsError(f"brokers must be >= 1, got {s.kafka_local_brokers}")
        return work(s)
    except (InfraError, SettingsError) as e:
        print(f"kvpipe infra {name}: {e}", file=sys.stderr)
        return 1


@click.group("infra", cls=Group, help=__doc__)
def infra() -> None:
    pass


@infra.command("up", short_help="start the local broker (if not running) and create kvpipe's topics",
               help="Start the local Kafka broker unless it runs (idempotent), wait until it answers, create the "
                    "events, DLQ and snapshot topics if missing. With --bootstrap-server (or "
                    "KVPIPE_KAFKA_BOOTSTRAP): check that cluster answers and create the topics there.")
@click.option("--partitions", type=int, default=None,
              help="partitions of the events and snapshot topics (default: settings.partitions)")
@click.option("--brokers", type=int, default=None,
              help="nodes of the local KRaft cluster (default: KVPIPE_KAFKA_LOCAL_BROKERS, 1). With 3: replication "
                   "factor 3 and min.insync.replicas 2 for kvpipe's topics; node k on kafka_port + 2(k-1)")
@click.option("--timeout", type=float, default=90.0, help="seconds to wait for the broker (default 90)")
@click.option("--secure", is_flag=True,
              help="also listen with SASL_PLAINTEXT and SASL_SSL (kafka_sasl_port, kafka_sasl_ssl_port) for the "
                   "user KVPIPE_KAFKA_SASL_USERNAME/PASSWORD (KVPIPE_KAFKA_LOCAL_SECURE)")
@bootstrap_server_option()
@log_level_option()
def up(partitions: int | None, brokers: int | None, timeout: float, secure: bool, bootstrap_server: str | None,
       log_level: str) -> int:
    configure_logging(log_level)
    apply_bootstrap(bootstrap_server)
    overrides = {"partitions": partitions, "kafka_local_brokers": brokers, "kafka_local_secure": True if secure else None}
    return _run("up", overrides, lambda s: cmd_up(s, timeout))


@infra.command("down", short_help="stop the local broker",
               help="Stop the broker whose pid is in <state_dir>/kafka/kafka.pid (SIGTERM, then SIGKILL after 30 s). "
                    "Nothing else is touched; an external cluster (--bootstrap-server) is never stopped.")
@click.option("--purge", is_flag=True, help="also delete the broker's data dir (all topics)")
@bootstrap_server_option()
@log_level_option()
def down(purge: bool, bootstrap_server: str | None, log_level: str) -> int:
    configure_logging(log_level)
    apply_bootstrap(bootstrap_server)
    return _run("down", {}, lambda s: cmd_down(s, purge))


@infra.command("status", short_help="show pid, bootstrap and topics; exit 0 if up, 3 if down",
               help="Show what runs where. Exit status 0 if the broker answers, 3 if not.")
@click.option("--all", "all_topics", is_flag=True, help="include internal topics (__consumer_offsets, ...)")
@output_option(help="what runs where, as lines for people or as one JSON object (the exit status is the same)")
@bootstrap_server_option()
@log_level_option()
def status(all_topics: bool, output: str, bootstrap_server: str | None, log_level: str) -> int:
    configure_logging(log_level)
    apply_bootstrap(bootstrap_server)
    return _run("status", {}, lambda s: cmd_status(s, all_topics, output))


def main(argv: list[str] | None = None) -> int:
    return int(run(infra, argv, "kvpipe infra"))
