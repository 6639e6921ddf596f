"""The local broker's secured listeners (infra/kafka/config.py): the default broker is unchanged,
`--secure` adds SASL_PLAINTEXT and SASL_SSL with PLAIN and SCRAM-SHA-512, and SCRAM users are
handed to the storage tool as salted credentials (RFC 5802), never in clear."""
from __future__ import annotations

import base64
import hashlib
import hmac
import re
from pathlib import Path

import pytest

from kvpipe.infra.cli import broker_config
from kvpipe.infra.kafka.config import BrokerConfig, scram_credential, server_properties
from kvpipe.schemas.settings import SettingsError, load_settings


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_the_default_broker_has_only_its_plaintext_and_controller_listeners():
    props = _props(server_properties(BrokerConfig(Path("/tmp/k"))))
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["listener.security.protocol.map"] == "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
    assert not [k for k in props if "sasl" in k or k.startswith("ssl.")]


def test_secure_broker_adds_both_sasl_listeners_with_plain_and_scram():
    cfg = BrokerConfig(Path("/tmp/k"), sasl_port=29392, sasl_ssl_port=29393, users=(("alice", "pw-alice"),))
    props = _props(server_properties(cfg, Path("/tmp/k/tls/broker.p12"), "store-pw"))
    assert props["listeners"].endswith(",SASL_PLAINTEXT://127.0.0.1:29392,SASL_SSL://127.0.0.1:29393")
    assert props["advertised.listeners"].endswith(",SASL_PLAINTEXT://127.0.0.1:29392,SASL_SSL://127.0.0.1:29393")
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert "SASL_SSL:SASL_SSL" in props["listener.security.protocol.map"]
    for listener in ("sasl_plaintext", "sasl_ssl"):
        assert props[f"listener.name.{listener}.sasl.enabled.mechanisms"] == "PLAIN,SCRAM-SHA-512"
        assert 'user_alice="pw-alice"' in props[f"listener.name.{listener}.plain.sasl.jaas.config"]
        assert "ScramLoginModule" in props[f"listener.name.{listener}.scram-sha-512.sasl.jaas.config"]
    assert props["ssl.keystore.location"] == "/tmp/k/tls/broker.p12" and props["ssl.keystore.type"] == "PKCS12"
    assert "pw-alice" not in repr(cfg)


def _hi(password: bytes, salt: bytes, iterations: int) -> bytes:
    """RFC 5802 Hi(), written out: U1 = HMAC(p, salt + INT(1)), Ui = HMAC(p, Ui-1), Hi = U1 ^ ... ^ Ui."""
    u = hmac.new(password, salt + b"\x00\x00\x00\x01", hashlib.sha512).digest()
    out = bytearray(u)
    for _ in range(iterations - 1):
        u = hmac.new(password, u, hashlib.sha512).digest()
        out = bytearray(a ^ b for a, b in zip(out, u))
    return bytes(out)


def test_scram_credential_is_the_rfc5802_salted_password_not_the_clear_one():
    salt = b"0123456789abcdef"
    arg = scram_credential("alice", "pw-alice", salt=salt)
    m = re.fullmatch(r'SCRAM-SHA-512=\[name=alice,iterations=(\d+),salt="([^"]+)",saltedpassword="([^"]+)"\]', arg)
    assert m, arg
    iterations, got_salt, salted = int(m[1]), base64.b64decode(m[2]), base64.b64decode(m[3])
    assert got_salt == salt and iterations >= 4096
    assert salted == _hi(b"pw-alice", salt, iterations)
    assert "pw-alice" not in arg


def test_infra_secure_needs_a_user_and_uses_the_settings_ports(tmp_path):
    with pytest.raises(SettingsError, match="KVPIPE_KAFKA_SASL_USERNAME"):
        broker_config(load_settings(env={"KVPIPE_KAFKA_LOCAL_SECURE": "true", "KVPIPE_STATE_DIR": str(tmp_path)}))
    cfg = broker_config(load_settings(env={"KVPIPE_KAFKA_LOCAL_SECURE": "true", "KVPIPE_STATE_DIR": str(tmp_path),
                                           "KVPIPE_KAFKA_SASL_USERNAME": "dev", "KVPIPE_KAFKA_SASL_PASSWORD": "x"}))
    assert (cfg.sasl_port, cfg.sasl_ssl_port, cfg.users) == (19094, 19095, (("dev", "x"),))
    assert not broker_config(load_settings(env={"KVPIPE_STATE_DIR": str(tmp_path)})).secure
