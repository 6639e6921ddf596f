"""The re-store tracker's state, rebuilt from the store when a worker takes an events partition over.

The tracker (`restores.RestoreTracker`) remembers, per (node, group, medium), which hashes were stored and in
what order (the LRU stack the capacity curve's distances come from) and which of them ended when and why. A
worker that restarts, or gets a partition in a rebalance, restores the index from the partition's snapshot and
replays from its offset X; with an empty tracker, a block evicted before X and stored again after it would not
be a re-store at all.

Why rebuilt from ClickHouse rather than carried in the snapshots (processors/core/snapshot.py):
- Exact for free. Everything the tracker knows at offset X is a function of the partition's rows up to X (the
  stores in `kv_events`, the ends in `kv_block_lifetimes`), and a snapshot claims X only after the store
  acknowledged every row up to it (processors/analytics/agents.py). So the rows `kafka_offset <= X` are all
  there; rows past X (written before a crash, not covered) are left out by that filter and replayed.
- Cheap where it matters. The stack holds up to `max_keys` (2^20) hashes per slot — the index holds only
  what is cached now, the stack every hash it may still measure a distance to. In snapshots that would be
  rewritten every `snapshot_every_s` for every slot, growing each snapshot many times over; rebuilt from the
  store it costs one query when a partition is assigned, nothing while consuming.
- The same bound. The query keeps the `max_keys` most recently stored hashes per slot (`LIMIT n BY`), the
  ones the live tracker would remember, and `ended` only for those: memory is what the live tracker uses.

The CPU tier's counts (`cputier`, the `from_cpu_blocks` of each GPU store) come back the same way and for the
same reason: `query_state` also runs `cputier.REBUILD_SQL` (each node's CPU stores minus removals up to X) and
returns them with the slots (`PartitionState`); the app's tracker installs both.

What is not identical: a live stack forgets past `max_keys` only when it compacts, so between compactions it
may still measure a distance of `max_keys` or more that the rebuilt one no longer can; `held` (blocks the
slot holds) is taken from the restored index, which counts each cached hash once.
"""
from __future__ import annotations

from typing import Any, Callable

from kvpipe.processors.analytics import cputier
from kvpipe.processors.analytics.restores import RestoreTracker, Slot, SlotKey
from kvpipe.processors.analytics.stackdist import StackDistance
from kvpipe.processors.core.index import GPU, Index

# Positions order the stores and ends of one node like the live tracker saw them: Kafka offset, then event index,
# then the hash's index in the event, packed in one Int128 (offset * 2^56 + event * 2^32 + hash; a message holds
# fewer than 2^24 events, at most 8 MiB, and an event fewer than 2^32 hashes) — one number aggregates much faster
# than a tuple. The event slot is the index + 1, so that a lifetime ended "before the message's events" (event_idx
# -1, stored as 2^32-1 by rows.lifetime_columns: a new epoch's clear, a resync) sorts first (0), and a node expiry,
# attributed to the node's last applied message but coming after its events, sorts last (2^24 - 1).
STATE_SQL = """
SELECT kafka_partition, node_id, group_idx, medium, block_hash,
    maxIf(at, is_store) AS stored_at,
    maxIf(at, NOT is_store) AS ended_at,
    argMaxIf(removed_us, at, NOT is_store) AS removed_us,
    argMaxIf(end_reason, at, NOT is_store) AS end_reason
FROM
(
    SELECT kafka_partition, node_id, if(group_idx < 0, 0, group_idx) AS group_idx,
        if(medium = '', '{gpu}', medium) AS medium, h AS block_hash,
        toInt128(kafka_offset) * 72057594037927936 + toInt128(event_idx + 1) * 4294967296 + i AS at,
        1 AS is_store, toInt64(0) AS removed_us, '' AS end_reason
    FROM kv_events
    ARRAY JOIN block_hashes AS h, arrayEnumerate(block_hashes) AS i
    WHERE kind = 'stored' AND has({{partitions:Array(UInt32)}}, kafka_partition)
        AND kafka_offset <= {{offsets:Array(UInt64)}}[indexOf({{partitions:Array(UInt32)}}, kafka_partition)]
    UNION ALL
    SELECT kafka_partition, node_id, group_idx, medium, block_hash,
        toInt128(kafka_offset) * 72057594037927936
            + toInt128(if(event_idx = 4294967295, if(reason = 'node_expired', 16777215, 0), event_idx + 1)) * 4294967296
            AS at,
        0 AS is_store, toUnixTimestamp64Micro(removed_ts) AS removed_us,
        if(end_reason = '', reason, end_reason) AS end_reason
    FROM kv_block_lifetimes
    WHERE has({{partitions:Array(UInt32)}}, kafka_partition)
        AND kafka_offset <= {{offsets:Array(UInt64)}}[indexOf({{partitions:Array(UInt32)}}, kafka_partition)]
)
GROUP BY kafka_partition, node_id, group_idx, medium, block_hash
HAVING stored_at > 0
ORDER BY stored_at DESC
LIMIT {{max_keys:UInt64}} BY kafka_partition, node_id, group_idx, medium
""".format(gpu=GPU)
# Not FINAL: a replayed copy of a row has the same position and values, so max/argMax read it the same way.
# maxIf over no row is 0, and a store's position is > 0 (its event slot is >= 1): `stored_at > 0` keeps hashes
# stored at least once, `ended_at > stored_at` those whose last lifetime ended after their last store.

