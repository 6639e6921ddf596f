"""One typed settings Struct for every kvpipe process.

Resolution order (later wins): the defaults below, which work on one machine out of the box → a
TOML file (`KVPIPE_CONFIG=path`, else `./kvpipe.toml` if present; keys are the field names) →
environment variables `KVPIPE_<FIELD>` (upper case, e.g. `KVPIPE_KAFKA_BOOTSTRAP`). Values are
decoded by msgspec, so a wrong type fails at start with the field's name, not deep in a run.
"""
from __future__ import annotations

import ipaddress
import os
import ssl
import tomllib
from pathlib import Path
from typing import Any, Literal, Mapping

import msgspec


class SettingsError(ValueError):
    pass


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # where local state lives: Kafka data, chDB files, processor snapshots, pid files
    state_dir: str = ".kvpipe"

    # Kafka: empty bootstrap = the local broker that `kvpipe infra up` runs
    kafka_bootstrap: str = ""
    kafka_port: int = 19092
    kafka_controller_port: int = 19093
    kafka_version: str = "3.9.1"
    kafka_heap: str = "768m"
    # nodes of the local cluster (`kvpipe infra up --brokers N`); clients bootstrap from all of them
    kafka_brokers: int = 1
    events_topic: str = "kv-events"
    dlq_topic: str = "kv-events-dlq"
    snapshot_topic: str = "kv-index-snapshots"
    partitions: int = 4

    # wire
    max_message_bytes: int = 8 * 1024 * 1024

    # producer
    producer_queue_batches: int = 10_000  # bounded queue in front of the background sender
    heartbeat_s: float = 2.0
    specs_every_s: float = 30.0  # group specs resent at least this often
    linger_ms: float = 5.0
    compression: str = "lz4"

    # processor
    processor_id: str = "kvpipe-processor"
    web_host: str = "127.0.0.1"
    web_port: int = 6066
    node_ttl_s: float = 30.0
    snapshot_every_s: float = 10.0
    snapshot_timeout_s: float = 60.0  # a snapshot not acknowledged by then fails, counted in /stats
    # how fetched events reach the index: "batch" (a partition's fetched run per call,
    # processors/core/batchdelivery.py) or "message" (one at a time through Faust's stream; the fallback)
    processor_delivery: Literal["batch", "message"] = "batch"

    # analytics app (`kvpipe analytics`): its own Faust app and consumer group on the events topic
    analytics_id: str = "kvpipe-analytics"
    analytics_web_port: int = 6067
    analytics_snapshot_topic: str = "kv-analytics-snapshots"
    clickhouse_dsn: str = ""  # empty = embedded chDB under state_dir/analytics
    analytics_batch_rows: int = 5000
    analytics_flush_s: float = 1.0
    analytics_max_queue_rows: int = 100_000  # rows waiting for the store before consumption pauses
    analytics_retry_max_s: float = 30.0  # longest back-off between write retries while the store refuses
    # re-stores + LRU stack distances for capacity planning (kv_restores, `kvpipe plan`); off saves the
    # per-stored-block tracking cost (BENCHMARKS.md, analytics) when nobody plans capacity
    analytics_capacity: bool = True

    # analyst SQL (served by the analytics app): limits the engine enforces per query
    sql_max_execution_s: float = 30.0
    sql_max_memory_bytes: int = 1 << 30
    sql_max_result_rows: int = 100_000
    sql_max_result_bytes: int = 64 << 20
    sql_max_concurrent: int = 2

    # -- security (docs/security.md) --------------------------------------------------------------
    # Secrets below never reach a log line: `repr()` masks them (see __repr__) and the Kafka client
    # configs are built here, in one place, so no caller formats them into a message.
    #
    # HTTP: a bearer token every kvpipe HTTP endpoint but /health requires once it is set.
    api_token: str = ""  # KVPIPE_API_TOKEN
    api_token_file: str = ""  # a file holding the token (a trailing newline is stripped)
    insecure: bool = False  # allow a non-loopback web_host without a token
    # Kafka: the same settings drive every client (confluent-kafka, aiokafka under Faust).
    kafka_security_protocol: str = "PLAINTEXT"  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    kafka_sasl_mechanism: str = ""  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 | OAUTHBEARER (empty: PLAIN)
    kafka_sasl_username: str = ""
    kafka_sasl_password: str = ""
    kafka_sasl_password_file: str = ""
    kafka_ssl_cafile: str = ""  # PEM bundle of the CA that signed the brokers' certificates (empty: system CAs)
    kafka_ssl_certfile: str = ""  # client certificate (mutual TLS), PEM
    kafka_ssl_keyfile: str = ""  # its private key, PEM (empty: inside certfile)
    kafka_ssl_key_password: str = ""
    kafka_ssl_check_hostname: bool = True
    # OAUTHBEARER: OIDC client-credentials grant against this token endpoint
    kafka_oauth_token_url: str = ""
    kafka_oauth_client_id: str = ""
    kafka_oauth_client_secret: str = ""
    kafka_oauth_scope: str = ""
    # `kvpipe infra up --secure`: the local broker also listens with SASL (PLAIN, SCRAM-SHA-512)
    # on these ports, without and with TLS; the plaintext listener on kafka_port stays.
    kafka_local_secure: bool = False
    kafka_sasl_port: int = 19094
    kafka_sasl_ssl_port: int = 19095


    # hardening (RELIABILITY.md): bounds on what hostile or broken input can do to the processor
    max_clock_skew_s: float = 10.0  # a node's ts beyond the trusted clock + this is clamped (and counted)
    node_retention_s: float = 3600.0  # an expired node's last state stays in /nodes this long, then is forgotten
    max_nodes: int = 100_000  # node ids one processor tracks; new ids past it are refused (counted)
    max_blocks_per_slot: int = 1_000_000  # hashes one node may hold per (group, medium); more are refused
    max_slots_per_node: int = 64  # (group, medium) pairs per node: vLLM models have a handful of groups
    dlq_copy_max_bytes: int = 512 * 1024  # larger bad messages go to the DLQ as an excerpt, never whole
    dlq_excerpt_bytes: int = 1024
    http_max_body_bytes: int = 8 * 1024 * 1024
    http_max_json_depth: int = 32
    http_read_timeout_s: float = 10.0

    # router (/route, /route/sent, /route/finished: processors/router/, processors/router/serving.py)
    route_inflight_ttl_s: float = 30.0  # a sent request's speculative blocks and load last this long at most
    route_inflight_max_requests: int = 100_000  # in-flight records per worker; the oldest go first
    route_inflight_max_entries: int = 2_000_000  # speculative (node, group, hash) entries per worker
    route_stale_after_s: float = 15.0  # a node silent longer than this ranks after live ones ("stale")
    # the native route server (processors/routing/routeserve.py): POST /route answered on `route_threads` native
    # threads beside ingest, everything else passed to this app's web port; 0 = off
    route_port: int = 0
    route_threads: int = 0  # 0: one per core this process may run on
    route_reuse_port: bool = False  # SO_REUSEPORT: router replicas on one host share route_port
    route_nice: int = 5  # niceness of its threads: on busy cores ingest (nice 0) runs before queries
    route_refresh_s: float = 0.005  # how often the nodes' live state (load, suspect, last seen) reaches it
    # the hit search: "native" (native/, built by infra/scripts/venv.sh; the Python one when it is not
    # importable) or "python" (gpu/hit.py, the reference): equal answers, the native one is faster
    route_search_engine: Literal["native", "python"] = "native"
    # where the index keeps its blocks (processors/core/slots.py): "native" (native/; the dict reference
    # when it is not importable) or "python" (the reference): equal answers, native is smaller and faster
    index_store: Literal["native", "python"] = "native"
    # refuse to start without the native core (KVPIPE_REQUIRE_NATIVE=1): where it is missing or stale, the apps
    # otherwise run on the Python engine and say why at start-up (processors/core/native.py)
    require_native: bool = False

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={_masked(name, getattr(self, name))!r}" for name in _FIELDS)
        return f"Settings({shown})"

    def __rich_repr__(self):
        for name in _FIELDS:
            yield name, _masked(name, getattr(self, name))

    def bootstrap(self) -> str:
        if self.kafka_bootstrap:
            return self.kafka_bootstrap
        # The local broker (`kvpipe infra up --secure`) has one listener per protocol.
        port = {"SASL_PLAINTEXT": self.kafka_sasl_port, "SASL_SSL": self.kafka_sasl_ssl_port}.get(
            self.kafka_security_protocol, self.kafka_port)
        if self.kafka_brokers > 1:  # the local cluster's node k listens on kafka_port + 2(k-1) (infra/kafka/cluster.py)
            return ",".join(f"127.0.0.1:{self.kafka_port + 2 * k}" for k in range(self.kafka_brokers))
        return f"127.0.0.1:{port}"

    def is_local_kafka(self) -> bool:
        return not self.kafka_bootstrap

    def state_path(self, *parts: str) -> Path:
        return Path(self.state_dir).joinpath(*parts)

    def clickhouse(self) -> str:
        if self.clickhouse_dsn:
            return self.clickhouse_dsn
        return f"chdb://{Path(self.state_dir, 'analytics').resolve()}"

    def is_embedded_clickhouse(self) -> bool:
        return self.clickhouse().startswith("chdb://")

    # -- security: resolved secrets and client configurations -------------------------------------

    def api_token_value(self) -> str:
        """The HTTP bearer token ("" = none configured): api_token, else api_token_file's content."""
        if self.api_token or not self.api_token_file:
            return self.api_token
        return _read_secret(self.api_token_file, "api_token_file")

    def kafka_password(self) -> str:
        if self.kafka_sasl_password or not self.kafka_sasl_password_file:
            return self.kafka_sasl_password
        return _read_secret(self.kafka_sasl_password_file, "kafka_sasl_password_file")

    def kafka_mechanism(self) -> str:
        """The SASL mechanism in use ("" when the protocol has no SASL)."""
        if not self.kafka_security_protocol.startswith("SASL_"):
            return ""
        return self.kafka_sasl_mechanism or "PLAIN"

    def kafka_uses_ssl(self) -> bool:
        return self.kafka_security_protocol in ("SSL", "SASL_SSL")

    def kafka_cafile(self) -> str:
        """kafka_ssl_cafile; for the local secured broker, the CA `kvpipe infra up --secure` wrote
        (infra/kafka/tls.py); else "" (the system's CAs)."""
        if self.kafka_ssl_cafile or not self.is_local_kafka():
            return self.kafka_ssl_cafile
        local = self.state_path("kafka", "tls", "ca.pem")
        return str(local) if local.is_file() else ""

    def kafka_confluent_security(self) -> dict[str, Any]:
        """librdkafka properties for the security settings (merge into any client's config)."""
        conf: dict[str, Any] = {"security.protocol": self.kafka_security_protocol}
        mechanism = self.kafka_mechanism()
        if mechanism == "OAUTHBEARER":
            conf.update({"sasl.mechanism": mechanism, "sasl.oauthbearer.method": "oidc",
                         "sasl.oauthbearer.client.id": self.kafka_oauth_client_id,
                         "sasl.oauthbearer.client.secret": self.kafka_oauth_client_secret,
                         "sasl.oauthbearer.token.endpoint.url": self.kafka_oauth_token_url})
            if self.kafka_oauth_scope:
                conf["sasl.oauthbearer.scope"] = self.kafka_oauth_scope
        elif mechanism:
            conf.update({"sasl.mechanism": mechanism, "sasl.username": self.kafka_sasl_username,
                         "sasl.password": self.kafka_password()})
        if self.kafka_uses_ssl():
            if self.kafka_cafile():
                conf["ssl.ca.location"] = self.kafka_cafile()
            if self.kafka_ssl_certfile:
                conf["ssl.certificate.location"] = self.kafka_ssl_certfile
                conf["ssl.key.location"] = self.kafka_ssl_keyfile or self.kafka_ssl_certfile
            if self.kafka_ssl_key_password:
                conf["ssl.key.password"] = self.kafka_ssl_key_password
            conf["ssl.endpoint.identification.algorithm"] = "https" if self.kafka_ssl_check_hostname else "none"
        return conf

    def kafka_confluent_config(self) -> dict[str, Any]:
        """`bootstrap.servers` plus the security properties: the base of every confluent-kafka client."""
        return {"bootstrap.servers": self.bootstrap(), **self.kafka_confluent_security()}

    def kafka_ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context aiokafka clients use (None without TLS)."""
        if not self.kafka_uses_ssl():
            return None
        ctx = ssl.create_default_context(cafile=self.kafka_cafile() or None)
        ctx.check_hostname = self.kafka_ssl_check_hostname
        if self.kafka_ssl_certfile:
            ctx.load_cert_chain(self.kafka_ssl_certfile, self.kafka_ssl_keyfile or None,
                                password=self.kafka_ssl_key_password or None)
        return ctx

    def kafka_aiokafka_kwargs(self) -> dict[str, Any]:
        """aiokafka client keyword arguments for the security settings. OAUTHBEARER needs a token
        provider object, which kvpipe.processors.core.kafkaconf adds (schemas stays free of client libraries)."""
        kwargs: dict[str, Any] = {"security_protocol": self.kafka_security_protocol}
        mechanism = self.kafka_mechanism()
        if mechanism:
            kwargs["sasl_mechanism"] = mechanism
        if mechanism and mechanism != "OAUTHBEARER":
            kwargs.update(sasl_plain_username=self.kafka_sasl_username, sasl_plain_password=self.kafka_password())
        ctx = self.kafka_ssl_context()
        if ctx is not None:
            kwargs["ssl_context"] = ctx
        return kwargs


PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
# Field names whose values are secrets: masked by Settings.__repr__ / __rich_repr__.
SECRET_FIELDS = frozenset({"api_token", "kafka_sasl_password", "kafka_ssl_key_password", "kafka_oauth_client_secret"})


def _masked(name: str, value: object) -> object:
    return "***" if name in SECRET_FIELDS and value else value


def _read_secret(path: str, field: str) -> str:
    try:
        return Path(path).read_text().rstrip("\r\n")
    except OSError as exc:  # the reason (missing, permission), never the content
        raise SettingsError(f"{field}: cannot read {path}: {exc.strerror}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def exposure_problem(host: str, has_token: bool, insecure: bool) -> str | None:
    """Why serving HTTP on `host` is refused, or None. The rule: without a token, loopback only."""
    if is_loopback(host) or has_token or insecure:
        return None
    return (f"refusing to serve HTTP on {host} without authentication: anyone who can reach it could read "
            f"the index and run queries. Set KVPIPE_API_TOKEN (or api_token_file), bind 127.0.0.1, "
            f"or pass --insecure to accept an open endpoint")


def _validate_security(s: Settings) -> None:
    """Contradictions that would otherwise surface as an opaque handshake failure much later."""
    problems = []
    if s.kafka_security_protocol not in PROTOCOLS:
        problems.append(f"kafka_security_protocol={s.kafka_security_protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    sasl = s.kafka_security_protocol.startswith("SASL_")
    if s.kafka_sasl_mechanism and s.kafka_sasl_mechanism not in MECHANISMS:
        problems.append(f"kafka_sasl_mechanism={s.kafka_sasl_mechanism!r}: expected one of {', '.join(MECHANISMS)}")
    elif s.kafka_sasl_mechanism and not sasl:
        problems.append(f"kafka_sasl_mechanism={s.kafka_sasl_mechanism} needs kafka_security_protocol "
                        f"SASL_PLAINTEXT or SASL_SSL (it is {s.kafka_security_protocol})")
    if s.kafka_sasl_password and s.kafka_sasl_password_file:
        problems.append("kafka_sasl_password and kafka_sasl_password_file are both set; keep one")
    if s.api_token and s.api_token_file:
        problems.append("api_token and api_token_file are both set; keep one")
    mechanism = s.kafka_mechanism()
    if mechanism == "OAUTHBEARER":
        missing = [f for f in ("kafka_oauth_token_url", "kafka_oauth_client_id", "kafka_oauth_client_secret")
                   if not getattr(s, f)]
        if missing:
            problems.append(f"kafka_sasl_mechanism=OAUTHBEARER needs {', '.join(missing)}")
    elif mechanism:
        if not s.kafka_sasl_username:
            problems.append(f"kafka_sasl_mechanism={mechanism} needs kafka_sasl_username")
        if not (s.kafka_sasl_password or s.kafka_sasl_password_file):
            problems.append(f"kafka_sasl_mechanism={mechanism} needs kafka_sasl_password or kafka_sasl_password_file")
    tls_files = [f for f in ("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile") if getattr(s, f)]
    if tls_files and not s.kafka_uses_ssl():
        problems.append(f"{', '.join(tls_files)} set but kafka_security_protocol={s.kafka_security_protocol} "
                        f"has no TLS (use SSL or SASL_SSL)")
    for field in tls_files + [f for f in ("api_token_file", "kafka_sasl_password_file") if getattr(s, f)]:
        if not os.access(getattr(s, field), os.R_OK):
            problems.append(f"{field}={getattr(s, field)}: not a readable file")
    if s.kafka_ssl_keyfile and not s.kafka_ssl_certfile:
        problems.append("kafka_ssl_keyfile needs kafka_ssl_certfile (the certificate the key belongs to)")
    if problems:
        raise SettingsError("invalid kvpipe security setting: " + "; ".join(problems))


_FIELDS = {f.name: f.type for f in msgspec.structs.fields(Settings)}


def _from_env(env: Mapping[str, str]) -> dict[str, str]:
    out = {}
    for name in _FIELDS:
        key = f"KVPIPE_{name.upper()}"
        if key in env:
            out[name] = env[key]
    return out


def load_settings(overrides: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Defaults ← TOML file ← KVPIPE_* environment ← explicit overrides (e.g. CLI flags)."""
    env = os.environ if env is None else env
    merged: dict[str, object] = {}
    path = env.get("KVPIPE_CONFIG") or ("kvpipe.toml" if Path("kvpipe.toml").exists() else "")
    if path:
        try:
            merged.update(tomllib.loads(Path(path).read_text()))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"cannot read settings file {path}: {exc}") from None
    merged.update(_from_env(env))
    if overrides:
        merged.update({k: v for k, v in overrides.items() if v is not None})
    try:
        # strict=False lets "19092" from the environment become an int.
        settings = msgspec.convert(merged, Settings, strict=False)
    except msgspec.ValidationError as exc:
        raise SettingsError(f"invalid kvpipe setting: {exc}") from None
    _validate_security(settings)
    return settings
