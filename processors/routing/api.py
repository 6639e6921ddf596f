"""The HTTP API's logic as plain functions: `/nodes` paging and answers (the router endpoints'
logic is `kvpipe.processors.router.serving`; metrics are `kvpipe.processors.routing.metrics`).

`views` only moves bytes between aiohttp and these functions, so every rule here is testable
without a server. Bad input raises `ApiError` (→ a 4xx JSON body `{"error", "detail"}`).
"""
from __future__ import annotations

import heapq
from typing import Mapping

from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.core.index import Index, NodeState, partial_fields


NODE_STATES = ("healthy", "partial", "suspect", "expired")
NODES_PAGE_DEFAULT = 1000
NODES_PAGE_MAX = 10_000


def node_state(node: NodeState) -> str:
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
              state: str | None = None) -> list[dict]:
    """Rows of the nodes with id > `after` in `state` (all when None), in id order, at most `limit`
    (a heap, not a sort of every node: a page costs O(n log limit))."""
    chosen = (n for n in index.nodes.values()
              if (after is None or n.node_id > after) and (state is None or node_state(n) == state))
    key = lambda n: n.node_id  # noqa: E731
    nodes = sorted(chosen, key=key) if limit is None else heapq.nsmallest(limit, chosen, key=key)
    rows = []
    for node in nodes:
        rows.append({
            "node_id": node.node_id,
            "epoch": node.epoch,
            "seq": node.seq,
            "model": node.model,
            "dp_rank": node.dp_rank,
            "partition": node.partition,
            "state": node_state(node),
            "last_seen": node.last_seen,
            "silent_s": round(max(0.0, now - node.last_seen), 3),
            "expired": node.expired,
            "suspect": node.suspect,
            "suspect_reason": node.reason or None,
            **partial_fields(node),
            "clock_skew_s": round(node.skew_s, 3),
            # the latest (running, waiting, kv_usage) it reported, as the router's score reads it
            "load": dict(zip(("running", "waiting", "kv_usage"), node.load)) if node.load else None,  # largest excess over the trusted clock (clamped)
            "groups": [{"group_idx": g.group_idx, "kind": g.kind, "block_size": g.block_size,
                        "sliding_window": g.sliding_window} for g in node.group_specs or ()],
            "blocks": {f"{g}/{m}": len(s.blocks) for (g, m), s in sorted(node.slots.items())},
            "counters": dict(node.counters),
        })
    return rows


def page_rows(rows: list[dict], limit: int, after: str | None, state: str | None) -> dict:
    """One page of already-built rows (a merge of several workers' pages): `{"nodes", "next_after"}`."""
    chosen = sorted((r for r in rows if (after is None or r["node_id"] > after) and (state is None or r.get("state") == state)),
                    key=lambda r: r["node_id"])
    page = chosen[:limit]
    return {"nodes": page, "next_after": page[-1]["node_id"] if len(chosen) > limit else None}
