"""Partial prefix-cache entries through the wire and the index: a vLLM batch with one-unit
BlockStored events decodes, is indexed in its group beside whole blocks, and the promotion
sequence (partial key removed first, full key stored, tail re-keyed) leaves exactly the keys the
node holds."""
from __future__ import annotations

import msgspec

from kvpipe.processors.core.index import Index
from kvpipe.schemas.codec import encode_vllm_batch, envelope_events
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import BlockRemoved, BlockStored

SPECS = [GroupSpec(group_idx=0, kind="mla_attention", block_size=64),
         GroupSpec(group_idx=1, kind="mamba", block_size=768, mamba_cache_mode="align")]
CFG = HashConfig(hash_block_size=16, prefix_match_unit=16)


def vllm_batch(events: list) -> msgspec.Raw:
    """The bytes vLLM's encoder produces for these events (map layout, 0.24+)."""
    return msgspec.Raw(encode_vllm_batch(events, 1.0))


def stored(h, g, bs, parent=None, tokens=16) -> BlockStored:
    return BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=list(range(tokens)), block_size=bs,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=g)


def test_partial_entries_decode_and_promotion_leaves_the_held_keys() -> None:
    index = Index()
    step1 = [stored(103, 0, 64, tokens=64), stored(105, 0, 16, parent=104), stored(105, 1, 16, parent=104)]
    step2 = [BlockRemoved(block_hashes=[105], medium="GPU", group_idx=0), stored(107, 0, 64, parent=103, tokens=64),
             stored(105, 0, 16, parent=104)]
    for seq, events in enumerate([step1, step2]):
        env = Envelope(v=SCHEMA_MAJOR, node_id="kimi", epoch=1, seq=seq, ts=1.0 + seq, batch=vllm_batch(events),
                       group_specs=SPECS if seq == 0 else None, hash_config=CFG if seq == 0 else None,
                       num_events=len(events))
        decoded = envelope_events(env)
        assert [type(e).__name__ for e in decoded] == [type(e).__name__ for e in events]
        assert [getattr(e, "block_size", None) for e in decoded] == [getattr(e, "block_size", None) for e in events]
        index.apply(env, decoded, 0, seq)
    node = index.nodes["kimi"]
    assert not node.suspect, node.reason
    assert set(node.slots[(0, "GPU")].blocks) == {103, 107, 105}
    assert set(node.slots[(1, "GPU")].blocks) == {105}
    assert all(node.slots[(0, "GPU")].refcount(h) == 1 for h in (103, 107, 105))
