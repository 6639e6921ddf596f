"""The live cache index: which node holds which block, per group and medium. Pure, no I/O.

This is the hot path (every block of every event passes through `Index.apply`), so it is written
for speed and measured (`kvpipe bench ingest`); the query side (the store's inverted view, read by
`kvpipe.processors.router.hma.held_positions` for the router) costs one lookup per requested hash.

Invariants:
- Per node, envelopes are applied in `(epoch, seq)` order: `seq <= last` is a duplicate (skipped,
  counted), `seq > last + 1` a gap (applied, but the node is *suspect* until a new epoch), a
  smaller epoch is stale (skipped, counted), a larger epoch clears the node first.
- A block key `(node, group, medium, hash)` is reference counted: vLLM does not de-duplicate
  identical blocks, so two `BlockStored` of one hash need two `BlockRemoved` before the node stops
  holding it (docs/vllm-behaviour.md §5.2). The first copy's store time is the lifetime's start.
- `AllBlocksCleared` clears the node's GPU entries only (vLLM's `reset_prefix_cache` covers the GPU
  pool; the offloading connector emits nothing for CPU, docs/vllm-behaviour.md §5.3).
- Liveness is judged on the node's own timestamps (`ts`/`sent_ts` of its envelopes), never the
  processor's clock at apply time, so replaying the log gives the same index as processing it live:
  a node whose next envelope comes more than `ttl_s` after its previous one is expired *before*
  that envelope is applied, exactly as the liveness timer would have expired it in between.
- Resync after real loss: an envelope with `lost_batches > 0` (upstream batches gone for good)
  clears the node's entries and makes it *partial* from that envelope on: everything learned
  since is exact, removals of hashes it does not hold are ignored (they were stored during the
  loss), so the index never holds a ghost and only under-reports. A partial node keeps routing,
  flagged with since-when; a new epoch (an empty cache) makes it exact again.
- Bounds (hostile or broken input cannot grow memory without limit): at most `max_nodes` node
  ids (a new id past it is refused, counted, after forgetting the longest-expired node if any),
  at most `max_slots_per_node` (group, medium) pairs per node and
  `max_blocks_per_slot` hashes per (node, group, medium) (the node is marked suspect with
  the reason, the excess stores are counted and not indexed), and an expired node is forgotten
  `retention_s` after its expiry (`expire`), its last state queryable until then.
- Every entry whose refcount reaches 0 yields one lifetime (a `LifetimeRow`, or a row of
  `LifetimeColumns` with `lifetimes="columns"`: the same values in the same order), with the Kafka coordinates of the
  message that ended it (`idx` = event index; -1 for a clear before the events, i.e. a new epoch,
  and for expiry, which is attributed to the node's last applied message).

Storage: the per-block state (each slot's blocks with store times and extra copies, and the
inverted per-group view the router reads) lives in a block store (`kvpipe.processors.core.slots`): the
native one by default, the dict reference otherwise, equal on every input
(tests/property/test_native_index.py). Blocks are keyed by their 64-bit form (`slots.key_of`).
This module keeps the rules around them: per-node order, epochs, liveness, loss, caps, lifetimes.
"""
from __future__ import annotations

import itertools
from functools import partial
from typing import Any, Callable, Iterable, Literal

from kvpipe.gpu.layout import layout_problem
from kvpipe.processors.core.lifetimes import LifetimeColumns
from kvpipe.processors.core.lifetimes import REASON_CLEARED, REASON_EVICTED, REASON_NODE_EXPIRED, LifetimeRow
from kvpipe.processors.core import native
from kvpipe.processors.core.slots import NativeStore, Slot, StoreKind, batch_event, make_store
from kvpipe.schemas.envelope import Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import MEDIUM_GPU as GPU
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

APPLIED = "applied"
DUPLICATE = "duplicate"
STALE = "stale"
REFUSED = "refused"  # a new node id while `max_nodes` are tracked

_node_keys = itertools.count()

LifetimesMode = Literal["rows", "columns", "count"]
# What `apply` and `expire` return as the lifetimes they ended: a list of `LifetimeRow`s (the reference),
# a `LifetimeColumns` (the analytics app: extended per store answer, no object per lifetime), or an
# empty list with `ended` counting them (the routing app). True and False stand for "rows" and "count".
Closed = list[LifetimeRow] | LifetimeColumns
_MODES: dict[object, LifetimesMode] = {True: "rows", False: "count", "rows": "rows", "columns": "columns",
                                       "count": "count"}


