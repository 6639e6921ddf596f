"""kvpipe.processors.core.webauth: the bearer-token middleware on a real aiohttp server, the bind rule, and
Faust's built-in pages switched off; the bridge's /metrics under the same rule."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import faust
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvpipe.processors.core import webauth
from kvpipe.producer.bridge.metrics import MetricsServer
from kvpipe.schemas.settings import load_settings


def test_bearer_ok_wants_the_scheme_and_the_exact_token():
    assert webauth.bearer_ok("Bearer abc", "abc") and webauth.bearer_ok("bearer  abc ", "abc")
    for header in (None, "", "abc", "Basic abc", "Bearer ab", "Bearer abcd", "Bearer"):
        assert not webauth.bearer_ok(header, "abc"), header


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _stats(request: web.Request) -> web.Response:
    return web.json_response({"n": 1})


async def _serve(token: str):
    app = web.Application(middlewares=[webauth.middleware(token)])
    app.router.add_get("/health", _health)
    app.router.add_get("/stats", _stats)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


def test_middleware_answers_401_json_with_www_authenticate_except_on_health():
    async def scenario():
        client = await _serve("t0ken")
        try:
            r = await client.get("/stats")
            body = await r.json()
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert body["error"] == "unauthorized" and "Authorization: Bearer" in body["detail"]
            r = await client.get("/stats", headers={"Authorization": "Bearer nope"})
            assert r.status == 401 and "does not carry" in (await r.json())["detail"]
            r = await client.get("/stats", headers={"Authorization": "Bearer t0ken"})
            assert r.status == 200 and await r.json() == {"n": 1}
            r = await client.get("/health")
            assert r.status == 200
            r = await client.get("/missing", headers={"Authorization": "Bearer t0ken"})
            assert r.status == 404
            r = await client.get("/missing")
            assert r.status == 401  # an unauthenticated caller learns nothing about which paths exist
        finally:
            await client.close()

    asyncio.run(scenario())


def test_install_turns_off_faust_pages_and_adds_the_middleware_only_with_a_token():
    app = faust.App("webauth-unit", broker="kafka://127.0.0.1:1")
    webauth.install(app, load_settings(env={"KVPIPE_API_TOKEN": "x"}))
    assert not (app.conf.web_router_enabled or app.conf.web_tables_enabled or app.conf.web_stats_enabled
                or app.conf.web_graph_enabled or app.conf.web_metrics_enabled)
    assert len(app.web.web_app.middlewares) == 1
    blueprints = [bp for _, bp in app.web.blueprints._enabled]
    assert not any("router" in str(bp) or "tables" in str(bp) or "graph" in str(bp) for bp in blueprints), blueprints

    open_app = faust.App("webauth-unit-open", broker="kafka://127.0.0.1:1")
    webauth.install(open_app, load_settings(env={}))
    assert len(open_app.web.web_app.middlewares) == 0 and not open_app.conf.web_router_enabled


def test_check_exposure_refuses_a_reachable_bind_without_token():
    with pytest.raises(webauth.ExposureError, match="KVPIPE_API_TOKEN"):
        webauth.check_exposure(load_settings(env={"KVPIPE_WEB_HOST": "0.0.0.0"}))
    webauth.check_exposure(load_settings(env={"KVPIPE_WEB_HOST": "0.0.0.0"}), insecure=True)
    webauth.check_exposure(load_settings(env={"KVPIPE_WEB_HOST": "0.0.0.0", "KVPIPE_INSECURE": "true"}))
    webauth.check_exposure(load_settings(env={"KVPIPE_WEB_HOST": "0.0.0.0", "KVPIPE_API_TOKEN": "t"}))
    webauth.check_exposure(load_settings(env={}))


def test_client_headers_carry_the_configured_token():
    assert webauth.client_headers(load_settings(env={})) == {}
    assert webauth.client_headers(load_settings(env={"KVPIPE_API_TOKEN": "t"})) == {"Authorization": "Bearer t"}


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _registry(value: float):
    from prometheus_client import CollectorRegistry, Gauge

    reg = CollectorRegistry()
    Gauge("kvpipe_x", "a test gauge", registry=reg).set(value)
    return reg


def test_bridge_metrics_endpoint_requires_the_token_when_one_is_set():
    server = MetricsServer("127.0.0.1", 0, _registry(1), token="m-tok").start()
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        status, body = _get(url)
        assert status == 401 and json.loads(body)["error"] == "unauthorized"
        assert _get(url, "wrong")[0] == 401
        status, body = _get(url, "m-tok")
        assert status == 200 and b"\nkvpipe_x 1.0\n" in body  # prometheus_client's exposition, HELP/TYPE included
        assert _get(url.replace("/metrics", "/other"), "m-tok")[0] == 404
    finally:
        server.close()
    open_server = MetricsServer("127.0.0.1", 0, _registry(2)).start()
    try:
        status, body = _get(f"http://127.0.0.1:{open_server.port}/metrics")
        assert status == 200 and b"\nkvpipe_x 2.0\n" in body
    finally:
        open_server.close()


@pytest.mark.parametrize("module", ["kvpipe.processors.routing.app", "kvpipe.processors.analytics.app"])
def test_the_exposure_rule_holds_however_the_app_is_started(module, tmp_path):
    """`faust -A <module> worker` imports the app module without the CLI: the import itself refuses a public bind
    without a token, and accepts it with one or with the insecure setting."""
    import os
    import subprocess
    import sys

    from kvpipe.bench.procrun import REPO

    base = {k: v for k, v in os.environ.items() if not k.startswith("KVPIPE_")}
    base.update(PYTHONPATH=str(REPO), KVPIPE_WEB_HOST="0.0.0.0", KVPIPE_STATE_DIR=str(tmp_path))
    code = f"import {module}"
    refused = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, cwd=tmp_path)
    assert refused.returncode != 0 and "refusing to serve HTTP on 0.0.0.0" in refused.stderr
    for extra in ({"KVPIPE_API_TOKEN": "t0k3n"}, {"KVPIPE_INSECURE": "true"}):
        ok = subprocess.run([sys.executable, "-c", code], env={**base, **extra}, capture_output=True, text=True,
                            cwd=tmp_path)
        assert ok.returncode == 0, ok.stderr[-2000:]
