"""Analytics rows: what one Kafka message turns into in ClickHouse, as plain values.

Pure functions, no I/O. `event_rows` maps one envelope's events to `EventRow`s, `load_row` its load
report to a `LoadRow`; the processor builds `LifetimeRow`s itself (it owns the index that knows when
each block was stored), or the same values as columns (`kvpipe.processors.core.lifetimes`, the analytics app's path). The sink turns rows into columns with `event_columns` / `lifetime_columns` /
`load_columns`.

Identity: every row carries the Kafka coordinates `(partition, offset, idx)` of the message and
event it came from. A replay after a crash reproduces the same coordinates and the same values
(timestamps are the node's batch `ts`, never the processor's clock — except `ingest_ts`, which
is informational and not part of any key), so the ReplacingMergeTree key collapses the copies
(see `kvpipe.processors.analytics.sink`).
"""
from __future__ import annotations

import math
from typing import Mapping

import msgspec

from kvpipe.schemas.envelope import Envelope
from kvpipe.processors.core.lifetimes import U32_MASK, U64_MASK, LifetimeRow, hash_to_u64
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

KIND_STORED = "stored"
KIND_REMOVED = "removed"
KIND_CLEARED = "cleared"


class EventRow(msgspec.Struct, gc=False):
    """One KV event. `gc=False`: rows are flat values and there are many of them."""

    node_id: str
    epoch: int
    seq: int
    dp_rank: int  # -1: the envelope did not say
    group_idx: int  # -1: no group (AllBlocksCleared, or a pre-HMA node)
    medium: str  # "" when vLLM sent None (and for AllBlocksCleared)
    kind: str  # KIND_STORED | KIND_REMOVED | KIND_CLEARED
    block_hashes: list[int]  # u64
    parent_hash: int | None  # u64; None = first block of the request (stored as 0 + has_parent=0)
    num_blocks: int
    num_tokens: int  # len(token_ids) of a BlockStored; may exceed num_blocks*block_size (SWA masks)
    block_size: int  # tokens per block of the group; 0 when unknown (BlockRemoved without specs)
    spec_kind: str  # vLLM KVCacheSpecKind string; "" when unknown
    ts: float  # the node's batch ts (seconds since the epoch)
    ingest_ts: float  # when the processor decoded the message (not part of the dedup key)
    partition: int
    offset: int
    idx: int  # index of the event within the message
    # of a GPU store's hashes, how many the node's CPU tier held (`cputier`); 0 on other events; None: not counted
    from_cpu_blocks: int | None = None


class LoadRow(msgspec.Struct, gc=False):
    """The load one envelope reported (`kv_node_load`). A field the envelope left out is None (NULL)."""

    node_id: str
    epoch: int
    seq: int
    ts: float  # the node's batch ts
    running: int | None
    waiting: int | None
    kv_usage: float | None
    partition: int
    offset: int


def _count(v: int | None) -> int | None:
    # UInt32 columns: a value no scheduler reports (negative, absurd) is not load, and written as
    # is it would fail the insert, which the sink retries forever (one bad producer stalls analytics)
    return v if v is not None and 0 <= v <= U32_MASK else None


def load_row(env: Envelope, partition: int, offset: int) -> LoadRow | None:
    """The envelope's load report (heartbeats carry it too), or None when it reports none."""
    if env.running is None and env.waiting is None and env.kv_usage is None:
        return None
    usage = env.kv_usage
    if usage is not None and not math.isfinite(usage):
        usage = None
    return LoadRow(env.node_id, env.epoch, env.seq, env.ts, _count(env.running), _count(env.waiting), usage,
                   partition, offset)


def group_kinds_of(env: Envelope) -> dict[int, tuple[str, int]]:
    """`group_idx → (spec kind, block size)` from the envelope's group specs (empty if absent)."""
    return {g.group_idx: (g.kind, g.block_size) for g in env.group_specs or ()}


