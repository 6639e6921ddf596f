"""A Python client for the router endpoints, for routers to import: sync (`RouterClient`, one
keep-alive `http.client` connection) and async (`AsyncRouterClient`, one reused aiohttp session).

Requests and answers are the Structs of `kvpipe.processors.router.model` — the same classes the server
decodes and encodes — so a caller gets typed answers (`answer.chosen`, `answer.nodes[0].gpu_tokens`).
A non-2xx answer raises `RouteError` with the server's status, error and detail. With a token,
every call sends `Authorization: Bearer <token>`; the token never appears in a repr or an error.

Neither client is safe to share across threads (sync) or event loops (async): give each its own.
"""
from __future__ import annotations

import http.client
import urllib.parse
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec

from kvpipe.processors.router.model import ErrorBody, FinishedReport, RouteAnswer, RouteError, RouteRequest, SentReport

T = TypeVar("T")
_encoder = msgspec.json.Encoder()
_answer_decoder = msgspec.json.Decoder(RouteAnswer)
_error_decoder = msgspec.json.Decoder(ErrorBody)

ROUTE, SENT, FINISHED, OPENAPI, HEALTH = "/route", "/route/sent", "/route/finished", "/openapi.json", "/health"


def _headers(token: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        h["Authorization"] = f"Bearer {token}"
    return h


def _error(status: int, body: bytes) -> RouteError:
    try:
        err = _error_decoder.decode(body)
        return RouteError(status, err.error, err.detail)
    except (msgspec.DecodeError, msgspec.ValidationError):
        text = body[:200].decode("utf-8", "replace")
        return RouteError(status, f"HTTP {status}", text or None)


class RouterClient:
    """Blocking client over one persistent HTTP/1.1 connection (reopened once if the server
    closed it between calls)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 5.0) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"router URL {base_url!r}: expected http(s)://host[:port][/prefix]")
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port
        self._prefix = url.path.rstrip("/")
        self._headers = _headers(token)
        self._timeout = timeout_s
        self._conn: http.client.HTTPConnection | None = None

    def __repr__(self) -> str:  # no token
        return f"RouterClient({'https' if self._https else 'http'}://{self._host}:{self._port}{self._prefix})"

    def route(self, request: RouteRequest) -> RouteAnswer:
        return _answer_decoder.decode(self._call("POST", ROUTE, _encoder.encode(request)))

    def sent(self, request_id: str, node_id: str, token_ids: Sequence[int]) -> None:
        self._call("POST", SENT, _encoder.encode(SentReport(request_id, node_id, list(token_ids))))

    def finished(self, request_id: str) -> None:
        self._call("POST", FINISHED, _encoder.encode(FinishedReport(request_id)))

    def openapi(self) -> dict[str, Any]:
        return msgspec.json.decode(self._call("GET", OPENAPI, None))

    def health(self) -> dict[str, Any]:
        """The worker's liveness answer (status, owned partitions, uptime)."""
        return msgspec.json.decode(self._call("GET", HEALTH, None))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> http.client.HTTPConnection:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self._timeout)
        return self._conn

    def _call(self, method: str, path: str, body: bytes | None) -> bytes:
        for attempt in (0, 1):
            conn = self._connect()
            try:
                conn.request(method, self._prefix + path, body=body, headers=self._headers)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                # the server closed the idle keep-alive connection: reopen once (a route request
                # changes nothing on the server unless it carries a request_id, and then the
                # latest report wins, so resending is safe)
                self.close()
                if attempt:
                    raise
        if resp.will_close:
            self.close()
        if not 200 <= resp.status < 300:
            raise _error(resp.status, data)
        return data


class AsyncRouterClient:
    """asyncio client over one `aiohttp.ClientSession` (created on first use, closed by `close`)."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 5.0) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"router URL {base_url!r}: expected http(s)://host[:port][/prefix]")
        self._base = base_url.rstrip("/")
        self._headers = _headers(token)
        self._timeout = timeout_s
        self._session: Any = None

    def __repr__(self) -> str:
        return f"AsyncRouterClient({self._base})"

    async def route(self, request: RouteRequest) -> RouteAnswer:
        return _answer_decoder.decode(await self._call("POST", ROUTE, _encoder.encode(request)))

    async def sent(self, request_id: str, node_id: str, token_ids: Sequence[int]) -> None:
        await self._call("POST", SENT, _encoder.encode(SentReport(request_id, node_id, list(token_ids))))

    async def finished(self, request_id: str) -> None:
        await self._call("POST", FINISHED, _encoder.encode(FinishedReport(request_id)))

    async def openapi(self) -> dict[str, Any]:
        return msgspec.json.decode(await self._call("GET", OPENAPI, None))

    async def health(self) -> dict[str, Any]:
        """The worker's liveness answer (status, owned partitions, uptime)."""
        return msgspec.json.decode(await self._call("GET", HEALTH, None))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "AsyncRouterClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, body: bytes | None) -> bytes:
        import aiohttp  # the sync client must not need it

        if self._session is None:
            self._session = aiohttp.ClientSession(headers=self._headers,
                                                  timeout=aiohttp.ClientTimeout(total=self._timeout))
        async with self._session.request(method, self._base + path, data=body) as resp:
            data = await resp.read()
            if not 200 <= resp.status < 300:
                raise _error(resp.status, data)
            return data
