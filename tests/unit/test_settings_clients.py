"""Settings that reach the clients: the ClickHouse password file and TLS options (to clickhouse-connect, at
connect time), and the Kafka client-properties pass-through (to librdkafka as given, to aiokafka and Faust
where a mapping exists, refused where none does or where a setting owns the property)."""
from __future__ import annotations

import faust
import pytest

from kvpipe.processors.core.kafkaconf import aiokafka_kwargs, faust_broker_kwargs
from kvpipe.schemas.configlayers import parse_properties
from kvpipe.schemas.settings import SettingsError, load_settings

HTTPS = "https://analyst@ch.example:8443/kv"


# -- ClickHouse ----------------------------------------------------------------------------------------------------

def test_the_password_file_and_tls_options_go_to_the_client_only(tmp_path):
    (tmp_path / "pw").write_text("from-the-file\n")
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    s = load_settings(env={"KVPIPE_CLICKHOUSE_DSN": HTTPS, "KVPIPE_CLICKHOUSE_PASSWORD_FILE": str(tmp_path / "pw"),
                           "KVPIPE_CLICKHOUSE_CA_CERT": str(tmp_path / "ca.pem"), "KVPIPE_CLICKHOUSE_VERIFY": "false"})
    assert s.clickhouse_client_kwargs() == {"password": "from-the-file", "verify": False,
                                            "ca_cert": str(tmp_path / "ca.pem")}
    assert "from-the-file" not in repr(s)
    plain = load_settings(env={"KVPIPE_CLICKHOUSE_DSN": "http://u@ch:8123",
                               "KVPIPE_CLICKHOUSE_PASSWORD_FILE": str(tmp_path / "pw")})
    assert plain.clickhouse_client_kwargs() == {"password": "from-the-file"}  # no TLS options without TLS
    assert load_settings(env={}).clickhouse_client_kwargs() == {}  # chDB: neither


@pytest.mark.parametrize("env, says", [
    ({"KVPIPE_CLICKHOUSE_PASSWORD_FILE": "/etc/hostname"}, "the embedded store has no password"),
    ({"KVPIPE_CLICKHOUSE_DSN": "http://u:inline@ch:8123", "KVPIPE_CLICKHOUSE_PASSWORD_FILE": "/etc/hostname"},
     "clickhouse_dsn carries a password and clickhouse_password_file is set"),
    ({"KVPIPE_CLICKHOUSE_DSN": "http://u@ch:8123", "KVPIPE_CLICKHOUSE_VERIFY": "false"},
     "clickhouse_verify set but clickhouse_dsn is http://"),
    ({"KVPIPE_CLICKHOUSE_DSN": HTTPS, "KVPIPE_CLICKHOUSE_PASSWORD_FILE": "/nonexistent/pw"}, "not a readable file"),
])
def test_clickhouse_contradictions_fail_at_load(env, says):
    with pytest.raises(SettingsError) as info:
        load_settings(env=env)
    assert says in str(info.value) and "inline" not in str(info.value)


def _open_sql_target(dsn: str) -> None:
    from kvpipe.processors.analytics import cli

    cli._sql_target(dsn, None)


def _open_sink(dsn: str) -> None:
    from kvpipe.processors.analytics.sink import AnalyticsSink

    AnalyticsSink(dsn).start()


def _open_read_client(dsn: str) -> None:
    from kvpipe.processors.analytics.reads import ReadClients

    with ReadClients(dsn).client():
        pass


