"""In-process benchmark of the token-id route path (`kvpipe bench route` runs it next to the same
workload over HTTP: `kvpipe.bench.route_http`): a seeded fleet of nodes holding realistic
hybrid caches in a real `Index`, then requests timed end to end with the hashing cost (token ids →
every configuration's block hashes) reported apart from the hit search.

Workload: `documents` shared prompts of `prompt_tokens` tokens; each node caches `per_node` of them
as vLLM with default retention would: full-attention blocks over a random prefix, the sliding-window
group only the window's blocks at the end of that prefix, a random share of both offloaded to CPU.
A request is a document cut at a random length plus a fresh suffix (a new user turn).

Each request is routed on both hit search engines (`kvpipe.processors.router.hits`: native and the Python
reference), back to back with the order alternating, and the answers must be equal; with the bench
extra `ai-dynamo-runtime` the same request's full-attention hashes are then looked up in Dynamo's
RadixTree (`kvpipe.bench.route_dynamo`).
"""
from __future__ import annotations

import gc
import random
import statistics
import time
import tracemalloc
from functools import partial
from typing import Any

import msgspec

from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.gpu.hit import ViewCache, sliding_blocks_needed
from kvpipe.processors.core import native, slots
from kvpipe.processors.core.index import Index
from kvpipe.bench import snapshot as snapshot_bench
from kvpipe.bench.route_dynamo import MISSING as DYNAMO_MISSING
from kvpipe.bench.route_dynamo import back_to_back
from kvpipe.bench.route_dynamo import build as build_dynamo
from kvpipe.bench.route_dynamo import find as find_dynamo
from kvpipe.bench.route_dynamo import load as load_dynamo
from kvpipe.processors.router.cohort import cohort_hits
from kvpipe.processors.router.decide import route, token_cohorts
from kvpipe.processors.router.hashing import PromptHasher
from kvpipe.processors.router.plan import plan
from kvpipe.processors.router.hits import HitSearch
from kvpipe.processors.router.model import RouteAnswer, RouteRequest
from kvpipe.processors.router.native import NativeRoute
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import BlockStored

LAYOUT = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
          GroupSpec(group_idx=1, kind="sliding_window", block_size=32, sliding_window=1024),
          GroupSpec(group_idx=2, kind="sliding_window", block_size=16, sliding_window=512)]


def layout(windows: int) -> list[GroupSpec]:
    """Full attention and `windows` (1 or 2) sliding-window groups of different specs."""
    if not 1 <= windows <= len(LAYOUT) - 1:
        raise ValueError(f"windows must be 1..{len(LAYOUT) - 1}")
    return LAYOUT[:1 + windows]
CONFIGS = [HashConfig(algorithm="sha256", hash_block_size=16),
           HashConfig(algorithm="sha256_cbor", hash_block_size=16, int_hashes=False)]


