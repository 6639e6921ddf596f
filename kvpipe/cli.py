"""The `kvpipe` command: a thin dispatcher (click).

Each subcommand lives in the package that owns the work, as a click command; this module only maps
a name to `module:command` and imports it when that name is used, so `kvpipe --help` (which lists
the names from the table) does not pay for torch or faust, and a base install without the `[gpu]`
extra still runs every other command.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

import click

from kvpipe.schemas.cliopts import CONTEXT_SETTINGS, run

COMMANDS: dict[str, tuple[str, str]] = {
    "infra": ("kvpipe.infra.cli:infra", "start/stop/inspect the local Apache Kafka broker and topics"),
    "node": ("kvpipe.gpu.node.cli:node", "run a simulated serving node (hybrid KV cache manager + offload)"),
    "bridge": ("kvpipe.producer.bridge.cli:bridge", "forward a real vLLM node's ZMQ KV events into Kafka"),
    "processor": ("kvpipe.processors.routing.cli:processor", "run the routing index app (Faust; /route, /nodes, /stats)"),
    "analytics": ("kvpipe.processors.analytics.cli:analytics", "run the analytics app (Faust; rows to ClickHouse, /sql)"),
    "route": ("kvpipe.processors.routing.cli:route", "ask a running processor which nodes hold a prefix"),
    "nodes": ("kvpipe.apps:nodes", "list the nodes a running processor knows (its /nodes, every page)"),
    "stats": ("kvpipe.apps:stats", "print a running app's /stats (the processor's, or --analytics)"),
    "sql": ("kvpipe.processors.analytics.cli:sql", "run a read-only SQL query (or a saved one) on the analytics store"),
    "plan": ("kvpipe.processors.analytics.cli:plan", "the capacity curve: hits N more/fewer cache blocks would give"),
    "report": ("kvpipe.processors.analytics.cli:report", "write the capacity-planning report (self-contained HTML)"),
    "inspect": ("kvpipe.producer.inspect:inspect", "decode a vLLM payload, ZMQ capture or kvpipe envelope to JSON"),
    "config": ("kvpipe.configcmd:config", "show the effective settings and where each came from; the settings file's schema"),
    "demo": ("kvpipe.demo:demo", "run the whole pipeline end to end on the embedded defaults"),
    "bench": ("kvpipe.bench:bench", "run a benchmark; last stdout line is one JSON object"),
}


# Modules the base install leaves out → the extra that brings them (pyproject.toml).
EXTRA_FOR_MODULE = {"torch": "gpu", "numpy": "gpu",
                    # the analytics role: the store's client and engine, the SQL guard's parser, the report's plots
                    "clickhouse_connect": "analytics", "chdb": "analytics", "sqlglot": "analytics",
                    "matplotlib": "analytics"}


class LazyGroup(click.Group):
    """Subcommands named in a table of `name → ("module:attribute", one-line help)`, imported on
    use. Help lists them from the table: click's own listing would import every command."""

    kind = "command"

    def __init__(self, *args: Any, table: dict[str, tuple[str, str]], **kwargs: Any) -> None:
        kwargs["context_settings"] = {**CONTEXT_SETTINGS, **(kwargs.get("context_settings") or {})}
        super().__init__(*args, **kwargs)
        self.table = table

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.table)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.table:
            return super().get_command(ctx, name)  # the hidden ones registered on the group
        module_name, attr = self.table[name][0].split(":")
        return getattr(importlib.import_module(module_name), attr)

    def resolve_command(self, ctx: click.Context,
                        args: list[str]) -> tuple[str | None, click.Command | None, list[str]]:
        name = args[0]
        if name not in self.table and name not in self.commands and not name.startswith("-"):
            ctx.fail(f"unknown {self.kind} {name!r}; known: {', '.join(self.table)}")
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section(f"{self.kind.capitalize()}s ({ctx.command_path} <{self.kind}> --help for details)"):
            formatter.write_dl([(name, desc) for name, (_, desc) in self.table.items()])


def version() -> str:
    """The installed distribution's version; the source tree's pyproject when run uninstalled."""
    from importlib import metadata

    try:
        return metadata.version("kvpipe")
    except metadata.PackageNotFoundError:
        import pathlib
        import tomllib

        pyproject = pathlib.Path(__file__).resolve().parent.parent / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def _print_version(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        print(f"kvpipe {version()}")
        ctx.exit(0)


@click.group("kvpipe", cls=LazyGroup, table=COMMANDS, invoke_without_command=True,
             help="Group-tagged KV-cache events from LLM serving nodes through Kafka into a live per-group cache "
                  "index and ClickHouse analytics. Every setting is also a KVPIPE_* environment variable.")
@click.option("-V", "--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="print kvpipe's version and exit")
@click.pass_context
def kvpipe(ctx: click.Context) -> int:
    if ctx.invoked_subcommand is None:  # bare `kvpipe`: the overview, as `--help` gives it
        print(ctx.get_help())
    return 0


@kvpipe.command("help", hidden=True)
@click.pass_context
def _help(ctx: click.Context) -> int:
    print(ctx.parent.get_help() if ctx.parent else "")
    return 0


@kvpipe.command("version", hidden=True)
def _version() -> int:
    print(f"kvpipe {version()}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return int(run(kvpipe, argv, "kvpipe") or 0)
    except ModuleNotFoundError as exc:
        extra = EXTRA_FOR_MODULE.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        name = next((a for a in argv if not a.startswith("-")), "")
        print(f"kvpipe {name}: needs {exc.name}, which this install does not have; "
              f"install the extra: pip install 'kvpipe[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
