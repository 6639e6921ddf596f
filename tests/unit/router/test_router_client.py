"""The router client, sync and async, against a small aiohttp server started here that decodes
requests with the router's own Structs and answers canned `RouteAnswer`s built from them."""
from __future__ import annotations

import asyncio
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import pytest
from aiohttp import web

from kvpipe.processors.router.client import AsyncRouterClient, RouterClient
from kvpipe.processors.router.model import FinishedReport, RouteError, RouteRequest, SentReport, decode_request
from kvpipe.processors.router.openapi import ANSWER_EXAMPLE, encoded

TOKEN = "s3cret-token"


class CannedRouter:
    """Records what it was sent and from which client port (one port = one reused connection)."""

    def __init__(self) -> None:
        self.requests: list[RouteRequest] = []
        self.reports: list[object] = []
        self.ports: list[int] = []
        self.loop = asyncio.new_event_loop()
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.auth])
        app.router.add_post("/route", self.route)
        app.router.add_post("/route/sent", self.sent)
        app.router.add_post("/route/finished", self.finished)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=encoded(), content_type="application/json")

    @web.middleware
    async def auth(self, request: web.Request, handler):
        self.ports.append(request.transport.get_extra_info("peername")[1])
        if request.path != "/openapi.json" and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "unauthorized", "detail": "bearer token missing or wrong"}, status=401)
        return await handler(request)

    async def route(self, request: web.Request) -> web.Response:
        try:
            req = decode_request(await request.read())
        except RouteError as exc:
            return web.Response(body=msgspec.json.encode(exc.body()), status=exc.status, content_type="application/json")
        self.requests.append(req)
        answer = msgspec.structs.replace(ANSWER_EXAMPLE, num_tokens=len(req.token_ids or ()))
        return web.Response(body=msgspec.json.encode(answer), content_type="application/json")

    async def sent(self, request: web.Request) -> web.Response:
        self.reports.append(msgspec.json.decode(await request.read(), type=SentReport))
        return web.Response(status=204)

    async def finished(self, request: web.Request) -> web.Response:
        self.reports.append(msgspec.json.decode(await request.read(), type=FinishedReport))
        return web.Response(status=204)

    def start(self) -> None:
        ready = threading.Event()

        async def serve() -> None:
            self.runner = web.AppRunner(self.app())
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            host, port = self.runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
            ready.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self.loop)
        assert ready.wait(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture()
def server():
    s = CannedRouter()
    s.start()
    yield s
    s.stop()


def test_sync_client_round_trip_typed_over_one_kept_alive_connection(server):
    with RouterClient(server.url, token=TOKEN) as client:
        for n in (3, 5, 8):
            answer = client.route(RouteRequest(token_ids=list(range(n)), include_zero=True))
            assert answer.chosen == "node-a" and answer.num_tokens == n
            assert answer.nodes[0].groups[1].kind == "sliding_window" and answer.nodes[0].load.running == 2
        client.sent("r1", "node-a", [1, 2, 3])
        client.finished("r1")
        assert client.openapi()["openapi"] == "3.1.0"
        assert TOKEN not in repr(client)
    assert [r.token_ids for r in server.requests] == [[0, 1, 2], [0, 1, 2, 3, 4], list(range(8))]
    assert server.requests[0].include_zero is True
    assert server.reports == [SentReport("r1", "node-a", [1, 2, 3]), FinishedReport("r1")]
    assert len(set(server.ports)) == 1  # keep-alive: every call on the same connection


def test_sync_client_errors_carry_the_servers_reason_and_never_the_token(server):
    with RouterClient(server.url, token="not-the-tok-987") as client:
        with pytest.raises(RouteError) as err:
            client.route(RouteRequest(token_ids=[1]))
        assert err.value.status == 401 and err.value.error == "unauthorized" and "tok-987" not in str(err.value)
    with RouterClient(server.url + "/", token=TOKEN) as client:
        with pytest.raises(RouteError) as err:
            client._call("POST", "/route", b'{"token_ids": [1], "bogus": 1}')
        assert err.value.status == 400 and "bogus" in err.value.detail


def test_async_client_round_trip_reuses_one_session(server):
    async def main() -> None:
        async with AsyncRouterClient(server.url, token=TOKEN) as client:
            answers = [await client.route(RouteRequest(token_ids=list(range(n)))) for n in (2, 4)]
            assert [a.num_tokens for a in answers] == [2, 4] and answers[0].nodes[0].node_id == "node-a"
            session = client._session
            await client.sent("r2", "node-a", [9])
            await client.finished("r2")
            assert client._session is session

    asyncio.run(main())
    assert server.reports == [SentReport("r2", "node-a", [9]), FinishedReport("r2")]
    assert len(set(server.ports)) == 1


def test_async_client_raises_the_servers_error():
    async def main(url: str) -> RouteError:
        async with AsyncRouterClient(url) as client:  # no token
            try:
                await client.route(RouteRequest(token_ids=[1]))
            except RouteError as exc:
                return exc
        raise AssertionError("no error")

    s = CannedRouter()
    s.start()
    try:
        exc = asyncio.run(main(s.url))
    finally:
        s.stop()
    assert exc.status == 401 and exc.detail == "bearer token missing or wrong"


def test_a_bad_url_is_refused_with_the_expected_form():
    with pytest.raises(ValueError, match="expected http"):
        RouterClient("localhost:8080")


def test_no_answer_is_an_oserror_naming_the_url_and_never_the_token():
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with RouterClient(url, token=TOKEN, timeout_s=2.0) as client:
        with pytest.raises(OSError, match=url) as err:
            client.route(RouteRequest(token_ids=[1]))
    assert TOKEN not in str(err.value)

    async def main() -> None:
        async with AsyncRouterClient(url, token=TOKEN, timeout_s=2.0) as client:
            await client.health()

    with pytest.raises(OSError, match=url):
        asyncio.run(main())


class _ClosesAfterEachAnswer(BaseHTTPRequestHandler):
    """Answers as HTTP/1.1 with keep-alive implied, then closes the connection: a server dropping idle clients."""
    protocol_version = "HTTP/1.1"
    ports: list[int] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.ports.append(self.client_address[1])
        req = decode_request(self.rfile.read(int(self.headers["Content-Length"])))
        body = msgspec.json.encode(msgspec.structs.replace(ANSWER_EXAMPLE, num_tokens=len(req.token_ids or ())))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


def test_a_connection_the_server_closed_between_calls_is_reopened():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ClosesAfterEachAnswer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with RouterClient(f"http://127.0.0.1:{httpd.server_port}") as client:
            assert [client.route(RouteRequest(token_ids=list(range(n)))).num_tokens for n in (1, 2, 3)] == [1, 2, 3]
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert len(set(_ClosesAfterEachAnswer.ports)) == 3  # each call after a close on a new connection
