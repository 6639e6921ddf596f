"""CPU tier bookkeeping: chunk states, LRU and ARC replacement, group-tagged CPU events."""
from __future__ import annotations

import pytest
import torch

from kvpipe.gpu.canonical import canonicalize
from kvpipe.gpu.cpu_policies import ARCPolicy
from kvpipe.gpu.cpu_tier import CpuTier, LookupResult, ReqContext, make_offload_key, offload_key_group
from kvpipe.gpu.kv_tensors import AttentionGeometry, allocate_kv_caches
from kvpipe.gpu.offload import BlockMover, GroupTransfer, allocate_host_buffers
from kvpipe.gpu.offload_checks import device_block_checksums
from kvpipe.schemas.events import BlockRemoved, BlockStored

MISS, HIT, PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


def key(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(32, "big"), group)


def keys(*ids: int) -> list[bytes]:
    return [key(i) for i in ids]


def request(name: str, *ids: int, tokens_per_chunk: int = 16) -> ReqContext:
    """A request whose chunk i (in the order given) ends at token (i+1)*tokens_per_chunk."""
    ctx = ReqContext(name)
    for pos, i in enumerate(ids, 1):
        ctx.set_position(key(i), pos * tokens_per_chunk)
    return ctx


def ids_of(ks: list[bytes]) -> list[int]:
    return [int.from_bytes(k[:-4], "big") for k in ks]


def stored(events) -> list[int]:
    return [e.block_hashes[0] for e in events if isinstance(e, BlockStored)]


def removed(events) -> list[set[int]]:
    return [set(e.block_hashes) for e in events if isinstance(e, BlockRemoved)]


def test_lru_walkthrough_capacity_four_evicts_head_then_a_tail_first_run_then_drops_a_failed_store():
    tier = CpuTier(4, "lru")
    a = request("a", 1, 2)
    out = tier.prepare_store(keys(1, 2), a)
    assert out is not None and ids_of(out.keys_to_store) == [1, 2] and out.chunk_ids == [0, 1]
    assert tier.lookup(key(1)) is PENDING  # written, not yet readable
    assert tier.take_events() == []  # nothing announced before the copy finished
    tier.complete_store(keys(1, 2), a)
    assert stored(tier.take_events()) == [1, 2]
    assert [tier.lookup(k) for k in keys(1, 2, 3)] == [HIT, HIT, MISS]

    # request b shares chunk 2 and adds 3..5: chunk 2 is part of the offer, so chunk 1 goes
    b = request("b", 1, 2, 3, 4, 5)
    out = tier.prepare_store(keys(2, 3, 4, 5), b)
    assert out is not None
    assert (ids_of(out.keys_to_store), out.chunk_ids, ids_of(out.evicted_keys)) == ([3, 4, 5], [2, 3, 0], [1])
    assert removed(tier.take_events()) == [{1}]
    assert tier.prepare_store(keys(1, 6), request("x", 1, 6)) is None  # 3..5 still being written
    tier.complete_store(keys(2, 3, 4, 5), b)
    assert [tier.lookup(k) for k in keys(1, 2, 3, 4, 5)] == [MISS, HIT, HIT, HIT, HIT]

    # loads pin: while 2 and 3 are read only 4 and 5 are evictable, too few for three chunks
    d = request("d", 1, 2, 3)
    assert tier.prepare_load(keys(2, 3), d) == [1, 2]
    e = request("e", 6, 7, 8)
    assert tier.prepare_store(keys(6, 7, 8), e) is None
    tier.complete_load(keys(2, 3), d)
    out = tier.prepare_store(keys(6, 7, 8), e)
    assert out is not None
    # b ranked its chunks tail before head, d re-read 2 and 3 later: 5, 4, then 3 (d's tail)
    assert ids_of(out.evicted_keys) == [5, 4, 3]
    assert out.chunk_ids == [2, 3, 0]  # freed slots are reused last-freed first
    tier.complete_store(keys(6, 7, 8), e)

    # a failed copy: the new chunk is dropped silently, the already-stored one stays
    f = request("f", 7, 9)
    out = tier.prepare_store(keys(7, 9), f)
    # 2 was last used by d, which is older than e: it is the least recent
    assert out is not None and ids_of(out.keys_to_store) == [9] and ids_of(out.evicted_keys) == [2]
    tier.complete_store(keys(7, 9), f, success=False)
    assert tier.lookup(key(7)) is HIT and tier.lookup(key(9)) is MISS
    events = tier.take_events()
    assert removed(events) == [{5, 4, 3}, {2}]
    assert stored(events) == [3, 4, 5, 6, 7, 8]  # nothing for 9


