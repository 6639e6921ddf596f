"""The router's default hit, without Kafka: the hybrid hit vLLM would compute per node, from what
the nodes' events put in the index (`decide.route` with per-group hash lists).

The worked examples are docs/vllm-behaviour.md §4.6 (block size 4, 10 full blocks = 40 tokens,
sliding window 12 ⇒ 3 blocks needed). `num_tokens` 41 caps nothing: the whole list can be a hit.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpipe.gpu.hit import longest_hybrid_hit
from kvpipe.gpu.specs import FullAttention, KVSpec, Mamba, SlidingWindow
from kvpipe.processors.core.index import Index
from kvpipe.processors.router.decide import route
from kvpipe.processors.router.model import RouteAnswer, RouteError, RouteRequest, decode_request
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockStored

H = list(range(100, 110))  # the request's 10 block hashes (every group at block size 4: one view)
FA = GroupSpec(group_idx=0, kind="full_attention", block_size=4)
SWA = GroupSpec(group_idx=1, kind="sliding_window", block_size=4, sliding_window=12)
MAMBA = GroupSpec(group_idx=2, kind="mamba", block_size=4, mamba_cache_mode="align")
ALL = range(10)


def stored(blocks, group: int, medium: str = "GPU", hashes=H) -> BlockStored:
    return BlockStored(block_hashes=[hashes[i] for i in blocks], parent_block_hash=None, token_ids=[], block_size=4,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def publish(index: Index, node: str, specs, *events, seq: int = 0) -> None:
    env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=1.0, sent_ts=1.0, group_specs=specs)
    index.apply(env, list(events), 0, 0)


def hma(index: Index, groups=(0, 1), **extra) -> RouteAnswer:
    extra.setdefault("num_tokens", 41)
    return route(index, RouteRequest(block_hashes={g: H for g in groups}, **extra), now=1.0)


def hits(index: Index, groups=(0, 1), **extra) -> dict[str, dict]:
    """Nodes with a hit: {"GPU": gpu_tokens, "any": GPU ∪ CPU hit}."""
    return {r.node_id: {"GPU": r.gpu_tokens, "any": r.gpu_tokens + r.loadable_tokens}
            for r in hma(index, groups, **extra).nodes if r.gpu_tokens or r.loadable_tokens}


# -- §4.6 worked examples --------------------------------------------------------------------------


def test_swa_holding_only_the_tail_window_hits_the_full_length_where_prefix_semantics_says_zero():
    index = Index()
    publish(index, "n", [FA, SWA], stored(ALL, 0), stored([7, 8, 9], 1))  # default retention: tail only
    answer = hma(index)
    assert answer.semantics == "hma" and answer.chosen == "n"
    assert hits(index)["n"] == {"GPU": 40, "any": 40} and answer.nodes[0].exact is True
    explained = hma(index, semantics="prefix-per-group").nodes[0]
    assert explained.gpu_tokens == 40 and [g.prefix_blocks["GPU"] for g in explained.groups] == [10, 0]


@pytest.mark.parametrize(("swa_blocks", "expected"), [
    (ALL, 40), ([7, 8, 9], 40), (range(7), 28), ([0, 1, 2, 4, 5, 8, 9], 12), ([0, 1, 2, 3, 5, 6, 8, 9], 16),
    ([0, 1], 8), ([8, 9], 0)])
def test_swa_cached_sets_next_to_a_complete_full_attention_group(swa_blocks, expected):
    index = Index()
    publish(index, "n", [FA, SWA], stored(ALL, 0), stored(swa_blocks, 1))
    assert hits(index).get("n", {"GPU": 0})["GPU"] == expected


def test_full_attention_missing_block_5_caps_the_hit_at_20_tokens():
    index = Index()
    publish(index, "n", [FA, SWA], stored([0, 1, 2, 3, 4, 6, 7, 8, 9], 0), stored(ALL, 1))
    assert hits(index)["n"] == {"GPU": 20, "any": 20}


def test_three_groups_fa_swa_mamba_reach_the_fixed_point_28():
    index = Index()
    publish(index, "n", [FA, SWA, MAMBA], stored(ALL, 0), stored([0, 1, 2, 3, 4, 5, 6, 7, 9], 1),
            stored([6, 9], 2))
    assert hits(index, groups=(0, 1, 2))["n"]["GPU"] == 28


# -- media, ranking, candidates ----------------------------------------------------------------------


def test_the_score_ranks_gpu_then_loadable_tokens_and_suspects_last():
    index = Index()
    publish(index, "gpu40", [FA, SWA], stored(ALL, 0), stored([7, 8, 9], 1))
    publish(index, "cpu40", [FA, SWA], stored(ALL, 0, "CPU"), stored([7, 8, 9], 1, "CPU"))
    publish(index, "gpu20", [FA, SWA], stored(range(5), 0), stored([2, 3, 4], 1))
    # GPU alone reaches 20; with the CPU copies of blocks 5-9 the node reaches 40
    publish(index, "mixed", [FA, SWA], stored(range(5), 0), stored([2, 3, 4], 1),
            stored(range(5, 10), 0, "CPU"), stored([7, 8, 9], 1, "CPU"))
    publish(index, "suspect", [FA, SWA], stored(ALL, 0), stored(ALL, 1), seq=3)  # gap: seqs 0-2 unseen
    rows = hma(index).nodes
    # scores (cap 40): 1.0, (20 + 0.5 · 20)/40, 0.5, 0.5 (tie: more GPU tokens first); suspects last
    assert [(r.node_id, r.gpu_tokens, r.loadable_tokens, r.state) for r in rows] == [
        ("gpu40", 40, 0, "live"), ("mixed", 20, 20, "live"), ("gpu20", 20, 0, "live"), ("cpu40", 0, 40, "live"),
        ("suspect", 40, 0, "suspect")]


def test_sparse_tail_blocks_alone_and_an_fa_interior_block_alone_are_no_hit():
    index = Index()
    publish(index, "tail", [FA, SWA], stored([7, 8, 9], 1))
    publish(index, "interior", [FA, SWA], stored([5], 0))
    assert hits(index) == {}
    assert {r.node_id: r.gpu_tokens for r in hma(index, include_zero=True).nodes} == {"tail": 0, "interior": 0}


def test_a_node_without_specs_or_without_a_hit_rule_is_no_signal_with_the_reason():
    index = Index()
    publish(index, "nospecs", None, stored(ALL, 0), stored(ALL, 1))
    no_align = GroupSpec(group_idx=2, kind="mamba", block_size=4, mamba_cache_mode="all")
    publish(index, "noalign", [FA, SWA, no_align], stored(ALL, 0), stored(ALL, 1), stored(ALL, 2))
    publish(index, "known", [FA, SWA], stored(range(2), 0), stored(range(2), 1))
    answer = hma(index)
    assert [r.node_id for r in answer.nodes] == ["known"]
    reasons = {n.node_id: (n.cause, n.reason) for n in answer.no_signal}
    assert reasons["nospecs"] == ("specs", "no group specs published")
    assert reasons["noalign"][0] == "specs" and "mode 'align'" in reasons["noalign"][1]


def test_num_tokens_caps_the_hit_at_num_tokens_minus_one_rounded_to_the_block():
    index = Index()
    publish(index, "n", [FA, SWA], stored(ALL, 0), stored(ALL, 1))
    assert hits(index, num_tokens=None)["n"]["GPU"] == 40  # no num_tokens: no cap, and not exact
    assert hma(index, num_tokens=None).nodes[0].exact is False
    assert hits(index, num_tokens=41)["n"]["GPU"] == 40
    assert hits(index, num_tokens=40)["n"]["GPU"] == 36  # vLLM recomputes the last token
    short = route(index, RouteRequest(block_hashes={0: H[:3], 1: H[:3]}, num_tokens=13), now=1.0)
    assert short.nodes[0].gpu_tokens == 12


# -- request forms ---------------------------------------------------------------------------------


def test_groups_at_different_block_sizes_need_their_own_lists_else_a_400_names_the_group():
    index = Index()
    swa8 = GroupSpec(group_idx=1, kind="sliding_window", block_size=8, sliding_window=16)
    publish(index, "n", [FA, swa8], stored(ALL, 0), stored([3, 4], 1, hashes=H[1::2]))
    with pytest.raises(RouteError) as exc:
        hma(index, groups=(0, 1))  # the block-size-4 list sent for the block-size-8 group
    assert exc.value.status == 400 and "group 1: 10 hashes, expected 5" in exc.value.detail
    # the per-group form: group 1's own view (every 2nd hash here) at block size 8
    answer = route(index, RouteRequest(block_hashes={0: H, 1: H[1::2]}, num_tokens=41), now=1.0)
    assert answer.nodes[0].gpu_tokens == 40


def test_a_group_missing_from_the_request_borrows_a_same_block_size_list_or_is_noted():
    index = Index()
    publish(index, "n", [FA, SWA], stored(ALL, 0), stored([0, 1, 2, 4, 5, 8, 9], 1))
    row = hma(index, groups=(0,)).nodes[0]
    assert row.gpu_tokens == 12 and row.exact is True  # SWA at bs 4 sees group 0's list
    index2 = Index()
    swa8 = GroupSpec(group_idx=1, kind="sliding_window", block_size=8, sliding_window=16)
    publish(index2, "n", [FA, swa8], stored(ALL, 0))
    row = hma(index2, groups=(0,)).nodes[0]
    assert row.exact is False and row.state == "partial" and "groups [1] not in the request" in row.reason
    assert row.gpu_tokens == 40  # over group 0 only; alignment still lcm(4, 8)


def test_bad_semantics_and_num_tokens_are_400s():
    for body in (b'{"block_hashes": {"0": [1]}, "semantics": "exact"}', b'{"block_hashes": {"0": [1]}, "num_tokens": 0}',
                 b'{"block_hashes": {"0": [1]}, "num_tokens": true}'):
        with pytest.raises(RouteError) as exc:
            route(Index(), decode_request(body), now=1.0)
        assert exc.value.status == 400, body


# -- the route's hit is kvpipe.gpu.hit's hit, over random holdings -------------------------------------------

HASH_UNIT = 4
SPEC_STRATEGY = st.one_of(
    st.sampled_from([4, 8]).map(FullAttention),
    st.tuples(st.sampled_from([4, 8]), st.integers(2, 24)).map(lambda t: SlidingWindow(t[0], t[1])),
    st.sampled_from([4, 8]).map(Mamba),
)


def _group_spec(g: int, spec: KVSpec) -> GroupSpec:
    return spec.to_group_spec(g)


@st.composite
def holdings(draw):
    specs = draw(st.lists(SPEC_STRATEGY, min_size=1, max_size=3))
    num_units = draw(st.integers(1, 24))
    fine = list(range(1000, 1000 + num_units))
    held = []  # per group: (GPU block indices, CPU block indices) in the group's own view
    for s in specs:
        n = num_units // (s.block_size // HASH_UNIT)
        gpu = {i for i in range(n) if draw(st.booleans()) or draw(st.booleans())}
        cpu = {i for i in range(n) if draw(st.integers(0, 3)) == 0}
        held.append((gpu, cpu))
    # the request's length: every group's list is its full blocks, so num_tokens // block_size must
    # give each list's length (a longer prompt would have more hashes); None: uncapped
    num_tokens = draw(st.one_of(st.none(), st.integers(num_units * HASH_UNIT, num_units * HASH_UNIT + HASH_UNIT - 1)))
    return specs, fine, held, num_tokens


@settings(max_examples=300, deadline=None)
@given(holdings())
def test_the_route_hit_equals_gpu_hit_called_directly(case):
    specs, fine, held, num_tokens = case
    views = [fine[s.block_size // HASH_UNIT - 1::s.block_size // HASH_UNIT] for s in specs]
    index = Index()
    events = []
    for g, ((gpu, cpu), view) in enumerate(zip(held, views)):
        events.append(stored(sorted(gpu), g, "GPU", hashes=view))
        events.append(stored(sorted(cpu), g, "CPU", hashes=view))
    publish(index, "n", [_group_spec(g, s) for g, s in enumerate(specs)], *events)
    req = RouteRequest(block_hashes={g: v for g, v in enumerate(views)}, num_tokens=num_tokens, include_zero=True)
    rows = route(index, req, now=1.0).nodes
    max_length = num_tokens - 1 if num_tokens is not None else max(len(v) * s.block_size for s, v in zip(specs, views))
    expected = {}
    for medium, pick in (("GPU", lambda gc: gc[0]), ("any", lambda gc: gc[0] | gc[1])):
        sets = [{view[i] for i in pick(gc)} for gc, view in zip(held, views)]
        expected[medium] = longest_hybrid_hit(specs, fine, HASH_UNIT, sets, max_length).length
    got = {r.node_id: {"GPU": r.gpu_tokens, "any": r.gpu_tokens + r.loadable_tokens} for r in rows}.get("n")
    if got is None:  # a layout vLLM itself has no hit rule for: no signal, with the reason
        assert "n" in {n.node_id for n in route(index, req, now=1.0).no_signal}
    else:
        assert got == expected
