"""`kvpipe bridge`: forward a vLLM node's ZMQ KV events into Kafka (or record them to files).

\b
    kvpipe bridge --zmq tcp://node:5557 --replay tcp://node:5558 --node-id node-a [--dp-ranks 2] \\
        --groups full_attention:16,sliding_window:16:4096 --bootstrap-server broker:9092
    kvpipe bridge --zmq tcp://node:5557 --node-id node-a --record captures/

\b
vLLM side:
    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'
"""
from __future__ import annotations

import logging
import signal
import threading
from types import SimpleNamespace

import click

from kvpipe.producer.bridge.replay import DEFAULT_TIMEOUT_S
from kvpipe.producer.bridge.runner import Bridge, BridgeConfig
from kvpipe.schemas.layout import layout_problem
from kvpipe.schemas.logsetup import librdkafka_logging
from kvpipe.schemas.cliopts import (Command, apply_bootstrap, bootstrap_server_option, configure_logging, deprecated,
                             log_level_option, run)
from kvpipe.producer.bridge.specs import SpecsError, apply_options, load_specs_file, parse_group_spec
from kvpipe.schemas.groupspec import EXAMPLE, GRAMMAR, GroupSpecError, parse_groups

log = logging.getLogger("kvpipe.bridge")


@click.command("bridge", cls=Command, help=__doc__)
@click.option("--zmq", required=True, metavar="ENDPOINT", help="vLLM's PUB endpoint (rank 0), e.g. tcp://node:5557")
@click.option("--replay", metavar="ENDPOINT", help="vLLM's replay ROUTER endpoint (rank 0), e.g. tcp://node:5558")
@click.option("--node-id", required=True, metavar="NAME", help="node name; rank r becomes node '<NAME>/dp<r>'")
@click.option("--node-id-format", default="{name}/dp{rank}", show_default=True, help="node id per rank")
@click.option("--dp-ranks", type=int, default=1, metavar="N", help="data-parallel ranks on this node (port + r)")
@click.option("--dp-rank-start", type=int, default=0, metavar="R", help="first rank (multi-host data parallel)")
@click.option("--bind", is_flag=True, help="bind the SUB endpoint (vLLM connects to us)")
@click.option("--subscribe", default="", metavar="PREFIX", help="ZMQ topic prefix to subscribe to (default: all)")
@click.option("--topic", help="Kafka topic (default: settings.events_topic)")
@bootstrap_server_option(deprecated_aliases=("--bootstrap",))
@click.option("--model", help="model name carried in the envelopes")
@click.option("--specs-file", metavar="FILE", help="JSON with group_specs (+ hash_config, model)")
@click.option("--groups", metavar="SPECS",
              help=f"the node's KV cache groups: {GRAMMAR} (e.g. {EXAMPLE}); short or vLLM kind names")
@click.option("--group-spec", multiple=True, metavar="SPEC",
              help="one group as a GroupSpec JSON object (fields --groups has no syntax for); repeatable. "
                   "The older IDX:KIND:BLOCK_SIZE[:WINDOW] form is read with a deprecation warning")
@click.option("--eagle-group", multiple=True, type=int, metavar="IDX",
              help="a declared group that serves an EAGLE draft (its hit drops one block); repeatable")
@click.option("--prefix-match-unit", type=int, metavar="TOKENS",
              help="the node's explicit hash unit (vLLM --prefix-match-unit); needs a hash_config")
@click.option("--context-parallel", type=int, default=1, metavar="N",
              help="the node's prefill context parallel size (checked: vLLM allows one group only above 1)")
@click.option("--replay-timeout", type=float, default=DEFAULT_TIMEOUT_S, show_default=True, metavar="S",
              help="seconds to wait for the replay endpoint's answer")
@click.option("--silence-warn-s", type=float, default=30.0, show_default=True, metavar="S",
              help="warn when no frame arrives for S seconds after connecting or since the last one (0: never)")
@click.option("--metrics-port", type=int, metavar="P", help="serve Prometheus /metrics on this port (0: any)")
@click.option("--metrics-host", default="127.0.0.1",
              help="address of /metrics (default loopback; another address needs KVPIPE_API_TOKEN or --insecure)")
@click.option("--insecure", is_flag=True, help="allow a non-loopback --metrics-host without a token")
@click.option("--metrics-url", metavar="URL",
              help="the engine's Prometheus /metrics (e.g. http://node:8000/metrics): scraped for the load "
                   "(running, waiting requests, KV cache usage) every envelope then carries for the router")
@click.option("--metrics-every", type=float, default=1.0, show_default=True, metavar="S",
              help="scrape period of --metrics-url")
@click.option("--record", metavar="DIR", help="write raw frames to DIR/rank<r>.kvrec instead of Kafka")
@log_level_option(default="info")
@click.option("--log-every", type=float, default=10.0, show_default=True, metavar="S", help="counter log line period")
def bridge(**params: object) -> int:
    return _bridge(SimpleNamespace(**params))


def main(argv: list[str] | None = None) -> int:
    return int(run(bridge, argv, "kvpipe bridge"))


