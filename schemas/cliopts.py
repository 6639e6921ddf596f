"""Flags every `kvpipe` subcommand spells the same way, as click decorators, and the command class
that reads them.

Here, beside the settings they map to, because every package with a command (gpu, producer,
processors, infra) may import `schemas`. click is the one library this module adds: a base
dependency of kvpipe (and Faust's own command-line library).

- `--bootstrap-server HOST:PORT[,...]`: the Kafka brokers (the `kafka_bootstrap` setting). It is
  written to `KVPIPE_KAFKA_BOOTSTRAP` in this process, so settings loaded later (Faust apps read
  them at import) and child processes (the demo's apps and nodes) see the same brokers; without the
  flag the environment variable and the settings file work as before.
- `--config FILE` (every command; `ConfigOption`): the settings file, checked and exported as
  `KVPIPE_CONFIG` for the same reasons.
- `-l/--log-level LEVEL` (+ `KVPIPE_LOG_LEVEL`): one level for kvpipe's loggers and Faust's worker;
  the command receives the resolved level (flag, else the variable, else its default). `--loglevel`
  is Faust's own spelling of it: a plain second name, since a Faust operator types it by habit.
- `--log-format text|json` (+ `KVPIPE_LOG_FORMAT`) beside every `--log-level`: text lines, or one JSON
  object per line (kvpipe.schemas.logsetup). Exported as KVPIPE_LOG_FORMAT like `--bootstrap-server`, so
  `configure_logging` and the processes a command starts read it, and no command's parameters change.
- `-o/--output table|json` on every command that prints data (`output_option`): `table` for people,
  `json` for programs. `--json` stays as its older spelling, without a warning: scripts use it, and
  it means the same. Given together, they must agree (a usage error otherwise), as `kvpipe sql`'s
  `--format` does.

Older spellings (`--summary-json`, the bridge's `--bootstrap`) stay as options of their own that
feed the new one and warn once on stderr: a `DeprecationWarning` is hidden by default, and a
deployer reading a start script is whom the warning is for.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO, TypeVar

import click
from click.core import ParameterSource

from kvpipe.schemas.logsetup import LOG_FORMAT_ENV, LOG_FORMATS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_ENV = "KVPIPE_LOG_LEVEL"
CONFIG_ENV = "KVPIPE_CONFIG"  # kvpipe.schemas.configlayers reads it
BOOTSTRAP_ENV = "KVPIPE_KAFKA_BOOTSTRAP"

# `-h` as argparse had it; help wrapped wider than click's 80 columns (the flags' help is long).
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

F = TypeVar("F", bound=Callable[..., Any])


def deprecated(old: str, new: str) -> None:
    """One stderr line naming the replacement of a deprecated spelling."""
    print(f"warning: {old} is deprecated; use {new}", file=sys.stderr)


# The help section of the shared flags: `--log-level` is on every command, `--bootstrap-server` on every
# command that talks to Kafka (tests/unit/test_cli_conventions.py holds them to it).
SHARED_HEADING = "Options shared by kvpipe commands"


class SharedOption(click.Option):
    """A flag every command of its kind takes: listed in its own help section."""


class DeprecatedAlias(click.Option):
    """An older spelling of the option named `replaces` (its parameter name); `replacement` is the
    flag to use instead. Its value goes to that option unless the new flag is given too."""

    def __init__(self, param_decls: Sequence[str], *, replaces: str, replacement: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", f"deprecated spelling of {replacement}")
        super().__init__(param_decls, **kwargs)
        self.replaces, self.replacement = replaces, replacement


class LogLevelOption(SharedOption):
    """`--log-level`; the command's own default level rides along (`command_default`)."""

    def __init__(self, param_decls: Sequence[str], *, command_default: str, **kwargs: Any) -> None:
        super().__init__(param_decls, **kwargs)
        self.command_default = command_default


