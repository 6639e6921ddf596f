"""GPU stores served from the CPU tier, counted as the analytics app writes them (saved query `cpu_tier_hits`).

The rule (the query's header and docs/capacity-planning.md say why it is the proxy the stream allows): a GPU
BlockStored of a hash while the node's CPU tier holds that hash is a block loaded back from CPU. "Holds" is a
running count per (node, epoch, group, hash) of the CPU tier's BlockStored minus its BlockRemoved, in the order
the app applies events (Kafka offset, then event index); a count above 0 is a live copy. A CPU-tier
AllBlocksCleared carries no medium, so it does not reset the count (the query has always said so).

`CpuTier` keeps those counts and gives each event of an applied message its `from_cpu_blocks` (migration 006):
for a GPU store, how many of its hashes had a live CPU copy just before it; 0 for every other event. Counting as
the app writes turns the query from a window over every CPU event plus an ASOF join of every GPU store (~4 s at
10 M lifetimes) into a sum over one column (BENCHMARKS.md, analytics).

Invariants and decisions:
- Per node only the epoch of its latest applied message is kept: the index never applies an older epoch after a
  newer one (`Index.apply`: stale), and a new epoch means a new cache, so the old counts can never be read
  again. (Only a node the index forgot after its retention, coming back with an epoch it had left, differs:
  the store's rows of that epoch would still count there; this state starts empty.)
- A count back at 0 is dropped (absent = 0). A negative count (a CPU removal of a hash the stream never showed
  stored) is kept: a later store brings it to 0, not to a live copy, as in the SQL.
- Each event is taken whole: a CPU event's hashes all count before the next event, and a GPU store reads the
  counts as they were before it (the same event never holds both media).
- Kept per node with the node's events partition (a node's messages share one: Kafka key = node id), so that a
  partition's counts can be dropped and rebuilt on their own, as the re-store tracker's slots are.
- `unknown` partitions: their counts were dropped (a restore, a rebalance) and not rebuilt; their events get
  NULL, which the query computes the old way. A new `CpuTier` counts every partition from its first offset.
- Restarts: the counts at a snapshot's offset X are a function of the partition's CPU events up to X, all of
  which the store acknowledged before the snapshot claimed X (processors/analytics/agents.py), so they are
  rebuilt from the store with REBUILD_SQL (processors/analytics/restore_state.py runs it beside the re-store
  tracker's query). A replayed message then gets the value it got the first time.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from kvpipe.processors.analytics.restores import RestoreRow, RestoreTracker, Slot, SlotKey
from kvpipe.processors.core.lifetimes import LifetimeColumns, LifetimeRow
from kvpipe.schemas.envelope import Envelope
from kvpipe.schemas.events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored, Event

Counts = dict[int, dict[int, int]]  # group → block hash (u64) → CPU copies (non-zero)


class NodeCopies:
    """One node's CPU-tier counts in one epoch. `partition`: the events partition of the node (its owner keeps this)."""

    __slots__ = ("epoch", "partition", "groups")

    def __init__(self, epoch: int, partition: int, groups: Counts | None = None) -> None:
        self.epoch = epoch
        self.partition = partition
        self.groups: Counts = groups if groups is not None else {}


