"""The routing app's answers besides the router's (those are `kvpipe.processors.router.model`): `GET /nodes`,
`GET /stats` and `GET /health`, one Struct per record; `views` encodes these, `kvpipe.processors.routing.apidoc`
documents them.

The JSON is what these endpoints answered before they were typed, every key present (null included), so no
`omit_defaults`. `/stats` is typed down to its stable records; what stays a free-form mapping says why where it is
declared (counter sets that grow with features, the native route server's own report).
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec

from kvpipe.processors.core.answers import DurabilityStats
from kvpipe.schemas.envelope import GroupSpec

# How /nodes (and /stats `nodes`) class a node: expired, else suspect, else partial (resynced after a
# real loss), else healthy (`kvpipe.processors.routing.api.node_state`).
NodeHealth = Literal["healthy", "partial", "suspect", "expired"]


# -- GET /nodes ---------------------------------------------------------------------------------------------


class NodeGroup(GroupSpec, omit_defaults=False):
    """One KV cache group of a node as it published it: every `GroupSpec` field, by inheritance, so a field
    the wire form gains is in /nodes at once; its defaults are written out (the wire form omits them)."""


class NodeLoad(msgspec.Struct):
    """The latest load the node reported, as the router's score reads it; a part it never sent is null."""

    running: int | None
    waiting: int | None
    kv_usage: float | None


class PartialSince(msgspec.Struct):
    """The envelope that resynced the node after a real loss: since then the index may lack older blocks."""

    epoch: int
    seq: int
    ts: float


class NodeRow(msgspec.Struct):
    node_id: str
    epoch: int
    seq: int  # last applied seq in this epoch
    model: str | None
    dp_rank: int | None
    partition: int  # of the events topic
    state: NodeHealth
    last_seen: float  # the node's own clock at its last applied envelope
    silent_s: float
    expired: bool
    suspect: bool
    suspect_reason: str | None
    partial: bool
    partial_since: PartialSince | None
    clock_skew_s: float  # largest excess of its timestamps over the trusted clock (clamped)
    load: NodeLoad | None
    groups: list[NodeGroup]
    blocks: dict[str, int]  # "<group>/<medium>" → blocks the index holds
    # the node's ingest counters (`kvpipe.processors.core.index.NODE_COUNTERS`): a mapping, as the set grows
    counters: dict[str, int]


class LocalNodesPage(msgspec.Struct):
    """One worker's page (`GET /nodes?local=1`, asked by the worker answering the group's `/nodes`): its rows
    and the events partitions it answers for, so each partition is taken from one worker only."""

    nodes: list[NodeRow]
    next_after: str | None
    partitions: list[int]


class NodesPage(msgspec.Struct):
    """`GET /nodes`: one page of every worker's nodes in id order; `next_after` is the next page's `after`
    (null: the last page). `partial`: some partitions' workers did not answer (`missing_partitions`)."""

    nodes: list[NodeRow]
    next_after: str | None
    partial: bool
    missing_partitions: list[int]


# -- GET /stats ---------------------------------------------------------------------------------------------


class Freshness(msgspec.Struct):
    """One events partition's position: the offset applied last and how far behind the log and the clock."""

    offset: int
    behind: int | None  # messages after `offset` (null: end offset unknown)
    lag_s: float | None  # now minus the newest applied message's stream time
    since_apply_s: float | None


class IndexStore(msgspec.Struct):
    kind: str  # "native" | "python"
    entries: int
    memory_bytes: int | None  # null for the Python store (measured by the bench instead)


class NodeCounts(msgspec.Struct):
    """Nodes per `NodeHealth` state."""

    healthy: int
    partial: int
    suspect: int
    expired: int


class RouterStats(msgspec.Struct):
    # in-flight accounting: its counters (`kvpipe.processors.router.inflight`) plus `entries` and `nodes`,
    # all ints; a mapping, as the counter set grows with the accounting
    inflight: dict[str, int]


class ClusterStats(msgspec.Struct):
    """This worker in its consumer group (`kvpipe.processors.routing.scatter`)."""

    url: str
    owned_partitions: list[int]
    peers: dict[str, list[int]]  # the other workers' URL → the partitions they own
    expected_partitions: list[int]
    # messages delivered directly vs through Faust's wait, and the batch path's counters
    # (`kvpipe.processors.core.fastpath`, `batchdelivery`); null where the consumer lacks that path; a mapping,
    # as which counters exist depends on the consumer in use
    deliveries: dict[str, int | None]


class DlqReadbackRun(msgspec.Struct):
    """The last read of the DLQ at a restore (`kvpipe.processors.routing.dlqtail`)."""

    partitions: list[int]  # the events partitions just restored
    found: int  # DLQ records already written for messages their replay meets again
    records_read: int  # DLQ records read to find them (every DLQ partition, since the restored snapshot)
    capped_partitions: int  # DLQ partitions whose older records were left unread (MAX_RECORDS_PER_PARTITION)
    dlq_partitions: int
    ms: float  # the read's time, in the restore's
    ts: float


class DlqReadbackFailure(msgspec.Struct):
    ts: float
    partitions: list[int]
    error: str


class DlqReadback(msgspec.Struct):
    """Reads of the DLQ at restore, so a replay after a crash writes no DLQ record twice
    (`counters.dlq_already_written` counts the sends it skipped)."""

    reads: int
    errors: int  # reads that failed (their partitions' replays may write duplicates)
    last_error: DlqReadbackFailure | None  # the latest failed read: when, for which partitions, why
    records_read: int
    found: int
    pending: int  # source offsets known written that the replay has not met yet
    last: DlqReadbackRun | None


class RoutingStats(msgspec.Struct):
    """`GET /stats` of one routing worker (what `/metrics` exports too)."""

    processor_id: str
    uptime_s: float
    counters: dict[str, int]  # index and ingest counters by name: a mapping, as each feature adds its own
    # bad messages this worker classified, by reason (an open set: decode errors name their kind). A message a
    # replay meets again counts again; its DLQ record is written once (`counters.dlq_already_written`)
    dlq_by_reason: dict[str, int]
    index: dict[str, dict[str, int]]  # group → medium → blocks held
    index_store: IndexStore
    nodes: NodeCounts
    freshness: dict[str, Freshness]  # by partition
    durability: DurabilityStats
    dlq_readback: DlqReadback
    router: RouterStats
    cluster: ClusterStats
    # the native route server's report (native/src/serve.rs counters and latency histograms, plus its state):
    # its shape is the native server's and differs while it is off, so it stays a mapping
    route_server: dict[str, Any]


# -- GET /health --------------------------------------------------------------------------------------------


class RoutingHealth(msgspec.Struct):
    """Liveness: answered once the worker serves, open without the token."""

    status: Literal["ok"]
    app: Literal["index"]
    processor_id: str
    owned_partitions: list[int]
    uptime_s: float
