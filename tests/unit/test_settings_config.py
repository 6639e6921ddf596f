"""`--config FILE` on every command and `kvpipe config show`: the file is checked when named and reaches
the settings loaded later; a file in the working directory is not read on its own; show prints each
effective value with where it came from and never a secret."""
from __future__ import annotations

import json
import logging
import os

import click
import pytest

from kvpipe.cli import COMMANDS, kvpipe, main
from kvpipe.schemas import cliopts, configlayers
from kvpipe.schemas.settings import SettingsError, load_settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No KVPIPE_ variable from the caller; KVPIPE_CONFIG restored after a test whose --config set it."""
    for name in [k for k in os.environ if k.startswith("KVPIPE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("KVPIPE_CONFIG", "")
    monkeypatch.delenv("KVPIPE_CONFIG")
    monkeypatch.setattr(configlayers, "_warned", set())
    monkeypatch.chdir(tmp_path)


def _leaves(command: click.Command, path: tuple[str, ...]):
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None:
                yield from _leaves(sub, path + (name,))
    else:
        yield path, command


def test_every_kvpipe_command_takes_config():
    ctx = click.Context(kvpipe)
    missing = [" ".join(path) for name in COMMANDS for path, command in _leaves(kvpipe.get_command(ctx, name), (name,))
               if not any("--config" in p.opts for p in command.params)]
    assert not missing, missing


def test_a_broken_file_is_a_usage_error_naming_it_and_the_line(tmp_path, capsys):
    (tmp_path / "bad.toml").write_text("web_port = \n")
    assert main(["config", "show", "--config", "bad.toml"]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and "bad.toml is not valid TOML" in err and "line 1" in err


def test_a_missing_file_is_a_usage_error_before_anything_runs(capsys):
    assert main(["config", "show", "--config", "nope.toml"]) == 2
    assert "nope.toml: no such file" in capsys.readouterr().err
    assert "KVPIPE_CONFIG" not in os.environ  # nothing exported


def test_unknown_keys_are_refused_all_at_once_with_the_nearest_names(tmp_path):
    (tmp_path / "k.toml").write_text('web_prot = 7000\npartitons = 3\nevents_topic = "x"\nzzz = 1\n')
    with pytest.raises(SettingsError) as info:
        load_settings(env={"KVPIPE_CONFIG": str(tmp_path / "k.toml")})
    message = str(info.value)
    assert "web_prot (did you mean web_port?)" in message and "partitons (did you mean partitions?)" in message
    assert "zzz" in message and "events_topic" not in message


def test_config_is_exported_absolute_and_show_says_where_each_value_came_from(tmp_path, monkeypatch, capsys):
    (tmp_path / "k.toml").write_text('partitions = 8\nweb_port = 7000\nevents_topic = "from-file"\n')
    monkeypatch.setenv("KVPIPE_WEB_PORT", "7100")
    assert main(["config", "show", "--config", "k.toml", "--set", "events_topic=flagged", "-o", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    path = str(tmp_path / "k.toml")
    assert shown["file"] == path
    got = {name: (s["value"], s["source"]) for name, s in shown["settings"].items()}
    assert got["partitions"] == (8, f"file {path}")
    assert got["web_port"] == (7100, "env KVPIPE_WEB_PORT")
    assert got["events_topic"] == ("flagged", "flag")
    assert got["snapshot_topic"] == ("kv-index-snapshots", "default")
    assert shown["settings"]["web_port"]["env"] == "KVPIPE_WEB_PORT"
    # settings loaded later in this process read the same file
    assert os.environ["KVPIPE_CONFIG"] == path and load_settings().partitions == 8


def test_show_masks_every_secret_and_never_reads_a_secret_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "ch_password").write_text("ch-file-secret\n")
    (tmp_path / "client.properties").write_text("sasl.jaas.config=password=\"props-secret\"\nclient.id=edge\n")
    monkeypatch.setenv("KVPIPE_API_TOKEN", "api-secret")
    monkeypatch.setenv("KVPIPE_KAFKA_OAUTH_CLIENT_SECRET", "oauth-secret")
    monkeypatch.setenv("KVPIPE_CLICKHOUSE_DSN", "https://analyst:dsn-secret@ch:8443/kv?access_token=tok-secret")
    monkeypatch.setenv("KVPIPE_KAFKA_PROPERTIES", '{"ssl.keystore.password": "table-secret", "client.rack": "r1"}')
    monkeypatch.setenv("KVPIPE_KAFKA_PROPERTIES_FILE", str(tmp_path / "client.properties"))
    for output in ("table", "json"):
        assert main(["config", "show", "-o", output]) == 0
        out = capsys.readouterr().out
        for secret in ("api-secret", "oauth-secret", "dsn-secret", "tok-secret", "table-secret", "props-secret",
                       "ch-file-secret"):
            assert secret not in out, (output, secret)
        assert "r1" in out and "https://analyst:***@ch:8443/kv" in out and str(tmp_path / "client.properties") in out


def test_a_settings_file_in_the_working_directory_is_not_read_and_says_so(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvpipe.settings")
    (tmp_path / "kvpipe.toml").write_text("partitions = 8\n")
    assert load_settings(env={}).partitions == 4
    load_settings(env={})
    said = [r.getMessage() for r in caplog.records if r.name == "kvpipe.settings"]
    assert said == ["./kvpipe.toml is not read: a settings file is read only when named (--config kvpipe.toml, "
                    "or KVPIPE_CONFIG=kvpipe.toml)"]
    assert load_settings(env={"KVPIPE_CONFIG": "kvpipe.toml"}).partitions == 8


def test_a_wrong_value_names_where_it_came_from(tmp_path):
    with pytest.raises(SettingsError, match=r"web_port.*\(env KVPIPE_WEB_PORT\)"):
        load_settings(env={"KVPIPE_WEB_PORT": "not-a-port"})
    (tmp_path / "k.toml").write_text('web_port = "x"\n')
    with pytest.raises(SettingsError, match=rf"web_port.*\(file {tmp_path / 'k.toml'}\)"):
        load_settings(env={"KVPIPE_CONFIG": str(tmp_path / "k.toml")})


def test_the_log_level_is_a_setting_the_file_can_hold(tmp_path, monkeypatch):
    (tmp_path / "k.toml").write_text('log_level = "error"\n')
    monkeypatch.setenv("KVPIPE_CONFIG", str(tmp_path / "k.toml"))
    assert cliopts.log_level(None, "warning") == "error"
    assert cliopts.log_level("debug", "warning") == "debug"  # the flag wins
    (tmp_path / "k.toml").write_text('log_level = "loud"\n')
    with pytest.raises(SystemExit, match=rf"log_level='loud' \(file {tmp_path / 'k.toml'}\)"):
        cliopts.log_level(None, "warning")
    with pytest.raises(SettingsError, match="log_level='loud'"):
        load_settings()