class CpuTier:
    def __init__(self) -> None:
        self.nodes: dict[str, NodeCopies] = {}
        self.unknown: set[int] = set()

    def observe(self, env: Envelope, events: Sequence[Event], hashes: Sequence[list[int]],
                partition: int) -> list[int] | list[None]:
        """`from_cpu_blocks` for each event of an applied message, and the counts moved past it. `hashes`: each
        event's block hashes as u64, as the event rows carry them (`rows.event_columns_of`)."""
        if partition in self.unknown:
            return [None] * len(events)
        node = self.nodes.get(env.node_id)
        if node is None or node.epoch != env.epoch:
            node = self.nodes[env.node_id] = NodeCopies(env.epoch, partition)
        node.partition = partition
        groups = node.groups
        out: list[int] = []
        for ev, hs in zip(events, hashes):
            if isinstance(ev, BlockStored):
                medium = ev.medium
                if medium == MEDIUM_GPU:
                    held = groups.get(-1 if ev.group_idx is None else ev.group_idx)
                    out.append(sum(1 for h in hs if held.get(h, 0) > 0) if held else 0)
                    continue
                if medium == MEDIUM_CPU:
                    _add(groups, -1 if ev.group_idx is None else ev.group_idx, hs, 1)
            elif isinstance(ev, BlockRemoved) and ev.medium == MEDIUM_CPU:
                _add(groups, -1 if ev.group_idx is None else ev.group_idx, hs, -1)
            out.append(0)
        return out

    def forget_partition(self, partition: int) -> None:
        """Drop the counts of one events partition's nodes; its events are not counted until `install`."""
        for node_id in [n for n, c in self.nodes.items() if c.partition == partition]:
            del self.nodes[node_id]
        self.unknown.add(partition)

    def install(self, partition: int, nodes: dict[str, NodeCopies]) -> None:
        """Replace one partition's counts with those rebuilt for its restored offset (`build_nodes`)."""
        self.forget_partition(partition)
        self.nodes.update(nodes)
        self.unknown.discard(partition)

    def entries(self) -> int:
        return sum(len(held) for node in self.nodes.values() for held in node.groups.values())


def _add(groups: Counts, group: int, hashes: list[int], step: int) -> None:
    held = groups.get(group)
    if held is None:
        held = groups[group] = {}
    for h in hashes:
        n = held.get(h, 0) + step
        if n:
            held[h] = n
        else:
            del held[h]


class CpuCounts(Protocol):
    """What the app's tracker offers of the CPU tier's counts (`CpuTier`, or the native one's view)."""

    def observe(self, env: Envelope, events: Sequence[Event], hashes: Sequence[list[int]],
                partition: int) -> list[int] | list[None]: ...
    def forget_partition(self, partition: int) -> None: ...
    def install(self, partition: int, nodes: dict[str, NodeCopies]) -> None: ...
    def entries(self) -> int: ...


class CapacityTracking:
    """The app's tracker as `derive.message_rows` and `restore_state.install` use it: re-stores per message and the
    CPU tier's counts (`cpu`), dropped and rebuilt per partition. Two implementations: `CapacityTracker` below (the
    reference) and processors/analytics/nativetrack.py's `NativeCapacityTracker` (the same state, native). A base
    class, not a Protocol: `message_rows` tests it per message, and isinstance on a class is cheap."""

    cpu: CpuCounts
    max_keys: int
    loaded: set[int]

    def observe(self, env: Envelope, events: list[Event], lifetimes: list[LifetimeRow] | LifetimeColumns,
                partition: int, offset: int, kinds: Mapping[int, tuple[str, int]]) -> list[RestoreRow]:
        raise NotImplementedError

    def end_all(self, lifetimes: list[LifetimeRow] | LifetimeColumns) -> None:
        raise NotImplementedError

    def forget_partition(self, partition: int) -> None:
        raise NotImplementedError

    def install(self, partition: int, slots: dict[SlotKey, Slot]) -> None:
        raise NotImplementedError


class CapacityTracker(RestoreTracker, CapacityTracking):
    """The analytics app's tracker: the re-store tracker, and the CPU tier's counts beside it, dropped and rebuilt
    with it (per partition: `forget_partition`, `install` from processors/analytics/restore_state.py)."""

    def __init__(self, max_keys_per_slot: int = 1 << 20) -> None:
        super().__init__(max_keys_per_slot)
        self.cpu = CpuTier()

    def forget_partition(self, partition: int) -> None:
        super().forget_partition(partition)
        self.cpu.forget_partition(partition)

    def install(self, partition: int, slots: dict[SlotKey, Slot]) -> None:
        super().install(partition, slots)  # forgets the partition first, CPU counts included
        cpu = getattr(slots, "cpu", None)  # restore_state.PartitionState; a plain dict rebuilt no counts
        if cpu is not None:
            self.cpu.install(partition, cpu)


