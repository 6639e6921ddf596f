"""The native decision hashes and searches a prompt only up to the first full-attention block no node holds
(native/src/reach.rs): no hit can pass it. The answers stay the Python path's, which hashes and searches every unit.
Block-hash requests are cut at the same bound: each group's list ends with the tokens the bound keeps.

The fleets here make the cut matter: sliding-window and Mamba blocks held far past every full-attention prefix
(nodes that hold no full-attention block at all among them), holes, GPU and CPU copies. Where the cut must not
happen (the prefix-per-group semantics, an EAGLE layout, a layout without full attention) the test shows it did not.
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
from kvpipe.processors.router.model import PREFIX_PER_GROUP, RouteRequest
from kvpipe.processors.router.serving import NodeLoads
from kvpipe.schemas.envelope import GroupSpec
from tests.nativecheck import require_native_core
from tests.unit.router.router_fixtures import Publisher, fa, group_lists, hash_config, mamba, shared_document, swa

require_native_core()

STALE = 15.0
UNIT = 16


def _eagle(spec: GroupSpec) -> GroupSpec:
    return msgspec.structs.replace(spec, eagle=True)


LAYOUTS = {
    "fa16+swa32+swa16": ([fa(0, 16), swa(1, 32, 128), swa(2, 16, 64)], True),
    "fa32+swa16": ([fa(0, 32), swa(1, 16, 48)], True),
    "fa16+mamba64+swa32": ([fa(0, 16), mamba(1, 64), swa(2, 32, 96)], True),
    "eagle fa16+swa16": ([_eagle(fa(0, 16)), _eagle(swa(1, 16, 48))], False),
    "swa16-alone": ([swa(0, 16, 48)], False),
}


def _held(rng: random.Random, n: int, layout: list[GroupSpec], fa_end: int) -> dict[tuple[int, str], list[int]]:
    """Full attention up to at most `fa_end` tokens (none at all on some nodes), with holes; the other groups
    anywhere up to the end of the document, most of all past `fa_end`."""
    held: dict[tuple[int, str], list[int]] = {}
    for spec in layout:
        blocks = n * UNIT // spec.block_size
        if spec.kind == "full_attention":
            end = 0 if rng.random() < 0.25 else rng.randint(fa_end // spec.block_size // 2, fa_end // spec.block_size)
            pos = [i for i in range(end) if rng.random() > 0.03]
        else:
            lo = 0 if rng.random() < 0.6 else rng.randint(0, blocks)
            pos = [i for i in range(lo, blocks) if rng.random() > 0.03]
        on_cpu = rng.randint(0, len(pos))
        held[(spec.group_idx, "GPU")] = pos[:on_cpu]
        held[(spec.group_idx, "CPU")] = pos[on_cpu:]
    return held


def _fleet(seed: int, name: str):
    rng = random.Random(seed)
    layout, _ = LAYOUTS[name]
    # no node holds a full-attention block past half the document
    index, doc, lists, nodes = shared_document(rng, layout, (16, 40), 12,
                                               lambda n: _held(rng, n, layout, n * UNIT // 2), UNIT)
    index.nodes[rng.choice(nodes)].mark_suspect("test: suspect")
    for node in rng.sample(nodes, 6):
        index.nodes[node].load = (rng.choice([0, 3, 20]), rng.choice([0, 5]), rng.choice([0.0, 0.5]))
    return rng, index, doc, lists


def _python(index: Index, req: RouteRequest) -> dict:
    answer = route(index, req, loads=NodeLoads(index), now=time.time(), stale_after_s=STALE, search=HitSearch("native"))
    return _plain(msgspec.json.encode(answer))


def _same(path: native.NativeRoute, index: Index, req: RouteRequest) -> int:
    """The native answer equals Python's; returns the longest hit in it (tokens on any medium)."""
    body = msgspec.json.encode(req)
    got = path.answer(body)
    assert got is not None, req
    want = _python(index, req)
    if _plain(got) != want:  # a stale row's "silent for N s" read from each call's clock: ask again
        got = path.answer(body)
    assert _plain(got) == want
    return max((row["gpu_tokens"] + row["loadable_tokens"] for row in want["nodes"]), default=0)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("seed", range(3))
