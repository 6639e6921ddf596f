"""Scatter-gather for `/route`, `/route/sent`, `/route/finished` and `/nodes` across the workers of
one consumer group.

Each worker's index holds only the events partitions it owns (a node lives in one partition:
key = node_id), so a worker asked `/route` asks every other live worker for its *local* answer
(`?local=1`, which never fans out again) and merges (`kvpipe.processors.router.serving.merge_local`, then
`kvpipe.processors.router.decide.finish`). A node's row depends only on that node's own entries, load and
in-flight requests — all held by the worker that owns its partition — so merging the workers'
rows gives the answer one worker holding everything would give.

Peer discovery — Faust's assignor, not a registry of our own. Every worker publishes its
`canonical_url` (`http://<web_host>:<web_port>`; web_host must therefore be an address the other
workers can reach) in its consumer-group metadata; the group leader's assignment hands every
member the whole map `url → {topic: [partitions]}` (`app.assignor.external_topics_metadata()`).
So the map is exactly as fresh as the group itself: a worker that joins or leaves cleanly shows
up or disappears at the rebalance, and no extra topic, heartbeat or TTL has to be kept right. Its
one blind spot is a worker that died without leaving: until the session timeout expels it
(`broker_session_timeout`, 10 s) its URL stays in the map, the call fails fast (connection
refused) or times out, and the answer is marked partial — which is the truth.

Correctness does not rest on the map: every local answer says which partitions it covers
(restored and still assigned), each partition is taken from one answer only (ours first, so a
partition handed over mid-rebalance is never counted twice), and the expected partitions are the
topic's, so whatever no answer covered is reported: `"partial": true, "missing_partitions": [...]`.
A peer that errs or does not answer within `PEER_TIMEOUT_S` costs its partitions, never a 500 —
except a 400 (or 413): the request is wrong, so it is the whole answer, as one index holding
every node would have given it.

"Sent" and "finished" reports go to every peer (`?local=1`): only the worker holding the node
(sent) or the request (finished) acts, and no worker needs to know which one that is.

Transport: one `httpx.AsyncClient` per worker (`PeerClient`), its pool keeping connections to the peers alive
between requests; the views own it and close it at shutdown.
"""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable, Iterable, Mapping, NamedTuple, Sequence

import httpx
import msgspec

from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.core.httpclient import tls_context
from kvpipe.processors.routing.answers import LocalNodesPage, NodeRow

PEER_TIMEOUT_S = 1.0
LOCAL_PARAM = "local"

# (peer url, request body) → its local answer: JSON bytes both ways, each side decoding into its Structs
PeerFn = Callable[[str, bytes], Awaitable[bytes]]


def is_local(query: Mapping[str, str]) -> bool:
    return query.get(LOCAL_PARAM, "") not in ("", "0", "false")


def peers(distribution: Mapping[str, Mapping[str, Sequence[int]]], topic: str, self_url: str) -> dict[str, list[int]]:
    """`url → partitions of topic` for the other workers (the assignor's map; see module doc)."""
    out = {}
    for url, topics in distribution.items():
        parts = topics.get(topic) or ()
        if parts and url.rstrip("/") != self_url.rstrip("/"):
            out[url] = sorted(parts)
    return out


def claim(answers: Sequence[LocalNodesPage]) -> dict[int, int]:
    """`partition → index of the answer it is taken from`: the first answer covering it."""
    owner: dict[int, int] = {}
    for i, answer in enumerate(answers):
        for p in answer.partitions:
            owner.setdefault(p, i)
    return owner


class MergedNodes(NamedTuple):
    rows: list[NodeRow]  # in node id order
    missing: list[int]  # expected partitions no answer covered
    # some worker's page was cut at the limit: rows past these exist even when fewer than a page are merged
    more: bool


def merge_nodes(answers: Sequence[LocalNodesPage], expected: Iterable[int]) -> MergedNodes:
    """Each partition's rows from the one answer that claims it."""
    owner = claim(answers)
    rows = [row for i, a in enumerate(answers) for row in a.nodes if owner.get(row.partition) == i]
    return MergedNodes(sorted(rows, key=lambda r: r.node_id), sorted(set(expected) - owner.keys()),
                       any(a.next_after is not None for a in answers))


async def ask_all(peer_urls: Iterable[str], body: bytes, ask: PeerFn) -> list[bytes]:
    """Local answers of the peers that answered (failures and timeouts are left out: the merge
    reports their partitions as missing; a peer's 400/413 is raised). `ask` enforces the timeout."""
    urls = list(peer_urls)
    if not urls:
        return []
    results = await asyncio.gather(*(ask(url, body) for url in urls), return_exceptions=True)
    for r in results:
        if isinstance(r, ApiError):
            raise r
    return [r for r in results if not isinstance(r, BaseException)]


_local_nodes_decoder = msgspec.json.Decoder(LocalNodesPage)


async def nodes(local: LocalNodesPage, peer_urls: Iterable[str], ask: PeerFn,
                expected: Iterable[int]) -> MergedNodes:
    """Every worker's `/nodes` rows merged (`merge_nodes`). A peer answer that does not decode costs that
    peer's partitions, as a peer that did not answer does."""
    theirs = []
    for raw in await ask_all(peer_urls, b"", ask):
        try:
            theirs.append(_local_nodes_decoder.decode(raw))
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
    return merge_nodes([local, *theirs], expected)


class PeerClient:
    """The worker's one HTTP client to its peers, `client()` to use it. The `httpx.AsyncClient` is made on first use
    because it belongs to the event loop it first runs on, and the worker's loop exists only once Faust runs;
    `aclose` ends it (the worker's shutdown), and a later use would make a new one."""

    def __init__(self) -> None:
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            # timeouts per call (`http_asker`); the pool's defaults (100 connections, 20 kept alive 5 s) are
            # aiohttp's connection limit and cover a /route fan-out per peer and request in flight
            self._client = httpx.AsyncClient(verify=tls_context())
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()


def http_asker(client: Callable[[], httpx.AsyncClient], path: str, method: str, timeout_s: float = PEER_TIMEOUT_S,
               headers: Mapping[str, str] | None = None) -> PeerFn:
    """A `PeerFn` over httpx: `<url><path>?local=1` (`&local=1` when `path` carries a query), `timeout_s` in
    all; a POST sends the body as is, a GET none. `headers`: extra request headers, the bearer token of the group
    (every worker runs with the same one). Answers the 2xx body's bytes."""
    request_headers = {"Content-Type": "application/json", **(headers or {})}

    async def ask(url: str, body: bytes) -> bytes:
        target = f"{url.rstrip('/')}{path}{'&' if '?' in path else '?'}{LOCAL_PARAM}=1"
        data = body if method == "POST" else None
        async with asyncio.timeout(timeout_s):  # in all, as each of httpx's own timeouts is per phase
            resp = await client().request(method, target, content=data, headers=request_headers, timeout=timeout_s)
        if resp.status_code in (400, 413):  # the request's fault, not the peer's: see the module doc
            error = json.loads(resp.content)
            raise ApiError(resp.status_code, error.get("error", "bad request"), error.get("detail"))
        if not 200 <= resp.status_code < 300:  # a 401 here: the peer runs with another token
            raise RuntimeError(f"{target} answered {resp.status_code}")
        return resp.content

    return ask