STATE_COLUMNS = ("kafka_partition", "node_id", "group_idx", "medium", "block_hash", "stored_at", "ended_at",
                 "removed_us", "end_reason")


def build_slots(columns: dict[str, list], max_keys: int) -> dict[int, dict[SlotKey, Slot]]:
    """Per partition, the slots the rows of STATE_SQL describe (pure; `columns`: column name → values)."""
    if not columns.get("block_hash"):  # no rows (chDB then sends no columns at all)
        return {}
    order = sorted(range(len(columns["block_hash"])), key=lambda i: columns["stored_at"][i])  # oldest store first
    per_slot: dict[tuple[int, SlotKey], tuple[list, dict]] = {}
    part, node, group, medium, hashes = (columns[c] for c in ("kafka_partition", "node_id", "group_idx", "medium",
                                                              "block_hash"))
    stored_at, ended_at = columns["stored_at"], columns["ended_at"]
    removed_us, reason = columns["removed_us"], columns["end_reason"]
    for i in order:
        key = (int(part[i]), (node[i], int(group[i]), medium[i]))
        entry = per_slot.get(key)
        if entry is None:
            entry = per_slot[key] = ([], {})
        h = int(hashes[i])
        entry[0].append(h)
        if ended_at[i] > stored_at[i]:  # its last lifetime ended after its last store
            entry[1][h] = (removed_us[i] / 1_000_000, reason[i])
    out: dict[int, dict[SlotKey, Slot]] = {}
    for (p, slot_key), (keys, ended) in per_slot.items():
        slot = Slot(max_keys, p, StackDistance.from_order(keys, max_keys))
        slot.ended = ended
        out.setdefault(p, {})[slot_key] = slot
    return out


class PartitionState(dict[SlotKey, Slot]):
    """One partition's rebuilt slots, and `cpu`: its nodes' CPU-tier counts (`cputier`), which the app's tracker
    (`cputier.CapacityTracker.install`) installs with them. A dict, so that callers that filter or compare the
    slots keep working."""

    cpu: dict[str, cputier.NodeCopies]

    def __init__(self, slots: dict[SlotKey, Slot] | None = None,
                 cpu: dict[str, cputier.NodeCopies] | None = None) -> None:
        super().__init__(slots or {})
        self.cpu = cpu if cpu is not None else {}


def query_state(read: Callable[[str, dict], dict[str, list]], offsets: dict[int, int],
                max_keys: int) -> dict[int, dict[SlotKey, Slot]]:
    """The slots of these partitions as of these offsets (partition → last covered offset; < 0: none yet), each a
    `PartitionState` with the CPU-tier counts too.

    `read(sql, parameters)` runs kvpipe's own SQL on the store and returns columns by name (the sink's
    `read_columns`). Runs in a worker thread: the query and the rebuilding take time, the result is installed
    on the event loop (`install`)."""
    covered = {p: x for p, x in offsets.items() if x >= 0}
    out: dict[int, dict[SlotKey, Slot]] = {p: PartitionState() for p in offsets}
    if covered:
        parts = sorted(covered)
        bounds = {"partitions": parts, "offsets": [covered[p] for p in parts]}
        slots = build_slots(read(STATE_SQL, {**bounds, "max_keys": max_keys}), max_keys)
        cpu = cputier.build_nodes(read(cputier.REBUILD_SQL, bounds))
        for p in parts:
            out[p] = PartitionState(slots.get(p), cpu.get(p))
    return out


def install(tracker: RestoreTracker | cputier.CapacityTracking, index: Index,
            state: dict[int, dict[SlotKey, Slot]]) -> int:
    """Put rebuilt partitions into the tracker (on the event loop); `held` from the restored index. Returns
    the number of hashes installed."""
    keys = 0
    for p, slots in state.items():
        for (node_id, group, medium), slot in slots.items():
            node = index.nodes.get(node_id)
            held = node.slots.get((group, medium)) if node is not None else None
            slot.held = len(held.blocks) if held is not None else 0
            keys += len(slot.stack)
        tracker.install(p, slots)
    return keys


def restore_info(state: dict[int, dict[SlotKey, Any]]) -> dict[str, int]:
    return {"partitions": len(state), "slots": sum(map(len, state.values())),
            "hashes": sum(len(s.stack) for slots in state.values() for s in slots.values()),
            "ended": sum(len(s.ended) for slots in state.values() for s in slots.values()),
            "cpu_copies": sum(len(held) for slots in state.values() for node in getattr(slots, "cpu", {}).values()
                              for held in node.groups.values())}
