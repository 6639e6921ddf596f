"""Kafka security for the aiokafka side (Faust apps, the snapshot reader), from Settings.

The translation of the settings lives in `kvpipe.schemas.settings` (librdkafka properties and aiokafka
keyword arguments, one place); this module adds what needs client libraries: Faust's
`broker_credentials` objects and, for OAUTHBEARER, a token provider — aiokafka does not fetch
OIDC tokens itself (librdkafka does, with `sasl.oauthbearer.method=oidc`), so
`ClientCredentialsTokens` runs the client-credentials grant (RFC 6749 §4.4) and caches the token
until shortly before it expires.

How Faust maps these (faust.transport.drivers.aiokafka.credentials_to_aiokafka_auth):
SSLCredentials → security_protocol=SSL + ssl_context; SASLCredentials → SASL_PLAINTEXT, or
SASL_SSL when it carries an ssl_context; OAuthCredentials likewise with the token provider. Faust
applies them to its consumer, producer and admin client alike.

The pass-through client properties (`kafka_properties`, `kafka_properties_file`) reach aiokafka only where
it has an equivalent (`AIOKAFKA_PROPERTIES`): the keyword of aiokafka's clients and the Faust settings
that carry it to Faust's own. Any other key stops the app with its name instead of being dropped: a
property that silently does nothing is a setting the operator believes in and does not have. Every
mapped keyword is one that no client here sets itself, so none is given twice.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from kvpipe.schemas.settings import Settings, SettingsError

TOKEN_EARLY_S = 30.0  # refresh this long before the token's expiry

# Kafka client property → (aiokafka client keyword, the Faust settings that carry it to Faust's clients).
AIOKAFKA_PROPERTIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "client.id": ("client_id", ("broker_client_id",)),
    "metadata.max.age.ms": ("metadata_max_age_ms", ("consumer_metadata_max_age_ms", "producer_metadata_max_age_ms")),
    "connections.max.idle.ms": ("connections_max_idle_ms",
                                ("consumer_connections_max_idle_ms", "producer_connections_max_idle_ms")),
}


def _mapped_properties(settings: Settings) -> list[tuple[str, tuple[str, ...], Any]]:
    """(aiokafka keyword, Faust settings, value) per pass-through property; SettingsError naming those
    aiokafka has no equivalent for."""
    props = settings.kafka_client_properties()
    unknown = sorted(key for key in props if key not in AIOKAFKA_PROPERTIES)
    if unknown:
        raise SettingsError(f"kafka_properties: {', '.join(unknown)}: no aiokafka equivalent, so the Faust apps "
                            f"cannot apply it; they take {', '.join(AIOKAFKA_PROPERTIES)}. Set the others only in "
                            f"the settings of librdkafka's users (the producers, the bridge)")
    out = []
    for key, value in props.items():
        keyword, faust_names = AIOKAFKA_PROPERTIES[key]
        try:  # .properties values are strings; the *.ms ones are integers to aiokafka
            typed = int(value) if key.endswith(".ms") else str(value)
        except ValueError:
            raise SettingsError(f"kafka_properties: {key}={value!r}: expected an integer") from None
        out.append((keyword, faust_names, typed))
    return out


def check_properties(settings: Settings) -> None:
    """SettingsError naming the pass-through properties the Faust apps' clients cannot apply (the CLIs call it
    before importing an app, so the operator reads one line, not a traceback from the app's import)."""
    _mapped_properties(settings)


def _token_provider_base() -> type:
    from aiokafka.abc import AbstractTokenProvider

    return AbstractTokenProvider


