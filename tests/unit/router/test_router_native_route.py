"""The native route decision (native/src/decide.rs, fed by processors/router/native.py) answers exactly as the Python
path (`decide.route` with the index's loads), and hands every request it does not model back to Python.

Every prompt form: token ids, the hash-unit chain and per-group block hashes. Seeded fleets with hybrid caches on GPU
and CPU, loads (some nodes loaded enough that an empty node wins), suspect
and stale nodes, cached and uncached prompts, `top_k` 1, 2, 5 and none. Only the timing fields differ.
"""
from __future__ import annotations

import json
import random
import time

import msgspec
import pytest

from kvpipe.bench import route as bench
from kvpipe.bench.route import without_timings as _plain
from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.gpu.hit import ViewCache
from kvpipe.processors.router import native
from kvpipe.processors.router.decide import route
from kvpipe.processors.router.hits import HitSearch
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import RouteRequest
from kvpipe.processors.router.serving import NodeLoads
from tests.unit.router.router_fixtures import Publisher, fa, swa
from tests.nativecheck import require_native_core

require_native_core()

STALE = 15.0


def _python(index, body: RouteRequest) -> dict:
    answer = route(index, body, loads=NodeLoads(index), now=time.time(), stale_after_s=STALE,
                   search=HitSearch("native"))
    return _plain(msgspec.json.encode(answer))


def _settled(left, right, tries: int = 3) -> tuple:
    """`left()` and `right()`, asked again while they differ: a stale row says "silent for N s" to a tenth of a
    second from each call's own clock, and two calls a few ms apart on a busy host can fall either side of a tenth.
    A real difference stays through every try."""
    for _ in range(tries):
        a, b = left(), right()
        if a == b:
            break
    return a, b


