"""The CPU tier's bookkeeping: which offload keys sit in which host chunk, in which state, what to
evict, and the group-tagged KV events it owes the publisher (vLLM 0.33 `CPUOffloadingManager`).

Pure logic with no tensors: the bytes live in `kvpipe.gpu.offload.HostBuffers`, indexed by the chunk ids
this tier hands out. The caller moves bytes between the two calls of each protocol:
`prepare_store` -> copy device->host -> `complete_store`, and `prepare_load` -> copy host->device
-> `complete_load`.
"""
from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from kvpipe.gpu.cpu_policies import POLICIES, CachePolicy, Chunk, OffloadKey, ReqContext
from kvpipe.gpu.hashing import external_hash, group_key
from kvpipe.schemas.events import MEDIUM_CPU, BlockRemoved, BlockStored

__all__ = ["CpuTier", "LookupResult", "OffloadKey", "PrepareStoreOutput", "ReqContext",
           "make_offload_key", "offload_key_group", "offload_key_hash"]


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Hash bytes followed by the group index as u32 big-endian: the same layout as the prefix
    cache's per-group key, and bytes rather than a tuple so millions of keys cost no GC work."""
    return group_key(block_hash, group_idx)


def offload_key_hash(key: OffloadKey) -> bytes:
    return key[:-4]


