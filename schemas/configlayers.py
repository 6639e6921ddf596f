"""Where each setting's value comes from: the layers `load_settings` merges, later winning —
defaults (the `Settings` type) ← the settings file ← `KVPIPE_*` environment ← flags (overrides).

Kept apart from the `Settings` type so the same layers answer two questions: "what is the value"
(`kvpipe.schemas.settings.load_settings`) and "who set it" (`kvpipe config show`). This module knows
setting names only, never their types, so it imports nothing of the settings module.

Decisions:
- The settings file is read only when it is named: `--config FILE` (every command) or
  `KVPIPE_CONFIG=FILE`. A `./kvpipe.toml` is no longer picked up on its own: which file configured a
  process then depended on the directory it was started from (the integration tests run their
  children elsewhere to dodge exactly that). A process that finds one unnamed says so, once.
- Keys the file does not know are refused, all of them in one message with the nearest names: a
  typo in a file is a setting silently left at its default otherwise.
- `KVPIPE_*` variables that are no setting are warned about, once each per process, on the
  `kvpipe.settings` logger (stderr before logging is set up) — not refused: environments are shared
  with other tools and stale exports should not stop a service. kvpipe's own variables that are not
  settings are listed in `OTHER_ENV`, the one place that names them.
"""
from __future__ import annotations

import difflib
import json
import logging
import tomllib
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_ENV = "KVPIPE_CONFIG"
ENV_PREFIX = "KVPIPE_"
UNNAMED_FILE = "kvpipe.toml"  # the file older kvpipe versions read from the working directory

# kvpipe's environment variables that are not settings (tests/unit/test_settings_env.py checks that the
# code and scripts name no other): the loader leaves them alone instead of warning about them.
OTHER_ENV: dict[str, str] = {
    CONFIG_ENV: "the settings file (`--config FILE`)",
    "KVPIPE_NATIVE": "0: build no native core (infra/scripts/native.sh); everything runs on the Python references",
    "KVPIPE_PYTHON": "the interpreter infra/scripts/venv.sh builds the virtual environment with",
    "KVPIPE_CACHE_DIR": "where infra/scripts/venv.sh keeps virtual environments and built wheels",
    "KVPIPE_TEST_ARTIFACTS": "where the browser test leaves its screenshots",
    "KVPIPE_TEST_RUN": "a tag the demo test puts on the processes it starts, to find strays",
    "KVPIPE_WRK_TOKEN": "the bearer token `kvpipe bench route-load` hands to wrk's Lua script",
    # Grafana's provisioning (infra/grafana/provisioning/datasources/), often in the same env file as kvpipe's
    "KVPIPE_PROMETHEUS_URL": "Grafana: the Prometheus data source",
    "KVPIPE_CLICKHOUSE_HOST": "Grafana: the ClickHouse data source's host",
    "KVPIPE_CLICKHOUSE_READONLY_USER": "Grafana: the ClickHouse data source's read-only user",
    "KVPIPE_CLICKHOUSE_READONLY_PASSWORD": "Grafana: that user's password",
}

log = logging.getLogger("kvpipe.settings")
_warned: set[str] = set()  # one line per name and process: settings load many times in one process


