"""A native decision that shows the best few nodes (`top_k`) leaves out members whose hit is bounded below the rows it
already has (native/src/topk.rs: `Bar`; the bounds in native/src/memberhit.rs). The answers stay the Python path's.

Every layout kind the bounds treat apart: full attention (its held prefix), sliding windows and Mamba (their last held
block), chunked local attention (which bounds nothing), at different block sizes. Nodes hold near-equal
prefixes with holes, split between GPU and CPU, with loads, suspects and stale nodes, so bounds tie with the bar and
members land on both sides of it.
"""
from __future__ import annotations

import random
import time

import msgspec
import pytest

from kvpipe.bench.route import without_timings as _plain
from kvpipe.processors.core.index import Index
from kvpipe.processors.router import native
from kvpipe.processors.router.decide import route
from kvpipe.processors.router.hits import HitSearch
from kvpipe.processors.router.model import RouteRequest
from kvpipe.processors.router.serving import NodeLoads
from kvpipe.schemas.envelope import GroupSpec
from tests.nativecheck import require_native_core
from tests.unit.router.router_fixtures import fa, mamba, shared_document, swa

require_native_core()

STALE = 15.0
UNIT = 16


def chunked(g: int, bs: int, chunk: int) -> GroupSpec:
    return GroupSpec(group_idx=g, kind="chunked_local_attention", block_size=bs, attention_chunk_size=chunk)


LAYOUTS = {
    "fa16+swa32+swa16": [fa(0, 16), swa(1, 32, 128), swa(2, 16, 64)],
    "fa32+swa16": [fa(0, 32), swa(1, 16, 48)],
    "fa16+mamba16": [fa(0, 16), mamba(1, 16)],
    "fa16+mamba64+swa32": [fa(0, 16), mamba(1, 64), swa(2, 32, 96)],
    "fa16+chunked16": [fa(0, 16), chunked(1, 16, 64)],
    "swa16-alone": [swa(0, 16, 48)],
}


def _held(rng: random.Random, n: int, layout: list[GroupSpec]) -> dict[tuple[int, str], list[int]]:
    """A node's positions per (group, medium): a prefix near a shared length, a hole now and then, the window
    groups only near its end, the rest of each group's blocks split between GPU and CPU."""
    end_tokens = rng.choice([n * UNIT, n * UNIT * 3 // 4, n * UNIT // 2, rng.randint(0, n * UNIT)])
    held: dict[tuple[int, str], list[int]] = {}
    for spec in layout:
        blocks = n * UNIT // spec.block_size
        end = min(blocks, end_tokens // spec.block_size)
        start = 0 if spec.kind == "full_attention" else max(0, end - rng.randint(1, 8))
        pos = [i for i in range(start, end) if rng.random() > 0.05]
        on_cpu = rng.randint(0, len(pos))
        held[(spec.group_idx, "GPU")] = pos[:on_cpu] if rng.random() < 0.5 else pos[on_cpu:]
        held[(spec.group_idx, "CPU")] = [p for p in pos if p not in held[(spec.group_idx, "GPU")]]
    return held


def _fleet(seed: int, name: str):
    rng = random.Random(seed)
    layout = LAYOUTS[name]
    index, doc, _, nodes = shared_document(rng, layout, (8, 40), 16, lambda n: _held(rng, n, layout), UNIT)
    now = time.time()
    for node in rng.sample(nodes, 2):
        index.nodes[node].mark_suspect(f"test: suspect {node}")
    index.nodes[rng.choice(nodes)].last_seen = now - 100.02
    for node in rng.sample(nodes, 10):
        # equal loads make ties on score; different ones let a shorter hit win
        index.nodes[node].load = (rng.choice([0, 0, 3, 20]), rng.choice([0, 0, 5]), rng.choice([0.0, 0.0, 0.5]))
    return rng, index, doc


def _python(index: Index, req: RouteRequest) -> dict:
    answer = route(index, req, loads=NodeLoads(index), now=time.time(), stale_after_s=STALE, search=HitSearch("native"))
    return _plain(msgspec.json.encode(answer))


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(4))
def test_a_top_k_decision_equals_the_python_path(name, seed):
    rng, index, doc = _fleet(seed, name)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    assert path.router.ready, path.why_not
    prompts = [doc, doc[: len(doc) // 2], doc[: len(doc) * 3 // 4] + [7] * 20, doc + [rng.randrange(50_000)] * 33]
    for tokens in prompts:
        for top_k in (1, 2, 3, None):
            req = RouteRequest(token_ids=tokens, top_k=top_k)
            body = msgspec.json.encode(req)
            got = path.answer(body)
            assert got is not None, (name, seed, top_k)
            want = _python(index, req)
            if _plain(got) != want:  # a stale row's "silent for N s" read from each call's clock: ask again
                got = path.answer(body)
            assert _plain(got) == want, (name, seed, top_k, len(tokens))
