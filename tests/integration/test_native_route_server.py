"""The native route server (native/src/serve.rs, `native.serve_static`) as a router meets it:
real sockets on loopback, a real aiohttp app as the upstream it forwards to.

`serve_static` answers every `POST /route` with a fixed JSON, except a body holding the forward
marker (left to the upstream) or the panic marker (the decider panics). What is checked is the
shell around the decision: keep-alive, the bearer token and its 401 bodies (as
`processors/core/webauth.py` writes them), the size and time limits (as `processors/core/httpbody.py`
words them), forwarding with the Authorization header kept, the counters, and stopping.
Needs no broker: only the built extension.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvpipe.processors.core import native
from tests.nativecheck import require_native_core

require_native_core()

TOKEN = "tok-route-server"
ANSWER = b'{"chosen": "node-a", "source": "native"}'
FORWARD = b"please-forward"
BOOM = b"please-panic"
MAX_BODY = 64 * 1024
READ_TIMEOUT_S = 0.5
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Upstream:
    """An aiohttp app on its own thread and loop that records what reached it and answers 202
    with it as JSON (a status and content type the native server never makes up itself)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from aiohttp import web

        async def echo(request: web.Request) -> web.Response:
            seen = {"method": request.method, "path_qs": request.path_qs,
                    "authorization": request.headers.get("Authorization"),
                    "body": (await request.read()).decode()}
            self.seen.append(seen)
            return web.json_response(seen, status=202, content_type="application/x-upstream+json")

        async def start() -> web.AppRunner:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", echo)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            return runner

        asyncio.set_event_loop(self._loop)
        self.runner = self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self.runner.cleanup())
        self._loop.close()

    def __enter__(self) -> Upstream:
        self._thread.start()
        assert self._ready.wait(10), "the aiohttp upstream did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    with Upstream() as up:
        yield up


@pytest.fixture
def start() -> Iterator[Callable[..., Any]]:
    """Factory: a serve_static server on a free loopback port; every one started is stopped."""
    started: list[Any] = []

    def make(upstream_port: int | None = None, token: str | None = TOKEN) -> Any:
        srv = native.serve_static("127.0.0.1", 0, 2, token, MAX_BODY, READ_TIMEOUT_S, upstream_port,
                                  ANSWER, FORWARD, panic_if_contains=BOOM)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop(1.0)


