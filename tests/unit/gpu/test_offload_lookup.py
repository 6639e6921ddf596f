"""Scheduler-side offload lookup: prefix scans, window scans, the cross-group fixed point, and which
chunks SWA/Mamba groups store and load (only the window's tail)."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from kvpipe.gpu.cpu_tier import LookupResult, make_offload_key
from kvpipe.gpu.offload_lookup import (
    FULL,
    MAMBA,
    SLIDING,
    OffloadGroup,
    chunk_keys,
    load_plan,
    lookup_hit_tokens,
    maximal_prefix_lookup,
    sliding_window_lookup,
    store_chunk_indices,
)
from kvpipe.gpu.specs import FullAttention, Mamba, SlidingWindow

HIT, MISS, PENDING, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.RETRY


def answers(table: dict) -> Callable[[bytes], LookupResult]:
    return lambda k: table.get(k, MISS)


def hits(*ids: int, pending=(), retry=()) -> Callable[[bytes], LookupResult]:
    table = {i: HIT for i in ids} | {i: PENDING for i in pending} | {i: RETRY for i in retry}
    return lambda k: table.get(k, MISS)


# -- single-group scans ----------------------------------------------------------------------------

def test_prefix_counts_hits_until_the_first_miss():
    assert maximal_prefix_lookup([1, 2, 3, 4], hits(1, 2, 4)) == 2
    assert maximal_prefix_lookup([1, 2], hits()) == 0


def test_prefix_defers_on_a_pending_hit_or_a_retry_even_before_a_miss():
    assert maximal_prefix_lookup([1, 2, 3], hits(1, pending=[2])) is None
    assert maximal_prefix_lookup([1, 2, 3], hits(1, 3, retry=[2])) is None


def test_window_of_two_over_hits_1_2_4_5_takes_the_rightmost_run():
    assert sliding_window_lookup([1, 2, 3, 4, 5], 2, hits(1, 2, 4, 5)) == 5


def test_window_of_four_without_a_full_run_falls_back_to_the_run_touching_the_first_key():
    # keys in order [2,1,3,4,5]; 1 is the only miss: runs are [2] and [3,4,5], none of length 4
    assert sliding_window_lookup([2, 1, 3, 4, 5], 4, hits(2, 3, 4, 5)) == 1


@pytest.mark.parametrize("where", [1, 2, 3])
def test_a_retry_anywhere_in_the_prefix_scan_defers(where):
    assert maximal_prefix_lookup([1, 2, 3], hits(*(i for i in (1, 2, 3) if i != where), retry=[where])) is None


@pytest.mark.parametrize("where", [3, 4])
def test_a_retry_met_before_the_window_completes_defers_even_if_a_full_window_follows(where):
    # right to left: the retry resets the run (or interrupts it); [1, 2] would be a full window
    assert sliding_window_lookup([1, 2, 3, 4], 2, hits(*(i for i in (1, 2, 3, 4) if i != where),
                                                       retry=[where])) is None


def test_a_retry_left_of_the_accepted_window_is_never_asked_about():
    asked = []

    def lookup(k):
        asked.append(k)
        return RETRY if k == 1 else HIT
    assert sliding_window_lookup([1, 2, 3, 4], 2, lookup) == 4
    assert asked == [4, 3]


def test_window_scan_defers_only_for_pending_keys_inside_the_accepted_run():
    assert sliding_window_lookup([1, 2, 3, 4, 5], 2, hits(4, 5, pending=[1])) == 5
    assert sliding_window_lookup([1, 2, 3, 4, 5], 2, hits(4, pending=[5])) is None


def test_first_run_may_need_the_widened_window():
    # the rightmost run [4,5] is too short for a widened window of 3; the next full run of 2 counts
    assert sliding_window_lookup([1, 2, 3, 4, 5], 2, hits(1, 2, 4, 5), initial_window=3) == 2


# -- groups and keys -------------------------------------------------------------------------------

def _fine(n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") for i in range(n)]


def test_chunk_key_is_the_last_fine_hash_of_the_chunk_tagged_with_the_group():
    g = OffloadGroup(2, FULL, tokens_per_block=32, blocks_per_chunk=2, hash_block_size=16)
    assert g.hashes_per_chunk == 4
    assert chunk_keys(_fine(10), g) == [make_offload_key(_fine(10)[3], 2), make_offload_key(_fine(10)[7], 2)]


def test_groups_from_specs_get_their_window_in_chunks():
    swa = OffloadGroup.from_spec(1, SlidingWindow(16, sliding_window=40), blocks_per_chunk=2, hash_block_size=16)
    assert (swa.kind, swa.window_chunks) == (SLIDING, 2)  # cdiv(40, 32)
    assert OffloadGroup.from_spec(2, Mamba(16), 2, 16).window_chunks == 1
    assert OffloadGroup.from_spec(0, FullAttention(16), 2, 16).window_chunks is None


def _group(idx: int, kind: str = FULL, tpb: int = 16, bpc: int = 1, window: int | None = None,
           hash_bs: int = 16) -> OffloadGroup:
    return OffloadGroup(idx, kind, tpb, bpc, hash_bs, sliding_window=window)


def _keys(group: int, n: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(32, "big"), group) for i in range(n)]


def _table(*present: tuple[int, list[int]]) -> Callable[[bytes], LookupResult]:
    return answers({make_offload_key(i.to_bytes(32, "big"), g): HIT for g, ids in present for i in ids})


# -- across groups ---------------------------------------------------------------------------------

def test_full_and_sliding_groups_agree_on_the_full_prefix():
    groups = [_group(0), _group(1, SLIDING, window=32)]
    lookup = _table((0, [0, 1, 2, 3, 4]), (1, [0, 1, 2, 3, 4]))
    assert lookup_hit_tokens(groups, [_keys(0, 6), _keys(1, 6)], lookup, 0, 100) == 80


def test_sliding_window_hole_shrinks_the_hit_to_the_last_full_window_before_it():
    groups = [_group(0), _group(1, SLIDING, window=32)]
    lookup = _table((0, [0, 1, 2, 3, 4]), (1, [0, 1, 2, 4]))  # SWA chunk 3 evicted
    assert lookup_hit_tokens(groups, [_keys(0, 6), _keys(1, 6)], lookup, 0, 100) == 48


def test_a_smaller_window_shrinking_the_hit_forces_the_larger_window_to_be_rechecked():
    groups = [_group(0, SLIDING, window=64), _group(1, SLIDING, window=32)]
    # the 4-chunk window only holds chunks 2..5, the 2-chunk window only 0..3: no common end
    lookup = _table((0, [2, 3, 4, 5]), (1, [0, 1, 2, 3]))
    assert lookup_hit_tokens(groups, [_keys(0, 6), _keys(1, 6)], lookup, 0, 100) == 0


def test_groups_with_different_block_sizes_meet_at_the_smaller_chunk():
    fa = _group(0, tpb=32)             # 2 hash blocks per chunk
    swa = _group(1, SLIDING, tpb=16, window=32)
    fine = _fine(8)                    # 128 tokens hashed
    fa_keys, swa_keys = chunk_keys(fine, fa), chunk_keys(fine, swa)
    assert len(fa_keys) == 4 and len(swa_keys) == 8
    lookup = answers({**{k: HIT for k in fa_keys}, **{k: HIT for k in swa_keys[:7]}})
    assert lookup_hit_tokens([fa, swa], [fa_keys, swa_keys], lookup, 0, 130) == 112


def test_retry_in_any_group_defers_the_request():
    groups = [_group(0), _group(1, SLIDING, window=32)]
    table = {k: HIT for k in _keys(0, 6) + _keys(1, 6)}
    table[_keys(1, 6)[4]] = RETRY
    assert lookup_hit_tokens(groups, [_keys(0, 6), _keys(1, 6)], answers(table), 0, 100) is None


def test_less_than_one_chunk_beyond_the_gpu_hit_loads_nothing():
    groups = [_group(0)]
    lookup = _table((0, [0, 1, 2]))
    assert lookup_hit_tokens(groups, [_keys(0, 3)], lookup, 32, 47) == 0  # 15 tokens: no whole chunk
    assert lookup_hit_tokens(groups, [_keys(0, 3)], lookup, 16, 64) == 32


def test_chunks_being_loaded_for_another_request_delay_the_lookup():
    groups = [_group(0)]
    lookup = _table((0, [0, 1, 2]))
    assert lookup_hit_tokens(groups, [_keys(0, 3)], lookup, 0, 64, being_loaded={_keys(0, 3)[1]}) is None


# -- what moves ------------------------------------------------------------------------------------

def test_sliding_window_loads_only_the_tail_blocks_its_window_reads():
    swa = _group(1, SLIDING, tpb=16, bpc=2, window=32)
    plan = load_plan(swa, 0, 128)
    assert (plan.first_chunk, plan.end_chunk, plan.first_block, plan.end_block, plan.skip) == (3, 4, 6, 8, 0)
    wider = _group(1, SLIDING, tpb=16, bpc=2, window=40)   # first needed token 89 -> block 5
    plan = load_plan(wider, 0, 128)
    assert (plan.first_chunk, plan.first_block, plan.skip) == (2, 5, 1)


def test_mamba_loads_only_the_last_state_and_full_attention_everything_after_the_gpu_hit():
    mamba = OffloadGroup(2, MAMBA, 16, 2, 16)
    plan = load_plan(mamba, 0, 128)
    assert (plan.first_chunk, plan.first_block, plan.end_block, plan.skip) == (3, 7, 8, 1)
    fa = _group(0, tpb=16, bpc=2)
    plan = load_plan(fa, 48, 128)
    assert (plan.first_chunk, plan.end_chunk, plan.first_block, plan.skip) == (1, 4, 3, 1)


def test_sliding_window_stores_only_the_window_tail():
    swa = _group(1, SLIDING, tpb=16, bpc=2, window=64)  # 2 chunks of 32 tokens
    blocks = [11, 12, 13, 14, 15, 16, 17, 18]
    assert store_chunk_indices(swa, 0, 128, blocks, num_keys=4) == [2, 3]
    fa = _group(0, tpb=16, bpc=2)
    assert store_chunk_indices(fa, 1, 128, blocks, num_keys=4) == [1, 2, 3]


def test_sliding_window_chunk_with_a_null_block_is_not_stored():
    swa = _group(1, SLIDING, tpb=16, bpc=2, window=64)
    blocks = [0, 0, 0, 0, 0, 16, 17, 18]  # blocks left of the window were freed early
    assert store_chunk_indices(swa, 0, 128, blocks, num_keys=4) == [3]


def test_only_complete_keyed_and_allocated_chunks_are_stored():
    fa = _group(0, tpb=16, bpc=2)
    assert store_chunk_indices(fa, 0, 100, list(range(1, 9)), num_keys=4) == [0, 1, 2]  # 100 tokens: 3 chunks
    assert store_chunk_indices(fa, 0, 128, list(range(1, 5)), num_keys=4) == [0, 1]    # 2 chunks allocated
    assert store_chunk_indices(fa, 0, 128, list(range(1, 9)), num_keys=1) == [0]       # 1 chunk hashed
