"""Sink full attention (vLLM's `SinkFullAttentionSpec`, docs/vllm-behaviour.md §4.3), the kind added through
the spec-kind registry: full attention behind static sink KV that lives outside the requests' blocks. Its
manager, hit, retention and offload are full attention's; its wire form and spec group are its own."""
from __future__ import annotations

import random

import msgspec
import pytest

from kvpipe.gpu.external_coordinator import ExternalCoordinator, validate_external_config
from kvpipe.gpu.hashing import BlockHasher, external_hash
from kvpipe.gpu.hit import longest_hybrid_hit, split_spec_groups
from kvpipe.gpu.kv_cache_manager import KVCacheManager
from kvpipe.gpu.layout import layout_problem, node_layout
from kvpipe.gpu.offload_lookup import FULL, OffloadGroup, load_plan, lookup_hit_tokens
from kvpipe.gpu.cpu_tier import LookupResult
from kvpipe.gpu.single_type_managers import FullAttentionManager
from kvpipe.gpu.specs import FullAttention, Mamba, SinkFullAttention, SlidingWindow, from_group_spec
from kvpipe.schemas.codec import decode_envelope, encode_envelope
from kvpipe.schemas.envelope import KIND_SINK_FULL, SCHEMA_MAJOR, Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import BlockStored
from kvpipe.schemas.groupspec import GRAMMAR, format_groups, parse_groups

HASHER = BlockHasher("sha256", env={})
SINK = SinkFullAttention(16, sink_len=32)


@pytest.mark.parametrize("sink_len", [16, 32, 160, None])
def test_a_sink_that_fills_whole_blocks_or_is_not_declared_is_accepted(sink_len) -> None:
    assert SinkFullAttention(16, sink_len).sink_len == sink_len


@pytest.mark.parametrize("sink_len", [0, -16, 8, 24])
def test_a_sink_that_does_not_fill_whole_blocks_is_refused_as_vllm_asserts(sink_len) -> None:
    with pytest.raises(ValueError, match="sink_len must be a positive multiple of block_size 16"):
        SinkFullAttention(16, sink_len)


def test_a_sink_group_round_trips_the_grammar_the_envelope_and_the_spec() -> None:
    assert "SINK_LEN" in GRAMMAR
    groups = parse_groups("sink:16:32,swa:16:64")
    assert groups[0] == GroupSpec(group_idx=0, kind=KIND_SINK_FULL, block_size=16, sink_len=32)
    assert format_groups(groups) == "sink_full_attention:16:32,sliding_window:16:64"
    assert parse_groups("sink_full_attention:16")[0].sink_len is None  # as a bridge declares a vLLM node
    env = Envelope(v=SCHEMA_MAJOR, node_id="n", epoch=1, seq=0, ts=1.0, group_specs=groups,
                   hash_config=HashConfig(hash_block_size=16))
    back = decode_envelope(encode_envelope(env))
    assert back.group_specs == groups
    assert from_group_spec(back.group_specs[0]) == SINK
    assert SINK.to_group_spec(0) == groups[0]
    # a group without a sink is written without the key (older readers see nothing new)
    plain = msgspec.msgpack.decode(encode_envelope(msgspec.structs.replace(env, group_specs=[groups[1]])))
    assert "sink_len" not in plain["group_specs"][0]


def test_the_node_publishes_the_sink_kind_on_its_specs_and_its_events() -> None:
    m = KVCacheManager([SINK, SlidingWindow(16, 32)], 40, hasher=HASHER, retention=0)
    assert [(g.kind, g.sink_len) for g in m.group_specs()] == [(KIND_SINK_FULL, 32), ("sliding_window", None)]
    r = m.make_request("0", list(range(64)))
    m.allocate_slots(r, 64)
    events = [e for e in m.take_events() if isinstance(e, BlockStored)]
    assert {e.group_idx: e.kv_cache_spec_kind for e in events} == {0: KIND_SINK_FULL, 1: "sliding_window"}


def test_a_sink_group_keeps_every_block_like_full_attention() -> None:
    """Manager and retention: full attention's (no early freeing, every full block cached)."""
    m = KVCacheManager([SINK, SlidingWindow(16, 16)], 40, hasher=HASHER, retention=0)
    assert type(m.coordinator.managers[0]) is FullAttentionManager
    r = m.make_request("0", list(range(128)))
    m.allocate_slots(r, 128)
    stored = {e.group_idx: e.block_hashes for e in m.take_events() if isinstance(e, BlockStored)}
    fine = [external_hash(h) for h in r.block_hashes]
    assert stored[0] == fine  # all eight blocks; the window keeps only its reachable tail
    assert [fine.index(h) for h in stored[1]] == [6]


