"""Flags every `kvpipe` subcommand spells the same way, as click decorators, and the command class
that reads them.

Here, beside the settings they map to, because every package with a command (gpu, producer,
processors, infra) may import `schemas`. click is the one library this module adds: a base
dependency of kvpipe (and Faust's own command-line library).

- `--bootstrap-server HOST:PORT[,...]`: the Kafka brokers (the `kafka_bootstrap` setting). It is
  written to `KVPIPE_KAFKA_BOOTSTRAP` in this process, so settings loaded later (Faust apps read
  them at import) and child processes (the demo's apps and nodes) see the same brokers; without the
  flag the environment variable and kvpipe.toml work as before.
- `--log-level LEVEL` (+ `KVPIPE_LOG_LEVEL`): one level for kvpipe's loggers and Faust's worker;
  the command receives the resolved level (flag, else the variable, else its default).
- `--json`: structured output as JSON.

Older spellings (`--loglevel`, `--summary-json`, the bridge's `--bootstrap`) stay as options of
their own that feed the new one and warn once on stderr: a `DeprecationWarning` is hidden by
default, and a deployer reading a start script is whom the warning is for.
"""
from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
from click.core import ParameterSource

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_LEVEL_ENV = "KVPIPE_LOG_LEVEL"
BOOTSTRAP_ENV = "KVPIPE_KAFKA_BOOTSTRAP"

# `-h` as argparse had it; help wrapped wider than click's 80 columns (the flags' help is long).
CONTEXT_SETTINGS: dict[str, Any] = {"help_option_names": ["-h", "--help"], "max_content_width": 100}

F = TypeVar("F", bound=Callable[..., Any])


def deprecated(old: str, new: str) -> None:
    """One stderr line naming the replacement of a deprecated spelling."""
    print(f"warning: {old} is deprecated; use {new}", file=sys.stderr)


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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["context_settings"] = {**CONTEXT_SETTINGS, **(kwargs.get("context_settings") or {})}
        super().__init__(*args, **kwargs)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        rest = super().parse_args(ctx, args)
        if not ctx.resilient_parsing:
            _fold_aliases(ctx)
            for param in self.params:
                if isinstance(param, LogLevelOption) and param.name is not None:
                    ctx.params[param.name] = log_level(ctx.params.get(param.name), param.command_default)
        return rest

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        own: list[tuple[str, str]] = []
        shared: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                (shared if isinstance(param, SharedOption) else own).append(record)
        for title, records in (("Options", own), ("Options every kvpipe command takes", shared)):
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


def log_level_option(default: str = "warning", loglevel_alias: bool = False) -> Callable[[F], F]:
    """`--log-level` (parameter `log_level`): the command receives the resolved level, lower case."""
    choice = click.Choice(LOG_LEVELS, case_sensitive=False)

    def decorate(f: F) -> F:
        if loglevel_alias:
            f = _aliases(("--loglevel",), "log_level", "--log-level", type=choice, metavar="LEVEL")(f)
        return click.option("--log-level", "log_level", cls=LogLevelOption, command_default=default, type=choice,
                            default=None, metavar="LEVEL",
                            help=f"log level of kvpipe (and Faust) loggers: {', '.join(LOG_LEVELS)} "
                                 f"({LOG_LEVEL_ENV}; default: {default})")(f)
    return decorate


def log_level(flag: str | None, default: str = "warning") -> str:
    """The flag, else KVPIPE_LOG_LEVEL, else the command's default; lower case."""
    level = (flag or os.environ.get(LOG_LEVEL_ENV) or default).lower()
    if level not in LOG_LEVELS:
        raise SystemExit(f"{LOG_LEVEL_ENV}={level!r}: expected one of {', '.join(LOG_LEVELS)}")
    return level


def configure_logging(level: str) -> str:
    """Root handler on stderr at `level` (resolved by `--log-level`), the `kvpipe` logger too; the
    level name (Faust's Worker takes it as `loglevel`)."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(level.upper())
    logging.getLogger("kvpipe").setLevel(level.upper())
    return level


def json_option(help: str = "print the result as JSON", aliases: Sequence[str] = ()) -> Callable[[F], F]:
    """`--json` (parameter `as_json`); `aliases` are older spellings kept working, with a warning."""
    def decorate(f: F) -> F:
        f = _aliases(aliases, "as_json", "--json", is_flag=True)(f)
        return click.option("--json", "as_json", is_flag=True, help=help)(f)
    return decorate


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
