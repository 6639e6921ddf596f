"""The bridge fills the EAGLE flag and the explicit hash unit from its options, refuses a declared
layout vLLM refuses, and does not mistake partial prefix-cache entries for spec mismatches."""
from __future__ import annotations

import pytest

from kvpipe.producer.bridge.cli import main
from kvpipe.producer.bridge.specs import SpecsError, SpecTracker, apply_options
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from kvpipe.schemas.events import BlockStored

FA = GroupSpec(group_idx=0, kind="mla_attention", block_size=64)
MAMBA = GroupSpec(group_idx=1, kind="mamba", block_size=768, mamba_cache_mode="align")


def stored(hashes, group, bs) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=bs, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=group,
                       kv_cache_spec_kind="mamba" if group == 1 else "mla_attention")


def test_options_fill_eagle_and_the_explicit_unit() -> None:
    specs, cfg = apply_options([FA, MAMBA], HashConfig(algorithm="sha256_cbor", hash_block_size=64), [0], 16)
    assert [g.eagle for g in specs] == [True, False]
    assert (cfg.hash_block_size, cfg.prefix_match_unit, cfg.algorithm) == (16, 16, "sha256_cbor")
    with pytest.raises(SpecsError, match="no such declared group"):
        apply_options([FA], None, [3])
    with pytest.raises(SpecsError, match="needs a hash_config"):
        apply_options([FA], None, (), 16)


def test_partial_entries_are_not_spec_mismatches() -> None:
    t = SpecTracker([FA, MAMBA], HashConfig(hash_block_size=16, prefix_match_unit=16), node_id="n")
    t.observe([stored([1, 2], 0, 64), stored([3], 1, 768), stored([4], 1, 16), stored([5], 0, 16)])
    assert t.mismatches == [] and t.specs[1].block_size == 768
    # a real contradiction (several hashes at the unit) still counts
    t.observe([stored([6, 7], 1, 16)])
    assert [(m.group_idx, m.field) for m in t.mismatches] == [(1, "block_size")]


@pytest.mark.parametrize("argv, words", [
    (["--group-spec", "0:full_attention:16", "--group-spec",
      '{"group_idx": 1, "kind": "mamba", "block_size": 64, "mamba_cache_mode": "all"}'], "align"),
    (["--group-spec", "0:full_attention:16", "--group-spec", "1:sliding_window:16:64", "--context-parallel", "2"],
     "context parallelism"),
    (["--group-spec", "0:cross_attention:16"], "no prefix-cacheable"),
    (["--group-spec", "0:full_attention:16", "--eagle-group", "4"], "no such declared group"),
])
def test_bridge_refuses_at_start(argv, words, caplog) -> None:
    assert main(["--zmq", "tcp://127.0.0.1:1", "--node-id", "n", *argv]) == 2
    assert words in caplog.text
