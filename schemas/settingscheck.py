"""Contradictions between settings, refused when the settings load, each with the fields named.

They would otherwise surface much later and far away: an opaque TLS handshake failure, a Kafka client
that ignores a property, a ClickHouse password that two places disagree on. Every problem found is
reported at once, so one edit of the file fixes them all. A value's origin (`file PATH`, `env
KVPIPE_X`) is named where the value itself is wrong, since that is where it must be changed.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvpipe.schemas.configlayers import SettingsError

if TYPE_CHECKING:
    from kvpipe.schemas.settings import Settings

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# Kafka client properties a setting owns → that setting. Given in kafka_properties they are refused: one
# place for each value, and the security ones stay where their checks above and the masking are.
OWNED_KAFKA_PROPERTIES = {
    "bootstrap.servers": "kafka_bootstrap", "metadata.broker.list": "kafka_bootstrap",
    "security.protocol": "kafka_security_protocol",
    "sasl.mechanism": "kafka_sasl_mechanism", "sasl.mechanisms": "kafka_sasl_mechanism",
    "sasl.username": "kafka_sasl_username", "sasl.password": "kafka_sasl_password",
    "ssl.ca.location": "kafka_ssl_cafile", "ssl.certificate.location": "kafka_ssl_certfile",
    "ssl.key.location": "kafka_ssl_keyfile", "ssl.key.password": "kafka_ssl_key_password",
    "ssl.endpoint.identification.algorithm": "kafka_ssl_check_hostname",
    "sasl.oauthbearer.method": "kafka_sasl_mechanism", "sasl.oauthbearer.client.id": "kafka_oauth_client_id",
    "sasl.oauthbearer.client.secret": "kafka_oauth_client_secret",
    "sasl.oauthbearer.token.endpoint.url": "kafka_oauth_token_url", "sasl.oauthbearer.scope": "kafka_oauth_scope",
    "compression.type": "compression", "compression.codec": "compression",
    "linger.ms": "linger_ms", "queue.buffering.max.ms": "linger_ms", "message.max.bytes": "max_message_bytes",
}


def validate(s: Settings, source: Callable[[str], str]) -> None:
    """SettingsError listing every problem; `source(name)` says where a setting's value came from."""
    problems = _security(s) + _clickhouse(s) + _kafka_properties(s)
    if s.log_level and s.log_level.lower() not in LOG_LEVELS:
        problems.append(f"log_level={s.log_level!r} ({source('log_level')}): expected one of {', '.join(LOG_LEVELS)}")
    for field in ("kafka_ssl_cafile", "kafka_ssl_certfile", "kafka_ssl_keyfile", "api_token_file", "kafka_sasl_password_file",
                  "clickhouse_password_file", "clickhouse_ca_cert", "kafka_properties_file"):
        path = getattr(s, field)
        if path and not os.access(path, os.R_OK):
            problems.append(f"{field}={path} ({source(field)}): not a readable file")
    if problems:
        raise SettingsError("invalid kvpipe setting: " + "; ".join(problems))


def _security(s: Settings) -> list[str]:
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
    if s.kafka_ssl_keyfile and not s.kafka_ssl_certfile:
        problems.append("kafka_ssl_keyfile needs kafka_ssl_certfile (the certificate the key belongs to)")
    return problems


def _clickhouse(s: Settings) -> list[str]:
    """The password file and TLS options apply to a server DSN only; the DSN's scheme is named, never the DSN
    (it may carry a password)."""
    problems = []
    dsn = s.clickhouse()
    scheme = dsn.split("://", 1)[0]
    if s.clickhouse_password_file:
        if s.is_embedded_clickhouse():
            problems.append("clickhouse_password_file needs a ClickHouse server clickhouse_dsn (http:// or https://); "
                            "the embedded store has no password")
        elif _dsn_password(dsn):
            problems.append("clickhouse_dsn carries a password and clickhouse_password_file is set; keep one")
    tls = [f for f, on in (("clickhouse_ca_cert", bool(s.clickhouse_ca_cert)),
                           ("clickhouse_verify", not s.clickhouse_verify)) if on]
    if tls and scheme != "https":
        problems.append(f"{', '.join(tls)} set but clickhouse_dsn is {scheme}://, without TLS (use https://)")
    return problems


def _dsn_password(dsn: str) -> bool:
    try:
        return bool(urlsplit(dsn).password)
    except ValueError:
        return False


def _kafka_properties(s: Settings) -> list[str]:
    if s.kafka_properties_file and not os.access(s.kafka_properties_file, os.R_OK):
        return []  # reported as an unreadable file
    owned = [f"{key} (set it with {OWNED_KAFKA_PROPERTIES[key]})" for key in s.kafka_client_properties()
             if key in OWNED_KAFKA_PROPERTIES]
    return [f"kafka_properties: {', '.join(owned)}: a setting owns it"] if owned else []
