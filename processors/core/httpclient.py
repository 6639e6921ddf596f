"""kvpipe's HTTP client stack: httpx, `httpx.Client` for blocking callers and `httpx.AsyncClient` on an event
loop, one library for both (the route clients, the CLI's and the demo's calls, the OIDC token fetch, the routing
app's peer fan-out; the bridge's load scrape uses it too, from producer/, which may not import this module).
The servers stay aiohttp's, under Faust's web.

What every client here keeps from the hand-written ones it replaced:
- TLS trusts the system's store (`ssl.create_default_context()`, what urllib and aiohttp used), not only
  certifi's bundle, httpx's own default: a deployment whose private CA is installed system-wide keeps working.
- "Nothing answers there" is an OSError, as urllib and http.client raised it and as every caller catches it
  (`kvpipe route`, `sql`, `nodes`, the demo): `transport_errors` turns httpx's transport errors into
  ConnectionError or TimeoutError naming the URL. An HTTP error status is an answer, never one of these.
"""
from __future__ import annotations

import functools
import ssl
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from kvpipe.schemas.redact import masked_dsn


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The system trust store, built once per process (loading it costs milliseconds) and shared by every client:
    an SSLContext is safe to share between connections and threads."""
    return ssl.create_default_context()


@contextmanager
def transport_errors(url: str | httpx.URL) -> Iterator[None]:
    """Inside: httpx's request errors (no connection, reset, timeout, a broken answer) leave as OSErrors naming
    `url` (its password masked, see the module doc); the httpx error is their cause."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise TimeoutError(f"{masked_dsn(str(url))}: no answer in time ({type(exc).__name__})") from exc
    except httpx.RequestError as exc:
        raise ConnectionError(f"{masked_dsn(str(url))}: {exc or type(exc).__name__}") from exc
