"""Two workers of one processor (one consumer group): the route API answers for the whole group.

Two `kvpipe processor` children with the same processor id and different web ports share an
events topic of 4 partitions; nodes are spread over all of them. Each worker's index holds only
its own partitions, yet `/route` and `/nodes` on either worker must give the full answer, equal
to what the test computes (scatter-gather, `processors.scatter`). A worker that does not answer
in time makes the answer partial, naming its partitions, never an error; a killed worker's
partitions move to the survivor, which restores them from snapshots and answers in full again.
Tests run in file order and share one pair of workers.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Producer

from processors.procrun import ProcessorProcess, free_port
from tests.integration.processor_fixture import HeldBlocks, ProcessorTopics
from schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from schemas.events import BlockRemoved, BlockStored

pytestmark = pytest.mark.integration

PARTITIONS = 4
NODES = [f"node-{i}" for i in range(10)]
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]


def chain(family: int, length: int = 10) -> list[int]:
    return [family * 1000 + i for i in range(length)]


PROBES = [chain(f) for f in range(5)] + [chain(f)[:2] for f in range(5)]


class Group:
    """Topics, two workers of one consumer group, and the test's own model of the index."""

    def __init__(self, bootstrap: str, tmp: Path) -> None:
        self.bootstrap, self.tmp = bootstrap, tmp
        self.topics = ProcessorTopics(bootstrap, "workers", PARTITIONS)
        self.events = self.topics.events
        self.group_id = f"kvpipe-workers-{self.topics.tag}"
        self.producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
        self.model = HeldBlocks()
        self.seq: dict[str, int] = {}
        self.workers = [self.worker("a"), self.worker("b")]

    def worker(self, name: str) -> ProcessorProcess:
        # Periodic snapshots every 2 s: a SIGKILLed worker's partitions are restored from them.
        env = self.topics.env(self.group_id, free_port(), str(self.tmp / f"state-{name}"),
                              KVPIPE_SNAPSHOT_EVERY_S="2", KVPIPE_NODE_TTL_S="3600")
        return ProcessorProcess(env, self.tmp / f"worker-{name}.log")

    # -- publishing: node i always on partition i % 4, so every partition has nodes ---------------

    def publish(self, node: str, events: list) -> None:
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        ts = time.time()
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=ts, sent_ts=ts, num_events=len(events),
                       group_specs=SPECS if seq == 0 else None, batch=msgspec.Raw(encode_vllm_batch(events, ts)))
        self.producer.produce(self.events, key=node.encode(), value=encode_envelope(env), headers=KAFKA_HEADERS,
                              partition=NODES.index(node) % PARTITIONS)
        self.model.apply(node, events)

    def end_offsets(self) -> dict[int, int]:
        self.producer.flush(30)
        return self.topics.end_offsets()

    def expected_route(self, hashes: list[int]) -> list[tuple[str, dict]]:
        """Both groups asked with the same hashes (every event here is on GPU)."""
        return self.model.expected_route({0: hashes, 1: hashes})

    # -- waiting for the group ---------------------------------------------------------------------

    def wait_split(self, workers: list[ProcessorProcess], end: dict[int, int], timeout: float = 90.0) -> list[dict]:
        """Until the workers' owned partitions are disjoint, cover the topic, and each has handled
        its partitions up to `end`; returns their /stats."""
        deadline = time.monotonic() + timeout
        stats: list[dict] = []
        while time.monotonic() < deadline:
            stats = [w.get("/stats") for w in workers]
            owned = [set(s["cluster"]["owned_partitions"]) for s in stats]
            disjoint = sum(map(len, owned)) == len(set().union(*owned))
            if disjoint and set().union(*owned) == set(range(PARTITIONS)) and all(owned) and all(
                    s["freshness"].get(str(p), {}).get("offset", -1) >= end[p] - 1
                    for s, mine in zip(stats, owned) for p in mine if end[p]):
                return stats
            time.sleep(0.2)
        raise TimeoutError(f"workers did not split the partitions: {[s.get('cluster') for s in stats]}\n"
                           + "\n".join(w.log_tail(2000) for w in workers))

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.topics.delete()


@pytest.fixture(scope="module")
def group(kafka_bootstrap: str, tmp_path_factory) -> Group:
    g = Group(kafka_bootstrap, tmp_path_factory.mktemp("workers"))
    yield g
    g.close()


def got_route(answer: dict) -> list[tuple[str, dict]]:
    return [(row["node_id"], row["prefix"]) for row in answer["nodes"]]