# The counts as of each partition's restored offset: per node, its CPU events of the latest epoch they reach
# (an older epoch's counts can never be read again; a node whose newest epoch has no CPU event yet gets the
# previous epoch's, which its next message replaces, as it would have here). FINAL: a count needs each event once.
REBUILD_SQL = """
SELECT kafka_partition, node_id, epoch, group_idx, block_hash, copies
FROM
(
    SELECT kafka_partition, node_id, epoch, group_idx, h AS block_hash, sum(if(kind = 'stored', 1, -1)) AS copies,
        max(epoch) OVER (PARTITION BY kafka_partition, node_id) AS latest
    FROM kv_events FINAL
    ARRAY JOIN block_hashes AS h
    WHERE medium = '{cpu}' AND kind IN ('stored', 'removed') AND has({{partitions:Array(UInt32)}}, kafka_partition)
        AND kafka_offset <= {{offsets:Array(UInt64)}}[indexOf({{partitions:Array(UInt32)}}, kafka_partition)]
    GROUP BY kafka_partition, node_id, epoch, group_idx, block_hash
)
WHERE epoch = latest AND copies != 0
""".format(cpu=MEDIUM_CPU)


def build_nodes(columns: dict[str, list]) -> dict[int, dict[str, NodeCopies]]:
    """Per partition, the nodes' counts the rows of REBUILD_SQL describe (pure; `columns`: name → values)."""
    out: dict[int, dict[str, NodeCopies]] = {}
    if not columns.get("block_hash"):  # no rows (chDB then sends no columns at all)
        return out
    for p, node_id, epoch, group, h, n in zip(*(columns[c] for c in ("kafka_partition", "node_id", "epoch",
                                                                   "group_idx", "block_hash", "copies"))):
        nodes = out.setdefault(int(p), {})
        node = nodes.get(node_id)
        if node is None:
            node = nodes[node_id] = NodeCopies(int(epoch), int(p))
        node.groups.setdefault(int(group), {})[int(h)] = int(n)
    return out


# The same count in SQL, per GPU store, from the events alone: the definition the app's counts are tested against
# (tests/integration/test_cpu_tier_counts.py) and what fills the benchmark's synthetic store
# (kvpipe/bench/saved_queries.py).
# `{events}`: a table or view with kv_events' columns and each event once. The CPU tier's copies per (node, epoch,
# group, hash) are a running sum over its events; each GPU store's hash takes the sum of the latest CPU event
# before it (an ASOF join); positions pack (kafka_offset, event_idx), a message holding fewer than 2^24 events.
EVENT_COUNTS_SQL = """
WITH
    cpu AS (
        SELECT node_id, epoch, group_idx, block_hash, kafka_offset * 16777216 + event_idx AS pos,
            sum(if(kind = 'stored', 1, -1)) OVER (
                PARTITION BY node_id, epoch, group_idx, block_hash ORDER BY pos
                ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS cpu_copies
        FROM (SELECT node_id, epoch, group_idx, kind, kafka_offset, event_idx, arrayJoin(block_hashes) AS block_hash
              FROM {events}
              WHERE medium = '{cpu}' AND kind IN ('stored', 'removed'))
    ),
    gpu AS (
        SELECT node_id, epoch, group_idx, kafka_partition, kafka_offset, event_idx,
            kafka_offset * 16777216 + event_idx AS pos, arrayJoin(block_hashes) AS block_hash
        FROM {events}
        WHERE medium = '{gpu}' AND kind = 'stored'
    )
SELECT g.kafka_partition AS kafka_partition, g.kafka_offset AS kafka_offset, g.event_idx AS event_idx,
    toUInt32(countIf(c.cpu_copies > 0)) AS from_cpu_blocks
FROM gpu AS g
ASOF LEFT JOIN cpu AS c
    ON g.node_id = c.node_id AND g.epoch = c.epoch AND g.group_idx = c.group_idx AND g.block_hash = c.block_hash
        AND g.pos > c.pos
GROUP BY kafka_partition, kafka_offset, event_idx
"""


def event_counts_sql(events: str) -> str:
    """EVENT_COUNTS_SQL over `events` (kvpipe's own table or view name, never analyst input)."""
    return EVENT_COUNTS_SQL.format(events=events, cpu=MEDIUM_CPU, gpu=MEDIUM_GPU)
