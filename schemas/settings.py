"""One typed settings Struct for every kvpipe process.

Resolution order (later wins): the defaults below, which work on one machine out of the box → the
settings file, a TOML file whose keys are the field names, read only when named (`--config FILE` on
any command, or `KVPIPE_CONFIG=FILE`: a file found in the working directory is not read, so where a
process starts does not change what it runs with) → environment variables `KVPIPE_<FIELD>` (upper
case, e.g. `KVPIPE_KAFKA_BOOTSTRAP`) → a command's own flags. Values are decoded by msgspec, so a wrong
type fails at start with the field's name and where the value came from, not deep in a run. The
layers, unknown keys and unknown `KVPIPE_*` names: kvpipe.schemas.configlayers; contradictions between
settings: kvpipe.schemas.settingscheck; the reference: docs/settings.md (`kvpipe config show` prints the
effective values).
"""
from __future__ import annotations

import ipaddress
import os
import ssl
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

import msgspec

from kvpipe.schemas.configlayers import Layers, gather, parse_properties, read_file
from kvpipe.schemas.configlayers import SettingsError as SettingsError
from kvpipe.schemas.redact import masked, read_secret
from kvpipe.schemas.settingscheck import validate


def Doc(text: str) -> msgspec.Meta:
    """A setting's description, for its user: the reference and the schema carry it (Annotated metadata)."""
    return msgspec.Meta(description=text)


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Every kvpipe setting. A field's description (`Doc`) is the user's documentation: docs/settings.md and
    infra/kvpipe.schema.json are generated from this type (tests/unit/test_settings_reference.py), so a
    setting without one fails the tests."""

    state_dir: Annotated[str, Doc("where local state lives: Kafka data, chDB files, processor snapshots, pid files "
                                  "(`--datadir`)")] = ".kvpipe"
    log_level: Annotated[str, Doc("level of kvpipe's and Faust's loggers: debug, info, warning, error, critical "
                                  "(`--log-level`); empty: the command's own default")] = ""
    log_format: Annotated[Literal["text", "json"], Doc(
        "how log lines are written (`--log-format`): `text` for people, or `json`, one object per line (time, "
        "level, logger, message, exception) for a log pipeline (docs/operations.md)")] = "text"

    # Kafka
    kafka_bootstrap: Annotated[str, Doc("Kafka brokers, HOST:PORT[,...] (`--bootstrap-server`); empty: the local "
                                        "broker that `kvpipe infra up` runs")] = ""
    kafka_port: Annotated[int, Doc("port of the local broker's plaintext listener")] = 19092
    kafka_controller_port: Annotated[int, Doc("port of the local broker's KRaft controller")] = 19093
    kafka_version: Annotated[str, Doc("Apache Kafka release `kvpipe infra up` downloads and runs")] = "3.9.1"
    kafka_heap: Annotated[str, Doc("JVM heap of each local broker node (all of it from the start: `-Xms` = `-Xmx`)")] = "768m"
    # A count, so not `kafka_brokers`, its old name (RENAMED): to Kafka and Faust "brokers" are addresses.
    kafka_local_brokers: Annotated[int, Doc("how many nodes the local cluster runs (`kvpipe infra up --brokers N`); "
                                            "clients bootstrap from all of them")] = 1
    events_topic: Annotated[str, Doc("topic of the KV events: producers write it, both apps consume it")] = "kv-events"
    dlq_topic: Annotated[str, Doc("dead-letter topic: messages the apps cannot use, with the reason")] = "kv-events-dlq"
    snapshot_topic: Annotated[str, Doc("compacted topic of the routing app's index snapshots")] = "kv-index-snapshots"
    partitions: Annotated[int, Doc("partitions of the topics kvpipe creates; the most workers one app's group "
                                   "can use")] = 4
    kafka_properties: Annotated[dict[str, str | int | float | bool], Doc(
        "more Kafka client properties, as Kafka names them (a TOML table; a JSON object in the environment): given "
        "to every librdkafka client; the Faust apps take those with an aiokafka equivalent and refuse the rest. "
        "Properties a setting owns are refused (docs/settings.md)")] = {}
    kafka_properties_file: Annotated[str, Doc("a Java .properties file of more Kafka client properties (Kafka's "
                                              "`--command-config`), merged under kafka_properties")] = ""

    # wire
    max_message_bytes: Annotated[int, Doc("largest message kvpipe writes or accepts (one node step's events)")] = \
        8 * 1024 * 1024

    # producer
    producer_queue_batches: Annotated[int, Doc("bounded queue in front of the producer's background sender, in "
                                               "batches")] = 10_000
    producer_stall_s: Annotated[float, msgspec.Meta(gt=0), Doc(
        "a producer holding envelopes in Kafka's client with none delivered for this long asks the cluster for "
        "its topic's metadata again (then at doubling intervals, up to once a minute)")] = 5.0
    heartbeat_s: Annotated[float, Doc("a producer sends its node's heartbeat (load, liveness) this often")] = 2.0
    specs_every_s: Annotated[float, Doc("a producer resends its node's group specs at least this often")] = 30.0
    linger_ms: Annotated[float, Doc("producer linger: how long a batch waits for more events (librdkafka "
                                    "`linger.ms`)")] = 5.0
    compression: Annotated[str, Doc("producer compression codec (librdkafka `compression.type`)")] = "lz4"

    # processor
    processor_id: Annotated[str, Doc("the routing app's Faust id, which is its consumer group "
                                     "(`kvpipe processor --processor-id`)")] = "kvpipe-processor"
    web_host: Annotated[str, Doc("address both apps' HTTP servers bind (`--web-bind`); beyond loopback only with "
                                 "a token or `insecure`")] = "127.0.0.1"
    web_port: Annotated[int, Doc("HTTP port of the routing app, the route API (`kvpipe processor --web-port`)")] = 6066
    node_ttl_s: Annotated[float, Doc("a node silent this long expires: it leaves routing")] = 30.0
    snapshot_every_s: Annotated[float, Doc("how often each app snapshots its index to Kafka")] = 10.0
    snapshot_timeout_s: Annotated[float, Doc("a snapshot not acknowledged by then fails, counted in /stats")] = 60.0
    processor_delivery: Annotated[Literal["batch", "message"], Doc(
        "how fetched events reach either app's index and row path: `batch` (a partition's fetched run per "
        "call, processors/core/batchdelivery.py) or `message` (one at a time through Faust's stream; the "
        "fallback)")] = "batch"
    fetch_min_bytes: Annotated[int, msgspec.Meta(ge=1), Doc(
        "both apps' event fetches while events flow: the broker answers once this many bytes are there, or after "
        "`fetch_max_wait_ms`. Each fetch costs the app's Python a fixed ~0.1 ms, so fuller fetches free CPU on a "
        "busy app (the routing app ingesting 100 k events/s: ~0.54 cores instead of ~0.74). Once a fetch comes "
        "back empty the next ones answer on the first byte again (Faust's own sizing), so a quiet app does not "
        "poll. 1: always Faust's sizing")] = 16384
    fetch_max_wait_ms: Annotated[int, msgspec.Meta(ge=0, le=10_000), Doc(
        "the longest the broker holds a fetch for `fetch_min_bytes` while events flow: what an event may wait "
        "beyond its arrival")] = 2

    # analytics app (`kvpipe analytics`): its own Faust app and consumer group on the events topic
    analytics_id: Annotated[str, Doc("the analytics app's Faust id, which is its consumer group")] = "kvpipe-analytics"
    analytics_web_port: Annotated[int, Doc("HTTP port of the analytics app (/sql, /stats, /metrics)")] = 6067
    analytics_snapshot_topic: Annotated[str, Doc("compacted topic of the analytics app's own index "
                                                 "snapshots")] = "kv-analytics-snapshots"
    clickhouse_dsn: Annotated[str, Doc("the analytics store: `http(s)://user@host:8123/db` (a ClickHouse server) or "
                                       "`chdb:///path`; empty: embedded chDB under state_dir/analytics. A password "
                                       "here is masked in output; clickhouse_password_file keeps it out")] = ""
    clickhouse_password_file: Annotated[str, Doc("a file holding the ClickHouse server user's password (a trailing "
                                                 "newline is stripped), read when a client connects")] = ""
    clickhouse_ca_cert: Annotated[str, Doc("PEM bundle of the CA that signed the ClickHouse server's certificate "
                                           "(an https DSN; empty: the system's CAs)")] = ""
    clickhouse_verify: Annotated[bool, Doc("verify the ClickHouse server's TLS certificate (an https DSN); turn off "
                                           "only for a test server")] = True
    analytics_batch_rows: Annotated[int, msgspec.Meta(ge=1), Doc(
        "rows per insert into the store (each insert is a part the store merges later: fewer, larger ones cost it "
        "less; 20 000 took half the store's time of 5 000 per row, BENCHMARKS.md, analytics)")] = 20_000
    analytics_flush_s: Annotated[float, Doc("a partial batch is written after this long")] = 1.0
    analytics_max_queue_rows: Annotated[int, Doc("rows waiting for the store before consumption pauses")] = 100_000
    analytics_retry_max_s: Annotated[float, Doc("longest back-off between write retries while the store "
                                                "refuses")] = 30.0
    analytics_capacity: Annotated[bool, Doc(
        "track re-stores and LRU stack distances for capacity planning (kv_restores, `kvpipe plan`); off saves "
        "the per-stored-block tracking cost (BENCHMARKS.md, analytics) when nobody plans capacity")] = True
    analytics_rows_engine: Annotated[Literal["native", "python"], Doc(
        "how the analytics app derives and encodes its rows: `native` (runs of common-case messages applied, "
        "tracked and turned into Native-format columns by the native core, native/src/anarows.rs) or `python` "
        "(the reference: one message at a time through processors/analytics/derive.py and clickhouse-connect's "
        "encoding); the Python engine runs `python` whatever this says")] = "native"

    # analyst SQL (served by the analytics app): limits the engine enforces per query
    sql_max_execution_s: Annotated[float, Doc("analyst SQL: longest a query may run")] = 30.0
    sql_max_memory_bytes: Annotated[int, Doc("analyst SQL: memory one query may use")] = 1 << 30
    sql_max_result_rows: Annotated[int, Doc("analyst SQL: rows one result may have")] = 100_000
    sql_max_result_bytes: Annotated[int, Doc("analyst SQL: bytes one result may have")] = 64 << 20
    sql_max_concurrent: Annotated[int, Doc("analyst SQL: queries one analytics app runs at once")] = 2

    # -- security (docs/security.md) --------------------------------------------------------------
    # Secrets below never reach a log line: `repr()` masks them (see __repr__) and the Kafka client
    # configs are built here, in one place, so no caller formats them into a message.
    api_token: Annotated[str, Doc("bearer token every kvpipe HTTP endpoint but /health and /openapi.json requires "
                                  "once it is set; masked in output")] = ""
    api_token_file: Annotated[str, Doc("a file holding the token (a trailing newline is stripped)")] = ""
    insecure: Annotated[bool, Doc("allow a non-loopback web_host without a token (`--insecure`)")] = False
    # Kafka: the same settings drive every client (confluent-kafka, aiokafka under Faust).
    kafka_security_protocol: Annotated[str, Doc("PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL, for every Kafka "
                                                "client")] = "PLAINTEXT"
    kafka_sasl_mechanism: Annotated[str, Doc("PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (empty: "
                                             "PLAIN)")] = ""
    kafka_sasl_username: Annotated[str, Doc("SASL user name")] = ""
    kafka_sasl_password: Annotated[str, Doc("SASL password; masked in output")] = ""
    kafka_sasl_password_file: Annotated[str, Doc("a file holding the SASL password")] = ""
    kafka_ssl_cafile: Annotated[str, Doc("PEM bundle of the CA that signed the brokers' certificates (empty: the "
                                         "system's CAs)")] = ""
    kafka_ssl_certfile: Annotated[str, Doc("client certificate for mutual TLS, PEM")] = ""
    kafka_ssl_keyfile: Annotated[str, Doc("its private key, PEM (empty: inside the certificate file)")] = ""
    kafka_ssl_key_password: Annotated[str, Doc("the private key's password; masked in output")] = ""
    kafka_ssl_check_hostname: Annotated[bool, Doc("check that the broker's certificate names the host "
                                                  "connected to")] = True
    kafka_oauth_token_url: Annotated[str, Doc("OAUTHBEARER: the OIDC token endpoint (client-credentials "
                                              "grant)")] = ""
    kafka_oauth_client_id: Annotated[str, Doc("OAUTHBEARER: the client id")] = ""
    kafka_oauth_client_secret: Annotated[str, Doc("OAUTHBEARER: the client secret; masked in output")] = ""
    kafka_oauth_scope: Annotated[str, Doc("OAUTHBEARER: the scope asked for (empty: none)")] = ""
    kafka_local_secure: Annotated[bool, Doc(
        "`kvpipe infra up --secure`: the local broker also listens with SASL (PLAIN, SCRAM-SHA-512) on "
        "kafka_sasl_port and, with TLS, kafka_sasl_ssl_port; the plaintext listener on kafka_port stays")] = False
    kafka_sasl_port: Annotated[int, Doc("the local broker's SASL_PLAINTEXT listener")] = 19094
    kafka_sasl_ssl_port: Annotated[int, Doc("the local broker's SASL_SSL listener")] = 19095

    # hardening (RELIABILITY.md): bounds on what hostile or broken input can do to the processor
    max_clock_skew_s: Annotated[float, Doc("a node's timestamp beyond the trusted clock plus this is clamped "
                                           "(and counted)")] = 10.0
    node_retention_s: Annotated[float, Doc("an expired node's last state stays in /nodes this long, then is "
                                           "forgotten")] = 3600.0
    max_nodes: Annotated[int, Doc("node ids one processor tracks; new ids past it are refused (counted)")] = 100_000
    max_blocks_per_slot: Annotated[int, Doc("hashes one node may hold per (group, medium); more are "
                                            "refused")] = 1_000_000
    max_slots_per_node: Annotated[int, Doc("(group, medium) pairs per node: vLLM models have a handful of "
                                           "groups")] = 64
    dlq_copy_max_bytes: Annotated[int, Doc("larger bad messages go to the DLQ as an excerpt, never "
                                           "whole")] = 512 * 1024
    dlq_excerpt_bytes: Annotated[int, Doc("bytes of a bad message its DLQ excerpt keeps")] = 1024
    http_max_body_bytes: Annotated[int, Doc("largest HTTP request body the apps read")] = 8 * 1024 * 1024
    http_max_json_depth: Annotated[int, Doc("deepest JSON nesting an HTTP request body may have")] = 32
    http_read_timeout_s: Annotated[float, Doc("a client that has not sent its whole request by then is "
                                              "dropped")] = 10.0

    # router (/route, /route/sent, /route/finished: processors/router/, processors/router/serving.py)
    route_inflight_ttl_s: Annotated[float, Doc("a sent request's speculative blocks and load last this long at "
                                               "most")] = 30.0
    route_inflight_max_requests: Annotated[int, Doc("in-flight request records per worker; the oldest go "
                                                    "first")] = 100_000
    route_inflight_max_entries: Annotated[int, Doc("speculative (node, group, hash) entries per "
                                                   "worker")] = 2_000_000
    route_stale_after_s: Annotated[float, Doc("a node silent longer than this ranks after live ones "
                                              "(`stale`)")] = 15.0
    # the native route server: processors/routing/routeserve.py
    route_port: Annotated[int, Doc("port of the native route server: POST /route answered on native threads beside "
                                   "ingest, every other request passed to this app's web port; 0: off")] = 0
    route_threads: Annotated[int, Doc("threads of the native route server; 0: one per core this process may "
                                      "run on")] = 0
    route_reuse_port: Annotated[bool, Doc("SO_REUSEPORT: router replicas on one host share "
                                          "route_port")] = False
    route_nice: Annotated[int, Doc("niceness of the route server's threads: on busy cores ingest (nice 0) runs "
                                   "before queries")] = 5
    route_hash_memo_entries: Annotated[int, Doc(
        "digests of prompt units some node holds that the route server remembers, so a prefix routed before is "
        "not hashed again (about 100 bytes each with 16-token units; exact: a digest is used only for the same "
        "parent digest and token ids); the text of their token ids is remembered too, 16 ids per entry (about "
        "11 bytes an id), so those ids are not read digit by digit again (exact: used only where the body's bytes "
        "are equal); 0: hash and read every request in full")] = 65_536
    route_refresh_s: Annotated[float, Doc("how often the nodes' live state (load, suspect, last seen) reaches the "
                                          "route server")] = 0.005
    route_search_engine: Annotated[Literal["native", "python"], Doc(
        "the hit search: `native` (native/; the Python one when it is not importable) or `python` (gpu/hit.py, "
        "the reference): equal answers, the native one is faster")] = "native"
    index_store: Annotated[Literal["native", "python"], Doc(
        "where the index keeps its blocks (processors/core/slots.py): `native` (native/; the dict reference when "
        "it is not importable) or `python` (the reference): equal answers, native is smaller and faster")] = "native"
    require_native: Annotated[bool, Doc(
        "refuse to start without the native core; where it is missing or stale the apps otherwise run on the "
        "Python engine and say why at start-up (processors/core/native.py)")] = False

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={masked(name, getattr(self, name))!r}" for name in _FIELDS)
        return f"Settings({shown})"

    def __rich_repr__(self):
        for name in _FIELDS:
            yield name, masked(name, getattr(self, name))

    def bootstrap(self) -> str:
        if self.kafka_bootstrap:
            return self.kafka_bootstrap
        # The local broker (`kvpipe infra up --secure`) has one listener per protocol.
        port = {"SASL_PLAINTEXT": self.kafka_sasl_port, "SASL_SSL": self.kafka_sasl_ssl_port}.get(
            self.kafka_security_protocol, self.kafka_port)
        if self.kafka_local_brokers > 1:  # the local cluster's node k listens on kafka_port + 2(k-1) (infra/kafka/cluster.py)
            return ",".join(f"127.0.0.1:{self.kafka_port + 2 * k}" for k in range(self.kafka_local_brokers))
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

    def clickhouse_client_kwargs(self, dsn: str | None = None) -> dict[str, Any]:
        """clickhouse-connect `get_client` keyword arguments beside a server DSN (default: the store's; {} for
        chDB): the password from clickhouse_password_file, read here at connect time and handed to the client
        only (an explicit `password` wins over the DSN's), and the server's TLS options."""
        dsn = self.clickhouse() if dsn is None else dsn
        if not dsn.startswith(("http://", "https://")):
            return {}
        kwargs: dict[str, Any] = {}
        if self.clickhouse_password_file:
            kwargs["password"] = read_secret(self.clickhouse_password_file, "clickhouse_password_file")
        if dsn.startswith("https://"):
            kwargs["verify"] = self.clickhouse_verify
            if self.clickhouse_ca_cert:
                kwargs["ca_cert"] = self.clickhouse_ca_cert
        return kwargs

    # -- security: resolved secrets and client configurations -------------------------------------

    def api_token_value(self) -> str:
        """The HTTP bearer token ("" = none configured): api_token, else api_token_file's content."""
        if self.api_token or not self.api_token_file:
            return self.api_token
        return read_secret(self.api_token_file, "api_token_file")

    def kafka_password(self) -> str:
        if self.kafka_sasl_password or not self.kafka_sasl_password_file:
            return self.kafka_sasl_password
        return read_secret(self.kafka_sasl_password_file, "kafka_sasl_password_file")

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

    def kafka_client_properties(self) -> dict[str, Any]:
        """The pass-through client properties: kafka_properties_file's (read now, never printed), then
        kafka_properties' on top. No key a setting owns (kvpipe.schemas.settingscheck refuses those)."""
        props: dict[str, Any] = {}
        if self.kafka_properties_file:
            props.update(parse_properties(read_secret(self.kafka_properties_file, "kafka_properties_file")))
        props.update(self.kafka_properties)
        return props

    def kafka_confluent_security(self) -> dict[str, Any]:
        """librdkafka properties for the security settings and the pass-through ones (merge into any client's
        config; a client's own keys, such as a producer's `acks`, go on top)."""
        conf: dict[str, Any] = {**self.kafka_client_properties(), "security.protocol": self.kafka_security_protocol}
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


_FIELDS = {f.name: f.type for f in msgspec.structs.fields(Settings)}


# Settings renamed, old name → new. The old name is still read (a TOML key, a KVPIPE_ variable) with a
# FutureWarning, the category Python shows users by default; where both are given the new one wins.
RENAMED = {"kafka_brokers": "kafka_local_brokers"}


def settings_layers(overrides: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None) -> Layers:
    """The values as given and where each came from (kvpipe.schemas.configlayers), before typing: what
    `load_settings` types and `kvpipe config show` prints."""
    return gather(_FIELDS, overrides, os.environ if env is None else env, json_fields=("kafka_properties",),
                  renamed=RENAMED)


def check_settings_file(path: str) -> None:
    """SettingsError unless `path` is a settings file kvpipe can read: present, TOML, known keys only."""
    read_file(path, [*_FIELDS, *RENAMED])


def load_settings(overrides: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """Defaults ← settings file ← KVPIPE_* environment ← explicit overrides (e.g. CLI flags)."""
    return typed_settings(settings_layers(overrides, env))


def typed_settings(layers: Layers) -> Settings:
    try:
        # strict=False lets "19092" from the environment become an int.
        settings = msgspec.convert(layers.values, Settings, strict=False)
    except msgspec.ValidationError as exc:
        path = str(exc).rpartition("at `$.")[2].split("`")[0].split(".")[0].split("[")[0]
        where = f" ({layers.source(path)})" if path in _FIELDS else ""
        raise SettingsError(f"invalid kvpipe setting: {exc}{where}") from None
    validate(settings, layers.source)
    return settings
