"""Snapshot records of one partition's slice of the index: pure encode/decode, no I/O.

A snapshot of events partition p at source offset X is a *generation* of records:
- chunks, key `p/<gen>/<i>`, each a msgpack `Chunk` of at most ~`CHUNK_BYTES` (a big node is
  split across chunks: its header repeats, its slots' entries are divided), so no record hits the
  broker's message size limit however large the index grows;
- then one manifest, key `p`, saying how many chunks the generation has and which offset it covers.

The manifest is written last, so a manifest always describes a complete generation; a crash in
the middle leaves chunks without a manifest, which restore ignores. Chunk keys carry the generation
so a new snapshot never overwrites (and compaction never deletes) the chunks of the one before it
until the new manifest is acknowledged; then the old chunks are tombstoned (`durability`).

On the native store (`processors/core/slots.py: NativeStore`) slot records are written and read by the
extension (native/src/snapshot.rs) as the very bytes msgspec writes for a `SlotSnap`, spliced into
the chunk as `msgspec.Raw`: no Python object per entry either way, and the format stays 1. The
walk below in Python stays the reference (the dict store, or the Python engine). The records are generic in
what a node's slots are (`NodeSnap[S]`): `SlotSnap`s or their bytes on the way out, `SlotSnap`s or `SlotBytes`
on the way in; the wire form is the same.
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

import msgspec

from kvpipe.processors.core import native as _native
from kvpipe.processors.core import slots as _slots
from kvpipe.processors.core.index import Index, NodeState
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from kvpipe.schemas.events import ExternalHash

CHUNK_BYTES = 512 * 1024  # below Kafka's default 1 MB message limit, with headroom
_NODE_BYTES = 256  # what a node's header is taken to cost in a chunk
FORMAT = 1


class SlotSnap(msgspec.Struct, array_like=True, gc=False):
    group: int
    medium: str
    hashes: list[ExternalHash]
    stored_ts: list[float]
    dups: dict[ExternalHash, int] = {}


S = TypeVar("S")  # a node's slot records: `SlotSnap`, or the bytes of one (`msgspec.Raw`, `SlotBytes`)


class NodeSnap(msgspec.Struct, Generic[S], array_like=True, gc=False):
    node_id: str
    epoch: int
    seq: int
    last_seen: float
    suspect: bool
    reason: str
    expired: bool
    group_specs: list[GroupSpec] | None
    hash_config: HashConfig | None
    model: str | None
    dp_rank: int | None
    last_offset: int
    counters: dict[str, int]
    slots: list[S]
    # added after FORMAT 1 shipped: trailing with defaults, so older snapshots still decode
    partial_since: tuple[int, int, float] | None = None
    skew_s: float = 0.0
    expired_at: float = 0.0
    load: tuple[int | None, int | None, float | None] | None = None  # the latest reported (router score)


class Chunk(msgspec.Struct, Generic[S], gc=False):
    partition: int
    gen: int
    idx: int
    nodes: list[NodeSnap[S]]


class Manifest(msgspec.Struct):
    format: int
    source_topic: str
    partition: int
    gen: int
    chunks: int
    offset: int  # last source offset the snapshot covers (-1: none yet)
    stream_ts: float  # newest node timestamp applied from the partition
    created_ts: float
    processor_id: str
    nodes: int
    blocks: int


class SlotBytes:
    """One slot piece kept as its encoded `SlotSnap` (what `decode_chunk` gives when the native
    reader is built). It was checked whole at decode, so a broken record fails there like any
    other undecodable chunk; a native store loads it from the bytes, the Python store and readers
    of its fields decode it with msgspec (the reference)."""

    __slots__ = ("raw", "group", "medium", "entries")

    def __init__(self, raw: msgspec.Raw, group: int, medium: str, entries: int) -> None:
        self.raw, self.group, self.medium, self.entries = raw, group, medium, entries

    def snap(self) -> SlotSnap:
        return _slot_decoder.decode(self.raw)

    @property
    def hashes(self) -> list[ExternalHash]:
        return self.snap().hashes

    @property
    def stored_ts(self) -> list[float]:
        return self.snap().stored_ts

    @property
    def dups(self) -> dict[ExternalHash, int]:
        return self.snap().dups

    def __repr__(self) -> str:
        return f"SlotBytes(group={self.group}, medium={self.medium!r}, entries={self.entries})"


Written = SlotSnap | msgspec.Raw  # a slot record on the way out (the Python walk's, or the extension's bytes)

_encoder = msgspec.msgpack.Encoder()
_chunk_decoder = msgspec.msgpack.Decoder(Chunk[SlotSnap])
_raw_chunk_decoder = msgspec.msgpack.Decoder(Chunk[msgspec.Raw])  # each slot left as its bytes
_slot_decoder = msgspec.msgpack.Decoder(SlotSnap)
_manifest_decoder = msgspec.msgpack.Decoder(Manifest)


def manifest_key(partition: int) -> bytes:
    return f"{partition}".encode()


def chunk_key(partition: int, gen: int, idx: int) -> bytes:
    return f"{partition}/{gen}/{idx}".encode()


def parse_key(key: bytes) -> tuple[int, int | None, int | None]:
    """`(partition, gen, idx)`; gen/idx None for a manifest key. ValueError for a foreign key."""
    parts = key.decode().split("/")
    if len(parts) == 1:
        return int(parts[0]), None, None
    if len(parts) == 3:
        return int(parts[0]), int(parts[1]), int(parts[2])
    raise ValueError(f"not a snapshot key: {key!r}")


def _node_header(node: NodeState, slots: list[Written]) -> NodeSnap[Written]:
    return NodeSnap(node.node_id, node.epoch, node.seq, node.last_seen, node.suspect, node.reason, node.expired,
                    node.group_specs, node.hash_config, node.model, node.dp_rank, node.last_offset, dict(node.counters),
                    slots, node.partial_since, node.skew_s, node.expired_at, node.load)


def _hash_bytes(h: ExternalHash) -> int:
    return 9 if isinstance(h, int) else len(h) + 2


def _native_core(index: Index, native: bool | None) -> _native.IndexStore | None:
    """The native store's core when slot records go through the extension, else None."""
    store = index.store
    usable = isinstance(store, _slots.NativeStore)
    if native and not usable:
        raise RuntimeError("native snapshots need the native index store")
    return store.core if isinstance(store, _slots.NativeStore) and native is not False else None


