"""Two workers of one processor (one consumer group): the route API answers for the whole group.

Two `kvpipe processor` children with the same processor id and different web ports share an
events topic of 4 partitions; nodes are spread over all of them. Each worker's index holds only
its own partitions, yet `/route` and `/nodes` on either worker must give the full answer, equal
to what the test computes (scatter-gather, `kvpipe.processors.routing.scatter`). A worker that does not answer
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

from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.processors.routing import apidoc
from kvpipe.processors.router.client import AsyncRouterClient, RouterClient
from kvpipe.processors.router.model import RouteRequest
from tests.integration.processor_fixture import HeldBlocks, ProcessorTopics
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import BlockRemoved, BlockStored

pytestmark = pytest.mark.integration

PARTITIONS = 4
NODES = [f"node-{i}" for i in range(10)]
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]


def chain(family: int, length: int = 10) -> list[int]:
    return [family * 1000 + i for i in range(length)]


PROBES = [chain(f) for f in range(5)] + [chain(f)[:2] for f in range(5)]
CFG = HashConfig(algorithm="sha256", hash_block_size=16)
DOCS = [list(range(20_000 + 1000 * d, 20_000 + 1000 * d + 8 * 16)) for d in range(3)]  # 8 blocks each
# reported load per node: equal hits are then decided by it (the score's load terms)
LOADS = {node: (i % 3, (i * 7) % 5, round(0.1 * (i % 4), 2)) for i, node in enumerate(NODES)}


def token_hashes(tokens: list[int]) -> list[int]:
    return [external_hash(h, True) for h in hash_request_blocks(hasher_from_config(CFG), tokens, 16)]


def strip(answer: dict) -> dict:
    """An answer without its timings (they differ from call to call)."""
    out = {k: v for k, v in answer.items() if k not in ("hashing_s", "search_s")}
    out["hash_configs"] = [{k: v for k, v in h.items() if k != "hashing_s"} for h in answer["hash_configs"]]
    return out


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
                              KVPIPE_SNAPSHOT_EVERY_S="2", KVPIPE_NODE_TTL_S="3600", KVPIPE_ROUTE_STALE_AFTER_S="3600")
        return ProcessorProcess(env, self.tmp / f"worker-{name}.log")

    # -- publishing: node i always on partition i % 4, so every partition has nodes ---------------

    def publish(self, node: str, events: list) -> None:
        seq = self.seq.get(node, 0)
        self.seq[node] = seq + 1
        ts = time.time()
        running, waiting, kv_usage = LOADS[node]
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=ts, sent_ts=ts, num_events=len(events),
                       group_specs=SPECS if seq == 0 else None, hash_config=CFG if seq == 0 else None,
                       batch=msgspec.Raw(encode_vllm_batch(events, ts)), running=running, waiting=waiting,
                       kv_usage=kv_usage)
        self.producer.produce(self.events, key=node.encode(), value=encode_envelope(env), headers=KAFKA_HEADERS,
                              partition=NODES.index(node) % PARTITIONS)
        self.model.apply(node, events)

    def end_offsets(self) -> dict[int, int]:
        self.producer.flush(30)
        return self.topics.end_offsets()

    def expected_route(self, hashes: list[int]) -> list[tuple[str, int, int]]:
        """Both groups asked with the same hashes, num_tokens one past them, the nodes' loads."""
        return self.model.expected_route(hashes, SPECS, loads=LOADS)

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


def got_route(answer: dict) -> list[tuple[str, int, int]]:
    """Rows with a hit (the chosen node is listed even without one)."""
    return [(r["node_id"], r["gpu_tokens"], r["loadable_tokens"]) for r in answer["nodes"]
            if r["gpu_tokens"] or r["loadable_tokens"]]


def load(row: dict, field: str) -> float:
    return row["load"].get(field, 0)  # zeros are left out of the JSON