def test_finished_request_makes_its_head_the_most_recent():
    tier = CpuTier(3, "lru")
    r = request("r", 1, 2, 3)
    tier.prepare_store(keys(1, 2, 3), r)
    tier.complete_store(keys(1, 2, 3), r)
    tier.on_request_finished(r)
    out = tier.prepare_store(keys(4), request("s", 4))
    assert out is not None and ids_of(out.evicted_keys) == [3]  # tail first, prefix survives


def test_touch_makes_the_first_key_most_recent():
    tier = CpuTier(3, "lru")
    ctx = ReqContext("no-positions")  # without positions every insert gets a fresh rank
    tier.prepare_store(keys(1, 2, 3), ctx)
    tier.complete_store(keys(1, 2, 3), ctx)
    tier.touch(keys(1, 2), ctx)  # order after: 3 (oldest), 2, 1
    out = tier.prepare_store(keys(4, 5), ReqContext("t"))
    assert out is not None and ids_of(out.evicted_keys) == [3, 2]


def test_pinned_and_write_pending_chunks_are_never_evicted_and_failure_changes_nothing():
    tier = CpuTier(2, "lru")
    ctx = ReqContext("p")
    tier.prepare_store(keys(1), ctx)  # pending
    tier.prepare_store(keys(2), ctx)
    tier.complete_store(keys(2), ctx)
    tier.prepare_load(keys(2), ctx)  # pinned
    assert tier.prepare_store(keys(3), ctx) is None
    assert tier.lookup(key(1)) is PENDING and tier.lookup(key(2)) is HIT


def test_removal_events_are_split_per_group_and_carry_group_and_medium():
    tier = CpuTier(2, "lru")
    ctx = ReqContext("g")
    ks = [key(1, group=0), key(1, group=3)]  # same hash, two groups
    tier.prepare_store(ks, ctx)
    tier.complete_store(ks, ctx)
    tier.prepare_store([key(8), key(9)], ctx)
    events = tier.take_events()
    assert [(type(e).__name__, e.group_idx) for e in events] == [
        ("BlockStored", 0), ("BlockStored", 3), ("BlockRemoved", 0), ("BlockRemoved", 3)]
    first = events[0]
    assert (first.medium, first.token_ids, first.block_size, first.parent_block_hash) == ("CPU", [], 0, None)
    assert first.block_hashes == [1]  # last 8 bytes of the hash, big-endian
    assert offload_key_group(ks[1]) == 3


def test_event_order_removal_before_store_and_store_only_after_completion():
    tier = CpuTier(1, "lru")
    ctx = ReqContext("o")
    tier.prepare_store(keys(1), ctx)
    tier.complete_store(keys(1), ctx)
    tier.take_events()
    tier.prepare_store(keys(2), ctx)
    pending = tier.take_events()
    assert [type(e).__name__ for e in pending] == ["BlockRemoved"]
    tier.complete_store(keys(2), ctx)
    assert [type(e).__name__ for e in tier.take_events()] == ["BlockStored"]


def test_reset_forgets_everything_without_events():
    tier = CpuTier(2, "lru")
    ctx = ReqContext("z")
    tier.prepare_store(keys(1), ctx)
    tier.complete_store(keys(1), ctx)
    tier.reset_cache()
    assert tier.take_events() == [] and tier.lookup(key(1)) is MISS and tier.num_free_chunks == 2


# -- ARC -------------------------------------------------------------------------------------------

