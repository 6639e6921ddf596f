"""Our event structs produce the exact bytes vLLM 0.33's encoder produces, and decode them back.

The hex vectors in vllm_0_33_batches.json were produced by vLLM 0.33.0's own struct definitions
(distributed/kv_events.py) encoded with msgspec 0.22; the cases below rebuild the same batches with
our structs. A field added, renamed, reordered or given another default breaks these tests.
"""
import json
from pathlib import Path

import msgspec
import pytest

from kvpipe.schemas.codec import LAYOUT_ARRAY, LAYOUT_MAP, decode_vllm_batch, detect_layout, encode_vllm_batch
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

GOLDEN = json.loads((Path(__file__).parent / "vllm_0_33_batches.json").read_text())


def _stored(**kw):
    base = dict(parent_block_hash=None, lora_id=None, lora_name=None)
    base.update(kw)
    return BlockStored(**base)


CASES = {
    "spec_1_2_example": KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
        _stored(block_hashes=[1, 2], token_ids=list(range(1, 9)), block_size=4, medium="GPU", group_idx=0,
                kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[2], medium="GPU", group_idx=0),
        AllBlocksCleared()]),
    "gpu_store_extra_keys_none": KVEventBatch(ts=1700000000.25, data_parallel_rank=0, events=[
        _stored(block_hashes=[10429158316690216413, 5745192707610611011], token_ids=list(range(8)), block_size=4,
                medium="GPU", extra_keys=[None, None], group_idx=1, kv_cache_spec_kind="sliding_window",
                kv_cache_spec_sliding_window=8)]),
    "all_optional_fields": KVEventBatch(ts=2.0, data_parallel_rank=2, events=[
        BlockStored(block_hashes=[2**64 - 1, 0, 127, 128, 2**32], parent_block_hash=2**63, token_ids=list(range(1, 21)),
                    block_size=4, lora_id=42, medium="CPU", lora_name="adapter",
                    extra_keys=[("adapter",), ("adapter", ("hash1", 2)), None, None, ("adapter", "salt")], group_idx=3,
                    kv_cache_spec_kind="mamba", kv_cache_spec_sliding_window=None, locality="REMOTE", ownership="kvcr",
                    session_id="sess-1", lookahead_token_ids=[[1], [2], [3], [4], [5]]),
        BlockRemoved(block_hashes=[5, 6], medium="CPU", group_idx=3, locality="LOCAL", ownership="kvcr")]),
    "bytes_hashes": KVEventBatch(ts=3.0, data_parallel_rank=1, events=[
        _stored(block_hashes=[bytes(range(32))], parent_block_hash=bytes(range(32, 64)), token_ids=[0, 1, 2, 3],
                block_size=4, medium="GPU", extra_keys=[None], group_idx=0, kv_cache_spec_kind="full_attention"),
        BlockRemoved(block_hashes=[bytes(range(32))], medium=None)]),
    "cpu_placeholder": KVEventBatch(ts=4.0, data_parallel_rank=0, events=[
        _stored(block_hashes=[77], token_ids=[], block_size=0, medium="CPU", group_idx=2)]),
    "empty_batch_dp_none": KVEventBatch(ts=5.0, events=[]),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_our_structs_encode_to_vllm_bytes(name):
    assert msgspec.msgpack.encode(CASES[name]).hex() == GOLDEN[name]


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_vllm_bytes_decode_to_the_same_events_and_reencode_identically(name):
    payload = bytes.fromhex(GOLDEN[name])
    batch, layout = decode_vllm_batch(payload)
    assert layout == LAYOUT_MAP
    # nested tuples inside extra_keys come back as lists (typed Any), so compare plain values
    plain = lambda b: msgspec.json.decode(msgspec.json.encode(b))  # noqa: E731
    assert plain(batch) == plain(CASES[name])
    assert encode_vllm_batch(batch.events, batch.ts, batch.data_parallel_rank) == payload


def test_block_stored_of_0_33_always_uses_a_map16_header():
    # 15 fields + tag: msgspec sizes the header from the possible entries, so even a minimal event is map16.
    payload = bytes.fromhex(GOLDEN["cpu_placeholder"])
    assert payload[11:14] == bytes([0xDE, 0x00, 0x09])  # type + 7 required + group_idx


def test_event_map_starts_with_type_tag_and_keeps_required_nil_fields():
    generic = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["spec_1_2_example"]))
    stored, removed, cleared = generic[1]
    assert list(stored)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                "medium", "lora_name"]
    assert stored["parent_block_hash"] is None and stored["lora_id"] is None
    assert removed == {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


def test_legacy_array_layout_is_detected_and_decoded():
    # vLLM <= 0.23 wrote every event as [tag, fields...] with all declared fields present; build such a
    # payload with a generic encoder (not our structs) so the test is independent of them.
    legacy = [2.5, [
        ["BlockStored", [11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None, [None, None], 1,
         "sliding_window", 8],
        ["BlockRemoved", [11], "GPU", 1],
        ["AllBlocksCleared"],
    ], 0]
    payload = msgspec.msgpack.encode(legacy)
    assert detect_layout(payload) == LAYOUT_ARRAY
    batch, layout = decode_vllm_batch(payload)
    assert layout == LAYOUT_ARRAY
    stored, removed, cleared = batch.events
    assert stored.block_hashes == [11, 12] and stored.group_idx == 1 and stored.kv_cache_spec_sliding_window == 8
    assert removed == BlockRemoved(block_hashes=[11], medium="GPU", group_idx=1)
    assert isinstance(cleared, AllBlocksCleared)
    # and our legacy encoder writes that very layout back
    assert encode_vllm_batch(batch.events, 2.5, 0, layout=LAYOUT_ARRAY) == payload


def test_oldest_array_layout_without_group_fields_decodes_with_defaults():
    # vLLM 0.10-0.13: [tag, hashes, parent, token_ids, block_size, lora_id, medium]
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [5], 4, [9, 9, 9, 9], 4, None, "GPU"]], None])
    batch, layout = decode_vllm_batch(payload)
    assert layout == LAYOUT_ARRAY
    assert batch.events[0].parent_block_hash == 4 and batch.events[0].group_idx is None