def event_rows(
    env: Envelope,
    events: list[Event],
    partition: int,
    offset: int,
    ingest_ts: float,
    group_kinds: Mapping[int, tuple[str, int]] | None = None,
) -> list[EventRow]:
    """One row per event of the envelope (none for a heartbeat).

    `group_kinds` (optional, `group_idx → (kind, block_size)`) lets the processor pass the specs
    it remembers for the node, since specs travel only on some envelopes; specs on this envelope
    take precedence, and a BlockStored's own `kv_cache_spec_kind`/`block_size` over both.
    """
    if not events:
        return []
    kinds: dict[int, tuple[str, int]] = dict(group_kinds or {})
    if env.group_specs:
        kinds.update(group_kinds_of(env))
    dp_rank = -1 if env.dp_rank is None else env.dp_rank
    rows: list[EventRow] = []
    for idx, ev in enumerate(events):
        if isinstance(ev, AllBlocksCleared):
            rows.append(EventRow(env.node_id, env.epoch, env.seq, dp_rank, -1, "", KIND_CLEARED, [], None,
                                 0, 0, 0, "", env.ts, ingest_ts, partition, offset, idx))
            continue
        group = -1 if ev.group_idx is None else ev.group_idx
        spec_kind, spec_block_size = kinds.get(group, ("", 0))
        hashes = [hash_to_u64(h) for h in ev.block_hashes]
        if isinstance(ev, BlockStored):
            parent = None if ev.parent_block_hash is None else hash_to_u64(ev.parent_block_hash)
            rows.append(EventRow(env.node_id, env.epoch, env.seq, dp_rank, group, ev.medium or "", KIND_STORED,
                                 hashes, parent, len(hashes), len(ev.token_ids), ev.block_size,
                                 ev.kv_cache_spec_kind or spec_kind, env.ts, ingest_ts, partition, offset, idx))
        elif isinstance(ev, BlockRemoved):
            rows.append(EventRow(env.node_id, env.epoch, env.seq, dp_rank, group, ev.medium or "", KIND_REMOVED,
                                 hashes, None, len(hashes), 0, spec_block_size, spec_kind, env.ts, ingest_ts,
                                 partition, offset, idx))
        else:
            raise TypeError(f"node {env.node_id!r} seq {env.seq}: event {idx} is {type(ev).__name__}, not a KV event")
    return rows


# --- columns for the sink --------------------------------------------------------------------------
# Column names differ from field names where the field name is an SQL keyword (partition, offset).

EVENT_COLUMNS = (
    "ts", "ingest_ts", "node_id", "epoch", "seq", "dp_rank", "group_idx", "medium", "kind", "spec_kind",
    "block_hashes", "parent_hash", "has_parent", "num_blocks", "num_tokens", "block_size",
    "kafka_partition", "kafka_offset", "event_idx", "from_cpu_blocks",
)
# Positions the derive step reads (the u64 hashes) and fills (the CPU-tier count) after `event_columns_of`.
HASHES_AT = EVENT_COLUMNS.index("block_hashes")
FROM_CPU_AT = EVENT_COLUMNS.index("from_cpu_blocks")
LIFETIME_COLUMNS = (
    "node_id", "epoch", "group_idx", "medium", "block_hash", "stored_ts", "removed_ts", "lifetime_s", "reason",
    "kafka_partition", "kafka_offset", "event_idx", "copy_idx", "group_kind", "end_reason",
)
LOAD_COLUMNS = ("ts", "node_id", "epoch", "seq", "running", "waiting", "kv_usage", "kafka_partition", "kafka_offset")


def _us(ts: float) -> int:
    # clickhouse-connect writes ints into DateTime64 columns as raw ticks (µs at precision 6);
    # floats are not accepted, and datetime objects would cost a conversion per value.
    return round(ts * 1_000_000)


def event_columns(rows: list[EventRow]) -> list[list]:
    """Column-oriented data in EVENT_COLUMNS order (one pass per column: cheap, no per-row tuples)."""
    return [
        [_us(r.ts) for r in rows],
        [_us(r.ingest_ts) for r in rows],
        [r.node_id for r in rows],
        [r.epoch for r in rows],
        [r.seq for r in rows],
        [r.dp_rank for r in rows],
        [r.group_idx for r in rows],
        [r.medium for r in rows],
        [r.kind for r in rows],
        [r.spec_kind for r in rows],
        [r.block_hashes for r in rows],
        [r.parent_hash or 0 for r in rows],
        [r.parent_hash is not None for r in rows],
        [r.num_blocks for r in rows],
        [r.num_tokens for r in rows],
        [r.block_size for r in rows],
        [r.partition for r in rows],
        [r.offset for r in rows],
        [r.idx for r in rows],
        [r.from_cpu_blocks for r in rows],
    ]


def number_copies(rows: list[LifetimeRow]) -> None:
    """Set `copy_idx`: the ordinal of each row among rows of this list with the same key.

    vLLM does not de-duplicate blocks: two requests computing the same prefix in one step both
    store the hash, so one AllBlocksCleared (or a node expiry) ends two lifetimes that agree on
    every key column. The ordinal keeps them apart, and it is the same on a replay because the
    sink numbers each `submit` list on its own and the processor submits all lifetimes ended by one
    message in one call.
    """
    seen: dict[tuple, int] = {}
    for r in rows:
        key = (r.node_id, r.group_idx, r.medium, r.block_hash, r.partition, r.offset, r.idx)
        n = seen.get(key, 0)
        r.copy_idx = n
        seen[key] = n + 1


def lifetime_columns(rows: list[LifetimeRow]) -> list[list]:
    """Column-oriented data in LIFETIME_COLUMNS order."""
    return [
        [r.node_id for r in rows],
        [r.epoch for r in rows],
        [r.group_idx for r in rows],
        [r.medium for r in rows],
        [r.block_hash for r in rows],
        [_us(r.stored_ts) for r in rows],
        [_us(r.removed_ts) for r in rows],
        [r.removed_ts - r.stored_ts for r in rows],
        [r.reason for r in rows],
        [r.partition for r in rows],
        [r.offset for r in rows],
        # event_idx is UInt32 (the DDL is applied): idx -1 is stored as 2^32-1, still distinct from
        # every real event index. Written as -1, the insert failed and the sink dropped every
        # new-epoch and node-expiry lifetime (found by tests/fault/test_processor_kill_analytics).
        [r.idx & U32_MASK for r in rows],
        [r.copy_idx for r in rows],
        [r.group_kind for r in rows],
        [r.end_reason or r.reason for r in rows],
    ]