class Command(click.Command):
    """A kvpipe command: `-h`, deprecated aliases folded into their options (with the warning), the
    log level resolved, and the shared flags in a help section of their own."""

    def __init__(self, *args: Any, config_option: bool = True, **kwargs: Any) -> None:
        kwargs["context_settings"] = {**CONTEXT_SETTINGS, **(kwargs.get("context_settings") or {})}
        super().__init__(*args, **kwargs)
        if config_option:  # every command that may load settings; not a parameter of its function
            self.params.append(ConfigOption())

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        if not ctx.resilient_parsing:
            _fold_aliases(ctx)
            for param in self.params:
                if isinstance(param, LogLevelOption) and param.name is not None:  # an option always has a name
                    ctx.params[param.name] = log_level(ctx.params.get(param.name), param.command_default)
                if isinstance(param, OutputOption) and param.name is not None:
                    ctx.params[param.name] = param.resolve(ctx, ctx.params.get(param.name),
                                                           ctx.params.pop("as_json", False))
        return rest

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        own: list[tuple[str, str]] = []
        shared: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                (shared if isinstance(param, SharedOption) else own).append(record)
        for title, records in (("Options", own), (SHARED_HEADING, shared)):
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


class Group(click.Group):
    """A kvpipe command group: `-h`, its commands are `Command`s, listed in the order they are defined
    (the order a reader meets them: `infra up`, `down`, `status`), not alphabetically."""

    command_class = Command

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["context_settings"] = {**CONTEXT_SETTINGS, **(kwargs.get("context_settings") or {})}
        super().__init__(*args, **kwargs)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)


def _fold_aliases(ctx: click.Context) -> None:
    for param in ctx.command.params:
        if not isinstance(param, DeprecatedAlias) or param.name is None:
            continue
        value = ctx.params.pop(param.name, None)
        if ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
            continue
        deprecated(param.opts[0], param.replacement)
        if ctx.get_parameter_source(param.replaces) is not ParameterSource.COMMANDLINE:  # the new flag wins
            ctx.params[param.replaces] = value


def _alias_name(flag: str) -> str:
    return "deprecated_" + flag.lstrip("-").replace("-", "_")


def _aliases(flags: Sequence[str], replaces: str, replacement: str, **kwargs: Any) -> Callable[[F], F]:
    def decorate(f: F) -> F:
        for flag in reversed(flags):
            f = click.option(flag, _alias_name(flag), cls=DeprecatedAlias, replaces=replaces,
                             replacement=replacement, **kwargs)(f)
        return f
    return decorate


def bootstrap_server_option(deprecated_aliases: Sequence[str] = ()) -> Callable[[F], F]:
    """`--bootstrap-server` (parameter `bootstrap_server`); export it with `apply_bootstrap`."""
    def decorate(f: F) -> F:
        f = _aliases(deprecated_aliases, "bootstrap_server", "--bootstrap-server", metavar="HOST:PORT[,...]")(f)
        return click.option("--bootstrap-server", "bootstrap_server", cls=SharedOption, metavar="HOST:PORT[,...]",
                            help=f"Kafka brokers ({BOOTSTRAP_ENV}; default: the local broker of `kvpipe infra up`)")(f)
    return decorate


def apply_bootstrap(value: str | None) -> str | None:
    """Export `--bootstrap-server` as KVPIPE_KAFKA_BOOTSTRAP (see the module docstring); the value or None."""
    if value:
        os.environ[BOOTSTRAP_ENV] = value
    return value or None


def log_level_option(default: str = "warning") -> Callable[[F], F]:
    """`-l/--log-level`, `--loglevel` (Faust's spelling) the same option (parameter `log_level`): the
    command receives the resolved level, lower case. With it `--log-format`, which no parameter receives: it is
    exported (module doc) and `configure_logging` reads it."""
    def decorate(f: F) -> F:
        f = click.option("--log-format", cls=SharedOption, type=click.Choice(LOG_FORMATS, case_sensitive=False),
                         default=None, expose_value=False, callback=_use_log_format, metavar="FORMAT",
                         help=f"log lines as text or one JSON object per line: {', '.join(LOG_FORMATS)} "
                              f"({LOG_FORMAT_ENV}; default: text)")(f)
        return click.option("-l", "--log-level", "--loglevel", "log_level", cls=LogLevelOption,
                            command_default=default, type=click.Choice(LOG_LEVELS, case_sensitive=False),
                            default=None, metavar="LEVEL",
                            help=f"log level of kvpipe (and Faust) loggers: {', '.join(LOG_LEVELS)} "
                                 f"({LOG_LEVEL_ENV}; default: {default}); --loglevel is Faust's spelling")(f)
    return decorate


