"""The route answer does not depend on the hit search engine, nor on the shortcut for nodes that
hold nothing: rows are equal field by field (on the bench's seeded fleet, with in-flight guesses,
stale and suspect nodes, both semantics)."""
from __future__ import annotations

import random

import pytest

from kvpipe.processors.router import decide
from kvpipe.bench import route as bench
from kvpipe.processors.router.hits import ENGINES, HitSearch
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import PREFIX_PER_GROUP, RouteRequest



def _fleet():
    rng = random.Random(5)
    envelopes, docs = bench.fleet(24, 6, 512, 2, 2, rng)
    index = bench.index_of(envelopes)
    nodes = sorted(index.nodes.values(), key=lambda n: n.node_id)
    nodes[1].suspect, nodes[1].reason = True, "gap in seq"
    nodes[2].last_seen = -100.0  # stale at now=1.0 with a 15 s bound
    return index, docs, bench.prompts(docs, 12, rng)


def _without_shortcut(monkeypatch) -> None:
    """Every node through `_prepare` + `_node_row`, as before the shortcut existed."""
    class NeverEmpty(dict):
        def get(self, key, default=None):
            got = super().get(key, default)
            return {} if got is None else got

    real = decide.held_positions
    monkeypatch.setattr(decide, "held_positions", lambda index, lists: NeverEmpty(real(index, lists)))


@pytest.mark.parametrize("semantics", [None, PREFIX_PER_GROUP])
def test_engines_and_the_nothing_held_shortcut_give_equal_rows(monkeypatch, semantics):
    index, docs, prompts = _fleet()
    answers = {}
    for variant in ("native", "python", "no-shortcut"):
        inflight = InFlight()
        if variant == "no-shortcut":
            _without_shortcut(monkeypatch)
        search = HitSearch("python" if variant == "no-shortcut" else variant)
        out = []
        for r, tokens in enumerate(prompts):
            extra = {"semantics": semantics} if semantics else {}
            req = RouteRequest(token_ids=tokens, request_id=f"r{r}", include_zero=True, **extra)
            a = decide.route(index, req, inflight=inflight, now=1.0, stale_after_s=15.0, search=search)
            out.append((a.chosen, a.nodes, a.no_signal))
        answers[variant] = out
    assert answers["native"] == answers["python"] == answers["no-shortcut"]
    chosen_rows = [row for _, rows, _ in answers["python"] for row in rows if row.gpu_tokens]
    assert chosen_rows and any(r.speculative for r in chosen_rows)  # in-flight guesses took part
    states = {row.state for _, rows, _ in answers["python"] for row in rows}
    assert {"live", "suspect", "stale"} <= states
    zero = [row for _, rows, _ in answers["python"] for row in rows if not row.gpu_tokens and not row.loadable_tokens]
    assert len(zero) > len(prompts)  # the shortcut's rows are in the answers compared


def test_an_unknown_engine_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="native"):
        HitSearch("rust")  # type: ignore[arg-type]
    assert set(ENGINES) == {"native", "python"}