def _warn_legacy_group(item: str) -> None:
    deprecated(f"group spec {item!r} (IDX:KIND:BLOCK_SIZE[:WINDOW])",
               f"--groups {GRAMMAR}, e.g. --groups {EXAMPLE}")


def _bridge(args: SimpleNamespace) -> int:
    """The bridge, its flags as attributes (parameter names of `bridge`)."""
    configure_logging(args.log_level)
    apply_bootstrap(args.bootstrap_server)
    try:
        specs_file = load_specs_file(args.specs_file) if args.specs_file else None
        declared = list(specs_file.group_specs) if specs_file else []
        if args.groups:
            declared += parse_groups(args.groups, on_deprecated=_warn_legacy_group)
        declared += [parse_group_spec(s, on_deprecated=_warn_legacy_group) for s in args.group_spec]
    except (SpecsError, GroupSpecError) as exc:
        log.error("%s", exc)
        return 2
    if len({g.group_idx for g in declared}) != len(declared):
        log.error("group specs repeat a group_idx: %s", [g.group_idx for g in declared])
        return 2
    hash_config = specs_file.hash_config if specs_file else None
    try:
        declared, hash_config = apply_options(declared, hash_config, args.eagle_group, args.prefix_match_unit)
    except SpecsError as exc:
        log.error("%s", exc)
        return 2
    if declared:
        problem = layout_problem(declared, hash_config, context_parallel=args.context_parallel)
        if problem is not None:
            log.error("declared layout: %s; fix --groups/--group-spec/--specs-file to match the vLLM node", problem)
            return 2
    model = args.model or (specs_file.model if specs_file else None)
    config = BridgeConfig(
        zmq_endpoint=args.zmq, replay_endpoint=args.replay, name=args.node_id, dp_ranks=args.dp_ranks,
        dp_rank_start=args.dp_rank_start, node_id_format=args.node_id_format, bind=args.bind,
        topic_filter=args.subscribe.encode(), replay_timeout_s=args.replay_timeout,
        silence_warn_s=args.silence_warn_s,
    )
    if args.record:
        bridge = Bridge(config, record_dir=args.record)
    else:
        bridge = _forwarding_bridge(config, args, declared, hash_config, model)
    return _serve(bridge, args)


def _forwarding_bridge(config: BridgeConfig, args: SimpleNamespace, declared: list, hash_config, model) -> Bridge:
    # Kafka only when forwarding: `--record` must work on a machine without a broker.
    from kvpipe.producer.bridge.dlq import KafkaDeadLetters
    from kvpipe.producer.publisher import Publisher
    from kvpipe.schemas.settings import load_settings

    settings = load_settings()  # --bootstrap-server is in the environment by now (kvpipe.schemas.cliopts)
    config.max_bytes = settings.max_message_bytes
    config.publisher_queue_limit = max(1, settings.producer_queue_batches * 4 // 5)

    def publisher_factory(node_id: str, rank: int) -> Publisher:
        return Publisher(settings, node_id, model=model, dp_rank=rank, group_specs=declared or None,
                         hash_config=hash_config, topic=args.topic, source="vllm-bridge")

    return Bridge(config, publisher_factory=publisher_factory,
                  dead_letters=KafkaDeadLetters(settings.bootstrap(), settings.dlq_topic,
                                                {**settings.kafka_confluent_security(),
                                                 **librdkafka_logging(settings.log_format)}),
                  declared_specs=declared, hash_config=hash_config)


def _metrics_token(args: SimpleNamespace) -> str | None:
    """The bearer token /metrics requires ("" = none); None when the bind is refused (logged)."""
    from kvpipe.schemas.settings import SettingsError, exposure_problem, load_settings

    try:
        settings = load_settings()
        token = settings.api_token_value()
    except SettingsError as exc:
        log.error("%s", exc)
        return None
    problem = exposure_problem(args.metrics_host, bool(token), args.insecure or settings.insecure)
    if problem:
        log.error("--metrics-host: %s", problem)
        return None
    return token


def _serve(bridge: Bridge, args: SimpleNamespace) -> int:
    token = _metrics_token(args) if args.metrics_port is not None else ""
    if token is None:
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        bridge.start()
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    scraper = None
    if getattr(args, "metrics_url", None) and not args.record:
        from kvpipe.producer.bridge.engine_load import LoadScraper

        try:
            scraper = LoadScraper(args.metrics_url, [(w.rank, w.publisher.set_load) for w in bridge.workers
                                                     if w.publisher is not None], every_s=args.metrics_every).start()
        except ValueError as exc:
            log.error("%s", exc)
            bridge.stop()
            return 2
    server = None
    if args.metrics_port is not None:
        from kvpipe.producer.bridge.metrics import MetricsServer

        server = MetricsServer(args.metrics_host, args.metrics_port, bridge.metrics_registry(), token=token).start()
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, server.port)
    try:
        while not stop.wait(args.log_every):
            log.info("bridge: %s", bridge.summary())
    finally:
        log.info("stopping: flushing what was read")
        if scraper is not None:
            scraper.stop()
        bridge.stop()
        if server is not None:
            server.close()
        log.info("bridge stopped: %s", bridge.summary())
    return 0