def _use_log_format(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None and not ctx.resilient_parsing:
        os.environ[LOG_FORMAT_ENV] = value.lower()


def log_format() -> str:
    """The `log_format` setting (`--log-format`, exported; KVPIPE_LOG_FORMAT; the settings file), else text."""
    from kvpipe.schemas.settings import SettingsError, settings_layers

    try:
        layers = settings_layers()
    except SettingsError as exc:
        raise SystemExit(f"kvpipe: {exc}") from None
    value = str(layers.values.get("log_format") or "text").lower()
    if value not in LOG_FORMATS:
        raise SystemExit(f"log_format={value!r} ({layers.source('log_format')}): expected one of "
                         f"{', '.join(LOG_FORMATS)}")
    return value


def log_level(flag: str | None, default: str = "warning") -> str:
    """The flag, else the `log_level` setting (settings file, KVPIPE_LOG_LEVEL), else the command's
    default; lower case. Only that setting is read: the rest load, and are checked, where used."""
    from kvpipe.schemas.settings import SettingsError, settings_layers

    level, source = flag, "--log-level"
    if not level:
        try:
            layers = settings_layers()
        except SettingsError as exc:
            raise SystemExit(f"kvpipe: {exc}") from None
        level, source = str(layers.values.get("log_level") or ""), layers.source("log_level")
    level = (level or default).lower()
    if level not in LOG_LEVELS:
        raise SystemExit(f"log_level={level!r} ({source}): expected one of {', '.join(LOG_LEVELS)}")
    return level


class ConfigOption(SharedOption):
    """`--config FILE`: the settings file. Checked when given (missing, not TOML, unknown keys: a usage
    error naming what is wrong) and exported as KVPIPE_CONFIG, made absolute, so settings loaded later
    in this process (Faust apps read theirs at import) and in the processes it starts (the demo's
    apps, a bench's children, whatever their working directory) read the same file. Eager: handled
    before the other flags, since resolving them (the log level) may read it."""

    def __init__(self) -> None:
        super().__init__(("--config",), metavar="FILE", is_eager=True, expose_value=False,
                         callback=_use_config_file,
                         help="the settings file (TOML; KVPIPE_CONFIG): keys are the settings of docs/settings.md")


def _use_config_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is None or ctx.resilient_parsing:
        return
    from kvpipe.schemas.settings import SettingsError, check_settings_file

    path = os.path.abspath(value)
    try:
        check_settings_file(path)
    except SettingsError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    os.environ[CONFIG_ENV] = path


def configure_logging(level: str, stream: TextIO | None = None) -> str:
    """Root handler on `stream` (stderr) at `level` (resolved by `--log-level`) in the `log_format`
    (`--log-format`), the `kvpipe` logger at `level` too, secrets masked (kvpipe.schemas.logsetup); the level
    name (Faust's Worker takes it as `loglevel`)."""
    from kvpipe.schemas import logsetup

    logsetup.configure(level, log_format(), stream)
    return level


def json_option(help: str = "print the result as JSON", aliases: Sequence[str] = ()) -> Callable[[F], F]:
    """`--json` (parameter `as_json`); `aliases` are older spellings kept working, with a warning."""
    def decorate(f: F) -> F:
        f = _aliases(aliases, "as_json", "--json", is_flag=True)(f)
        return click.option("--json", "as_json", is_flag=True, help=help)(f)
    return decorate


# The two Faust apps' flags in Faust's worker spelling, kvpipe's older names (after the settings) kept as the
# same option: one meaning each. Faust's own --web-host is the host name an app advertises; kvpipe's
# `web_host` setting is the bind address (the apps give Faust both from it), so here --web-host binds.
def web_bind_option() -> Callable[[F], F]:
    """`--web-bind`, `--web-host` (parameter `web_host`, the KVPIPE_WEB_HOST setting)."""
    return click.option("--web-bind", "--web-host", "web_host", metavar="ADDRESS",
                        help="address the HTTP API binds, as Faust's --web-bind (KVPIPE_WEB_HOST; default "
                             "127.0.0.1); --web-host is the same option")


def datadir_option(app_dir: str) -> Callable[[F], F]:
    """`--datadir`, `--state-dir` (parameter `state_dir`, the KVPIPE_STATE_DIR setting): kvpipe's state
    root, under which the app keeps its Faust data (`app_dir`/<app id>)."""
    return click.option("--datadir", "--state-dir", "state_dir", metavar="DIR",
                        help=f"kvpipe's local state directory, as Faust's --datadir (KVPIPE_STATE_DIR); this "
                             f"app's Faust data lives under DIR/{app_dir}/; --state-dir is the same option")


OUTPUTS = ("table", "json")


class OutputOption(click.Option):
    """`-o/--output`, with `--json` (parameter `as_json`) folded into it by `Command`: the command
    receives one format. `json_means` is the format `--json` alone gives; `--json` agrees with any
    of `json_agrees` (for `kvpipe inspect`, whose JSON comes as lines or as one document)."""

    def __init__(self, param_decls: Sequence[str], *, fallback: str, json_means: str,
                 json_agrees: Sequence[str], **kwargs: Any) -> None:
        super().__init__(param_decls, **kwargs)
        self.fallback, self.json_means, self.json_agrees = fallback, json_means, tuple(json_agrees)

    def resolve(self, ctx: click.Context, chosen: str | None, as_json: bool) -> str:
        if as_json and chosen is not None and chosen not in self.json_agrees:
            raise click.UsageError(f"-o/--output {chosen} and --json disagree", ctx)
        return chosen or (self.json_means if as_json else self.fallback)


def output_option(choices: Sequence[str] = OUTPUTS, default: str = "table", help: str = "",
                  json_means: str = "json", json_aliases: Sequence[str] = ()) -> Callable[[F], F]:
    """`-o/--output` (parameter `output`, one of `choices`, `default` when not given) and `--json`, its
    older spelling (see `OutputOption`); `json_aliases` are older spellings of `--json`, with a warning."""
    agrees = tuple(c for c in choices if c.startswith("json"))

    def decorate(f: F) -> F:
        f = _aliases(json_aliases, "as_json", "--json", is_flag=True)(f)
        f = click.option("--json", "as_json", is_flag=True, help=f"same as --output {json_means}")(f)
        return click.option("-o", "--output", "output", cls=OutputOption, type=click.Choice(tuple(choices)),
                            default=None, fallback=default, json_means=json_means, json_agrees=agrees,
                            help=f"{help or 'the output format'} (default: {default})")(f)
    return decorate


def mapping_table(data: Mapping[str, Any]) -> str:
    """`-o table` of a summary mapping: one row per value, nested keys joined by dots (`requests.finished`),
    drawn by terminaltables as kvpipe's other tables are (a base dependency, imported when used)."""
    from terminaltables import AsciiTable

    rows: list[list[str]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        else:
            rows.append([prefix, "" if value is None else str(value)])

    walk("", data)
    table = AsciiTable([["key", "value"], *rows])
    table.justify_columns = {1: "right"}
    return table.table


def parse(command: click.Command, argv: Sequence[str], prog: str | None = None) -> dict[str, Any]:
    """The parameters `command` would be called with for `argv` (warnings of deprecated spellings
    included), without running it."""
    with command.make_context(prog or command.name, list(argv)) as ctx:
        return dict(ctx.params)


def run(command: click.Command, argv: Sequence[str] | None, prog: str) -> Any:
    """Run `command` on `argv` as `prog`; its return value (an exit code for commands), or the exit
    code of help, a usage error (2) or an abort. Nothing here calls `sys.exit`: callers may be tests."""
    try:
        result = command.main(args=list(sys.argv[1:] if argv is None else argv), prog_name=prog,
                              standalone_mode=False)
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        print("Aborted!", file=sys.stderr)
        return 1
    return 0 if result is None else result
