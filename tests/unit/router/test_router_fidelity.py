"""The router's hit on today's hybrid layouts, partial entries and EAGLE (kvpipe.processors.router.decide and
kvpipe.processors.router.hma), against the pure rules (kvpipe.gpu.hit) on the node's true cache state."""
from __future__ import annotations

import random

from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.gpu.hit import longest_hybrid_hit
from kvpipe.gpu.layout import node_layout
from kvpipe.processors.core.index import Index
from kvpipe.processors.router.decide import route
from kvpipe.processors.router.model import RouteRequest
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from tests.unit.router.router_fixtures import Publisher, fa, mamba, stored, swa

CFG16 = HashConfig(algorithm="sha256", hash_block_size=16)
# MLA at 64 + Mamba at 768 hash at the gcd 64 by default; an explicit unit of 16 (prefix_match_unit)
UNIT16 = HashConfig(algorithm="sha256", hash_block_size=16, prefix_match_unit=16)


def fine(cfg: HashConfig, tokens: list[int]) -> list:
    return [external_hash(d, cfg.int_hashes)
            for d in hash_request_blocks(hasher_from_config(cfg), tokens, cfg.hash_block_size)]


def kimi_like(n_mamba: int = 3) -> list[GroupSpec]:
    return [GroupSpec(group_idx=0, kind="mla_attention", block_size=64)] + [mamba(g, 768) for g in range(1, n_mamba + 1)]


