"""server.properties and log4j.properties for a KRaft broker on loopback: one combined
broker+controller node (the default), or one node of a local cluster of such nodes (`--brokers 3`).

Written fresh on every start (cheap, and a port change in settings takes effect), except the
cluster id, which must stay fixed once storage is formatted: it lives in `<kafka dir>/cluster.id`.
"""
from __future__ import annotations

import base64
import hashlib
import os
import secrets
import uuid
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class BrokerConfig:
    """Everything that distinguishes one local broker from another (dev on 19092, tests on 29092)."""

    state_dir: Path
    port: int = 19092
    controller_port: int = 19093
    version: str = "3.9.1"
    heap: str = "768m"
    max_message_bytes: int = 8 * 1024 * 1024
    host: str = "127.0.0.1"  # loopback only: the plaintext listener has no authentication
    # Secured listeners (`kvpipe infra up --secure`; 0 = off): SASL (PLAIN, SCRAM-SHA-512) without
    # and with TLS. `users` (name, password) may log in on both with either mechanism.
    sasl_port: int = 0
    sasl_ssl_port: int = 0
    users: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    # One node of a local cluster (infra/kafka/cluster.py): its id, the controller quorum as
    # (node id, controller port) pairs, and its own directory under the state dir. The defaults are
    # the single broker, whose files stay where they always were (<state>/kafka).
    node_id: int = 1
    voters: tuple[tuple[int, int], ...] = ()
    kafka_subdir: str = "kafka"
    # More log dirs after data_dir (JBOD): Kafka spreads partitions over them and takes only a
    # failed dir offline, not the broker (the full-disk fault test puts one on a small filesystem).
    extra_log_dirs: tuple[Path, ...] = ()

    @property
    def secure(self) -> bool:
        return bool(self.sasl_port or self.sasl_ssl_port)

    @property
    def tls_dir(self) -> Path:
        return self.kafka_dir / "tls"

    @property
    def cluster_size(self) -> int:
        return max(1, len(self.voters))

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir / self.kafka_subdir

    @property
    def data_dir(self) -> Path:
        return self.kafka_dir / "data"

    @property
    def log_dirs(self) -> tuple[Path, ...]:
        return (self.data_dir, *self.extra_log_dirs)

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def server_properties(self) -> Path:
        return self.kafka_dir / "server.properties"

    @property
    def log4j_properties(self) -> Path:
        return self.kafka_dir / "log4j.properties"

    @property
    def server_log(self) -> Path:
        return self.kafka_dir / "server.log"

    @property
    def console_log(self) -> Path:
        return self.kafka_dir / "console.out"

    @property
    def gc_log(self) -> Path:
        return self.kafka_dir / "kafkaServer-gc.log"

    @property
    def pid_file(self) -> Path:
        return self.kafka_dir / "kafka.pid"

    @property
    def cluster_id_file(self) -> Path:
        return self.kafka_dir / "cluster.id"


def new_cluster_id() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding (22 chars), as
    `kafka-storage.sh random-uuid` prints. Kafka rejects ids that start with '-' (they look like
    flags), so draw again in that case; saves a JVM start compared to calling the tool."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-512")
SCRAM_ITERATIONS = 8192


def scram_credential(name: str, password: str, salt: bytes | None = None) -> str:
    """A `kafka-storage format --add-scram` argument carrying the *salted* password (RFC 5802
    SaltedPassword = PBKDF2-HMAC-SHA-512), so the clear password never sits on a command line."""
    salt = salt or secrets.token_bytes(16)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, SCRAM_ITERATIONS)
    b64 = lambda b: base64.b64encode(b).decode()  # noqa: E731
    return (f'SCRAM-SHA-512=[name={name},iterations={SCRAM_ITERATIONS},salt="{b64(salt)}",'
            f'saltedpassword="{b64(salted)}"]')


def _jaas_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _secure_props(cfg: BrokerConfig, keystore: Path | None, store_password: str) -> dict[str, str]:
    """Extra listeners and their SASL/TLS settings. Inter-broker and controller traffic stay on the
    loopback plaintext listeners (a single node talks to itself)."""
    names = [n for n, port in (("SASL_PLAINTEXT", cfg.sasl_port), ("SASL_SSL", cfg.sasl_ssl_port)) if port]
    ports = {"SASL_PLAINTEXT": cfg.sasl_port, "SASL_SSL": cfg.sasl_ssl_port}
    plain_users = " ".join(f'user_{name}="{_jaas_value(pw)}"' for name, pw in cfg.users)
    props = {"sasl.enabled.mechanisms": ",".join(SASL_MECHANISMS)}
    for name in names:
        prefix = f"listener.name.{name.lower()}"
        props[f"{prefix}.sasl.enabled.mechanisms"] = ",".join(SASL_MECHANISMS)
        props[f"{prefix}.plain.sasl.jaas.config"] = (
            f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};")
        props[f"{prefix}.scram-sha-512.sasl.jaas.config"] = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
    if cfg.sasl_ssl_port and keystore is not None:
        props.update({"ssl.keystore.type": "PKCS12", "ssl.keystore.location": str(keystore.resolve()),
                      "ssl.keystore.password": store_password, "ssl.key.password": store_password,
                      "ssl.client.auth": "none"})
    props["_listeners"] = ",".join(f"{n}://{cfg.host}:{ports[n]}" for n in names)
    props["_map"] = ",".join(f"{n}:{n}" for n in names)
    return props


