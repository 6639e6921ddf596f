"""Bounded reading and parsing of HTTP JSON bodies (RELIABILITY.md, probe 5).

A body is read with a size cap (a declared `Content-Length` over it is refused before reading)
and a read timeout (a client that declares more bytes than it sends is answered 408 instead of
holding the connection), then parsed by msgspec with a nesting-depth check: every malformed body
is a 4xx with a reason, never a 500.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgspec

_decoder = msgspec.json.Decoder()


class ApiError(ValueError):
    """A request either app refuses: `status` (4xx), a short `error` and a `detail`, sent as
    the JSON body `{"error", "detail"}`."""

    def __init__(self, status: int, error: str, detail: Any = None) -> None:
        super().__init__(error)
        self.status, self.error, self.detail = status, error, detail

    def body(self) -> dict:
        return {"error": self.error, "detail": self.detail}


def json_depth_ok(data: bytes, max_depth: int) -> bool:
    """False if `[`/`{` nest deeper than `max_depth` outside strings. A byte scan, so a hostile
    body costs linear time and no recursion (msgspec itself would raise RecursionError); skipped
    (C-speed counts) when the body has too few brackets to nest that deep, as a route body does."""
    if data.count(b"[") + data.count(b"{") <= max_depth:
        return True
    depth = 0
    in_string = escaped = False
    for b in data:
        if in_string:
            if escaped:
                escaped = False
            elif b == 0x5C:  # backslash
                escaped = True
            elif b == 0x22:  # quote
                in_string = False
        elif b == 0x22:
            in_string = True
        elif b == 0x5B or b == 0x7B:  # [ {
            depth += 1
            if depth > max_depth:
                return False
        elif b == 0x5D or b == 0x7D:  # ] }
            depth -= 1
    return True


def parse_json(data: bytes, max_bytes: int, max_depth: int) -> Any:
    """JSON value of a request body, or ApiError 413 (too large) / 400 (not JSON, too deep)."""
    if len(data) > max_bytes:
        raise ApiError(413, "body too large", f"{len(data)} bytes; the limit is {max_bytes}")
    if not json_depth_ok(data, max_depth):
        raise ApiError(400, "body nested too deep", f"JSON arrays/objects nest deeper than {max_depth} levels")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, "body is not JSON", str(exc)) from None


async def read_body(request: Any, max_bytes: int, timeout_s: float) -> bytes:
    """The request's body bytes, within `max_bytes` and `timeout_s` (aiohttp request)."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise ApiError(413, "body too large", f"Content-Length {declared}; the limit is {max_bytes}")
    try:
        async with asyncio.timeout(timeout_s):  # (not wait_for: no task per request)
            return await _read_capped(request, max_bytes)
    except TimeoutError:
        raise ApiError(408, "request body timeout", f"the body did not arrive within {timeout_s:g} s "
                                                     f"(a Content-Length larger than the body sent?)") from None


async def _read_capped(request: Any, max_bytes: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.read(64 * 1024)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, "body too large", f"more than {max_bytes} bytes")
        chunks.append(chunk)


async def json_body(request: Any, max_bytes: int, max_depth: int, timeout_s: float) -> Any:
    return parse_json(await read_body(request, max_bytes, timeout_s), max_bytes, max_depth)


async def checked_body(request: Any, max_bytes: int, max_depth: int, timeout_s: float) -> bytes:
    """The body bytes, bounded like `json_body` (size, time, nesting depth), for a caller that
    decodes them into a typed Struct itself."""
    data = await read_body(request, max_bytes, timeout_s)
    if not json_depth_ok(data, max_depth):
        raise ApiError(400, "body nested too deep", f"JSON arrays/objects nest deeper than {max_depth} levels")
    return data
