"""Fine-grained (partial) hits and EAGLE against an independent brute-force reading of the rules.

Layouts where vLLM turns partial hits on: at least one Mamba group in align mode with a block
larger than the hash unit `A`, the others full attention (any multiple of `A`) or sliding window at
`A`. Hits land on `A`. Cached entries are given per group at hash-unit positions `j` (the prefix
ending at `(j + 1) * A`): block ends and partial entries alike.

A length L (a multiple of A) is accepted by a group when:
  full attention   L <= F, F = the longest reach of an entry j whose earlier whole blocks are all
                   cached (block ends j' = (i + 1) * k - 1), the search capped at `limit`; with
                   EAGLE the cap is `min(limit + A, hashed)` and F drops one hash unit. vLLM looks
                   each full-attention group up once, full-attention groups first in group order,
                   and `limit` is what the full-attention groups before it left of `max` (a whole
                   block past that limit does not count: its interior needs partial entries);
  Mamba            L == 0 or unit L / A - 1 cached (a state exactly at L);
  sliding window   the `need` blocks before L cached (all of them when L is shorter); with EAGLE
                   one more block after L is cached too and L + A <= hashed.
The hit is the largest L <= max every group accepts (merged equal specs: the intersection).
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.gpu.hit import cdiv, longest_hybrid_hit, partial_hits_enabled
from kvpipe.gpu.specs import FullAttention, KVSpec, Mamba, SlidingWindow

A = 4


def full_reach(bs: int, cached: set[int], limit: int) -> int:
    k = bs // A
    best = 0
    for j in range(limit // A):
        b = j // k
        if j in cached and all((i + 1) * k - 1 in cached for i in range(b)):
            best = max(best, (j + 1) * A)
    return best


def full_limits(specs, eagle, cached, max_length: int, hashed: int) -> dict:
    """Each full-attention spec's F, looked up in vLLM's order (see the module doc)."""
    cur, reach = max_length, {}
    for spec, e, c in zip(specs, eagle, cached):
        if isinstance(spec, FullAttention) and spec not in reach:
            if e:
                f = max(full_reach(spec.block_size, c, min(cur + A, hashed)) - A, 0)
            else:
                f = full_reach(spec.block_size, c, cur)
            reach[spec] = f
            cur = min(cur, f)
    return reach


def accepts(spec: KVSpec, eagle: bool, cached: set[int], length: int, hashed: int, full: dict) -> bool:
    if isinstance(spec, FullAttention):
        return length <= full[spec]
    if isinstance(spec, Mamba):
        return length == 0 or (length // A - 1) in cached
    if isinstance(spec, SlidingWindow):
        assert spec.block_size == A
        need = cdiv(spec.sliding_window - 1, A)
        b = length // A
        if length == 0:
            return True
        if eagle:
            if length + A > hashed:
                return False
            return all(i in cached for i in range(max(0, b - need), b + 1))
        return all(i in cached for i in range(max(0, b - need), b))
    raise AssertionError(spec)


def brute_force(specs, eagle, cached, max_length, hashed) -> int:
    full = full_limits(specs, eagle, cached, max_length, hashed)
    for length in range(max_length // A * A, -1, -A):
        if all(accepts(s, e, c, length, hashed, full) for s, e, c in zip(specs, eagle, cached)):
            return length
    return 0


other_spec = st.one_of(
    st.sampled_from([4, 8, 16]).map(FullAttention),
    st.integers(2, 20).map(lambda w: SlidingWindow(A, w)),
    st.sampled_from([8, 16]).map(Mamba),
)


@st.composite
def scenarios(draw):
    specs = [Mamba(draw(st.sampled_from([8, 16])))] + draw(st.lists(other_spec, min_size=1, max_size=3))
    specs = draw(st.permutations(specs))
    num_units = draw(st.integers(0, 20))
    cached: list[set[int]] = []
    for s in specs:
        density = draw(st.sampled_from([0.2, 0.6, 0.95]))
        k = s.block_size // A
        # block ends are common, interior (partial) entries rarer: vLLM stores one per prompt tail
        cached.append({j for j in range(num_units)
                       if draw(st.floats(0, 1)) < (density if (j + 1) % k == 0 else density / 3)})
    eagle = [draw(st.booleans()) and not isinstance(s, Mamba) for s in specs]
    max_length = draw(st.integers(0, num_units * A))
    return specs, eagle, cached, num_units, max_length


@settings(max_examples=500, deadline=None)
@given(scenarios())
def test_partial_hit_is_the_longest_length_every_group_accepts(scenario) -> None:
    specs, eagle, cached, num_units, max_length = scenario
    assert partial_hits_enabled(specs, A)
    fine = [f"u{j}".encode() for j in range(num_units)]
    sets = [{fine[j] for j in c} for c in cached]
    eagle_groups = {g for g, e in enumerate(eagle) if e}
    got = longest_hybrid_hit(specs, fine, A, sets, max_length, eagle_groups=eagle_groups)
    # Merged equal specs see the intersection of their members' caches and drop if any member does.
    merged_cached = [set.intersection(*(c for t, c in zip(specs, cached) if t == s)) for s in specs]
    merged_eagle = [any(e for t, e in zip(specs, eagle) if t == s) for s in specs]
    assert got.length % A == 0
    assert got.length == brute_force(specs, merged_eagle, merged_cached, max_length, num_units * A)


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_the_gpu_coordinator_agrees_with_the_brute_force(scenario) -> None:
    """The same scenarios through the GPU side's coordinator, its pool holding the entries."""
    from kvpipe.gpu.block_pool import KVBlock
    from kvpipe.gpu.coordinator import KVCacheCoordinator

    specs, eagle, cached, num_units, max_length = scenario
    eagle_groups = {g for g, e in enumerate(eagle) if e}
    co = KVCacheCoordinator(specs, 4, eagle_groups=eagle_groups, prefix_match_unit=A)
    assert co.partial_hits and co.alignment == A
    fine = [f"unit{j:04d}".encode() for j in range(num_units)]
    next_id = 100
    for g, c in enumerate(cached):
        for j in c:
            blk = KVBlock(next_id)
            next_id += 1
            blk.key = fine[j] + g.to_bytes(4, "big")
            co.pool.cached[blk.key] = blk
    blocks, hit, _ = co.find_longest_cache_hit(fine, max_length)
    merged_cached = [set.intersection(*(c for t, c in zip(specs, cached) if t == s)) for s in specs]
    merged_eagle = [any(e for t, e in zip(specs, eagle) if t == s) for s in specs]
    assert hit == brute_force(specs, merged_eagle, merged_cached, max_length, num_units * A)
    for s, blks in zip(specs, blocks):
        if isinstance(s, FullAttention):
            assert len(blks) == cdiv(hit, s.block_size)
