"""The bridge against real ZMQ sockets (a vLLM-like publisher) and the real Kafka broker.

Each test plays one scenario of a vLLM node's stream and reads back what a consumer of the
events topic (and of the DLQ topic) sees.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.producer.bridge.dlq import HEADER_REASON, decode_frames
from kvpipe.producer.bridge.recording import read_recording
from kvpipe.producer.bridge.runner import Bridge, BridgeConfig
from kvpipe.bench.testing_publisher import CacheSim, TestingPublisher, free_port_range
from kvpipe.schemas.codec import decode_vllm_batch
from kvpipe.schemas.envelope import Envelope
from tests.integration.bridge_helpers import GROUPS, Node, batches_on, consume, publish_steps, running_bridge

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def topics(unique_topic):
    return unique_topic("bridge-events"), unique_topic("bridge-dlq")


@pytest.fixture
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.close()


def test_normal_flow_forwards_every_batch_byte_identical_in_order(kafka_bootstrap, topics, node):
    topic, dlq = topics
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=1, full_fields=True)
    with running_bridge(kafka_bootstrap, topic, dlq, node) as bridge:
        sent = publish_steps(pub, sim, 20)
        envs = batches_on(kafka_bootstrap, topic, 20)
    assert [e.upstream_seq for e in envs] == list(range(20))
    assert [e.seq for e in envs] == list(range(20)) and len({e.epoch for e in envs}) == 1
    assert [bytes(e.batch) for e in envs] == sent
    assert all(e.node_id == "vllm-a/dp0" and e.source == "vllm-bridge" and e.layout == "map" and e.lost_batches == 0
               for e in envs)
    assert envs[0].group_specs == GROUPS
    assert bridge.counters()["vllm-a/dp0"]["batches"] == 20


def test_legacy_array_layout_is_forwarded_and_labelled(kafka_bootstrap, topics, node):
    topic, dlq = topics
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=2, int_hashes=False)
    with running_bridge(kafka_bootstrap, topic, dlq, node):
        sent = publish_steps(pub, sim, 5, layout="array")
        envs = batches_on(kafka_bootstrap, topic, 5)
    assert [bytes(e.batch) for e in envs] == sent and {e.layout for e in envs} == {"array"}
    assert decode_vllm_batch(sent[0])[1] == "array"


def test_batches_dropped_on_the_live_path_come_back_from_the_replay_ring_in_order(kafka_bootstrap, topics, node):
    topic, dlq = topics
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=3)
    pub.drop(2, 3, 4, 9)
    with running_bridge(kafka_bootstrap, topic, dlq, node) as bridge:
        sent = publish_steps(pub, sim, 12)
        envs = batches_on(kafka_bootstrap, topic, 12)
    assert [e.upstream_seq for e in envs] == list(range(12))
    assert [bytes(e.batch) for e in envs] == sent
    assert all(e.lost_batches == 0 for e in envs)
    c = bridge.counters()["vllm-a/dp0"]
    assert (c["gaps"], c["replayed"], c["lost"]) == (2, 4, 0)


def test_pre_026_replay_frames_without_topic_are_understood(kafka_bootstrap, topics):
    topic, dlq = topics
    node = Node(legacy_replay=True, topic="kv@pod@model")
    try:
        node.ranks[0].drop(1)
        with running_bridge(kafka_bootstrap, topic, dlq, node):
            publish_steps(node.ranks[0], CacheSim(GROUPS), 3)
            envs = batches_on(kafka_bootstrap, topic, 3)
    finally:
        node.close()
    assert [(e.upstream_seq, e.lost_batches) for e in envs] == [(0, 0), (1, 0), (2, 0)]


def test_a_gap_older_than_the_ring_is_reported_as_lost_batches(kafka_bootstrap, topics):
    topic, dlq = topics
    node = Node(buffer_steps=3)
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=4)
    try:
        with running_bridge(kafka_bootstrap, topic, dlq, node) as bridge:
            pub.drop(*range(1, 7))
            publish_steps(pub, sim, 7)  # 0 live; 1..6 only in the ring, which keeps 4, 5, 6
            publish_steps(pub, sim, 1)  # 7 live: the bridge asks for 1..6
            envs = batches_on(kafka_bootstrap, topic, 4)
    finally:
        node.close()
    assert [(e.upstream_seq, e.lost_batches) for e in envs] == [(0, 0), (5, 4), (6, 0), (7, 0)]
    assert bridge.counters()["vllm-a/dp0"]["lost"] == 4


def test_a_replay_that_never_answers_times_out_counts_the_gap_lost_and_goes_on(kafka_bootstrap, topics, node):
    topic, dlq = topics
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=5)
    pub.replay_mute = True
    pub.drop(1)
    with running_bridge(kafka_bootstrap, topic, dlq, node, replay_timeout_s=0.3) as bridge:
        publish_steps(pub, sim, 4)
        envs = batches_on(kafka_bootstrap, topic, 3)
    assert [(e.upstream_seq, e.lost_batches) for e in envs] == [(0, 0), (2, 1), (3, 0)]
    assert bridge.counters()["vllm-a/dp0"]["replay_timeouts"] == 1


def test_a_publisher_restart_starts_a_new_epoch(kafka_bootstrap, topics, node):
    topic, dlq = topics
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=6)
    with running_bridge(kafka_bootstrap, topic, dlq, node) as bridge:
        publish_steps(pub, sim, 4)
        pub.restart()
        publish_steps(pub, sim, 3)
        envs = batches_on(kafka_bootstrap, topic, 7)
    first, second = envs[0].epoch, envs[4].epoch
    assert second > first
    assert [(e.epoch, e.seq, e.upstream_seq) for e in envs] == (
        [(first, i, i) for i in range(4)] + [(second, i, i) for i in range(3)])
    assert envs[4].group_specs == GROUPS  # specs travel again on seq 0 of the new epoch
    assert bridge.counters()["vllm-a/dp0"]["restarts"] == 1


def restarted(node: Node, timeout: float = 10.0) -> TestingPublisher:
    """A new publisher on the old node's ports (ZMQ releases a closed listener asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return TestingPublisher(f"tcp://*:{node.pub_port}", f"tcp://*:{node.replay_port}")
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_a_new_publisher_process_that_got_ahead_before_we_reconnected_is_a_new_epoch(kafka_bootstrap, topics, node):
    topic, dlq = topics
    with running_bridge(kafka_bootstrap, topic, dlq, node) as bridge:
        publish_steps(node.ranks[0], CacheSim(GROUPS, seed=11), 3)
        batches_on(kafka_bootstrap, topic, 3)
        node.ranks[0].close()  # vLLM dies …
        node.ranks[0] = restarted(node)
        pub, sim = node.ranks[0], CacheSim(GROUPS, seed=12)
        early = publish_steps(pub, sim, 5)  # … and its successor publishes 0..4 before we are back
        pub.wait_for_subscriber()
        late = publish_steps(pub, sim, 1)  # seq 5: past what we expect (3), so only the reconnect tells
        envs = batches_on(kafka_bootstrap, topic, 9)
    assert bridge.counters()["vllm-a/dp0"]["restarts"] == 1
    new = envs[3:]
    assert len({e.epoch for e in new}) == 1 and new[0].epoch > envs[0].epoch
    assert [(e.seq, e.upstream_seq, e.lost_batches) for e in new] == [(i, i, 0) for i in range(6)]
    assert [bytes(e.batch) for e in new] == early + late