class NodeState:
    """What the index knows about one serving node (one incarnation = one epoch at a time)."""

    __slots__ = ("node_id", "epoch", "seq", "last_seen", "suspect", "reason", "expired", "group_specs",
                 "hash_config", "model", "dp_rank", "partition", "last_offset", "slots", "counters",
                 "partial_since", "skew_s", "expired_at", "load", "key")

    def __init__(self, node_id: str, epoch: int, partition: int) -> None:
        self.node_id = node_id
        # a small int naming this node state in the native store's slot records (`slots`), unique in
        # the process (wraps past 2^32 node states, which no process lives to see)
        self.key = next(_node_keys) & 0xFFFF_FFFF
        self.epoch = epoch
        self.seq = -1  # last applied seq in this epoch
        self.last_seen = 0.0  # the node's own clock: max(ts, sent_ts) of its last applied envelope
        self.suspect = False
        self.reason = ""
        self.expired = False
        self.group_specs: list[GroupSpec] | None = None
        self.hash_config: HashConfig | None = None
        self.model: str | None = None
        self.dp_rank: int | None = None
        self.partition = partition
        self.last_offset = -1
        self.slots: dict[tuple[int, str], Slot] = {}
        self.counters: dict[str, int] = dict.fromkeys(NODE_COUNTERS, 0)
        # (epoch, seq, ts) of the envelope that resynced the node after a real loss; None = exact
        self.partial_since: tuple[int, int, float] | None = None
        self.skew_s = 0.0  # largest amount its timestamps ran ahead of the trusted clock (clamped)
        self.expired_at = 0.0  # the node's clock at expiry (last_seen + ttl); retention counts from it
        # (running, waiting, kv_usage) of its latest envelope that reported load (router score); None: never
        self.load: tuple[int | None, int | None, float | None] | None = None

    @property
    def partial(self) -> bool:
        return self.partial_since is not None

    def mark_suspect(self, reason: str) -> None:
        # Keep the first reason: it is the one that explains the state; later ones are consequences.
        if not self.suspect:
            self.suspect, self.reason = True, reason

    def groups(self) -> list[int]:
        if self.group_specs:
            return sorted(g.group_idx for g in self.group_specs)
        return sorted({g for g, _ in self.slots})


NODE_COUNTERS = ("envelopes", "heartbeats", "events", "stored", "removed", "duplicates", "stale", "gaps",
                 "unknown_removes", "dropped_events", "lost_batches", "clears", "resyncs", "partial_unknown_removes",
                 "capped_stores", "clock_clamped")
INDEX_COUNTERS = NODE_COUNTERS + ("expired_nodes", "new_epochs", "forgotten_nodes", "refused_envelopes")

