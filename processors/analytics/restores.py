"""Re-stores: a block stored again on the same node, group and medium after its lifetime ended.

A re-store is recompute the cache paid for: the block was evicted (or cleared) and a later request
needed it again. For each one the tracker reports how long after the end it came back and its LRU
stack distance among the slot's stores (`stackdist`): a cache `d + 1` blocks large under LRU would
still have held it. That distance is what the capacity curve sweeps (saved query `capacity_curve`,
`kvpipe plan`).

Pure: `observe` takes what the analytics agent already has for one message (envelope, decoded
events, the lifetimes the index closed) and returns rows; no I/O, no index access.

What counts as an access: every stored block hash of a BlockStored (copies too). vLLM publishes no
event for a cache *hit*, so a block reused while cached does not move to the top of the modelled
stack: the model's recency is store recency, not use recency (see `CAPACITY_METHOD`).

Order inside a message matters (a removal at event 3 and a store at event 7 of one envelope is a
re-store; the other way round is not): lifetimes carry the index `idx` of the event that ended them
(-1: before the message's events, e.g. a new epoch's clear), and `observe` walks both in event order.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import msgspec

from kvpipe.processors.core.lifetimes import LifetimeColumns
from kvpipe.processors.core.lifetimes import REASON_CLEARED, LifetimeRow, hash_to_u64
from kvpipe.processors.analytics.stackdist import StackDistance
from kvpipe.schemas.envelope import Envelope
from kvpipe.schemas.events import BlockStored, Event

REASON_EPOCH_CHANGE = "epoch_change"
REASON_RESYNC = "resync"

CAPACITY_METHOD = (
    "Method: every BlockStored is an access to its (node, group, medium) slot; a re-store is a store of a hash whose "
    "previous lifetime in that slot ended. Its LRU stack distance d is the number of distinct other hashes stored in "
    "the slot since that hash's previous store (computed exactly by the analytics app as it consumes). An LRU "
    "cache of C blocks would have turned the re-store into a hit iff d < C; the curve counts, per "
    "cache size C = capacity + X, the re-stores with d < C. 'capacity' is the most blocks the slot held at any "
    "re-store, plus the re-stored block (the observed pool size). Assumptions and what is not modelled: recency "
    "is store recency (vLLM emits no event for a cache hit, so blocks reused while cached look older than they are: the curve is pessimistic for hot "
    "prefixes); vLLM's free-block queue is approximated by LRU (its eviction order also depends on request "
    "completion and refcounts); a bigger cache would change what the scheduler admits, not modelled; clears, epoch "
    "changes and node expiry end lifetimes regardless of size, so those re-stores are hits only in the model. "
    "Re-stores whose previous store lies more than the tracker's key bound back are not counted (a worker that "
    "restarts or takes a partition over rebuilds the tracker from the stored rows, so restarts lose none). "
    "Recompute saved = hits x block_size tokens.")


class RestoreRow(msgspec.Struct, gc=False):
    """One re-store. `(partition, offset, idx, block_hash)` of the storing event identify it."""

    node_id: str
    epoch: int
    group_idx: int
    group_kind: str  # "" when the node never sent its group specs
    medium: str
    block_hash: int  # u64
    block_size: int  # tokens per block (0: unknown)
    removed_ts: float
    restored_ts: float
    end_reason: str  # how the previous lifetime ended
    stack_distance: int  # distinct other hashes stored in the slot since this hash's previous store
    held_blocks: int  # blocks the slot held just before this store (the pool size when it is full)
    partition: int
    offset: int
    idx: int


RESTORE_COLUMNS = (
    "node_id", "epoch", "group_idx", "group_kind", "medium", "block_hash", "block_size", "removed_ts", "restored_ts",
    "delay_s", "end_reason", "stack_distance", "held_blocks", "kafka_partition", "kafka_offset", "event_idx",
)


def restore_columns(rows: list[RestoreRow]) -> list[list]:
    us = 1_000_000
    return [
        [r.node_id for r in rows], [r.epoch for r in rows], [r.group_idx for r in rows], [r.group_kind for r in rows],
        [r.medium for r in rows], [r.block_hash for r in rows], [r.block_size for r in rows],
        [round(r.removed_ts * us) for r in rows], [round(r.restored_ts * us) for r in rows],
        [r.restored_ts - r.removed_ts for r in rows], [r.end_reason for r in rows], [r.stack_distance for r in rows],
        [r.held_blocks for r in rows], [r.partition for r in rows], [r.offset for r in rows], [r.idx for r in rows],
    ]


def refine_reasons(env: Envelope | None, lifetimes: Iterable[LifetimeRow]) -> None:
    """Set `end_reason`: `reason`, except for the two kinds of `cleared` the index does not tell apart
    from AllBlocksCleared: a lifetime ended before the message's events (idx -1) by a newer epoch is
    `epoch_change`, by a resync after real loss upstream (same epoch) `resync`. (`reason` keeps the
    index's coarser value, which earlier rows and queries use.)"""
    for lt in lifetimes:
        lt.end_reason = lt.reason
        if env is not None and lt.reason == REASON_CLEARED and lt.idx == -1:
            lt.end_reason = REASON_EPOCH_CHANGE if lt.epoch != env.epoch else REASON_RESYNC


def refine_reason_columns(env: Envelope | None, cols: LifetimeColumns) -> None:
    """`refine_reasons` on columns (the same rule; a whole-column copy when no row needs it, which is
    every message that ends nothing by a clear)."""
    reason = cols.reason
    if env is None or REASON_CLEARED not in reason:
        cols.end_reason = reason[:]
        return
    epoch = env.epoch
    cols.end_reason = [(REASON_EPOCH_CHANGE if e != epoch else REASON_RESYNC) if i == -1 and r == REASON_CLEARED
                       else r for r, i, e in zip(reason, cols.idx, cols.epoch)]


def _end_reasons(cols: LifetimeColumns) -> list[str]:
    """Per row `end_reason or reason`, the reason `_end` records."""
    reasons = cols.end_reason
    if reasons is None:
        return cols.reason
    if "" in reasons:
        return [e or r for e, r in zip(reasons, cols.reason)]
    return reasons


class Slot:
    """One (node, group, medium): its store stack, the hashes whose last lifetime there ended, and how many
    blocks it holds. `partition`: the events partition of the node (whose owner keeps this state)."""

    __slots__ = ("stack", "ended", "held", "partition", "prune_at")

    def __init__(self, max_keys: int, partition: int = -1, stack: StackDistance | None = None) -> None:
        self.stack = stack if stack is not None else StackDistance(max_keys)
        self.ended: dict[int, tuple[float, str]] = {}  # hash → (removed_ts, reason) of its last lifetime
        self.held = 0
        self.partition = partition
        self.prune_at = 1024  # `ended` size that triggers dropping the hashes the stack forgot (see _end)

    def prune(self) -> None:
        last = self.stack._last  # noqa: SLF001
        ended = self.ended
        for h in [h for h in ended if h not in last]:
            del ended[h]
        # each prune removes half of `ended` or doubles the threshold: amortised O(1) per end
        self.prune_at = 2 * max(len(last), len(ended)) + 1024


SlotKey = tuple[str, int, str]  # (node, group, medium)


class RestoreTracker:
    """Per (node, group, medium): the store stack and the hashes whose lifetime ended.

    Memory: at most `max_keys_per_slot` hashes per slot in the stack (`StackDistance`'s bound), and `ended`
    pruned to hashes the stack still remembers (a forgotten hash's re-store has no distance to report).
    `loaded`: the events partitions whose state is complete here — rebuilt from the store when the worker took
    the partition over (`restore_state`), or built from the partition's first offset on.
    """

    def __init__(self, max_keys_per_slot: int = 1 << 20) -> None:
        self.max_keys = max_keys_per_slot
        self.slots: dict[SlotKey, Slot] = {}
        self.loaded: set[int] = set()
        self.restores = 0

    def _slot(self, key: SlotKey, partition: int) -> Slot:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = Slot(self.max_keys, partition)
        return slot

    def _end(self, lt: LifetimeRow) -> None:
        slot = self.slots.get((lt.node_id, lt.group_idx, lt.medium))
        if slot is None:  # never stored here (a removal the index did not know): nothing to come back to
            return
        if lt.block_hash in slot.stack._last:  # noqa: SLF001 - hot path: a dict probe, not a method call
            ended = slot.ended
            ended[lt.block_hash] = (lt.removed_ts, lt.end_reason or lt.reason)
            if len(ended) > slot.prune_at:  # the stack forgets past its bound; so does `ended`
                slot.prune()
        if slot.held:
            slot.held -= 1

    def observe(self, env: Envelope, events: list[Event], lifetimes: list[LifetimeRow] | LifetimeColumns,
                partition: int, offset: int,
                kinds: Mapping[int, tuple[str, int]]) -> list[RestoreRow]:
        """The re-stores of one applied message (`kinds`: group → (spec kind, block size)).

        `lifetimes` normally come in the order the index closed them, which is event order (`idx`
        non-decreasing; the -1 ones, closed before the events, first); other orders are sorted first.
        """
        if isinstance(lifetimes, LifetimeColumns):
            return self._observe_columns(env, events, lifetimes, partition, offset, kinds)
        out: list[RestoreRow] = []
        j, n_ends = 0, len(lifetimes)
        if n_ends > 1 and any(lifetimes[i].idx > lifetimes[i + 1].idx for i in range(n_ends - 1)):
            lifetimes = sorted(lifetimes, key=lambda lt: lt.idx)
        for idx, ev in enumerate(events):
            while j < n_ends and lifetimes[j].idx <= idx:
                self._end(lifetimes[j])
                j += 1
            if ev.__class__ is BlockStored:
                self._stored(env, ev, idx, partition, offset, kinds, out)
        while j < n_ends:
            self._end(lifetimes[j])
            j += 1
        self.restores += len(out)
        return out

    def _stored(self, env: Envelope, ev: BlockStored, idx: int, partition: int, offset: int,
                kinds: Mapping[int, tuple[str, int]], out: list[RestoreRow]) -> None:
        """One BlockStored: each hash an access to its slot's stack; a hash whose lifetime there ended is a re-store."""
        node = env.node_id
        group = ev.group_idx or 0
        medium = ev.medium or "GPU"
        slot = self.slots.get((node, group, medium))
        if slot is None:
            slot = self._slot((node, group, medium), partition)
        stack, ended = slot.stack, slot.ended
        last = stack._last  # noqa: SLF001 - see _end
        for h in ev.block_hashes:
            h = h & 0xFFFFFFFFFFFFFFFF if h.__class__ is int else hash_to_u64(h)
            fresh = h not in last
            d = stack.access(h)
            end = ended.pop(h, None) if ended else None
            if end is not None and d is not None:
                kind, size = kinds.get(group, ("", 0))
                out.append(RestoreRow(node, env.epoch, group, kind, medium, h, ev.block_size or size, end[0],
                                      env.ts, end[1], d, slot.held, partition, offset, idx))
            if fresh or end is not None:
                slot.held += 1

    def _observe_columns(self, env: Envelope, events: list[Event], cols: LifetimeColumns, partition: int, offset: int,
                         kinds: Mapping[int, tuple[str, int]]) -> list[RestoreRow]:
        """`observe` with the lifetimes as columns: the same walk in event order. Each end still takes
        a few dict operations on its slot's state, one row at a time (an end changes what the next store
        of the message sees), but reads the columns in place, without a row object or a call per end."""
        idxs = cols.idx
        if idxs != sorted(idxs):  # not in event order (see observe): stable, like sorting the rows
            cols = cols.take(sorted(range(len(idxs)), key=idxs.__getitem__))
            idxs = cols.idx
        reasons = _end_reasons(cols)
        out: list[RestoreRow] = []
        j, n_ends = 0, len(idxs)
        for idx, ev in enumerate(events):
            stop = j
            while stop < n_ends and idxs[stop] <= idx:  # the rows this event (or one before it) ended
                stop += 1
            if stop > j:
                self._end_columns(cols, reasons, j, stop)
                j = stop
            if ev.__class__ is BlockStored:
                self._stored(env, ev, idx, partition, offset, kinds, out)
        if j < n_ends:
            self._end_columns(cols, reasons, j, n_ends)
        self.restores += len(out)
        return out

    def _end_columns(self, cols: LifetimeColumns, reasons: list[str], start: int, stop: int) -> None:
        """`_end` for rows `start:stop` of the columns (`reasons`: `_end_reasons(cols)`)."""
        slots = self.slots
        nodes, groups, media = cols.node_id, cols.group_idx, cols.medium
        hashes, removed = cols.block_hash, cols.removed_ts
        key: SlotKey | None = None
        slot: Slot | None = None
        for i in range(start, stop):
            k = (nodes[i], groups[i], media[i])
            if k != key:  # ends outside a message come slot by slot (`Index._close_slots`)
                key, slot = k, slots.get(k)
            if slot is None:  # never stored here: nothing to come back to
                continue
            h = hashes[i]
            if h in slot.stack._last:  # noqa: SLF001 - see _end
                ended = slot.ended
                ended[h] = (removed[i], reasons[i])
                if len(ended) > slot.prune_at:
                    slot.prune()
            if slot.held:
                slot.held -= 1

    def end_all(self, lifetimes: list[LifetimeRow] | LifetimeColumns) -> None:
        """Lifetimes ended outside a message (a node expiry by the timer)."""
        if isinstance(lifetimes, LifetimeColumns):
            self._end_columns(lifetimes, _end_reasons(lifetimes), 0, len(lifetimes))
            return
        for lt in lifetimes:
            self._end(lt)

    def forget_node(self, node_id: str) -> None:
        for key in [k for k in self.slots if k[0] == node_id]:
            del self.slots[key]

    def forget_partition(self, partition: int) -> None:
        """Drop the state of one events partition's nodes (revoked, or about to be rebuilt)."""
        for key in [k for k, s in self.slots.items() if s.partition == partition]:
            del self.slots[key]
        self.loaded.discard(partition)

    def install(self, partition: int, slots: dict[SlotKey, Slot]) -> None:
        """Replace one partition's state with `slots` (rebuilt elsewhere, e.g. `restore_state`)."""
        self.forget_partition(partition)
        self.slots.update(slots)
        self.loaded.add(partition)

