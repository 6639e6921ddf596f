"""HTTP views: JSON in, JSON out; bad input is a 4xx `{"error", "detail"}`, never a 500.

The router endpoints (`/route`, `/route/sent`, `/route/finished`) read and write the msgspec Structs of
`kvpipe.processors.router.model`; their logic is `kvpipe.processors.router.serving`. `/nodes`, `/stats` and
`/health` answer the Structs of `kvpipe.processors.routing.answers`; `/openapi.json` documents every route
registered here (`kvpipe.processors.routing.apidoc`)."""
from __future__ import annotations

import time
from typing import Any, Mapping, Protocol, Sequence, TypeVar, cast
from urllib.parse import urlencode

import msgspec
from faust import web
from faust.types import TP

from kvpipe.processors.router import serving
from kvpipe.processors.routing import routeserve, scatter
from kvpipe.processors.core import fastpath, webauth
from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.core.signals import connect
from kvpipe.processors.routing import apidoc
from kvpipe.processors.routing.answers import ClusterStats, LocalNodesPage, NodesPage, RoutingHealth, RoutingStats
from kvpipe.processors.routing.api import node_rows, page_rows, parse_nodes_query
from kvpipe.processors.routing.app import app, settings
from kvpipe.processors.core.httpbody import checked_body
from kvpipe.processors.router.model import (
    FinishedReport,
    LocalRouteAnswer,
    Recorded,
    RouteError,
    RouteRequest,
    SentForward,
    SentReport,
    decode_request,
)
from kvpipe.processors.router.request import Checked, check_request
from kvpipe.processors.routing.state import collect_stats, expected_partitions, owned_partitions, runtime


async def _body(request: web.Request) -> bytes:
    return await checked_body(request, settings.http_max_body_bytes, settings.http_max_json_depth,
                              settings.http_read_timeout_s)


def _error(view: web.View, exc: ApiError | RouteError) -> web.Response:
    if isinstance(exc, RouteError):
        return view.bytes(msgspec.json.encode(exc.body()), content_type="application/json", status=exc.status)
    return view.json(exc.body(), status=exc.status)


def _typed(view: web.View, value: Any) -> web.Response:
    return view.bytes(msgspec.json.encode(value), content_type="application/json")


def _highwater(partition: int) -> int | None:
    try:
        return app.consumer.highwater(TP(settings.events_topic, partition))
    except Exception:
        return None


# -- the group's view: scatter-gather over the workers (kvpipe.processors.routing.scatter) -------------------------


class _Assignor(Protocol):
    """What the views read of Faust's assignor (`faust.assignor.PartitionAssignor`; its declared interface,
    `PartitionAssignorT`, leaves this method out)."""

    def external_topics_metadata(self) -> Mapping[str, Mapping[str, Sequence[int]]]: ...


def _peer_urls() -> dict[str, list[int]]:
    try:
        distribution = cast(_Assignor, app.assignor).external_topics_metadata()
    except Exception:
        return {}
    return scatter.peers(distribution, settings.events_topic, str(app.conf.canonical_url))


def _local_nodes(query: Mapping[str, str]) -> LocalNodesPage:
    limit, after, state = parse_nodes_query(query)
    # one row past the page, so the page knows whether a next one exists
    rows, next_after = page_rows(node_rows(runtime.index, time.time(), limit + 1, after, state), limit, after, state)
    return LocalNodesPage(nodes=rows, next_after=next_after, partitions=owned_partitions())


_peer_headers = webauth.client_headers(settings)  # workers of one group share the token
_peers = scatter.PeerClient()  # this worker's one client to the others, closed at shutdown (below)
_ask_route = scatter.http_asker(_peers.client, "/route", "POST", headers=_peer_headers)
_ask_sent = scatter.http_asker(_peers.client, "/route/sent", "POST", headers=_peer_headers)
_ask_finished = scatter.http_asker(_peers.client, "/route/finished", "POST", headers=_peer_headers)


@connect(app.on_before_shutdown)
async def close_peer_client(app: Any, *args: Any, **kwargs: Any) -> None:  # noqa: ARG001 - Faust's signal signature
    await _peers.aclose()