def test_malformed_messages_go_to_the_dlq_with_a_reason_while_good_ones_flow(kafka_bootstrap, topics, node):
    topic, dlq = topics
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=7)
    with running_bridge(kafka_bootstrap, topic, dlq, node) as bridge:
        publish_steps(pub, sim, 2)
        pub.send_frames([b"just one frame"])
        pub.send_frames([b"", (2).to_bytes(8, "big")])
        pub.publish_payload(b"\xc1 not msgpack")  # seq 2, undecodable
        publish_steps(pub, sim, 2)  # seqs 3, 4
        envs = batches_on(kafka_bootstrap, topic, 4)
        letters = consume(kafka_bootstrap, dlq, 3)
    assert [(e.upstream_seq, e.lost_batches) for e in envs] == [(0, 0), (1, 0), (3, 1), (4, 0)]
    reasons = [dict(m.headers())[HEADER_REASON].decode() for m in letters]
    assert [r.split(":")[0] for r in reasons] == ["malformed_frames", "malformed_frames", "undecodable_payload"]
    assert "not_msgpack" in reasons[2]
    assert decode_frames(letters[0].value()) == [b"just one frame"]
    assert decode_frames(letters[2].value())[2] == b"\xc1 not msgpack"
    c = bridge.counters()["vllm-a/dp0"]
    assert (c["malformed"], c["dlq"], c["lost"]) == (3, 3, 1)