class ClientCredentialsTokens:
    """`await token()` → an access token from the OIDC token endpoint (client-credentials grant).

    Used as aiokafka's `sasl_oauth_token_provider`. The secret goes only into the POST body; an
    endpoint's refusal is reported by status and its `error` field, never with the request."""

    def __init__(self, url: str, client_id: str, client_secret: str, scope: str = "", timeout_s: float = 10.0) -> None:
        self.url, self.client_id, self._secret, self.scope, self.timeout_s = url, client_id, client_secret, scope, timeout_s
        self._token = ""
        self._expires = 0.0

    def __repr__(self) -> str:
        return f"<ClientCredentialsTokens {self.url} client_id={self.client_id}>"

    async def token(self) -> str:
        if self._token and time.monotonic() < self._expires:
            return self._token
        import httpx  # only OAUTHBEARER needs it (and its ~0.1 s import)

        from kvpipe.processors.core.httpclient import tls_context, transport_errors

        form = {"grant_type": "client_credentials", "client_id": self.client_id, "client_secret": self._secret}
        if self.scope:
            form["scope"] = self.scope
        # A client per fetch: one fetch an expiry (minutes to hours apart), so no connection is worth keeping.
        # `timeout_s` bounds the fetch in all, as aiohttp's total timeout did.
        with transport_errors(self.url):
            async with httpx.AsyncClient(timeout=self.timeout_s, verify=tls_context()) as client:
                async with asyncio.timeout(self.timeout_s):
                    resp = await client.post(self.url, data=form)
        try:
            body = resp.json()
        except ValueError:
            body = {}
        if resp.status_code != 200 or not isinstance(body, dict) or "access_token" not in body:
            reason = body.get("error", "no access_token in the answer") if isinstance(body, dict) else "not JSON"
            raise RuntimeError(f"OAUTHBEARER: token endpoint {self.url} answered {resp.status_code} "
                               f"for client_id {self.client_id}: {reason}")
        self._token = str(body["access_token"])
        self._expires = time.monotonic() + max(0.0, float(body.get("expires_in", 300)) - TOKEN_EARLY_S)
        return self._token

    def extensions(self) -> dict:
        return {}


def token_provider(settings: Settings) -> Any:
    """An aiokafka AbstractTokenProvider for the OAUTHBEARER settings."""
    base = _token_provider_base()
    cls = type("KvpipeTokenProvider", (ClientCredentialsTokens, base), {})
    return cls(settings.kafka_oauth_token_url, settings.kafka_oauth_client_id, settings.kafka_oauth_client_secret,
               settings.kafka_oauth_scope)


def aiokafka_kwargs(settings: Settings) -> dict[str, Any]:
    """Security and pass-through keyword arguments for an aiokafka client (consumer, producer, admin)."""
    kwargs = settings.kafka_aiokafka_kwargs()
    kwargs.update({keyword: value for keyword, _, value in _mapped_properties(settings)})
    if settings.kafka_mechanism() == "OAUTHBEARER":
        kwargs["sasl_oauth_token_provider"] = token_provider(settings)
    return kwargs


def faust_broker_kwargs(settings: Settings) -> dict[str, Any]:
    """`faust.App(...)` keyword arguments for the security settings ({} for PLAINTEXT) and the
    pass-through client properties."""
    props = {name: value for _, faust_names, value in _mapped_properties(settings) for name in faust_names}
    return {**props, **_faust_credentials(settings)}


def _faust_credentials(settings: Settings) -> dict[str, Any]:
    import faust

    protocol = settings.kafka_security_protocol
    if protocol == "PLAINTEXT":
        return {}
    ctx = settings.kafka_ssl_context()
    if protocol == "SSL":
        return {"broker_credentials": faust.SSLCredentials(ctx)}
    mechanism = settings.kafka_mechanism()
    if mechanism == "OAUTHBEARER":
        return {"broker_credentials": faust.OAuthCredentials(oauth_cb=token_provider(settings), ssl_context=ctx)}
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        # ssl_context set ⇔ SASL_SSL (faust.auth.SASLCredentials picks the protocol from it)
        return {"broker_credentials": faust.SASLCredentials(username=settings.kafka_sasl_username,
                                                            password=settings.kafka_password(),
                                                            mechanism=mechanism, ssl_context=ctx)}
    raise SettingsError(f"kafka_security_protocol={protocol} is not supported by the Faust apps")
