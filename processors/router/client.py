"""A Python client for the router endpoints, for routers to import: sync (`RouterClient`, one
`httpx.Client` keeping its connection alive) and async (`AsyncRouterClient`, one reused `httpx.AsyncClient`).

Requests and answers are the Structs of `kvpipe.processors.router.model` — the same classes the server
decodes and encodes — so a caller gets typed answers (`answer.chosen`, `answer.nodes[0].gpu_tokens`).
A non-2xx answer raises `RouteError` with the server's status, error and detail; no answer at all (refused,
reset, timed out) an OSError naming the URL (kvpipe.processors.core.httpclient). With a token,
every call sends `Authorization: Bearer <token>`; the token never appears in a repr or an error.

Neither client is safe to share across threads (sync) or event loops (async): give each its own.
"""
from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
import msgspec

from kvpipe.processors.core.httpclient import tls_context, transport_errors
from kvpipe.processors.router.model import ErrorBody, FinishedReport, RouteAnswer, RouteError, RouteRequest, SentReport

T = TypeVar("T")
_encoder = msgspec.json.Encoder()
_answer_decoder = msgspec.json.Decoder(RouteAnswer)
_error_decoder = msgspec.json.Decoder(ErrorBody)

ROUTE, SENT, FINISHED, OPENAPI, HEALTH = "/route", "/route/sent", "/route/finished", "/openapi.json", "/health"

# The server closed the kept-alive connection just as the request went out on it (httpx drops connections it
# sees closed before reusing them; this is the race left): the request is sent once more, on a new connection.
# Safe: a route request changes nothing on the server unless it carries a request_id, and then the latest report
# wins; "sent" and "finished" are idempotent.
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _base_url(base_url: str) -> tuple[str, str]:
    """The base URL calls are made under, and how a repr shows it (no user info: it could carry a password)."""
    url = urllib.parse.urlsplit(base_url)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise ValueError(f"router URL {base_url!r}: expected http(s)://host[:port][/prefix]")
    shown = f"{url.scheme}://{url.hostname}{f':{url.port}' if url.port else ''}{url.path.rstrip('/')}"
    return base_url.rstrip("/"), shown


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


def _content(resp: httpx.Response) -> bytes:
    if not 200 <= resp.status_code < 300:
        raise _error(resp.status_code, resp.content)
    return resp.content


class RouterClient:
    """Blocking client over one `httpx.Client` (made on first call, closed by `close`): its pool keeps the
    connection alive between calls, so sequential calls share one connection."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 5.0) -> None:
        self._base, self._shown = _base_url(base_url)
        self._headers = _headers(token)
        self._timeout = timeout_s
        self._client: httpx.Client | None = None
        # parsed once: httpx would parse the same URL strings on every call
        self._urls = {path: httpx.URL(self._base + path) for path in (ROUTE, SENT, FINISHED, OPENAPI, HEALTH)}

    def __repr__(self) -> str:  # no token
        return f"RouterClient({self._shown})"

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
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "RouterClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _connect(self) -> httpx.Client:
        if self._client is None:
            # the timeout per connect, read and write, as http.client's socket timeout was
            self._client = httpx.Client(headers=self._headers, timeout=self._timeout, verify=tls_context())
        return self._client

    def _call(self, method: str, path: str, body: bytes | None) -> bytes:
        url = self._urls.get(path) or httpx.URL(self._base + path)
        client = self._connect()
        with transport_errors(url):
            try:
                resp = client.request(method, url, content=body)
            except _STALE_CONNECTION:
                resp = client.request(method, url, content=body)  # once more, on a new connection (see above)
        return _content(resp)


class AsyncRouterClient:
    """asyncio client over one `httpx.AsyncClient` (created on first use, closed by `close`). `timeout_s` bounds
    each call in all, as aiohttp's total timeout did."""

    def __init__(self, base_url: str, token: str | None = None, timeout_s: float = 5.0) -> None:
        self._base, self._shown = _base_url(base_url)
        self._headers = _headers(token)
        self._timeout = timeout_s
        self._session: httpx.AsyncClient | None = None

    def __repr__(self) -> str:
        return f"AsyncRouterClient({self._shown})"

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
            await self._session.aclose()
            self._session = None

    async def __aenter__(self) -> "AsyncRouterClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, body: bytes | None) -> bytes:
        if self._session is None:
            self._session = httpx.AsyncClient(headers=self._headers, timeout=self._timeout, verify=tls_context())
        url = self._base + path
        with transport_errors(url):
            async with asyncio.timeout(self._timeout):
                resp = await self._session.request(method, url, content=body)
        return _content(resp)