def _replay(specs, prompts, probe) -> list:
    """Hit, block tables and stored hashes per group, serving `prompts` then asking for `probe`."""
    m = KVCacheManager(specs, 60, hasher=HASHER, retention=0)
    for i, p in enumerate(prompts):
        r = m.make_request(str(i), p)
        blocks, hit = m.get_computed_blocks(r)
        while r.num_computed_tokens < r.num_tokens:  # prefill chunks ending where Mamba states are kept
            n = m.mamba_aligned_chunk(r, r.num_tokens - r.num_computed_tokens - hit, hit)
            m.allocate_slots(r, n, hit, blocks)
            r.num_computed_tokens += hit + n
            blocks, hit = None, 0
        m.free(r)
    events = [(e.group_idx, e.block_hashes) for e in m.take_events() if isinstance(e, BlockStored)]
    req = m.make_request("probe", probe)
    blocks, hit = m.get_computed_blocks(req)
    return [hit, [[b.block_id for b in g] for g in blocks], events]


@pytest.mark.parametrize("other", [SlidingWindow(16, 32), Mamba(16), FullAttention(16)])
def test_a_node_with_a_sink_group_serves_the_hits_a_full_attention_node_serves(other) -> None:
    common = list(range(80))
    prompts = [common + [500 + i] * 9 for i in range(3)] + [list(range(200, 250))]
    probe = common + [777] * 20
    assert _replay([SINK, other], prompts, probe) == _replay([FullAttention(16), other], prompts, probe)


def test_a_sink_group_is_its_own_spec_group_searched_first_with_the_full_attention_rule() -> None:
    sgs = split_spec_groups([SlidingWindow(16, 32), SINK, FullAttention(16), SINK])
    assert [(sg.spec, sg.group_ids) for sg in sgs] == [
        (SINK, (1, 3)), (FullAttention(16), (2,)), (SlidingWindow(16, 32), (0,))]
    assert sgs[0].rule is sgs[1].rule and sgs[0].rule.prefix


def test_the_sink_hit_equals_the_full_attention_hit_on_random_caches() -> None:
    """Same cached sets, the sink in place of full attention: same hit and masks, partial hits included
    (a Mamba block above the hash unit turns them on; the sink searches hash units as full attention does)."""
    rng = random.Random(7)
    hashes = [bytes([i]) for i in range(24)]
    layouts = [([SINK, SlidingWindow(16, 40)], 16), ([SinkFullAttention(64, 64), Mamba(64)], 16)]
    for specs, unit in layouts:
        full = [FullAttention(s.block_size) if isinstance(s, SinkFullAttention) else s for s in specs]
        for _ in range(200):
            cached = [{h for h in hashes if rng.random() < 0.8} for _ in specs]
            cap = rng.randrange(0, 24 * unit)
            eagle = {0} if rng.random() < 0.3 else set()
            got = longest_hybrid_hit(specs, hashes, unit, cached, cap, eagle_groups=eagle)
            assert got == longest_hybrid_hit(full, hashes, unit, cached, cap, eagle_groups=eagle)


def test_the_cpu_tier_offloads_a_sink_group_as_a_prefix() -> None:
    group = OffloadGroup.from_spec(0, SINK, blocks_per_chunk=2, hash_block_size=16)
    assert group == OffloadGroup.from_spec(0, FullAttention(16), 2, 16) and group.kind == FULL
    keys = [[("k", i) for i in range(6)]]
    held = {("k", i) for i in (0, 1, 2, 4)}

    def lookup(key) -> LookupResult:
        return LookupResult.HIT if key in held else LookupResult.MISS

    assert lookup_hit_tokens([group], keys, lookup, 0, 6 * 32) == 3 * 32  # stops at the first missing chunk
    assert load_plan(group, 32, 96).first_block == 2  # loads everything past the GPU hit


def test_an_external_pool_stores_and_loads_every_sink_block() -> None:
    validate_external_config([SINK, SlidingWindow(16, 32)])
    co = ExternalCoordinator([SINK, SlidingWindow(16, 32)], retention=0)
    sink_mask, window_mask = co.store_masks(64, num_prompt_tokens=64)
    assert sink_mask is None and window_mask is not None and not all(window_mask)
    assert co.load_masks([bytes([i]) for i in range(4)], 64)[0] == [True] * 4


def test_the_router_reads_a_published_sink_layout_and_refuses_a_sink_off_the_blocks() -> None:
    cfg = HashConfig(hash_block_size=16)
    published = [GroupSpec(group_idx=0, kind=KIND_SINK_FULL, block_size=16, sink_len=32),
                 GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=32)]
    assert node_layout(published, cfg).specs == (SINK, SlidingWindow(16, 32))
    unknown_sink = [msgspec.structs.replace(published[0], sink_len=None), published[1]]
    assert node_layout(unknown_sink, cfg).specs[0] == SinkFullAttention(16)
    bad = [msgspec.structs.replace(published[0], sink_len=24), published[1]]
    assert "sink_len must be a positive multiple of block_size 16" in (layout_problem(bad, cfg) or "")
