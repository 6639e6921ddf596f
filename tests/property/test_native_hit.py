"""The native hit search (native/, `kvpipe_native`) equals the reference (`kvpipe.gpu.hit` through
`hma.hybrid_hit`) on random layouts and random held sets: merged equal-spec groups, mixed
block sizes, sink full attention (full attention's rule, its own spec group), sliding windows,
Mamba (align, and the refused modes), chunked local, partial hits at the hash unit, EAGLE, subsets of a node's groups, several nodes of different layouts in one call,
and held positions past the lists. Errors (layouts `kvpipe.gpu.hit` refuses) must be equal too.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.gpu.hit import default_alignment, partial_hits_enabled
from kvpipe.gpu.layout import NodeLayout, node_layout
from kvpipe.gpu.specs import ChunkedLocal, CrossAttention, FullAttention, KVSpec, Mamba, SinkFullAttention, SlidingWindow
from kvpipe.processors.router.hits import HitSearch, Job
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from tests.nativecheck import require_native_core

require_native_core()


@st.composite
def spec(draw, unit: int, scale: int = 1) -> KVSpec:
    bs = unit * draw(st.sampled_from([1, 1, 2, 4]))
    kind = draw(st.sampled_from(["full", "full", "sink", "sliding", "mamba", "chunked", "cross"]))
    if kind == "full":
        return FullAttention(bs)
    if kind == "sink":  # full attention's rule under its own kind: never merged with a full-attention group
        return SinkFullAttention(bs, sink_len=draw(st.sampled_from([None, bs, 4 * bs])))
    if kind == "sliding":
        return SlidingWindow(bs, sliding_window=draw(st.integers(1, 6 * scale * bs)))
    if kind == "mamba":
        return Mamba(bs, mode=draw(st.sampled_from(["align", "align", "align", "none"])))
    if kind == "chunked":
        return ChunkedLocal(bs, attention_chunk_size=bs * draw(st.integers(1, 4)))
    return CrossAttention(bs)


@st.composite
def held(draw, n: int) -> set[int]:
    """Positions held: random ones, mostly over dense runs (a prefix, a tail) so hits are not all 0."""
    out = draw(st.sets(st.integers(0, n + 2), max_size=n + 3))
    if draw(st.integers(0, 3)):
        a, b = sorted(draw(st.integers(0, n + 1)) for _ in range(2))
        out |= set(range(a)) if draw(st.booleans()) else set(range(a, b))
        out -= draw(st.sets(st.integers(0, n), max_size=2))  # a few holes
    return out


@st.composite
def node_job(draw, scale: int = 1) -> Job:
    """`scale` > 1: lists and windows that many times longer (runs across 64-position words)."""
    # 3: block sizes and alignments that are not powers of two (divisions, where powers of two shift)
    unit = draw(st.sampled_from([2, 4, 3]))
    pool = draw(st.lists(spec(unit, scale), min_size=1, max_size=3))  # drawing from a pool merges equal specs
    if draw(st.integers(0, 3)) == 0:  # partial hits at the hash unit: Mamba above the unit, full attention
        pool += [Mamba(unit * 4), FullAttention(unit * draw(st.sampled_from([1, 2, 4])))]
    specs = tuple(draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4)))
    n = len(specs)
    eagle = frozenset(draw(st.sets(st.integers(0, n - 1), max_size=2)))
    alignment = default_alignment(specs, unit)
    model = NodeLayout(tuple(range(n)), specs, unit, alignment, partial_hits_enabled(specs, unit), eagle)
    groups = tuple(g for g in range(n) if draw(st.booleans()) or g == 0)
    num_tokens = draw(st.integers(1, 40 * scale * unit))
    lens = []
    for g in groups:
        natural = num_tokens // model.list_unit(g)
        lens.append(draw(st.one_of(st.just(natural), st.integers(0, natural + 3))))
    sets = [draw(held(ln)) for ln in lens]
    cap = draw(st.one_of(st.just(num_tokens - 1), st.integers(0, num_tokens + 2 * unit)))
    return Job(model, groups, tuple(lens), sets, cap)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(node_job(), min_size=1, max_size=5))
def test_native_search_equals_the_reference(jobs: list[Job]) -> None:
    native = HitSearch("native")
    assert native.engine == "native"
    want = HitSearch("python").search(jobs)
    assert native.search(jobs) == want
    # the layouts are now cached natively: a second call answers the same
    assert native.search(jobs[::-1]) == want[::-1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(node_job(scale=12), min_size=1, max_size=3))
def test_native_search_equals_the_reference_on_long_lists(jobs: list[Job]) -> None:
    """Lists of hundreds of positions: the native finders read runs a 64-bit word at a time."""
    assert HitSearch("native").search(jobs) == HitSearch("python").search(jobs)


def test_the_engines_differ_only_in_speed_on_a_hybrid_node() -> None:
    """A fixed case through the fixed point: merged full attention with EAGLE reaches 6 blocks and
    drops one (80 tokens); below 80 the window's rightmost two-block run is blocks 1..2 (48)."""
    specs = (FullAttention(16), SlidingWindow(16, sliding_window=33), FullAttention(16))
    model = NodeLayout((0, 1, 2), specs, 16, 16, False, frozenset({2}))
    job = Job(model, (0, 1, 2), (8, 8, 8), [set(range(6)), {1, 2, 4, 5}, set(range(6))], 127)
    native, = HitSearch("native").search([job])
    assert native == HitSearch("python").search([job])[0]
    assert not isinstance(native, str) and native.length == 48
    assert native.spans[1] == (1, 3)  # [False, True, True]


def test_a_published_sink_layout_is_searched_natively_with_the_full_attention_code() -> None:
    """Sink full attention from the wire (`node_layout`) through the router's search: its own spec group
    (next to a full-attention group of the same block size), the full rule's native code, equal answers."""
    published = [GroupSpec(group_idx=0, kind="sink_full_attention", block_size=16, sink_len=32),
                 GroupSpec(group_idx=1, kind="full_attention", block_size=16),
                 GroupSpec(group_idx=2, kind="sliding_window", block_size=16, sliding_window=33)]
    model = node_layout(published, HashConfig(hash_block_size=16))
    search = HitSearch("native")
    layout = search.native_layout(model, (0, 1, 2))
    assert layout is not None, "the native engine models the sink group (full attention's rule)"
    assert dict(kvpipe_native_rules(search))["full"] == 0
    job = Job(model, (0, 1, 2), (8, 8, 8), [set(range(6)), set(range(5)), {1, 2, 3, 4, 5}], 127)
    got, = search.search([job])
    assert got == HitSearch("python").search([job])[0]
    assert not isinstance(got, str) and got.length == 80  # the full-attention group's 5 blocks cap the sink's 6
    assert got.spans[0] == (0, 5) and got.spans[1] == (0, 5)


def kvpipe_native_rules(search: HitSearch) -> list[tuple[str, int]]:
    """The hit rules the built engine knows (`HitEngine.RULES`), which must be native/src/hit_rules.toml's."""
    rules = list(search.native_engine.RULES)
    table = tomllib.loads((Path(__file__).resolve().parents[2] / "native" / "src" / "hit_rules.toml").read_text())
    assert dict(rules) == table
    return rules