class Index:
    """All nodes of the partitions this processor owns, plus the inverted per-group view."""

    def __init__(self, ttl_s: float | None = None, *, retention_s: float | None = None, max_nodes: int | None = None,
                 max_blocks_per_slot: int | None = None, max_slots_per_node: int | None = None,
                 store: StoreKind | None = None, lifetimes: bool | LifetimesMode = True) -> None:
        self.ttl_s = ttl_s
        self.retention_s = retention_s
        self.max_nodes = max_nodes
        self.max_blocks_per_slot = max_blocks_per_slot
        self.max_slots_per_node = max_slots_per_node
        # expired nodes in expiry order (re-expiry moves a node to the end); entries of nodes that
        # came back or were dropped are skipped lazily, so making room is O(1) amortized, not a scan
        self._expired_order: dict[str, NodeState] = {}
        self.nodes: dict[str, NodeState] = {}
        self.store = make_store(store)  # the blocks and the inverted view (`kvpipe.processors.core.slots`)
        # how ended entries come back (`LifetimesMode`); the routing app only counts them (`ended`),
        # which spares an object per evicted block
        mode = _MODES.get(lifetimes)
        if mode is None:
            raise ValueError(f"Index(lifetimes=...) must be 'rows', 'columns', 'count' or a bool, got {lifetimes!r}")
        self.lifetimes_mode: LifetimesMode = mode
        self.lifetimes = mode != "count"  # whether ended entries are reported at all
        self._columns = mode == "columns"
        self.ended = 0  # entries whose last copy went (evicted, cleared, expired), rows or not
        # bumped whenever a node comes, goes, expires, returns, or changes epoch, specs, hash
        # configuration or model: what the router's per-index plan depends on (`router.plan`).
        # Code that edits `nodes` directly (a snapshot restore) bumps it too.
        self.generation = 0
        # Told the new generation whenever it moves (the native route path stops answering until its plan is
        # re-exported: processors/router/native.py).
        self.on_move: Callable[[int], None] | None = None
        # The router's plan of this index (`kvpipe.processors.router.plan`), kept with it and checked against
        # `generation` there; opaque here.
        self.route_plan: object = None
        self.counters: dict[str, int] = dict.fromkeys(INDEX_COUNTERS, 0)

    # -- ingest ------------------------------------------------------------------------------------

    def apply(self, env: Envelope, events: list[Event] | Any, partition: int = 0,
              offset: int = -1) -> tuple[str, Closed]:
        """Apply one envelope; returns `(APPLIED | DUPLICATE | STALE, closed lifetimes)` (rows or columns, as
        `lifetimes` chose). `events`: the decoded events, or the batch the native side read
        (`slots.parse_batch`; native store only)."""
        closed: Closed = LifetimeColumns() if self._columns else []
        counters = self.counters
        node = self.nodes.get(env.node_id)
        seen = env.sent_ts if env.sent_ts > env.ts else env.ts
        if node is None:
            if self.max_nodes is not None and len(self.nodes) >= self.max_nodes and not self._forget_oldest_expired():
                counters["refused_envelopes"] += 1
                return REFUSED, closed
            node = self.nodes[env.node_id] = NodeState(env.node_id, env.epoch, partition)
            self._move()
            if env.seq != 0:
                node.mark_suspect(f"first envelope seen is epoch {env.epoch} seq {env.seq}: seqs 0..{env.seq - 1} were never seen")
        else:
            if env.epoch < node.epoch:
                node.counters["stale"] += 1
                counters["stale"] += 1
                return STALE, closed
            if env.epoch == node.epoch and env.seq <= node.seq:
                node.counters["duplicates"] += 1
                counters["duplicates"] += 1
                return DUPLICATE, closed
            if not node.expired and self.ttl_s is not None and seen - node.last_seen > self.ttl_s:
                self._expire_node(node, closed)
            if env.epoch > node.epoch:
                self._close_slots(node, node.slots.values(), REASON_CLEARED, env.ts, offset, -1, closed)
                node.epoch, node.seq = env.epoch, -1
                node.suspect, node.reason, node.expired = False, "", False
                self._move()
                node.partial_since = None
                counters["new_epochs"] += 1
            elif node.expired:
                node.mark_suspect(f"silent for more than {self.ttl_s} s in epoch {env.epoch}; its entries were dropped at expiry")
            if env.seq > node.seq + 1:
                node.counters["gaps"] += 1
                counters["gaps"] += 1
                node.mark_suspect(f"gap in epoch {env.epoch}: expected seq {node.seq + 1}, got {env.seq} "
                                  f"({env.seq - node.seq - 1} envelopes missing)")
        if node.expired:
            node.expired = False
            self._move()
        node.seq = env.seq
        node.partition = partition
        node.last_offset = offset
        if seen > node.last_seen:
            node.last_seen = seen
        if env.group_specs is not None or env.hash_config is not None:
            if env.group_specs is not None:
                if env.group_specs != node.group_specs:
                    self._move()
                node.group_specs = env.group_specs
            if env.hash_config is not None:
                if env.hash_config != node.hash_config:
                    self._move()
                node.hash_config = env.hash_config
            # a layout vLLM itself refuses: its hits cannot be computed, say why on the node
            problem = layout_problem(node.group_specs, node.hash_config) if node.group_specs else None
            if problem is not None:
                node.mark_suspect(f"layout vLLM refuses: {problem}")
        if env.model is not None:
            if env.model != node.model:
                self._move()
            node.model = env.model
        if env.dp_rank is not None:
            node.dp_rank = env.dp_rank
        if env.running is not None or env.waiting is not None or env.kv_usage is not None:
            node.load = (env.running, env.waiting, env.kv_usage)
        if env.spec_mismatches:
            # a gauge, not a sum: the bridge reports its latest count; kept in counters so /nodes and
            # snapshots carry it without a schema of their own
            node.counters["spec_mismatches"] = env.spec_mismatches
        if env.dropped:
            node.counters["dropped_events"] += env.dropped
            counters["dropped_events"] += env.dropped
            node.mark_suspect(f"producer dropped {env.dropped} events before epoch {env.epoch} seq {env.seq}")
        if env.lost_batches:
            node.counters["lost_batches"] += env.lost_batches
            counters["lost_batches"] += env.lost_batches
            self._resync(node, env, offset, closed)
        node.counters["envelopes"] += 1
        counters["envelopes"] += 1
        if not events:
            node.counters["heartbeats"] += 1
            counters["heartbeats"] += 1
            return APPLIED, closed
        self._apply_events(node, events, env.ts, partition, offset, closed)
        return APPLIED, closed

    def _apply_events(self, node: NodeState, events: list[Event] | native.Batch, ts: float, partition: int,
                      offset: int, closed: Closed) -> None:
        stored = removed = unknown = 0
        # The native store applies runs of stores and removes into existing slots in one call (from
        # event objects, or from a batch it read itself: `slots.parse_batch`); the event it stops at
        # (a clear, a new slot, anything unusual) takes the per-event path below.
        on_native = self.store.kind == "native"
        run = self._apply_run if on_native else None
        at: Callable[[int], Event]
        if isinstance(events, list):
            at = events.__getitem__
        else:  # a native batch: only the native store reads it
            if not on_native:
                raise TypeError("a native event batch needs the native store")
            at = partial(batch_event, events)
        i, n = 0, len(events)
        while i < n:
            if run is not None:
                i, st, rm, unk = run(node, events, i, ts, partition, offset, closed)
                stored, removed, unknown = stored + st, removed + rm, unknown + unk
                if i >= n:
                    break
            st, rm, unk = self._apply_one(node, at(i), i, ts, partition, offset, closed)
            stored, removed, unknown = stored + st, removed + rm, unknown + unk
            i += 1
        self.count_events(node, len(events), stored, removed, unknown)

    def count_events(self, node: NodeState, events: int, stored: int, removed: int, unknown: int) -> None:
        """Add applied events to the index's and the node's counters (also for runs applied
        natively, `processors/core/ingestrun.py`)."""
        c, nc = self.counters, node.counters
        c["events"] += events
        nc["events"] += events
        c["stored"] += stored
        nc["stored"] += stored
        c["removed"] += removed
        nc["removed"] += removed
        # A partial node's unknown removes are expected (stored during the loss): not a health signal.
        key = "partial_unknown_removes" if node.partial_since is not None else "unknown_removes"
        c[key] += unknown
        nc[key] += unknown

    def _apply_one(self, node: NodeState, ev: Event, idx: int, ts: float, partition: int, offset: int,
                   closed: Closed) -> tuple[int, int, int]:
        """One event; returns (stored, removed, unknown)."""
        slots = node.slots
        if isinstance(ev, AllBlocksCleared):
            self._close_slots(node, [s for s in slots.values() if s.medium == GPU], REASON_CLEARED, ts, offset, idx, closed)
            node.counters["clears"] += 1
            self.counters["clears"] += 1
            return 0, 0, 0
        group = ev.group_idx or 0
        medium = ev.medium or GPU
        slot = slots.get((group, medium))
        if slot is None:
            if self.max_slots_per_node is not None and len(slots) >= self.max_slots_per_node:
                self._refuse_slot(node, group, medium, ev)
                return 0, 0, 0
            slot = slots[(group, medium)] = self.store.new_slot(node, group, medium)
        if ev.__class__ is BlockStored:
            kept, refused = self.store.store(slot, ev.block_hashes, ts, self.max_blocks_per_slot)
            if refused:
                self._capped(node, slot, refused, self.max_blocks_per_slot)
            return kept, 0, 0
        n, missing, keys, times = self.store.remove(slot, ev.block_hashes)  # BlockRemoved
        self.ended += len(keys)
        if isinstance(closed, LifetimeColumns):  # `lifetimes="columns"`
            closed.add(node.node_id, node.epoch, group, medium, keys, times, ts, REASON_EVICTED, partition, offset, idx)
        elif self.lifetimes:
            node_id, epoch = node.node_id, node.epoch
            closed.extend([LifetimeRow(node_id, epoch, group, medium, k, stored_ts, ts, REASON_EVICTED, partition,
                                       offset, idx) for k, stored_ts in zip(keys, times)])
        return 0, n, missing

    def _apply_run(self, node: NodeState, events: list[Event] | native.Batch, start: int, ts: float, partition: int,
                   offset: int, closed: Closed) -> tuple[int, int, int, int]:
        """Events from `start` (event objects, or a batch the native side read from bytes) applied by the native
        store until one it leaves to `_apply_one`; returns (where it stopped, stored, removed, unknown)."""
        store = self.store
        assert isinstance(store, NativeStore)  # chosen by `_apply_events` on the native store only
        cap = self.max_blocks_per_slot
        if isinstance(events, list):
            answer = store.core.apply_events(events, start, node.slots, ts, cap, BlockStored, BlockRemoved)
        else:
            answer = store.core.apply_batch(events, start, node.slots, ts, cap)
        return self._ran(store, node, answer, ts, partition, offset, closed)

    def _ran(self, store: NativeStore, node: NodeState, answer: native.Applied, ts: float, partition: int,
             offset: int, closed: Closed) -> tuple[int, int, int, int]:
        """Counters, cap notes and lifetimes of one native run."""
        stop, stored, removed, unknown, refused, keys, times, idxs, sids = answer
        by_sid = store.slot_by_id
        for sid, n in refused:
            self._capped(node, by_sid(sid), n, self.max_blocks_per_slot)
        self.ended += len(keys)
        if not keys:
            return stop, stored, removed, unknown
        if isinstance(closed, LifetimeColumns):
            # per row its slot's group and medium: one lookup per distinct slot, then a C-level map
            n = len(sids)
            if sids.count(sids[0]) == n:
                slot = by_sid(sids[0])
                groups, media = [slot.group] * n, [slot.medium] * n
            else:
                slots = {sid: by_sid(sid) for sid in set(sids)}
                groups = list(map({sid: s.group for sid, s in slots.items()}.__getitem__, sids))
                media = list(map({sid: s.medium for sid, s in slots.items()}.__getitem__, sids))
            closed.add_run(node.node_id, node.epoch, groups, media, keys, times, ts, REASON_EVICTED, partition, offset,
                           idxs)
        elif self.lifetimes:
            node_id, epoch = node.node_id, node.epoch
            last, group, medium = -1, 0, GPU  # the slot of the previous row (slot ids are never negative)
            for k, stored_ts, idx, sid in zip(keys, times, idxs, sids):
                if sid != last:
                    slot = by_sid(sid)
                    last, group, medium = sid, slot.group, slot.medium
                closed.append(LifetimeRow(node_id, epoch, group, medium, k, stored_ts, ts, REASON_EVICTED,
                                          partition, offset, idx))
        return stop, stored, removed, unknown

    def _capped(self, node: NodeState, slot: Slot, refused: int, cap: int | None) -> None:
        """Stores past the per-slot cap were not indexed: counted, and the node says why."""
        node.counters["capped_stores"] += refused
        self.counters["capped_stores"] += refused
        node.mark_suspect(f"group {slot.group} {slot.medium}: over the cap of {cap} blocks per group and medium; "
                          f"{node.counters['capped_stores']} stores not indexed")

    def _refuse_slot(self, node: NodeState, group: int, medium: str, ev: Event) -> None:
        """A (group, medium) past the per-node cap: its stores are not indexed (removes of it hold nothing)."""
        if ev.__class__ is BlockStored:
            node.counters["capped_stores"] += len(ev.block_hashes)
            self.counters["capped_stores"] += len(ev.block_hashes)
        node.mark_suspect(f"over the cap of {self.max_slots_per_node} (group, medium) pairs per node "
                          f"(group {group} medium {medium[:64]!r} refused)")

    def _resync(self, node: NodeState, env: Envelope, offset: int, closed: Closed) -> None:
        """Real loss upstream: drop what the node held and learn it again from this envelope on."""
        self._close_slots(node, node.slots.values(), REASON_CLEARED, env.ts, offset, -1, closed)
        node.suspect, node.reason = False, ""
        node.partial_since = (env.epoch, env.seq, env.ts)
        node.counters["resyncs"] += 1
        self.counters["resyncs"] += 1

    def note_expired(self, node: NodeState) -> None:
        self._expired_order.pop(node.node_id, None)
        self._expired_order[node.node_id] = node

    def _forget_oldest_expired(self) -> bool:
        """Make room for a new node id by forgetting the node expired longest ago, if any."""
        order = self._expired_order
        while order:
            node_id = next(iter(order))
            node = order.pop(node_id)
            if node.expired and self.nodes.get(node_id) is node:
                self._forget(node)
                return True
        return False

    def _forget(self, node: NodeState) -> None:
        for slot in node.slots.values():  # none after expiry; kept for safety
            self.store.close(slot)
        del self.nodes[node.node_id]
        self._move()
        self._expired_order.pop(node.node_id, None)
        self.counters["forgotten_nodes"] += 1

    def _close_slots(self, node: NodeState, slots: Iterable[Slot], reason: str, ts: float, offset: int, idx: int,
                     closed: Closed) -> None:
        """Drop every entry of these slots (all copies), one lifetime per key."""
        for slot in list(slots):
            keys, times = self.store.close(slot)
            self.ended += len(keys)
            if isinstance(closed, LifetimeColumns):
                closed.add(node.node_id, node.epoch, slot.group, slot.medium, keys, times, ts, reason, node.partition,
                           offset, idx)
            elif self.lifetimes:
                node_id, epoch, group, medium, partition = node.node_id, node.epoch, slot.group, slot.medium, node.partition
                closed.extend([LifetimeRow(node_id, epoch, group, medium, k, stored_ts, ts, reason, partition, offset,
                                           idx) for k, stored_ts in zip(keys, times)])
            del node.slots[(slot.group, slot.medium)]

    def _expire_node(self, node: NodeState, closed: Closed) -> None:
        # Attributed to the node's last applied message, so the live timer and a replay agree.
        expired_at = node.last_seen + (self.ttl_s or 0.0)
        self._close_slots(node, node.slots.values(), REASON_NODE_EXPIRED, expired_at, node.last_offset, -1, closed)
        node.expired = True
        self._move()
        node.expired_at = expired_at
        self.note_expired(node)
        self.counters["expired_nodes"] += 1

    def expire(self, now: float, ttl: float | None = None, partition: int | None = None) -> Closed:
        """Expire nodes silent since before `now - ttl` (only those of `partition`, if given)."""
        ttl = self.ttl_s if ttl is None else ttl
        closed: Closed = LifetimeColumns() if self._columns else []
        if ttl is None:
            return closed
        retention = self.retention_s
        gone = []
        for node in self.nodes.values():
            if partition is not None and node.partition != partition:
                continue
            if not node.expired and now - node.last_seen > ttl:
                self._expire_node(node, closed)
            elif node.expired and retention is not None and now - node.expired_at > retention:
                gone.append(node)
        for node in gone:
            self._forget(node)
        return closed

    def drop_partition(self, partition: int) -> int:
        """Forget the nodes of a partition (revoked, or about to be restored): no lifetimes, since
        the blocks did not leave the node; another owner (or the restore) takes over."""
        gone = [n for n in self.nodes.values() if n.partition == partition]
        for node in gone:
            for slot in node.slots.values():
                self.store.close(slot)
            del self.nodes[node.node_id]
        self._move()
        return len(gone)

    def slot(self, node: NodeState, group: int, medium: str) -> Slot:
        """The node's slot for (group, medium), made if new (snapshot restore; no cap applies)."""
        slot = node.slots.get((group, medium))
        if slot is None:
            slot = node.slots[(group, medium)] = self.store.new_slot(node, group, medium)
        return slot

    def add_slot_entries(self, slot: Slot, blocks: dict, dups: dict) -> None:
        """Load entries into a slot (snapshot restore), keeping the inverted view in step."""
        self.store.load(slot, blocks, dups)

    # -- queries -----------------------------------------------------------------------------------

    def _move(self) -> None:
        self.generation += 1
        if self.on_move is not None:
            self.on_move(self.generation)

    def sizes(self) -> dict[str, dict[str, int]]:
        """`{group: {medium: live keys}}` (expired nodes hold none)."""
        out: dict[str, dict[str, int]] = {}
        for node in self.nodes.values():
            for (group, medium), slot in node.slots.items():
                per = out.setdefault(str(group), {})
                per[medium] = per.get(medium, 0) + len(slot.blocks)
        return out


def partial_fields(node: NodeState) -> dict:
    """How a /nodes row flags a node resynced after a real loss."""
    since = node.partial_since
    return {"partial": since is not None,
            "partial_since": None if since is None else {"epoch": since[0], "seq": since[1], "ts": since[2]}}