def _stored(hashes: list, group: int, bs: int, medium: str) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=bs, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def fleet(nodes: int, documents: int, prompt_tokens: int, per_node: int, configs: int,
          rng: random.Random, windows: int = 1) -> tuple[list[tuple[Envelope, list[BlockStored]]], list[list[int]]]:
    """Each node's one envelope (specs, hash configuration) with its cache as events, and the documents."""
    docs = [[rng.randrange(150_000) for _ in range(prompt_tokens)] for _ in range(documents)]
    views: dict[tuple[int, int], ViewCache] = {}
    for c in range(configs):
        cfg = CONFIGS[c]
        hasher = hasher_from_config(cfg)
        for d, doc in enumerate(docs):
            fine = hash_request_blocks(hasher, doc, cfg.hash_block_size)
            views[(c, d)] = ViewCache([external_hash(h, cfg.int_hashes) for h in fine], cfg.hash_block_size)
    out = []
    specs = layout(windows)
    fa = specs[0]
    for n in range(nodes):
        c = n % configs
        events = []
        for d in rng.sample(range(documents), per_node):
            fa_list = views[(c, d)].at(fa.block_size)
            cut = rng.randint(len(fa_list) // 4, len(fa_list))  # FA blocks cached: a prefix
            on_cpu = rng.randint(0, cut)  # blocks [on_cpu, cut) were offloaded
            events.append(_stored(list(fa_list[:on_cpu]), 0, fa.block_size, "GPU"))
            events.append(_stored(list(fa_list[on_cpu:cut]), 0, fa.block_size, "CPU"))
            for sw in specs[1:]:  # each window keeps only its blocks at the end of that prefix
                sw_list = views[(c, d)].at(sw.block_size)
                need = sliding_blocks_needed(sw.sliding_window or 0, sw.block_size)
                sw_end = cut * fa.block_size // sw.block_size
                tail = list(sw_list[max(0, sw_end - need):sw_end])
                events.append(_stored(tail, sw.group_idx, sw.block_size, "GPU" if rng.random() < 0.5 else "CPU"))
        env = Envelope(v=SCHEMA_MAJOR, node_id=f"node-{n:04d}", epoch=1, seq=0, ts=1.0, model="bench",
                       group_specs=specs, hash_config=CONFIGS[c])
        out.append((env, events))
    return out, docs


def build(nodes: int, documents: int, prompt_tokens: int, per_node: int, configs: int,
          rng: random.Random, windows: int = 1) -> tuple[Index, list[list[int]]]:
    envelopes, docs = fleet(nodes, documents, prompt_tokens, per_node, configs, rng, windows)
    return index_of(envelopes), docs


def index_of(envelopes: list[tuple[Envelope, list[BlockStored]]], store: slots.StoreKind | None = None) -> Index:
    index = Index(store=store)
    for n, (env, events) in enumerate(envelopes):
        index.apply(env, events, 0, n)
    return index


def stores(envelopes: list[tuple[Envelope, list[BlockStored]]], snapshots: bool = False) -> dict[str, Any]:
    """Both block stores on the same fleet, one after the other: bytes per (block × holder) entry
    (the native store's own count of its tables at their allocated size, and for both what
    tracemalloc saw the index allocate: the native tables are not Python allocations, so its traced
    figure is the Python side only) and the apply rate of the fleet's block events; with `snapshots`,
    each store's snapshot export and import timed per path (`kvpipe.bench.snapshot`)."""
    events = sum(len(ev.block_hashes) for _, evs in envelopes for ev in evs)
    out: dict[str, Any] = {"block_events": events}
    for kind in [k for k in slots.STORES if k == "python" or native.engine() == "native"]:
        gc.collect()
        tracemalloc.start()
        t = time.perf_counter()
        index = index_of(envelopes, kind)
        seconds = time.perf_counter() - t
        traced = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        entries = index.store.entries()
        own = index.store.memory_bytes()
        row: dict[str, Any] = {"entries": entries, "apply_block_events_per_s": round(events / seconds),
               "python_traced_bytes_per_entry": round(traced / max(entries, 1), 1)}
        if own is not None:
            row["native_bytes_per_entry"] = round(own / max(entries, 1), 1)
            row["bytes_per_entry"] = round((own + traced) / max(entries, 1), 1)
        else:
            row["bytes_per_entry"] = row["python_traced_bytes_per_entry"]
        if snapshots:  # after tracemalloc stopped: it would slow the Python paths many times over
            row["snapshot"] = snapshot_bench.times(index)
        out[kind] = row
        del index
    if "native" in out:
        out["memory_python_over_native"] = round(out["python"]["bytes_per_entry"] / out["native"]["bytes_per_entry"], 2)
    return out


def prompts(docs: list[list[int]], requests: int, rng: random.Random) -> list[list[int]]:
    """Requests: a document cut at a random length plus a fresh suffix (a new user turn)."""
    out = []
    for _ in range(requests):
        doc = rng.choice(docs)
        turn = [rng.randrange(150_000) for _ in range(rng.randint(1, 64))]
        out.append(doc[: rng.randint(len(doc) // 2, len(doc))] + turn)
    return out


def summary(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"mean_us": round(statistics.fmean(xs) * 1e6, 1), "p50_us": round(xs[len(xs) // 2] * 1e6, 1),
            "p99_us": round(xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6, 1)}


def _rows(answer: RouteAnswer) -> tuple:
    """What a route decides (timings left out): the engines must agree on it exactly."""
    return answer.chosen, answer.nodes, answer.no_signal


def run(nodes: int = 256, requests: int = 200, documents: int = 64, prompt_tokens: int = 2048,
        per_node: int = 8, configs: int = 1, seed: int = 0, dynamo: bool = True,
        compare_stores: bool = True, windows: int = 1, snapshots: bool = False) -> dict[str, Any]:
    """Time `requests` token-id routes over `nodes` nodes; `configs` = 1 or 2 distinct hash
    configurations among the nodes (2: the prompt is hashed twice per request). Every request is
    routed on each hit search engine in turn (order alternating), their answers checked equal,
    then (with `dynamo` and `ai-dynamo-runtime` installed) looked up in Dynamo's RadixTree."""
    if not 1 <= configs <= len(CONFIGS):
        raise ValueError(f"configs must be 1..{len(CONFIGS)}")
    rng = random.Random(seed)
    t0 = time.perf_counter()
    envelopes, docs = fleet(nodes, documents, prompt_tokens, per_node, configs, rng, windows)
    index = index_of(envelopes)
    build_s = time.perf_counter() - t0
    store_cmp = stores(envelopes, snapshots) if compare_stores else None
    engines = ["native", "python"] if native.engine() == "native" else ["python"]
    searches = {e: HitSearch(e) for e in engines}  # type: ignore[arg-type]
    timed: dict[str, dict[str, list[float]]] = {e: {"hashing": [], "search": [], "total": []} for e in engines}
    radix = load_dynamo() if dynamo else None
    tree = build_dynamo(radix, envelopes) if radix is not None else None
    fa_hasher = hasher_from_config(CONFIGS[0])
    dyn: list[float] = []
    dynamo_checked = 0  # requests whose node → prefix depth answers were equal on both sides
    prefix_route: list[float] = []  # our route of Dynamo's question (one group, prefix), whole call
    native_prefix: list[float] = []  # the same question to the native route path, as the hash-unit chain
    cohort_calls: list[float] = []  # the native cohort call(s) alone: every node's hits, nothing else
    decision: dict[str, list[float]] = {"search": [], "total": []}
    hits = []
    # the native route decision (native/src/decide.rs): the route server's whole answer from the request's
    # bytes (JSON read, hashing, search, ranking, JSON written), checked equal to the Python path's
    path = NativeRoute(index, searches["native"], None) if "native" in searches else None
    # the same path without the digest memo (native/src/hashmemo.rs): every token-id prompt hashed in full
    cold = NativeRoute(index, searches["native"], None, memo_entries=0) if path is not None else None
    for p in (cold, path):  # `path` last: the index tells the last one attached when its nodes move
        if p is not None:
            p.refresh(None)
    native_times: dict[str, list[float]] = {"decision": [], "full": [], "decision_search": [], "units_decision": [],
                                            "units_full": [], "blocks_decision": [], "blocks_full": [],
                                            "uncached_decision": [], "decision_memo_off": []}
    specs = layout(windows)
    native_checked = 0
    warm_cases: list[tuple[list, dict]] = []  # per request: Dynamo's hashes and our calls, for `back_to_back`
    uncached: list[int] | None = None  # this request's prompt no node holds
    fresh = random.Random(seed + 1)  # prompts no node holds (their own stream: the cached ones stay as they were)
    for r, tokens in enumerate(prompts(docs, requests, rng)):
        decided = {}
        for e in engines if r % 2 == 0 else engines[::-1]:
            t = time.perf_counter()
            answer = route(index, RouteRequest(token_ids=tokens), now=1.0, search=searches[e])
            timed[e]["total"].append(time.perf_counter() - t)
            timed[e]["hashing"].append(answer.hashing_s)
            timed[e]["search"].append(answer.search_s)
            decided[e] = answer
        first = decided[engines[0]]
        for e in engines[1:]:
            if _rows(decided[e]) != _rows(first):
                raise RuntimeError(f"request {r}: the {e} hit search answered differently from {engines[0]}")
        hits.append(first.nodes[0].gpu_tokens + first.nodes[0].loadable_tokens if first.nodes else 0)
        # the router's decision alone (top_k 1: every node ranked, the chosen one's row built)
        e = engines[0]
        t = time.perf_counter()
        one = route(index, RouteRequest(token_ids=tokens, top_k=1), now=1.0, search=searches[e])
        decision["total"].append(time.perf_counter() - t)
        decision["search"].append(one.search_s)
        if one.chosen != first.chosen or one.nodes != first.nodes[:1]:
            raise RuntimeError(f"request {r}: top_k 1 chose differently from the full answer")
        if path is not None and path.router.ready:
            # the decision with and without the digest memo, in alternating order (the first after the Python
            # calls above finds less in the cache)
            assert cold is not None
            body = _ENCODE(RouteRequest(token_ids=tokens, top_k=1))
            pair = (("decision", path), ("decision_memo_off", cold))
            for name, p in pair if r % 2 == 0 else pair[::-1]:
                t = time.perf_counter()
                got = p.answer(body)
                native_times[name].append(time.perf_counter() - t)
                if got is None or without_timings(got) != without_timings(_ENCODE(one)):
                    raise RuntimeError(f"request {r}: the native {name} differs from the Python path's")
                if name == "decision":
                    native_times["decision_search"].append(_DECODE(got)["search_s"])
            t = time.perf_counter()
            got = path.answer(_ENCODE(RouteRequest(token_ids=tokens)))
            native_times["full"].append(time.perf_counter() - t)
            if got is None or without_timings(got) != without_timings(_ENCODE(first)):
                raise RuntimeError(f"request {r}: the native full answer differs from the Python path's")
            # the same prompt as its hash-unit chain (the hashes ready made, as Dynamo gets them)
            cfg = CONFIGS[0]
            chain: list[int | str] = [h if isinstance(h, int) else "0x" + h.hex() for h in (
                external_hash(d, True) for d in hash_request_blocks(fa_hasher, tokens, cfg.hash_block_size))]
            # and as per-group block hashes (a router that hashes per group itself)
            forms: dict[str, dict[str, Any]] = {
                "units": {"unit_hashes": chain, "hash_block_size": cfg.hash_block_size},
                "blocks": {"block_hashes": group_lists(chain, specs)}}
            for form, fields in forms.items():
                for name, k, want in ((f"{form}_decision", 1, one), (f"{form}_full", None, first)):
                    body = _ENCODE(RouteRequest(**fields, num_tokens=len(tokens), top_k=k))
                    t = time.perf_counter()
                    got = path.answer(body)
                    native_times[name].append(time.perf_counter() - t)
                    same = got is not None and _DECODE(got)["nodes"] == _DECODE(_ENCODE(want))["nodes"]
                    if not same:
                        raise RuntimeError(f"request {r}: the native {name} differs from the token-id answer")
            # a prompt no node holds, as long: every node is ranked by load alone
            uncached = [fresh.randrange(150_000) for _ in tokens]
            req = RouteRequest(token_ids=uncached, top_k=1)
            t = time.perf_counter()
            got = path.answer(_ENCODE(req))
            native_times["uncached_decision"].append(time.perf_counter() - t)
            if got is None or without_timings(got) != without_timings(_ENCODE(route(index, req, now=1.0))):
                raise RuntimeError(f"request {r}: the native decision of an uncached prompt differs from Python's")
            native_checked += 1
        if "native" in searches:
            req = RouteRequest(token_ids=tokens)
            cohorts = token_cohorts(plan(index, None), PromptHasher(tokens), [])
            t = time.perf_counter()
            for lists, members in cohorts.values():
                cohort_hits(index, searches["native"], lists, members, req, len(tokens), None)
            cohort_calls.append(time.perf_counter() - t)
        if tree is not None:
            fa = [external_hash(h, CONFIGS[0].int_hashes)
                  for h in hash_request_blocks(fa_hasher, tokens, CONFIGS[0].hash_block_size)]
            # the request's wire form of the same hashes (ints here; bytes would travel as "0x…" text)
            fa_wire: list[int | str] = [h if isinstance(h, int) else "0x" + h.hex() for h in fa]
            # Dynamo's question to the native route path: the full answer (every node with a hit), prefixes per
            # group and medium; full attention has 16-token blocks, so the unit chain is its list. Timed next to
            # Dynamo's find_matches in alternating order, so neither runs in the other's wake more often.
            native_ok = path is not None and path.router.ready
            body = _ENCODE(RouteRequest(unit_hashes=fa_wire, hash_block_size=CONFIGS[0].hash_block_size,
                                        num_tokens=len(tokens), semantics="prefix-per-group"))
            native_got: bytes | None = None
            for who in ("dynamo", "native") if r % 2 == 0 else ("native", "dynamo"):
                if who == "dynamo":
                    took, scores = find_dynamo(tree, fa)
                    dyn.append(took)
                elif native_ok:
                    assert path is not None
                    t = time.perf_counter()
                    native_got = path.answer(body)
                    native_prefix.append(time.perf_counter() - t)
            if native_ok and path is not None and cold is not None:
                warm_cases.append((fa, _warm_calls(path, cold, tokens, fa_wire, body, uncached, specs)))
            # the same question on our index's Python path: each node's longest full-attention prefix on any
            # medium (timed as a route shows it, then checked with every node listed)
            t = time.perf_counter()
            route(index, RouteRequest(block_hashes={0: fa_wire}, semantics="prefix-per-group"), now=1.0)
            prefix_route.append(time.perf_counter() - t)
            prefix = route(index, RouteRequest(block_hashes={0: fa_wire}, semantics="prefix-per-group", include_zero=True),
                           now=1.0)
            ours = {int(row.node_id.rsplit("-", 1)[1]): row.groups[0].prefix_blocks["any"]
                    for row in prefix.nodes if row.groups and row.groups[0].prefix_blocks}
            theirs = {(k[0] if isinstance(k, tuple) else k): v for k, v in dict(scores).items()}
            if {k: v for k, v in ours.items() if v} != {k: v for k, v in theirs.items() if v}:
                raise RuntimeError(f"request {r}: Dynamo's node → depth answer differs from our index's prefixes")
            if native_ok:
                want = route(index, RouteRequest(**_DECODE(body)), now=time.time())
                if native_got is None or without_timings(native_got) != without_timings(_ENCODE(want)):
                    raise RuntimeError(f"request {r}: the native prefix route differs from the Python path's")
                # every node it shows (those with a hybrid hit) has Dynamo's depth as its full-attention prefix
                for row in _DECODE(native_got)["nodes"]:
                    node = int(row["node_id"].rsplit("-", 1)[1])
                    if row["groups"][0]["prefix_blocks"]["any"] != theirs.get(node, 0):
                        raise RuntimeError(f"request {r}: node {node}'s prefix differs from Dynamo's depth")
            dynamo_checked += 1
    main = timed[engines[0]]
    out: dict[str, Any] = {
        "nodes": nodes, "requests": requests, "documents": documents, "prompt_tokens": prompt_tokens,
        "per_node": per_node, "hash_configs": configs, "seed": seed,
        "groups": [f"{g.kind}/{g.block_size}" + (f"/{g.sliding_window}" if g.sliding_window else "")
                   for g in layout(windows)],
        "index_blocks": sum(v for per in index.sizes().values() for v in per.values()),
        "build_s": round(build_s, 3),
        "engine": engines[0], "answers_checked": len(hits) if len(engines) > 1 else 0,
        "hashing": summary(main["hashing"]), "search": summary(main["search"]),
        "route_total": summary(main["total"]),
        "engines": {e: {"search": summary(t["search"]), "route_total": summary(t["total"])} for e, t in timed.items()},
        "decision_top_k_1": {"search": summary(decision["search"]), "route_total": summary(decision["total"])},
        "mean_best_hit_tokens": round(statistics.fmean(hits), 1),
        "index_store": index.store.kind,
    }
    if store_cmp is not None:
        out["stores"] = store_cmp
    if cohort_calls:
        out["native_cohort_call"] = summary(cohort_calls)
    if len(engines) > 1:
        out["search_p50_python_over_native"] = round(
            out["engines"]["python"]["search"]["p50_us"] / max(out["engines"]["native"]["search"]["p50_us"], 0.1), 2)
    if tree is not None:
        d = summary(dyn)
        out["dynamo_radix_tree"] = {"find_matches": d, "semantics": "one group (full attention), prefix, no media",
                                    "answers_checked": dynamo_checked,
                                    "ratio_dynamo_p50_over_ours_search_p50":
                                        round(d["p50_us"] / max(out["search"]["p50_us"], 0.1), 4)}
        out["prefix_route_one_group"] = summary(prefix_route)
        out["dynamo_radix_tree"]["ratio_dynamo_p50_over_prefix_route_p50"] = round(
            d["p50_us"] / max(out["prefix_route_one_group"]["p50_us"], 0.1), 4)
        if native_prefix:
            out["native_prefix_route"] = {**summary(native_prefix), "what": "Dynamo's question (each node's longest "
                                          "prefix) to the native route path: the hash-unit chain, semantics "
                                          "prefix-per-group, every node holding anything, every group's prefixes"}
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_prefix_route_p50"] = round(
                d["p50_us"] / max(out["native_prefix_route"]["p50_us"], 0.1), 4)
        out["dynamo_radix_tree"]["ratio_dynamo_p50_over_decision_search_p50"] = round(
            d["p50_us"] / max(out["decision_top_k_1"]["search"]["p50_us"], 0.1), 4)
        if cohort_calls:
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_cohort_call_p50"] = round(
                d["p50_us"] / max(out["native_cohort_call"]["p50_us"], 0.1), 4)
    else:
        out["dynamo_radix_tree"] = {"missing": DYNAMO_MISSING if dynamo else "skipped (--no-dynamo)"}
    if native_checked:
        assert path is not None
        out["native_route"] = {"answers_checked": native_checked,
                               "decision_top_k_1": summary(native_times["decision"]),
                               "full_answer": summary(native_times["full"]),
                               "decision_search_part": summary(native_times["decision_search"]),
                               "uncached_decision_top_k_1": summary(native_times["uncached_decision"]),
                               "decision_top_k_1_memo_off": summary(native_times["decision_memo_off"]),
                               "hash_memo": {**dict(path.router.memo_stats()), "what": "prompt units whose digest "
                                             "came from the memo of held units (hits) or was computed (misses)"},
                               "unit_chain": {"decision_top_k_1": summary(native_times["units_decision"]),
                                              "full_answer": summary(native_times["units_full"]),
                                              "what": "the same prompts sent as their hash-unit chain "
                                                      "(unit_hashes): JSON read, search, ranking, JSON written"},
                               "block_hashes": {"decision_top_k_1": summary(native_times["blocks_decision"]),
                                                "full_answer": summary(native_times["blocks_full"]),
                                                "what": "the same prompts sent as per-group block hashes "
                                                        "(block_hashes, num_tokens): JSON read, search, ranking, "
                                                        "JSON written"},
                               "what": "the route server's answer from the request bytes: JSON read, hashing, "
                                       "search, ranking, JSON written"}
        if tree is not None:
            d = out["dynamo_radix_tree"]["find_matches"]["p50_us"]
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_decision_p50"] = round(
                d / max(out["native_route"]["decision_top_k_1"]["p50_us"], 0.1), 4)
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_full_answer_p50"] = round(
                d / max(out["native_route"]["full_answer"]["p50_us"], 0.1), 4)
            units = out["native_route"]["unit_chain"]
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_unit_chain_decision_p50"] = round(
                d / max(units["decision_top_k_1"]["p50_us"], 0.1), 4)
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_unit_chain_full_answer_p50"] = round(
                d / max(units["full_answer"]["p50_us"], 0.1), 4)
            blocks = out["native_route"]["block_hashes"]
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_block_hashes_decision_p50"] = round(
                d / max(blocks["decision_top_k_1"]["p50_us"], 0.1), 4)
            out["dynamo_radix_tree"]["ratio_dynamo_p50_over_native_block_hashes_full_answer_p50"] = round(
                d / max(blocks["full_answer"]["p50_us"], 0.1), 4)
    else:
        out["native_route"] = {"missing": "the native route path is not built or not open for this fleet"}
    if tree is not None and warm_cases:
        warm = {name: summary(t) for name, t in back_to_back(tree, warm_cases).items()}
        best = warm["dynamo"]["p50_us"]
        out["dynamo_radix_tree"]["back_to_back"] = {
            **warm, "what": "each call asked twice in a row and the second timed: Dynamo's lookups in a loop of their "
                            "own once its tree thread settled, then ours (Dynamo at its best, as under steady load)",
            **{f"ratio_dynamo_p50_over_{name}_p50": round(best / max(warm[name]["p50_us"], 0.1), 4)
               for name in warm if name != "dynamo"}}
    return out


