"""Settings resolve defaults <- the settings file (KVPIPE_CONFIG) <- KVPIPE_* environment <- explicit overrides."""
import pytest

from kvpipe.schemas.settings import SettingsError, load_settings


def test_defaults_work_locally_without_any_configuration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = load_settings(env={})
    assert s.bootstrap() == "127.0.0.1:19092" and s.is_local_kafka()
    assert s.clickhouse() == f"chdb://{tmp_path / '.kvpipe' / 'analytics'}" and s.is_embedded_clickhouse()


def test_file_then_environment_then_overrides_win_in_that_order(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text('partitions = 8\nweb_port = 7000\nevents_topic = "from-file"\n')
    s = load_settings(env={"KVPIPE_CONFIG": str(cfg), "KVPIPE_WEB_PORT": "7100"}, overrides={"events_topic": "cli"})
    assert (s.partitions, s.web_port, s.events_topic) == (8, 7100, "cli")


def test_external_cluster_and_server_clickhouse_switch_by_environment():
    s = load_settings(env={"KVPIPE_KAFKA_BOOTSTRAP": "kafka:9092", "KVPIPE_CLICKHOUSE_DSN": "http://ch:8123"})
    assert s.bootstrap() == "kafka:9092" and not s.is_local_kafka()
    assert s.clickhouse() == "http://ch:8123" and not s.is_embedded_clickhouse()


def test_wrong_types_and_unknown_keys_fail_with_the_field_name(tmp_path):
    with pytest.raises(SettingsError, match="web_port"):
        load_settings(env={"KVPIPE_WEB_PORT": "not-a-port"})
    cfg = tmp_path / "k.toml"
    cfg.write_text("partitons = 3\n")
    with pytest.raises(SettingsError, match="partitons"):
        load_settings(env={"KVPIPE_CONFIG": str(cfg)})
