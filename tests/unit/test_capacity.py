"""Re-stores and the capacity curve's stack distances, on traces whose answer is known by construction."""
from __future__ import annotations

import random

import msgspec
import pytest

from kvpipe.processors.analytics.restores import REASON_EPOCH_CHANGE, RestoreTracker, refine_reasons
from kvpipe.processors.analytics.stackdist import StackDistance
from kvpipe.processors.core.index import Index
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
KINDS = {g.group_idx: (g.kind, g.block_size) for g in SPECS}


def brute_distances(seq: list[int]) -> list[int | None]:
    out, history = [], []
    for k in seq:
        if k in history:
            last = len(history) - 1 - history[::-1].index(k)
            out.append(len(set(history[last + 1:])))
        else:
            out.append(None)
        history.append(k)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_stack_distance_equals_the_definition_across_compactions(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(rng.randint(1, 80)) for _ in range(500)]
    stack = StackDistance(initial_size=16)  # tiny: compacts many times
    assert [stack.access(k) for k in seq] == brute_distances(seq)


def test_stack_distance_forgets_the_least_recent_keys_past_its_bound():
    stack = StackDistance(max_keys=10, initial_size=16)
    for k in range(40):
        stack.access(k)
    assert len(stack) <= 20 and stack.forgotten > 0
    assert stack.access(0) is None  # forgotten long ago: a first access, not a distance


def env(seq: int, ts: float, events: list, epoch: int = 1) -> Envelope:
    return Envelope(v=SCHEMA_MAJOR, node_id="n1", epoch=epoch, seq=seq, ts=ts, sent_ts=ts,
                    group_specs=SPECS if seq == 0 else None, num_events=len(events), batch=msgspec.Raw(b"[]"))


def run_lru_trace(accesses: list[int], capacity: int, group: int = 0, medium: str = "GPU") -> list:
    """Publish an LRU cache of `capacity` blocks serving `accesses` (a miss stores, a full cache evicts its LRU
    block first) through the real index and tracker; returns the re-store rows."""
    index, tracker = Index(ttl_s=None), RestoreTracker()
    cache: list[int] = []  # LRU order, most recent last
    rows = []
    for seq, h in enumerate(accesses):
        events = []
        if h in cache:  # a hit: vLLM publishes nothing
            cache.remove(h)
            cache.append(h)
        else:
            if len(cache) == capacity:
                events.append(BlockRemoved(block_hashes=[cache.pop(0)], medium=medium, group_idx=group))
            events.append(BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16,
                                      lora_id=None, medium=medium, lora_name=None, group_idx=group))
            cache.append(h)
        e = env(seq, 1000.0 + seq, events)
        _, closed = index.apply(e, events, 0, seq)
        rows += tracker.observe(e, events, closed, 0, seq, KINDS)
    return rows


def hits_at(rows: list, cache_blocks: int) -> int:
    return sum(r.stack_distance < cache_blocks for r in rows)


@pytest.mark.parametrize("k,capacity", [(10, 4), (37, 36), (64, 8)])
def test_cyclic_trace_over_k_blocks_no_hit_below_k_all_at_or_above(k, capacity):
    rows = run_lru_trace([i % k for i in range(6 * k)], capacity)
    assert len(rows) == 5 * k  # every access after the first round misses: a re-store
    assert {r.stack_distance for r in rows} == {k - 1}
    assert all(r.held_blocks == capacity - 1 for r in rows)  # its own eviction made room just before
    for size in range(1, 2 * k):
        assert hits_at(rows, size) == (0 if size < k else len(rows)), size
    assert {(r.group_kind, r.end_reason, r.restored_ts - r.removed_ts) for r in rows} == \
        {("full_attention", "evicted", float(k - capacity))}


def test_re_store_rows_equal_an_independent_replay_of_a_random_lru_trace():
    rng = random.Random(7)
    accesses = [rng.randrange(30) if rng.random() < 0.7 else rng.randrange(200) for _ in range(3000)]
    capacity = 20
    rows = run_lru_trace(accesses, capacity, group=1, medium="CPU")
    # independent model: every store (miss) is an access of the modelled stack; a re-store is a miss of a hash
    # stored before; its distance counts distinct stores since that hash's previous store
    cache, stores, removed_at, expected = [], [], {}, []
    for t, h in enumerate(accesses):
        if h in cache:
            cache.remove(h)
            cache.append(h)
            continue
        if len(cache) == capacity:
            removed_at[cache.pop(0)] = 1000.0 + t
        if h in removed_at:
            last = len(stores) - 1 - stores[::-1].index(h)
            expected.append((h, len(set(stores[last + 1:])), 1000.0 + t - removed_at.pop(h)))
        stores.append(h)
        cache.append(h)
    assert [(r.block_hash, r.stack_distance, r.restored_ts - r.removed_ts) for r in rows] == expected
    assert {(r.group_kind, r.medium) for r in rows} == {("sliding_window", "CPU")}


