"""Where the index keeps its blocks: per slot (one node's group on one medium) the blocks it holds
with their store times and extra copies, and per group the inverted view (block → slots) that the
router reads. Two implementations of one contract, chosen by `make_store`:

  "native"  `kvpipe_native.IndexStore` (native/src/store.rs): open-addressing tables keyed by the
            64-bit hash; the default on the native engine (`kvpipe.processors.core.native`).
  "python"  dicts, the readable reference (tests/property/test_native_index.py holds the two equal).

Both key blocks by vLLM's 64-bit form of the hash (`hash_to_u64`: ints as they are, bytes by their
last 8 bytes), the form analytics rows and snapshots already use, so an index answers the same
whichever store it runs on. Two different digests sharing their last 8 bytes would share an entry;
vLLM itself identifies blocks by that same 64-bit value in its events (docs/vllm-behaviour.md), so
the index cannot tell them apart better than the engine does.

`close` returns a slot's entries sorted by (store time, key) in both stores: lifetimes and
snapshots come out in one order whichever store made them.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

from kvpipe.processors.core import native
from kvpipe.processors.core.lifetimes import U64_MASK
from kvpipe.schemas.events import MEDIUM_GPU as GPU  # the medium name vLLM gives device memory
from kvpipe.schemas.events import Event, ExternalHash

StoreKind = Literal["native", "python"]
MAX_MEDIA = 0xFFFF  # medium ids the native store records; the last one is shared by any further medium
STORES: tuple[StoreKind, ...] = ("native", "python")


def key_of(h: ExternalHash) -> int:
    """The 64-bit key of a block hash (the rule of `kvpipe.processors.analytics.rows.hash_to_u64`)."""
    if h.__class__ is int:
        return h & U64_MASK
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(h[-8:], "big")
    if isinstance(h, int):
        return int(h) & U64_MASK
    raise TypeError(f"a block hash must be int or bytes, got {type(h).__name__}")


def parse_batch(payload: bytes) -> native.Batch | None:
    """vLLM's event batch read natively (`kvpipe_native.Batch`: no Python object per event), or
    None when the reference decoder must read it (`kvpipe.schemas.codec.decode_vllm_batch`: the native
    reader accepts a strict subset, native/src/batch.rs) or the Python engine runs."""
    return native.parse_batch(payload)


def batch_event(batch: native.Batch, i: int) -> Event:
    """Event `i` of a native batch as the reference's event object (the fields the index reads;
    for the per-event path: clears and first events of a new slot)."""
    from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

    kind, keys, group, medium = batch.event(i)
    if kind == 2:
        return AllBlocksCleared()
    hashes: list[ExternalHash] = list(keys)  # the events' type (ints or bytes); a rare path: clears, new slots
    if kind == 1:
        return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=0, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def default_store() -> StoreKind:
    return native.engine()


class Slot:
    """The blocks one node holds in one group on one medium (`blocks`: key → store time of the first
    copy; `dups`: key → extra copies). The store owns the entries; a slot is its handle."""

    __slots__ = ("node", "group", "medium", "blocks", "dups", "sid")

    def __init__(self, node: Any, group: int, medium: str) -> None:
        self.node = node
        self.group = group
        self.medium = medium
        self.blocks: Any = {}
        self.dups: Any = {}
        self.sid = -1

    def refcount(self, h: ExternalHash) -> int:
        k = key_of(h)
        return (1 + self.dups.get(k, 0)) if k in self.blocks else 0


Closed = tuple[list[int], list[float]]


class PyStore:
    """The reference: one dict per slot, and per group `key → Slot | set[Slot]` (most blocks have
    one holder, and a bare Slot instead of a one-element set saves an allocation per block)."""

    kind: StoreKind = "python"

    def __init__(self) -> None:
        self.holders: dict[int, dict[int, Slot | set[Slot]]] = {}

    def new_slot(self, node: Any, group: int, medium: str) -> Slot:
        self.holders.setdefault(group, {})
        return Slot(node, group, medium)

    def store(self, slot: Slot, hashes: Iterable[ExternalHash], ts: float, cap: int | None) -> tuple[int, int]:
        keys = [key_of(h) for h in hashes]
        blocks, dups, holders = slot.blocks, slot.dups, self.holders[slot.group]
        given = len(keys)
        if cap is not None and len(blocks) + len(keys) > cap:
            room = cap - len(blocks)
            kept = []
            for k in keys:  # judged on the slot before this call
                if k in blocks:
                    kept.append(k)
                elif room > 0:
                    kept.append(k)
                    room -= 1
            keys = kept
        for k in keys:
            if k in blocks:
                dups[k] = dups.get(k, 0) + 1
                continue
            blocks[k] = ts
            cur = holders.get(k)
            if cur is None:
                holders[k] = slot
            elif isinstance(cur, set):
                cur.add(slot)
            else:
                holders[k] = {cur, slot}
        return len(keys), given - len(keys)

    def remove(self, slot: Slot, hashes: Iterable[ExternalHash]) -> tuple[int, int, list[int], list[float]]:
        blocks, dups, holders = slot.blocks, slot.dups, self.holders[slot.group]
        removed = unknown = 0
        keys: list[int] = []
        times: list[float] = []
        for h in hashes:
            k = key_of(h)
            extra = dups.get(k)
            if extra is not None:  # another copy still serves hits
                if extra > 1:
                    dups[k] = extra - 1
                else:
                    del dups[k]
                removed += 1
                continue
            stored_ts = blocks.pop(k, None)
            if stored_ts is None:  # never stored: counted by the caller, not an error
                unknown += 1
                continue
            removed += 1
            _drop_holder(holders, k, slot)
            keys.append(k)
            times.append(stored_ts)
        return removed, unknown, keys, times

    def close(self, slot: Slot) -> Closed:
        holders = self.holders.get(slot.group, {})
        items = sorted(slot.blocks.items(), key=lambda kv: (kv[1], kv[0]))
        for k, _ in items:
            _drop_holder(holders, k, slot)
        slot.blocks, slot.dups = {}, {}
        return [k for k, _ in items], [t for _, t in items]

    def load(self, slot: Slot, blocks: Mapping[ExternalHash, float], dups: Mapping[ExternalHash, int]) -> None:
        holders = self.holders.setdefault(slot.group, {})
        for h, ts in blocks.items():
            k = key_of(h)
            if k not in slot.blocks:
                cur = holders.get(k)
                if cur is None:
                    holders[k] = slot
                elif isinstance(cur, set):
                    cur.add(slot)
                elif cur is not slot:
                    holders[k] = {cur, slot}
            slot.blocks[k] = ts
        for h, n in dups.items():
            k = key_of(h)
            if n and k in slot.blocks:
                slot.dups[k] = n

    def holders_of(self, group: int, h: ExternalHash) -> list[Slot]:
        cur = self.holders.get(group, {}).get(key_of(h))
        if cur is None:
            return []
        return list(cur) if isinstance(cur, set) else [cur]

    def held(self, hashes_by_group: Mapping[int, list]) -> dict[Slot, set[int]]:
        """Per slot, the positions of the request's blocks it holds (one lookup per (group, hash);
        list entries that are None are placeholders no slot holds)."""
        by_slot: dict[Slot, set[int]] = {}
        for group, hashes in hashes_by_group.items():
            holders = self.holders.get(group)
            if not holders:
                continue
            for i, h in enumerate(hashes):
                if h is None:
                    continue
                cur = holders.get(key_of(h))
                if cur is None:
                    continue
                for slot in (cur if isinstance(cur, set) else (cur,)):
                    positions = by_slot.get(slot)
                    if positions is None:
                        positions = by_slot[slot] = set()
                    positions.add(i)
        return by_slot

    def entries(self) -> int:
        return sum(len(s.blocks) for per in self.holders.values() for s in _slots_of(per))

    def memory_bytes(self) -> int | None:
        return None  # Python objects: measured by the bench with tracemalloc, not here


def _slots_of(per: dict[int, Slot | set[Slot]]) -> set[Slot]:
    out: set[Slot] = set()
    for cur in per.values():
        if isinstance(cur, set):
            out.update(cur)
        else:
            out.add(cur)
    return out


def _drop_holder(holders: dict[int, Slot | set[Slot]], k: int, slot: Slot) -> None:
    cur = holders.get(k)
    if cur is slot:
        del holders[k]
    elif isinstance(cur, set):
        cur.discard(slot)
        if len(cur) == 1:
            holders[k] = next(iter(cur))


class _Blocks(Mapping[ExternalHash, float]):
    """A native slot's `blocks` as a read-only mapping key → store time (order: time, key)."""

    __slots__ = ("_core", "_sid")

    def __init__(self, core: native.IndexStore, sid: int) -> None:
        self._core, self._sid = core, sid

    def __len__(self) -> int:
        return self._core.slot_len(self._sid)

    def __getitem__(self, h: ExternalHash) -> float:
        ts = self._core.get(self._sid, h)
        if ts is None:
            raise KeyError(h)
        return ts

    def __contains__(self, h: object) -> bool:
        return isinstance(h, (int, bytes)) and self._core.get(self._sid, h) is not None

    def __iter__(self) -> Iterator[int]:
        return iter(self._core.items(self._sid)[0])

    # lists, not views: one native call reads the slot's keys and times in one order
    def items(self):
        keys, times = self._core.items(self._sid)
        return list(zip(keys, times))

    def values(self):
        return self._core.items(self._sid)[1]


