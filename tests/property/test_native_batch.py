"""The native batch reader (native/src/batch.rs, `slots.parse_batch`) against the reference decoder
(`kvpipe.schemas.codec.decode_vllm_batch`): on random batches, well-formed and broken (bytes flipped, cut,
appended; unknown fields, negative groups, nested extra keys, odd types), whatever the native
reader accepts the reference reads to the same events, and whatever the reference refuses the
native reader leaves to it. Then whole streams through `Ingest` with and without the native reader
give equal outcomes, DLQ reasons, counters and index.
"""
from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.processors.core import slots
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.schemas.codec import KAFKA_HEADERS, DecodeError, decode_vllm_batch, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.nativecheck import require_native_core

require_native_core()

HASH = st.one_of(st.integers(0, 2**64 - 1), st.integers(-2**63, -1), st.binary(max_size=40))
MEDIUM = st.sampled_from([None, "GPU", "CPU", "", "disk"])


@st.composite
def event(draw):
    kind = draw(st.integers(0, 6))
    group = draw(st.one_of(st.none(), st.integers(0, 5)))
    if kind == 0:
        return AllBlocksCleared()
    if kind <= 3:
        return BlockStored(block_hashes=draw(st.lists(HASH, max_size=5)), parent_block_hash=draw(st.none() | HASH),
                           token_ids=draw(st.lists(st.integers(0, 2**32), max_size=4)),
                           block_size=draw(st.integers(1, 64)), lora_id=draw(st.none() | st.integers(0, 3)),
                           medium=draw(MEDIUM), lora_name=draw(st.none() | st.text(max_size=4)), group_idx=group,
                           kv_cache_spec_kind=draw(st.none() | st.sampled_from(["full_attention", "sliding_window"])),
                           extra_keys=draw(st.sampled_from([None, None, [None], [("lora", 1)]])))
    return BlockRemoved(block_hashes=draw(st.lists(HASH, max_size=5)), medium=draw(MEDIUM), group_idx=group)


def raw_event(draw) -> dict:
    """An event written as a plain map, to reach shapes the structs cannot encode."""
    base = {"type": draw(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])),
            "block_hashes": draw(st.lists(HASH, max_size=3)), "medium": draw(MEDIUM)}
    if base["type"] == "BlockStored":
        base.update(parent_block_hash=None, token_ids=[1, 2], block_size=16, lora_id=None, lora_name=None)
    extra = draw(st.sampled_from([{}, {"group_idx": -1}, {"group_idx": 1.5}, {"unknown": 1}, {"block_size": True},
                                  {"token_ids": [1.0]}, {"medium": 3}, {"block_hashes": ["text"]},
                                  {"lookahead_token_ids": [[1]]}, {"group_idx": 2**63}]))
    base.update(extra)
    if draw(st.booleans()):  # the tag elsewhere than first
        tag = base.pop("type")
        base["type"] = tag
    return base


@st.composite
def payload(draw) -> bytes:
    events = draw(st.lists(event(), max_size=6))
    data = encode_vllm_batch(events, draw(st.floats(0, 2e9)), draw(st.none() | st.integers(0, 3)))
    how = draw(st.integers(0, 9))
    if how == 0:  # a raw map among the events
        raw = msgspec.msgpack.decode(data)
        raw[1].insert(draw(st.integers(0, len(raw[1]))), raw_event(draw))
        data = msgspec.msgpack.encode(raw)
    elif how == 1 and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([draw(st.integers(0, 255))]) + data[i + 1:]
    elif how == 2:
        data = data[:draw(st.integers(0, len(data)))]
    elif how == 3:
        data = data + draw(st.binary(min_size=1, max_size=3))
    return data


def reference(data: bytes):
    try:
        return decode_vllm_batch(data, 1 << 20, "map")[0].events
    except DecodeError:
        return None


def as_tuples(events) -> list[tuple]:
    out = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            out.append((2, [], None, None))
        else:
            out.append((0 if isinstance(ev, BlockStored) else 1, [slots.key_of(h) for h in ev.block_hashes],
                        ev.group_idx, ev.medium or None))
    return out


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(payload())
def test_native_reader_accepts_only_what_the_reference_reads_the_same(data):
    native = slots.parse_batch(data)
    ref = reference(data)
    if native is None:
        return
    assert ref is not None, "the native reader accepted a batch the reference refuses"
    if any((ev.group_idx or 0) < 0 for ev in ref if not isinstance(ev, AllBlocksCleared)):
        pytest.fail("the native reader accepted a negative group (the ingest check refuses it)")
    assert [native.event(i) for i in range(len(native))] == as_tuples(ref)


def test_the_common_batch_is_read_natively():
    events = [BlockStored(block_hashes=[1, b"\x00" * 24 + b"\x01" * 8], parent_block_hash=None, token_ids=[1] * 16,
                          block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=1),
              BlockRemoved(block_hashes=[1], medium=None, group_idx=None), AllBlocksCleared()]
    native = slots.parse_batch(encode_vllm_batch(events, 5.0))
    assert native is not None and len(native) == 3 and native.blocks() == 3
    assert native.event(0) == (0, [1, 0x0101010101010101], 1, "GPU")
    assert native.event(1) == (1, [1], None, None)


@st.composite
def stream(draw):
    out = []
    seqs: dict[str, int] = {}
    for _ in range(draw(st.integers(1, 25))):
        node = draw(st.sampled_from(["a", "b"]))
        seq = seqs.get(node, 0) + draw(st.sampled_from([1, 1, 1, 0, 2])) if node in seqs else 0
        seqs[node] = seq
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=100.0 + len(out), sent_ts=100.0 + len(out),
                       batch=msgspec.Raw(draw(payload())), num_events=1)
        out.append(encode_envelope(env))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream())
def test_ingest_with_the_native_reader_equals_the_reference(messages):
    runs = []
    for native in (True, False):
        ingest = Ingest(Index(store="native", lifetimes=not native), 1 << 20, native_batches=native)
        outcomes = []
        for offset, data in enumerate(messages):
            r = ingest.handle(data, KAFKA_HEADERS, 0, offset, 200.0)
            outcomes.append((r.outcome, r.error.kind if r.error else None, r.error.message if r.error else None))
        index = ingest.index
        state = {n: (s.seq, s.suspect, s.reason, dict(s.counters),
                     {k: (sorted(sl.blocks.items()), sorted(dict(sl.dups).items())) for k, sl in sorted(s.slots.items())})
                 for n, s in sorted(index.nodes.items())}
        runs.append((outcomes, dict(ingest.counters), ingest.dlq_by_reason, dict(index.counters), state, index.ended))
    assert runs[0] == runs[1]
