"""`kvpipe node` against the real broker: what a consumer of the node's topic reads back."""
from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from kvpipe.gpu.node.cli import main as node_main
from kvpipe.schemas.codec import decode_envelope, envelope_events
from kvpipe.schemas.events import BlockRemoved, BlockStored

pytestmark = pytest.mark.integration


def read_all(bootstrap: str, topic: str, count: int, timeout: float = 30.0) -> list:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{topic}", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    out = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                out.append(decode_envelope(msg.value()))
    finally:
        consumer.close()
    return out


def test_node_run_publishes_contiguous_epochs_with_specs_and_a_restart(kafka_bootstrap, unique_topic, capsys,
                                                                      monkeypatch) -> None:
    monkeypatch.setenv("KVPIPE_KAFKA_BOOTSTRAP", kafka_bootstrap)
    topic = unique_topic("node-publish")
    rc = node_main(["--node-id", "it-node", "--topic", topic, "--steps", "80", "--restart-at", "40",
                    "--gpu-blocks", "128", "--cpu-chunks", "64", "--layers", "1", "--summary-json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pub = summary["publisher"]
    assert pub["failed"] == 0 and pub["dropped"] == 0
    envs = read_all(kafka_bootstrap, topic, pub["sent"])
    assert len(envs) == pub["sent"]

    epochs: dict[int, list] = {}
    for env in envs:
        assert env.node_id == "it-node"
        epochs.setdefault(env.epoch, []).append(env)
    assert len(epochs) == 2, f"expected two epochs (restart at step 40), got {sorted(epochs)}"
    first, second = sorted(epochs)
    assert second > first
    assert [e.epoch for e in envs] == sorted(e.epoch for e in envs), "the restarted epoch comes after the old one"
    by_type: Counter = Counter()
    by_medium: Counter = Counter()
    for epoch, batch in epochs.items():
        assert [e.seq for e in batch] == list(range(len(batch))), f"epoch {epoch}: seq not contiguous from 0"
        head = batch[0]
        assert head.group_specs and [g.kind for g in head.group_specs] == ["full_attention", "sliding_window", "mamba"]
        assert head.hash_config is not None and head.hash_config.algorithm == "sha256"
        for env in batch:
            events = envelope_events(env)
            assert len(events) == env.num_events
            for ev in events:
                by_type[type(ev).__name__] += 1
                if isinstance(ev, (BlockStored, BlockRemoved)):
                    assert ev.group_idx in (0, 1, 2)
                    by_medium[ev.medium] += 1
    assert dict(by_type) == summary["events"]["by_type"]
    assert dict(by_medium) == summary["events"]["by_medium"]
    assert by_medium["GPU"] > 0 and by_medium["CPU"] > 0
    # every envelope carries the node's load as the router's score reads it (its scheduler's queues,
    # its KV pool usage), and it moves as the node works
    assert all(e.running is not None and e.waiting is not None and 0.0 <= e.kv_usage <= 1.0 for e in envs)
    assert max(e.running for e in envs) > 0 and len({e.kv_usage for e in envs}) > 1
