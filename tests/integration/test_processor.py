"""The processor end to end: real broker, `kvpipe processor` as a child process, HTTP API.

One processor serves the whole module (tests run in file order and read as one session): it
learns the published scenario, then bad input, then is stopped and restarted (restore from the
shutdown snapshot), then gets more events, is SIGKILLed and restarted (restore + replay of the
tail), and its index must come back equal each time — and equal to a second processor that
rebuilds everything from offset 0. Periodic snapshots are off (1 h) so the test knows exactly
which snapshot a restart finds.
"""
from __future__ import annotations

import random
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from kvpipe.bench.procrun import ProcessorProcess, free_port
from tests.integration.processor_fixture import HeldBlocks, ProcessorTopics
from kvpipe.producer.publisher import Publisher
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import HEADER_VERSION, SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored
from kvpipe.schemas.settings import load_settings

pytestmark = pytest.mark.integration

PARTITIONS = 3
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
FA_ONLY = [SPECS[0]]  # the hand-made envelopes' nodes: one full-attention group


class Session:
    """Topics, the processor, and what the test itself expects the index to hold."""

    def __init__(self, bootstrap: str, tmp: Path) -> None:
        self.bootstrap, self.tmp = bootstrap, tmp
        self.topics = ProcessorTopics(bootstrap, "proc", PARTITIONS)
        self.events, self.dlq, self.snapshots = self.topics.events, self.topics.dlq, self.topics.snapshots
        self.env = self.topics.env(f"kvpipe-test-{self.topics.tag}", free_port(), str(tmp / "state"),
                                   KVPIPE_SNAPSHOT_EVERY_S="3600", KVPIPE_NODE_TTL_S="3600",
                                   KVPIPE_ROUTE_STALE_AFTER_S="3600")
        self.processor = ProcessorProcess(self.env, tmp / "processor.log").start()
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.model = HeldBlocks()

    # -- publishing ------------------------------------------------------------------------------

    def publisher(self, node_id: str, epoch: int = 1) -> Publisher:
        settings = load_settings(overrides={"kafka_bootstrap": self.bootstrap, "events_topic": self.events,
                                            "heartbeat_s": 3600.0})
        return Publisher(settings, node_id, group_specs=SPECS, epoch=epoch, model="test-model")

    def raw(self, node: str, seq: int, events: list, epoch: int = 1, headers=KAFKA_HEADERS, **kw) -> None:
        """One hand-made envelope (for what a well-behaved publisher never sends: gaps, duplicates)."""
        ts = time.time()
        kw.setdefault("group_specs", FA_ONLY)
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=ts, sent_ts=ts, num_events=len(events),
                       batch=msgspec.Raw(encode_vllm_batch(events, ts)) if events else msgspec.Raw(), **kw)
        self.producer.produce(self.events, key=node.encode(), value=encode_envelope(env), headers=headers)

    def end_offsets(self) -> dict[int, int]:
        self.producer.flush(30)
        return self.topics.end_offsets()

    def close(self) -> None:
        self.processor.stop()
        self.topics.delete()


@pytest.fixture(scope="module")
def session(kafka_bootstrap: str, tmp_path_factory) -> Session:
    s = Session(kafka_bootstrap, tmp_path_factory.mktemp("processor"))
    yield s
    s.close()