def load_columns(rows: list[LoadRow]) -> list[list]:
    """Column-oriented data in LOAD_COLUMNS order."""
    return [
        [_us(r.ts) for r in rows], [r.node_id for r in rows], [r.epoch for r in rows], [r.seq for r in rows],
        [r.running for r in rows], [r.waiting for r in rows], [r.kv_usage for r in rows],
        [r.partition for r in rows], [r.offset for r in rows],
    ]


# --- the fast path: one message's event rows straight into columns ---------------------------------


class EventColumns:
    """Event rows as columns in EVENT_COLUMNS order, built straight from decoded events.

    The analytics agent's path (`event_rows` + `event_columns` is the readable reference of the same
    values; a unit test holds the two equal). Columns whose value is the message's (time, node, epoch,
    seq, rank, Kafka coordinates) are filled by list repetition instead of per row, and no per-row
    object is made, so the event loop spends about half the time per row and the writer thread
    only concatenates columns.
    """

    __slots__ = ("columns",)

    def __init__(self, columns: list[list] | None = None) -> None:
        self.columns = columns if columns is not None else [[] for _ in EVENT_COLUMNS]

    def __len__(self) -> int:
        return len(self.columns[0])

    def extend(self, other: "EventColumns") -> None:
        for mine, theirs in zip(self.columns, other.columns):
            mine.extend(theirs)

    def __getitem__(self, rows: slice) -> list[list]:
        """The columns of a range of rows (what an insert takes)."""
        return [c[rows] for c in self.columns]

    def __delitem__(self, rows: slice) -> None:
        for c in self.columns:
            del c[rows]


def event_columns_of(env: Envelope, events: list[Event], partition: int, offset: int, ingest_ts: float,
                     group_kinds: Mapping[int, tuple[str, int]] | None = None) -> EventColumns:
    """`event_columns(event_rows(...))`, without the rows (same arguments, same values)."""
    n = len(events)
    if not n:
        return EventColumns()
    kinds: dict[int, tuple[str, int]] = dict(group_kinds or {})
    if env.group_specs:
        kinds.update(group_kinds_of(env))
    group_c: list[int] = []
    medium_c: list[str] = []
    kind_c: list[str] = []
    spec_c: list[str] = []
    hashes_c: list[list[int]] = []
    parent_c: list[int] = []
    has_parent_c: list[bool] = []
    nblocks_c: list[int] = []
    ntokens_c: list[int] = []
    bsize_c: list[int] = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            group_c.append(-1); medium_c.append(""); kind_c.append(KIND_CLEARED); spec_c.append("")  # noqa: E702
            hashes_c.append([]); parent_c.append(0); has_parent_c.append(False)  # noqa: E702
            nblocks_c.append(0); ntokens_c.append(0); bsize_c.append(0)  # noqa: E702
            continue
        group = -1 if ev.group_idx is None else ev.group_idx
        hashes = [h & U64_MASK if h.__class__ is int else hash_to_u64(h) for h in ev.block_hashes]
        group_c.append(group)
        medium_c.append(ev.medium or "")
        hashes_c.append(hashes)
        nblocks_c.append(len(hashes))
        if isinstance(ev, BlockStored):
            kind_c.append(KIND_STORED)
            spec_c.append(ev.kv_cache_spec_kind or kinds.get(group, ("", 0))[0])
            parent = ev.parent_block_hash
            if parent is None:
                parent_c.append(0)
                has_parent_c.append(False)
            else:
                parent_c.append(hash_to_u64(parent))
                has_parent_c.append(True)
            ntokens_c.append(len(ev.token_ids))
            bsize_c.append(ev.block_size)
        elif isinstance(ev, BlockRemoved):
            spec_kind, spec_block_size = kinds.get(group, ("", 0))
            kind_c.append(KIND_REMOVED)
            spec_c.append(spec_kind)
            parent_c.append(0)
            has_parent_c.append(False)
            ntokens_c.append(0)
            bsize_c.append(spec_block_size)
        else:
            raise TypeError(f"node {env.node_id!r} seq {env.seq}: event is {type(ev).__name__}, not a KV event")
    dp_rank = -1 if env.dp_rank is None else env.dp_rank
    return EventColumns([
        [_us(env.ts)] * n, [_us(ingest_ts)] * n, [env.node_id] * n, [env.epoch] * n, [env.seq] * n, [dp_rank] * n,
        group_c, medium_c, kind_c, spec_c, hashes_c, parent_c, has_parent_c, nblocks_c, ntokens_c, bsize_c,
        [partition] * n, [offset] * n, list(range(n)), [None] * n,  # from_cpu_blocks: `derive` counts them
    ])