def _ask_nodes(limit: int, after: str | None, state: str | None) -> scatter.PeerFn:
    """Asks a peer for its rows of the page asked for: its own page, cut at `limit` (`page_rows`' `more`)."""
    query = {"limit": str(limit)}
    if after is not None:
        query["after"] = after
    if state is not None:
        query["state"] = state
    return scatter.http_asker(_peers.client, f"/nodes?{urlencode(query)}", "GET", headers=_peer_headers)


_sent_decoder = msgspec.json.Decoder(SentReport)
_forward_decoder = msgspec.json.Decoder(SentForward)
_finished_decoder = msgspec.json.Decoder(FinishedReport)
_recorded_decoder = msgspec.json.Decoder(Recorded)
_RECORDED, _NOT_RECORDED = msgspec.json.encode(Recorded(True)), msgspec.json.encode(Recorded(False))
T = TypeVar("T")


def _decode(decoder: msgspec.json.Decoder[T], data: bytes, what: str) -> T:
    try:
        return decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise RouteError(400, f"bad {what}", str(exc)) from None


def _was_recorded(answer: bytes) -> bool:
    try:
        return _recorded_decoder.decode(answer).recorded
    except (msgspec.ValidationError, msgspec.DecodeError):  # a peer that answers nonsense did not record it
        return False


def _local_answer(req: RouteRequest, checked: Checked) -> LocalRouteAnswer:
    return serving.local_answer(runtime.index, runtime.inflight, req, owned_partitions(), settings.route_stale_after_s,
                                 checked=checked)


async def _record_elsewhere(peers: dict[str, list[int]], forward: SentForward) -> bool:
    """Ask every peer to record a sent request; True when the one holding the node did."""
    answers = await scatter.ask_all(peers, msgspec.json.encode(forward), _ask_sent) if peers else []
    return any(_was_recorded(a) for a in answers)