def stored(hashes, group=0, medium="GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def removed(hashes, group=0, medium="GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


def chain(family: int, length: int = 12) -> list[int]:
    return [family * 1000 + i for i in range(length)]


def got_route(answer: dict) -> list[tuple[str, int, int]]:
    return [(row["node_id"], row["gpu_tokens"], row["loadable_tokens"]) for row in answer["nodes"]]


def route(proc: ProcessorProcess, hashes: list[int], groups=("0", "1"), **fields) -> dict:
    """The same list for `groups` (a group left out borrows a named one's list at its block size),
    `num_tokens` one past the list's tokens so the hit may cover it all."""
    return proc.route({g: hashes for g in groups}, num_tokens=len(hashes) * 16 + 1, **fields)


def raw_specs(nodes) -> dict:
    return {n: FA_ONLY for n in nodes}


PROBES = [chain(f) for f in range(6)] + [chain(f)[:3] for f in range(6)]


def test_published_steps_give_the_index_and_routes_the_test_computes(session: Session):
    rng = random.Random(7)
    publishers = [session.publisher(f"node-{i}") for i in range(4)]
    for step in range(60):
        pub = rng.choice(publishers)
        fam = rng.randrange(6)
        n = rng.randrange(1, 13)
        events = [stored(chain(fam)[:n], group=0), stored(chain(fam)[:n], group=1)]
        if rng.random() < 0.3:  # the same prefix computed twice: refcount 2
            events.append(stored(chain(fam)[:n], group=0))
        if rng.random() < 0.2:
            events.append(stored(chain(fam)[:rng.randrange(1, 13)], medium="CPU"))
        if rng.random() < 0.4:  # sliding window: early blocks freed and evicted, FA keeps them
            events += [removed([h], group=1) for h in chain(fam)[: rng.randrange(1, 6)]]
        if rng.random() < 0.3:
            events.append(removed([rng.choice(chain(fam))], group=0))
        assert pub.publish(events)
        session.model.apply(pub.node_id, events)
    for pub in publishers:
        pub.close()
    stats = session.processor.wait_offsets(session.end_offsets())
    assert stats["counters"]["dlq"] == 0
    for hashes in PROBES:
        expected = session.model.expected_route(hashes, SPECS)
        answer = route(session.processor, hashes)
        assert got_route(answer) == expected, hashes
        assert answer["chosen"] == (expected[0][0] if expected else answer["chosen"])
        assert got_route(route(session.processor, hashes, groups=("0",))) == expected, "group 1 borrows group 0's list"
    nodes = {n["node_id"]: n for n in session.processor.get("/nodes")["nodes"]}
    assert set(nodes) == {f"node-{i}" for i in range(4)}
    assert all(not n["suspect"] and n["model"] == "test-model" and len(n["groups"]) == 2 for n in nodes.values())


def test_hma_route_counts_a_sliding_window_group_that_holds_only_its_tail(session: Session):
    # vLLM's default retention: the SWA group (window 64 = 4 blocks of 16) caches only the blocks
    # ending at the replay boundary; full attention caches all 12. vLLM would hit all 192 tokens.
    hashes = chain(50)
    events = [stored(hashes, group=0), stored(hashes[8:], group=1)]
    pub = session.publisher("hybrid-node")
    assert pub.publish(events)
    pub.close()
    session.model.apply("hybrid-node", events)
    session.processor.wait_offsets(session.end_offsets())
    answer = route(session.processor, hashes)  # vLLM's hybrid hit is the default
    assert answer["semantics"] == "hma" and answer["chosen"] == "hybrid-node", answer
    assert [(r["node_id"], r["gpu_tokens"], r["loadable_tokens"], r["exact"]) for r in answer["nodes"]] == \
        [("hybrid-node", 192, 0, True)]
    # per-group prefixes are an explanation only: the SWA group's prefix is 0, the hit is not
    prefix = route(session.processor, hashes, semantics="prefix-per-group")
    (row,) = prefix["nodes"]
    assert row["gpu_tokens"] == 192 and prefix["chosen"] == "hybrid-node"
    assert [(g["group_idx"], g["prefix_blocks"]["GPU"]) for g in row["groups"]] == [(0, 12), (1, 0)]


def test_duplicates_are_skipped_gaps_make_suspects_and_new_epochs_clear(session: Session):
    before = session.processor.get("/stats")["counters"]
    session.raw("dup", 0, [stored([1, 2, 3])])
    session.raw("dup", 1, [removed([3])])
    session.raw("dup", 1, [removed([3])])  # a replay: must not remove anything twice
    session.raw("dup", 0, [stored([1, 2, 3])])
    session.model.apply("dup", [stored([1, 2, 3]), removed([3])])
    session.raw("gappy", 0, [stored([1])])
    session.raw("gappy", 5, [stored([2])])
    session.model.apply("gappy", [stored([1]), stored([2])])
    session.raw("reborn", 0, [stored([1, 2]), stored([1, 2], medium="CPU")])
    session.raw("reborn", 0, [stored([1])], epoch=2)
    session.raw("reborn", 1, [stored([2])], epoch=1)  # stale: the old incarnation is gone
    session.model.clear_node("reborn")
    session.model.apply("reborn", [stored([1])])
    stats = session.processor.wait_offsets(session.end_offsets())
    counters = stats["counters"]
    assert counters["duplicates"] - before["duplicates"] == 2
    assert counters["gaps"] - before["gaps"] == 1
    assert counters["stale"] - before["stale"] == 1
    nodes = {n["node_id"]: n for n in session.processor.get("/nodes")["nodes"]}
    assert nodes["gappy"]["suspect"] and "expected seq 1, got 5" in nodes["gappy"]["suspect_reason"]
    assert not nodes["dup"]["suspect"] and nodes["reborn"]["epoch"] == 2 and not nodes["reborn"]["suspect"]
    answer = route(session.processor, [1, 2, 3], groups=("0",))
    expected = session.model.expected_route([1, 2, 3], SPECS, suspect=frozenset({"gappy"}),
                                            node_specs=raw_specs(("dup", "gappy", "reborn")))
    assert got_route(answer) == expected and expected[-1] == ("gappy", 32, 0)
    assert answer["nodes"][-1]["state"] == "suspect" and "expected seq 1" in answer["nodes"][-1]["state_reason"]


def test_bad_input_goes_to_the_dlq_with_reasons_and_good_events_keep_flowing(session: Session):
    good = encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id="dlq-node", epoch=1, seq=0, ts=time.time(),
                                    batch=msgspec.Raw(encode_vllm_batch([stored([77])], time.time()))))
    bad = [(b"garbage", b"\xc1 not msgpack at all", KAFKA_HEADERS, "not_msgpack"),
           (b"dlq-node", good[: len(good) // 2], KAFKA_HEADERS, "not_msgpack"),
           (b"dlq-node", good, [(HEADER_VERSION, b"9")], "unknown_version")]
    for key, value, headers, _ in bad:
        session.producer.produce(session.events, key=key, value=value, headers=headers)
    session.raw("dlq-node", 0, [stored([77])])
    session.model.apply("dlq-node", [stored([77])])
    stats = session.processor.wait_offsets(session.end_offsets())
    assert stats["dlq_by_reason"] == {"not_msgpack": 2, "unknown_version": 1}
    assert got_route(route(session.processor, [77], groups=("0",))) == [("dlq-node", 16, 0)]

    consumer = Consumer({"bootstrap.servers": session.bootstrap, "group.id": f"dlq-{uuid.uuid4().hex}",
                         "auto.offset.reset": "earliest"})
    consumer.subscribe([session.dlq])
    seen = []
    deadline = time.monotonic() + 30
    while len(seen) < len(bad) and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            seen.append((msg.value(), dict(msg.headers())))
    consumer.close()
    assert [value for value, _ in seen] == [value for _, value, _, _ in bad]
    for (_, headers), (_, _, _, kind) in zip(seen, bad):
        assert headers["kvpipe-dlq-reason"].decode().startswith(kind + ":")
        assert headers["kvpipe-source-topic"].decode() == session.events
        assert int(headers["kvpipe-source-offset"]) >= 0 and "kvpipe-source-partition" in headers


def test_http_errors_are_4xx_json_and_metrics_parse(session: Session):
    proc = session.processor
    for body in (b"{not json", {"hashes": [1]}, {"block_hashes": {"x": [1]}}, {"block_hashes": ["zz"]},
                 {"block_hashes": {"0": "notalist"}}, {"token_ids": []}, {"token_ids": [1], "block_hashes": {"0": [1]}},
                 {"block_hashes": {"0": ["zz"]}}):
        status, answer = proc.post("/route", body)
        assert 400 <= status < 500 and answer["error"], (body, status, answer)
    # a list that does not fit the groups' block size is a 400 naming the group, never a silent 0
    status, answer = proc.post("/route", {"block_hashes": {"0": [1, 2, 3]}, "num_tokens": 100})
    assert status == 400 and "group 0: 3 hashes, expected 6" in answer["detail"], answer
    # analyst SQL is the analytics app's; the routing app does not serve it
    request = urllib.request.Request(proc.url + "/sql", data=b'{"sql": "SELECT 1"}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 404
    health = proc.get("/health")
    assert (health["status"], health["app"]) == ("ok", "index") and health["owned_partitions"]
    # the exposition parses with prometheus_client's own parser; the route above was timed
    families = {f.name: f for f in text_string_to_metric_families(proc.get("/metrics"))}
    assert all(name.startswith(("kvpipe_processor_", "process_")) for name in families), sorted(families)
    assert any(s.value > 0 for s in families["kvpipe_processor_index_blocks"].samples)
    outcomes = {s.labels["outcome"]: s.value for s in families["kvpipe_processor_envelopes"].samples}
    assert outcomes["applied"] > 0
    route_count = [s.value for s in families["kvpipe_processor_route_latency_seconds"].samples
                   if s.name.endswith("_count") and s.labels["scope"] == "group"]
    assert route_count and route_count[0] >= 1
    assert any(s.name.endswith("_count") and s.value > 0 for s in families["kvpipe_processor_freshness_seconds"].samples)
    assert "process_resident_memory_bytes" in families


def _state(proc: ProcessorProcess) -> dict:
    nodes = proc.get("/nodes")["nodes"]
    for n in nodes:
        n.pop("silent_s")
    probes = [route(proc, h, include_zero=True) for h in PROBES + [[1, 2, 3], [77]]]
    for answer in probes:  # timings differ from call to call
        answer.pop("hashing_s"), answer.pop("search_s")
    return {"nodes": nodes, "routes": probes, "index": proc.get("/stats")["index"]}


def _committed(session: Session) -> dict[int, int]:
    consumer = Consumer({"bootstrap.servers": session.bootstrap, "group.id": session.env["KVPIPE_PROCESSOR_ID"]})
    try:
        tps = consumer.committed([TopicPartition(session.events, p) for p in range(PARTITIONS)], timeout=10)
        return {tp.partition: tp.offset for tp in tps}
    finally:
        consumer.close()


def test_graceful_stop_snapshots_and_restart_restores_without_replay(session: Session):
    proc = session.processor
    end = session.end_offsets()
    proc.wait_offsets(end)
    expected = _state(proc)
    proc.stop()  # SIGTERM: the shutdown hook snapshots every partition
    proc.start()
    stats = proc.wait_offsets(end)
    assert _state(proc) == expected
    assert stats["counters"]["messages"] == 0, "everything was covered by the shutdown snapshot"
    assert sorted((r["partition"], r["offset"]) for r in stats["durability"]["restores"]) == \
        [(p, end[p] - 1) for p in range(PARTITIONS)]


def test_sigkill_replays_the_tail_after_the_snapshot_even_when_faust_committed_past_it(session: Session):
    proc = session.processor
    snapshot_end = session.end_offsets()  # the last snapshot (at the graceful stop) covers up to here
    pub = session.publisher("late-node")
    pub.publish([stored(chain(3)), stored(chain(3), group=1)])
    session.model.apply("late-node", [stored(chain(3)), stored(chain(3), group=1)])
    pub.close()
    session.raw("dup", 2, [removed([1])])
    session.model.apply("dup", [removed([1])])
    end = session.end_offsets()
    tail = sum(end.values()) - sum(snapshot_end.values())
    proc.wait_offsets(end)
    expected = _state(proc)
    deadline = time.monotonic() + 20  # Faust commits acked offsets every few seconds
    while _committed(session) != end and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _committed(session) == end, "Faust committed past the snapshot: the restart must not trust that"
    assert proc.get("/stats")["durability"]["snapshots"] == 0, "no periodic snapshot since the restart"

    proc.kill()
    proc.start()
    stats = proc.wait_offsets(end)
    assert _state(proc) == expected
    assert stats["counters"]["messages"] == tail and stats["counters"]["offset_holes"] == 0
    assert sorted((r["partition"], r["offset"]) for r in stats["durability"]["restores"]) == \
        [(p, snapshot_end[p] - 1) for p in range(PARTITIONS)]

    rebuild = ProcessorProcess({**session.env, "KVPIPE_PROCESSOR_ID": f"rebuild-{uuid.uuid4().hex[:8]}",
                                "KVPIPE_SNAPSHOT_TOPIC": session.dlq,  # no snapshots there: rebuild from 0
                                "KVPIPE_WEB_PORT": str(free_port())}, session.tmp / "rebuild.log").start()
    try:
        rebuild.wait_offsets(end)
        assert _state(rebuild) == expected
    finally:
        rebuild.kill()