def test_a_cut_chain_gives_the_python_answers(name, seed):
    rng, index, doc, lists = _fleet(seed, name)
    path = native.NativeRoute(index, HitSearch("native"), STALE, memo_entries=0)  # every unit hashed: counted
    path.refresh(None)
    assert path.router.ready, path.why_not
    big = [1 << 40] * UNIT  # ids the native hash cannot write: past the cut they are never hashed
    prompts = [doc, doc[: len(doc) * 2 // 3] + [9] * 7, [rng.randrange(50_000) for _ in doc],
               doc[: len(doc) * 2 // 3] + big]
    cut = LAYOUTS[name][1]
    longest = 0
    for tokens in prompts:
        if tokens[-1] == big[-1] and not cut:  # hashed in full: the native path hands such a prompt to Python
            assert path.answer(msgspec.json.encode(RouteRequest(token_ids=tokens, top_k=1))) is None
            continue
        for top_k in (1, 3, None):
            before = path.router.memo_stats()["misses"]
            longest = max(longest, _same(path, index, RouteRequest(token_ids=tokens, top_k=top_k)))
            hashed = path.router.memo_stats()["misses"] - before
            if cut:
                assert hashed <= len(doc) // UNIT // 2 + 2, (name, hashed)
            else:
                assert hashed == len(tokens) // UNIT, (name, hashed)
        # the prefix-per-group semantics reports each group's own prefix: nothing is cut
        before = path.router.memo_stats()["misses"]
        if tokens[-1] != big[-1]:
            _same(path, index, RouteRequest(token_ids=tokens, semantics=PREFIX_PER_GROUP))
            assert path.router.memo_stats()["misses"] - before == len(tokens) // UNIT
    # the hash-unit chain, cut the same way
    chain = group_lists(hash_config("sha256-int", UNIT), [fa(0, UNIT)], doc)[0]
    for top_k in (1, None):
        _same(path, index, RouteRequest(unit_hashes=chain, hash_block_size=UNIT, num_tokens=len(doc), top_k=top_k))
    _same(path, index, RouteRequest(unit_hashes=chain, hash_block_size=UNIT, num_tokens=len(doc),
                                    semantics=PREFIX_PER_GROUP))
    # each group's block hashes (a router that hashes per group), cut at the same bound
    blocks = group_lists(hash_config("sha256-int", UNIT), LAYOUTS[name][0], doc)
    for top_k in (1, None):
        longest = max(longest, _same(path, index, RouteRequest(block_hashes=blocks, num_tokens=len(doc), top_k=top_k)))
    _same(path, index, RouteRequest(block_hashes=blocks, num_tokens=len(doc), semantics=PREFIX_PER_GROUP))
    # hits reach well into the document, up to the cut: a cut a few blocks early would change answers
    assert longest >= 4 * UNIT, (name, longest)


def test_the_prefix_semantics_is_not_cut_where_a_medium_holds_only_later_blocks():
    """A node's `prefix_blocks` names every medium it holds the group on within the prompt, with the prefix there
    (0 where it holds only later blocks). Here no node holds block 4 of any group, and one node holds window blocks
    past it on CPU only: a chain cut at block 4 would drop "CPU" from that node's window group."""
    layout = [fa(0, UNIT), swa(1, UNIT, 48)]
    cfg = hash_config("sha256-int", UNIT)
    doc = [random.Random(3).randrange(50_000) for _ in range(20 * UNIT)]
    lists = group_lists(cfg, layout, doc)
    index = Index()
    now = time.time()
    held = {"a": {(0, "GPU"): [0, 1, 2, 3], (1, "GPU"): [0, 1, 2, 3], (1, "CPU"): [12, 13, 14, 15]},
            "b": {(0, "GPU"): [0, 1], (1, "GPU"): [0, 1]}}
    for node, positions in held.items():
        Publisher(index, node, layout, cfg, ts=now).store(lists, positions)
        index.nodes[node].last_seen = now
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    assert path.router.ready, path.why_not
    for req in (RouteRequest(token_ids=doc, semantics=PREFIX_PER_GROUP),
                RouteRequest(unit_hashes=lists[0], hash_block_size=UNIT, num_tokens=len(doc),
                             semantics=PREFIX_PER_GROUP),
                RouteRequest(block_hashes=lists, num_tokens=len(doc), semantics=PREFIX_PER_GROUP)):
        _same(path, index, req)
        rows = {row["node_id"]: row for row in _python(index, req)["nodes"]}
        assert rows["a"]["groups"][1]["prefix_blocks"] == {"CPU": 0, "GPU": 4, "any": 4}
    _same(path, index, RouteRequest(token_ids=doc))  # the hma semantics is cut there, with the same answer
    _same(path, index, RouteRequest(block_hashes=lists, num_tokens=len(doc)))