def publish_scenario(group: Group) -> None:
    for step in range(40):
        node = NODES[step % len(NODES)]
        fam = (step * 7) % 5
        n = 1 + (step * 3) % 10
        events = [BlockStored(block_hashes=chain(fam)[:n], parent_block_hash=None, token_ids=[], block_size=16,
                              lora_id=None, medium="GPU", lora_name=None, group_idx=g) for g in (0, 1)]
        if step % 4 == 3:  # sliding window: early blocks leave group 1, group 0 keeps them
            events.append(BlockRemoved(block_hashes=chain(fam)[:2], medium="GPU", group_idx=1))
        group.publish(node, events)


def test_two_workers_split_the_partitions_and_both_answer_for_the_whole_group(group: Group):
    a, b = group.workers
    publish_scenario(group)
    end = group.end_offsets()
    assert all(end.values()), f"every partition has nodes: {end}"
    a.start()
    b.start()
    stats = group.wait_split([a, b], end)
    assert all(s["cluster"]["peers"] for s in stats), "each worker sees the other in the assignor's map"
    for hashes in PROBES:
        expected = group.expected_route(hashes)
        answers = [w.route({"0": hashes, "1": hashes}) for w in (a, b)]
        assert answers[0] == answers[1], hashes
        assert got_route(answers[0]) == expected, hashes
        assert answers[0]["partial"] is False and answers[0]["missing_partitions"] == []
        assert [w.route(hashes) for w in (a, b)][0]["nodes"] == answers[0]["nodes"], "one list for all groups"
    nodes = [[{k: v for k, v in n.items() if k != "silent_s"} for n in w.get("/nodes")["nodes"]] for w in (a, b)]
    assert nodes[0] == nodes[1] and [n["node_id"] for n in nodes[0]] == sorted(NODES)
    assert {n["partition"] for n in nodes[0]} == set(range(PARTITIONS))
    # the local answer is one worker's share only: no fan-out from it
    _, local = a.post("/route?local=1", {"block_hashes": {"0": chain(0), "1": chain(0)}})
    assert {r["partition"] for r in local["nodes"]} <= set(stats[0]["cluster"]["owned_partitions"])


def test_a_worker_that_does_not_answer_in_time_makes_the_answer_partial_not_an_error(group: Group):
    a, b = group.workers
    b_parts = b.get("/stats")["cluster"]["owned_partitions"]
    os.kill(b.proc.pid, signal.SIGSTOP)  # its socket still accepts; nothing answers
    try:
        started = time.monotonic()
        status, answer = a.post("/route", {"block_hashes": {"0": chain(1)}})
        elapsed = time.monotonic() - started
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert status == 200 and answer["partial"] is True and answer["missing_partitions"] == b_parts
    assert 0.9 < elapsed < 3.0, f"the peer timeout is ~1 s, took {elapsed:.2f} s"
    assert {r["node_id"] for r in answer["nodes"]} == {
        n for n, _ in group.expected_route(chain(1)) if NODES.index(n) % PARTITIONS not in b_parts}


def test_killed_worker_partitions_move_to_the_survivor_which_answers_in_full(group: Group):
    a, b = group.workers
    late = {"0": chain(7), "1": chain(7)}
    for node in NODES[:4]:  # more events after the last snapshots: the survivor replays them
        group.publish(node, [BlockStored(block_hashes=chain(7)[:3 + NODES.index(node)], parent_block_hash=None,
                                         token_ids=[], block_size=16, lora_id=None, medium="GPU", lora_name=None,
                                         group_idx=g) for g in (0, 1)])
    end = group.end_offsets()
    group.wait_split([a, b], end)
    b_parts = b.get("/stats")["cluster"]["owned_partitions"]
    b.kill()
    answer = a.route(late)  # until the group expels b (session timeout), its partitions are missing
    assert answer["partial"] is True and answer["missing_partitions"] == b_parts
    stats = group.wait_split([a], end, timeout=90)
    from_snapshot = {r["partition"] for r in stats[0]["durability"]["restores"] if r["offset"] >= 0}
    assert set(b_parts) <= from_snapshot and stats[0]["counters"]["offset_holes"] == 0
    for hashes in PROBES + [chain(7)]:
        answer = a.route({"0": hashes, "1": hashes})
        assert answer["partial"] is False and got_route(answer) == group.expected_route(hashes), hashes
    assert [n["node_id"] for n in a.get("/nodes")["nodes"]] == sorted(NODES)