def route(w: ProcessorProcess, hashes: list[int], **fields) -> dict:
    return w.route({"0": hashes, "1": hashes}, num_tokens=len(hashes) * 16 + 1, **fields)


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
    for i, node in enumerate(NODES):  # real prompts' blocks, hashed as the nodes hash them
        hashes = token_hashes(DOCS[i % 3])[: 2 + i % 7]
        group.publish(node, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
                                         lora_id=None, medium="GPU", lora_name=None, group_idx=g) for g in (0, 1)])


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
        answers = [strip(route(w, hashes, include_zero=True)) for w in (a, b)]
        assert answers[0] == answers[1], hashes
        assert got_route(answers[0]) == expected and answers[0]["chosen"] == expected[0][0], hashes
        assert answers[0]["partial"] is False and answers[0]["missing_partitions"] == []
        assert len(answers[0]["nodes"]) == len(NODES), "include_zero lists every node"
        loads = {r["node_id"]: (load(r, "running"), load(r, "waiting"), load(r, "kv_usage")) for r in answers[0]["nodes"]}
        assert loads == LOADS
        top = [strip(route(w, hashes, top_k=2, semantics="prefix-per-group")) for w in (a, b)]
        assert top[0] == top[1] and len(top[0]["nodes"]) == 2 and top[0]["chosen"] == answers[0]["chosen"]
    for doc in DOCS:  # token ids: every worker hashes the prompt for its own nodes
        tokens = doc + [5]
        answers = [strip(w.route(token_ids=tokens)) for w in (a, b)]
        assert answers[0] == answers[1] and answers[0]["num_tokens"] == len(tokens)
        assert got_route(answers[0]) == group.expected_route(token_hashes(doc))
        assert answers[0]["hash_configs"][0]["nodes"] == len(NODES), "hashed once per configuration, all nodes"
    nodes = [[{k: v for k, v in n.items() if k != "silent_s"} for n in w.get("/nodes")["nodes"]] for w in (a, b)]
    assert nodes[0] == nodes[1] and [n["node_id"] for n in nodes[0]] == sorted(NODES)
    assert {n["partition"] for n in nodes[0]} == set(range(PARTITIONS))
    paged, after = [], ""  # pages smaller than either worker's share: each page asks both workers
    while after is not None:
        page = a.get("/nodes?limit=2" + (f"&after={after}" if after else ""))
        paged += [n["node_id"] for n in page["nodes"]]
        after = page["next_after"]
    assert paged == sorted(NODES)
    # the local answer is one worker's share only: no fan-out from it
    _, local = a.post("/route?local=1", {"block_hashes": {"0": chain(0), "1": chain(0)}, "include_zero": True})
    owned = set(stats[0]["cluster"]["owned_partitions"])
    assert local["chosen"] is None and local["partitions"] == sorted(owned)
    assert {local["node_partitions"][r["node_id"]] for r in local["nodes"]} == owned


def test_a_request_routed_on_one_worker_is_in_flight_on_the_worker_holding_its_node(group: Group):
    a, b = group.workers
    fresh = list(range(90_000, 90_000 + 6 * 16)) + [1]  # no node holds any of it: load alone decides
    first = a.route(token_ids=fresh, request_id="req-1", include_zero=True)
    chosen = first["chosen"]
    least = min(NODES, key=lambda n: (0.02 * LOADS[n][0] + 0.05 * LOADS[n][1] + 0.5 * LOADS[n][2], n))
    assert chosen == least, first
    # the next request with that prefix, on either worker, sees the guess and the extra load
    for w in (a, b):
        again = w.route(token_ids=fresh, include_zero=True)
        row = next(r for r in again["nodes"] if r["node_id"] == chosen)
        assert again["chosen"] == chosen and row["speculative"] and row["gpu_tokens"] == 96, again
        assert load(row, "waiting") == LOADS[chosen][1] + 1
    # finished on the worker that does not hold the node: it leaves the load there too
    holder_is_a = NODES.index(chosen) % PARTITIONS in a.get("/stats")["cluster"]["owned_partitions"]
    other = b if holder_is_a else a
    assert other.post("/route/finished", {"request_id": "req-1"}) == (204, None)
    row = next(r for r in a.route(token_ids=fresh, include_zero=True)["nodes"] if r["node_id"] == chosen)
    assert load(row, "waiting") == LOADS[chosen][1] and row["speculative"]  # blocks stay until events or TTL
    # "sent" reports reach the node's worker whichever worker is asked; unknown nodes are a 404
    other_node = next(n for n in NODES if n != chosen)
    assert other.post("/route/sent", {"request_id": "req-2", "node_id": other_node, "token_ids": fresh}) == (204, None)
    row = next(r for r in b.route(token_ids=fresh, include_zero=True)["nodes"] if r["node_id"] == other_node)
    assert row["speculative"] and load(row, "waiting") == LOADS[other_node][1] + 1
    status, err = a.post("/route/sent", {"request_id": "req-3", "node_id": "nobody", "token_ids": [1]})
    assert status == 404 and "nobody" in err["detail"]
    assert a.post("/route/finished", {"request_id": "req-2"}) == (204, None)
    assert a.post("/route/finished", {"request_id": "never-sent"}) == (204, None)  # idempotent
    inflight = [w.get("/stats")["router"]["inflight"] for w in (a, b)]
    assert sum(i["sent"] for i in inflight) == 2 and sum(i["finished"] for i in inflight) == 2


