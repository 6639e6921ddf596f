"""The analytics app's HTTP API behind the same bearer token as the routing app: a real
`kvpipe analytics` on the shared broker with KVPIPE_API_TOKEN set. Analyst SQL, stats and metrics
need the token; /health does not; `kvpipe sql` sends the token from its environment; a reachable
bind without a token refuses to start; the token is in no log line.
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

import pytest

from kvpipe.bench.procrun import REPO, ProcessorProcess, free_port
from tests.integration.processor_fixture import ProcessorTopics
from tests.integration.test_api_auth import call

pytestmark = pytest.mark.integration

TOKEN = "atok-" + secrets.token_hex(16)


def _cli(env: dict[str, str], cwd: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    full.update(env)
    full["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "kvpipe", *args], env=full, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def _sql(url: str, sql: str, token: str | None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + "/sql", data=json.dumps({"sql": sql}).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_analytics_endpoints_need_the_token_and_kvpipe_sql_sends_it(kafka_bootstrap: str, tmp_path: Path):
    topics = ProcessorTopics(kafka_bootstrap, "aauth", 1)
    port = free_port()
    env = topics.env(f"aauth-{topics.tag}", free_port(), str(tmp_path / "state"), KVPIPE_API_TOKEN=TOKEN,
                     KVPIPE_ANALYTICS_ID=f"aauth-an-{topics.tag}", KVPIPE_ANALYTICS_WEB_PORT=str(port),
                     KVPIPE_ANALYTICS_SNAPSHOT_TOPIC=topics.analytics_snapshots)
    app = ProcessorProcess(env, tmp_path / "analytics.log", command="analytics", args=["--loglevel", "info"])
    app.start(timeout=90)
    try:
        for path in ("/stats", "/metrics"):
            assert call(app.url + path)[0] == 401, path
            assert call(app.url + path, token="wrong")[0] == 401, path
            assert call(app.url + path, token=TOKEN)[0] == 200, path
        status, _, health = call(app.url + "/health")
        assert status == 200
        store = json.loads(health)["store"]  # open: the store's state, never the engine's error text
        assert "state" in store and "reason" not in store
        status, _, body = call(app.url + "/openapi.json")  # open, as the routing app's: it describes, reveals no state
        assert status == 200 and set(json.loads(body)["paths"]) >= {"/sql", "/stats", "/health", "/metrics"}
        status, body = _sql(app.url, "SELECT count() AS n FROM kv_events_final", None)
        assert status == 401 and body["error"] == "unauthorized"
        status, body = _sql(app.url, "SELECT count() AS n FROM kv_events_final", TOKEN)
        assert status == 200 and body["rows"] == [[0]]
        # /sql bodies are read as the routing app reads its own: bounded, and every refusal is JSON
        for raw, want in ((b'{"sql": ' + b"[" * 40 + b"]" * 40 + b"}", 400), (b"not json", 400),
                          (json.dumps({"sql": "SELECT 1 -- " + "x" * 600_000}).encode(), 413),
                          (json.dumps({"sql": "SELECT 1 WHERE " + "(" * 3000 + "1" + ")" * 3000}).encode(), 400)):
            req = urllib.request.Request(app.url + "/sql", data=raw, method="POST",
                                         headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
            try:
                urllib.request.urlopen(req, timeout=30)
                raise AssertionError(f"{raw[:40]!r} was accepted")
            except urllib.error.HTTPError as exc:
                assert exc.code == want and "error" in json.loads(exc.read()), raw[:40]
        cli_env = {"KVPIPE_ANALYTICS_WEB_PORT": str(port), "KVPIPE_STATE_DIR": str(tmp_path / "state")}
        ok = _cli({**cli_env, "KVPIPE_API_TOKEN": TOKEN}, tmp_path, "sql", "--json", "SELECT 1 AS one")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["data"] == [{"one": 1}]
        refused = _cli(cli_env, tmp_path, "sql", "SELECT 1 AS one")
        assert refused.returncode == 1 and "unauthorized" in refused.stderr
        time.sleep(0.5)
        assert TOKEN not in (tmp_path / "analytics.log").read_text(errors="replace")
    finally:
        app.stop()
        topics.delete()


def test_analytics_on_a_reachable_address_without_a_token_refuses_to_start(kafka_bootstrap: str, tmp_path: Path):
    env = {"KVPIPE_KAFKA_BOOTSTRAP": kafka_bootstrap, "KVPIPE_STATE_DIR": str(tmp_path / "state"),
           "KVPIPE_ANALYTICS_WEB_PORT": str(free_port())}
    refused = _cli(env, tmp_path, "analytics", "--web-host", "0.0.0.0")
    assert refused.returncode == 2
    assert "KVPIPE_API_TOKEN" in refused.stderr and "--insecure" in refused.stderr