def offload_key_group(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big")


class LookupResult(enum.Enum):
    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"  # present, but its write has not completed: not loadable yet
    RETRY = "retry"  # the backend cannot tell yet; ask again later (never returned by CpuTier)


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    keys_to_store: list[OffloadKey]
    chunk_ids: list[int]  # co-indexed with keys_to_store
    evicted_keys: list[OffloadKey]


@dataclass(slots=True)
class _Access:
    """One request's observed keys (per group, first-seen order) and how it used them."""

    generation: int = -1
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


@dataclass(frozen=True, slots=True)
class _TierEvent:
    keys: list[OffloadKey]
    removed: bool
    metadata_only: bool = False  # a failed store's cleanup: bookkeeping only, never published


class CpuTier:
    """Host chunk pool of `num_chunks` slots with a replacement policy ("lru" or "arc").

    Invariants: a key maps to at most one chunk; a chunk's `ref_cnt` is -1 while its write is
    pending (lookup -> HIT_PENDING, never evicted), 0 when ready and evictable, n > 0 while n loads
    read it; only ref_cnt 0 chunks outside the current offer are evicted, and all-or-nothing.
    Fresh chunk ids are handed out in order 0, 1, 2, ... before freed ids are reused, last freed
    first, so a cold tier gives adjacent chunks (one host copy run per transfer).

    Events: evictions are queued when `prepare_store` decides them (before the store they make
    room for), stores only when `complete_store(success=True)` confirms the bytes landed. So on
    the wire a CPU `BlockStored` never precedes its copy, and the removals it caused precede it.
    """

    def __init__(self, num_chunks: int, policy: str | CachePolicy = "lru", enable_events: bool = True,
                 int_hashes: bool = True) -> None:
        if num_chunks < 0:
            raise ValueError(f"CpuTier: num_chunks must be >= 0, got {num_chunks}")
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"CpuTier: unknown policy {policy!r}; known: {sorted(POLICIES)}")
            policy = POLICIES[policy](num_chunks)
        self.num_chunks = num_chunks
        self.policy = policy
        self.int_hashes = int_hashes
        self._events: list[_TierEvent] | None = [] if enable_events else None
        self._next_fresh = 0
        self._free: list[int] = []
        self._num_evictable = 0
        self._num_write_pending = 0
        self._generation = 0

    # -- chunk pool ------------------------------------------------------------------------------

    @property
    def num_free_chunks(self) -> int:
        return self.num_chunks - self._next_fresh + len(self._free)

    def usage(self) -> float:
        """Fraction of chunks that are pinned or being written (not free, not evictable)."""
        used = self._next_fresh - len(self._free) - self._num_evictable
        return used / self.num_chunks if self.num_chunks else 0.0

    def _allocate(self, n: int) -> list[int]:
        fresh = min(n, self.num_chunks - self._next_fresh)
        ids = list(range(self._next_fresh, self._next_fresh + fresh))
        self._next_fresh += fresh
        ids += [self._free.pop() for _ in range(n - fresh)]
        return ids

    # -- per-request records ---------------------------------------------------------------------

    def _access(self, ctx: ReqContext) -> _Access:
        rec = ctx.state(self, _Access)
        if rec.generation != self._generation:  # first call, or the cache was reset since
            ctx.drop_state(self, _Access)
            rec = ctx.state(self, _Access)
            rec.generation = self._generation
        return rec

    def _record(self, keys: Iterable[OffloadKey], ctx: ReqContext, reused: Iterable[OffloadKey] = ()) -> None:
        rec = self._access(ctx)
        new = [k for k in keys if k not in rec.seen]
        if new:
            if rec.finished:
                raise RuntimeError(f"request {ctx.req_id}: new offload keys after on_request_finished")
            for k in new:
                rec.key_groups.setdefault(offload_key_group(k), []).append(k)
            rec.seen.update(new)
            self.policy.on_request_access(new, ctx)
        # re-reading what this request itself stored is not a reuse
        rec.reused.update(k for k in reused if k not in rec.inserted)

    # -- OffloadingManager protocol --------------------------------------------------------------

    def on_new_request(self, ctx: ReqContext) -> None:
        self._access(ctx)

    def lookup(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        """State of one key; never changes recency."""
        chunk = self.policy.get(key)
        if chunk is None:
            return LookupResult.MISS
        return LookupResult.HIT if chunk.is_ready else LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> list[int]:
        """Pin ready chunks until `complete_load`; returns their chunk ids, co-indexed with keys."""
        ids = []
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or not chunk.is_ready:
                raise KeyError(f"prepare_load: key {key.hex()} is {'absent' if chunk is None else 'not ready'}")
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self._num_evictable -= 1
            chunk.ref_cnt += 1
            ids.append(chunk.chunk_id)
        self._record(keys, ctx, reused=keys)
        return ids

    def touch(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        self.policy.touch(keys, ctx)

    def complete_load(self, keys: Collection[OffloadKey], ctx: ReqContext) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or chunk.ref_cnt <= 0:
                raise KeyError(f"complete_load: key {key.hex()} is not being loaded")
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self._num_evictable += 1
                self.policy.mark_evictable(key)

    def prepare_store(self, keys: Collection[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Allocate chunks for the keys not yet present, evicting idle ones if needed; None if that
        is impossible (nothing changes then, apart from the request's access record)."""
        keys = list(keys)
        to_store = [k for k in keys if self.policy.get(k) is None]
        ready_present = [k for k in keys if (c := self.policy.get(k)) is not None and c.is_ready]
        rec = self._access(ctx)
        misses = [k for k in to_store if k not in rec.store_misses]
        if misses:
            self.policy.on_store_miss(misses, ctx)  # ARC adapts on ghosts before insert drops them
            rec.store_misses.update(misses)
        recorded = set(to_store) | set(ready_present)
        self._record((k for k in keys if k in recorded), ctx, reused=ready_present)
        if not to_store:
            return PrepareStoreOutput([], [], [])

        evicted: list[OffloadKey] = []
        shortfall = len(to_store) - self.num_free_chunks
        if shortfall > 0:
            if shortfall > self._num_evictable:
                return None
            # keys of this offer stay, even those already stored: the caller counts on them
            victims = self.policy.evict(shortfall, set(keys))
            if victims is None:
                return None
            self._num_evictable -= len(victims)
            for key, chunk in victims:
                self._free.append(chunk.chunk_id)
                evicted.append(key)
            if self._events is not None:
                self._events.append(_TierEvent(evicted, removed=True))

        ids = self._allocate(len(to_store))
        for key, chunk_id in zip(to_store, ids):
            self.policy.insert(key, Chunk(chunk_id), ctx)
        self._num_write_pending += len(to_store)
        rec.inserted.update(to_store)
        return PrepareStoreOutput(to_store, ids, evicted)

    def complete_store(self, keys: Collection[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        """Make written chunks loadable, or drop them if the copy failed. Keys that were not
        pending (already stored before this offer) are left alone."""
        done = []
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or chunk.is_ready:
                continue
            self._num_write_pending -= 1
            if success:
                chunk.ref_cnt = 0
                self._num_evictable += 1
                self.policy.mark_evictable(key)
            else:
                self.policy.remove(key)
                self._free.append(chunk.chunk_id)
            done.append(key)
        if done and self._events is not None:
            self._events.append(_TierEvent(done, removed=not success, metadata_only=not success))

    def on_request_finished(self, ctx: ReqContext) -> None:
        """Commit the request's recency: its keys, head most recent (LRU) / reuses promoted (ARC)."""
        rec = self._access(ctx)
        if rec.finished:
            return
        rec.finished = True
        groups = []
        for g in sorted(rec.key_groups):
            keys = rec.key_groups[g]
            if all(k in ctx.positions for k in keys):
                keys = sorted(keys, key=ctx.positions.__getitem__)
            groups.append(tuple(keys))
        self.policy.on_request_finished(groups, rec.inserted - rec.reused, rec.reused, ctx)

    def reset_cache(self) -> None:
        """Forget everything without events (vLLM publishes no CPU removals on reset)."""
        self.policy.clear()
        self._generation += 1
        self._next_fresh = 0
        self._free.clear()
        self._num_evictable = 0
        self._num_write_pending = 0
        if self._events is not None:
            self._events.clear()

    # -- events ----------------------------------------------------------------------------------

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """Drain queued events as vLLM's placeholder CPU events: one `BlockStored` per stored key
        (token_ids=[], block_size=0, no parent), one `BlockRemoved` per group per eviction batch.
        Failed-store cleanups are not published (nothing was announced for them)."""
        if not self._events:
            return []
        queued, self._events = self._events, []
        out: list[BlockStored | BlockRemoved] = []
        for ev in queued:
            if ev.metadata_only:
                continue
            if not ev.removed:
                out.extend(self._stored(k) for k in ev.keys)
                continue
            by_group: dict[int, list[int | bytes]] = {}
            for k in ev.keys:
                by_group.setdefault(offload_key_group(k), []).append(self._ext(k))
            out.extend(BlockRemoved(block_hashes=h, medium=MEDIUM_CPU, group_idx=g) for g, h in by_group.items())
        return out

    def _ext(self, key: OffloadKey) -> int | bytes:
        return external_hash(offload_key_hash(key), self.int_hashes)

    def _stored(self, key: OffloadKey) -> BlockStored:
        return BlockStored(block_hashes=[self._ext(key)], parent_block_hash=None, token_ids=[], block_size=0,
                           lora_id=None, medium=MEDIUM_CPU, lora_name=None, group_idx=offload_key_group(key))
