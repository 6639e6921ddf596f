"""`kvpipe bench route`: the token-id route path in process and over HTTP, on one workload.

In process (`kvpipe.bench.route.run`): a real `Index` of the seeded fleet, `decide.route`
per request, hashing (token ids → every hash configuration's block hashes) timed apart from the
hit search. Over HTTP: the same fleet published as envelopes to a fresh topic on the configured
broker, a real `kvpipe processor` child consuming it, and the same requests sent one at a time by
the router client (one keep-alive connection), timed at the client; the server's own hashing and
search times come back in every answer. Contract of `kvpipe.bench`: `value` is the HTTP route
rate (sequential requests/s), `baseline` the in-process rate, `ratio` their quotient.
"""
from __future__ import annotations

import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import msgspec

from kvpipe.bench import route as bench
from kvpipe.processors.router.model import RouteRequest
from kvpipe.schemas.cliopts import Command, run as run_command
from kvpipe.schemas.codec import PRODUCE_HEADERS, encode_envelope, encode_vllm_batch


def _publish(bootstrap: str, topic: str, partitions: int, envelopes: list, security: dict) -> dict[int, int]:
    """Create the topics' events topic and publish every node's envelope; end offset per partition."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap, **security})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)], operation_timeout=30).values():
        f.result(timeout=30)
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, **security})
    ends: dict[int, int] = {}

    def delivered(err, msg) -> None:
        if err is not None:
            raise RuntimeError(f"bench envelope not delivered: {err}")
        ends[msg.partition()] = max(ends.get(msg.partition(), 0), msg.offset() + 1)

    now = time.time()
    for env, events in envelopes:
        env = msgspec.structs.replace(env, ts=now, sent_ts=now, num_events=len(events),
                                      batch=msgspec.Raw(encode_vllm_batch(events, now)))
        producer.produce(topic, key=env.node_id.encode(), value=encode_envelope(env), headers=PRODUCE_HEADERS,
                         on_delivery=delivered)
        producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("bench envelopes still queued after 60 s")
    return ends


def _delete(bootstrap: str, names: list[str], security: dict) -> None:
    from confluent_kafka.admin import AdminClient

    for f in AdminClient({"bootstrap.servers": bootstrap, **security}).delete_topics(names, operation_timeout=30).values():
        try:
            f.result(timeout=30)
        except Exception:  # cleanup only
            pass


def _over_http(args: SimpleNamespace) -> dict[str, Any]:
    from kvpipe.bench.ingest import _security_env
    from kvpipe.bench.procrun import ProcessorProcess, free_port
    from kvpipe.processors.router.client import RouterClient
    from kvpipe.schemas.settings import load_settings

    settings = load_settings()
    bootstrap, security = settings.bootstrap(), settings.kafka_confluent_security()
    rng = random.Random(args.seed)
    envelopes, docs = bench.fleet(args.nodes, args.documents, args.prompt_tokens, args.per_node, args.configs, rng,
                                 args.windows)
    requests = bench.prompts(docs, args.requests + args.warmup, random.Random(args.seed + 1))
    tag = uuid.uuid4().hex[:8]
    topic, dlq, snaps = f"bench-route-{tag}", f"bench-route-dlq-{tag}", f"bench-route-snap-{tag}"
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-bench-route-"))
    proc = None
    try:
        ends = _publish(bootstrap, topic, args.partitions, envelopes, security)
        proc = ProcessorProcess({**_security_env(), "KVPIPE_KAFKA_BOOTSTRAP": bootstrap, "KVPIPE_EVENTS_TOPIC": topic,
                                 "KVPIPE_DLQ_TOPIC": dlq, "KVPIPE_SNAPSHOT_TOPIC": snaps,
                                 "KVPIPE_PARTITIONS": str(args.partitions), "KVPIPE_PROCESSOR_ID": f"bench-{tag}",
                                 "KVPIPE_WEB_PORT": str(free_port()), "KVPIPE_STATE_DIR": str(tmp / "state"),
                                 "KVPIPE_SNAPSHOT_EVERY_S": "3600", "KVPIPE_NODE_TTL_S": "3600",
                                 "KVPIPE_ROUTE_STALE_AFTER_S": "3600"}, tmp / "processor.log")
        proc.start()
        proc.wait_offsets({p: ends.get(p, 0) for p in range(args.partitions)}, timeout=300)
        wall, hashing, search, hits, decision, floor = [], [], [], [], [], []
        with RouterClient(proc.url, token=settings.api_token_value() or None, timeout_s=30.0) as client:
            for i, tokens in enumerate(requests):
                t = time.perf_counter()
                answer = client.route(RouteRequest(token_ids=tokens))
                elapsed = time.perf_counter() - t
                if i < args.warmup:
                    continue
                wall.append(elapsed)
                hashing.append(answer.hashing_s)
                search.append(answer.search_s)
                best = answer.nodes[0] if answer.nodes else None
                hits.append(best.gpu_tokens + best.loadable_tokens if best else 0)
            # the decision alone (top_k 1), and the floor: the same connection's round trip to /health
            for tokens in requests[args.warmup:]:
                t = time.perf_counter()
                client.route(RouteRequest(token_ids=tokens, top_k=1))
                decision.append(time.perf_counter() - t)
            for _ in requests[args.warmup:]:
                t = time.perf_counter()
                client.health()
                floor.append(time.perf_counter() - t)
    finally:
        if proc is not None:
            proc.stop()
        if not args.keep_topics:
            _delete(bootstrap, [topic, dlq, snaps], security)
    return {"requests": args.requests, "route_wall": bench.summary(wall),
            "decision_top_k_1_wall": bench.summary(decision), "health_wall": bench.summary(floor),
            "server_hashing": bench.summary(hashing),
            "server_search": bench.summary(search), "mean_best_hit_tokens": round(statistics.fmean(hits), 1),
            "routes_per_s": round(len(wall) / sum(wall), 1)}


@click.command("route", cls=Command, help=__doc__.split("\n\n")[0])
@click.option("--nodes", type=int, default=256, show_default=True, help="serving nodes of the fleet")
@click.option("--requests", type=int, default=300, show_default=True, help="timed route requests")
@click.option("--warmup", type=int, default=20, show_default=True, help="HTTP requests sent before timing")
@click.option("--documents", type=int, default=64, show_default=True, help="shared prompts the nodes cache parts of")
@click.option("--prompt-tokens", type=int, default=2048, show_default=True, help="tokens of each document")
@click.option("--per-node", type=int, default=8, show_default=True, help="documents each node caches")
@click.option("--configs", type=click.IntRange(1, 2), default=1, show_default=True,
              help="distinct hash configurations")
@click.option("--windows", type=click.IntRange(1, 2), default=1, show_default=True,
              help="sliding-window groups beside full attention (2: the three-group HMA layout)")
@click.option("--partitions", type=int, default=4, show_default=True, help="partitions of the events topic")
@click.option("--seed", type=int, default=0, show_default=True, help="workload seed")
@click.option("--no-dynamo", is_flag=True,
              help="skip Dynamo's RadixTree baseline even when ai-dynamo-runtime is installed")
@click.option("--in-process-only", is_flag=True, help="skip the HTTP part (no broker needed)")
@click.option("--keep-topics", is_flag=True, help="leave the bench topics on the broker")
@click.option("--snapshots", is_flag=True,
              help="also time one partition's snapshot export and import per store (native and Python paths)")
def route_bench(**params: Any) -> dict[str, Any]:
    args = SimpleNamespace(**params)
    local = bench.run(nodes=args.nodes, requests=args.requests, documents=args.documents,
                      prompt_tokens=args.prompt_tokens, per_node=args.per_node, configs=args.configs, seed=args.seed,
                      dynamo=not args.no_dynamo, windows=args.windows, snapshots=args.snapshots)
    local_rate = 1e6 / local["route_total"]["mean_us"]
    out: dict[str, Any] = {"bench": "route", "unit": "routes/s (sequential, token ids)",
                           "baseline": round(local_rate, 1), "in_process": local}
    if args.in_process_only:
        return {**out, "value": round(local_rate, 1), "ratio": 1.0}
    http = _over_http(args)
    return {**out, "value": http["routes_per_s"], "ratio": round(http["routes_per_s"] / local_rate, 4), "http": http}


def run(argv: list[str]) -> dict[str, Any] | int:
    """`kvpipe bench route`: the result, or an exit code after help or a usage error."""
    return run_command(route_bench, argv, "kvpipe bench route")