def group_lists(chain: list, specs: list[GroupSpec]) -> dict[int, list]:
    """Each group's block hashes from the prompt's hash-unit chain (wire form): the chain's view at the group's block
    size (every k-th unit hash, k = block size / unit), the lists a router hashing per group sends as `block_hashes`."""
    views = ViewCache(chain, CONFIGS[0].hash_block_size)
    return {s.group_idx: list(views.at(s.block_size)) for s in specs}


def _warm_calls(path: NativeRoute, cold: NativeRoute, tokens: list[int], fa_wire: list, prefix_body: bytes,
                uncached: list[int] | None = None, specs: list[GroupSpec] | None = None) -> dict:
    """Our calls for one request in `back_to_back`: the decision and full answer in all three prompt forms (the
    token-id decision also with the digest memo off), the prefix route, and the decision of a prompt no node holds."""
    bs = CONFIGS[0].hash_block_size
    bodies = {"decision": (path, RouteRequest(token_ids=tokens, top_k=1)),
              "decision_memo_off": (cold, RouteRequest(token_ids=tokens, top_k=1)),
              "full_answer": (path, RouteRequest(token_ids=tokens)),
              "unit_chain_decision": (path, RouteRequest(unit_hashes=fa_wire, hash_block_size=bs,
                                                         num_tokens=len(tokens), top_k=1)),
              "unit_chain_full_answer": (path, RouteRequest(unit_hashes=fa_wire, hash_block_size=bs,
                                                            num_tokens=len(tokens)))}
    if specs is not None:
        lists = group_lists(fa_wire, specs)
        bodies["block_hashes_decision"] = (path, RouteRequest(block_hashes=lists, num_tokens=len(tokens), top_k=1))
        bodies["block_hashes_full_answer"] = (path, RouteRequest(block_hashes=lists, num_tokens=len(tokens)))
    if uncached is not None:
        bodies["uncached_decision"] = (path, RouteRequest(token_ids=uncached, top_k=1))
    calls = {name: partial(p.answer, _ENCODE(req)) for name, (p, req) in bodies.items()}
    calls["prefix_route"] = partial(path.answer, prefix_body)
    return calls


_ENCODE = msgspec.json.encode
_DECODE = msgspec.json.decode


def without_timings(answer: bytes | dict) -> dict:
    """A route answer (JSON bytes or decoded) without its timings, which differ run to run: what the native and
    the Python paths must agree on."""
    d = dict(_DECODE(answer) if isinstance(answer, bytes) else answer)
    d.pop("hashing_s"), d.pop("search_s")
    d["hash_configs"] = [{k: v for k, v in h.items() if k != "hashing_s"} for h in d["hash_configs"]]
    return d
