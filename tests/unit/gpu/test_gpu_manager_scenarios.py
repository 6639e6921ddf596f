"""Scheduler-level scenarios of the hybrid manager: hits, early freeing, retention, events."""
from __future__ import annotations

import pytest

from kvpipe.gpu.block_pool import BlockPool
from kvpipe.gpu.hashing import BlockHasher, external_hash, group_key
from kvpipe.gpu.kv_cache_manager import KVCacheManager
from kvpipe.gpu.retention import reachable_block_mask
from kvpipe.gpu.single_type_managers import SlidingWindowManager
from kvpipe.gpu.specs import FullAttention, Mamba, SlidingWindow
from kvpipe.schemas.events import BlockStored

HASHER = BlockHasher("sha256", env={})


def step(m: KVCacheManager, req, n: int, first: bool = False):
    """One scheduler step for `req` computing `n` new tokens (looks up hits on the first)."""
    blocks, hit = m.get_computed_blocks(req) if first else (None, 0)
    out = m.allocate_slots(req, n, hit, blocks)
    assert out is not None
    req.num_computed_tokens += hit + n
    return hit, blocks


def stored(events, group: int) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored) and e.group_idx == group]


def bids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# --- full attention + two sliding-window groups (bs 16, window 32) -------------------------------

def test_hybrid_prefill_reuses_the_window_tail_and_survives_evictions() -> None:
    m = KVCacheManager([FullAttention(16), SlidingWindow(16, 32), SlidingWindow(16, 32)], 21,
                       hasher=HASHER, retention=None)
    common = [i for i in range(3) for _ in range(16)]
    r0 = m.make_request("0", common + [3] * 7)
    step(m, r0, 55, first=True)
    assert tuple(bids(g) for g in m.coordinator.block_table("0")) == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    r1 = m.make_request("1", common + [3] * 5)
    blocks, hit = m.get_computed_blocks(r1)
    assert hit == 48
    assert tuple(bids(g) for g in blocks) == ([1, 2, 3], [0, 6, 7], [0, 10, 11])
    new = m.allocate_slots(r1, 5, hit, blocks)
    assert tuple(bids(g) for g in new) == ([13], [14], [15])
    assert all(b.ref_cnt == 2 for g in blocks for b in g if not b.is_null)
    hashes = r1.block_hashes
    m.free(r0)
    m.free(r1)

    def hit_without(evicted: list[tuple[int, int]]) -> int:
        """Hit (in blocks) of a new request sharing the 48-token prefix, with some (block, group)
        entries hidden from the cache for the duration of the lookup."""
        saved = {group_key(hashes[b], g): m.pool.cached.pop(group_key(hashes[b], g)) for b, g in evicted}
        req = m.make_request("x", common + [4] * 5)
        got, n = m.get_computed_blocks(req)
        assert all(len(g) == n // 16 for g in got)
        m.pool.cached.update(saved)
        return n // 16

    assert hit_without([(0, 1), (0, 2)]) == 3  # outside the window: irrelevant
    assert hit_without([(0, 0)]) == 0  # first full-attention block gone: total miss
    assert hit_without([(2, 0), (2, 1), (2, 2)]) == 2
    assert hit_without([(2, 0)]) == 2
    assert hit_without([(2, 1)]) == 2
    assert hit_without([(2, 2)]) == 2
    # FA holds blocks 0-1 only (hit 32); the windows then need blocks 0-1 and lack 0: no agreement.
    assert hit_without([(2, 0), (0, 1), (0, 2)]) == 0


@pytest.mark.parametrize("specs", [
    [FullAttention(16), SlidingWindow(16, 32)],
    [FullAttention(16), Mamba(16)],
    [SlidingWindow(16, 32), Mamba(16)],
    [FullAttention(16), SlidingWindow(16, 32), SlidingWindow(16, 64), Mamba(16)],
])
def test_shared_48_token_prefix_hits_in_every_group_combination(specs) -> None:
    m = KVCacheManager(specs, 100, hasher=HASHER, retention=None)
    prefix = list(range(48))
    r0 = m.make_request("0", prefix + [900] * 7)
    first = True
    while r0.num_computed_tokens < r0.num_tokens:
        n = m.mamba_aligned_chunk(r0, r0.num_tokens - r0.num_computed_tokens)
        step(m, r0, n, first)
        first = False
    m.free(r0)
    r1 = m.make_request("1", prefix + [901] * 9)
    assert m.get_computed_blocks(r1)[1] == 48


# --- early freeing: window 4, block 2 -----------------------------------------------------------

@pytest.mark.parametrize("processed, nulled", [(4, []), (5, [0]), (6, [0]), (7, [0, 1]), (11, [0, 1, 2, 3])])
def test_sliding_window_frees_blocks_that_left_the_window(processed, nulled) -> None:
    pool = BlockPool(20, 2)
    mgr = SlidingWindowManager(SlidingWindow(2, 4), pool, 0, alignment=2)
    mgr.allocate_new_blocks("r", 12)
    table = list(mgr.req_to_blocks["r"])
    mgr.remove_skipped_blocks("r", processed)
    assert [i for i, b in enumerate(mgr.req_to_blocks["r"]) if b.is_null] == nulled
    # the highest freed block went back first, so it is reused first
    freed = [table[i].block_id for i in reversed(nulled)]
    assert pool.free_queue.block_ids()[: len(freed)] == freed


# --- retention: which window blocks are cached at all -------------------------------------------

@pytest.mark.parametrize("retention, expect", [(64, {3, 7, 11, 14, 15}), (0, {14}), (None, set(range(16)))])
def test_pure_window_model_retains_only_reachable_tails_yet_replay_hits(retention, expect) -> None:
    m = KVCacheManager([SlidingWindow(16, 16)], 40, hasher=HASHER, retention=retention)
    r = m.make_request("0", list(range(256)))
    step(m, r, 256, first=True)
    (ev,) = m.take_events()
    kept = {r.block_hashes.index(h) for h in r.block_hashes if external_hash(h) in ev.block_hashes}
    assert kept == expect
    assert len(ev.token_ids) == 256  # skipped blocks still count in the token range
    m.free(r)
    assert m.get_computed_blocks(m.make_request("1", list(range(256))))[1] == 240


def test_window_group_next_to_coarser_full_attention_keeps_only_segment_tails() -> None:
    m = KVCacheManager([FullAttention(32), SlidingWindow(8, 8)], 40, hasher=HASHER, retention=None)
    r = m.make_request("0", list(range(64)))
    step(m, r, 64, first=True)
    swa = stored(m.take_events(), 1)[0]
    fine = [external_hash(h) for h in r.block_hashes]
    assert [fine.index(h) for h in swa.block_hashes] == [3, 7]


def test_hybrid_caching_is_clamped_to_the_scheduler_block() -> None:
    m = KVCacheManager([FullAttention(32), SlidingWindow(16, 32)], 40, hasher=HASHER, retention=None)
    r = m.make_request("0", list(range(112)))
    step(m, r, 112, first=True)
    events = m.take_events()
    fine = [external_hash(h) for h in r.block_hashes]
    assert [fine.index(h) for h in stored(events, 1)[0].block_hashes] == [0, 1, 2, 3, 4, 5]
    assert len(stored(events, 0)[0].block_hashes) == 3


@pytest.mark.parametrize("window, expect", [(16, {5, 14}), (48, {3, 4, 5, 12, 13, 14})])
def test_zero_retention_pins_the_shared_prefix_junction_and_the_replay_point(window, expect) -> None:
    mask = reachable_block_mask(SlidingWindow(16, window), 0, 16, 16, retention=0, boundaries=[255, 96])
    assert {i for i, keep in enumerate(mask) if keep} == expect


def test_mamba_zero_retention_keeps_the_boundary_states_only() -> None:
    mask = reachable_block_mask(Mamba(16), 0, 16, 16, retention=0, boundaries=[255, 96])
    assert {i for i, keep in enumerate(mask) if keep} == {5, 14}
    assert reachable_block_mask(Mamba(16), 0, 16, 16, retention=None) is None


# --- events -------------------------------------------------------------------------------------

def test_one_block_stored_per_group_and_step_with_the_whole_token_range() -> None:
    m = KVCacheManager([FullAttention(16)], 20, hasher=HASHER)
    r = m.make_request("0", list(range(16 * 3 + 5)))
    step(m, r, r.num_tokens, first=True)
    (ev,) = m.take_events()
    assert ev.block_hashes == [external_hash(h) for h in r.block_hashes]
    assert ev.parent_block_hash is None and len(ev.token_ids) == 48 and ev.block_size == 16
    assert (ev.kv_cache_spec_kind, ev.group_idx, ev.medium, ev.extra_keys) == ("full_attention", 0, "GPU", [None] * 3)


def test_chunked_prefill_of_a_sparse_window_group_publishes_hashes_with_gaps() -> None:
    # FA + SWA(window 12), block 4, a 41-token prompt in two chunks, production retention 0.
    m = KVCacheManager([FullAttention(4), SlidingWindow(4, 12)], 40, hasher=HASHER, retention=0)
    r = m.make_request("0", list(range(41)))
    step(m, r, 20, first=True)
    first = m.take_events()
    swa1 = stored(first, 1)[0]
    assert (swa1.block_hashes, len(swa1.token_ids), swa1.extra_keys) == ([], 20, None)
    assert len(stored(first, 0)[0].block_hashes) == 5
    step(m, r, 21)
    swa2 = stored(m.take_events(), 1)[0]
    h = [external_hash(x) for x in r.block_hashes]
    assert swa2.block_hashes == h[7:10]
    assert swa2.parent_block_hash == h[4]  # block 4 was never stored: the parent still names it
    assert swa2.token_ids == list(range(20, 40))
    assert swa2.kv_cache_spec_sliding_window == 12


def test_stored_events_carry_each_groups_kind() -> None:
    m = KVCacheManager([FullAttention(16), SlidingWindow(16, 32), Mamba(16)], 30, hasher=HASHER, retention=None)
    r = m.make_request("0", list(range(33)))
    step(m, r, 32, first=True)
    kinds = {e.group_idx: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in m.take_events()}
    assert kinds == {0: ("full_attention", None), 1: ("sliding_window", 32), 2: ("mamba", None)}


def test_lora_request_publishes_adapter_id_name_and_untagged_keys() -> None:
    from kvpipe.gpu.hashing import LoRA, RequestKeys
    m = KVCacheManager([FullAttention(4)], 10, hasher=HASHER)
    r = m.make_request("0", list(range(9)), RequestKeys(lora=LoRA("ad", "/x", 42)), session_id="s1")
    step(m, r, 9, first=True)
    (ev,) = m.take_events()
    assert (ev.lora_id, ev.lora_name, ev.session_id, ev.extra_keys) == (42, "ad", "s1", [("ad",), ("ad",)])


def test_events_off_produces_nothing_but_caching_still_works() -> None:
    m = KVCacheManager([FullAttention(4)], 10, hasher=HASHER, enable_events=False)
    r = m.make_request("0", list(range(9)))
    step(m, r, 9, first=True)
    m.free(r)
    assert m.take_events() == []
    assert m.get_computed_blocks(m.make_request("1", list(range(9))))[1] == 8


def test_allocation_refuses_when_the_pool_is_too_small() -> None:
    m = KVCacheManager([FullAttention(4)], 3, hasher=HASHER)
    r = m.make_request("0", list(range(9)))
    assert m.allocate_slots(r, 9) is None
    assert m.pool.num_free_blocks == 2
