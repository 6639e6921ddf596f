"""Snapshots written and read by the extension (native/src/snapshot.rs) against the Python walk of
`kvpipe.processors.core.snapshot` (the reference): the native writer produces the reference's bytes
exactly (chunk splitting included), snapshots move between the native and the dict store either
way unchanged, and a broken slot record fails the decode with `msgspec.DecodeError` saying where,
which the restore reports and recovers from (a rebuild from offset 0) as any broken snapshot.
"""
from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.processors.core import durability, native, slots, snapshot
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.processors.core.snapshot import (
    SlotBytes,
    SlotSnap,
    chunk_key,
    decode_chunk,
    export_partition,
    import_chunks,
    manifest_key,
)
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import BlockRemoved, BlockStored
from tests.nativecheck import require_native_core

require_native_core()

# every int width msgpack has, negative ints, bytes (short ones too), and a 64-bit collision of forms
HASHES = st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1), st.integers(-(2**63), -1),
                   st.binary(min_size=0, max_size=40), st.just(b"\x00" * 24 + (7).to_bytes(8, "big")))
SIZES = st.sampled_from([257, 300, 700, 4096, snapshot.CHUNK_BYTES])


@st.composite
def events(draw) -> list:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        group = draw(st.sampled_from([0, 1, 2]))
        medium = draw(st.sampled_from(["GPU", "CPU", "disk/ü", "m" * 40]))
        hashes = draw(st.lists(HASHES, max_size=80))
        if draw(st.integers(0, 4)):
            # repeated hashes: extra copies, which snapshots carry in `dups`
            hashes += draw(st.lists(st.sampled_from(hashes), max_size=5)) if hashes else []
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
                                   lora_id=None, medium=medium, lora_name=None, group_idx=group))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
    return out


@st.composite
def fleet(draw) -> list:
    """Per node: its envelopes' (ts, events) and its partition (1: not part of the export)."""
    nodes = []
    for i in range(draw(st.integers(0, 5))):
        batches = [(100.0 + draw(st.sampled_from([0.0, 0.25, 1.5, 1e9])), draw(events()))
                   for _ in range(draw(st.integers(1, 4)))]
        nodes.append((f"node-{i}", draw(st.sampled_from([0, 0, 1])), batches))
    return nodes


def build(kind: str, nodes: list) -> Index:
    index = Index(store=kind)
    offset = 0
    for node_id, partition, batches in nodes:
        for seq, (ts, evs) in enumerate(batches):
            env = Envelope(v=SCHEMA_MAJOR, node_id=node_id, epoch=1, seq=seq, ts=ts, sent_ts=ts)
            index.apply(env, list(evs), partition, offset)
            offset += 1
    return index


def contents(index: Index, partition: int = 0) -> dict:
    """What a snapshot of the partition must carry: node fields and every slot's entries and copies."""
    out = {}
    for node_id, n in sorted(index.nodes.items()):
        if n.partition != partition:
            continue
        out[node_id] = (n.epoch, n.seq, n.last_seen, n.suspect, n.reason, n.expired, n.last_offset, dict(n.counters),
                        n.partial_since, n.load,
                        {key: (sorted(s.blocks.items()), sorted(dict(s.dups).items()))
                         for key, s in sorted(n.slots.items())})
    return out


def decoded(chunks: list[bytes]) -> list:
    """The reference's reading of chunks: msgspec objects all the way down."""
    return [decode_chunk(c, native=False) for c in chunks]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet(), SIZES)
def test_the_native_writer_produces_the_reference_bytes(nodes, chunk_bytes):
    index = build("native", nodes)
    native = export_partition(index, 0, 7, chunk_bytes=chunk_bytes, native=True)
    reference = export_partition(index, 0, 7, chunk_bytes=chunk_bytes, native=False)
    assert native == reference  # the same chunks, byte for byte, and the same node and block counts
    assert decoded(native[0]) == decoded(reference[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet(), SIZES)
def test_snapshots_move_between_the_stores_either_way(nodes, chunk_bytes):
    for source_kind in slots.STORES:
        source = build(source_kind, nodes)
        chunks, _, blocks = export_partition(source, 0, 3, chunk_bytes=chunk_bytes)
        natively_read = [decode_chunk(c, native=True) for c in chunks]
        assert all(p.__class__ is SlotBytes for c in natively_read for n in c.nodes for p in n.slots)
        # the bytes the native reader kept say what msgspec reads from them
        for fast, ref in zip(natively_read, decoded(chunks)):
            for fn, rn in zip(fast.nodes, ref.nodes):
                assert [p.snap() for p in fn.slots] == rn.slots
                assert [(p.group, p.medium, p.entries) for p in fn.slots] == [
                    (p.group, p.medium, len(p.hashes)) for p in rn.slots]
        for read in (natively_read, decoded(chunks)):
            for target_kind in slots.STORES:
                restored = Index(store=target_kind)
                assert import_chunks(restored, 0, read) == blocks
                assert contents(restored) == contents(source), (source_kind, target_kind)


def slot_records(chunks: list[bytes]) -> list[bytes]:
    return [bytes(p.raw) for c in chunks for n in decode_chunk(c, native=True).nodes for p in n.slots]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet(), st.data())
