"""`kvpipe bench <name> [-o json] [options]`: dispatch to the benchmark drivers, this package's modules.

They live here, not in the runtime packages they measure, with the helpers the tests share with them:
`procrun` (a `kvpipe processor|analytics` child process), `testing_publisher` (a vLLM-like ZMQ
publisher), `fuzz` (hostile inputs), `workload` (a synthetic analytics store) and the fault rig
(`faults`, `faultload`).

Contract for every benchmark function `run(argv) -> dict`: it measures the thing and a baseline in the
same run and returns a dict with at least `bench`, `value`, `unit`, `baseline`, `ratio` (higher is
better) plus details. This module prints it; with `-o json` (or `--json`) the last stdout line is that one
object.
A benchmark parses its own flags with a click command (`kvpipe.schemas.cliopts.Command`, run by
`cliopts.run`): `kvpipe bench <name>` takes out the flags every benchmark shares and hands it the
rest, `--help` included, untouched. `run` may return an exit code instead of a dict (after printing
its help, or a usage error: 2).
"""
from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import click

from kvpipe.cli import LazyGroup
from kvpipe.schemas.cliopts import (Command, apply_bootstrap, bootstrap_server_option, configure_logging,
                                    log_level_option, output_option)

BENCHES: dict[str, tuple[str, str]] = {
    "producer": ("kvpipe.bench.producer:run", "publisher events/s vs raw confluent-kafka, publish() cost"),
    "ingest": ("kvpipe.bench.ingest:run", "index apply rate vs raw consumption, publish->route freshness"),
    "analytics": ("kvpipe.bench.analytics:run", "analytics app rows/s into chDB vs direct insert; routing freshness under SQL"),
    "analytics-queries": ("kvpipe.bench.analytics_queries:run", "analytics write latency p50/p99 idle vs under analysts' heaviest queries; query caps and time limits"),
    "bridge": ("kvpipe.bench.bridge:run", "ZMQ -> Kafka forwarding rate vs raw publish rate"),
    "offload": ("kvpipe.bench.offload:run", "batched block copies GB/s vs one contiguous copy"),
    "manager": ("kvpipe.bench.manager:run", "scheduler steps/s and events/s of the hybrid manager"),
    "route": ("kvpipe.bench.route_http:run", "token-id /route in process and over HTTP: hashing, search, p50/p99"),
    "route-load": ("kvpipe.bench.route_load:run", "/route decisions/s, p50/p99 under wrk load, with and without ingest"),
    "fuzz": ("kvpipe.bench.fuzz:run", "hostile inputs/s through ingest: outcomes by reason, crashes, RSS growth"),
    "faults": ("kvpipe.bench.faults:run", "broker outage, processor kill/pause, cluster leader kill: events lost, stalls"),
}

# The benchmark's own flags pass through: unknown options and their values are kept, in order, for it;
# no help option here, so `--help` reaches the benchmark's own parser.
_PASS_THROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "allow_interspersed_args": True}


def bench_command(name: str) -> click.Command:
    """`kvpipe bench <name>`: the shared flags, then the benchmark's `run` on the rest."""
    target, desc = BENCHES[name]

    @click.command(name, cls=Command, help=desc, add_help_option=False, context_settings=_PASS_THROUGH)
    @output_option(help="the result as one key per line, or as one JSON object, the last stdout line")
    @bootstrap_server_option()
    @log_level_option()
    @click.pass_context
    def bench_one(ctx: click.Context, output: str, bootstrap_server: str | None, log_level: str) -> int:
        apply_bootstrap(bootstrap_server)  # benchmarks load the settings themselves: the environment carries it
        configure_logging(log_level)
        module_name, func_name = target.split(":")
        result = getattr(importlib.import_module(module_name), func_name)(list(ctx.args))
        if not isinstance(result, dict):  # its help was asked for, or its flags were wrong
            return int(result or 0)
        if output == "json":
            print(json.dumps(result, sort_keys=True))
        else:
            for key, value in result.items():
                print(f"{key:>24}: {value}")
        return 0

    return bench_one


def split_common(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """The flags every benchmark shares, taken out of `argv` (their values, log level resolved), and
    the rest, in order, for the benchmark's own parser."""
    with bench_command("producer").make_context("kvpipe bench", list(argv)) as ctx:
        return list(ctx.args), dict(ctx.params)


class BenchGroup(LazyGroup):
    kind = "benchmark"

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        return bench_command(name) if name in self.table else super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        shared = [p.get_help_record(ctx) for p in bench_command("producer").params]
        with formatter.section("Options every benchmark takes (after its name)"):
            formatter.write_dl([r for r in shared if r is not None])
        super().format_commands(ctx, formatter)


@click.group("bench", cls=BenchGroup, table=BENCHES, invoke_without_command=True,
             help="Run a benchmark: it measures the thing and a baseline in the same run and prints the result "
                  "(bench, value, unit, baseline, ratio: higher is better, details); with -o json (or --json) the "
                  "last stdout line is one JSON object.")
@click.pass_context
def bench(ctx: click.Context) -> int:
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
    return 0


def main(argv: list[str]) -> int:
    from kvpipe.schemas.cliopts import run

    return int(run(bench, argv, "kvpipe bench"))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