class SettingsError(ValueError):
    """A setting that cannot be used, with what to change: the field, where its value came from."""


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _nearest(name: str, known: Collection[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def read_file(path: str, fields: Collection[str]) -> dict[str, object]:
    """The settings file's table, or SettingsError naming the file and what is wrong with it."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise SettingsError(f"settings file {path}: no such file") from None
    except OSError as exc:
        raise SettingsError(f"settings file {path}: cannot read it: {exc.strerror}") from None
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # its message has the line and column
        raise SettingsError(f"settings file {path} is not valid TOML: {exc}") from None
    unknown = [key for key in values if key not in fields]
    if unknown:
        named = ", ".join(key + _nearest(key, fields) for key in unknown)
        raise SettingsError(f"settings file {path}: unknown settings {named}; the keys are the setting names "
                            f"of docs/settings.md")
    return values


def parse_properties(text: str) -> dict[str, str]:
    """A Java `.properties` file (Kafka's `--command-config`): `key=value`, `key: value` or
    `key value` lines, `#`/`!` comments, a line ending in an odd number of backslashes continued on
    the next. Values stay strings, as in Java; other escapes are kept as written."""
    props: dict[str, str] = {}
    logical = ""
    for raw in text.splitlines():
        line = raw.lstrip(" \t\f")
        if not logical and (not line or line[0] in "#!"):
            continue
        trailing = len(line) - len(line.rstrip("\\"))
        if trailing % 2:
            logical += line[:-1]
            continue
        key, value = _key_value(logical + line)
        logical = ""
        if key:
            props[key] = value
    if logical:
        key, value = _key_value(logical)
        if key:
            props[key] = value
    return props


def _key_value(line: str) -> tuple[str, str]:
    """The key ends at the first unescaped `=`, `:` or blank; blanks and one `=`/`:` after it are the separator."""
    i = 0
    while i < len(line) and line[i] not in "=: \t\f":
        i += 2 if line[i] == "\\" else 1
    rest = line[i:].lstrip(" \t\f")
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(" \t\f")
    return line[:i], rest  # trailing blanks belong to the value, as in Java


@dataclass
class Layers:
    """The merged values (not yet typed) and, per field set anywhere, where its value came from:
    `file PATH`, `env KVPIPE_X` or `flag`; a field absent from `sources` has its default."""

    file: str = ""
    values: dict[str, object] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def source(self, name: str) -> str:
        return self.sources.get(name, "default")


def gather(fields: Collection[str], overrides: Mapping[str, object] | None, env: Mapping[str, str],
           json_fields: Collection[str] = (), renamed: Mapping[str, str] | None = None) -> Layers:
    """The layers for `fields`; `json_fields` take a JSON object in the environment (a table in the file).
    `renamed` (old name → new) is still read under the old name, with a FutureWarning — the category Python
    shows users by default; where a layer gives both, the new name wins."""
    renamed = renamed or {}
    layers = Layers(file=env.get(CONFIG_ENV, ""))
    if layers.file:
        found = _new_names(read_file(layers.file, [*fields, *renamed]), renamed,
                           lambda name: f"{name} ({layers.file})")
        for key, value in found.items():
            layers.values[key], layers.sources[key] = value, f"file {layers.file}"
    elif Path(UNNAMED_FILE).is_file():
        _warn_once(UNNAMED_FILE, f"./{UNNAMED_FILE} is not read: a settings file is read only when named "
                                 f"(--config {UNNAMED_FILE}, or {CONFIG_ENV}={UNNAMED_FILE})")
    given = {name: env[env_name(name)] for name in (*fields, *renamed) if env_name(name) in env}
    for name, text in _new_names(given, renamed, env_name).items():
        layers.values[name] = _env_value(env_name(name), text) if name in json_fields else text
        layers.sources[name] = f"env {env_name(name)}"
    for name, value in (overrides or {}).items():
        if value is not None:
            layers.values[name], layers.sources[name] = value, "flag"
    warn_unknown_env(env, [*fields, *renamed])
    return layers


def _new_names(values: dict, renamed: Mapping[str, str], spell: Callable[[str], str]) -> dict:
    """`values` with each old name moved to its new one (`spell`: a name as the user wrote it)."""
    for old, new in renamed.items():
        if old in values:
            warnings.warn(f"{spell(old)} is deprecated; use {spell(new)}", FutureWarning, stacklevel=3)
            values.setdefault(new, values.pop(old))
    return values


def _env_value(key: str, text: str) -> object:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SettingsError(f"{key}: expected a JSON object ({exc})") from None


def unknown_env(env: Mapping[str, str], fields: Collection[str]) -> list[str]:
    """`KVPIPE_*` names in `env` that are neither a setting nor one of `OTHER_ENV`."""
    known = {env_name(f) for f in fields} | set(OTHER_ENV)
    return sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in known)


def warn_unknown_env(env: Mapping[str, str], fields: Collection[str]) -> None:
    known = [env_name(f) for f in fields]
    for key in unknown_env(env, fields):
        _warn_once(key, f"{key} is not a kvpipe setting; ignored{_nearest(key.upper(), known)}")


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)
