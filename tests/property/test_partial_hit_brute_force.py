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
  sliding window   the `need` blocks before L cached (all of them when L is shorter); with EAGLE's
                   drop one more block after L is cached too and L + A <= hashed.
The hit is where vLLM's coordinator loop settles over those rules (merged equal specs: the intersection): from
`max`, each group in turn (full attention first) takes the largest L up to the current length that it accepts,
until a pass changes nothing (one pass when a full-attention group has one other group beside it). An EAGLE group
applies its drop once, then looks up without it until a group looked up without a drop shrinks the length
(vLLM's `eagle_verified`). So the hit need not be a length every EAGLE group accepts with its drop: one verified
at a longer length keeps a shorter one that its drop would refuse. Apart from that, the hit is the largest L <= max
every group accepts.
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
    """The coordinator's loop (module doc), each group's finder a scan of every length from the top."""
    full = full_limits(specs, eagle, cached, max_length, hashed)
    groups = {}  # spec -> (eagle, cached), in order: full attention first
    for s, e, c in sorted(zip(specs, eagle, cached), key=lambda t: not isinstance(t[0], FullAttention)):
        groups.setdefault(s, (e, c))
    simple = len(groups) == 2 and isinstance(next(iter(groups)), FullAttention)
    hit, verified = max_length, set()
    while True:
        cur = hit
        for s, (e, c) in groups.items():
            if isinstance(s, FullAttention):
                cur = min(cur, full[s])  # looked up once (full_limits), then clamped
                continue
            drop = e and s not in verified
            new = next(n for n in range(cur // A * A, -1, -A) if accepts(s, drop, c, n, hashed, full))
            if drop:
                verified.add(s)
            elif new < cur:
                verified.clear()
            cur = new
        if cur >= hit or simple:
            return min(cur, hit)
        hit = cur


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
def test_partial_hit_is_where_the_coordinator_loop_settles(scenario) -> None:
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


def test_an_eagle_drop_verified_at_a_longer_length_is_not_checked_again() -> None:
    """vLLM's `eagle_verified`: the window groups drop at 16 (the first finds 16, the second 8: its block 3 is
    missing); at 8 the first window group looks up without its drop, so its missing block 2 (past 8) does not count,
    and the hit stays 8 where every EAGLE drop at 8 would have given 4."""
    specs = [Mamba(8), FullAttention(4), SlidingWindow(A, 3), SlidingWindow(A, 2)]
    cached = [set(range(13)), set(range(13)), set(range(13)) - {2}, set(range(13)) - {3}]
    fine = [f"u{j}".encode() for j in range(13)]
    got = longest_hybrid_hit(specs, fine, A, [{fine[j] for j in c} for c in cached], 16, eagle_groups={2, 3})
    assert got.length == 8
    assert brute_force(specs, [False, False, True, True], cached, 16, 13 * A) == 8
    # every EAGLE drop checked at each length instead: the first window group needs its block 2 at 8
    full = full_limits(specs, [False, False, True, True], cached, 16, 13 * A)
    assert max(n for n in range(0, 17, A) if all(accepts(s, e, c, n, 13 * A, full) for s, e, c in
                                                   zip(specs, [False, False, True, True], cached))) == 4
