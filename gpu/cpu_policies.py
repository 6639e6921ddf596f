"""Replacement policies of the CPU tier (vLLM 0.33 semantics): request-ranked LRU and ARC.

A policy owns the chunk index (key -> Chunk) and decides what to evict; the tier (`kvpipe.gpu.cpu_tier`)
owns reference counts, the chunk pool and events, and tells the policy when a chunk becomes
evictable (ref_cnt reaches 0) or stops being so.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

OffloadKey = bytes  # block hash bytes followed by the group index as u32 big-endian (kvpipe.gpu.cpu_tier)

_T = TypeVar("_T")


@dataclass(slots=True)
class ReqContext:
    """What the tier knows about the request calling it: its id, the end-token position of each of
    its offload keys (recorded by the scheduler so prefix order survives out-of-order stores) and
    per-owner scratch state (the tier and the policy keep their per-request records here)."""

    req_id: str
    positions: dict[OffloadKey, int] = field(default_factory=dict)
    _state: dict[Any, Any] = field(default_factory=dict, repr=False)

    def set_position(self, key: OffloadKey, end_token: int) -> None:
        self.positions[key] = end_token

    def position(self, key: OffloadKey) -> int | None:
        return self.positions.get(key)

    def state(self, owner: object, factory: type[_T]) -> _T:
        """This owner's record for the request, created on first use."""
        slot = (id(owner), factory)
        rec = self._state.get(slot)
        if rec is None:
            rec = self._state[slot] = factory()
        return rec

    def drop_state(self, owner: object, factory: type) -> None:
        self._state.pop((id(owner), factory), None)


class Chunk:
    """One host chunk slot. `ref_cnt`: -1 write pending, 0 ready and evictable, >0 pinned by
    that many loads. `__slots__` because the tier holds one per cached chunk."""

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = -1

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


def prefix_order(key_groups: Sequence[Sequence[OffloadKey]], ctx: ReqContext) -> list[OffloadKey]:
    """All groups' keys head to tail by recorded end position (kept as given if any is unknown)."""
    keys = [k for group in key_groups for k in group]
    if all(k in ctx.positions for k in keys):
        keys.sort(key=ctx.positions.__getitem__)
    return keys


