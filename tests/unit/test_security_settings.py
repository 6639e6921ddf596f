"""Security settings: validation at load, one translation per client library, secrets masked."""
from __future__ import annotations

import logging
import ssl

import pytest

from kvpipe.schemas.settings import SettingsError, exposure_problem, is_loopback, load_settings

SASL_SSL = {"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "KVPIPE_KAFKA_SASL_USERNAME": "svc", "KVPIPE_KAFKA_SASL_PASSWORD": "s3cret-pw",
            "KVPIPE_KAFKA_BOOTSTRAP": "kafka:9093"}


def test_plaintext_default_translates_to_plaintext_everywhere():
    s = load_settings(env={})
    assert s.kafka_confluent_config() == {"bootstrap.servers": "127.0.0.1:19092", "security.protocol": "PLAINTEXT"}
    assert s.kafka_aiokafka_kwargs() == {"security_protocol": "PLAINTEXT"}
    assert s.api_token_value() == ""


def test_scram_over_tls_becomes_librdkafka_properties_and_aiokafka_kwargs():
    s = load_settings(env={**SASL_SSL, "KVPIPE_KAFKA_SSL_CHECK_HOSTNAME": "false"})
    conf = s.kafka_confluent_config()
    assert conf == {"bootstrap.servers": "kafka:9093", "security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                    "sasl.username": "svc", "sasl.password": "s3cret-pw", "ssl.endpoint.identification.algorithm": "none"}
    kw = s.kafka_aiokafka_kwargs()
    assert (kw["security_protocol"], kw["sasl_mechanism"], kw["sasl_plain_username"], kw["sasl_plain_password"]) == \
        ("SASL_SSL", "SCRAM-SHA-512", "svc", "s3cret-pw")
    assert isinstance(kw["ssl_context"], ssl.SSLContext) and kw["ssl_context"].check_hostname is False


def test_sasl_mechanism_defaults_to_plain_and_password_file_is_read(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("from-file\n")
    s = load_settings(env={"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT", "KVPIPE_KAFKA_SASL_USERNAME": "u",
                           "KVPIPE_KAFKA_SASL_PASSWORD_FILE": str(pw)})
    conf = s.kafka_confluent_config()
    assert conf["sasl.mechanism"] == "PLAIN" and conf["sasl.password"] == "from-file" and "ssl.ca.location" not in conf


def test_oauthbearer_uses_librdkafkas_oidc_client_credentials():
    s = load_settings(env={"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_MECHANISM": "OAUTHBEARER",
                           "KVPIPE_KAFKA_OAUTH_TOKEN_URL": "https://idp/token", "KVPIPE_KAFKA_OAUTH_CLIENT_ID": "kv",
                           "KVPIPE_KAFKA_OAUTH_CLIENT_SECRET": "oidc-secret", "KVPIPE_KAFKA_OAUTH_SCOPE": "kafka"})
    conf = s.kafka_confluent_config()
    assert conf["sasl.oauthbearer.method"] == "oidc" and conf["sasl.oauthbearer.token.endpoint.url"] == "https://idp/token"
    assert conf["sasl.oauthbearer.client.id"] == "kv" and conf["sasl.oauthbearer.scope"] == "kafka"
    assert "sasl.username" not in conf
    assert "oidc-secret" not in repr(s)


@pytest.mark.parametrize("env, says", [
    ({"KVPIPE_KAFKA_SECURITY_PROTOCOL": "TLS"}, "expected one of PLAINTEXT"),
    ({"KVPIPE_KAFKA_SASL_MECHANISM": "PLAIN"}, "needs kafka_security_protocol SASL_PLAINTEXT or SASL_SSL"),
    ({"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_MECHANISM": "GSSAPI"}, "kafka_sasl_mechanism='GSSAPI'"),
    ({"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_USERNAME": "u"}, "needs kafka_sasl_password"),
    ({"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_PASSWORD": "p"}, "needs kafka_sasl_username"),
    ({"KVPIPE_KAFKA_SASL_PASSWORD": "p", "KVPIPE_KAFKA_SASL_PASSWORD_FILE": "/etc/hostname"}, "both set"),
    ({"KVPIPE_API_TOKEN": "t", "KVPIPE_API_TOKEN_FILE": "/etc/hostname"}, "api_token and api_token_file"),
    ({"KVPIPE_KAFKA_SSL_CAFILE": "/etc/hostname"}, "has no TLS"),
    ({"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SSL", "KVPIPE_KAFKA_SSL_CAFILE": "/nonexistent/ca.pem"}, "not a readable file"),
    ({"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_MECHANISM": "OAUTHBEARER",
      "KVPIPE_KAFKA_OAUTH_CLIENT_ID": "x"}, "needs kafka_oauth_token_url, kafka_oauth_client_secret"),
])
def test_contradictions_fail_at_load_with_the_fields_named(env, says):
    with pytest.raises(SettingsError) as info:
        load_settings(env=env)
    assert says in str(info.value)


def test_errors_never_carry_a_secret():
    with pytest.raises(SettingsError) as info:
        load_settings(env={"KVPIPE_KAFKA_SASL_PASSWORD": "leak-me", "KVPIPE_KAFKA_SASL_MECHANISM": "PLAIN"})
    assert "leak-me" not in str(info.value)


def test_repr_rich_repr_and_logging_mask_every_secret(caplog):
    s = load_settings(env={**SASL_SSL, "KVPIPE_API_TOKEN": "api-tok-123", "KVPIPE_KAFKA_SSL_KEY_PASSWORD": "keypw"})
    from rich.pretty import pretty_repr

    caplog.set_level(logging.INFO)
    logging.getLogger("t").info("settings: %s / %r", s, s)
    for text in (repr(s), str(s), pretty_repr(s), caplog.text):
        assert "s3cret-pw" not in text and "api-tok-123" not in text and "keypw" not in text
        assert "svc" in text  # what is not secret is still shown
        assert "***" in text
    assert s.kafka_password() == "s3cret-pw" and s.api_token_value() == "api-tok-123"  # the values themselves stay


def test_api_token_file_strips_the_trailing_newline(tmp_path):
    f = tmp_path / "token"
    f.write_text("abc\n")
    assert load_settings(env={"KVPIPE_API_TOKEN_FILE": str(f)}).api_token_value() == "abc"


def test_local_secured_broker_is_reached_on_the_listener_of_the_protocol(tmp_path):
    base = {"KVPIPE_KAFKA_SASL_USERNAME": "u", "KVPIPE_KAFKA_SASL_PASSWORD": "p", "KVPIPE_STATE_DIR": str(tmp_path)}
    sasl = load_settings(env={**base, "KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    assert sasl.bootstrap() == "127.0.0.1:19094"
    (tmp_path / "kafka" / "tls").mkdir(parents=True)
    (tmp_path / "kafka" / "tls" / "ca.pem").write_text("")
    tls = load_settings(env={**base, "KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})
    assert tls.bootstrap() == "127.0.0.1:19095"
    assert tls.kafka_confluent_config()["ssl.ca.location"] == str(tmp_path / "kafka" / "tls" / "ca.pem")


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True), ("127.0.0.5", True),
                                            ("0.0.0.0", False), ("10.1.2.3", False), ("router.internal", False)])
def test_only_loopback_may_be_bound_without_a_token(host, loopback):
    assert is_loopback(host) is loopback
    problem = exposure_problem(host, has_token=False, insecure=False)
    assert (problem is None) is loopback
    if problem:
        assert "KVPIPE_API_TOKEN" in problem and "--insecure" in problem
    assert exposure_problem(host, has_token=True, insecure=False) is None
    assert exposure_problem(host, has_token=False, insecure=True) is None