def _fleet(seed: int, configs: int = 1):
    rng = random.Random(seed)
    index, docs = bench.build(24, 6, 512, 2, configs, rng, windows=1 + seed % 3 // 2)
    nodes = sorted(index.nodes)
    now = time.time()
    for n in nodes:
        index.nodes[n].last_seen = now  # live, except the stale ones below
    for n in rng.sample(nodes, 3):
        index.nodes[n].mark_suspect(f"test: suspect {n}")
    for n in rng.sample(nodes, 2):
        index.nodes[n].last_seen = now - 100.02  # far past the bound: "silent for 100.0 s"
    loaded = rng.sample(nodes, 12) if seed % 2 else nodes[:-3]  # seed odd: some loads; even: an empty node wins
    for n in loaded:
        index.nodes[n].load = (rng.randint(0, 40), rng.randint(0, 40), rng.random()) if seed % 2 else (30, 30, 0.9)
    return rng, index, docs


@pytest.mark.parametrize("seed", range(6))
def test_native_answers_equal_the_python_path(seed):
    rng, index, docs = _fleet(seed)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    assert path.router.ready, path.why_not
    uncached = [[rng.randrange(50_000, 60_000) for _ in range(300)] for _ in range(3)]
    checked = 0
    for i, tokens in enumerate(bench.prompts(docs, 10, rng) + uncached + [[1], [7] * 16]):
        for top_k in (None, 1, 2, 5):
            # every third prompt asks the prefix-per-group semantics (rows also say each group's prefixes)
            req = RouteRequest(token_ids=tokens, top_k=top_k, semantics="prefix-per-group" if i % 3 == 2 else "hma")
            body = msgspec.json.encode(req)
            assert path.answer(body) is not None, (seed, top_k)
            got, want = _settled(lambda: _plain(path.answer(body)), lambda: _python(index, req))
            assert got == want, (seed, top_k, len(tokens), req.semantics)
            checked += 1
    assert checked == 4 * 15


def _chain(tokens: list[int], as_bytes: bool = False) -> list:
    """The prompt's hash-unit chain in its wire form: ints (vLLM's external form) or "0x…" digests."""
    cfg = bench.CONFIGS[0]
    digests = hash_request_blocks(hasher_from_config(cfg), tokens, cfg.hash_block_size)
    return ["0x" + d.hex() if as_bytes else external_hash(d, True) for d in digests]


def _same_as_python_and(path, index, req: RouteRequest, other: RouteRequest) -> dict:
    """A request with its hashes ready made: answered natively, hashing nothing, as Python answers it, and with the
    same nodes, rows and choice as `other`, the same prompt in another form. Returns Python's answer."""
    body = msgspec.json.encode(req)
    got = path.answer(body)
    assert got is not None, req
    assert json.loads(got)["hashing_s"] == 0.0
    plain, want = _settled(lambda: _plain(path.answer(body)), lambda: _python(index, req))
    assert plain == want, (req.top_k, req.num_tokens)
    assert want["hash_configs"] == []
    theirs, ours = _settled(lambda: _python(index, other), lambda: _python(index, req))
    assert (theirs["nodes"], theirs["chosen"]) == (ours["nodes"], ours["chosen"])
    return want


def _hashed_prompts(seed: int, short: int):
    """A seeded fleet, its native route path, and prompts for the hash forms: cached ones, one no node holds, and
    two short ones (`short` tokens: one block of the widest group, and 40)."""
    rng, index, docs = _fleet(seed)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    uncached = [[rng.randrange(50_000, 60_000) for _ in range(300)]]
    return index, path, bench.prompts(docs, 6, rng) + uncached + [[7] * short, [7] * 40]


@pytest.mark.parametrize("seed", range(4))
def test_native_answers_to_a_unit_chain_equal_the_python_path(seed):
    index, path, prompts = _hashed_prompts(seed, 16)
    checked = 0
    for i, tokens in enumerate(prompts):
        for top_k in (None, 1, 3):
            req = RouteRequest(unit_hashes=_chain(tokens, as_bytes=i % 2 == 1), hash_block_size=16,
                               num_tokens=len(tokens), top_k=top_k,
                               semantics="prefix-per-group" if top_k == 3 else "hma")
            _same_as_python_and(path, index, req, RouteRequest(token_ids=tokens, top_k=top_k, semantics=req.semantics))
            checked += 1
    assert checked == 3 * 9


def _blocks(index, tokens: list[int], as_bytes: bool = False) -> dict[int, list]:
    """The prompt's per-group block hashes, each group's list at its own block size (the fleet's nodes share one
    layout), as a router that hashes itself sends them."""
    return bench.group_lists(_chain(tokens, as_bytes), next(iter(index.nodes.values())).group_specs)


@pytest.mark.parametrize("seed", range(4))
def test_native_answers_to_block_hashes_equal_the_python_path(seed):
    index, path, prompts = _hashed_prompts(seed, 32)
    checked = 0
    for i, tokens in enumerate(prompts):
        lists = _blocks(index, tokens, as_bytes=i % 2 == 1)
        # a group left out borrows the list of a named group with its block size (the fleet's windows: 32 and 16)
        named = {g: v for g, v in lists.items() if g != 2} if i % 3 == 1 and 2 in lists else lists
        for top_k in (None, 1, 3):
            req = RouteRequest(block_hashes=named, num_tokens=len(tokens), top_k=top_k,
                               semantics="prefix-per-group" if top_k == 3 else "hma")
            want = _same_as_python_and(path, index, req, RouteRequest(
                unit_hashes=_chain(tokens), hash_block_size=16, num_tokens=len(tokens), top_k=top_k,
                semantics=req.semantics))
            assert all(row["exact"] for row in want["nodes"]), sorted(named)
            checked += 1
    assert checked == 3 * 9


def test_block_hashes_it_does_not_model_go_to_python():
    rng, index, docs = _fleet(2)  # two sliding windows: groups 0 and 2 at 16 tokens a block, group 1 at 32
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    tokens = bench.prompts(docs, 1, rng)[0]
    lists, n = _blocks(index, tokens), len(tokens)
    assert sorted(lists) == [0, 1, 2]
    assert path.answer(msgspec.json.encode(RouteRequest(block_hashes=lists, num_tokens=n))) is not None
    for other in (
            RouteRequest(block_hashes=lists),  # no num_tokens: Python's rows are not exact
            RouteRequest(block_hashes={0: lists[0]}, num_tokens=n),  # group 1 has no list: a "partial" row
            RouteRequest(block_hashes={**lists, 7: lists[0]}, num_tokens=n),  # a group no node has: no signal / 400
            RouteRequest(block_hashes={**lists, 1: lists[1][:-1]}, num_tokens=n),  # one block short: no signal
            RouteRequest(block_hashes=lists, num_tokens=n + 16),  # the count does not fit the lists
            RouteRequest(block_hashes={}, num_tokens=n),  # no group: Python's 400
            RouteRequest(block_hashes=lists, num_tokens=n, hash_block_size=16),  # Python's 400
            RouteRequest(block_hashes=lists, unit_hashes=_chain(tokens), num_tokens=n)):  # two forms: Python's 400
        assert path.answer(msgspec.json.encode(other)) is None, other
    body = json.dumps({"block_hashes": {str(g): v for g, v in lists.items()}, "num_tokens": n})
    assert path.answer(body.encode()) is not None
    for key in ("00", "-0", "+1", " 1", "1.0", "0x1"):  # group keys msgspec refuses or reads otherwise: Python's
        assert path.answer(body.replace('"0":', f'"{key}":', 1).encode()) is None, key
    twice = body.replace('"1":', '"0": [1], "1":', 1)  # a group twice (msgspec keeps the last): Python's
    assert path.answer(twice.encode()) is None
    for bad in ([-1], ["0xabc"], [1.5], [1 << 64]):
        raw = json.dumps({"block_hashes": {"0": bad + lists[0][1:], "1": lists[1], "2": lists[2]}, "num_tokens": n})
        assert path.answer(raw.encode()) is None, bad


@pytest.mark.parametrize("seed", range(3))
def test_block_hashes_name_nodes_of_another_layout_as_python_does(seed):
    """Nodes whose layout the lists do not fit are no-signal rows (cause "lists") beside the others' answer: here
    nodes that run full attention alone (a group they lack), or full attention at 32 tokens a block beside a window
    at 16 (lists of the wrong length), beside the fleet."""
    rng, index, docs = _fleet(seed)
    cfg = bench.CONFIGS[0]
    layouts = {"fa-only": [fa(0, 16)], "fa32": [fa(0, 32), swa(1, 16, 48)]}
    now = time.time()
    for i, (name, specs) in enumerate(sorted(layouts.items()) * 2):
        doc = docs[i % len(docs)]
        views = ViewCache(hash_request_blocks(hasher_from_config(cfg), doc, 16), 16)
        lists = {s.group_idx: [external_hash(h, True) for h in views.at(s.block_size)] for s in specs}
        node = f"node-{name}-{i}"  # sorts among the fleet's nodes
        Publisher(index, node, specs, cfg, model="bench", ts=now).store(lists, {(0, "GPU"): range(len(lists[0]) // 2)})
        index.nodes[node].last_seen = now
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    assert path.router.ready, path.why_not
    checked = 0
    for tokens in bench.prompts(docs, 4, rng) + [docs[0]]:
        lists = _blocks(index, tokens)
        named = {0: lists[0], 1: lists[1]} if seed % 2 else lists  # group 1 alone may also be unknown to them
        for top_k in (None, 1):
            req = RouteRequest(block_hashes=named, num_tokens=len(tokens), top_k=top_k)
            body = msgspec.json.encode(req)
            got = path.answer(body)
            assert got is not None, (seed, top_k)
            plain, want = _settled(lambda: _plain(path.answer(body)), lambda: _python(index, req))
            assert plain == want, (seed, top_k)
            misfit = [n for n in want["no_signal"] if n["cause"] == "lists"]
            assert len(misfit) == 4 and all("not among the node's groups" in n["reason"] or "expected" in n["reason"]
                                            for n in misfit), misfit
            checked += 1
    assert checked == 2 * 5
    # lists no node's layout fits: Python's 400 names the first misfit
    doc = docs[0]
    wrong = {0: _blocks(index, doc)[0][:-1]}
    assert path.answer(msgspec.json.encode(RouteRequest(block_hashes=wrong, num_tokens=len(doc)))) is None


def test_block_hashes_go_to_python_while_a_node_has_no_usable_hash_configuration():
    rng, index, docs = _fleet(1)
    tokens = bench.prompts(docs, 1, rng)[0]
    lists, n = _blocks(index, tokens), len(tokens)
    index.nodes[sorted(index.nodes)[0]].hash_config = None  # searched by block-hash routes, not by token ids
    index.generation += 1
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    assert path.router.ready
    assert path.answer(msgspec.json.encode(RouteRequest(token_ids=tokens))) is not None
    assert path.answer(msgspec.json.encode(RouteRequest(block_hashes=lists, num_tokens=n))) is None


def test_unit_chains_it_does_not_model_go_to_python():
    rng, index, docs = _fleet(1)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    tokens = bench.prompts(docs, 1, rng)[0]
    chain = _chain(tokens)
    n = len(tokens)
    assert path.answer(msgspec.json.encode(RouteRequest(unit_hashes=chain, hash_block_size=16, num_tokens=n))) \
        is not None
    for other in (
            RouteRequest(unit_hashes=chain, hash_block_size=32, num_tokens=n),  # the nodes hash per 16: no signal
            RouteRequest(unit_hashes=chain, hash_block_size=16, num_tokens=n + 16),  # one hash short: Python's 400
            RouteRequest(unit_hashes=chain, hash_block_size=16),  # no num_tokens: Python's 400
            RouteRequest(unit_hashes=chain, num_tokens=n),  # no unit: Python's 400
            RouteRequest(unit_hashes=chain, token_ids=tokens, hash_block_size=16, num_tokens=n)):
        assert path.answer(msgspec.json.encode(other)) is None, other
    for bad in ([-1], ["0xabc"], ["0x zz"], ["ab"], [1.5], [1 << 64], ["0x"]):
        raw = json.dumps({"unit_hashes": bad + chain[1:], "hash_block_size": 16, "num_tokens": n}).encode()
        assert path.answer(raw) is None, bad
    for semantics in ("other", None):  # Python's 400s (null is no semantics)
        assert path.answer(json.dumps({"token_ids": tokens, "semantics": semantics}).encode()) is None, semantics
    # token ids with a unit or a count are Python's to check
    for extra in ({"num_tokens": n}, {"hash_block_size": 16}):
        assert path.answer(json.dumps({"token_ids": tokens, **extra}).encode()) is None, extra


def test_requests_it_does_not_model_go_to_python():
    rng, index, docs = _fleet(1)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    tokens = bench.prompts(docs, 1, rng)[0]
    assert path.answer(msgspec.json.encode(RouteRequest(token_ids=tokens))) is not None
    for other in (RouteRequest(token_ids=tokens, include_zero=True), RouteRequest(token_ids=tokens, model="m"),
                  RouteRequest(token_ids=tokens, request_id="r1"), 
                  RouteRequest(block_hashes={0: [1, 2]}, num_tokens=32),  # group 1 without a list: not exact
                  RouteRequest(token_ids=tokens, top_k=0),
                  RouteRequest(token_ids=[])):
        assert path.answer(msgspec.json.encode(other)) is None, other
    for raw in (b"not json", b'{"token_ids": [1.5]}', b'{"token_ids": [1], "top_k": 1, "x": 2}', b"[]",
                b'{"token_ids": [18446744073709551616]}'):
        assert path.answer(raw) is None, raw


def test_a_moved_index_or_inflight_guesses_close_the_native_path_until_refreshed():
    rng, index, docs = _fleet(2)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    body = msgspec.json.encode(RouteRequest(token_ids=bench.prompts(docs, 1, rng)[0], top_k=1))
    assert path.answer(body) is not None
    index._move()  # what a node coming, going or changing epoch does
    assert path.answer(body) is None  # told at once: Python answers until the plan is re-exported
    path.refresh(None)
    assert path.answer(body) is not None
    got, want = _settled(lambda: _plain(path.answer(body)), lambda: _python(index, RouteRequest(
        token_ids=json.loads(body)["token_ids"], top_k=1)))
    assert got == want
    inflight = InFlight(30.0, 100, 10_000)
    some = next(iter(index.nodes.values()))
    inflight.sent("r1", some.node_id, {0: [1, 2, 3]}, time.time())
    path.refresh(inflight)
    assert path.answer(body) is None and "in-flight" in path.open_reason
    path.serves_all = lambda: False
    path.refresh(None)
    assert path.answer(body) is None and "partition" in path.open_reason


def test_loads_and_suspect_marks_reach_it_on_refresh():
    rng, index, docs = _fleet(3)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    tokens = bench.prompts(docs, 1, rng)[0]
    req = RouteRequest(token_ids=tokens, top_k=1)
    before = json.loads(path.answer(msgspec.json.encode(req)))
    chosen = before["chosen"]
    index.nodes[chosen].mark_suspect("test: marked after the plan")
    path.refresh(None)
    after, want = _settled(lambda: _plain(path.answer(msgspec.json.encode(req))), lambda: _python(index, req))
    assert after == want and after["chosen"] != chosen


def test_a_hash_configuration_hashed_in_python_keeps_the_path_closed():
    rng, index, docs = _fleet(0, configs=2)  # the second configuration is sha256_cbor
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    path.refresh(None)
    assert not path.router.ready and "sha256_cbor" in path.open_reason
    assert path.answer(msgspec.json.encode(RouteRequest(token_ids=bench.prompts(docs, 1, rng)[0]))) is None


def test_live_state_is_pushed_only_when_messages_were_handled():
    rng, index, docs = _fleet(5)
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    pushed = []
    real = path.router.set_live
    path.router = type("Spy", (), {"__getattr__": lambda self, name: getattr(real.__self__, name),
                                   "set_live": lambda self, live: pushed.append(len(live)) or real(live)})()
    path.refresh(None, seen=10)  # the plan (and its live state) exported
    path.refresh(None, seen=10)
    path.refresh(None, seen=10)
    assert pushed == []
    path.refresh(None, seen=11)
    assert pushed == [len(path._nodes)]


def test_remembered_unit_digests_give_the_same_answers_and_only_held_prefixes_are_kept():
    """The digest memo (native/src/hashmemo.rs) changes no answer, remembers only units of a prefix some node holds,
    and is off at 0 entries."""
    rng, index, docs = _fleet(5)
    cached = bench.prompts(docs, 8, rng)
    uncached = [[rng.randrange(50_000, 60_000) for _ in range(300)] for _ in range(2)]
    path = native.NativeRoute(index, HitSearch("native"), STALE)
    off = native.NativeRoute(index, HitSearch("native"), STALE, memo_entries=0)
    path.refresh(None)
    off.refresh(None)
    bodies = [msgspec.json.encode(RouteRequest(token_ids=t, top_k=2)) for t in cached]
    first = [_plain(path.answer(b)) for b in bodies]
    after_first = path.router.memo_stats()
    assert after_first["admitted"] > 0 and after_first["entries"] == after_first["admitted"]
    again = [_plain(path.answer(b)) for b in bodies]
    after_again = path.router.memo_stats()
    assert again == first == [_plain(off.answer(b)) for b in bodies]
    assert first == [_python(index, RouteRequest(token_ids=t, top_k=2)) for t in cached]
    # the second pass read every held unit from the memo and admitted nothing new
    assert after_again["hits"] - after_first["hits"] >= after_first["admitted"]
    assert after_again["admitted"] == after_first["admitted"]
    # and read the held prefixes' ids from their remembered text (native/src/idtext.rs), as many ids as the
    # digest memo gave units' worth, without admitting any text again
    assert after_first["text_admitted"] > 0 and after_first["text_ids"] == after_first["text_admitted"]
    assert after_again["text_taken"] - after_first["text_taken"] >= 16 * after_first["admitted"]
    assert after_again["text_admitted"] == after_first["text_admitted"]
    # prompts no node holds are never kept, and hashed only to their first unit: its full-attention block (16
    # tokens, the unit) is held by no node, so no hit can pass it (native/src/reach.rs)
    for t in uncached:
        body = msgspec.json.encode(RouteRequest(token_ids=t, top_k=1))
        got, want = _settled(lambda: _plain(path.answer(body)), lambda: _python(index, RouteRequest(token_ids=t,
                                                                                                   top_k=1)))
        assert got == want
        path.answer(body)
    final = path.router.memo_stats()
    assert final["admitted"] == after_again["admitted"] and final["hits"] == after_again["hits"]
    assert final["misses"] - after_again["misses"] == 2 * 2
    assert off.router.memo_stats()["entries"] == 0 and off.router.memo_stats()["hits"] == 0
    assert off.router.memo_stats()["text_ids"] == 0 and off.router.memo_stats()["text_taken"] == 0
    # the same prompts written with spaces match no remembered text, and answer alike
    spaced = [b.replace(b",", b", ") for b in bodies]
    assert [_plain(path.answer(b)) for b in spaced] == first
    assert path.router.memo_stats()["text_taken"] == final["text_taken"]