def test_a_broken_slot_record_is_refused_where_msgspec_refuses_it(nodes, data):
    records = [r for r in slot_records(export_partition(build("native", nodes), 0, 1)[0]) if len(r) > 1]
    if not records:
        return
    record = data.draw(st.sampled_from(records))
    how = data.draw(st.sampled_from(["truncate", "flip", "append"]))
    if how == "truncate":
        broken = record[:data.draw(st.integers(0, len(record) - 1))]
    elif how == "flip":
        at = data.draw(st.integers(0, len(record) - 1))
        broken = record[:at] + bytes([data.draw(st.integers(0, 255))]) + record[at + 1:]
    else:
        broken = record + data.draw(st.binary(min_size=1, max_size=4))
    try:
        ref = msgspec.msgpack.decode(broken, type=SlotSnap)
    except (msgspec.DecodeError, UnicodeDecodeError):  # msgspec reports a bad str with the latter
        ref = None
    try:
        head = native.read_slot_head(broken)
    except ValueError as exc:
        assert str(exc).startswith("snapshot slot record broken at byte ")
        # stricter than msgspec only where a record cannot be one we wrote
        assert ref is None or len(ref.hashes) != len(ref.stored_ts) or any(n > 2**32 - 1 for n in ref.dups.values())
        return
    assert ref is not None, "the native reader accepted bytes msgspec refuses"
    assert head == (ref.group, ref.medium, len(ref.hashes))
    if len({slots.key_of(h) for h in ref.hashes}) != len(ref.hashes):
        return  # one key twice: the reference's dict keeps per hash object the last time, the store per key
    # and loads what msgspec reads
    nat, py = Index(store="native"), Index(store="python")
    env = Envelope(v=SCHEMA_MAJOR, node_id="n", epoch=1, seq=0, ts=1.0, sent_ts=1.0)
    for index in (nat, py):
        index.apply(env.__copy__(), [], 0, 0)
    if ref.group < 0 or ref.group >= 2**64:
        return  # a group the native store cannot hold, whichever way it is read
    slot_n = nat.slot(nat.nodes["n"], ref.group, ref.medium)
    nat.store.core.load_snapshot(slot_n.sid, broken)
    slot_p = py.slot(py.nodes["n"], ref.group, ref.medium)
    py.add_slot_entries(slot_p, dict(zip(ref.hashes, ref.stored_ts)), ref.dups)
    assert sorted(slot_n.blocks.items()) == sorted(slot_p.blocks.items())
    assert sorted(dict(slot_n.dups).items()) == sorted((k, n) for k, n in dict(slot_p.dups).items() if n > 0)


def mistyped(record: bytes) -> bytes:
    """The record with its first store time turned into an 8-byte str: still well-formed msgpack,
    so only reading the slot as a `SlotSnap` finds it broken."""
    at = record.index(b"\xcb")  # hashes below 128 are one byte each: the first 0xcb is a float's marker
    return record[:at] + b"\xa8" + record[at + 1:]


def test_a_broken_slot_in_a_chunk_fails_the_decode_saying_where():
    index = build("native", [("n", 0, [(1.0, [BlockStored(block_hashes=list(range(50)), parent_block_hash=None,
                                                            token_ids=[], block_size=16, lora_id=None, medium="GPU",
                                                            lora_name=None, group_idx=0)])])])
    (chunk,), _, _ = export_partition(index, 0, 5)
    raw = bytes(decode_chunk(chunk, native=True).nodes[0].slots[0].raw)
    broken = chunk.replace(raw, mistyped(raw))
    with pytest.raises(msgspec.DecodeError, match=r"snapshot chunk 0/5/0, node 'n', slot piece 0: snapshot slot "
                                                  r"record broken at byte 62 of 513: a store time must be a float"):
        decode_chunk(broken, native=True)
    with pytest.raises(msgspec.DecodeError):  # the reference refuses it too
        decode_chunk(broken, native=False)
    # malformed msgpack (not just a wrong type) is refused by msgspec while it splits the chunk
    for bad in (chunk.replace(raw, raw[:-3] + b"\xc1\xc1\xc1"), chunk[:-5]):
        with pytest.raises(msgspec.DecodeError):
            decode_chunk(bad, native=True)