@pytest.mark.parametrize("open_client", [_open_sql_target, _open_sink, _open_read_client])
def test_every_store_client_connects_with_them(open_client, tmp_path, monkeypatch):
    """The three places that open a client on a server DSN (`kvpipe sql`, the sink's writer, its read pool):
    what reaches clickhouse_connect.get_client."""
    import clickhouse_connect

    (tmp_path / "pw").write_text("pw-from-file")
    monkeypatch.setenv("KVPIPE_CLICKHOUSE_DSN", HTTPS)
    monkeypatch.setenv("KVPIPE_CLICKHOUSE_PASSWORD_FILE", str(tmp_path / "pw"))
    seen = {}

    class Stop(Exception):
        pass

    def get_client(**kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(clickhouse_connect, "get_client", get_client)
    with pytest.raises(Stop):
        open_client(HTTPS)
    assert seen == {"dsn": HTTPS, "password": "pw-from-file", "verify": True}


# -- Kafka client properties ---------------------------------------------------------------------------------------

def test_a_java_properties_file_reads_as_kafka_writes_it():
    text = ("# comment\n! also a comment\n\nclient.id = edge-7\nmetadata.max.age.ms:60000\n"
            "socket.keepalive.enable true\nsasl.jaas.config=org.Module required \\\n    username=\"u\";\n"
            "empty=\n")
    assert parse_properties(text) == {"client.id": "edge-7", "metadata.max.age.ms": "60000",
                                      "socket.keepalive.enable": "true",
                                      "sasl.jaas.config": "org.Module required username=\"u\";", "empty": ""}


def test_properties_reach_librdkafka_with_the_table_over_the_file(tmp_path):
    (tmp_path / "c.properties").write_text("client.id=from-file\nsocket.keepalive.enable=true\n")
    s = load_settings(env={"KVPIPE_KAFKA_PROPERTIES_FILE": str(tmp_path / "c.properties"),
                           "KVPIPE_KAFKA_PROPERTIES": '{"client.id": "from-table"}'})
    conf = s.kafka_confluent_config()
    assert (conf["client.id"], conf["socket.keepalive.enable"]) == ("from-table", "true")
    assert conf["security.protocol"] == "PLAINTEXT" and conf["bootstrap.servers"] == "127.0.0.1:19092"
    from confluent_kafka.admin import AdminClient

    AdminClient(conf)  # librdkafka takes them: an unknown property would raise here


def test_a_property_a_setting_owns_is_refused_with_the_setting_named():
    with pytest.raises(SettingsError) as info:
        load_settings(env={"KVPIPE_KAFKA_PROPERTIES": '{"security.protocol": "SSL", "linger.ms": 50}'})
    message = str(info.value)
    assert "security.protocol (set it with kafka_security_protocol)" in message
    assert "linger.ms (set it with linger_ms)" in message


def test_aiokafka_and_faust_get_the_properties_they_have_and_refuse_the_rest():
    s = load_settings(env={"KVPIPE_KAFKA_PROPERTIES": '{"client.id": "edge-7", "metadata.max.age.ms": "60000"}'})
    kwargs = aiokafka_kwargs(s)
    assert (kwargs["client_id"], kwargs["metadata_max_age_ms"]) == ("edge-7", 60000)
    app = faust.App("kvpipe-test-props", broker="kafka://127.0.0.1:1", **faust_broker_kwargs(s))
    assert app.conf.broker_client_id == "edge-7"
    assert app.conf.consumer_metadata_max_age_ms == app.conf.producer_metadata_max_age_ms == 60000
    odd = load_settings(env={"KVPIPE_KAFKA_PROPERTIES": '{"socket.keepalive.enable": true, "client.rack": "r1"}'})
    for build in (aiokafka_kwargs, faust_broker_kwargs):
        with pytest.raises(SettingsError, match="client.rack, socket.keepalive.enable: no aiokafka equivalent"):
            build(odd)


def test_secret_properties_are_masked_in_the_settings_repr():
    s = load_settings(env={"KVPIPE_KAFKA_PROPERTIES": '{"ssl.keystore.password": "ks-secret", "client.rack": "r1"}'})
    assert "ks-secret" not in repr(s) and "'client.rack': 'r1'" in repr(s)


def test_both_apps_refuse_such_properties_at_start_in_one_line(monkeypatch, capsys):
    from kvpipe.processors.core.appcli import worker_settings

    monkeypatch.setenv("KVPIPE_KAFKA_PROPERTIES", '{"socket.keepalive.enable": true}')
    for prog in ("kvpipe processor", "kvpipe analytics"):
        assert worker_settings(prog, {}, insecure=False) is None  # the CLI exits 2, before importing the app
        err = capsys.readouterr().err
        assert err.startswith(f"{prog}: kafka_properties: socket.keepalive.enable: no aiokafka equivalent")
        assert "Traceback" not in err and err.count("\n") == 1
