"""Router v2's decision on a real index: token ids and hash lists agree, the default hit is vLLM's
hybrid hit on the node's true cache state, mistakes are errors or no-signal reasons, load moves
the choice as `kvpipe.processors.router.decide` says."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.gpu.hit import ViewCache, longest_hybrid_hit, partial_hits_enabled
from kvpipe.gpu.specs import from_group_spec
from kvpipe.processors.core.index import Index
from kvpipe.processors.router.decide import route
from kvpipe.processors.router.rows import score
from kvpipe.processors.router.model import Load, RouteError, RouteRequest, Scoring
from kvpipe.schemas.envelope import HashConfig
from tests.unit.router.router_fixtures import (
    LAYOUTS,
    Publisher,
    fa,
    group_lists,
    hash_config,
    swa,
)

MEDIA = ("GPU", "CPU")


def random_holdings(rng: random.Random, lists: dict[int, list]) -> dict[tuple[int, str], list[int]]:
    """A plausible cache: per group a prefix, some tail blocks, some holes, split over GPU and CPU."""
    out: dict[tuple[int, str], list[int]] = {}
    for g, hashes in lists.items():
        n = len(hashes)
        prefix = rng.randint(n // 2, n) if rng.random() < 0.7 else rng.randint(0, n)
        pos = set(range(prefix)) | {i for i in range(n) if rng.random() < 0.3}
        pos -= {i for i in range(n) if rng.random() < 0.1}
        for i in pos:
            out.setdefault((g, rng.choice(MEDIA) if rng.random() < 0.3 else "GPU"), []).append(i)
    return out


def comparable(row) -> tuple:
    return (row.node_id, row.gpu_tokens, row.loadable_tokens, row.score,
            [(g.group_idx, g.gpu_blocks, g.blocks, g.medium) for g in row.groups])


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_token_ids_and_per_group_hash_lists_give_the_same_answer_on_random_workloads(layout):
    specs, hbs = LAYOUTS[layout]
    rng = random.Random(layout)
    nonzero = [0, 0]
    for trial in range(10):
        index = Index()
        prompts = [[rng.randrange(50_000) for _ in range(rng.randint(64, 400))] for _ in range(3)]
        kinds = {}
        for n in range(8):
            cfg = hash_config(rng.choice(["sha256-int", "cbor-bytes", "cbor-seeded"]), hbs)
            node = Publisher(index, f"n{n}", specs, cfg)
            # each node cached one of the prompts (possibly a longer sibling of the asked one)
            lists = group_lists(cfg, specs, rng.choice(prompts))
            node.store(lists, random_holdings(rng, lists))
            kinds[node.node_id] = cfg
        prompt = rng.choice(prompts)
        tokens = prompt[: rng.randint(1, len(prompt))] if trial % 3 == 0 else prompt
        by_tokens = route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0)
        assert not by_tokens.no_signal
        rows = {r.node_id: r for r in by_tokens.nodes}
        assert set(rows) == set(kinds)
        nonzero[0] += sum(r.gpu_tokens > 0 for r in rows.values())
        nonzero[1] += sum(r.loadable_tokens > 0 for r in rows.values())
        for cfg in {(c.algorithm, c.int_hashes, c.none_hash_seed): c for c in kinds.values()}.values():
            lists = group_lists(cfg, specs, tokens)
            by_hashes = route(index, RouteRequest(block_hashes={g: [h if isinstance(h, int) else "0x" + h.hex()
                                                                    for h in hs] for g, hs in lists.items()},
                                                  num_tokens=len(tokens), include_zero=True), now=100.0)
            same = [r for r in by_hashes.nodes if kinds[r.node_id] == cfg]
            assert same and [comparable(r) for r in same] == [comparable(rows[r.node_id]) for r in same], (
                layout, trial)
            # block-level lists cannot name partial entries inside a block: exact only without partial hits
            partial = partial_hits_enabled([from_group_spec(g) for g in specs], hbs)
            assert all(r.exact != partial for r in same)
    assert min(nonzero) >= 3, nonzero  # the workloads exercise real GPU hits and CPU-loadable tails


LAYOUT_NAMES = sorted(LAYOUTS)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_default_hit_is_gpu_hit_on_the_nodes_true_cache_state(data):
    specs, hbs = LAYOUTS[data.draw(st.sampled_from(LAYOUT_NAMES))]
    cfg = hash_config(data.draw(st.sampled_from(["sha256-int", "cbor-bytes"])), hbs)
    n_tokens = data.draw(st.integers(1, 260))
    tokens = list(range(7, 7 + n_tokens))
    fine = hash_request_blocks(hasher_from_config(cfg), tokens, hbs)
    views = ViewCache(fine, hbs)
    lists = group_lists(cfg, specs, tokens)
    held: dict[tuple[int, str], list[int]] = {}
    for gs in specs:
        n = len(lists[gs.group_idx])
        for medium in MEDIA:
            if not n:
                held[(gs.group_idx, medium)] = []
                continue
            prefix = data.draw(st.integers(0, n), label=f"{medium} prefix of group {gs.group_idx}")
            extra = data.draw(st.lists(st.integers(0, n - 1), max_size=n), label=f"{medium} more blocks")
            holes = data.draw(st.sets(st.integers(0, n - 1), max_size=3), label=f"{medium} holes")
            held[(gs.group_idx, medium)] = sorted((set(range(prefix)) | set(extra)) - holes)
    index = Index()
    Publisher(index, "n", specs, cfg).store(lists, held)
    row = route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0).nodes[0]

    kv = [from_group_spec(gs) for gs in specs]

    def truth(media) -> int:
        sets = [{views.at(gs.block_size)[i] for m in media for i in held[(gs.group_idx, m)]} for gs in specs]
        return longest_hybrid_hit(kv, fine, hbs, sets, n_tokens - 1).length

    assert row.gpu_tokens == truth(["GPU"])
    assert row.gpu_tokens + row.loadable_tokens == truth(MEDIA)
    assert row.gpu_tokens <= n_tokens - 1  # vLLM never reuses the last token
    event(f"GPU hit {'> 0' if row.gpu_tokens else '0'}, loadable {'> 0' if row.loadable_tokens else '0'}")


def test_a_block_aligned_prompt_is_capped_one_token_short_of_its_full_cached_length():
    specs, hbs = LAYOUTS["fa"]
    cfg = hash_config("sha256-int", hbs)
    tokens = list(range(64))  # exactly 4 blocks, all cached
    index = Index()
    lists = group_lists(cfg, specs, tokens)
    Publisher(index, "n", specs, cfg).store(lists, {(0, "GPU"): range(4)})
    assert route(index, RouteRequest(token_ids=tokens), now=100.0).nodes[0].gpu_tokens == 48
    # the same lists without num_tokens: not capped, and the row says so
    loose = route(index, RouteRequest(block_hashes=lists), now=100.0).nodes[0]
    assert loose.gpu_tokens == 64 and loose.exact is False and "num_tokens not given" in loose.reason


# -- mistakes are errors or reasons, never silent zeros ----------------------------------------------


def test_the_16_token_list_for_a_32_token_group_is_a_400_naming_the_group():
    specs, hbs = LAYOUTS["fa16+swa32"]
    cfg = hash_config("sha256-int", hbs)
    tokens = list(range(200))
    index = Index()
    lists = group_lists(cfg, specs, tokens)
    Publisher(index, "n", specs, cfg).store(lists, {(0, "GPU"): range(12), (1, "GPU"): range(6)})
    wrong = {0: lists[0], 1: lists[0]}
    with pytest.raises(RouteError) as err:
        route(index, RouteRequest(block_hashes=wrong, num_tokens=200))
    assert err.value.status == 400 and "group 1: 12 hashes, expected 6" in err.value.detail
    with pytest.raises(RouteError) as err:  # without num_tokens the lists disagree on the prompt length
        route(index, RouteRequest(block_hashes=wrong))
    assert "group 1" in err.value.detail and "own block size" in err.value.detail
    with pytest.raises(RouteError, match="group 0: 12 hashes, expected 11"):
        route(index, RouteRequest(block_hashes=lists, num_tokens=190))
    assert route(index, RouteRequest(block_hashes=lists, num_tokens=200)).nodes[0].gpu_tokens == 192


@pytest.mark.parametrize(("body", "match"), [
    (dict(), "exactly one of"),
    (dict(token_ids=[1], block_hashes={0: [1]}), "exactly one of"),
    (dict(token_ids=[]), "empty"),
    (dict(token_ids=[1, 2], num_tokens=3), "num_tokens 3 but 2 token_ids"),
    (dict(block_hashes={0: ["zz"]}), r"block_hashes\[0\]\[0\]"),
    (dict(block_hashes={0: [2 ** 64]}), "2\\*\\*64"),
    (dict(block_hashes={0: [1]}, cache_salt="s"), "token-id hashing only"),
    (dict(token_ids=[1], lora_name="a"), "lora_name and lora_path"),
    (dict(token_ids=[1], top_k=0), "top_k"),
    (dict(token_ids=[1], scoring=Scoring(temperature=-1)), "temperature"),
])
def test_bad_requests_are_errors_that_say_what_was_expected(body, match):
    with pytest.raises(RouteError, match=match) as err:
        route(Index(), RouteRequest(**body))
    assert err.value.status == 400


def test_nodes_that_can_never_match_are_no_signal_with_the_reason_and_other_algorithms_are_hashed_their_way():
    specs, hbs = LAYOUTS["fa16+swa32"]
    tokens = list(range(100, 300))
    index = Index()
    for name, cfg, model in [
        ("sha", hash_config("sha256-int", hbs), "m"),
        ("cbor", hash_config("cbor-bytes", hbs), "m"),
        ("random-seed", HashConfig(hash_block_size=hbs, algorithm="sha256_cbor", none_hash_seed_rule="random"), "m"),
        ("xx", HashConfig(hash_block_size=hbs, algorithm="xxhash_cbor", none_hash_seed_rule="pythonhashseed",
                          none_hash_seed="1"), "m"),
        ("unit", HashConfig(hash_block_size=24), "m"),
        ("no-config", None, "m"),
        ("other-model", hash_config("sha256-int", hbs), "other"),
    ]:
        node = Publisher(index, name, specs, cfg, model=model)
        if cfg is not None and name not in ("random-seed", "xx", "unit"):
            lists = group_lists(cfg, specs, tokens)
            node.store(lists, {(0, "GPU"): range(12), (1, "GPU"): range(6)})
        else:
            node.send([])
    Publisher(index, "no-specs", None, hash_config("sha256-int", hbs)).send([])
    answer = route(index, RouteRequest(token_ids=tokens, model="m"), now=100.0)
    assert [(r.node_id, r.gpu_tokens) for r in answer.nodes] == [("cbor", 192), ("sha", 192)]
    assert sorted(c.label for c in answer.hash_configs) == ["sha256/16/default/int", "sha256_cbor/16/default/bytes"]
    reasons = {n.node_id: n.reason for n in answer.no_signal}
    assert set(reasons) == {"random-seed", "xx", "unit", "no-config", "other-model", "no-specs"}
    assert "random per-process none-hash seed" in reasons["random-seed"]
    assert "xxhash_cbor" in reasons["xx"]
    assert "not a multiple of the hash unit 24" in reasons["unit"]
    assert "no hash configuration published" in reasons["no-config"]
    assert "serves model 'other'" in reasons["other-model"]
    assert "no group specs" in reasons["no-specs"]


# -- the decision ------------------------------------------------------------------------------------


def two_nodes(hit_on: str = "a"):
    specs, hbs = LAYOUTS["fa"]
    cfg = hash_config("sha256-int", hbs)
    tokens = list(range(161))  # 10 full blocks, cap 160
    index = Index()
    for name in ("a", "b"):
        lists = group_lists(cfg, specs, tokens)
        Publisher(index, name, specs, cfg).store(lists, {(0, "GPU"): range(10)} if name == hit_on else {})
    return index, tokens


def test_load_moves_the_choice_as_the_formula_says():
    index, tokens = two_nodes()
    req = RouteRequest(token_ids=tokens, include_zero=True)
    assert route(index, req, now=100.0).chosen == "a"  # benefit 1.0 vs 0.0
    # 19 waiting: 1.0 - 0.95 > 0 still a; 21 waiting: 1.0 - 1.05 < 0 → the empty node
    assert route(index, req, loads={"a": Load(waiting=19)}, now=100.0).chosen == "a"
    answer = route(index, req, loads={"a": Load(waiting=21)}, now=100.0)
    assert answer.chosen == "b"
    a = next(r for r in answer.nodes if r.node_id == "a")
    assert math.isclose(a.score, 1.0 - 21 * 0.05)
    # both loaded alike: the cache decides again; a full KV cache costs kv_usage_weight
    assert route(index, req, loads={"a": Load(waiting=21), "b": Load(waiting=21)}, now=100.0).chosen == "a"
    assert route(index, req, loads={"a": Load(kv_usage=1.0), "b": Load()},
                 now=100.0).chosen == "a"  # 1.0 - 0.5 > 0
    heavy = RouteRequest(token_ids=tokens, scoring=Scoring(kv_usage_weight=2.0))
    assert route(index, heavy, loads={"a": Load(kv_usage=0.9)}, now=100.0).chosen == "b"


def test_cpu_loadable_tokens_count_at_cpu_weight():
    assert score(0, 100, 101, Load(), 0, Scoring()) == pytest.approx(0.5)
    assert score(0, 100, 101, Load(), 0, Scoring(cpu_weight=1.0)) == pytest.approx(1.0)
    assert score(100, 0, 101, Load(running=10), 2, Scoring()) == pytest.approx(1.0 - 0.2 - 0.1)


def test_temperature_samples_reproducibly_and_roughly_by_score():
    index, tokens = two_nodes()
    hot = Scoring(temperature=0.5, seed=1)
    picks = [route(index, RouteRequest(token_ids=tokens, scoring=Scoring(temperature=0.5, seed=s)),
                   now=100.0).chosen for s in range(300)]
    share = picks.count("a") / len(picks)
    expected = 1 / (1 + math.exp(-1.0 / 0.5))  # scores 1.0 and 0.0
    assert abs(share - expected) < 0.1
    first = route(index, RouteRequest(token_ids=tokens, scoring=hot), now=100.0).chosen
    assert all(route(index, RouteRequest(token_ids=tokens, scoring=hot), now=100.0).chosen == first for _ in range(5))


def test_suspect_nodes_are_chosen_only_when_no_live_node_is_left():
    index, tokens = two_nodes(hit_on="a")
    index.nodes["a"].mark_suspect("gap in epoch 1")
    answer = route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0)
    assert answer.chosen == "b"
    a = next(r for r in answer.nodes if r.node_id == "a")
    assert a.state == "suspect" and a.state_reason == "gap in epoch 1" and a.gpu_tokens == 160


def test_stale_nodes_say_how_long_they_were_silent():
    index, tokens = two_nodes(hit_on="a")
    answer = route(index, RouteRequest(token_ids=tokens), now=200.0, stale_after_s=30.0)
    assert answer.nodes[0].state == "stale" and "silent for 100.0 s" in answer.nodes[0].state_reason


def test_top_k_and_include_zero_and_the_chosen_node_is_always_listed():
    index, tokens = two_nodes(hit_on="a")
    assert [r.node_id for r in route(index, RouteRequest(token_ids=tokens), now=100.0).nodes] == ["a"]
    assert [r.node_id for r in route(index, RouteRequest(token_ids=tokens, include_zero=True), now=100.0).nodes] == ["a", "b"]
    answer = route(index, RouteRequest(token_ids=tokens, include_zero=True, top_k=1), loads={"a": Load(waiting=40)},
                   now=100.0)
    assert answer.chosen == "b" and [r.node_id for r in answer.nodes] == ["b"]
    # an empty cluster still chooses (by load), listing only the chosen node
    index2, _ = two_nodes(hit_on="nobody")
    empty = route(index2, RouteRequest(token_ids=tokens), loads={"a": Load(running=3)}, now=100.0)
    assert empty.chosen == "b" and [r.node_id for r in empty.nodes] == ["b"]


def test_prefix_per_group_adds_the_explanation_but_the_ranking_stays_the_hybrid_hit():
    specs = [fa(0, 16), swa(1, 16, 48)]
    cfg = hash_config("sha256-int", 16)
    tokens = list(range(161))
    index = Index()
    lists = group_lists(cfg, specs, tokens)
    Publisher(index, "tail", specs, cfg).store(lists, {(0, "GPU"): range(10), (1, "GPU"): [7, 8, 9]})
    Publisher(index, "prefix", specs, cfg).store(lists, {(0, "GPU"): range(4), (1, "GPU"): range(4)})
    answer = route(index, RouteRequest(token_ids=tokens, semantics="prefix-per-group"), now=100.0)
    assert [r.node_id for r in answer.nodes] == ["tail", "prefix"]
    tail = answer.nodes[0]
    assert tail.gpu_tokens == 160 and tail.groups[1].prefix_blocks == {"GPU": 0, "any": 0}
    assert tail.groups[1].gpu_blocks == 3 and tail.groups[0].prefix_blocks == {"GPU": 10, "any": 10}


def test_a_group_left_out_of_the_hash_lists_makes_the_row_partial():
    specs = [fa(0, 16), swa(1, 32, 64)]
    cfg = hash_config("sha256-int", 16)
    tokens = list(range(161))
    index = Index()
    lists = group_lists(cfg, specs, tokens)
    Publisher(index, "n", specs, cfg).store(lists, {(0, "GPU"): range(10)})
    row = route(index, RouteRequest(block_hashes={0: lists[0]}, num_tokens=161), now=100.0).nodes[0]
    assert row.state == "partial" and row.exact is False and "groups [1] not in the request" in row.reason
    assert row.gpu_tokens == 160


def test_cache_salt_and_lora_enter_the_token_id_hashes_as_vllm_keys_them():
    from kvpipe.gpu.hashing import LoRA, RequestKeys

    specs, hbs = LAYOUTS["fa"]
    cfg = hash_config("sha256-int", hbs)
    tokens = list(range(81))
    hasher = hasher_from_config(cfg)
    index = Index()
    for name, keys in [("salted", RequestKeys(cache_salt="tenant-a")),
                       ("lora", RequestKeys(lora=LoRA("sql", "/adapters/sql"))), ("plain", None)]:
        hashes = [external_hash(d) for d in hash_request_blocks(hasher, tokens, hbs, keys)]
        Publisher(index, name, specs, cfg).store({0: hashes}, {(0, "GPU"): range(5)})

    def hits(**extra) -> dict[str, int]:
        answer = route(index, RouteRequest(token_ids=tokens, **extra), now=100.0)
        return {r.node_id: r.gpu_tokens for r in answer.nodes if r.gpu_tokens}  # (a no-hit choice is listed too)

    assert hits() == {"plain": 80}
    assert hits(cache_salt="tenant-a") == {"salted": 80}
    assert hits(cache_salt="tenant-b") == {}
    assert hits(lora_name="sql", lora_path="/adapters/sql") == {"lora": 80}
    assert hits(lora_name="sql", lora_path="/adapters/other") == {}


# -- several workers -----------------------------------------------------------------------------------


def test_two_workers_answer_exactly_as_one_index_holding_every_node():
    from kvpipe.processors.router.decide import finish, route_local

    specs, hbs = LAYOUTS["fa16+swa32"]
    rng = random.Random(5)
    prompt = [rng.randrange(50_000) for _ in range(300)]
    one, workers = Index(), [Index(), Index()]
    for n in range(10):
        cfg = hash_config(["sha256-int", "cbor-bytes"][n % 2], hbs)
        lists = group_lists(cfg, specs, prompt)
        held = random_holdings(rng, lists)
        for index in (one, workers[n % 2]):
            Publisher(index, f"n{n}", specs, cfg).store(lists, held)
    Publisher(one, "x", specs, HashConfig(none_hash_seed_rule="random")).send([])
    Publisher(workers[1], "x", specs, HashConfig(none_hash_seed_rule="random")).send([])
    loads = {f"n{n}": Load(running=n % 3, waiting=n % 4) for n in range(10)}
    for req in [RouteRequest(token_ids=prompt[:250]), RouteRequest(token_ids=prompt, include_zero=True, top_k=4),
                RouteRequest(token_ids=prompt, scoring=Scoring(temperature=0.3), request_id="r9")]:
        single = route(one, req, loads=loads, now=100.0)
        merged = finish([route_local(w, req, loads=loads, now=100.0) for w in workers], req)
        assert [comparable(r) for r in merged.nodes] == [comparable(r) for r in single.nodes]
        assert merged.chosen == single.chosen and merged.no_signal == single.no_signal
        assert sorted((h.label, h.nodes) for h in merged.hash_configs) == sorted(
            (h.label, h.nodes) for h in single.hash_configs)


def test_hash_lists_that_fit_no_worker_are_a_400_but_fitting_one_worker_is_enough():
    from kvpipe.processors.router.decide import finish, route_local

    cfg = hash_config("sha256-int", 16)
    tokens = list(range(64))
    a, b = Index(), Index()
    Publisher(a, "a", [fa(0, 16)], cfg).send([])
    Publisher(b, "b", [fa(0, 32)], hash_config("sha256-int", 32)).send([])
    fits_a = RouteRequest(block_hashes=group_lists(cfg, [fa(0, 16)], tokens), num_tokens=64, include_zero=True)
    merged = finish([route_local(w, fits_a, now=100.0) for w in (a, b)], fits_a)
    assert [r.node_id for r in merged.nodes] == ["a"]
    assert [(n.node_id, n.cause) for n in merged.no_signal] == [("b", "lists")]
    with pytest.raises(RouteError, match="group 0: 4 hashes, expected 2"):
        finish([route_local(b, fits_a, now=100.0)], fits_a)
