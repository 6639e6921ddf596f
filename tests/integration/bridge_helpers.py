"""Shared pieces of the bridge integration tests: a vLLM-like node on free ports, a running
bridge with the real Publisher, and readers for what lands in Kafka."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from tests.integration.kafka_reading import consume

from kvpipe.producer.bridge.dlq import KafkaDeadLetters
from kvpipe.producer.bridge.runner import Bridge, BridgeConfig
from kvpipe.bench.testing_publisher import CacheSim, TestingPublisher, free_port_range
from kvpipe.producer.publisher import Publisher
from kvpipe.schemas.codec import decode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import Envelope, GroupSpec
from kvpipe.schemas.settings import load_settings

GROUPS = [GroupSpec(0, "full_attention", 16), GroupSpec(1, "sliding_window", 16, sliding_window=64)]


def batches_on(bootstrap: str, topic: str, count: int, partitions: int = 1) -> list[Envelope]:
    """The first `count` non-heartbeat envelopes (heartbeats are disabled in these tests anyway)."""
    envs = [decode_envelope(m.value()) for m in consume(bootstrap, topic, count, partitions)]
    envs = [e for e in envs if not e.is_heartbeat]
    assert len(envs) == count, f"expected {count} batch envelopes on {topic}, got {len(envs)}"
    return envs


class Node:
    """A vLLM-like node (one publisher per DP rank) on free loopback ports."""

    def __init__(self, ranks: int = 1, **kw: object) -> None:
        # one range for both sockets: two separate picks could hand out the same port twice
        self.pub_port = free_port_range(2 * ranks)
        self.replay_port = self.pub_port + ranks
        self.ranks = [TestingPublisher(f"tcp://*:{self.pub_port}", f"tcp://*:{self.replay_port}", dp_rank=r, **kw)
                      for r in range(ranks)]

    @property
    def zmq(self) -> str:
        return f"tcp://127.0.0.1:{self.pub_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def close(self) -> None:
        for p in self.ranks:
            p.close()


@contextmanager
def running_bridge(bootstrap: str, topic: str, dlq: str, node: Node, *, name: str = "vllm-a",
                   replay: bool = True, replay_timeout_s: float = 2.0, groups=GROUPS) -> Iterator[Bridge]:
    settings = load_settings(overrides={"kafka_bootstrap": bootstrap, "heartbeat_s": 600.0})
    config = BridgeConfig(zmq_endpoint=node.zmq, replay_endpoint=node.replay if replay else None, name=name,
                          dp_ranks=len(node.ranks), replay_timeout_s=replay_timeout_s)

    def factory(node_id: str, rank: int) -> Publisher:
        return Publisher(settings, node_id, dp_rank=rank, group_specs=groups, topic=topic, source="vllm-bridge")

    bridge = Bridge(config, publisher_factory=factory, dead_letters=KafkaDeadLetters(bootstrap, dlq),
                    declared_specs=groups).start()
    try:
        for p in node.ranks:
            p.wait_for_subscriber()
        yield bridge
    finally:
        bridge.stop()


def publish_steps(pub: TestingPublisher, sim: CacheSim, n: int, layout: str = "map") -> list[bytes]:
    """n steps of `sim` as vLLM would encode them; returns the payloads sent."""
    payloads = [encode_vllm_batch(sim.step(), time.time(), pub.dp_rank, layout) for _ in range(n)]
    for p in payloads:
        pub.publish_payload(p)
    pub.wait_sent()
    return payloads
