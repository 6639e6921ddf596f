"""Fine-grained (partial) hits, explicit hash units and EAGLE margins in the pure rules (kvpipe.gpu.hit),
from vllm-semantics §2.5, §4.2-4.3 and the layouts of today's hybrid models."""
from __future__ import annotations

import pytest

from kvpipe.gpu.finders import find_full, find_mamba
from kvpipe.gpu.hit import default_alignment, longest_hybrid_hit, partial_hits_enabled
from kvpipe.gpu.specs import ChunkedLocal, FullAttention, Mamba, SlidingWindow, resolve_block_sizes


def fine(n: int) -> list[bytes]:
    return [f"u{j}".encode() for j in range(n)]


def test_partial_hits_turn_on_only_for_mamba_align_above_the_unit() -> None:
    assert partial_hits_enabled([FullAttention(16), Mamba(64)], 16)
    assert not partial_hits_enabled([FullAttention(16), Mamba(16)], 16)  # state block = unit
    assert not partial_hits_enabled([FullAttention(16), Mamba(64, "all")], 16)
    assert not partial_hits_enabled([Mamba(64)], 16)  # one group hits on its block
    # a sliding-window group coarser than the unit has no fine-grained finder: off
    assert not partial_hits_enabled([FullAttention(16), SlidingWindow(32, 128), Mamba(64)], 16)
    assert partial_hits_enabled([FullAttention(16), SlidingWindow(16, 128), Mamba(64)], 16)
    assert not partial_hits_enabled([FullAttention(16), ChunkedLocal(32, 64), Mamba(64)], 16)
    assert default_alignment([FullAttention(16), Mamba(64)], 16) == 16
    assert default_alignment([FullAttention(16), SlidingWindow(32, 128), Mamba(64)], 16) == 64


def test_explicit_hash_unit_below_the_gcd() -> None:
    specs = [FullAttention(64), Mamba(128)]
    assert resolve_block_sizes(specs) == (128, 64)
    assert resolve_block_sizes(specs, prefix_match_unit=16) == (128, 16)
    with pytest.raises(ValueError, match="multiple"):
        resolve_block_sizes(specs, prefix_match_unit=48)
    with pytest.raises(ValueError, match="one KV cache group"):
        resolve_block_sizes([FullAttention(16)], prefix_match_unit=8)
    assert resolve_block_sizes([FullAttention(16)], prefix_match_unit=16) == (16, 16)
    # a non-align Mamba group backs off to the lcm, the explicit unit included (as vLLM)
    assert resolve_block_sizes([FullAttention(16), Mamba(64, "all")], prefix_match_unit=8) == (64, 64)


def test_full_attention_probes_the_units_inside_the_next_block() -> None:
    h = fine(12)  # block 16 over unit 4: k = 4
    cached = {h[3], h[7], h[9]}  # blocks 0, 1 whole; a partial entry at unit 9 (40 tokens)
    found, hit = find_full(h, 48, 16, 4, cached.__contains__)
    assert hit == 40 and len(found) == 3
    # interior probing stops at the cap
    assert find_full(h, 39, 16, 4, cached.__contains__)[1] == 32
    # EAGLE drops one hash unit, not one block
    assert find_full(h, 48, 16, 4, cached.__contains__, drop_eagle=True)[1] == 36
    # not fine-grained (alignment = block): only block ends count
    assert find_full(h[3::4], 48, 16, 16, {h[3], h[7]}.__contains__)[1] == 32


def test_mamba_takes_the_highest_cached_unit() -> None:
    h = fine(12)
    found, hit = find_mamba(h, 48, 16, 4, {h[3], h[9]}.__contains__)
    assert hit == 40 and found == [None, None, True]  # block index 9 // 4 = 2
    assert find_mamba(h, 39, 16, 4, {h[3], h[9]}.__contains__)[1] == 16


def test_issue_examples_partial_state_inside_a_768_block() -> None:
    """Kimi-like MLA at 64 + Mamba align at 768, unit 16. A prompt's tail state at 624 tokens is a
    partial entry of Mamba block 0 and of FA block 9: vLLM reuses 624, the block rule finds 0."""
    specs = [FullAttention(64), Mamba(768)]
    h = fine(200)
    fa = {h[(i + 1) * 4 - 1] for i in range(9)} | {h[624 // 16 - 1]}
    mamba = {h[624 // 16 - 1]}
    got = longest_hybrid_hit(specs, h, 16, [fa, mamba], 2000)
    assert got.length == 624
    assert longest_hybrid_hit(specs, h, 16, [fa, mamba], 2000, alignment=768).length == 0
    # a state at 2272 after a whole block at 768: FA cached up to 2304
    fa2 = {h[(i + 1) * 4 - 1] for i in range(36)}
    mamba2 = {h[767 // 16], h[2272 // 16 - 1]}
    assert longest_hybrid_hit(specs, h, 16, [fa2, mamba2], 3000).length == 2272
    assert longest_hybrid_hit(specs, h, 16, [fa2, mamba2], 3000, alignment=768).length == 768


def test_eagle_margin_is_one_unit_when_fine_grained() -> None:
    specs = [FullAttention(64), Mamba(128)]
    h = fine(16)  # 256 tokens at unit 16
    every = set(h)
    # FA EAGLE looks one unit past the cap 40 (56: no whole block, units up to 48), drops one unit
    assert longest_hybrid_hit(specs, h, 16, [every, every], 40, eagle_groups={0}).length == 32
    # a whole-block margin would reach 104 and land past the cap: the unit margin keeps it below
    assert longest_hybrid_hit(specs, h, 16, [every, every], 100, eagle_groups={0}).length == 96
    fa_only_blocks = {h[3], h[7]}  # no partial entries: EAGLE drops a unit off the block end
    assert longest_hybrid_hit(specs, h, 16, [fa_only_blocks, every], 200, eagle_groups={0}).length == 112


def test_dsv4_like_layout_has_no_partial_hits_and_lands_on_the_lcm() -> None:
    """DeepSeek-V4-like: MLA at 256 plus sliding-window MLA groups at 64, 64, 4 and 8."""
    specs = [FullAttention(256), SlidingWindow(64, 128), SlidingWindow(64, 512), SlidingWindow(4, 128),
             SlidingWindow(8, 128)]
    assert resolve_block_sizes(specs) == (256, 4)
    assert not partial_hits_enabled(specs, 4)
    h = fine(512)  # 2048 tokens
    every = set(h)
    assert longest_hybrid_hit(specs, h, 4, [every] * 5, 2047).length == 1792
