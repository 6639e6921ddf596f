"""The native cohort path (`kvpipe.processors.router.cohort`: one store call per cohort, rows only for nodes
holding blocks, nodes holding nothing ranked only when one could be chosen) answers exactly as the
per-node path on the Python engine: seeded fleets with hybrid caches on GPU and CPU, loads (some
nodes loaded enough that an empty node wins), suspect and stale nodes, `include_zero`, `top_k` and
sampling."""
from __future__ import annotations

import random

import pytest

from kvpipe.processors.router import cohort, decide
from kvpipe.bench import route as bench
from kvpipe.processors.router.hits import HitSearch
from kvpipe.processors.router.model import Load, RouteRequest, Scoring
from tests.nativecheck import require_native_core

require_native_core()


class Loads(dict):
    nonnegative = True  # as the index's loads (negative ones are refused at ingest)


@pytest.mark.parametrize("seed", range(6))
def test_native_cohorts_answer_as_the_per_node_path(seed, monkeypatch):
    rng = random.Random(seed)
    index, docs = bench.build(24, 6, 512, 2, 1 + seed % 2, rng, windows=1 + seed % 3 // 2)
    nodes = sorted(index.nodes)
    for n in rng.sample(nodes, 3):
        index.nodes[n].mark_suspect("test")
    loads = Loads({n: Load(running=rng.randint(0, 40), waiting=rng.randint(0, 40), kv_usage=rng.random())
                   for n in rng.sample(nodes, 12)})
    # all but three nodes busy: a node holding nothing is often the best choice
    heavy = Loads({n: Load(running=30, waiting=30, kv_usage=0.9) for n in nodes[:-3]})
    used = []
    real = cohort.cohort_hits

    def spy(*args, **kw):
        got = real(*args, **kw)
        used.append(got is not None)
        return got

    monkeypatch.setattr(decide, "cohort_hits", spy)
    native, python = HitSearch("native"), HitSearch("python")
    uncached = [[rng.randrange(50_000, 60_000) for _ in range(300)] for _ in range(2)]  # no node holds these
    for tokens in bench.prompts(docs, 12, rng) + uncached:
        for req in (RouteRequest(token_ids=tokens), RouteRequest(token_ids=tokens, include_zero=True),
                    RouteRequest(token_ids=tokens, top_k=1), RouteRequest(token_ids=tokens, top_k=2),
                    RouteRequest(token_ids=tokens, top_k=5, include_zero=True),
                    RouteRequest(token_ids=tokens, semantics="prefix-per-group"),
                    RouteRequest(token_ids=tokens, semantics="prefix-per-group", top_k=2, include_zero=True),
                    RouteRequest(token_ids=tokens, scoring=Scoring(temperature=0.5, seed=seed)),
                    RouteRequest(token_ids=tokens, scoring=Scoring(waiting_weight=0.5))):
            for given in (loads, heavy, None):
                a = decide.route(index, req, loads=given, now=5.0, stale_after_s=3.0 + seed, search=native)
                b = decide.route(index, req, loads=given, now=5.0, stale_after_s=3.0 + seed, search=python)
                assert (a.chosen, a.nodes, a.no_signal) == (b.chosen, b.nodes, b.no_signal)
    assert any(used) and not all(used[i] for i in range(1, len(used), 2))  # native taken; python never


def test_a_top_k_answer_builds_only_the_rows_it_can_show(monkeypatch):
    """Ranked first, built after: with `top_k` and no sampling the native path builds the best row
    and the first `top_k` rows with a hit, not one row per node holding blocks."""
    rng = random.Random(7)
    index, docs = bench.build(48, 4, 512, 2, 1, rng, windows=2)
    built = []
    real = cohort.build_row

    def spy(*args, **kw):
        built.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(decide, "build_row", spy)
    native, python = HitSearch("native"), HitSearch("python")
    for tokens in bench.prompts(docs, 6, rng):
        full = decide.route(index, RouteRequest(token_ids=tokens), now=5.0, search=native)
        many = len(built)
        built.clear()
        req = RouteRequest(token_ids=tokens, top_k=2)
        a = decide.route(index, req, now=5.0, search=native)
        b = decide.route(index, req, now=5.0, search=python)
        assert (a.chosen, a.nodes) == (b.chosen, b.nodes)
        assert many > 3 and len(built) <= 3, (many, len(built))  # 24 nodes hold each document here
        assert a.nodes == full.nodes[:2]
        built.clear()


def test_nodes_publishing_equal_specs_share_one_model():
    """Each envelope decodes into its own spec objects; equal ones must still give one model, so
    a route's per-model work runs once per distinct layout, not once per node."""
    import msgspec

    from kvpipe.processors.core.index import NodeState
    from kvpipe.processors.router.hma import node_model

    specs = bench.layout(2)
    nodes = []
    for i in range(3):
        n = NodeState(f"n{i}", 1, 0)
        n.group_specs = [msgspec.structs.replace(g) for g in specs]
        n.hash_config = msgspec.structs.replace(bench.CONFIGS[0])
        nodes.append(n)
    models = [node_model(n) for n in nodes]
    assert models[0] is models[1] is models[2]
    other = NodeState("x", 1, 0)
    other.group_specs = [msgspec.structs.replace(g) for g in bench.layout(1)]
    other.hash_config = msgspec.structs.replace(bench.CONFIGS[0])
    assert node_model(other) is not models[0]
