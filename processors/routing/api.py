"""The HTTP API's logic as plain functions: `/nodes` paging and rows (the router endpoints'
logic is `kvpipe.processors.router.serving`; metrics are `kvpipe.processors.routing.metrics`).

`views` only moves bytes between aiohttp and these functions, so every rule here is testable
without a server. Rows are the Structs of `kvpipe.processors.routing.answers`. Bad input raises
`ApiError` (→ a 4xx JSON body `{"error", "detail"}`).
"""
from __future__ import annotations

import heapq
from typing import Iterable, Mapping, get_args

import msgspec

from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.core.index import Index, NodeState
from kvpipe.processors.routing.answers import NodeGroup, NodeHealth, NodeLoad, NodeRow, PartialSince

NODE_STATES: tuple[NodeHealth, ...] = get_args(NodeHealth)
NODES_PAGE_DEFAULT = 1000
NODES_PAGE_MAX = 10_000


def node_state(node: NodeState) -> NodeHealth:
    if node.expired:
        return "expired"
    if node.suspect:
        return "suspect"
    return "partial" if node.partial else "healthy"


def parse_nodes_query(query: Mapping[str, str]) -> tuple[int, str | None, str | None]:
    """`(limit, after, state)` of `GET /nodes?limit=&after=&state=`: pages in node id order, so a
    fleet of any size is read in bounded answers (`next_after` of one page is `after` of the next)."""
    raw = query.get("limit")
    try:
        limit = NODES_PAGE_DEFAULT if raw is None else int(raw)
    except ValueError:
        raise ApiError(400, "bad limit", f"limit {raw!r} is not an integer") from None
    if not 1 <= limit <= NODES_PAGE_MAX:
        raise ApiError(400, "bad limit", f"limit {limit} must be between 1 and {NODES_PAGE_MAX}")
    state = query.get("state")
    if state is not None and state not in NODE_STATES:
        raise ApiError(400, "bad state", f"state {state!r}; expected one of {', '.join(NODE_STATES)}")
    return limit, query.get("after"), state


def node_rows(index: Index, now: float, limit: int | None = None, after: str | None = None,
              state: str | None = None) -> list[NodeRow]:
    """Rows of the nodes with id > `after` in `state` (all when None), in id order, at most `limit`
    (a heap, not a sort of every node: a page costs O(n log limit))."""
    chosen = (n for n in index.nodes.values()
              if (after is None or n.node_id > after) and (state is None or node_state(n) == state))
    nodes = sorted(chosen, key=_node_id) if limit is None else heapq.nsmallest(limit, chosen, key=_node_id)
    return [node_row(node, now) for node in nodes]


def _node_id(node: NodeState) -> str:
    return node.node_id


def node_row(node: NodeState, now: float) -> NodeRow:
    since = node.partial_since
    return NodeRow(
        node_id=node.node_id,
        epoch=node.epoch,
        seq=node.seq,
        model=node.model,
        dp_rank=node.dp_rank,
        partition=node.partition,
        state=node_state(node),
        last_seen=node.last_seen,
        silent_s=round(max(0.0, now - node.last_seen), 3),
        expired=node.expired,
        suspect=node.suspect,
        suspect_reason=node.reason or None,
        partial=since is not None,
        partial_since=None if since is None else PartialSince(*since),
        clock_skew_s=round(node.skew_s, 3),
        load=None if not node.load else NodeLoad(*node.load),
        groups=[NodeGroup(**msgspec.structs.asdict(g)) for g in node.group_specs or ()],
        blocks={f"{g}/{m}": len(s.blocks) for (g, m), s in sorted(node.slots.items())},
        counters=dict(node.counters),
    )


def page_rows(rows: Iterable[NodeRow], limit: int, after: str | None, state: str | None,
              more: bool = False) -> tuple[list[NodeRow], str | None]:
    """One page of already-built rows (a merge of several workers' pages): `(rows, next_after)`,
    `next_after` None on the last page. `more`: rows past these exist although not given (a worker's own page
    was cut at `limit`; its rows past the cut all sort after this page's last, which holds that worker's whole page)."""
    chosen = sorted((r for r in rows if (after is None or r.node_id > after) and (state is None or r.state == state)),
                    key=lambda r: r.node_id)
    page = chosen[:limit]
    return page, page[-1].node_id if page and (len(chosen) > limit or more) else None
