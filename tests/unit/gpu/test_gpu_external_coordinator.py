"""External pool: the same hybrid hit over `(group, hash)` membership, load/store masks, config checks."""
from __future__ import annotations

import pytest

from kvpipe.gpu.external_coordinator import ExternalCoordinator, validate_external_config
from kvpipe.gpu.specs import CrossAttention, FullAttention, Mamba, SlidingWindow

H = [f"h{i}".encode() for i in range(8)]


def test_hole_in_full_attention_limits_the_external_hit() -> None:
    # FA + SWA, bs 16: FA lacks block 1, so only the first 16 tokens can be loaded.
    co = ExternalCoordinator([FullAttention(16), SlidingWindow(16, 32)])
    present = {(0, H[0]), (0, H[2]), (0, H[3])} | {(1, h) for h in H[:4]}
    hit = co.find_longest_cache_hit(H[:4], 63, present)
    assert hit.length == 16
    assert hit.masks == ([True], [True])


def test_load_masks_fetch_only_the_window_tail() -> None:
    co = ExternalCoordinator([FullAttention(16), SlidingWindow(16, 32)])
    masks = co.load_masks(H[:4], 64)
    assert masks == ([True] * 4, [False, False, True, True])


def test_a_group_missing_the_hash_blocks_the_hit_for_all() -> None:
    co = ExternalCoordinator([FullAttention(16), FullAttention(16)])  # merged: both must hold it
    assert co.find_longest_cache_hit(H[:2], 32, {(0, H[0]), (0, H[1]), (1, H[0])}).length == 16


def test_store_masks_keep_only_reachable_window_blocks_and_no_mamba() -> None:
    co = ExternalCoordinator([FullAttention(32), SlidingWindow(8, 8), Mamba(32)])
    fa, swa, mamba = co.store_masks(64)
    assert fa is None
    assert swa == [False, False, False, True, False, False, False, True]
    assert mamba == [False, False]


@pytest.mark.parametrize("specs, kwargs, message", [
    ([FullAttention(16), CrossAttention(16)], {}, "group 1: cross-attention"),
    ([FullAttention(16), Mamba(16, mode="all")], {}, "group 1: Mamba mode 'all'"),
    ([FullAttention(16), SlidingWindow(16, 32)], {"decode_context_parallel": 2}, "context parallelism"),
    ([CrossAttention(16)], {}, "no prefix-cacheable"),
])
def test_unsupported_layouts_are_rejected_with_the_reason(specs, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        validate_external_config(specs, **kwargs)


def test_single_group_with_context_parallelism_is_fine() -> None:
    validate_external_config([FullAttention(16)], prefill_context_parallel=2)
