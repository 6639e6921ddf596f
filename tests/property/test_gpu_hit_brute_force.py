"""The hybrid hit equals a brute-force definition: the longest aligned length L <= max such that
every group's own rule accepts L.

A group accepts L (blocks viewed at its size, `b = L // block_size`, L a multiple of it):
  full attention   blocks 0..b-1 all cached;
  sliding window   the `need` blocks before L cached, or (L shorter than the window) all of them;
  Mamba            L == 0, or the state block ending at L cached.
Merged equal specs must all accept. The property holds for any mix where one pass or the fixed
point converges to the longest mutually accepted length — which is what the coordinator promises.
"""
from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.gpu.hit import cdiv, longest_hybrid_hit
from kvpipe.gpu.specs import FullAttention, KVSpec, Mamba, SlidingWindow

HASH_UNIT = 4


def accepts(spec: KVSpec, cached: set[int], length: int) -> bool:
    """`cached` holds block indices in the group's own block view."""
    bs = spec.block_size
    if length % bs:
        return False
    b = length // bs
    if isinstance(spec, FullAttention):
        return all(i in cached for i in range(b))
    if isinstance(spec, SlidingWindow):
        need = cdiv(spec.sliding_window - 1, bs)
        return all(i in cached for i in range(max(0, b - need), b))
    if isinstance(spec, Mamba):
        return b == 0 or (b - 1) in cached
    raise AssertionError(spec)


def brute_force(specs: list[KVSpec], cached: list[set[int]], max_length: int, alignment: int) -> int:
    for length in range(max_length // alignment * alignment, -1, -alignment):
        if all(accepts(s, c, length) for s, c in zip(specs, cached)):
            return length
    return 0


spec_strategy = st.one_of(
    st.sampled_from([4, 8]).map(FullAttention),
    st.tuples(st.sampled_from([4, 8]), st.integers(2, 24)).map(lambda t: SlidingWindow(t[0], t[1])),
    st.sampled_from([4, 8]).map(Mamba),
)


@st.composite
def scenarios(draw):
    specs = draw(st.lists(spec_strategy, min_size=1, max_size=4))
    num_units = draw(st.integers(0, 24))
    fine = [f"u{i}".encode() for i in range(num_units)]
    cached: list[set[int]] = []
    for s in specs:
        k = s.block_size // HASH_UNIT
        num_blocks = num_units // k
        density = draw(st.sampled_from([0.3, 0.7, 0.95]))
        cached.append({i for i in range(num_blocks) if draw(st.floats(0, 1)) < density})
    max_length = draw(st.integers(0, num_units * HASH_UNIT))
    return specs, fine, cached, max_length


@settings(max_examples=400, deadline=None)
@given(scenarios())
def test_hybrid_hit_is_the_longest_length_every_group_accepts(scenario) -> None:
    specs, fine, cached, max_length = scenario
    sets = []
    for s, blocks in zip(specs, cached):
        k = s.block_size // HASH_UNIT
        sets.append({fine[(i + 1) * k - 1] for i in blocks})
    alignment = math.lcm(*(s.block_size for s in specs))
    got = longest_hybrid_hit(specs, fine, HASH_UNIT, sets, max_length)
    # Merged equal specs see the intersection of their members' caches.
    merged = [set.intersection(*(c for t, c in zip(specs, cached) if t == s)) for s in specs]
    assert got.length == brute_force(specs, merged, max_length, alignment)
    for s, mask in zip(specs, got.masks):
        if isinstance(s, FullAttention):
            assert len(mask) == cdiv(got.length, s.block_size)
