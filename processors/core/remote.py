"""A running processor seen from outside: JSON over HTTP (`kvpipe sql`, `kvpipe demo`, test processes).

`ProcessorSql` is read-only SQL through `POST /sql`, as a `saved.QueryFn`: embedded chDB lets one
process open the store, the processor is that process, so `kvpipe sql`, `kvpipe plan` and
`kvpipe report` read through it. The answer is JSON, which turns DateTime values into strings; they are turned
back here by the column types the processor reports, so callers (the report's plots) get the same
values as from an `AnalyticsSink` in process.

Both send the bearer token of the settings (KVPIPE_API_TOKEN / api_token_file) when one is
configured: a token-protected server answers 401 otherwise (kvpipe.processors.core.webauth).

Every call goes through one `httpx.Client` per process (kvpipe.processors.core.httpclient), made on first use: a
command that asks the same app again (`kvpipe nodes` paging, the demo's polling) reuses the kept-alive
connection. httpx's Client is thread-safe (its pool locks), so benchmark threads share it too.
"""
from __future__ import annotations

import json
import threading
from datetime import datetime
from typing import Any

import httpx

from kvpipe.processors.core.httpclient import tls_context, transport_errors


class SqlError(RuntimeError):
    """The processor answered, and refused or failed the statement (`error`, `detail` as it said)."""

    def __init__(self, status: int, error: str, detail: Any) -> None:
        super().__init__(f"{error}: {detail}")
        self.status, self.error, self.detail = status, error, detail


def auth_headers() -> dict[str, str]:
    """`Authorization: Bearer …` from the settings, or {} when no token is configured."""
    from kvpipe.schemas.settings import load_settings

    token = load_settings().api_token_value()
    return {"Authorization": f"Bearer {token}"} if token else {}


_client: httpx.Client | None = None
_client_lock = threading.Lock()


def _shared_client() -> httpx.Client:
    global _client
    with _client_lock:
        if _client is None:
            # urllib followed redirects; the timeout is given per call (per connect, read, write: urllib's too)
            _client = httpx.Client(verify=tls_context(), follow_redirects=True)
        return _client


def request_json(method: str, url: str, body: Any = None, timeout: float = 60.0,
                 headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """The one HTTP JSON client of kvpipe's own runtime code (CLI, demo, test processes): send `body`
    (bytes as they are, anything else as JSON), return `(status, decoded body)`. A JSON answer is
    decoded, another one is text, an empty one None; 4xx/5xx are answers, not exceptions. Raises
    OSError when nothing answers at `url`. `headers` default: `auth_headers()` (the bearer token)."""
    headers = auth_headers() if headers is None else headers
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    with transport_errors(url):
        resp = _shared_client().request(method, url, content=data, timeout=timeout,
                                        headers={**({"Content-Type": "application/json"} if data is not None else {}),
                                                 **headers})
    raw = resp.content
    if resp.status_code >= 400:  # an error's body is read as JSON whatever its type says, as before
        try:
            return resp.status_code, json.loads(raw or b"{}")
        except ValueError:
            return resp.status_code, {"error": f"HTTP {resp.status_code}", "detail": raw[:200].decode(errors="replace")}
    return resp.status_code, _body(raw, resp.headers.get("content-type", ""))


def _body(raw: bytes, content_type: str) -> Any:
    if not raw:
        return None
    if content_type.split(";", 1)[0].strip().lower() == "application/json":
        return json.loads(raw)
    return raw.decode(errors="replace")


def post_json(url: str, body: Any, timeout: float = 60.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """`POST` (see `request_json`)."""
    return request_json("POST", url, body, timeout, headers)


def get_json(url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """`GET` (see `request_json`)."""
    return request_json("GET", url, None, timeout, headers)


class HttpStatusError(OSError):
    """A server answered with an error status where the caller needed a 2xx (`ok_json`)."""

    def __init__(self, url: str, status: int, body: Any) -> None:
        detail = body.get("detail") or body.get("error") if isinstance(body, dict) else body
        super().__init__(f"{url} answered HTTP {status}: {str(detail)[:300]}")
        self.url, self.status, self.body = url, status, body


def ok_json(url: str, body: Any = None, timeout: float = 60.0, headers: dict[str, str] | None = None) -> Any:
    """GET (or POST when `body` is given) and the decoded answer; HttpStatusError for a non-2xx one."""
    status, answer = request_json("GET" if body is None else "POST", url, body, timeout, headers)
    if not 200 <= status < 300:
        raise HttpStatusError(url, status, answer)
    return answer


def _is_datetime(type_name: str) -> bool:
    return type_name.removeprefix("Nullable(").startswith("DateTime")


def _decode(result: dict) -> dict:
    for col, type_name in enumerate(result.get("types", [])):
        if _is_datetime(type_name):
            for row in result["rows"]:
                if isinstance(row[col], str):
                    row[col] = datetime.fromisoformat(row[col])
    return result


class ProcessorSql:
    """`(sql, params) -> {"columns", "types", "rows"}` answered by the processor at `base_url`."""

    def __init__(self, base_url: str, timeout: float = 60.0, headers: dict[str, str] | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = auth_headers() if headers is None else headers

    def __call__(self, sql: str, params: dict | None = None) -> dict:
        body: dict[str, Any] = {"sql": sql}
        if params:
            body["params"] = params
        status, answer = post_json(self.base_url + "/sql", body, self.timeout, self.headers)
        if status != 200:
            answer = answer if isinstance(answer, dict) else {}
            raise SqlError(status, str(answer.get("error", f"HTTP {status}")), answer.get("detail"))
        return _decode(answer)
