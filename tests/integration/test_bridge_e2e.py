"""vLLM-like node → bridge → real Kafka → real processor (`python -m kvpipe processor`).

One node lives through three phases, and after each the processor's index is read back over
HTTP and compared with the node's true cache content (`CacheSim.truth`):
1. live batches dropped on the way but recovered from the replay ring → index == truth, healthy;
2. a gap older than the ring → `lost_batches` → the node is resynced: its entries are cleared and
   it is *partial* in `/nodes` and route answers, holding exactly what was stored since, no ghosts;
3. vLLM restarts → new epoch → the node is clean again and index == the new (fresh) truth.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvpipe.bench.testing_publisher import CacheSim, free_port_range
from kvpipe.schemas.codec import encode_vllm_batch

from tests.integration.bridge_helpers import GROUPS, Node, running_bridge

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NODE = "vllm-e2e/dp0"


class Processor:
    def __init__(self, bootstrap: str, topic: str, dlq: str, snapshots: str, state_dir: Path) -> None:
        self.port = free_port_range(1)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
        env.update(KVPIPE_KAFKA_BOOTSTRAP=bootstrap, KVPIPE_EVENTS_TOPIC=topic, KVPIPE_DLQ_TOPIC=dlq,
                   KVPIPE_SNAPSHOT_TOPIC=snapshots, KVPIPE_PARTITIONS="1", KVPIPE_STATE_DIR=str(state_dir),
                   KVPIPE_PROCESSOR_ID=f"proc-{topic}", KVPIPE_WEB_PORT=str(self.port), KVPIPE_NODE_TTL_S="600")
        self.log = open(state_dir / "processor.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvpipe", "processor"], cwd=REPO,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = state_dir / "processor.log"

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def node(self) -> dict | None:
        try:
            rows = self.get("/nodes")["nodes"]
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None
        return next((r for r in rows if r["node_id"] == NODE), None)

    def wait_for(self, epoch: int, seq: int, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"processor exited: {self.log_path.read_text()[-3000:]}"
            row = self.node()
            if row is not None and (row["epoch"], row["seq"]) >= (epoch, seq):
                return row
            time.sleep(0.25)
        raise AssertionError(f"processor never applied {NODE} epoch {epoch} seq {seq}; last: {self.node()}\n"
                             f"{self.log_path.read_text()[-3000:]}")

    def holds(self, group: int, h: int) -> bool:
        """Is `h` cached on GPU in `group`: the per-group prefix explanation of a one-block request."""
        answer = self.post("/route", {"block_hashes": {str(group): [h]}, "semantics": "prefix-per-group",
                                      "include_zero": True})
        return any(r["node_id"] == NODE and g["group_idx"] == group and g["prefix_blocks"].get("GPU", 0) == 1
                   for r in answer["nodes"] for g in r["groups"])

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def step(pub, sim: CacheSim, bridge, published: int, live: bool = True) -> int:
    """Publish one step; unless it is dropped on the live path, wait until the bridge has dealt
    with everything so far (forwarded or counted lost), so the replay ring is where the test
    expects it. Returns the number of steps published so far (all incarnations)."""
    pub.publish_payload(encode_vllm_batch(sim.step(), time.time(), 0))
    pub.wait_sent()
    published += 1
    deadline = time.monotonic() + 10
    while live and time.monotonic() < deadline:
        c = bridge.counters()[NODE]
        if c["batches"] + c["lost"] >= published:
            break
        time.sleep(0.005)
    return published


class Since:
    """The part of a node's cache learned after a resync: blocks stored since (an under-report
    of the truth, never more)."""

    def __init__(self, sim: CacheSim, before: set) -> None:
        self.truth = sim.truth - before


def assert_index_is_truth(proc: Processor, row: dict, sim: CacheSim, removed: set) -> None:
    per_group = {g.group_idx: 0 for g in GROUPS}
    for g, _ in sim.truth:
        per_group[g] += 1
    assert row["blocks"] == {f"{g}/GPU": n for g, n in per_group.items() if n}
    assert all(proc.holds(g, h) for g, h in sorted(sim.truth, key=str))
    assert not any(proc.holds(g, h) for g, h in sorted(removed, key=str)[:20])


def test_index_equals_the_nodes_cache_and_losses_resync_the_node_as_partial(kafka_bootstrap, unique_topic, tmp_path):
    topic, dlq = unique_topic("e2e-events"), unique_topic("e2e-dlq")
    snapshots = unique_topic("e2e-snap", config={"cleanup.policy": "compact"})
    proc = Processor(kafka_bootstrap, topic, dlq, snapshots, tmp_path)
    node = Node(buffer_steps=8)
    pub = node.ranks[0]
    try:
        with running_bridge(kafka_bootstrap, topic, dlq, node, name="vllm-e2e") as bridge:
            worker_pub = bridge.workers[0].publisher
            # 1. drops on the live path, all still in the ring
            sim, ever, n = CacheSim(GROUPS, seed=21), set(), 0
            dropped = {3, 7, 8, 15}
            pub.drop(*dropped)
            for seq in range(20):
                n = step(pub, sim, bridge, n, live=seq not in dropped)
                ever |= sim.truth
            row = proc.wait_for(worker_pub.epoch, 19)
            assert not row["suspect"], row
            assert_index_is_truth(proc, row, sim, ever - sim.truth)

            # 2. a gap the ring (8 batches) cannot cover
            pub.drop(*range(20, 32))
            for seq in range(20, 25):
                n = step(pub, sim, bridge, n, live=False)
            before_resync = set(sim.truth)  # 20..24 are lost for good: the index restarts after them
            for seq in range(25, 33):
                n = step(pub, sim, bridge, n, live=seq == 32)
            forwarded = bridge.counters()[NODE]["batches"]
            row = proc.wait_for(worker_pub.epoch, forwarded - 1)
            assert not row["suspect"] and row["partial"] and row["partial_since"]["seq"] == 20, row
            assert bridge.counters()[NODE]["lost"] == 5  # 20..31 dropped; the ring keeps 25..32
            assert_index_is_truth(proc, row, Since(sim, before_resync), (ever | before_resync) - sim.truth)

            # 3. vLLM restarts: empty cache, seq from 0
            pub.restart()
            sim, ever, n0 = CacheSim(GROUPS, seed=22), set(), n
            for _ in range(6):
                n = step(pub, sim, bridge, n)
                ever |= sim.truth
            assert bridge.counters()[NODE]["restarts"] == 1
            row = proc.wait_for(worker_pub.epoch, n - n0 - 1)
            assert not row["suspect"], row
            assert_index_is_truth(proc, row, sim, ever - sim.truth)
    finally:
        node.close()
        proc.close()


def test_a_bridge_attached_late_to_a_long_running_node_routes_it_as_partial_and_exact_since(
        kafka_bootstrap, unique_topic, tmp_path):
    """The bridge starts after the node has published 40 batches; the ring holds the last 8:
    32 batches are lost for good. The node routes (partial, since the first forwarded batch) with
    exactly the blocks stored since, none from before, and removals of older blocks are ignored."""
    topic, dlq = unique_topic("late-events"), unique_topic("late-dlq")
    snapshots = unique_topic("late-snap", config={"cleanup.policy": "compact"})
    proc = Processor(kafka_bootstrap, topic, dlq, snapshots, tmp_path)
    node = Node(buffer_steps=8)
    pub = node.ranks[0]
    try:
        sim = CacheSim(GROUPS, seed=31)
        truth_after = [set()]  # the cache after k steps
        for _ in range(40):  # nobody listening yet; the ring (8) keeps the newest
            pub.publish_payload(encode_vllm_batch(sim.step(), time.time(), 0))
            truth_after.append(set(sim.truth))
        pub.wait_sent()
        with running_bridge(kafka_bootstrap, topic, dlq, node, name="vllm-e2e") as bridge:
            n = 40
            for _ in range(10):
                n = step(pub, sim, bridge, n)
            c = bridge.counters()[NODE]
            assert c["lost"] >= 32 and c["lost"] + c["batches"] == 50, c  # the ring covers the newest 7-8 of 0..39
            before = truth_after[c["lost"]]  # what was cached when the first forwarded batch came
            row = proc.wait_for(bridge.workers[0].publisher.epoch, c["batches"] - 1)
            assert row["partial"] and not row["suspect"] and row["partial_since"]["seq"] == 0, row
            assert row["counters"]["partial_unknown_removes"] > 0 and row["counters"]["unknown_removes"] == 0, row
            assert_index_is_truth(proc, row, Since(sim, before), before)
            answer = proc.post("/route", {"block_hashes": {"0": [h for g, h in sorted(sim.truth - before, key=str) if g == 0][:1]},
                                          "include_zero": True})
            assert [(r["node_id"], r["state"]) for r in answer["nodes"]] == [(NODE, "live")]  # routed, not suspect
    finally:
        node.close()
        proc.close()


def test_the_engines_prometheus_load_reaches_the_router_through_the_bridge(kafka_bootstrap, unique_topic, tmp_path):
    """`kvpipe bridge --metrics-url`: the engine's vLLM gauges (served here by a small HTTP server)
    ride on the node's envelopes into the processor, where the router's score reads them."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvpipe.producer.bridge.engine_load import LoadScraper

    page = {"text": ""}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = page["text"].encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    def gauges(running: int, waiting: int, usage: float) -> str:
        return "".join(f"# TYPE vllm:{name} gauge\nvllm:{name}{{engine=\"0\",model_name=\"m\"}} {value}\n"
                       for name, value in (("num_requests_running", running), ("num_requests_waiting", waiting),
                                           ("kv_cache_usage_perc", usage)))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    topic, dlq = unique_topic("load-events"), unique_topic("load-dlq")
    snapshots = unique_topic("load-snap", config={"cleanup.policy": "compact"})
    proc = Processor(kafka_bootstrap, topic, dlq, snapshots, tmp_path)
    node = Node(buffer_steps=8)
    pub = node.ranks[0]
    try:
        with running_bridge(kafka_bootstrap, topic, dlq, node, name="vllm-e2e") as bridge:
            worker_pub = bridge.workers[0].publisher
            scraper = LoadScraper(f"http://127.0.0.1:{server.server_port}/metrics",
                                  [(w.rank, w.publisher.set_load) for w in bridge.workers])
            sim, n = CacheSim(GROUPS, seed=5), 0
            for running, waiting, usage in ((3, 7, 0.5), (1, 0, 0.125)):
                page["text"] = gauges(running, waiting, usage)
                assert scraper.scrape_once()
                n = step(pub, sim, bridge, n)
                row = proc.wait_for(worker_pub.epoch, n - 1)
                assert row["load"] == {"running": running, "waiting": waiting, "kv_usage": usage}, row
                answer = proc.post("/route", {"block_hashes": {"0": [1]}, "include_zero": True})
                (route_row,) = answer["nodes"]
                assert route_row["load"].get("waiting", 0) == waiting and route_row["load"].get("running", 0) == running
    finally:
        node.close()
        proc.close()
        server.shutdown()
        server.server_close()