def test_the_client_round_trips_sync_and_async_against_the_group(group: Group):
    a, b = group.workers
    tokens = DOCS[1] + [3]
    with RouterClient(a.url) as client:
        sync = [client.route(RouteRequest(token_ids=tokens)) for _ in range(3)]  # one kept-alive connection
        client.sent("req-c", sync[0].chosen, tokens)
        client.finished("req-c")
        doc = client.openapi()
        health = client.health()

    async def with_async():
        async with AsyncRouterClient(b.url) as client:
            assert (await client.health())["status"] == "ok"
            return [await client.route(RouteRequest(token_ids=tokens)) for _ in range(2)]

    import asyncio

    answers = asyncio.run(with_async())
    assert {x.chosen for x in sync + answers} == {sync[0].chosen}
    assert [(r.node_id, r.gpu_tokens) for r in sync[0].nodes] == [(r.node_id, r.gpu_tokens) for r in sync[2].nodes]
    assert [(n, g, c) for n, g, c in got_route(a.route(token_ids=DOCS[0] + [3]))] == \
        group.expected_route(token_hashes(DOCS[0]))  # the typed answer and the JSON one agree
    # the "sent" report made the whole prompt a speculative GPU hit on the chosen node (for the TTL)
    row = next(r for r in answers[0].nodes if r.node_id == sync[0].chosen)
    assert row.speculative and row.gpu_tokens == len(DOCS[1]) and row.load.waiting == LOADS[row.node_id][1]
    assert doc["openapi"].startswith("3.1") and "/route" in doc["paths"]
    assert health["status"] == "ok" and health["owned_partitions"]


def test_every_example_of_the_openapi_document_is_accepted_by_the_running_group(group: Group):
    a, b = group.workers
    doc = a.get("/openapi.json")
    assert doc == b.get("/openapi.json") == msgspec.json.decode(apidoc.encoded())
    # the examples name node-a (full attention at 16, sliding window at 32, the example's model)
    ts = time.time()
    env = Envelope(v=SCHEMA_MAJOR, node_id="node-a", epoch=1, seq=0, ts=ts, sent_ts=ts, model="google/gemma-3-4b-it",
                   group_specs=[GroupSpec(group_idx=0, kind="full_attention", block_size=16),
                                GroupSpec(group_idx=1, kind="sliding_window", block_size=32, sliding_window=64)],
                   hash_config=CFG)
    group.producer.produce(group.events, key=b"node-a", value=encode_envelope(env), headers=KAFKA_HEADERS, partition=0)
    group.wait_split([a, b], group.end_offsets())
    checked = 0
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            examples = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("examples", {})
            for name, example in examples.items():
                for w in (a, b):
                    status, answer = w.post(path, example["value"])
                    assert 200 <= status < 300, (path, name, status, answer)
                    checked += 1
    assert checked == 2 * 5  # three /route examples, one /route/sent, one /route/finished


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
        n for n, *_ in group.expected_route(chain(1)) if NODES.index(n) % PARTITIONS not in b_parts}


def test_killed_worker_partitions_move_to_the_survivor_which_answers_in_full(group: Group):
    a, b = group.workers
    for node in NODES[:4]:  # more events after the last snapshots: the survivor replays them
        group.publish(node, [BlockStored(block_hashes=chain(7)[:3 + NODES.index(node)], parent_block_hash=None,
                                         token_ids=[], block_size=16, lora_id=None, medium="GPU", lora_name=None,
                                         group_idx=g) for g in (0, 1)])
    end = group.end_offsets()
    group.wait_split([a, b], end)
    b_parts = b.get("/stats")["cluster"]["owned_partitions"]
    b.kill()
    answer = route(a, chain(7))  # until the group expels b (session timeout), its partitions are missing
    assert answer["partial"] is True and answer["missing_partitions"] == b_parts
    stats = group.wait_split([a], end, timeout=90)
    from_snapshot = {r["partition"] for r in stats[0]["durability"]["restores"] if r["offset"] >= 0}
    assert set(b_parts) <= from_snapshot and stats[0]["counters"]["offset_holes"] == 0
    for hashes in PROBES + [chain(7)]:
        answer = route(a, hashes)
        assert answer["partial"] is False and got_route(answer) == group.expected_route(hashes), hashes
    assert [n["node_id"] for n in a.get("/nodes")["nodes"]] == sorted(NODES + ["node-a"])  # + the examples' node