def export_partition(index: Index, partition: int, gen: int, chunk_bytes: int = CHUNK_BYTES,
                     native: bool | None = None) -> tuple[list[bytes], int, int]:
    """The partition's nodes as encoded chunks; returns `(chunks, nodes, blocks)`.

    Runs synchronously between two messages of the agent, so the slice is consistent with the
    partition's applied offset at the moment of the call. `native`: write slot records with the
    extension (None: when the store is native and the extension has it; False: the Python walk,
    the reference, byte for byte the same output).
    """
    if chunk_bytes <= _NODE_BYTES:  # no room for an entry after a node's header: the walk would never end
        raise ValueError(f"chunk_bytes must exceed {_NODE_BYTES}, got {chunk_bytes}")
    core = _native_core(index, native)
    if core is not None:
        return _export_native(index, core, partition, gen, chunk_bytes)
    out = _Chunks(partition, gen)
    blocks = 0
    for node, header in out.nodes_of(index):
        for slot in node.slots.values():
            entries = slot.blocks.items()  # one read: keys and times in one order
            hashes = [h for h, _ in entries]
            stored = [t for _, t in entries]
            dups = dict(slot.dups)
            blocks += len(hashes)
            start = 0
            while True:
                end, room = start, chunk_bytes - out.size
                while end < len(hashes) and room > 0:
                    room -= _hash_bytes(hashes[end]) + 9
                    end += 1
                piece = SlotSnap(slot.group, slot.medium, hashes[start:end], stored[start:end],
                                 {h: dups[h] for h in hashes[start:end] if h in dups} if dups else {})
                header.slots.append(piece)
                out.size = chunk_bytes - room
                start = end
                if start >= len(hashes):
                    break
                out.flush()  # the chunk is full: the rest of this slot goes on in the next chunk
                header = out.open(node)
        if out.size >= chunk_bytes:
            out.flush()
    out.flush()
    return out.chunks, out.nodes, blocks


