"""Partial entries on the GPU side: the block pool, managers and coordinator key a prompt's last
hash-unit boundary inside a block, emit what vLLM emits (one-unit BlockStored; promotion = the
partial key's BlockRemoved first), serve hits that end between block ends, and accept an explicit
hash unit below the gcd (vllm-semantics §2.5, §3.1-3.2, §4.2-4.3)."""
from __future__ import annotations

import pytest

from kvpipe.gpu.hashing import external_hash
from kvpipe.gpu.kv_cache_manager import KVCacheManager
from kvpipe.gpu.specs import FullAttention, Mamba, SlidingWindow
from kvpipe.schemas.events import BlockRemoved, BlockStored


def brief(events) -> list[tuple]:
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(("S", e.group_idx, e.block_size, len(e.block_hashes), len(e.token_ids)))
        elif isinstance(e, BlockRemoved):
            out.append(("R", e.group_idx))
    return out


def step(m: KVCacheManager, req, n: int, hit: int = 0, blocks=None) -> None:
    assert m.allocate_slots(req, n, hit, blocks) is not None
    req.num_computed_tokens += hit + n


@pytest.fixture
def m() -> KVCacheManager:
    # MLA-like FA at 64 + Mamba align at 128, hashed at an explicit unit of 16 (gcd would be 64)
    return KVCacheManager([FullAttention(64), Mamba(128)], 64, retention=None, prefix_match_unit=16)


def test_explicit_unit_turns_partial_hits_on(m) -> None:
    co = m.coordinator
    assert (co.scheduler_block_size, co.hash_block_size, co.alignment, co.partial_hits) == (128, 16, 16, True)
    # the default unit (gcd 64) is below the Mamba block too: partial hits land on 64
    assert KVCacheManager([FullAttention(64), Mamba(128)], 8).coordinator.alignment == 64
    assert KVCacheManager([FullAttention(64), Mamba(64)], 8).coordinator.alignment == 64
    assert not KVCacheManager([FullAttention(64), Mamba(64)], 8).coordinator.partial_hits
    with pytest.raises(ValueError, match="multiple"):
        KVCacheManager([FullAttention(64), Mamba(128)], 8, prefix_match_unit=24)


def test_prompt_tail_is_keyed_inside_the_block_and_hit_by_a_resend(m) -> None:
    tokens = list(range(1000, 1100))  # 100 tokens: the reusable boundary is 96 (99 floored to 16)
    a = m.make_request("a", tokens)
    assert m.mamba_aligned_chunk(a, 100) == 96  # the chunk stops at the boundary
    step(m, a, 96)
    ev = m.take_events()
    assert brief(ev) == [("S", 0, 64, 1, 64), ("S", 0, 16, 1, 16), ("S", 1, 16, 1, 16)]
    u = [external_hash(h) for h in a.block_hashes]
    fa_partial, mamba_partial = ev[1], ev[2]
    assert fa_partial.block_hashes == [u[5]] and fa_partial.parent_block_hash == u[4]
    assert fa_partial.token_ids == tokens[80:96] and mamba_partial.block_hashes == [u[5]]

    b = m.make_request("b", tokens + [7, 8, 9])
    blocks, hit = m.get_computed_blocks(b)
    assert hit == 96  # the lcm rule (128) would give 0
    assert [len(x) for x in blocks] == [2, 1]
    step(m, b, len(b.all_token_ids) - 96, 96, blocks)
    # b continues in private copies of the shared blocks its hit ends inside (copy on write)
    assert m.coordinator.managers[0].req_to_blocks["b"][1] is not blocks[0][1]
    assert m.coordinator.managers[1].req_to_blocks["b"][0] is not blocks[1][0]


def test_promotion_announces_the_partial_key_removed_first(m) -> None:
    tokens = list(range(2000, 2100))
    a = m.make_request("a", tokens)
    step(m, a, 96)
    m.take_events()
    step(m, a, 4)  # the rest of the prompt
    a.append_tokens(range(28))  # decode up to 128 tokens: FA block 1 fills
    m.take_events()
    step(m, a, 28)
    ev = m.take_events()
    u = [external_hash(h) for h in a.block_hashes]
    fa = [e for e in ev if e.group_idx == 0]
    # promotion: the partial key goes (announced), the full key comes; then, as vLLM's full-attention
    # manager re-keys the prompt tail on every caching call, the partial key returns as an extra key
    assert [type(e).__name__ for e in fa] == ["BlockRemoved", "BlockStored", "BlockStored"]
    assert fa[0].block_hashes == [u[5]] and fa[1].block_hashes == [u[7]] and fa[1].parent_block_hash == u[3]
    assert fa[2].block_hashes == [u[5]] and fa[2].block_size == 16


def test_partial_hits_off_when_a_coarse_sliding_group_cannot_search_units() -> None:
    m = KVCacheManager([FullAttention(16), SlidingWindow(32, 64), Mamba(64)], 64, retention=None)
    assert not m.coordinator.partial_hits and m.coordinator.alignment == 64
    m2 = KVCacheManager([FullAttention(16), SlidingWindow(16, 64), Mamba(64)], 64, retention=None)
    assert m2.coordinator.partial_hits and m2.coordinator.alignment == 16


def test_eviction_removes_every_key_of_a_block() -> None:
    m = KVCacheManager([FullAttention(64), Mamba(128)], 7, retention=None, prefix_match_unit=16)
    a = m.make_request("a", list(range(100)))
    step(m, a, 96)
    m.take_events()
    m.free(a)
    # a new request needs every block: the cached ones are evicted, each key announced once
    c = m.make_request("c", list(range(5000, 5300)))
    step(m, c, 300)
    removed = [e for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert sorted((e.group_idx, e.block_hashes[0]) for e in removed) == sorted(
        [(0, external_hash(a.block_hashes[3])), (0, external_hash(a.block_hashes[5])),
         (1, external_hash(a.block_hashes[5]))])


def test_external_pool_serves_the_partial_hit_or_clips_to_the_lcm() -> None:
    """The store-connector case of upstream's mooncake coordinator tests: a Mamba state inside a
    block gives a fine-grained hit of 48 where the lcm rule clips to 32."""
    from kvpipe.gpu.external_coordinator import ExternalCoordinator

    specs = [FullAttention(16), Mamba(32)]
    h = [bytes([j]) * 8 for j in range(5)]  # unit 16: 80 tokens
    present = {(0, x) for x in h} | {(1, h[1]), (1, h[2])}  # states at 32 (block end) and 48 (partial)
    assert ExternalCoordinator(specs).find_longest_cache_hit(h, 79, present).length == 48
    assert ExternalCoordinator(specs, partial_hits=False).find_longest_cache_hit(h, 79, present).length == 32
