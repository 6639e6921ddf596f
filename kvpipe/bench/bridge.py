"""`kvpipe bench bridge`: how fast the bridge moves vLLM batches from ZMQ into Kafka.

Both numbers come from the same run, the same pre-encoded payloads and the same vLLM-like
publisher (`TestingPublisher`, in its own process, as vLLM's publisher is):
- baseline: the raw publish rate — N batches from the publisher to a bare SUB socket that only
  counts them (ZMQ transport plus the publisher's own queue and thread);
- value: N batches from the publisher through the bridge (frame checks, decode, spec checks,
  Publisher) until Kafka has acknowledged all N envelopes (delivery reports).
ratio = value / baseline (1.0 = the bridge keeps up with a publisher running flat out).
"""
from __future__ import annotations

import multiprocessing
import time
import uuid
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

import click
import zmq

from kvpipe.bench.testing_publisher import CacheSim, TestingPublisher
from kvpipe.schemas.cliopts import Command, run as run_command
from kvpipe.schemas.codec import encode_vllm_batch
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.settings import load_settings

GROUPS = [GroupSpec(0, "full_attention", 16), GroupSpec(1, "sliding_window", 16, sliding_window=1024)]


def _publisher_process(conn: Connection, n: int, stores: int, seed: int) -> None:
    """Child: pre-encode n steps, then publish them as fast as the publisher goes, per 'go'."""
    sim = CacheSim(GROUPS, seed=seed)
    steps = [sim.step(stores=stores, removes=1) for _ in range(n)]
    payloads = [encode_vllm_batch(events, time.time(), 0) for events in steps]
    events = sum(len(s) for s in steps)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            return
        pub = TestingPublisher("tcp://*:0", "tcp://*:0", hwm=n + 16)
        conn.send((pub.endpoint, pub.replay_endpoint, events, sum(map(len, payloads))))
        pub.wait_for_subscriber(60)
        conn.send("ready")
        conn.recv()  # go
        t0 = time.perf_counter()
        for p in payloads:
            pub.publish_payload(p)
        pub.wait_sent(300)
        conn.send(time.perf_counter() - t0)
        conn.recv()  # done
        pub.close()


def _raw(conn: Connection, n: int) -> dict:
    conn.send("serve")
    endpoint, _, events, nbytes = conn.recv()
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, n + 16)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    conn.recv()  # ready
    got = 0
    conn.send("go")
    t0 = time.perf_counter()
    while got < n and sub.poll(10_000):
        sub.recv_multipart()
        got += 1
    elapsed = time.perf_counter() - t0
    send_s = conn.recv()
    conn.send("done")
    sub.close(linger=0)
    return {"received": got, "seconds": elapsed, "publisher_send_s": send_s, "events": events, "bytes": nbytes}


def _bridged(conn: Connection, n: int, bootstrap: str | None, topic: str) -> dict:
    from kvpipe.producer.bridge.dlq import KafkaDeadLetters
    from kvpipe.producer.bridge.runner import Bridge, BridgeConfig
    from kvpipe.producer.publisher import Publisher

    settings = load_settings(overrides={"kafka_bootstrap": bootstrap, "heartbeat_s": 3600.0})
    conn.send("serve")
    endpoint, replay, events, nbytes = conn.recv()
    publishers: list[Publisher] = []

    def factory(node_id: str, rank: int) -> Publisher:
        publishers.append(Publisher(settings, node_id, dp_rank=rank, group_specs=GROUPS, topic=topic,
                                    source="vllm-bridge"))
        return publishers[-1]

    config = BridgeConfig(zmq_endpoint=endpoint, replay_endpoint=replay, name="bench",
                          publisher_queue_limit=max(1, settings.producer_queue_batches * 4 // 5))
    bridge = Bridge(config, publisher_factory=factory, dead_letters=KafkaDeadLetters(settings.bootstrap(), topic + "-dlq",
                                                                                   settings.kafka_confluent_security()),
                    declared_specs=GROUPS).start()
    try:
        conn.recv()  # ready
        conn.send("go")
        t0 = time.perf_counter()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            c = publishers[0].counters() if publishers else {}
            if c and c["delivered"] + c["failed"] + c["dropped_batches"] >= n:
                break
            time.sleep(0.002)
        elapsed = time.perf_counter() - t0
        send_s = conn.recv()
        conn.send("done")
    finally:
        bridge.stop()
    return {"seconds": elapsed, "publisher_send_s": send_s, "events": events, "bytes": nbytes,
            "bridge": bridge.counters()["bench/dp0"], "publisher": publishers[0].counters()}


@click.command("bridge", cls=Command, help=__doc__)
@click.option("--batches", type=int, default=20_000, show_default=True, help="vLLM batches sent by each side")
@click.option("--stores", type=int, default=4, show_default=True, help="blocks stored per group per step")
@click.option("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap (default: --bootstrap-server, the settings)")
def bridge_bench(**params: Any) -> dict:
    args = SimpleNamespace(**params)

    from confluent_kafka.admin import AdminClient, NewTopic

    settings = load_settings(overrides={"kafka_bootstrap": args.bootstrap})
    admin = AdminClient(settings.kafka_confluent_config())
    topic = f"bench-bridge-{uuid.uuid4().hex[:10]}"
    for f in admin.create_topics([NewTopic(topic, 1, 1), NewTopic(topic + "-dlq", 1, 1)]).values():
        f.result(30)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_publisher_process, args=(child, args.batches, args.stores, 1), daemon=True)
    proc.start()
    try:
        raw = _raw(parent, args.batches)
        bridged = _bridged(parent, args.batches, args.bootstrap, topic)
        parent.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        for f in admin.delete_topics([topic, topic + "-dlq"]).values():
            try:
                f.result(30)
            except Exception:  # a leftover bench topic is harmless
                pass
    n = args.batches
    raw_rate = raw["received"] / raw["seconds"]
    rate = bridged["publisher"]["delivered"] / bridged["seconds"]
    return {
        "bench": "bridge", "value": round(rate, 1), "unit": "batches/s", "baseline": round(raw_rate, 1),
        "ratio": round(rate / raw_rate, 3), "events_per_s": round(bridged["events"] / bridged["seconds"], 1),
        "raw_events_per_s": round(raw["events"] / raw["seconds"], 1),
        "batches": n, "events_per_batch": round(bridged["events"] / n, 2), "payload_bytes_avg": round(bridged["bytes"] / n, 1),
        "raw_received": raw["received"], "delivered": bridged["publisher"]["delivered"],
        "bridge_lost": bridged["bridge"]["lost"], "bridge_replayed": bridged["bridge"]["replayed"],
        "publish_rejected": bridged["bridge"]["publish_rejected"],
        "bridge_seconds": round(bridged["seconds"], 3), "raw_seconds": round(raw["seconds"], 3),
    }


def run(argv: list[str]) -> dict | int:
    """`kvpipe bench bridge`: the result, or an exit code after help or a usage error."""
    return run_command(bridge_bench, argv, "kvpipe bench bridge")
