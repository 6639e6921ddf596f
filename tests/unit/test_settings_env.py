"""KVPIPE_* environment names: each setting's variable is read, an unknown name is warned about once (with
the nearest setting's name), kvpipe's own non-setting variables are not, and the code names no
variable that is neither a setting nor listed in kvpipe.schemas.configlayers.OTHER_ENV."""
from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest

from kvpipe.schemas import configlayers
from kvpipe.schemas.configlayers import OTHER_ENV, env_name
from kvpipe.schemas.settings import RENAMED, Settings, load_settings

ROOT = Path(__file__).resolve().parents[2]
# KVPIPE_ words in the code that are no variable: placeholders in help and tests, wrk's output marker, and the
# unknown names these tests set on purpose
NOT_VARIABLES = {"KVPIPE_X", "KVPIPE_NAME", "KVPIPE_WRK", "KVPIPE_WEB_PROT", "KVPIPE_SOMETHING"}


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(configlayers, "_warned", set())


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvpipe.settings"]


def test_a_misspelt_variable_is_warned_about_once_with_the_setting_it_resembles(caplog):
    caplog.set_level(logging.WARNING, logger="kvpipe.settings")
    env = {"KVPIPE_WEB_PROT": "7000", "KVPIPE_PARTITIONS": "8"}
    assert load_settings(env=env).web_port == 6066  # the typo changes nothing...
    load_settings(env=env)
    assert _warnings(caplog) == ["KVPIPE_WEB_PROT is not a kvpipe setting; ignored (did you mean KVPIPE_WEB_PORT?)"]


def test_kvpipes_own_variables_and_renamed_settings_are_not_unknown(caplog):
    caplog.set_level(logging.WARNING, logger="kvpipe.settings")
    env = {name: "1" for name in OTHER_ENV if name != "KVPIPE_CONFIG"}
    load_settings(env={**env, "KVPIPE_LOG_LEVEL": "info", "OTHER_TOOL_X": "1"})
    assert _warnings(caplog) == []
    assert configlayers.unknown_env({"KVPIPE_SOMETHING": "1", "KVPIPE_NATIVE": "0"}, Settings.__struct_fields__) == \
        ["KVPIPE_SOMETHING"]


def test_every_setting_is_read_from_its_variable():
    assert load_settings(env={"KVPIPE_LOG_LEVEL": "debug"}).log_level == "debug"
    assert load_settings(env={"KVPIPE_KAFKA_PROPERTIES": '{"client.id": "edge-7"}'}).kafka_properties == \
        {"client.id": "edge-7"}


def test_an_object_setting_in_the_environment_must_be_json():
    from kvpipe.schemas.settings import SettingsError

    with pytest.raises(SettingsError, match="KVPIPE_KAFKA_PROPERTIES: expected a JSON object"):
        load_settings(env={"KVPIPE_KAFKA_PROPERTIES": "client.id=x"})


def test_the_code_names_no_kvpipe_variable_outside_the_settings_and_the_list():
    known = {env_name(f) for f in Settings.__struct_fields__} | set(OTHER_ENV) | {env_name(o) for o in RENAMED}
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    strays: dict[str, str] = {}
    for name in files:
        path = ROOT / name
        if not (path.suffix in (".py", ".sh", ".yaml", ".yml", ".toml") or path.name == "Makefile") \
                or not path.is_file():
            continue
        for word in re.findall(r"KVPIPE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")):
            # a prefix is a test on many names (`k.startswith("KVPIPE_KAFKA_SASL")`), not a variable
            if word not in known | NOT_VARIABLES and not any(k.startswith(word + "_") for k in known):
                strays.setdefault(word, name)
    assert not strays, f"KVPIPE_ variables that are neither a setting nor in configlayers.OTHER_ENV: {strays}"