def _export_native(index: Index, core: _native.IndexStore, partition: int, gen: int,
                   chunk_bytes: int) -> tuple[list[bytes], int, int]:
    """`export_partition`'s walk with each slot written by the extension: the same pieces (the
    chunk sizing of the Python walk, with every hash a 64-bit int: `_ENTRY` bytes an entry), so
    the same bytes."""
    out = _Chunks(partition, gen)
    blocks = 0
    for node, header in out.nodes_of(index):
        for slot in node.slots.values():
            n = core.slot_len(slot.sid)
            blocks += n
            # cut the slot where the Python walk would: a piece takes entries while its chunk has room
            cuts, headers, start = [0], [header], 0
            size = out.size
            while True:
                room = chunk_bytes - size
                take = min(n - start, -(-room // _ENTRY)) if room > 0 else 0
                start += take
                size = chunk_bytes - (room - take * _ENTRY)
                cuts.append(start)
                if start >= n:
                    break
                header = _node_header(node, [])
                headers.append(header)
                size = _NODE_BYTES
            pieces = core.snapshot_slot(slot.sid, slot.group, slot.medium, cuts)
            headers[0].slots.append(msgspec.Raw(pieces[0]))
            for piece, head in zip(pieces[1:], headers[1:]):
                out.flush()  # the chunk is full: the rest of this slot goes on in the next chunk
                head.slots.append(msgspec.Raw(piece))
                out.current.append(head)
            out.size = size
        if out.size >= chunk_bytes:
            out.flush()
    out.flush()
    return out.chunks, out.nodes, blocks


class _Chunks:
    """One partition's generation of chunks as the walk fills them: the open chunk's nodes and
    its size so far; `flush` encodes it and starts the next."""

    def __init__(self, partition: int, gen: int) -> None:
        self.partition, self.gen = partition, gen
        self.chunks: list[bytes] = []
        self.current: list[NodeSnap[Written]] = []
        self.size = 0
        self.nodes = 0

    def nodes_of(self, index: Index) -> Iterator[tuple[NodeState, NodeSnap[Written]]]:
        """The partition's nodes, each with its header opened in the chunk (counted in `nodes`)."""
        for node in index.nodes.values():
            if node.partition == self.partition:
                self.nodes += 1
                yield node, self.open(node)

    def open(self, node: NodeState) -> NodeSnap[Written]:
        """A header of `node` in the open chunk (a big node's header repeats in each chunk)."""
        header = _node_header(node, [])
        self.current.append(header)
        self.size += _NODE_BYTES
        return header

    def flush(self) -> None:
        if self.current:
            self.chunks.append(_encoder.encode(Chunk(self.partition, self.gen, len(self.chunks), self.current)))
            self.current, self.size = [], 0


_ENTRY = 18  # a 64-bit hash and a float64 with their markers (`_hash_bytes` of an int + 9)


def encode_manifest(manifest: Manifest) -> bytes:
    return _encoder.encode(manifest)


def decode_manifest(data: bytes) -> Manifest:
    return _manifest_decoder.decode(data)


def decode_chunk(data: bytes, native: bool | None = None) -> Chunk[SlotSnap] | Chunk[SlotBytes]:
    """A chunk read back. With the native reader (`native` None: on the native engine) each slot stays its
    bytes (`SlotBytes`), checked whole here, so a broken slot record raises `msgspec.DecodeError`
    saying where, as msgspec does for the rest of the chunk."""
    if native is None:
        native = _native.engine() == "native"
    if not native:
        return _chunk_decoder.decode(data)
    raw = _raw_chunk_decoder.decode(data)
    out: list[NodeSnap[SlotBytes]] = []
    for node in raw.nodes:
        pieces = []
        for i, piece in enumerate(node.slots):
            try:
                group, medium, entries = _native.read_slot_head(piece)
            except ValueError as exc:
                raise msgspec.DecodeError(f"snapshot chunk {raw.partition}/{raw.gen}/{raw.idx}, node {node.node_id!r}, "
                                          f"slot piece {i}: {exc}") from None
            pieces.append(SlotBytes(piece, group, medium, entries))
        out.append(_with_slots(node, pieces))
    return Chunk(raw.partition, raw.gen, raw.idx, out)


def _with_slots(node: NodeSnap[Any], slots: list[S]) -> NodeSnap[S]:
    """`node` with other slot records (every other field as it is)."""
    return msgspec.structs.replace(node, slots=slots)


def import_chunks(index: Index, partition: int, chunks: Sequence[Chunk[SlotSnap] | Chunk[SlotBytes]],
                  max_ts: float = math.inf) -> int:
    """Load a generation's chunks into the index (the partition's old nodes must be dropped
    first); returns the number of blocks loaded. Node times past `max_ts` (the trusted clock plus
    the allowed skew) are clamped to it: a snapshot never brings back a poisoned clock, even one
    written before timestamps were bounded at ingest. Slots read as bytes (`SlotBytes`) go
    straight into a native store."""
    core = _native_core(index, None)
    loaded = 0
    for chunk in chunks:
        for snap in chunk.nodes:
            node = index.nodes.get(snap.node_id)
            if node is None or node.partition != partition:
                node = index.nodes[snap.node_id] = NodeState(snap.node_id, snap.epoch, partition)
                index.generation += 1
                node.seq, node.last_seen, node.suspect, node.reason = snap.seq, min(snap.last_seen, max_ts), snap.suspect, snap.reason
                node.expired, node.group_specs, node.hash_config = snap.expired, snap.group_specs, snap.hash_config
                node.model, node.dp_rank, node.last_offset = snap.model, snap.dp_rank, snap.last_offset
                node.counters.update(snap.counters)
                node.partial_since, node.skew_s, node.expired_at = snap.partial_since, snap.skew_s, min(snap.expired_at, max_ts)
                node.load = snap.load
                if node.expired:
                    index.note_expired(node)
            for piece in snap.slots:
                slot = index.slot(node, piece.group, piece.medium)
                if piece.__class__ is SlotBytes:
                    if core is not None:  # straight from the bytes into the store
                        loaded += core.load_snapshot(slot.sid, piece.raw)
                        continue
                    piece = piece.snap()
                index.add_slot_entries(slot, dict(zip(piece.hashes, piece.stored_ts)), piece.dups)
                loaded += len(piece.hashes)
    return loaded
