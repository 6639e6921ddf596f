"""Byte identity of bridged payloads.

Property: for any batch vLLM's encoder can produce (0.33 map layout with every optional field,
int or bytes hashes, and the <= 0.23 array layout), our structs decode it and re-encode it to the
very same bytes, and the bridge hands the publisher the original bytes. Payloads our encoder would
NOT reproduce (0.32's narrower map header, 0.10's shorter arrays, non-minimal int widths from other
encoders) are still forwarded unchanged — that is why the bridge never re-encodes.
"""
from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.producer.bridge.forwarder import Forwarder
from kvpipe.schemas.codec import LAYOUT_ARRAY, LAYOUT_MAP, decode_vllm_batch, encode_vllm_batch
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.unit.bridge.fakes import ListDeadLetters, RecordingPublisher

u64 = st.integers(0, 2**64 - 1)
hashes = st.one_of(u64, st.binary(min_size=16, max_size=32))
text = st.text(max_size=12)
maybe = lambda s: st.one_of(st.none(), s)  # noqa: E731
ints = st.integers(0, 2**31)
extra_key = maybe(st.tuples(st.one_of(text, ints, st.binary(max_size=8)), st.one_of(text, ints)))


def stored(int_hashes: bool | None):
    h = hashes if int_hashes is None else (u64 if int_hashes else st.binary(min_size=32, max_size=32))
    return st.builds(
        BlockStored,
        block_hashes=st.lists(h, max_size=6),
        parent_block_hash=maybe(h),
        token_ids=st.lists(ints, max_size=64),
        block_size=st.integers(0, 1024),
        lora_id=maybe(ints),
        medium=maybe(st.sampled_from(["GPU", "CPU", "STORAGE"])),
        lora_name=maybe(text),
        extra_keys=maybe(st.lists(extra_key, max_size=6)),
        group_idx=maybe(st.integers(0, 64)),
        kv_cache_spec_kind=maybe(st.sampled_from(["full_attention", "sliding_window", "mamba"])),
        kv_cache_spec_sliding_window=maybe(ints),
        locality=maybe(st.sampled_from(["LOCAL", "REMOTE"])),
        ownership=maybe(text),
        session_id=maybe(text),
        lookahead_token_ids=maybe(st.lists(st.lists(ints, max_size=4), max_size=4)),
    )


def removed(int_hashes: bool | None):
    h = hashes if int_hashes is None else (u64 if int_hashes else st.binary(min_size=32, max_size=32))
    return st.builds(BlockRemoved, block_hashes=st.lists(h, max_size=6), medium=maybe(st.sampled_from(["GPU", "CPU"])),
                     group_idx=maybe(st.integers(0, 64)), locality=maybe(text), ownership=maybe(text))


@st.composite
def batches(draw):
    int_hashes = draw(st.sampled_from([True, False, None]))  # None: mixed, as a fuzzer would
    events = draw(st.lists(st.one_of(stored(int_hashes), removed(int_hashes), st.just(AllBlocksCleared())), max_size=8))
    ts = draw(st.floats(allow_nan=False))
    dp = draw(maybe(st.integers(0, 255)))
    layout = draw(st.sampled_from([LAYOUT_MAP, LAYOUT_ARRAY]))
    return events, ts, dp, layout


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_decode_then_encode_gives_back_the_original_bytes(batch):
    events, ts, dp, layout = batch
    payload = encode_vllm_batch(events, ts, dp, layout)
    decoded, seen_layout = decode_vllm_batch(payload)
    assert seen_layout == layout or not events  # an empty batch has no event to tell the layout by
    assert encode_vllm_batch(decoded.events, decoded.ts, decoded.data_parallel_rank, seen_layout) == payload


@settings(max_examples=100, deadline=None)
@given(st.lists(batches(), min_size=1, max_size=5))
def test_the_bridge_hands_the_publisher_the_original_bytes(items):
    pub = RecordingPublisher()
    fwd = Forwarder("n/dp0", pub, ListDeadLetters())
    payloads = [encode_vllm_batch(*b) for b in items]
    for seq, payload in enumerate(payloads):
        fwd.on_frames([b"", seq.to_bytes(8, "big"), payload])
    assert [s.payload for s in pub.sent] == payloads


def _forward_one(payload: bytes) -> bytes:
    pub = RecordingPublisher()
    Forwarder("n/dp0", pub, ListDeadLetters()).on_frames([b"", bytes(8), payload])
    (sent,) = pub.sent
    return sent.payload


def test_payloads_our_encoder_would_not_reproduce_still_forward_unchanged():
    # vLLM 0.32: BlockStored had 14 fields + tag, so msgspec used a fixmap header (0x8f), not map16.
    v032_event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2],
                  "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}
    v032 = msgspec.msgpack.encode([1.5, [v032_event], 0])
    assert v032[11] == 0x88  # fixmap(8) where 0.33 structs write de 00 08
    # vLLM 0.10: array events with 6 fields; another encoder: hash 7 as uint64 (0xcf) instead of a fixint.
    v010 = msgspec.msgpack.encode([1.5, [["BlockStored", [7], None, [1, 2], 2, None, "GPU"]], 0])
    wide = v010.replace(b"\x91\x07", b"\x91\xcf" + (7).to_bytes(8, "big"))
    for payload in (v032, v010, wide):
        decoded, layout = decode_vllm_batch(payload)
        assert decoded.events[0].block_hashes == [1] or decoded.events[0].block_hashes == [7]
        assert encode_vllm_batch(decoded.events, decoded.ts, decoded.data_parallel_rank, layout) != payload
        assert _forward_one(payload) == payload
