"""`kvpipe node`: run one simulated serving node and publish its KV events to Kafka.

\b
    kvpipe node --node-id n1 --steps 500 --groups full:16,sliding_window:16:128,mamba:16 -o json

At the end the run's summary on stdout: a table, or with `-o json` one JSON object, the last stdout line
(`--json`, and `--summary-json` before it, are older spellings); progress goes to stderr only with
`--progress`. Kafka settings come from `kvpipe.schemas.settings` (KVPIPE_* environment, kvpipe.toml).
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click

from kvpipe.gpu.node.kv_compute import ModelShape
from kvpipe.gpu.node.node import CountingSink, Node, NodeConfig
from kvpipe.gpu.node.workload import SyntheticConfig, SyntheticWorkload, TraceWorkload, Workload
from kvpipe.gpu.specs import KVSpec, from_group_spec
from kvpipe.schemas.cliopts import (Command, apply_bootstrap, bootstrap_server_option, configure_logging, deprecated,
                                    log_level_option, mapping_table, output_option, run)
from kvpipe.schemas.groupspec import GroupSpecError
from kvpipe.schemas.groupspec import parse_groups as parse_group_specs

DEFAULT_GROUPS = "full:16,sliding_window:16:128,mamba:16"


def parse_groups(text: str) -> tuple[KVSpec, ...]:
    """`--groups`: the grammar of `kvpipe.schemas.groupspec` (kind:block_size[:window|chunk], comma separated,
    in group order; short or vLLM kind names). The bridge's older IDX:KIND:... items are read with a
    deprecation warning."""
    def warn(item: str) -> None:
        deprecated(f"--groups item {item!r} (IDX:KIND:...)", "KIND:BLOCK_SIZE[:WINDOW] items in group order")

    try:
        declared = sorted(parse_group_specs(text, on_deprecated=warn), key=lambda g: g.group_idx)
        if [g.group_idx for g in declared] != list(range(len(declared))):
            raise GroupSpecError(f"--groups {text!r}: group indexes must be 0..{len(declared) - 1}")
        return tuple(from_group_spec(g) for g in declared)
    except ValueError as exc:  # GroupSpecError, or a kind the simulated node has no hit rule for
        raise GroupSpecError(f"{exc} (default {DEFAULT_GROUPS})") from None


class _Groups(click.ParamType):
    name = "SPECS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[KVSpec, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return parse_groups(value)
        except GroupSpecError as exc:
            self.fail(str(exc), param, ctx)


class _Retention(click.ParamType):
    name = "none|N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int | None:
        if value is None or isinstance(value, int):
            return value
        if str(value).lower() == "none":
            return None
        try:
            number = int(value)
        except ValueError:
            number = -1
        if number < 0:
            self.fail(f"{value!r}: expected none or an integer >= 0", param, ctx)
        return number


@click.command("node", cls=Command, help=__doc__)
@click.option("--node-id", default="node-0", show_default=True, help="the node's id (the Kafka key of its events)")
@click.option("--steps", type=int, help="stop after this many steps (default 500; not with --duration)")
@click.option("--duration", type=float, help="stop after this many seconds (not with --steps)")
@click.option("--rate", type=float, default=0.0, help="steps per second; 0 = as fast as possible")
@click.option("--seed", type=int, default=0, help="traffic seed (arrivals, users, repeats)")
@click.option("--prompt-seed", type=int, default=0,
              help="seed of the shared system prompts; keep it equal across nodes of one demo")
@click.option("--groups", type=_Groups(), default=DEFAULT_GROUPS,
              help=f"KV cache groups, kind:block_size[:window|chunk] in group order (default {DEFAULT_GROUPS})")
@click.option("--prefix-match-unit", type=int, metavar="TOKENS",
              help="explicit hash unit below the gcd of the group block sizes (e.g. 16 with "
                   "full:64,mamba:768: partial hits land on it)")
@click.option("--eagle-group", type=int, multiple=True, metavar="IDX",
              help="a group that serves an EAGLE draft (its hit drops one block); repeatable")
@click.option("--gpu-blocks", type=int, default=512, show_default=True, help="GPU blocks of the KV cache")
@click.option("--cpu-chunks", type=int, default=1024, help="CPU tier chunks; 0 disables offload (default 1024)")
@click.option("--blocks-per-chunk", type=int, default=1, show_default=True, help="GPU blocks per CPU tier chunk")
@click.option("--cpu-policy", type=click.Choice(["lru", "arc"]), default="lru", show_default=True,
              help="eviction policy of the CPU tier")
@click.option("--hash", "hash_algorithm", type=click.Choice(["sha256", "sha256_cbor"]), default="sha256",
              show_default=True, help="block hash (vLLM's --prefix-caching-hash-algo)")
@click.option("--retention", type=_Retention(), default="0", help="prefix-cache retention interval: none | 0 | N")
@click.option("--token-budget", type=int, default=256, help="tokens computed per step (default 256)")
@click.option("--max-running", type=int, default=16, show_default=True, help="requests running at once")
@click.option("--layers", type=int, default=2, help="layers per group (default 2)")
@click.option("--arrivals", type=float, default=0.3, help="new conversations per step (synthetic; default 0.3)")
@click.option("--system-prompts", type=int, default=6, show_default=True, help="shared system prompts (synthetic)")
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path),
              help="JSONL trace instead of the synthetic workload")
@click.option("--no-publish", is_flag=True, help="dry run: count events, send nothing")
@click.option("--topic", help="Kafka topic (default: the events_topic setting)")
@click.option("--model", default="kvpipe-sim", show_default=True, help="model name carried in the envelopes")
@click.option("--restart-at", type=int, help="simulate a restart before this step (new epoch, empty cache)")
@click.option("--export-prefixes", type=click.Path(dir_okay=False, path_type=Path),
              help="write system prompts and their block hashes as JSON")
@output_option(help="the run summary on stdout: a table, or one JSON object (the last line)",
               json_aliases=("--summary-json",))
@bootstrap_server_option()
@log_level_option()
@click.option("--progress", is_flag=True, help="progress lines on stderr")
@click.option("--threads", type=int, default=1, help="torch threads (the tensors are tiny; default 1)")
@click.option("--device", default="cpu", show_default=True,
              help="device of the KV tensors: cpu, cuda, cuda:N or auto (cuda when available)")
def node(**params: Any) -> int:
    if params["steps"] is not None and params["duration"] is not None:
        raise click.UsageError("give --steps or --duration, not both")
    return _run_node(SimpleNamespace(**params))


def main(argv: list[str] | None = None) -> int:
    return int(run(node, argv, "kvpipe node"))


def make_workload(args: SimpleNamespace) -> Workload:
    if args.trace is not None:
        return TraceWorkload.from_file(args.trace)
    return SyntheticWorkload(SyntheticConfig(seed=args.seed, prompt_seed=args.prompt_seed,
                                             num_system_prompts=args.system_prompts,
                                             arrivals_per_step=args.arrivals))


def _run_node(args: SimpleNamespace) -> int:
    """The node, its flags as attributes (parameter names of `node`)."""
    import torch

    torch.set_num_threads(max(1, args.threads))
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():
        print(f"kvpipe node: --device {device}: torch sees no CUDA device here", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    apply_bootstrap(args.bootstrap_server)
    config = NodeConfig(node_id=args.node_id, specs=args.groups, gpu_blocks=args.gpu_blocks,
                        cpu_chunks=args.cpu_chunks, blocks_per_chunk=args.blocks_per_chunk,
                        cpu_policy=args.cpu_policy, hash_algorithm=args.hash_algorithm,
                        retention=args.retention, prefix_match_unit=args.prefix_match_unit,
                        eagle_groups=tuple(args.eagle_group),
                        token_budget=args.token_budget,
                        max_running=args.max_running, shape=ModelShape(layers_per_group=args.layers),
                        device=device)
    publisher = None
    if args.no_publish:
        sink = CountingSink()
        node = Node(config, make_workload(args), sink)
    else:
        from kvpipe.producer.publisher import Publisher
        from kvpipe.schemas.settings import load_settings

        # The publisher needs the node's group specs and hash config, so the node comes first.
        node = Node(config, make_workload(args), CountingSink())
        publisher = Publisher(load_settings(), args.node_id, model=args.model, group_specs=node.group_specs(),
                              hash_config=node.hash_config(), topic=args.topic)
        node.sink = publisher
    if args.export_prefixes is not None:
        args.export_prefixes.write_text(json.dumps(node.export_prefixes()))

    def progress(n: Node) -> None:
        s = n.scheduler.stats
        print(f"[{n.config.node_id}] step {n.step_no}: running {len(n.scheduler.running)} waiting "
              f"{len(n.scheduler.waiting)} finished {s.finished} gpu_hit {s.gpu_hit_tokens} cpu_hit "
              f"{s.cpu_hit_tokens} events {sum(n.events.by_type.values())} usage {n.manager.usage:.2f}",
              file=sys.stderr, flush=True)

    def stop(signum: int, frame: object) -> None:  # the demo stops nodes with SIGTERM: flush, report
        node.stop_requested = True

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    steps = args.steps if args.steps is not None or args.duration is not None else 500
    try:
        elapsed = node.run(steps=steps, duration=args.duration, rate=args.rate, restart_at=args.restart_at,
                           progress=progress if args.progress else None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if publisher is not None:
            publisher.close()
    summary = node.summary(elapsed, publisher)
    print(json.dumps(summary, sort_keys=True) if args.output == "json" else mapping_table(summary))
    return 0