@app.page("/route")
class Route(web.View):
    """Token ids (or per-group hashes) in; vLLM's hybrid hit per node, scores and a chosen node out
    (processors/router/decide.py). Several workers: each answers for its own nodes (`?local=1`),
    the one asked merges and chooses (processors/router/serving.py)."""

    async def post(self, request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            raw = await _body(request)
            req = decode_request(raw)
            checked = check_request(req)  # once per request: both halves below read it
            if scatter.is_local(request.query):
                local = _local_answer(req, checked)
                runtime.metrics.route_latency.labels("local").observe(time.perf_counter() - started)
                return _typed(self, local)
            mine = _local_answer(req, checked)
            peers = _peer_urls()
            theirs = [serving.decode_local(a) for a in await scatter.ask_all(peers, raw, _ask_route)] if peers else []
            parts, missing = serving.merge_local([mine, *theirs], expected_partitions())
            answer = serving.answer(parts, missing, req, runtime.index, runtime.inflight, checked=checked)
            request_id, chosen = req.request_id, answer.chosen
            # the chosen node's worker records it (needs_forward implies both are set; the None checks say so to mypy)
            if request_id is not None and chosen is not None and serving.needs_forward(answer, req, runtime.index):
                await _record_elsewhere(peers, SentForward(request_id, chosen, req))
        except (ApiError, RouteError) as exc:
            return _error(self, exc)
        runtime.metrics.route_latency.labels("group").observe(time.perf_counter() - started)
        return _typed(self, answer)


@app.page("/route/sent")
class RouteSent(web.View):
    """"Request R was sent to node N": R's blocks are speculative holdings of N and R counts in N's
    load until "finished", real events or the TTL (processors/router/inflight.py). Recorded by the
    worker whose index holds N; 404 when no worker does."""

    async def post(self, request: web.Request) -> web.Response:
        try:
            raw = await _body(request)
            if scatter.is_local(request.query):
                fwd = _decode(_forward_decoder, raw, "sent report")
                why = serving.sent_locally(runtime.index, runtime.inflight, fwd.request_id, fwd.node_id, fwd.request)
                return self.bytes(_NOT_RECORDED if why else _RECORDED, content_type="application/json")
            report = _decode(_sent_decoder, raw, "sent report")
            req = RouteRequest(token_ids=report.token_ids)
            why = serving.sent_locally(runtime.index, runtime.inflight, report.request_id, report.node_id, req)
            if why is not None:
                peers = _peer_urls()
                if not await _record_elsewhere(peers, SentForward(report.request_id, report.node_id, req)):
                    raise RouteError(404, "node not known", why if not peers else
                                     f"no worker holds node {report.node_id!r} with usable group specs and hash "
                                     "configuration (not published yet, or expired)")
        except (ApiError, RouteError) as exc:
            return _error(self, exc)
        return self.bytes(b"", status=204)


@app.page("/route/finished")
class RouteFinished(web.View):
    """"Request R finished": it leaves its node's load (its speculative blocks stay until confirmed
    or expired). Unknown or expired requests are fine: finishing is idempotent."""

    async def post(self, request: web.Request) -> web.Response:
        try:
            raw = await _body(request)
            report = _decode(_finished_decoder, raw, "finished report")
            found = runtime.inflight.finished(report.request_id)
            if scatter.is_local(request.query):
                return self.bytes(_RECORDED if found else _NOT_RECORDED, content_type="application/json")
            peers = _peer_urls()
            if not found and peers:  # the worker that recorded it (the chosen node's) finishes it
                await scatter.ask_all(peers, raw, _ask_finished)
        except (ApiError, RouteError) as exc:
            return _error(self, exc)
        return self.bytes(b"", status=204)


_OPENAPI = apidoc.encoded()


@app.page("/openapi.json")
class OpenApi(web.View):
    """This app's OpenAPI 3.1 document, every endpoint, generated from the request/answer Structs."""

    async def get(self, request: web.Request) -> web.Response:
        return self.bytes(_OPENAPI, content_type="application/json")


@app.page("/nodes")
class Nodes(web.View):
    async def get(self, request: web.Request) -> web.Response:
        answer: LocalNodesPage | NodesPage
        try:
            if scatter.is_local(request.query):
                answer = _local_nodes(request.query)
            else:
                limit, after, state = parse_nodes_query(request.query)
                merged = await scatter.nodes(_local_nodes(request.query), _peer_urls(),
                                             _ask_nodes(limit, after, state), expected_partitions())
                page, next_after = page_rows(merged.rows, limit, after, state, merged.more)
                answer = NodesPage(nodes=page, next_after=next_after, partial=bool(merged.missing),
                                   missing_partitions=merged.missing)
        except ApiError as exc:
            return _error(self, exc)
        return _typed(self, answer)


def cluster_stats() -> ClusterStats:
    consumer = app.consumer
    return ClusterStats(url=str(app.conf.canonical_url), owned_partitions=owned_partitions(), peers=_peer_urls(),
                        expected_partitions=list(expected_partitions()),
                        deliveries=fastpath.deliveries(consumer))


def stats_mapping() -> dict[str, Any]:
    """What `/stats` reports, as built: `collect_stats` (shared with /metrics, a plain mapping) and this worker's
    place in the group."""
    return {**collect_stats(runtime, _highwater), "cluster": cluster_stats(), "route_server": routeserve.serving.stats()}


def stats_answer() -> RoutingStats:
    """`/stats`: `stats_mapping` read into its Struct, which checks every value's type. A key the Struct lacks
    would be dropped: tests/unit/test_http_answers.py holds the two equal on a worker with every record filled."""
    return msgspec.convert(stats_mapping(), RoutingStats)


@app.page("/stats")
class Stats(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return _typed(self, stats_answer())


runtime.metrics.watch(lambda: collect_stats(runtime, _highwater))  # kvpipe.processors.routing.metrics


@app.page("/metrics")
class Metrics(web.View):
    async def get(self, request: web.Request) -> web.Response:
        return self.bytes(runtime.metrics.render(), content_type="text/plain; version=0.0.4")


@app.page("/health")
class Health(web.View):
    """Liveness for an orchestrator: 200 once the worker serves, with what it owns; open without the
    API token (kvpipe.processors.core.webauth.OPEN_PATHS)."""

    async def get(self, request: web.Request) -> web.Response:
        return _typed(self, RoutingHealth(status="ok", app="index", processor_id=settings.processor_id,
                                          owned_partitions=owned_partitions(),
                                          uptime_s=round(time.time() - runtime.started, 1)))
