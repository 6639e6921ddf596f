"""The processor's HTTP API behind a bearer token (kvpipe.processors.core.webauth), as a user meets it: a real
`kvpipe processor` on the shared broker with KVPIPE_API_TOKEN set, asked with no token, a wrong
one and the right one; Faust's own pages gone; the bind rule of `--web-host`; `kvpipe route`
sending the token from its environment; and the token in no log line.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Producer

from kvpipe.bench.procrun import REPO, ProcessorProcess, free_port
from kvpipe.producer.publisher import Publisher
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockStored
from kvpipe.schemas.settings import load_settings
from tests.integration.kafka_reading import client_config
from tests.integration.processor_fixture import ProcessorTopics

pytestmark = pytest.mark.integration

TOKEN = "tok-" + secrets.token_hex(16)
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]
PROTECTED = [("GET", "/nodes"), ("GET", "/stats"), ("GET", "/metrics"), ("POST", "/route")]
FAUST_PAGES = ["/router", "/router/", "/table", "/table/", "/", "/graph", "/graph/", "/stats/", "/assignment/",
               "/performance/"]


def call(url: str, method: str = "GET", token: str | None = None, scheme: str = "Bearer") -> tuple[int, dict, bytes]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"{scheme} {token}"
    data = json.dumps({"block_hashes": {"0": [1, 2]}}).encode() if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


class Protected:
    def __init__(self, kafka_bootstrap: str, tmp: Path) -> None:
        self.topics = ProcessorTopics(kafka_bootstrap, "auth", 1)
        self.env = self.topics.env(f"auth-{self.topics.tag}", free_port(), str(tmp / "state"),
                                   KVPIPE_API_TOKEN=TOKEN, KVPIPE_SNAPSHOT_EVERY_S="3600")
        self.proc = ProcessorProcess(self.env, tmp / "processor.log", args=["--loglevel", "info"])
        self.proc.start()
        self.tmp = tmp


@pytest.fixture(scope="module")
def protected(kafka_bootstrap: str, tmp_path_factory) -> Protected:
    p = Protected(kafka_bootstrap, tmp_path_factory.mktemp("auth"))
    settings = load_settings(overrides={"kafka_bootstrap": kafka_bootstrap, "events_topic": p.topics.events,
                                        "heartbeat_s": 3600.0})
    with Publisher(settings, "auth-node", group_specs=SPECS, epoch=1) as pub:
        pub.publish([BlockStored(block_hashes=[1, 2, 3], parent_block_hash=None, token_ids=[], block_size=16,
                                 lora_id=None, medium="GPU", lora_name=None, group_idx=0)])
        pub.flush(30)
    p.proc.wait_offsets(p.topics.end_offsets())
    yield p
    p.proc.stop()
    p.topics.delete()


def test_every_endpoint_but_health_needs_the_token(protected: Protected):
    base = protected.proc.url
    for method, path in PROTECTED:
        for token, scheme in ((None, "Bearer"), ("wrong-" + TOKEN, "Bearer"), (TOKEN, "Basic"), (TOKEN[:-1], "Bearer")):
            status, headers, body = call(base + path, method, token, scheme)
            assert status == 401, (method, path, token, status)
            assert headers.get("WWW-Authenticate") == "Bearer"
            answer = json.loads(body)
            assert answer["error"] == "unauthorized" and answer["detail"] and TOKEN not in body.decode()
        status, _, body = call(base + path, method, TOKEN)
        assert status == 200, (method, path, body[:300])
    status, _, body = call(base + "/route", "POST", TOKEN)
    assert [n["node_id"] for n in json.loads(body)["nodes"]] == ["auth-node"]
    status, _, body = call(base + "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = call(base + "/openapi.json")  # open: the document describes, it reveals no state
    assert status == 200 and json.loads(body)["paths"]["/route"]
    for path in ("/route/sent", "/route/finished"):
        assert call(base + path, "POST")[0] == 401, path


def test_faust_builtin_pages_are_not_served(protected: Protected):
    for path in FAUST_PAGES:
        assert call(protected.proc.url + path)[0] == 401, path  # nothing is told without the token
        status, _, body = call(protected.proc.url + path, token=TOKEN)
        # "/" is Faust's production index ({"status": "OK"}); the pages that list topics,
        # partitions, tables or worker URLs answer 404
        if path == "/":
            assert status == 200 and json.loads(body) == {"status": "OK"}
        else:
            assert status == 404, (path, status, body[:200])


def _cli(env: dict[str, str], cwd: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvpipe", *args], env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_kvpipe_route_sends_the_token_from_its_environment(protected: Protected):
    env = {"KVPIPE_WEB_PORT": str(protected.proc.port)}
    ok = _cli({**env, "KVPIPE_API_TOKEN": TOKEN}, protected.tmp, "route", "--hashes", "1,2,3", "--group", "0", "--json")
    assert ok.returncode == 0, ok.stderr
    assert [n["node_id"] for n in json.loads(ok.stdout)["nodes"]] == ["auth-node"]
    token_file = protected.tmp / "token"
    token_file.write_text(TOKEN + "\n")  # a file's trailing newline is not part of the token
    ok = _cli({**env, "KVPIPE_API_TOKEN_FILE": str(token_file)}, protected.tmp, "route", "--hashes", "1")
    assert ok.returncode == 0, ok.stderr
    refused = _cli(env, protected.tmp, "route", "--hashes", "1,2,3")
    assert refused.returncode == 1 and "unauthorized" in refused.stderr


def test_the_token_is_in_no_log_line(protected: Protected):
    call(protected.proc.url + "/stats", token=TOKEN)
    call(protected.proc.url + "/stats", token="wrong")
    time.sleep(0.5)
    log = (protected.tmp / "processor.log").read_text(errors="replace")
    assert TOKEN not in log


def test_a_reachable_bind_without_a_token_refuses_to_start_and_starts_with_insecure(kafka_bootstrap: str,
                                                                                   tmp_path: Path):
    topics = ProcessorTopics(kafka_bootstrap, "bind", 1)
    try:
        env = topics.env(f"bind-{topics.tag}", free_port(), str(tmp_path / "state"))
        refused = _cli(env, tmp_path, "processor", "--web-host", "0.0.0.0", timeout=60)
        assert refused.returncode == 2
        assert "KVPIPE_API_TOKEN" in refused.stderr and "--insecure" in refused.stderr
        proc = ProcessorProcess(env, tmp_path / "insecure.log", args=["--web-host", "0.0.0.0",
                                                                        "--insecure"])
        proc.start()
        try:
            assert call(proc.url + "/stats")[0] == 200  # open, as the operator asked
        finally:
            proc.stop()
    finally:
        topics.delete()


def test_workers_of_a_token_protected_group_ask_each_other_with_the_token(kafka_bootstrap: str, tmp_path: Path):
    """Scatter-gather (processors/routing/scatter.py): each worker holds one partition; a /route on either
    one is complete only if its peer accepted the worker's own bearer token."""
    topics = ProcessorTopics(kafka_bootstrap, "authgrp", 2)
    workers: list[ProcessorProcess] = []
    try:
        producer = Producer(client_config(kafka_bootstrap))
        for partition, node in enumerate(("left-node", "right-node")):
            ts = time.time()
            events = [BlockStored(block_hashes=[7, 8], parent_block_hash=None, token_ids=[], block_size=16,
                                  lora_id=None, medium="GPU", lora_name=None, group_idx=0)]
            env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=0, ts=ts, sent_ts=ts, num_events=1,
                           group_specs=SPECS, batch=msgspec.Raw(encode_vllm_batch(events, ts)))
            producer.produce(topics.events, key=node.encode(), value=encode_envelope(env), headers=KAFKA_HEADERS,
                             partition=partition)
        producer.flush(30)
        group_id = f"authgrp-{topics.tag}"
        for name in ("a", "b"):
            env = topics.env(group_id, free_port(), str(tmp_path / f"state-{name}"), KVPIPE_API_TOKEN=TOKEN,
                             KVPIPE_SNAPSHOT_EVERY_S="3600")
            workers.append(ProcessorProcess(env, tmp_path / f"worker-{name}.log").start())
        deadline = time.monotonic() + 90
        owned: list[list[int]] = []
        while time.monotonic() < deadline:
            owned = [w.get("/stats")["cluster"]["owned_partitions"] for w in workers]
            if sorted(p for o in owned for p in o) == [0, 1] and all(owned):
                break
            time.sleep(0.3)
        assert sorted(p for o in owned for p in o) == [0, 1] and all(owned), owned
        for w in workers:
            answer = w.route({"0": [7, 8]})
            assert not answer["partial"], answer
            assert sorted(n["node_id"] for n in answer["nodes"]) == ["left-node", "right-node"]
        for name in ("a", "b"):
            assert TOKEN not in (tmp_path / f"worker-{name}.log").read_text(errors="replace")
    finally:
        for w in workers:
            w.stop()
        topics.delete()
