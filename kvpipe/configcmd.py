"""`kvpipe config`: the settings as a process would see them, and their documents.

- `kvpipe config show`: every setting's effective value and where it came from (default, the settings
  file, a `KVPIPE_*` variable, a flag), secrets masked (kvpipe.schemas.redact); `*_file` settings show
  their path, never their content.
- `kvpipe config schema`: the JSON Schema of the settings file, for editors and CI checks
  (infra/kvpipe.schema.json is a copy of it).
- `kvpipe config reference`: the Markdown reference, docs/settings.md.

Both documents are generated from the `Settings` type and its field descriptions, so they cannot drift
from the code: tests/unit/test_settings_reference.py holds the checked-in copies equal to the output.
"""
from __future__ import annotations

import json
import sys
from typing import Any

import click
import msgspec

from kvpipe.schemas.cliopts import Group, output_option
from kvpipe.schemas.configlayers import OTHER_ENV, SettingsError, env_name
from kvpipe.schemas.redact import masked
from kvpipe.schemas.settings import RENAMED, Settings, settings_layers, typed_settings

SCHEMA_DRAFT = "https://json-schema.org/draft/2020-12/schema"


@click.group("config", cls=Group, help="Show the effective settings, the settings file's JSON Schema, the "
             "settings reference.")
def config() -> None:
    pass


def _set_option(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    overrides = {}
    for item in values:
        name, sep, value = item.partition("=")
        if not sep or name not in Settings.__struct_fields__:
            raise click.BadParameter(f"{item!r}: expected NAME=VALUE with NAME a setting (docs/settings.md)",
                                     ctx, param)
        overrides[name] = value
    return overrides


@config.command("show", short_help="every setting's effective value and where it came from",
                help="Every setting's effective value and where it came from: default, the settings "
                "file (--config, KVPIPE_CONFIG), a KVPIPE_* variable, or a flag (--set). Secrets are masked; "
                "*_file settings show their path, never their content.")
@click.option("--set", "overrides", multiple=True, metavar="NAME=VALUE", callback=_set_option,
              help="override a setting as a command's flag would (repeatable)")
@output_option(help="table for people, json for programs")
def show(overrides: dict[str, str], output: str) -> int:
    try:
        layers = settings_layers(overrides)
        settings = typed_settings(layers)
    except SettingsError as exc:
        print(f"kvpipe config show: {exc}", file=sys.stderr)
        return 2
    rows = [(name, masked(name, getattr(settings, name)), layers.source(name))
            for name in Settings.__struct_fields__]
    if output == "json":
        print(json.dumps({"file": layers.file or None,
                          "settings": {name: {"value": value, "source": source, "env": env_name(name)}
                                       for name, value, source in rows}}, indent=2))
        return 0
    from kvpipe.processors.core.texttable import render

    print(f"settings file: {layers.file or '(none)'}")
    print(render(["setting", "value", "source"], [(n, _text(v), s) for n, v, s in rows], right=()))
    return 0


def _text(value: object) -> str:
    """A value as a person reads it in a table: TOML's true/false, tables as JSON."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True)
    return str(value)


@config.command("schema", short_help="the JSON Schema of the settings file",
                help="Print the JSON Schema of the settings file (infra/kvpipe.schema.json).")
def schema() -> int:
    print(json.dumps(json_schema(), indent=2))
    return 0


@config.command("reference", short_help="the settings reference in Markdown",
                help="Print the settings reference in Markdown (docs/settings.md).")
def reference() -> int:
    print(reference_markdown(), end="")
    return 0


def json_schema() -> dict[str, Any]:
    """The settings file's schema: msgspec's for `Settings`, with the struct as the root object."""
    generated = msgspec.json.schema(Settings)
    defs = generated["$defs"]
    root = defs.pop("Settings")
    root.pop("title", None)
    out: dict[str, Any] = {
        "$schema": SCHEMA_DRAFT, "title": "kvpipe settings file",
        **root,
        "description": "kvpipe's settings (TOML), read when named: `--config FILE` or KVPIPE_CONFIG. Generated "
                       "by `kvpipe config schema`; the reference is docs/settings.md.",
    }
    if defs:  # a nested struct some day: its $ref stays valid at the root
        out["$defs"] = defs
    return out


def _type(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " or ".join(f"`{v}`" for v in prop["enum"])
    return {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean",
            "object": "table"}.get(prop.get("type", ""), "value")


def _default(value: Any) -> str:
    return f"`{json.dumps(value)}`" if isinstance(value, (str, bool, dict)) else f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    from kvpipe.processors.core.kafkaconf import AIOKAFKA_PROPERTIES

    props = json_schema()["properties"]
    lines = [
        "# Settings reference",
        "",
        "<!-- Generated from schemas/settings.py: `kvpipe config reference > docs/settings.md`. Edit the "
        "descriptions there; tests/unit/test_settings_reference.py fails when this file differs. -->",
        "",
        "Every setting is a field of `Settings` (schemas/settings.py). Later sources win: the default below, the "
        "settings file (TOML, the keys are the names below; read only when named, with `--config FILE` on any "
        "command or `KVPIPE_CONFIG=FILE`), the environment variable, a command's own flag. "
        "`kvpipe config show` prints each effective value and where it came from, secrets masked; "
        "`kvpipe config schema` prints the file's JSON Schema (a copy: infra/kvpipe.schema.json). An unknown key "
        "in the file is refused; an unknown `KVPIPE_*` variable is warned about, once.",
        "",
        "| setting | environment | type | default | what it does |",
        "|---|---|---|---|---|",
    ]
    for name, prop in props.items():
        lines.append(f"| `{name}` | `{env_name(name)}` | {_type(prop)} | {_default(prop.get('default'))} | "
                     f"{_cell(prop.get('description', ''))} |")
    lines += [
        "",
        "## Kafka client properties",
        "",
        "`kafka_properties` (a TOML table, or a JSON object in `KVPIPE_KAFKA_PROPERTIES`) and "
        "`kafka_properties_file` (a Java `.properties` file, as Kafka's `--command-config` takes; the table wins "
        "where both set a key) pass more client properties, by Kafka's names. Every librdkafka client (producers, "
        "the bridge, `kvpipe infra`) gets them as given; a client's own keys, such as a producer's `acks`, go on "
        "top. A property a setting owns (`security.protocol`, `sasl.*`, `ssl.*.location`, `bootstrap.servers`, "
        "`linger.ms`, `compression.type`, `message.max.bytes`) is refused at load. The Faust apps' client, "
        "aiokafka, takes only these, and refuses to start with any other:",
        "",
        "| property | aiokafka | Faust |",
        "|---|---|---|",
    ]
    for key, (keyword, faust_names) in AIOKAFKA_PROPERTIES.items():
        lines.append(f"| `{key}` | `{keyword}` | {', '.join(f'`{n}`' for n in faust_names)} |")
    lines += ["", "Values whose property name says password, secret, token, credential or jaas are masked by "
              "`kvpipe config show`; the file's content is never shown.", "",
              "## Renamed settings", "",
              "Still read under the old name, with a warning; where both are given the new name wins.", "",
              "| old | new |", "|---|---|"]
    lines += [f"| `{old}` (`{env_name(old)}`) | `{new}` |" for old, new in RENAMED.items()]
    lines += ["", "## Other environment variables", "",
              "kvpipe's own variables that are not settings (no warning for them):", "",
              "| variable | what it does |", "|---|---|"]
    lines += [f"| `{name}` | {_cell(what)} |" for name, what in OTHER_ENV.items()]
    return "\n".join(lines) + "\n"