def test_each_data_parallel_rank_is_a_node_of_its_own(kafka_bootstrap, unique_topic):
    topic, dlq = unique_topic("bridge-dp", partitions=2), unique_topic("bridge-dlq")
    node = Node(ranks=2)
    try:
        with running_bridge(kafka_bootstrap, topic, dlq, node):
            for rank, pub in enumerate(node.ranks):
                publish_steps(pub, CacheSim(GROUPS, seed=10 + rank), 3 + rank)
            envs = batches_on(kafka_bootstrap, topic, 7, partitions=2)
    finally:
        node.close()
    by_node: dict[str, list[Envelope]] = {}
    for e in envs:
        by_node.setdefault(e.node_id, []).append(e)
    assert sorted(by_node) == ["vllm-a/dp0", "vllm-a/dp1"]
    for rank in (0, 1):
        got = by_node[f"vllm-a/dp{rank}"]
        assert [e.upstream_seq for e in got] == list(range(3 + rank))
        assert {e.dp_rank for e in got} == {rank}
        assert {decode_vllm_batch(bytes(e.batch))[0].data_parallel_rank for e in got} == {rank}


def test_record_writes_raw_frames_that_inspect_decodes(tmp_path, node):
    pub, sim = node.ranks[0], CacheSim(GROUPS, seed=8)
    bridge = Bridge(BridgeConfig(zmq_endpoint=node.zmq, name="rec"), record_dir=str(tmp_path)).start()
    try:
        pub.wait_for_subscriber()
        sent = publish_steps(pub, sim, 3)
        pub.send_frames([b"bad"])
        deadline = time.monotonic() + 5
        while bridge.counters()["rec/dp0"]["recorded"] < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        bridge.stop()
    recorded = list(read_recording(tmp_path))
    assert [(seq, payload) for _, seq, payload, _ in recorded] == list(enumerate(sent))
    out = subprocess.run([sys.executable, "-m", "kvpipe", "inspect", str(tmp_path)], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    assert [(line["zmq"]["seq"], line["layout"]) for line in lines] == [(0, "map"), (1, "map"), (2, "map")]
    assert lines[0]["events"][0]["type"] in ("BlockStored", "BlockRemoved")


def test_the_cli_forwards_serves_metrics_and_flushes_on_sigterm(kafka_bootstrap, topics, node, tmp_path):
    topic, dlq = topics
    specs = tmp_path / "specs.json"
    specs.write_text(json.dumps({"group_specs": [{"group_idx": 0, "kind": "full_attention", "block_size": 16},
                                                 {"group_idx": 1, "kind": "sliding_window", "block_size": 16,
                                                  "sliding_window": 128}], "model": "m"}))
    port = free_port_range(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    env.update(KVPIPE_KAFKA_BOOTSTRAP=kafka_bootstrap, KVPIPE_DLQ_TOPIC=dlq, KVPIPE_HEARTBEAT_S="600")
    proc = subprocess.Popen([sys.executable, "-m", "kvpipe", "bridge", "--zmq", node.zmq, "--replay", node.replay,
                             "--node-id", "cli", "--topic", topic, "--specs-file", str(specs),
                             "--metrics-port", str(port)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        pub = node.ranks[0]
        pub.wait_for_subscriber(30)
        pub.drop(2)
        sent = publish_steps(pub, CacheSim(GROUPS, seed=9), 5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            if 'kvpipe_bridge_batches_total{node="cli/dp0"} 5' in text:
                break
            time.sleep(0.1)
        assert 'kvpipe_bridge_replayed_batches_total{node="cli/dp0"} 1' in text
        # group 1 declared with a 128-token window; the node's events say 64
        mismatches = [s.labels for f in text_string_to_metric_families(text) if f.name == "kvpipe_bridge_spec_mismatch"
                      for s in f.samples]
        assert {"node": "cli/dp0", "group": "1", "field": "sliding_window", "declared": "128",
                "observed": "64"} in mismatches
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out.decode()[-2000:]
    assert b"ERROR" in out and b"sliding_window declared 128" in out
    envs = batches_on(kafka_bootstrap, topic, 5)
    assert [bytes(e.batch) for e in envs] == sent
    # the first batch revealed the mismatch before it was queued: seq 0 already carries the fix
    assert envs[0].model == "m" and envs[0].group_specs[1].sliding_window == 64
