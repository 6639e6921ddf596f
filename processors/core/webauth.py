"""Who may call a Faust app's HTTP API: a bearer token, and a refusal to listen openly.

Both kvpipe Faust apps (`kvpipe processor`, `kvpipe analytics`) call the same two functions:

    webauth.check_exposure(settings, insecure)  # before starting: exit 2 on an open, reachable bind
    webauth.install(app, settings)              # before the web server exists (right after faust.App)

Rules (docs/security.md):
- With a token configured (KVPIPE_API_TOKEN / api_token_file) every path but `/health` and `/openapi.json` needs
  `Authorization: Bearer <token>`; anything else is a 401 `{"error", "detail"}` with
  `WWW-Authenticate: Bearer`. `/health` stays open so a load balancer or orchestrator can probe
  without the secret.
- Faust's own pages (`/router`, `/table`, the statistics index, `/graph`, `/performance`) are not
  served: they list topics, partitions and worker URLs, and kvpipe's clients never use them
  (the index is not a Faust table, so `@table_route` is unused).
- Without a token, only a loopback address may be bound, unless the operator says `--insecure`.

Tokens are never logged: Faust runs aiohttp's AppRunner with `access_log=None` (no request lines
at all), and nothing here formats the header into a message.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

from kvpipe.schemas.settings import Settings, exposure_problem

OPEN_PATHS = frozenset({"/health", "/openapi.json"})  # the API document describes, it reveals no state

# Faust settings that gate its built-in blueprints (faust.web.base.BLUEPRINT_FLAGS).
_FAUST_PAGES_OFF = ("web_router_enabled", "web_tables_enabled", "web_stats_enabled", "web_graph_enabled",
                    "web_metrics_enabled")


class ExposureError(RuntimeError):
    """The app would listen on a reachable address with no authentication."""


def check_exposure(settings: Settings, insecure: bool = False) -> None:
    """Raise ExposureError if `settings.web_host` is not loopback and no token is configured
    (unless `insecure` or `settings.insecure`). The CLI turns it into exit status 2."""
    problem = exposure_problem(settings.web_host, bool(settings.api_token_value()), insecure or settings.insecure)
    if problem:
        raise ExposureError(problem)


def bearer_ok(header: str | None, token: str) -> bool:
    """True if an Authorization header carries `token` (constant-time comparison)."""
    if not header:
        return False
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def unauthorized_body(has_header: bool) -> bytes:
    detail = ("the Authorization header does not carry the configured token" if has_header
              else "send 'Authorization: Bearer <token>' (the token is KVPIPE_API_TOKEN of the server)")
    return json.dumps({"error": "unauthorized", "detail": detail}).encode()


def client_headers(settings: Settings) -> dict[str, str]:
    """Headers a kvpipe client (CLI, peer worker) sends: the bearer token if one is configured."""
    token = settings.api_token_value()
    return {"Authorization": f"Bearer {token}"} if token else {}


def middleware(token: str) -> Callable[..., Awaitable[Any]]:
    """An aiohttp middleware that enforces the bearer token (see module doc)."""
    from aiohttp import web as aioweb

    @aioweb.middleware
    async def require_token(request: Any, handler: Callable[[Any], Awaitable[Any]]) -> Any:
        if request.path in OPEN_PATHS:
            return await handler(request)
        header = request.headers.get("Authorization")
        if not bearer_ok(header, token):
            return aioweb.Response(status=401, body=unauthorized_body(header is not None),
                                   content_type="application/json", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return require_token


def install(app: Any, settings: Settings) -> None:
    """Turn off Faust's built-in pages and, if a token is configured, require it. Must run before
    anything touches `app.web` (the blueprints and the aiohttp Application are built there).

    The exposure rule is checked here too, not only by the CLI: however the app is started
    (`faust -A kvpipe.processors.routing.app worker`, an embedding program), a non-loopback bind without a
    token refuses to build the app (ExposureError)."""
    check_exposure(settings)
    for name in _FAUST_PAGES_OFF:
        setattr(app.conf, name, False)
    token = settings.api_token_value()
    if token:
        # kvpipe sets no other aiohttp Application options; reading the setting first would mark it
        # "used" and make Faust warn about a late reconfiguration.
        app.conf.web_application_options = {"middlewares": [middleware(token)]}