def _arc(capacity: int = 4) -> tuple[CpuTier, ARCPolicy]:
    tier = CpuTier(capacity, "arc")
    assert isinstance(tier.policy, ARCPolicy)
    return tier, tier.policy


def test_arc_new_chunks_enter_t1_and_a_reuse_by_another_request_moves_them_to_t2():
    tier, arc = _arc()
    w = ReqContext("writer")
    tier.prepare_store(keys(1, 2), w)
    tier.complete_store(keys(1, 2), w)
    tier.on_request_finished(w)  # the writer's own keys are insertions, not reuses
    assert set(arc.t1) == set(keys(1, 2)) and not arc.t2
    r = ReqContext("reader")
    tier.prepare_load(keys(1), r)
    tier.complete_load(keys(1), r)
    tier.on_request_finished(r)
    assert key(1) in arc.t2 and key(2) in arc.t1


def test_arc_touch_promotes_ready_chunks_but_not_ones_still_being_written():
    tier, arc = _arc()
    ctx = ReqContext("t")
    tier.prepare_store(keys(1, 2), ctx)
    tier.complete_store(keys(1), ctx)
    tier.touch(keys(1, 2), ctx)
    assert key(1) in arc.t2 and key(2) in arc.t1


def test_arc_ghost_hit_in_b1_grows_the_t1_target():
    tier, arc = _arc(capacity=2)
    ctx = ReqContext("c")
    tier.prepare_store(keys(1, 2), ctx)
    tier.complete_store(keys(1, 2), ctx)
    tier.prepare_store(keys(3), ReqContext("d"))  # evicts 1 from T1 into ghost list B1
    assert key(1) in arc.b1 and arc.target_t1 == 0
    tier.prepare_store(keys(1), ReqContext("e"))  # 1 is wanted again: recency was undervalued
    assert arc.target_t1 == 1
    assert key(1) not in arc.b1 and key(1) in arc.t1


def test_arc_evicts_from_t2_while_t1_is_below_target():
    tier, arc = _arc(capacity=3)
    ctx = ReqContext("w")
    tier.prepare_store(keys(1, 2, 3), ctx)
    tier.complete_store(keys(1, 2, 3), ctx)
    tier.touch(keys(1), ctx)  # 1 -> T2
    arc.target_t1 = 3  # T1 (2 chunks) is below target: take T2's LRU
    out = tier.prepare_store(keys(4), ReqContext("x"))
    assert out is not None and out.evicted_keys == [key(1)] and key(1) in arc.b2


def test_store_after_prepare_returns_exact_bytes_on_load():
    """Tier + kernels: bytes stored into the chunk ids the tier hands out come back unchanged."""
    geom = AttentionGeometry(num_layers=2, block_size=4, num_kv_heads=2, head_size=8)
    kv = allocate_kv_caches([geom], 16, device="cpu")
    for layer in kv.layers.values():
        layer.raw.random_(0, 256)
    canon = canonicalize(kv)
    tier = CpuTier(4, "lru")
    mover = BlockMover(canon, allocate_host_buffers(canon, 4, blocks_per_chunk=2))
    ctx = request("bytes", 1, 2)
    out = tier.prepare_store(keys(1, 2), ctx)
    assert out is not None
    sums = device_block_checksums(canon, 0, [9, 4, 13, 0])
    handle = mover.store([GroupTransfer(0, [9, 4, 13, 0], out.chunk_ids)])
    assert handle.done()
    tier.complete_store(keys(1, 2), ctx)
    for layer in kv.layers.values():
        layer.raw.zero_()
    chunk_ids = tier.prepare_load(keys(1, 2), ctx)
    mover.load([GroupTransfer(0, [1, 2, 3, 5], chunk_ids)]).wait()
    tier.complete_load(keys(1, 2), ctx)
    assert torch.equal(device_block_checksums(canon, 0, [1, 2, 3, 5]), sums)


def test_prepare_load_of_a_pending_key_is_an_error():
    tier = CpuTier(2)
    ctx = ReqContext("e")
    tier.prepare_store(keys(1), ctx)
    with pytest.raises(KeyError, match="not ready"):
        tier.prepare_load(keys(1), ctx)
