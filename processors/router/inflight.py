"""In-flight accounting: requests the router has sent but whose KV events have not arrived yet.

Between "request R goes to node N" and N's `BlockStored` events reaching the index there is a
window (the prefill, then the Kafka hop) in which a burst of requests with R's prefix would all
see no hit anywhere and scatter across nodes. So on "sent" the router records *speculative*
holdings — R's block hashes per group on N — and counts R in N's load:

- the entries live `ttl_s` (they are a guess: the request may fail or be evicted before caching);
- a real event for `(group, hash)` on N (stored or removed) replaces the guess with the truth:
  the entry is dropped and the index answers for that block from then on; a new epoch or
  `AllBlocksCleared` on N drops all of N's entries;
- R counts in N's load until "R finished" or the TTL, whichever first. Finishing does not drop
  the entries: the blocks R computed are cached now, only their events are still on the way.

Bounded memory: at most `max_requests` records and `max_entries` speculative (group, hash)
entries; the oldest records go first. One TTL for all records means insertion order is expiry
order, so a sweep pops expired records from the front and costs only what it removes.

Pure: the caller passes `now` (seconds, any monotone clock).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, ExternalHash


@dataclass(slots=True)
class _Record:
    node_id: str
    expires: float
    keys: list[tuple[int, ExternalHash]]
    finished: bool = False


@dataclass(slots=True)
class _NodeSpec:
    """One node's speculative holdings: group → hash → number of records holding it."""

    groups: dict[int, dict[ExternalHash, int]] = field(default_factory=dict)
    running: int = 0  # unfinished, unexpired records
    records: int = 0  # all live records (the node's state goes when the last one does)


class InFlight:
    def __init__(self, ttl_s: float = 30.0, max_requests: int = 100_000, max_entries: int = 2_000_000) -> None:
        if ttl_s <= 0 or max_requests < 1 or max_entries < 1:
            raise ValueError("InFlight needs ttl_s > 0, max_requests >= 1 and max_entries >= 1")
        self.ttl_s = ttl_s
        self.max_requests = max_requests
        self.max_entries = max_entries
        self._records: OrderedDict[str, _Record] = OrderedDict()
        self._nodes: dict[str, _NodeSpec] = {}
        self.entries = 0  # live speculative (node, group, hash) entries
        self.counters = {"sent": 0, "finished": 0, "expired": 0, "evicted": 0, "confirmed": 0}

    # -- reports -------------------------------------------------------------------------------------

    def sent(self, request_id: str, node_id: str, hashes_by_group: Mapping[int, Sequence[ExternalHash]],
             now: float) -> None:
        """R was sent to N: R's blocks are speculatively on N's GPU until confirmed or `now + ttl`."""
        self.sweep(now)
        if request_id in self._records:  # a retry or re-route: the latest report wins
            self._drop(request_id)
        keys = [(g, h) for g, hashes in hashes_by_group.items() for h in hashes]
        node = self._nodes.get(node_id)
        if node is None:
            node = self._nodes[node_id] = _NodeSpec()
        for g, h in keys:
            per = node.groups.get(g)
            if per is None:
                per = node.groups[g] = {}
            n = per.get(h, 0)
            per[h] = n + 1
            if n == 0:
                self.entries += 1
        node.running += 1
        node.records += 1
        self._records[request_id] = _Record(node_id, now + self.ttl_s, keys)
        self.counters["sent"] += 1
        while len(self._records) > self.max_requests or (self.entries > self.max_entries and len(self._records) > 1):
            self._drop(next(iter(self._records)))
            self.counters["evicted"] += 1

    def finished(self, request_id: str) -> bool:
        """R finished: it leaves N's load (its entries stay until confirmed or expired)."""
        rec = self._records.get(request_id)
        if rec is None or rec.finished:
            return False
        rec.finished = True
        self._nodes[rec.node_id].running -= 1
        self.counters["finished"] += 1
        return True

    def on_events(self, node_id: str, events: Iterable[Event], new_epoch: bool = False) -> None:
        """Real events from N (as applied to the index) replace N's guesses for their blocks."""
        node = self._nodes.get(node_id)
        if node is None:
            return
        if new_epoch:
            self._clear_node(node)
        for ev in events:
            cls = ev.__class__
            if cls is AllBlocksCleared:
                self._clear_node(node)
            elif isinstance(ev, (BlockStored, BlockRemoved)):
                per = node.groups.get(ev.group_idx or 0)
                if per:
                    for h in ev.block_hashes:
                        if per.pop(h, None) is not None:
                            self.entries -= 1
                            self.counters["confirmed"] += 1

    def sweep(self, now: float) -> int:
        """Drop records whose TTL ended; returns how many."""
        n = 0
        records = self._records
        while records:
            rid, rec = next(iter(records.items()))
            if rec.expires > now:
                break
            self._drop(rid)
            n += 1
        self.counters["expired"] += n
        return n

    # -- queries -------------------------------------------------------------------------------------

    def running(self, node_id: str) -> int:
        """Requests sent to N, not finished, not expired (as of the last sweep)."""
        node = self._nodes.get(node_id)
        return node.running if node else 0

    def tracking(self) -> bool:
        """Whether anything is recorded for any node (a route skips per-node checks when not)."""
        return bool(self._nodes)

    def tracks(self, node_id: str) -> bool:
        """Whether anything (a running request, a speculative block) is recorded for N."""
        return node_id in self._nodes

    def nodes(self) -> list[str]:
        return [n for n, s in self._nodes.items() if s.running or any(s.groups.values())]

    def positions(self, node_id: str, lists: Mapping[int, Sequence[ExternalHash]]) -> dict[int, set[int]]:
        """The overlay for a hit search: per group, positions in `lists[group]` that N holds only
        speculatively (the caller unions them with the index's positions and marks them)."""
        node = self._nodes.get(node_id)
        if node is None:
            return {}
        out: dict[int, set[int]] = {}
        for g, hashes in lists.items():
            per = node.groups.get(g)
            if per:
                got = {i for i, h in enumerate(hashes) if h in per}
                if got:
                    out[g] = got
        return out

    # -- internals -----------------------------------------------------------------------------------

    def _drop(self, request_id: str) -> None:
        rec = self._records.pop(request_id)
        node = self._nodes.get(rec.node_id)
        if node is None:
            return
        if not rec.finished:
            node.running -= 1
        node.records -= 1
        for g, h in rec.keys:
            per = node.groups.get(g)
            if per is None:
                continue
            n = per.get(h)
            if n is None:  # confirmed by a real event (or cleared) meanwhile
                continue
            # (if the entry was confirmed and then re-added by a later request, this ends that
            # request's guess early: conservative — a guess is dropped, never kept too long)
            if n > 1:
                per[h] = n - 1
            else:
                del per[h]
                self.entries -= 1
        if node.records == 0:
            del self._nodes[rec.node_id]

    def _clear_node(self, node: _NodeSpec) -> None:
        for per in node.groups.values():
            self.entries -= len(per)
            per.clear()
