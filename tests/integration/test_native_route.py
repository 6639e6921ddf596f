"""The routing app's native route server, end to end: a real broker, a real `kvpipe processor` with `--route-port`,
a seeded fleet published through Kafka. The route port answers every token-id and block-hash request as the web port
does (only the timings differ), passes every other request through to the web port, keeps the token rule, and shows its counters
in /stats and /metrics; ingest goes on while it serves.
"""
from __future__ import annotations

import http.client
import json
import random
import time
import uuid

import msgspec
import pytest

from kvpipe.bench import route as bench
from kvpipe.bench.route import without_timings as _plain
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.bench.route_http import _publish
from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.processors.router.model import RouteRequest
from tests.integration.processor_fixture import ProcessorTopics
from tests.nativecheck import require_native_core

require_native_core()
pytestmark = [pytest.mark.integration]

TOKEN = "native-route-test-token"


class Conn:
    """One keep-alive connection to a port, with the token."""

    def __init__(self, port: int, token: str | None = TOKEN) -> None:
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.c.request("POST", path, body=body, headers=self.headers)
        r = self.c.getresponse()
        return r.status, r.read()

    def get(self, path: str) -> tuple[int, bytes]:
        self.c.request("GET", path, headers=self.headers)
        r = self.c.getresponse()
        return r.status, r.read()


@pytest.fixture(scope="module")
def served(kafka_bootstrap: str, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("native-route")
    topics = ProcessorTopics(kafka_bootstrap, "nroute", 2)
    rng = random.Random(7)
    envelopes, docs = bench.fleet(48, 8, 512, 3, 1, rng, 2)
    # the fleet goes to the processor's own events topic (created above; _publish creates it only when missing)
    topics.admin.delete_topics([topics.events], operation_timeout=30)[topics.events].result(timeout=30)
    ends = _publish(kafka_bootstrap, topics.events, 2, envelopes, {})
    route_port = free_port()
    proc = ProcessorProcess(topics.env(f"nroute-{uuid.uuid4().hex[:8]}", free_port(), str(tmp / "state"),
                                       KVPIPE_API_TOKEN=TOKEN, KVPIPE_ROUTE_PORT=str(route_port),
                                       KVPIPE_ROUTE_THREADS="2", KVPIPE_NODE_TTL_S="3600",
                                       KVPIPE_ROUTE_STALE_AFTER_S="3600"), tmp / "processor.log")
    proc.start()
    try:
        proc.wait_offsets({p: ends.get(p, 0) for p in range(2)}, timeout=120)
        _wait_native(proc, route_port, bench.prompts(docs, 1, random.Random(0))[0])
        yield proc, route_port, docs, rng
    finally:
        proc.stop()
        topics.delete()


def _wait_native(proc: ProcessorProcess, route_port: int, tokens: list[int], timeout_s: float = 60.0) -> None:
    """Until the route port answers a request natively. The fleet applied, the native plan of the index's last
    generation is exported at the app's next refresh (every few ms); until then the route port passes requests
    to the web port, by design (docs/architecture.md §5)."""
    conn = Conn(route_port)
    body = msgspec.json.encode(RouteRequest(token_ids=tokens, top_k=1))
    deadline = time.monotonic() + timeout_s
    while True:
        before = proc.get("/stats")["route_server"]["requests"].get("native", 0)
        status, _ = conn.post("/route", body)
        assert status == 200
        if proc.get("/stats")["route_server"]["requests"].get("native", 0) > before:
            return
        assert time.monotonic() < deadline, "the route port never answered natively"
        time.sleep(0.02)


def test_the_route_port_answers_as_the_web_port(served):
    proc, route_port, docs, rng = served
    native, web = Conn(route_port), Conn(proc.port)
    prompts = bench.prompts(docs, 12, rng) + [[rng.randrange(50_000, 60_000) for _ in range(512)]]
    for tokens in prompts:
        for top_k in (1, None):
            body = msgspec.json.encode(RouteRequest(token_ids=tokens, top_k=top_k))
            s1, a = native.post("/route", body)
            s2, b = web.post("/route", body)
            assert (s1, s2) == (200, 200), (a, b)
            assert _plain(a) == _plain(b)
    stats = proc.get("/stats")["route_server"]
    assert stats["running"] and stats["native_open"], stats
    assert stats["requests"]["native"] >= 2 * len(prompts)  # answered natively, not passed through


def test_block_hashes_are_answered_on_the_route_port_as_on_the_web_port(served):
    """A router that hashes per group itself sends `block_hashes`: answered natively too, the same rows."""
    proc, route_port, docs, rng = served
    native, web = Conn(route_port), Conn(proc.port)
    cfg = bench.CONFIGS[0]
    before = proc.get("/stats")["route_server"]["requests"]["native"]
    prompts = bench.prompts(docs, 6, rng)
    for tokens in prompts:
        chain = [external_hash(h, True) for h in hash_request_blocks(hasher_from_config(cfg), tokens, cfg.hash_block_size)]
        lists = bench.group_lists(chain, bench.layout(2))
        body = msgspec.json.encode(RouteRequest(block_hashes=lists, num_tokens=len(tokens), top_k=1))
        s1, a = native.post("/route", body)
        s2, b = web.post("/route", body)
        assert (s1, s2) == (200, 200), (a, b)
        assert _plain(a) == _plain(b)
    assert proc.get("/stats")["route_server"]["requests"]["native"] >= before + len(prompts)


def test_other_requests_pass_through_to_the_web_port(served):
    proc, route_port, docs, rng = served
    native, web = Conn(route_port), Conn(proc.port)
    tokens = bench.prompts(docs, 1, rng)[0]
    before = proc.get("/stats")["route_server"]["requests"].get("forwarded", 0)
    for body in (RouteRequest(token_ids=tokens, include_zero=True), RouteRequest(token_ids=tokens, top_k=2, model="x")):
        s1, a = native.post("/route", msgspec.json.encode(body))
        s2, b = web.post("/route", msgspec.json.encode(body))
        assert s1 == s2 == 200 and _plain(a) == _plain(b)
    status, err = native.post("/route", b'{"token_ids": []}')  # Python's 400, with its reason
    assert status == 400 and json.loads(err)["error"] == "bad token_ids"
    status, nodes = native.get("/nodes")
    assert status == 200 and json.loads(nodes)["nodes"]
    assert proc.get("/stats")["route_server"]["requests"]["forwarded"] >= before + 4


def test_the_token_and_health_rules_hold_on_the_route_port(served):
    proc, route_port, docs, rng = served
    body = msgspec.json.encode(RouteRequest(token_ids=bench.prompts(docs, 1, rng)[0], top_k=1))
    assert Conn(route_port, token=None).post("/route", body)[0] == 401
    assert Conn(route_port, token="wrong").post("/route", body)[0] == 401
    status, health = Conn(route_port, token=None).get("/health")
    assert status == 200 and json.loads(health)["status"] == "ok"


def test_metrics_show_the_route_server(served):
    proc, route_port, docs, rng = served
    text = proc.get("/metrics")
    for family in ("kvpipe_processor_route_server_requests_total{outcome=\"native\"}",
                   "kvpipe_processor_route_server_native_latency_seconds_bucket",
                   "kvpipe_processor_route_server_in_flight", "kvpipe_processor_route_server_native_open 1.0",
                   "kvpipe_processor_route_server_hash_memo_entries", "kvpipe_processor_route_server_id_text_ids_total",
                   "kvpipe_processor_route_server_id_text_held_ids"):
        assert family in text, family