def call(port: int, method: str, path: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, wait_s: float = 0.0) -> bytes:
    """Send `data`, maybe wait, then read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        if wait_s:
            time.sleep(wait_s)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def split_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
    return int(lines[0].split()[1]), headers, body


def test_native_answer(start: Callable[..., Any]) -> None:
    srv = start()
    status, headers, body = call(srv.port, "POST", "/route", json.dumps(list(range(2048))).encode(), AUTH)
    assert (status, body) == (200, ANSWER)
    assert headers["content-type"] == "application/json"


def test_keep_alive_serves_many_requests_on_one_connection(start: Callable[..., Any]) -> None:
    srv = start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    body = json.dumps(list(range(2048))).encode()
    local_ports = set()
    for _ in range(200):
        conn.request("POST", "/route", body=body, headers=AUTH)
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (200, ANSWER)
        assert not resp.will_close
        local_ports.add(conn.sock.getsockname()[1])
    conn.close()
    assert len(local_ports) == 1, "the client had to reconnect: the server closed a kept-alive connection"
    assert srv.stats()["requests"]["native"] == 200


def test_token_required_like_the_python_app_and_health_open(start: Callable[..., Any]) -> None:
    srv = start()
    status, headers, body = call(srv.port, "POST", "/route", b"[1]")
    assert status == 401
    assert headers["www-authenticate"] == "Bearer"
    assert headers["content-type"] == "application/json"
    # byte for byte what processors/core/webauth.py answers
    from kvpipe.processors.core.webauth import unauthorized_body
    assert body == unauthorized_body(False)
    status, _, body = call(srv.port, "POST", "/route", b"[1]", {"Authorization": "Bearer wrong"})
    assert (status, body) == (401, unauthorized_body(True))
    status, _, _ = call(srv.port, "GET", "/nodes", None, {"Authorization": f"Basic {TOKEN}"})
    assert status == 401
    status, headers, body = call(srv.port, "GET", "/health")
    assert status == 200
    assert json.loads(body) == {"status": "ok", "server": "native"}


def test_oversize_body_is_413(start: Callable[..., Any]) -> None:
    srv = start()
    # refused on the declared length alone: the body is never read
    raw = raw_exchange(srv.port, f"POST /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                                 f"Content-Length: {MAX_BODY + 1}\r\n\r\n".encode())
    status, headers, body = split_response(raw)
    assert status == 413
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"error": "body too large",
                                "detail": f"Content-Length {MAX_BODY + 1}; the limit is {MAX_BODY}"}


def test_stalled_body_is_408(start: Callable[..., Any]) -> None:
    srv = start()
    raw = raw_exchange(srv.port, f"POST /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                                 f"Content-Length: 1000\r\n\r\n[1, 2, 3".encode(), wait_s=READ_TIMEOUT_S + 0.3)
    status, headers, body = split_response(raw)
    assert status == 408
    assert headers["connection"] == "close"
    assert json.loads(body) == {
        "error": "request body timeout",
        "detail": f"the body did not arrive within {READ_TIMEOUT_S:g} s (a Content-Length larger than the body sent?)"}
    assert srv.stats()["requests"]["timeout"] == 1


def test_declined_route_and_other_paths_are_forwarded(start: Callable[..., Any], upstream: Upstream) -> None:
    srv = start(upstream.port)
    upstream.seen.clear()
    body = b'{"token_ids": [1, 2], "note": "' + FORWARD + b'"}'
    status, headers, answer = call(srv.port, "POST", "/route", body, AUTH)
    assert status == 202
    assert headers["content-type"].startswith("application/x-upstream+json")
    assert json.loads(answer) == {"method": "POST", "path_qs": "/route", "authorization": f"Bearer {TOKEN}",
                                  "body": body.decode()}
    status, _, answer = call(srv.port, "GET", "/nodes?x=1", None, AUTH)
    assert status == 202
    assert json.loads(answer) == {"method": "GET", "path_qs": "/nodes?x=1", "authorization": f"Bearer {TOKEN}",
                                  "body": ""}
    # a /route the native side answers never reaches the upstream
    status, _, answer = call(srv.port, "POST", "/route", b"[1, 2]", AUTH)
    assert (status, answer) == (200, ANSWER)
    assert [s["path_qs"] for s in upstream.seen] == ["/route", "/nodes?x=1"]
    assert srv.stats()["requests"]["forwarded"] == 2


def test_without_upstream_declined_is_503_and_others_404(start: Callable[..., Any]) -> None:
    srv = start(None)
    status, headers, body = call(srv.port, "POST", "/route", FORWARD, AUTH)
    assert status == 503
    assert headers["content-type"] == "application/json"
    assert json.loads(body)["error"] == "no upstream"
    status, _, body = call(srv.port, "GET", "/nodes?x=1", None, AUTH)
    assert status == 404
    assert set(json.loads(body)) == {"error", "detail"}


def test_a_panicking_decision_is_a_500_and_the_server_lives_on(start: Callable[..., Any]) -> None:
    srv = start()
    status, _, body = call(srv.port, "POST", "/route", BOOM, AUTH)
    assert status == 500
    assert json.loads(body)["error"] == "internal error"
    assert call(srv.port, "POST", "/route", b"[1]", AUTH)[0] == 200
    stats = srv.stats()
    assert (stats["panics"], stats["requests"]["error"], stats["requests"]["native"]) == (1, 1, 1)


def test_counters_match_what_was_sent(start: Callable[..., Any], upstream: Upstream) -> None:
    srv = start(upstream.port)
    sent = {"native": 7, "forwarded": 3, "unauthorized": 2, "too_large": 1, "timeout": 1, "bad_request": 0,
            "error": 1, "health": 4}
    for _ in range(sent["native"]):
        call(srv.port, "POST", "/route", b"[1, 2, 3]", AUTH)
    for _ in range(2):
        call(srv.port, "POST", "/route", FORWARD, AUTH)
    call(srv.port, "GET", "/nodes", None, AUTH)
    call(srv.port, "POST", "/route", b"[1]")
    call(srv.port, "POST", "/route", b"[1]", {"Authorization": "Bearer nope"})
    raw_exchange(srv.port, f"POST /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                           f"Content-Length: {10 * MAX_BODY}\r\n\r\n".encode())
    raw_exchange(srv.port, f"POST /route HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                           f"Content-Length: 10\r\n\r\n[".encode(), wait_s=READ_TIMEOUT_S + 0.3)
    call(srv.port, "POST", "/route", BOOM, AUTH)
    for _ in range(sent["health"]):
        call(srv.port, "GET", "/health")

    stats = srv.stats()
    assert stats["requests"] == sent
    assert stats["in_flight"] == 0
    assert stats["panics"] == 1
    native, whole = stats["native_latency"], stats["request_latency"]
    assert native["count"] == sent["native"]
    assert whole["count"] == sum(sent.values())
    for hist in (native, whole):
        assert hist["bounds"][-1] == math.inf
        assert len(hist["bounds"]) == len(hist["cumulative"])
        assert hist["cumulative"] == sorted(hist["cumulative"])
        assert hist["cumulative"][-1] == hist["count"]
        assert hist["sum"] >= 0
    assert whole["sum"] >= READ_TIMEOUT_S  # the stalled request waited out the timeout

    # what a /metrics collector hands prometheus_client
    from prometheus_client.core import HistogramMetricFamily
    from prometheus_client.utils import floatToGoString
    buckets = [(floatToGoString(b), c) for b, c in zip(native["bounds"], native["cumulative"])]
    family = HistogramMetricFamily("kvpipe_native_route_seconds", "native route answers", buckets=buckets,
                                   sum_value=native["sum"])
    assert family.samples[-2].value == sent["native"]  # count (= the +Inf bucket), then sum


def test_stop_ends_the_server(start: Callable[..., Any]) -> None:
    srv = start()
    port = srv.port
    assert call(port, "GET", "/health")[0] == 200
    idle = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # a kept-alive connection left idle
    idle.request("GET", "/health")
    idle.getresponse().read()
    srv.stop(2.0)
    assert not srv.running
    srv.stop(2.0)  # idempotent
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
        idle.request("GET", "/health")
        idle.getresponse()
    idle.close()


def test_bind_failure_is_an_os_error(start: Callable[..., Any]) -> None:
    srv = start()
    with pytest.raises(OSError):
        native.serve_static("127.0.0.1", srv.port, 1, None, MAX_BODY, 1.0, None, ANSWER, FORWARD)