def test_kimi_like_partial_state_is_routed_exactly() -> None:
    """MLA at 64 + Mamba align at 768, unit 16: a prompt tail cached at 624 tokens (a partial entry
    of FA block 9 and of every Mamba group's block 0). vLLM reuses 624; block ends alone say 0."""
    specs = kimi_like()
    assert node_layout(specs, UNIT16).alignment == 16
    rng = random.Random(1)
    tokens = [rng.randrange(30_000) for _ in range(1000)]
    u = fine(UNIT16, tokens)
    index = Index()
    node = Publisher(index, "kimi", specs, UNIT16)
    events = [stored([u[(i + 1) * 4 - 1] for i in range(9)], 0, 64), stored([u[624 // 16 - 1]], 0, 16)]
    events += [stored([u[624 // 16 - 1]], g, 16) for g in range(1, 4)]  # partial entries: block_size = unit
    node.send(events)
    ans = route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0)
    (row,) = ans.nodes
    assert row.gpu_tokens == 624 and row.exact
    assert [(g.group_idx, g.blocks) for g in row.groups] == [(0, 10), (1, 1), (2, 1), (3, 1)]
    # the same from the pure rules on the node's own holdings
    held = [set(e.block_hashes) for e in events[1:2]]
    fa_held = set(events[0].block_hashes) | held[0]
    assert longest_hybrid_hit([node_layout(specs, UNIT16).specs[i] for i in range(4)], u, 16,
                              [fa_held] + [held[0]] * 3, 999).length == 624
    # a Mamba group missing the state caps the hit: merged equal specs must all hold it
    node.send([BlockRemovedFor(u[624 // 16 - 1], 3)])
    assert route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0).nodes[0].gpu_tokens == 0
    # block-level lists cannot name the partial entries: a lower bound, said so
    ans = route(index, RouteRequest(block_hashes={0: u[3::4][:15]}, num_tokens=1000, include_zero=True), now=100.0)
    assert all(not r.exact and "partial entries" in (r.reason or "") for r in ans.nodes)


def BlockRemovedFor(h, g):  # noqa: N802 - reads as an event constructor
    from tests.unit.router.router_fixtures import removed

    return removed([h], g)


def test_partial_entry_after_whole_blocks_2272() -> None:
    """FA at 64 holding 36 whole blocks, Mamba 768 with a state at block end 768 and a partial state
    at 2272: vLLM reuses 2272 (the lcm rule: 768)."""
    specs = [fa(0, 64), mamba(1, 768)]
    rng = random.Random(2)
    tokens = [rng.randrange(30_000) for _ in range(2400)]
    u = fine(UNIT16, tokens)
    index = Index()
    Publisher(index, "n", specs, UNIT16).send([
        stored([u[(i + 1) * 4 - 1] for i in range(36)], 0, 64),
        stored([u[767 // 16]], 1, 768), stored([u[2272 // 16 - 1]], 1, 16)])
    (row,) = route(index, RouteRequest(token_ids=tokens), now=100.0).nodes
    assert row.gpu_tokens == 2272
    # block-level hash lists cannot probe partial entries inside blocks: a lower bound, said so
    (row,) = route(index, RouteRequest(block_hashes={0: u[3::4], 1: u[47::48]}, num_tokens=2400), now=100.0).nodes
    assert row.gpu_tokens == 768 and not row.exact


def test_eagle_group_drops_one_block_in_the_router() -> None:
    rng = random.Random(3)
    tokens = [rng.randrange(30_000) for _ in range(65)]
    u = fine(CFG16, tokens)
    index = Index()
    Publisher(index, "plain", [fa(0, 16)], CFG16).send([stored(u[:4], 0, 16)])
    eagle = GroupSpec(group_idx=0, kind="full_attention", block_size=16, eagle=True)
    Publisher(index, "eagle", [eagle], CFG16).send([stored(u[:4], 0, 16)])
    rows = {r.node_id: r.gpu_tokens for r in route(index, RouteRequest(token_ids=tokens), now=100.0).nodes}
    assert rows == {"plain": 64, "eagle": 48}
    by_hashes = {r.node_id: r.gpu_tokens
                 for r in route(index, RouteRequest(block_hashes={0: u}, num_tokens=65), now=100.0).nodes}
    assert by_hashes == {"plain": 64, "eagle": 48}


def test_gemma3_three_sliding_and_one_full() -> None:
    """Gemma-3: 3 sliding-window groups (window 1024, merged: equal specs) + 1 full, block 16. With
    default retention the sliding groups cache only the tail window."""
    specs = [swa(0, 16, 1024), swa(1, 16, 1024), swa(2, 16, 1024), fa(3, 16)]
    rng = random.Random(4)
    tokens = [rng.randrange(30_000) for _ in range(2049)]
    u = fine(CFG16, tokens)
    need = -(-1023 // 16)
    index = Index()
    tail = u[128 - need:128]
    Publisher(index, "g", specs, CFG16).send([stored(u[:128], 3, 16)] + [stored(tail, g, 16) for g in range(3)])
    (row,) = route(index, RouteRequest(token_ids=tokens), now=100.0).nodes
    assert row.gpu_tokens == 2048
    # one sliding group lacking a tail block: the merged lookup misses there, no full run remains
    index2 = Index()
    Publisher(index2, "g", specs, CFG16).send([stored(u[:128], 3, 16)] + [stored(tail, g, 16) for g in range(2)]
                                              + [stored(tail[1:], 2, 16)])
    (row,) = route(index2, RouteRequest(token_ids=tokens), now=100.0).nodes
    assert row.gpu_tokens == 0


def test_dsv4_like_sparse_groups() -> None:
    """DeepSeek-V4-like: MLA at 256 plus sliding-window MLA groups at 64, 64, 4 and 8 (unit 4;
    no Mamba, so hits land on the lcm 256). Each sliding group holds only its tail window."""
    specs = [GroupSpec(group_idx=0, kind="mla_attention", block_size=256),
             GroupSpec(group_idx=1, kind="sliding_window_mla", block_size=64, sliding_window=128),
             GroupSpec(group_idx=2, kind="sliding_window_mla", block_size=64, sliding_window=512),
             GroupSpec(group_idx=3, kind="sliding_window_mla", block_size=4, sliding_window=128),
             GroupSpec(group_idx=4, kind="sliding_window_mla", block_size=8, sliding_window=128)]
    cfg = HashConfig(algorithm="sha256", hash_block_size=4)
    layout = node_layout(specs, cfg)
    assert (layout.alignment, layout.partial_hits) == (256, False)
    rng = random.Random(5)
    tokens = [rng.randrange(30_000) for _ in range(1100)]
    u = fine(cfg, tokens)

    def tail_at(bs: int, window: int, end: int) -> list:
        k, need = bs // 4, -(-(window - 1) // bs)
        return [u[(i + 1) * k - 1] for i in range(end // bs - need, end // bs)]

    index = Index()
    events = [stored([u[(i + 1) * 64 - 1] for i in range(4)], 0, 256)]  # 1024 tokens of MLA
    for g, (bs, w) in enumerate([(64, 128), (64, 512), (4, 128), (8, 128)], start=1):
        events.append(stored(tail_at(bs, w, 1024), g, bs))
    Publisher(index, "dsv4", specs, cfg).send(events)
    (row,) = route(index, RouteRequest(token_ids=tokens), now=100.0).nodes
    assert row.gpu_tokens == 1024 and row.exact
    # the window-512 group lacking its first tail block: no run ends at 1024; 768 needs other tails
    index2 = Index()
    Publisher(index2, "dsv4", specs, cfg).send(events[:2] + [stored(tail_at(64, 512, 1024)[1:], 2, 64)] + events[3:])
    (row,) = route(index2, RouteRequest(token_ids=tokens), now=100.0).nodes
    assert row.gpu_tokens == 0


def test_eagle_identical_prompt_keeps_one_block() -> None:
    """vLLM's test_eagle_identical_prompt_hit: a 37-token prompt cached in 2 blocks of 16; resending
    it hits 1 block with EAGLE (the lookup reaches 32, then drops a block), 2 without."""
    rng = random.Random(6)
    tokens = [rng.randrange(30_000) for _ in range(37)]
    u = fine(CFG16, tokens)
    index = Index()
    Publisher(index, "eagle", [GroupSpec(group_idx=0, kind="full_attention", block_size=16, eagle=True)],
              CFG16).send([stored(u[:2], 0, 16)])
    Publisher(index, "plain", [fa(0, 16)], CFG16).send([stored(u[:2], 0, 16)])
    rows = {r.node_id: r.gpu_tokens for r in route(index, RouteRequest(token_ids=tokens), now=100.0).nodes}
    assert rows == {"eagle": 16, "plain": 32}


LAYOUTS = {
    # name: (group specs, hash config)
    "fa16+swa(eagle)": ([fa(0, 16), GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=40,
                                              eagle=True)], CFG16),
    "fa16(eagle)+mamba64": ([GroupSpec(group_idx=0, kind="full_attention", block_size=16, eagle=True),
                             mamba(1, 64)], CFG16),
    "mla64(eagle)+2mamba768/u16": ([GroupSpec(group_idx=0, kind="mla_attention", block_size=64, eagle=True),
                                    mamba(1, 768), mamba(2, 768)], UNIT16),
    "fa32+swa16+mamba64": ([fa(0, 32), swa(1, 16, 48), mamba(2, 64)], CFG16),
}


def test_router_equals_the_pure_rules_with_partial_entries_and_eagle() -> None:
    """Random holdings, block ends and partial entries (one hash unit, block_size = unit), through
    the index and the token-id router: the hit equals kvpipe.gpu.hit's on the node's true holdings."""
    rng = random.Random(7)
    checked = partial_hits = 0
    for name, (specs, cfg) in LAYOUTS.items():
        layout = node_layout(specs, cfg)
        for trial in range(12):
            tokens = [rng.randrange(30_000) for _ in range(rng.randint(40, 1700))]
            u = fine(cfg, tokens)
            unit = cfg.hash_block_size
            index = Index()
            holdings = []
            events = []
            for gs in specs:
                k = gs.block_size // unit
                ends = [j for j in range(len(u)) if (j + 1) % k == 0 and rng.random() < 0.8]
                inner = [j for j in range(len(u)) if (j + 1) % k and rng.random() < 0.15]
                if rng.random() < 0.8:  # a prefix, the way caches usually look
                    cut = rng.randint(0, len(u))
                    ends = [j for j in ends if j < cut] + [j for j in ends if j >= cut and rng.random() < 0.3]
                holdings.append({u[j] for j in ends + inner})
                if ends:
                    events.append(stored([u[j] for j in ends], gs.group_idx, gs.block_size))
                events += [stored([u[j]], gs.group_idx, unit) for j in inner]
            Publisher(index, "n", specs, cfg).send(events)
            want = longest_hybrid_hit(layout.specs, u, unit, holdings, len(tokens) - 1, layout.alignment,
                                      {i for i, gs in enumerate(specs) if gs.eagle})
            (row,) = route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0).nodes
            assert row.gpu_tokens == want.length, (name, trial)
            checked += 1
            partial_hits += want.length % layout.alignment == 0 and want.length % max(
                gs.block_size for gs in specs) != 0
    assert checked == 48 and partial_hits > 5, partial_hits


def test_prefix_per_group_counts_whole_blocks_on_a_partial_node() -> None:
    specs = kimi_like(1)
    rng = random.Random(8)
    tokens = [rng.randrange(30_000) for _ in range(1000)]
    u = fine(UNIT16, tokens)
    index = Index()
    Publisher(index, "k", specs, UNIT16).send([stored([u[(i + 1) * 4 - 1] for i in range(9)], 0, 64),
                                              stored([u[38]], 0, 16), stored([u[38]], 1, 16)])
    (row,) = route(index, RouteRequest(token_ids=tokens, semantics="prefix-per-group"), now=100.0).nodes
    assert row.gpu_tokens == 624
    assert [g.prefix_blocks for g in row.groups] == [{"GPU": 9, "any": 9}, {"GPU": 0, "any": 0}]


def test_the_hash_unit_chain_routes_as_token_ids_do_partial_entries_included() -> None:
    """A router that hashes itself sends the prompt's hash-unit chain (`unit_hashes`): every group's list is a view
    of it and groups searched at the unit get the chain itself, so partial entries count exactly, as with token
    ids, where per-group block lists can only give a lower bound."""
    rng = random.Random(11)
    checked = partial = 0
    for name, (specs, cfg) in LAYOUTS.items():
        for trial in range(10):
            tokens = [rng.randrange(30_000) for _ in range(rng.randint(40, 1700))]
            u = fine(cfg, tokens)
            unit = cfg.hash_block_size
            index = Index()
            events = []
            for gs in specs:
                k = gs.block_size // unit
                cut = rng.randint(0, len(u))
                ends = [j for j in range(len(u)) if (j + 1) % k == 0 and j < cut and rng.random() < 0.9]
                inner = [j for j in range(len(u)) if (j + 1) % k and rng.random() < 0.15]
                if ends:
                    events.append(stored([u[j] for j in ends], gs.group_idx, gs.block_size))
                events += [stored([u[j]], gs.group_idx, unit) for j in inner]
            Publisher(index, "n", specs, cfg).send(events)
            by_tokens = route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0)
            by_units = route(index, RouteRequest(unit_hashes=u, hash_block_size=unit, num_tokens=len(tokens),
                                                 include_zero=True), now=100.0)
            assert by_units.nodes == by_tokens.nodes and by_units.chosen == by_tokens.chosen, (name, trial)
            assert by_units.nodes[0].exact and by_units.hash_configs == []
            checked += 1
            row = by_tokens.nodes[0]
            partial += row.gpu_tokens % max(gs.block_size for gs in specs) != 0
    assert checked == 10 * len(LAYOUTS) and partial > 3, partial


def test_unit_hashes_are_checked_and_other_units_are_no_signal() -> None:
    from kvpipe.processors.router.model import RouteError

    specs = kimi_like()
    tokens = list(range(1000))
    u = fine(UNIT16, tokens)
    index = Index()
    Publisher(index, "kimi", specs, UNIT16).send([stored([u[3]], 0, 64)])
    for bad, says in ((RouteRequest(unit_hashes=u, num_tokens=1000), "hash_block_size"),
                      (RouteRequest(unit_hashes=u, hash_block_size=16), "num_tokens"),
                      (RouteRequest(unit_hashes=u[:-1], hash_block_size=16, num_tokens=1000), "expected 62"),
                      (RouteRequest(unit_hashes=u, hash_block_size=16, num_tokens=1000, token_ids=tokens), "exactly one"),
                      (RouteRequest(token_ids=tokens, hash_block_size=16), "goes with unit_hashes")):
        try:
            route(index, bad, now=100.0)
        except RouteError as exc:
            assert exc.status == 400 and says in f"{exc.error} {exc.detail}", (bad, exc)
        else:
            raise AssertionError(f"accepted {bad}")
    # a chain at 32 tokens per unit fits no node hashing per 16: a 400 naming why
    u32 = fine(HashConfig(algorithm="sha256", hash_block_size=32), tokens)
    try:
        route(index, RouteRequest(unit_hashes=u32, hash_block_size=32, num_tokens=1000), now=100.0)
    except RouteError as exc:
        assert exc.status == 400 and "per 16" in (exc.detail or "")
    else:
        raise AssertionError("a chain of another unit was accepted")