class _Dups(Mapping[ExternalHash, int]):
    """A native slot's extra copies as a read-only mapping key → count."""

    __slots__ = ("_core", "_sid")

    def __init__(self, core: native.IndexStore, sid: int) -> None:
        self._core, self._sid = core, sid

    def _all(self) -> dict[int, int]:
        return dict(self._core.dup_items(self._sid))

    def __len__(self) -> int:
        return len(self._all())

    def __getitem__(self, h: ExternalHash) -> int:
        n = self._core.copies(self._sid, h)
        if n <= 1:
            raise KeyError(h)
        return n - 1

    def __iter__(self) -> Iterator[int]:
        return iter(self._all())


class NativeStore:
    """`kvpipe_native.IndexStore` behind the reference's interface; slots are handles by id."""

    kind: StoreKind = "native"

    def __init__(self) -> None:
        self.core = native.index_store()  # NativeUnavailable, saying why, on the Python engine
        self._gpu_bit, self._unknown_bit, self._mask_media = native.media_bits()
        self._slots: dict[int, Slot] = {}  # sid → slot, for the router's answers
        # media by id as the store records them per slot (ids are u16; past that, one shared id;
        # the router reads media the reference way once they pass the answer mask's bits)
        self.media: list[str] = []
        self._media_ids: dict[str, int] = {}
        self._rank: list[int] | None = None
        self._names: dict[int, str] = {}  # media mask → the router's medium string (ids never change)

    def new_slot(self, node: Any, group: int, medium: str) -> Slot:
        slot = Slot(node, group, medium)
        slot.sid = self.core.new_slot(group, node.key, self._medium_id(medium), medium == GPU)
        slot.blocks, slot.dups = _Blocks(self.core, slot.sid), _Dups(self.core, slot.sid)
        self._slots[slot.sid] = slot
        return slot

    def _medium_id(self, medium: str) -> int:
        got = self._media_ids.get(medium)
        if got is None:
            if len(self.media) >= MAX_MEDIA:
                return MAX_MEDIA
            got = self._media_ids[medium] = len(self.media)
            self.media.append(medium)
            self._rank = None
        return got

    def media_rank(self) -> list[int]:
        """Per medium id its position by name (the order the router lists media in)."""
        if self._rank is None:
            order = sorted(range(len(self.media)), key=self.media.__getitem__)
            rank = [0] * len(self.media)
            for pos, mid in enumerate(order):
                rank[mid] = pos
            self._rank = rank
        return self._rank

    def masks_media(self) -> bool:
        """Whether every medium so far has a bit in a native answer's media mask (past that, the router
        reads media the reference way)."""
        return len(self.media) < self._mask_media

    def media_names(self, mask: int) -> str:
        """A route answer's media mask (`kvpipe_native.IndexStore.route_cohort`: bit `id` per medium
        id, and the GPU and unknown bits) as the router writes it: names joined by "+", GPU first,
        "?" for blocks on no medium known, "none" for none."""
        got = self._names.get(mask)
        if got is None:
            names = [GPU] if mask & self._gpu_bit else []
            if mask & self._unknown_bit:
                names.append("?")
            names += [m for i, m in enumerate(self.media) if i < self._mask_media and mask >> i & 1]
            got = self._names[mask] = "+".join(sorted(names, key=lambda m: (m != GPU, m))) or "none"
        return got

    def slot_by_id(self, sid: int) -> Slot:
        return self._slots[sid]

    def route_cohort(self, engine: native.HitEngine, lists: list[tuple[int, list[ExternalHash]]],
                     members: native.MemberTable, models: list[tuple[int, int, int]],
                     prefixes: bool) -> list[native.CohortRow]:
        """A cohort's members holding any requested block, with their hits, in one native call
        (`kvpipe.processors.router.cohort`); media come as masks (`masks_media`, `media_names`)."""
        return self.core.route_cohort(engine, lists, members, models, self.media_rank(), prefixes)

    def router(self, memo_entries: int = native.MEMO_ENTRIES) -> native.NativeRouter:
        """The native route decision on this store: it reads the blocks under the store's lock from threads of
        its own (`kvpipe.processors.router.native`); `memo_entries` bounds the digests of held prompt units it
        remembers (0: none)."""
        return native.native_router(self.core, memo_entries)

    def store(self, slot: Slot, hashes: Iterable[ExternalHash], ts: float, cap: int | None) -> tuple[int, int]:
        return self.core.store(slot.sid, hashes, ts, cap)

    def remove(self, slot: Slot, hashes: Iterable[ExternalHash]) -> tuple[int, int, list[int], list[float]]:
        return self.core.remove(slot.sid, hashes)

    def close(self, slot: Slot) -> Closed:
        out = self.core.close(slot.sid)
        if self._slots.get(slot.sid) is slot:
            del self._slots[slot.sid]
        slot.blocks, slot.dups = {}, {}  # the id may be reused: the handle must not read another slot
        slot.sid = -1
        return out

    def load(self, slot: Slot, blocks: Mapping[ExternalHash, float], dups: Mapping[ExternalHash, int]) -> None:
        self.core.load(slot.sid, list(blocks), list(blocks.values()),
                       [(key_of(h), n) for h, n in dups.items() if n > 0])

    def holders_of(self, group: int, h: ExternalHash) -> list[Slot]:
        return [self._slots[s] for s in self.core.holders(group, h)]

    def held(self, hashes_by_group: Mapping[int, list]) -> dict[Slot, set[int]]:
        # placeholders (None) stand for blocks no node holds: left out, positions mapped back
        slots = self._slots
        plain = [(g, hashes) for g, hashes in hashes_by_group.items() if None not in hashes]
        out = {slots[sid]: positions for sid, positions in self.core.held(plain)} if plain else {}
        for g, hashes in hashes_by_group.items():
            if None in hashes:  # a slot belongs to one group: the answers never overlap
                keep = [i for i, h in enumerate(hashes) if h is not None]
                for sid, positions in self.core.held([(g, [hashes[i] for i in keep])]):
                    out[slots[sid]] = {keep[i] for i in positions}
        return out

    def entries(self) -> int:
        return self.core.entries()

    def memory_bytes(self) -> int | None:
        return self.core.memory_bytes()


def make_store(kind: StoreKind | None = None) -> PyStore | NativeStore:
    """The store `kind` names (None: native when built, else python)."""
    kind = kind or default_store()
    if kind not in STORES:
        raise ValueError(f"index store must be one of {STORES}, got {kind!r}")
    return NativeStore() if kind == "native" else PyStore()