class CachePolicy:
    """Interface; see LRUPolicy and ARCPolicy."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    def get(self, key: OffloadKey) -> Chunk | None: raise NotImplementedError
    def insert(self, key: OffloadKey, chunk: Chunk, ctx: ReqContext) -> None: raise NotImplementedError
    def remove(self, key: OffloadKey) -> None: raise NotImplementedError
    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> None: raise NotImplementedError
    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        raise NotImplementedError
    def clear(self) -> None: raise NotImplementedError

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        return None

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        return None

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], inserted_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: ReqContext) -> None:
        for keys in key_groups:
            self.touch(keys, ctx)

    def mark_evictable(self, key: OffloadKey) -> None:
        return None

    def mark_non_evictable(self, key: OffloadKey) -> None:
        return None


@dataclass(slots=True)
class _Rank:
    value: int = 0


class LRUPolicy(CachePolicy):
    """LRU whose recency is a rank, not a list position, so it can change while a chunk is pinned.

    Rank = `(request_rank, -end_position)`: a request gets one rank at its first access and its
    chunks are ordered tail before head, so under pressure a request's tail goes first and its
    prefix (what other requests share) survives longest. A finished request re-ranks its keys
    tail to head with fresh global ranks (head most recent); `touch` does the same for the keys
    it is given. Lookups never change recency.

    Evictable chunks sit in a lazy min-heap: re-ranking pushes a new entry and stale ones are
    skipped when popped, which beats re-sorting a list on every access. Eviction is atomic: either
    `n` chunks outside `protected` are found or nothing changes.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.chunks: dict[OffloadKey, Chunk] = {}
        self._rank: dict[OffloadKey, tuple[int, int]] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[tuple[tuple[int, int], OffloadKey]] = []
        # The clock only moves forward; `_floor` is its value at the last clear(), so request
        # ranks handed out earlier are recognisably stale.
        self._clock = 0
        self._floor = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _request_rank(self, ctx: ReqContext) -> int:
        rec = ctx.state(self, _Rank)
        if rec.value <= self._floor:  # first access, or a rank from before the last clear()
            rec.value = self._tick()
        return rec.value

    def _push(self, key: OffloadKey) -> None:
        heapq.heappush(self._heap, (self._rank[key], key))
        if len(self._heap) > max(64, 2 * len(self._evictable)):
            self._heap = [(self._rank[k], k) for k in self._evictable]
            heapq.heapify(self._heap)

    def _rerank_fresh(self, keys_most_recent_last: Iterable[OffloadKey]) -> None:
        for key in keys_most_recent_last:
            if key in self.chunks:
                self._rank[key] = (self._tick(), 0)
                if key in self._evictable:
                    self._push(key)

    def get(self, key: OffloadKey) -> Chunk | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: Chunk, ctx: ReqContext) -> None:
        self.chunks[key] = chunk
        pos = ctx.position(key)
        self._rank[key] = (self._tick(), 0) if pos is None else (self._request_rank(ctx), -pos)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            self._push(key)

    def remove(self, key: OffloadKey) -> None:
        del self.chunks[key]
        self._rank.pop(key, None)
        self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> None:
        self._rerank_fresh(reversed(list(keys)))  # the first key given ends up most recent

    def on_request_access(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        req_rank = self._request_rank(ctx)
        for key in keys:
            pos = ctx.position(key)
            if pos is None or key not in self.chunks:
                continue
            rank = (req_rank, -pos)
            if self._rank[key] < rank:  # only ever moves a chunk towards "more recent"
                self._rank[key] = rank
                if key in self._evictable:
                    self._push(key)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], inserted_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: ReqContext) -> None:
        self._rerank_fresh(reversed(prefix_order(key_groups, ctx)))

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        if n == 0:
            return []
        chosen: list[tuple[tuple[int, int], OffloadKey]] = []
        chosen_keys: set[OffloadKey] = set()
        skipped: list[tuple[tuple[int, int], OffloadKey]] = []
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            if key not in self._evictable or self._rank.get(key) != rank or key in chosen_keys:
                continue  # stale entry (re-ranked, pinned or gone) or a duplicate of a chosen one
            if key in protected:
                skipped.append(entry)
                continue
            chosen.append(entry)
            chosen_keys.add(key)
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        if len(chosen) < n:  # atomic: put the candidates back untouched
            for entry in chosen:
                heapq.heappush(self._heap, entry)
            return None
        out = []
        for _, key in chosen:
            self._evictable.remove(key)
            del self._rank[key]
            out.append((key, self.chunks.pop(key)))
        return out

    def mark_evictable(self, key: OffloadKey) -> None:
        self._evictable.add(key)
        self._push(key)

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.remove(key)

    def clear(self) -> None:
        self.chunks.clear()
        self._rank.clear()
        self._evictable.clear()
        self._heap.clear()
        self._floor = self._clock


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache over chunks.

    T1 holds chunks seen by one request, T2 chunks reused by a later request; B1/B2 remember keys
    recently evicted from each (ghosts, bounded by capacity). Inserting always goes to T1; a
    *ready* chunk reused by a finished request moves to T2 once per request (a store is not a
    reuse). A store miss that hits a ghost adapts `target_t1`: a B1 ghost says recency was
    undervalued (grow T1), a B2 ghost says frequency was (shrink T1). Eviction takes T1's LRU when
    |T1| >= target, else T2's, skipping pinned and protected chunks, atomically.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_t1: float = 0.0
        self.t1: OrderedDict[OffloadKey, Chunk] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, Chunk] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> Chunk | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, chunk: Chunk, ctx: ReqContext) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def _ghost_hit(self, key: OffloadKey) -> None:
        if key in self.b1:
            self.target_t1 = min(self.target_t1 + max(1.0, len(self.b2) / len(self.b1)), self.capacity)
            self.b1.move_to_end(key)
        elif key in self.b2:
            self.target_t1 = max(self.target_t1 - max(1.0, len(self.b1) / len(self.b2)), 0.0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(keys):
            self._ghost_hit(key)

    def touch(self, keys: Iterable[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(list(keys)):
            chunk = self.t1.pop(key, None)
            if chunk is not None:
                # a chunk still being written was only just inserted: not a second access
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_request_finished(self, key_groups: Sequence[Sequence[OffloadKey]], inserted_only: set[OffloadKey],
                            reused: set[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(prefix_order(key_groups, ctx)):
            if key in inserted_only:
                for lst in (self.t1, self.t2):
                    if key in lst:
                        lst.move_to_end(key)
                        break
            elif key in reused:
                if key in self.t1:
                    self.t2[key] = self.t1.pop(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def evict(self, n: int, protected: set[OffloadKey]) -> list[tuple[OffloadKey, Chunk]] | None:
        if n == 0:
            return []
        t1_iter, t2_iter = iter(self.t1.items()), iter(self.t2.items())

        def next_free(it: Iterable[tuple[OffloadKey, Chunk]]) -> tuple[OffloadKey, Chunk] | None:
            for key, chunk in it:
                if chunk.ref_cnt == 0 and key not in protected:
                    return key, chunk
            return None

        picks: list[tuple[OffloadKey, Chunk, bool]] = []
        t1_size = len(self.t1)
        for _ in range(n):
            pick = next_free(t1_iter) if t1_size >= int(self.target_t1) else None
            from_t1 = pick is not None
            if pick is None:
                pick = next_free(t2_iter)
            if pick is None:
                pick, from_t1 = next_free(t1_iter), True
                if pick is None:
                    return None  # nothing has been modified yet
            t1_size -= from_t1
            picks.append((*pick, from_t1))
        out = []
        for key, chunk, from_t1 in picks:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
            out.append((key, chunk))
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return out

    def clear(self) -> None:
        for d in (self.t1, self.t2, self.b1, self.b2):
            d.clear()
        self.target_t1 = 0.0


POLICIES: dict[str, type[CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}
