"""The settings' documents are generated from the Settings type: every setting carries a description, and
the checked-in docs/settings.md and infra/kvpipe.schema.json are what `kvpipe config reference` and
`kvpipe config schema` print now (regenerate with those commands when this fails)."""
from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvpipe.configcmd import json_schema, reference_markdown
from kvpipe.schemas.configlayers import env_name
from kvpipe.schemas.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_says_what_it_does():
    props = json_schema()["properties"]
    assert list(props) == list(Settings.__struct_fields__)
    undocumented = [name for name, prop in props.items() if len(prop.get("description", "").strip()) < 10]
    assert not undocumented, f"settings without a description (Doc(...) in schemas/settings.py): {undocumented}"


def test_the_checked_in_reference_is_the_generated_one():
    text = (ROOT / "docs" / "settings.md").read_text()
    assert text == reference_markdown(), "docs/settings.md is stale: kvpipe config reference > docs/settings.md"


def test_the_reference_lists_each_setting_with_its_variable_and_default():
    rows = {line.split(" | ")[0].strip("| `"): line for line in reference_markdown().splitlines()
            if line.startswith("| `")}
    for name, default in (("web_port", "`6066`"), ("clickhouse_verify", "`true`"), ("kafka_properties", "`{}`")):
        assert f"`{env_name(name)}`" in rows[name] and default in rows[name], rows[name]


def test_the_checked_in_schema_is_the_generated_one():
    text = (ROOT / "infra" / "kvpipe.schema.json").read_text()
    assert json.loads(text) == json_schema(), "infra/kvpipe.schema.json is stale: kvpipe config schema > it"


def test_the_schema_refuses_unknown_keys_and_types_each_setting():
    schema = json_schema()
    assert schema["additionalProperties"] is False and schema["required"] == []
    props = schema["properties"]
    assert props["web_port"]["type"] == "integer" and props["web_port"]["default"] == 6066
    assert props["processor_delivery"]["enum"] == ["batch", "message"]
    assert props["kafka_properties"]["type"] == "object"
    # every default in the schema is the one a Settings() has
    defaults = msgspec.to_builtins(Settings())
    assert {name: prop["default"] for name, prop in props.items()} == defaults


def test_an_editor_checking_a_settings_file_against_the_schema_finds_what_kvpipe_refuses():
    import tomllib

    import jsonschema

    validator = jsonschema.Draft202012Validator(json.loads((ROOT / "infra" / "kvpipe.schema.json").read_text()))
    good = tomllib.loads('web_port = 7000\nprocessor_delivery = "message"\n[kafka_properties]\n"client.id" = "a"\n')
    assert not list(validator.iter_errors(good))
    bad = tomllib.loads('web_prot = 7000\nweb_port = "x"\nprocessor_delivery = "bulk"\n')
    messages = " ".join(e.message for e in validator.iter_errors(bad))
    assert "web_prot" in messages and "'x' is not of type 'integer'" in messages and "'bulk'" in messages
