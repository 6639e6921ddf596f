"""`/route`, `/route/sent` and `/route/finished` of one worker, as plain functions over its index
and in-flight accounting (`views` only moves bytes between aiohttp and these).

The decision itself is `kvpipe.processors.router.decide`. Here: the load the score reads (each node's
latest envelope fields, kept by the index), one worker's part of an answer (`local_answer`), and
the merge of several workers' parts (`merge_local`): every events partition is taken from one
answer only (the first that covers it: the coordinator's own), so a partition handed over in a
rebalance is never counted twice, and partitions no answer covered are reported as missing. A row
depends only on its node, so `decide.finish` over the claimed rows gives the answer one index
holding every node would give.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping, Sequence

import msgspec

from kvpipe.processors.core.index import Index
from kvpipe.processors.router.decide import finish, record_sent, route_local
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import Load, LocalRouteAnswer, RouteAnswer, RouteRequest
from kvpipe.processors.router.request import Checked

_local_decoder = msgspec.json.Decoder(LocalRouteAnswer)
_answer_fields = RouteAnswer.__struct_fields__


# msgspec leaves a float field out at its default only when it is the default's own object: a reported 0.0 (a new
# float) would be written as `"kv_usage": 0.0` where a node that reported nothing shows no field, and the native
# route path writes neither
_UNUSED = Load().kv_usage


class NodeLoads(Mapping[str, Load]):
    """Each node's latest reported load, read from the index when a row asks for it (a route
    touches the rows it builds, not every node); nodes that never reported have none: zero load."""

    # every load is >= 0: envelopes with a negative one are refused (`kvpipe.schemas.codec.validate_envelope`),
    # which lets a route skip ranking nodes holding nothing when a node with a hit outranks them all
    nonnegative = True

    def __init__(self, index: Index) -> None:
        self._nodes = index.nodes

    def __getitem__(self, node_id: str) -> Load:
        got = self.get(node_id)
        if got is None:
            raise KeyError(node_id)
        return got

    def get(self, node_id: str, default: Load | None = None) -> Load | None:  # type: ignore[override]
        # without an exception per node that never reported a load (a route asks once per row)
        node = self._nodes.get(node_id)
        if node is None or node.load is None:
            return default
        running, waiting, kv_usage = node.load
        return Load(running or 0, waiting or 0, kv_usage or _UNUSED)

    def __iter__(self) -> Iterator[str]:
        return (n for n, node in self._nodes.items() if node.load is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def node_loads(index: Index) -> dict[str, Load]:
    """Every reported load, as a dict (for tests and tools)."""
    return dict(NodeLoads(index))


def local_answer(index: Index, inflight: InFlight | None, req: RouteRequest, partitions: list[int],
                 stale_after_s: float | None, now: float | None = None,
                 checked: Checked | None = None) -> LocalRouteAnswer:
    """This worker's rows (nothing chosen yet), with the partitions it answers for. `checked`:
    `check_request(req)` when the caller has it already."""
    answer = route_local(index, req, loads=NodeLoads(index), inflight=inflight, now=now,
                         stale_after_s=stale_after_s, checked=checked)
    nodes = index.nodes
    listed = [r.node_id for r in answer.nodes] + [n.node_id for n in answer.no_signal]
    return LocalRouteAnswer(**{f: getattr(answer, f) for f in _answer_fields}, partitions=partitions,
                            node_partitions={n: nodes[n].partition for n in listed if n in nodes})


def decode_local(data: bytes) -> LocalRouteAnswer:
    return _local_decoder.decode(data)


def merge_local(answers: Sequence[LocalRouteAnswer], expected: Iterable[int]) -> tuple[list[RouteAnswer], list[int]]:
    """Claimed parts of local answers (the coordinator's first) and the partitions none covered."""
    owner: dict[int, int] = {}
    for i, answer in enumerate(answers):
        for p in answer.partitions:
            owner.setdefault(p, i)
    parts: list[RouteAnswer] = []
    for i, a in enumerate(answers):
        mine = {n for n, p in a.node_partitions.items() if owner.get(p) == i}
        parts.append(msgspec.structs.replace(a, nodes=[r for r in a.nodes if r.node_id in mine],
                                             no_signal=[n for n in a.no_signal if n.node_id in mine]))
    return parts, sorted(set(expected) - owner.keys())


def answer(parts: Sequence[RouteAnswer], missing: list[int], req: RouteRequest, index: Index,
           inflight: InFlight | None, now: float | None = None, checked: Checked | None = None) -> RouteAnswer:
    """The public answer: `finish` (merge, choose, trim; records `request_id` on the chosen node
    when this worker holds it) plus coverage. A `LocalRouteAnswer` part is narrowed to its
    `RouteAnswer` fields, so the public answer never carries worker bookkeeping."""
    plain = [RouteAnswer(**{f: getattr(p, f) for f in _answer_fields}) for p in parts]
    out = finish(plain, req, inflight=inflight, index=index, now=time.time() if now is None else now,
                 checked=checked)
    out.partial, out.missing_partitions = bool(missing), missing
    return out


def needs_forward(out: RouteAnswer, req: RouteRequest, index: Index) -> bool:
    """A `request_id` whose chosen node another worker holds: that worker must record it."""
    return req.request_id is not None and out.chosen is not None and out.chosen not in index.nodes


def sent_locally(index: Index, inflight: InFlight, request_id: str, node_id: str, req: RouteRequest,
                 now: float | None = None) -> str | None:
    """Record "request sent to node" here; why not (the node is not in this index, …), else None."""
    return record_sent(index, inflight, request_id, node_id, req, time.time() if now is None else now)