def test_order_inside_a_message_decides_what_is_a_re_store():
    index, tracker = Index(ttl_s=None), RestoreTracker()
    st = lambda h: BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16,  # noqa: E731
                               lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    rm = lambda h: BlockRemoved(block_hashes=[h], medium="GPU", group_idx=0)  # noqa: E731
    rows = []
    for seq, events in enumerate([[st(1), st(2)], [rm(1), st(3), st(1)], [st(2), rm(2)]]):
        e = env(seq, 10.0 + seq, events)
        _, closed = index.apply(e, events, 0, seq)
        rows += tracker.observe(e, events, closed, 0, seq, KINDS)
    # hash 1: removed at event 0, stored again at event 2 of the same message (hash 3 between: distance 2 = {2, 3});
    # hash 2: stored while held (a copy), then removed: no re-store
    got = [(r.block_hash, r.stack_distance, r.idx, r.removed_ts, r.restored_ts) for r in rows]
    assert got == [(1, 2, 2, 11.0, 11.0)]


def test_a_new_epoch_ends_lifetimes_as_epoch_change_and_a_clear_as_cleared():
    index, tracker = Index(ttl_s=None), RestoreTracker()
    stored = BlockStored(block_hashes=[5], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                         medium="GPU", lora_name=None, group_idx=0)
    rows, reasons = [], []
    steps = [(env(0, 1.0, [stored]), [stored]), (env(1, 2.0, [AllBlocksCleared(), stored]), [AllBlocksCleared(), stored]),
             (env(0, 5.0, [stored], epoch=2), [stored])]
    for e, events in steps:
        _, closed = index.apply(e, events, 0, int(e.ts))
        refine_reasons(e, closed)
        reasons += [(lt.reason, lt.end_reason) for lt in closed]
        rows += tracker.observe(e, events, closed, 0, int(e.ts), KINDS)
    assert reasons == [("cleared", "cleared"), ("cleared", REASON_EPOCH_CHANGE)]
    assert [(r.end_reason, r.restored_ts - r.removed_ts, r.epoch) for r in rows] == \
        [("cleared", 0.0, 1), (REASON_EPOCH_CHANGE, 0.0, 2)]


def test_lifetimes_out_of_event_order_are_walked_in_event_order():
    from kvpipe.processors.core.lifetimes import LifetimeRow

    tracker = RestoreTracker()
    st = lambda h: BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16,  # noqa: E731
                               lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    tracker.observe(env(0, 1.0, []), [st(1), st(2)], [], 0, 0, KINDS)
    events = [BlockRemoved(block_hashes=[2], medium="GPU", group_idx=0), st(3),
              BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0), st(1), st(2)]
    ends = [LifetimeRow("n1", 1, 0, "GPU", 1, 1.0, 2.0, "evicted", 0, 1, 2),
            LifetimeRow("n1", 1, 0, "GPU", 2, 1.0, 2.0, "evicted", 0, 1, 0)]
    rows = tracker.observe(env(1, 2.0, events), events, ends, 0, 1, KINDS)
    assert [(r.block_hash, r.idx, r.stack_distance) for r in rows] == [(1, 3, 2), (2, 4, 2)]


@pytest.mark.parametrize("seed", range(10))
def test_a_stack_rebuilt_from_its_key_order_measures_what_the_original_goes_on_measuring(seed):
    rng = random.Random(seed)
    history = [rng.randrange(60) for _ in range(400)]
    more = [rng.randrange(80) for _ in range(400)]
    original = StackDistance(initial_size=16)
    for k in history:
        original.access(k)
    rebuilt = StackDistance.from_order(original.order())
    expected = brute_distances(history + more)[len(history):]
    assert [rebuilt.access(k) for k in more] == [original.access(k) for k in more] == expected


def test_a_rebuilt_stack_keeps_only_the_most_recent_keys_of_its_bound():
    stack = StackDistance.from_order(list(range(100)), max_keys=10)
    assert len(stack) == 10 and stack.forgotten == 90
    assert stack.access(95) == 4 and stack.access(50) is None  # 96..99 since 95; 50 is beyond the bound


def test_ended_hashes_the_stack_forgot_are_pruned_so_memory_stays_bounded():
    tracker = RestoreTracker(max_keys_per_slot=16)
    st = lambda hs: BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=[], block_size=16,  # noqa: E731
                                lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    index = Index(ttl_s=None)
    for seq in range(2000):  # 20,000 distinct hashes, each stored once and evicted (the stack compacts at 4,096)
        hashes = list(range(seq * 10, seq * 10 + 10))
        events = [st(hashes), BlockRemoved(block_hashes=hashes, medium="GPU", group_idx=0)]
        e = env(seq, 1.0 + seq, events)
        _, closed = index.apply(e, events, 0, seq)
        tracker.observe(e, events, closed, 0, seq, KINDS)
    slot = tracker.slots[("n1", 0, "GPU")]
    # bounded by the largest the stack got (4,096 keys before its first compaction), not by the 20,000 that ended
    assert len(slot.stack) <= 32 and len(slot.ended) <= slot.prune_at <= 2 * 4096 + 1024
    assert set(slot.ended) >= set(slot.stack.order())  # what it can still measure is kept


def test_forgetting_a_partition_drops_only_its_nodes():
    tracker = RestoreTracker()
    st = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                     medium="GPU", lora_name=None, group_idx=0)
    for p, node in ((0, "a"), (1, "b")):
        e = msgspec.structs.replace(env(0, 1.0, [st]), node_id=node)
        tracker.observe(e, [st], [], p, 0, KINDS)
    tracker.loaded.update({0, 1})
    tracker.forget_partition(1)
    assert set(tracker.slots) == {("a", 0, "GPU")} and tracker.loaded == {0}