def test_a_broken_slot_record_makes_the_restore_rebuild_from_the_log(monkeypatch):
    """The restore's own handling: the error is counted, the partition starts from offset 0, and
    nothing of the broken snapshot is loaded."""
    source = build("native", [("n", 0, [(1.0, [BlockStored(block_hashes=list(range(5000)), parent_block_hash=None,
                                                             token_ids=[], block_size=16, lora_id=None, medium="GPU",
                                                             lora_name=None, group_idx=0)])])])
    chunks, nodes, blocks = export_partition(source, 0, 9, chunk_bytes=4096)
    assert len(chunks) > 3  # one slot split over several chunks
    manifest = snapshot.Manifest(snapshot.FORMAT, "ev", 0, 9, len(chunks), 41, 1.0, 1.0, "p", nodes, blocks)
    records = {chunk_key(0, 9, i): (i, c) for i, c in enumerate(chunks)}
    records[manifest_key(0)] = (len(chunks), snapshot.encode_manifest(manifest))

    async def read(consumer, topic, partition):
        return durability._newest_complete(dict(records), partition)

    async def restore() -> durability.Durability:
        ingest = Ingest(Index(store="native"), 1 << 20)
        d = durability.Durability(ingest, "unused:0", "ev", "snap", "p")
        await d._restore_one(None, 0)
        return d

    monkeypatch.setattr(durability, "read_latest", read)
    d = asyncio.run(restore())
    assert d.stats["restore_errors"] == 0 and d.pending_seek[0] == 42
    assert contents(d.ingest.index) == contents(source)

    last = chunks[-1]
    raw = bytes(decode_chunk(last, native=True).nodes[0].slots[-1].raw)
    records[chunk_key(0, 9, len(chunks) - 1)] = (len(chunks) - 1, last.replace(raw, mistyped(raw)))
    d = asyncio.run(restore())
    assert d.stats["restore_errors"] == 1 and d.pending_seek[0] == 0
    assert d.ingest.index.nodes == {} and d.ingest.index.store.entries() == 0


def test_on_the_python_engine_the_python_walk_writes_and_reads():
    nodes = [("n", 0, [(1.0, [BlockStored(block_hashes=[1, 2, 2, b"xy"], parent_block_hash=None, token_ids=[],
                                          block_size=16, lora_id=None, medium="CPU", lora_name=None, group_idx=1)])])]
    source = build("python", nodes)
    with_native = export_partition(source, 0, 2)
    with native.python_engine("as without the native core"):
        assert export_partition(source, 0, 2) == with_native  # the dict store is always written by the walk
        read = [decode_chunk(c) for c in with_native[0]]
        assert [p.__class__ for c in read for n in c.nodes for p in n.slots] == [SlotSnap]
        restored = Index()  # the store the Python engine makes by default
        assert restored.store.kind == "python"
        assert import_chunks(restored, 0, read) == 3
        with pytest.raises(native.NativeUnavailable, match="as without the native core"):
            decode_chunk(with_native[0][0], native=True)  # the native reader is not there to ask
    assert contents(restored) == contents(source)
    assert [p.__class__ for p in decode_chunk(with_native[0][0]).nodes[0].slots] == [SlotBytes]  # native again


@pytest.mark.parametrize("chunk_bytes", [snapshot.CHUNK_BYTES, 2_000_000])
def test_a_big_slot_with_many_copies_is_written_as_the_reference_writes_it(chunk_bytes):
    """Past 65,535 entries a piece's arrays take msgpack's 32-bit length form; past 15 copies the
    copies' map its 16-bit form."""
    hashes = list(range(2**40, 2**40 + 70_000)) + list(range(2**40, 2**40 + 20))
    nodes = [("n", 0, [(1.0, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
                                          lora_id=None, medium="GPU", lora_name=None, group_idx=0)])])]
    index = build("native", nodes)
    native = export_partition(index, 0, 4, chunk_bytes=chunk_bytes, native=True)
    assert native == export_partition(index, 0, 4, chunk_bytes=chunk_bytes, native=False)
    assert (len(native[0]) == 1) == (chunk_bytes == 2_000_000)
    for kind in slots.STORES:
        restored = Index(store=kind)
        assert import_chunks(restored, 0, [decode_chunk(c) for c in native[0]]) == 70_000
        assert contents(restored) == contents(index)
