"""The spec-kind registry (`kvpipe.gpu.kinds`): every row resolves to working parts, agrees with the
wire rules in `schemas/`, and is what every user dispatches on; the router reads it without loading the
block pool or the CPU tier."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpipe.gpu import kinds
from kvpipe.gpu.block_pool import BlockPool
from kvpipe.gpu.finders import HitRule, find_for_spec, refusal
from kvpipe.gpu.offload_lookup import OffloadGroup
from kvpipe.gpu.retention import reachable_block_mask
from kvpipe.gpu.single_type_managers import SingleTypeManager, make_manager
from kvpipe.gpu.specs import (
    ChunkedLocal,
    CrossAttention,
    FullAttention,
    KVSpec,
    Mamba,
    SinkFullAttention,
    SlidingWindow,
    from_group_spec,
)
from kvpipe.schemas.envelope import KIND_ENCODER_ONLY, KIND_UNKNOWN, KNOWN_KINDS
from kvpipe.schemas.layout import NOT_CACHEABLE

HIT_RULES = Path(__file__).resolve().parents[3] / "native" / "src" / "hit_rules.toml"

# One spec of every row, with its parameters where it has some.
EXAMPLES: dict[str, KVSpec] = {
    s.kind: s for s in (FullAttention(16), SlidingWindow(16, 40), Mamba(32), ChunkedLocal(16, 64), CrossAttention(16),
                        SinkFullAttention(16, 32))
}


def test_every_row_resolves_to_its_parts_and_names_its_own_spec_class() -> None:
    assert set(EXAMPLES) == {k.wire for k in kinds.KINDS}, "an example spec per row"
    for row in kinds.KINDS:
        assert row.spec_class.kind == row.wire
        assert issubclass(row.manager, SingleTypeManager)
        assert row.hit is None or isinstance(row.hit, HitRule)
        assert row.retention is None or callable(row.retention)
        assert kinds.kind_of(EXAMPLES[row.wire]) is row


def test_every_vllm_kind_reads_as_one_row_or_has_no_hit_rule() -> None:
    read = {k for k in KNOWN_KINDS if kinds.read_as(k) is not None}
    assert KNOWN_KINDS - read == {KIND_ENCODER_ONLY, KIND_UNKNOWN}
    aliases = [a for k in kinds.KINDS for a in k.reads]
    assert len(aliases) == len(set(aliases)) and not set(aliases) & {k.wire for k in kinds.KINDS}


def test_the_rows_that_never_hit_are_the_kinds_the_wire_rules_call_not_cacheable() -> None:
    never = {w for k in kinds.KINDS if k.hit is None for w in (k.wire, *k.reads)}
    assert never == set(NOT_CACHEABLE)
    for spec in EXAMPLES.values():
        assert spec.prefix_cacheable == (spec.kind not in NOT_CACHEABLE)


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_each_kind_round_trips_its_wire_form(kind: str) -> None:
    spec = EXAMPLES[kind]
    gs = spec.to_group_spec(3)
    assert (gs.group_idx, gs.kind, gs.block_size) == (3, kind, spec.block_size)
    assert from_group_spec(gs) == spec


def test_the_hit_rules_the_rows_name_have_native_codes_in_the_one_table() -> None:
    codes = tomllib.loads(HIT_RULES.read_text())
    named = {k.hit.name for k in kinds.KINDS if k.hit is not None}
    assert named == set(codes) == {kinds.RULE_FULL, kinds.RULE_SLIDING, kinds.RULE_MAMBA, kinds.RULE_CHUNKED_LOCAL}
    assert len(set(codes.values())) == len(codes) and all(0 <= c <= 255 for c in codes.values())


def test_every_behaviour_dispatches_on_the_row() -> None:
    """Manager, hit finder, retention and offload geometry each follow the spec's row."""
    pool = BlockPool(64, hash_block_size=16)
    for kind, spec in EXAMPLES.items():
        row = kinds.kind_of(spec)
        assert type(make_manager(spec, pool, 0, spec.block_size)) is row.manager
        mask = reachable_block_mask(spec, 0, 8, spec.block_size, retention=0, boundaries=[100])
        assert (mask is None) == (row.retention is None)
        if row.offload is None:
            with pytest.raises(ValueError, match="not offloaded"):
                OffloadGroup.from_spec(0, spec, 1, 16)
        else:
            assert OffloadGroup.from_spec(0, spec, 1, 16).kind == row.offload
        if row.hit is None:
            with pytest.raises(ValueError, match="never take part in prefix caching"):
                find_for_spec(spec, [], 64, spec.block_size, lambda h: True)
        else:
            hashes = [bytes([i]) for i in range(8)]
            assert find_for_spec(spec, hashes, 128, spec.block_size, lambda h: True) == \
                row.hit.find(spec, hashes, 128, spec.block_size, lambda h: True, False)


def test_a_spec_class_without_a_row_is_refused_by_name() -> None:
    @dataclass(frozen=True, slots=True)
    class Unregistered(KVSpec):
        kind = "not_a_kind"

    with pytest.raises(ValueError, match="not_a_kind"):
        kinds.kind_of(Unregistered(16))
    with pytest.raises(ValueError, match="group 2: no manager for Unregistered"):
        make_manager(Unregistered(16), BlockPool(8, hash_block_size=16), 2, 16)


def test_refusals_come_from_the_spec_and_its_rule() -> None:
    assert refusal(FullAttention(16), True, 16) is None
    assert "mode 'align'" in (refusal(Mamba(16, mode="all"), False, 16) or "")
    assert "EAGLE" in (refusal(ChunkedLocal(16, 64), True, 16) or "")
    assert "hits on its block" in (refusal(ChunkedLocal(16, 64), False, 32) or "")
    with pytest.raises(ValueError, match="group 1: Mamba mode 'all'"):
        make_manager(Mamba(16, mode="all"), BlockPool(8, hash_block_size=16), 1, 16)


def test_the_router_reads_the_registry_without_loading_the_block_pool_or_the_cpu_tier() -> None:
    """The rows name managers and offload by module path, resolved on first use: a router process
    that searches hits on every kind never imports the GPU-only modules."""
    code = (
        "import sys\n"
        "from kvpipe.gpu import kinds\n"
        "from kvpipe.gpu.hit import longest_hybrid_hit\n"
        "from kvpipe.processors.router import hits\n"
        "from kvpipe.gpu.specs import FullAttention, SlidingWindow, Mamba, ChunkedLocal, CrossAttention\n"
        "specs = [FullAttention(16), SlidingWindow(16, 40), Mamba(16), ChunkedLocal(16, 64), CrossAttention(16)]\n"
        "h = [bytes([i]) for i in range(8)]\n"
        "longest_hybrid_hit(specs, h, 16, lambda g, x: True, 127)\n"
        "assert all(k.hit is None or k.hit.name for k in kinds.KINDS)\n"
        "print(sorted(m for m in sys.modules if m.startswith('kvpipe.gpu.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    assert {"kvpipe.gpu.hit", "kvpipe.gpu.finders", "kvpipe.gpu.kinds"} <= set(loaded)
    for heavy in ("kvpipe.gpu.block_pool", "kvpipe.gpu.single_type_managers", "kvpipe.gpu.cpu_tier",
                  "kvpipe.gpu.offload_lookup"):
        assert heavy not in loaded