def server_properties(cfg: BrokerConfig, keystore: Path | None = None, store_password: str = "") -> str:
    n = cfg.cluster_size
    voters = cfg.voters or ((cfg.node_id, cfg.controller_port),)
    # Replicated cluster: every partition on 3 nodes (fewer if the cluster is smaller), and an
    # acks=all write needs 2 of them, so one node may die without losing an acknowledged message.
    rf, min_isr = str(min(n, 3)), str(min(n, 2))
    props = {
        # KRaft combined mode: each JVM is a broker and a voter of the controller quorum (one
        # voter alone for the single broker).
        "process.roles": "broker,controller",
        "node.id": str(cfg.node_id),
        "controller.quorum.voters": ",".join(f"{i}@{cfg.host}:{port}" for i, port in voters),
        "listeners": f"PLAINTEXT://{cfg.host}:{cfg.port},CONTROLLER://{cfg.host}:{cfg.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{cfg.host}:{cfg.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": ",".join(str(d.resolve()) for d in cfg.log_dirs),
        # A single node needs every replication factor at 1, or internal topics never come online.
        "default.replication.factor": rf,
        "min.insync.replicas": min_isr,
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": min_isr,
        # Fewer internal partitions than the defaults (50) so a fresh broker is ready sooner.
        "offsets.topic.num.partitions": "8",
        "transaction.state.log.num.partitions": "4",
        # Topics come from `kvpipe.infra.topics` or from Faust through the admin API; a misspelt topic
        # name in a producer must fail, not silently create a 1-partition topic.
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        # Tests and Faust workers join groups constantly; the 3 s default delay is pure waiting.
        "group.initial.rebalance.delay.ms": "0",
        # Dev-sized storage: small segments so retention and compaction actually run locally.
        "log.segment.bytes": str(64 * 1024 * 1024),
        "log.retention.hours": "24",
        "log.retention.bytes": str(1024 * 1024 * 1024),
        "log.retention.check.interval.ms": "60000",
        "log.cleaner.dedupe.buffer.size": str(32 * 1024 * 1024),  # default 128 MB of a small heap
        # One message carries a whole node step (many events): the broker must accept what the
        # producer is configured to send (Settings.max_message_bytes), plus batch overhead.
        "message.max.bytes": str(cfg.max_message_bytes + 64 * 1024),
        "replica.fetch.max.bytes": str(cfg.max_message_bytes + 64 * 1024),
        "num.network.threads": "3",
        "num.io.threads": "4",
    }
    if cfg.secure:
        extra = _secure_props(cfg, keystore, store_password)
        listeners, protocol_map = extra.pop("_listeners"), extra.pop("_map")
        props["listeners"] += "," + listeners
        props["advertised.listeners"] += "," + listeners
        props["listener.security.protocol.map"] += "," + protocol_map
        props.update(extra)
    lines = ["# Generated by `kvpipe infra up`; edits are overwritten on the next start."]
    lines += [f"{k}={v}" for k, v in props.items()]
    return "\n".join(lines) + "\n"


def log4j_properties(cfg: BrokerConfig) -> str:
    # log4j 1.x syntax (reload4j), as Kafka 3.x's config/log4j.properties; one rolling file
    # instead of the release's six appenders — a dev broker needs one place to look.
    log = str(cfg.server_log.resolve())
    return "\n".join([
        "log4j.rootLogger=INFO, file",
        "log4j.appender.file=org.apache.log4j.RollingFileAppender",
        f"log4j.appender.file.File={log}",
        "log4j.appender.file.MaxFileSize=20MB",
        "log4j.appender.file.MaxBackupIndex=3",
        "log4j.appender.file.layout=org.apache.log4j.PatternLayout",
        "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n",
        # The request and state-change loggers are chatty at INFO; keep them quiet.
        "log4j.logger.kafka.request.logger=WARN",
        "log4j.logger.kafka.controller=INFO",
        "log4j.logger.state.change.logger=WARN",
        "log4j.logger.org.apache.kafka.clients=WARN",
        "",
    ])


def write_configs(cfg: BrokerConfig, keystore: Path | None = None, store_password: str = "") -> None:
    cfg.kafka_dir.mkdir(parents=True, exist_ok=True)
    # 0600: a secured broker's file holds the PLAIN users' passwords and the key store password.
    fd = os.open(cfg.server_properties, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(server_properties(cfg, keystore, store_password))
    cfg.log4j_properties.write_text(log4j_properties(cfg))


def cluster_id(cfg: BrokerConfig) -> str:
    """The stored cluster id, created on first use."""
    if cfg.cluster_id_file.is_file():
        return cfg.cluster_id_file.read_text().strip()
    cid = new_cluster_id()
    cfg.kafka_dir.mkdir(parents=True, exist_ok=True)
    cfg.cluster_id_file.write_text(cid + "\n")
    return cid
