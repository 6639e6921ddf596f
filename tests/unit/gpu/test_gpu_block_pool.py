"""Block pool: LRU free order, lazy eviction with one BlockRemoved per hash, duplicates, reset."""
from __future__ import annotations

from kvpipe.gpu.hashing import BlockHasher, external_hash
from kvpipe.gpu.kv_cache_manager import KVCacheManager
from kvpipe.gpu.specs import FullAttention
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

HASHER = BlockHasher("sha256", env={})


def manager(num_blocks: int = 11, bs: int = 4) -> KVCacheManager:
    return KVCacheManager([FullAttention(bs)], num_blocks, hasher=HASHER, retention=None)


def prefill(m: KVCacheManager, rid: str, tokens: list[int]):
    req = m.make_request(rid, tokens)
    blocks, hit = m.get_computed_blocks(req)
    assert m.allocate_slots(req, len(tokens) - hit, hit, blocks) is not None
    req.num_computed_tokens = len(tokens)
    return req


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_block_zero_is_the_null_block_and_never_handed_out() -> None:
    m = manager()
    assert m.pool.null_block.block_id == 0 and m.pool.num_free_blocks == 10
    req = prefill(m, "a", list(range(40)))
    assert 0 not in ids(m.coordinator.block_table("a")[0])
    m.free(req)


def test_freed_request_goes_tail_first_cached_to_the_back_uncached_to_the_front() -> None:
    m = manager()
    req = prefill(m, "a", list(range(10)))  # blocks 1,2 full and cached, block 3 partial
    m.free(req)
    # partial block 3 is reused first; then the untouched blocks; then cached tail-first: 2, 1
    assert m.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]


def test_a_hit_takes_blocks_out_of_the_free_queue() -> None:
    m = manager()
    m.free(prefill(m, "a", list(range(10))))
    req = m.make_request("b", list(range(9)))
    blocks, hit = m.get_computed_blocks(req)
    assert hit == 8
    m.allocate_slots(req, 1, hit, blocks)
    assert 1 not in m.pool.free_queue.block_ids() and 2 not in m.pool.free_queue.block_ids()
    assert [b.ref_cnt for b in blocks[0]] == [1, 1]


def test_eviction_is_lazy_and_announces_each_hash_separately() -> None:
    m = manager(num_blocks=5)
    a = prefill(m, "a", list(range(8)))
    m.free(a)
    stored = m.take_events()
    assert len(stored) == 1 and isinstance(stored[0], BlockStored)
    assert m.take_events() == []  # freeing announces nothing
    prefill(m, "b", list(range(100, 116)))  # needs all 4 blocks: evicts both cached ones
    events = m.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    # the request's tail block was freed first, so it is evicted first
    assert [e.block_hashes for e in removed] == [[h] for h in reversed(stored[0].block_hashes)]
    assert all(len(e.block_hashes) == 1 and e.group_idx == 0 and e.medium == "GPU" for e in removed)
    assert isinstance(events[-1], BlockStored)  # removals come before the new store


def test_duplicate_blocks_under_one_key_need_reference_counting() -> None:
    m = manager()
    tokens = list(range(9))
    a, b = m.make_request("a", tokens), m.make_request("b", tokens)
    # Both look up before either computes: both miss and both cache their own copy.
    lookups = [m.get_computed_blocks(r) for r in (a, b)]
    for r, (blocks, hit) in zip((a, b), lookups):
        assert hit == 0
        m.allocate_slots(r, 9, hit, blocks)
    stores = m.take_events()
    assert [e.block_hashes for e in stores] == [stores[0].block_hashes] * 2
    h0 = stores[0].block_hashes[0]
    m.free(a)
    m.free(b)
    # Use blocks until exactly one of the two copies of block 0 is reused.
    free_order = m.pool.free_queue.block_ids()
    copies = [bid for bid in free_order if m.pool.blocks[bid].key is not None
              and external_hash(m.pool.blocks[bid].key[:-4]) == h0]
    assert len(copies) == 2
    m.pool.get_new_blocks(free_order.index(copies[0]) + 1)
    removed = [e.block_hashes[0] for e in m.take_events() if isinstance(e, BlockRemoved)]
    assert h0 in removed
    probe = m.make_request("c", tokens)
    assert m.get_computed_blocks(probe)[1] == 8  # the surviving copies still serve the whole hit


def test_reset_clears_everything_with_one_event_and_only_when_idle() -> None:
    m = manager()
    a = prefill(m, "a", list(range(12)))
    m.take_events()
    assert not m.reset_prefix_cache()  # a request still holds blocks
    m.free(a)
    assert m.reset_prefix_cache()
    assert [type(e) for e in m.take_events()] == [AllBlocksCleared]
    assert m.get_computed_blocks(m.make_request("b", list(range(12))))[1] == 0
    prefill(m, "c", list(range(200, 240)))  # reusing formerly cached blocks: no removals
    assert not any(isinstance(e, BlockRemoved) for e in m.take_events())


def test_evict_blocks_drops_a_block_in_use_from_the_cache() -> None:
    m = manager()
    prefill(m, "a", list(range(8)))
    m.take_events()
    m.evict_blocks([1])
    events = m.take_events()
    assert len(events) == 1 and isinstance(events[0], BlockRemoved)
    assert m.get_computed_blocks(m.make_request("b", list(range(9))))[1] == 0
