"""Declared group specs against what vLLM stamps on its events."""
from __future__ import annotations

import json

import pytest

from kvpipe.producer.bridge.specs import SpecsError, SpecTracker, load_specs_file, parse_group_spec
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from kvpipe.schemas.events import BlockRemoved, BlockStored


def stored(group=0, kind="full_attention", window=None, block_size=16, h=1, medium="GPU"):
    return BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=block_size, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group, kv_cache_spec_kind=kind,
                       kv_cache_spec_sliding_window=window)


def test_group_spec_option_forms():
    assert parse_group_spec("1:sliding_window:16:4096") == GroupSpec(1, "sliding_window", 16, 4096)
    assert parse_group_spec('{"group_idx": 2, "kind": "mamba", "block_size": 64, "mamba_cache_mode": "align"}').mamba_cache_mode == "align"
    for bad in ("0:full_attention", "0:nonsense:16", "0:full_attention:0", "x:full_attention:16"):
        with pytest.raises(SpecsError):
            parse_group_spec(bad)


def test_specs_file(tmp_path):
    f = tmp_path / "specs.json"
    f.write_text(json.dumps({"group_specs": [{"group_idx": 0, "kind": "full_attention", "block_size": 16}],
                             "hash_config": {"algorithm": "xxhash", "hash_block_size": 16}, "model": "m"}))
    specs = load_specs_file(f)
    assert specs.model == "m" and specs.hash_config.algorithm == "xxhash" and specs.group_specs[0].block_size == 16
    f.write_text(json.dumps([{"group_idx": 0, "kind": "full_attention", "block_size": 16}] * 2))
    with pytest.raises(SpecsError, match="repeated"):
        load_specs_file(f)


def test_matching_events_change_nothing():
    t = SpecTracker([GroupSpec(0, "full_attention", 16), GroupSpec(1, "sliding_window", 16, 128)])
    assert not t.observe([stored(), stored(1, "sliding_window", 128), BlockRemoved([1], "GPU", 0)])
    assert t.mismatches == []


def test_a_contradicted_declaration_is_reported_once_and_corrected():
    t = SpecTracker([GroupSpec(0, "full_attention", 16)])
    assert t.observe([stored(block_size=32, h=1)])
    assert not t.observe([stored(block_size=32, h=2)] * 100)
    assert [(m.group_idx, m.field, m.declared, m.observed) for m in t.mismatches] == [(0, "block_size", "16", "32")]
    assert t.group_specs() == [GroupSpec(0, "full_attention", 32)]


def test_an_undeclared_group_is_a_mismatch_when_specs_were_declared():
    t = SpecTracker([GroupSpec(0, "full_attention", 16)])
    t.observe([stored(group=1, kind="mamba", block_size=64)])
    assert [m.field for m in t.mismatches] == ["group"]
    assert [g.group_idx for g in t.group_specs()] == [0, 1]


def test_without_declarations_specs_are_learned_silently():
    t = SpecTracker()
    assert t.observe([stored(), stored(1, "sliding_window", 512, 16)])
    assert t.mismatches == [] and t.group_specs()[1].sliding_window == 512
    assert t.hash_config is None  # the events do not say which algorithm: nothing invented


def test_offload_placeholders_and_old_events_teach_nothing_wrong():
    t = SpecTracker([GroupSpec(0, "sliding_window", 16, 128)])
    t.observe([stored(kind=None, block_size=0, medium="CPU")])  # offload placeholder
    t.observe([stored(kind=None, window=None, block_size=16)])  # vLLM < 0.22: no spec stamped
    assert t.mismatches == [] and t.group_specs() == [GroupSpec(0, "sliding_window", 16, 128)]


def test_hash_type_is_checked_against_a_declared_hash_config():
    t = SpecTracker([], HashConfig(int_hashes=True))
    assert t.observe([stored(h=b"\x00" * 32)])
    assert t.hash_config.int_hashes is False and t.mismatches[0].field == "int_hashes"
