"""Hit rules per attention type and across groups (docs/vllm-behaviour.md §4.3, §4.6), on the pure function
the router uses: cached sets in, hit length and per-group masks out."""
from __future__ import annotations

import pytest

from kvpipe.gpu.finders import find_sliding
from kvpipe.gpu.hit import longest_hybrid_hit
from kvpipe.gpu.specs import ChunkedLocal, FullAttention, Mamba, SlidingWindow

H = [f"h{i}".encode() for i in range(16)]  # stand-in fine hashes, one per block


def cached(*idx: int) -> set[bytes]:
    return {H[i] for i in idx}


def slots(mask: list[bool]) -> list[int | None]:
    """Mask as in the spec's tables: block index for a real block, None for a null slot."""
    return [i if m else None for i, m in enumerate(mask)]


N = None


# --- sliding window: window 4, block 2 -> two consecutive cached blocks make a hit ---------------

@pytest.mark.parametrize("is_cached, expect_blocks", [
    ([True], 1),
    ([True, False], 1),
    ([False, True], 0),
    ([True, True], 2),
    ([True, True, False], 2),
    ([False, True, True], 3),
    ([True, True, True, False], 3),
    ([True, False, True, True, False], 4),
    ([False, False, False, True, False, True], 0),
    ([True, True, False, True, False, False, True, True, False, True, True, True], 12),
    ([True, True, False, True, False, False, True, True, False, False, False], 8),
])
def test_sliding_window_hit_ends_at_the_rightmost_full_window(is_cached, expect_blocks) -> None:
    hashes = H[: len(is_cached)]
    have = {h for h, c in zip(hashes, is_cached) if c}
    found, length = find_sliding(hashes, len(hashes) * 2, 2, 4, 2, have.__contains__)
    assert length == expect_blocks * 2
    assert len(found) == expect_blocks
    assert all(is_cached[i] for i, f in enumerate(found) if f is not None)


def test_sliding_window_with_finer_hash_unit_looks_at_block_view() -> None:
    # hash unit 2, block 4, window 5 -> need 1 block; the block view of fine hashes is 1, 3.
    spec = SlidingWindow(4, 5)
    hit = longest_hybrid_hit([spec], H[:4], 2, [cached(1, 3)], 8, alignment=4)
    assert hit.length == 8
    assert slots(hit.masks[0]) == [N, 1]


# --- the worked examples: block 4, ten blocks, max length 40 ------------------------------------

SWA12 = SlidingWindow(4, 12)  # needs 3 consecutive blocks


@pytest.mark.parametrize("swa_cached, expect_len, expect_slots", [
    (range(10), 40, [N] * 7 + [7, 8, 9]),
    ((7, 8, 9), 40, [N] * 7 + [7, 8, 9]),
    (range(7), 28, [N] * 4 + [4, 5, 6]),
    ((0, 1, 2, 4, 5, 8, 9), 12, [0, 1, 2]),
    ((0, 1, 2, 3, 5, 6, 8, 9), 16, [N, 1, 2, 3]),
    ((0, 1), 8, [0, 1]),
    ((8, 9), 0, []),
])
def test_sliding_window_worked_examples(swa_cached, expect_len, expect_slots) -> None:
    hit = longest_hybrid_hit([SWA12], H[:10], 4, [cached(*swa_cached)], 40)
    assert hit.length == expect_len
    assert slots(hit.masks[0]) == expect_slots


def test_hybrid_full_and_window_both_fully_cached_hits_everything() -> None:
    hit = longest_hybrid_hit([FullAttention(4), SWA12], H[:10], 4, [cached(*range(10))] * 2, 40)
    assert hit.length == 40


def test_hybrid_hole_in_full_attention_limits_the_window_search() -> None:
    fa = cached(*(i for i in range(10) if i != 5))
    hit = longest_hybrid_hit([FullAttention(4), SWA12], H[:10], 4, [fa, cached(*range(10))], 40)
    assert hit.length == 20
    assert slots(hit.masks[1]) == [N, N, 2, 3, 4]


def test_hybrid_window_gaps_shrink_the_hit_and_full_attention_is_truncated() -> None:
    hit = longest_hybrid_hit([FullAttention(4), SWA12], H[:10], 4,
                             [cached(*range(10)), cached(0, 1, 2, 4, 5, 8, 9)], 40)
    assert hit.length == 12
    assert slots(hit.masks[0]) == [0, 1, 2]
    assert hit.longest_group_hit == 40  # full attention alone would have reused everything


def test_three_types_iterate_to_a_fixed_point() -> None:
    specs = [FullAttention(4), SWA12, Mamba(4)]
    sets = [cached(*range(10)), cached(*(i for i in range(10) if i != 8)), cached(6, 9)]
    hit = longest_hybrid_hit(specs, H[:10], 4, sets, 40)
    # FA 40 -> SWA finds {5,6,7} -> 32 -> Mamba <= 32 finds state 6 -> 28; pass 2 confirms 28.
    assert hit.length == 28
    assert slots(hit.masks[2]) == [N] * 6 + [6]
    assert slots(hit.masks[1]) == [N] * 4 + [4, 5, 6]


def test_eagle_drops_one_full_attention_block() -> None:
    hit = longest_hybrid_hit([FullAttention(4)], H[:10], 4, [cached(*range(10))], 40, eagle_groups={0})
    assert hit.length == 36


def test_window_run_must_end_on_the_alignment() -> None:
    hit = longest_hybrid_hit([SWA12], H[:10], 4, [cached(*range(9))], 40, alignment=8)
    assert hit.length == 32
    assert slots(hit.masks[0]) == [N] * 5 + [5, 6, 7]


def test_equal_specs_are_merged_and_must_all_hold_the_hash() -> None:
    specs = [FullAttention(4), SWA12, SWA12]
    sets = [cached(*range(10)), cached(*range(10)), cached(*range(9))]  # group 2 lacks block 9
    hit = longest_hybrid_hit(specs, H[:10], 4, sets, 40)
    assert hit.length == 36
    assert hit.masks[1] == hit.masks[2]


def test_chunked_local_counts_earlier_chunks_as_computed() -> None:
    # chunk 8, block 4, max 15: blocks 0-1 (tokens 0-7) are outside the local window.
    spec = ChunkedLocal(4, 8)
    hit = longest_hybrid_hit([spec], H[:4], 4, [cached(2)], 15)
    assert (hit.length, slots(hit.masks[0])) == (12, [N, N, 2])
    hit = longest_hybrid_hit([spec], H[:4], 4, [set()], 16)
    assert (hit.length, slots(hit.masks[0])) == (16, [N, N, N, N])


def test_is_cached_may_be_a_callable() -> None:
    have = {(0, h) for h in H[:3]}
    hit = longest_hybrid_hit([FullAttention(4)], H[:10], 4, lambda g, h: (g, h) in have, 40)
    assert hit.length == 12


def test_mamba_hit_is_the_last_aligned_state() -> None:
    # Mamba bs 4 next to FA bs 8: states only count at 8-token boundaries.
    specs = [FullAttention(8), Mamba(4)]
    fine = H[:8]
    hit = longest_hybrid_hit(specs, fine, 4, [set(fine[1::2]), cached(3, 6)], 32)
    assert hit.length == 16  # state 6 ends at 28, off the 8-token grid; state 3 ends at 16
    assert slots(hit.masks[1]) == [N, N, N, 3]
    assert slots(hit.masks[0]) == [0, 1]
