"""kvpipe.processors.core.kafkaconf: Faust credentials per protocol (and what Faust hands aiokafka from them),
and the OAUTHBEARER client-credentials token provider against a real local token endpoint."""
from __future__ import annotations

import asyncio

import faust
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth

from kvpipe.processors.core.kafkaconf import aiokafka_kwargs, faust_broker_kwargs
from kvpipe.schemas.settings import load_settings

SASL = {"KVPIPE_KAFKA_SASL_USERNAME": "svc", "KVPIPE_KAFKA_SASL_PASSWORD": "pw"}


def _auth(env: dict) -> dict:
    creds = faust_broker_kwargs(load_settings(env=env)).get("broker_credentials")
    return credentials_to_aiokafka_auth(creds)


def test_plaintext_adds_nothing_to_the_faust_app():
    assert faust_broker_kwargs(load_settings(env={})) == {}


def test_each_protocol_reaches_aiokafka_as_configured():
    assert _auth({"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SSL"})["security_protocol"] == "SSL"
    plain = _auth({**SASL, "KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT"})
    assert (plain["security_protocol"], plain["sasl_mechanism"], plain["sasl_plain_username"],
            plain["sasl_plain_password"], plain["ssl_context"]) == ("SASL_PLAINTEXT", "PLAIN", "svc", "pw", None)
    scram = _auth({**SASL, "KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512"})
    assert (scram["security_protocol"], scram["sasl_mechanism"]) == ("SASL_SSL", "SCRAM-SHA-512")
    assert scram["ssl_context"] is not None
    assert "pw" not in repr(faust_broker_kwargs(load_settings(env={**SASL, "KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL"})))


def test_oauthbearer_fetches_and_caches_a_client_credentials_token():
    seen: list[dict] = []

    async def token(request: web.Request) -> web.Response:
        form = dict(await request.post())
        seen.append(form)
        if form.get("client_secret") != "cs":
            return web.json_response({"error": "invalid_client"}, status=401)
        return web.json_response({"access_token": f"tok-{len(seen)}", "expires_in": 3600, "token_type": "Bearer"})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/token", token)
        server = TestServer(app)
        await server.start_server()
        try:
            url = str(server.make_url("/token"))
            env = {"KVPIPE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "KVPIPE_KAFKA_SASL_MECHANISM": "OAUTHBEARER",
                   "KVPIPE_KAFKA_OAUTH_TOKEN_URL": url, "KVPIPE_KAFKA_OAUTH_CLIENT_ID": "kv",
                   "KVPIPE_KAFKA_OAUTH_CLIENT_SECRET": "cs", "KVPIPE_KAFKA_OAUTH_SCOPE": "kafka"}
            settings = load_settings(env=env)
            creds = faust_broker_kwargs(settings)["broker_credentials"]
            assert isinstance(creds, faust.OAuthCredentials)
            auth = credentials_to_aiokafka_auth(creds)
            assert auth["sasl_mechanism"] == "OAUTHBEARER" and auth["security_protocol"] == "SASL_SSL"
            provider = auth["sasl_oauth_token_provider"]
            assert await provider.token() == "tok-1" and await provider.token() == "tok-1"  # cached
            assert seen == [{"grant_type": "client_credentials", "client_id": "kv", "client_secret": "cs", "scope": "kafka"}]
            assert "sasl_oauth_token_provider" in aiokafka_kwargs(settings)
            bad = aiokafka_kwargs(load_settings(env={**env, "KVPIPE_KAFKA_OAUTH_CLIENT_SECRET": "wrong"}))
            with pytest.raises(RuntimeError, match="invalid_client") as info:
                await bad["sasl_oauth_token_provider"].token()
            assert "wrong" not in str(info.value)
        finally:
            await server.close()

    asyncio.run(scenario())
