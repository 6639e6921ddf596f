"""Router v2's decision: per node, vLLM's hybrid hit on GPU and on GPU ∪ CPU, a score that weighs
that cache benefit against the node's load, and a chosen node.

Hit (the default semantics, "hma"). For every eligible node, each of its groups' hash lists (from
token ids: `kvpipe.processors.router.hashing`, per the node's own hash configuration; or the request's
validated lists) is looked up once in the index's inverted view (`hma.held_positions`), and
`kvpipe.gpu.hit.longest_hybrid_hit_in_views` — the rule the GPU side's coordinator runs — gives the hit
on the node's own group specs, capped at `num_tokens − 1` (vLLM never reuses the last token). All
candidate nodes are searched in one call (`kvpipe.processors.router.hits`: the native crate by default,
held equal to `kvpipe.gpu.hit` by a property test); each node's row is built in `kvpipe.processors.router.rows`.

    gpu_tokens      = hit(blocks on GPU ∪ speculative)
    loadable_tokens = hit(blocks on any medium ∪ speculative) − gpu_tokens

Speculative blocks are in-flight accounting's guesses (`kvpipe.processors.router.inflight`): blocks of
requests sent to the node whose events have not arrived. They count as GPU blocks; every row
says how many of its blocks are only guesses (`speculative`, `groups[].speculative_blocks`).

Score (higher is better; all weights are `Scoring` knobs of the request):

    cap     = max(num_tokens − 1, 1)
    benefit = overlap_weight · (gpu_tokens + cpu_weight · loadable_tokens) / cap
    load    = running_weight · running
            + waiting_weight · (waiting + in_flight)
            + kv_usage_weight · kv_usage
    score   = benefit − load

The benefit is the fraction of the prompt the node need not prefill (a loadable token is worth
`cpu_weight` of a resident one, since it must be copied back first), so it lies in
[0, overlap_weight] whatever the prompt length; the load terms are per request and per unit of KV
usage. `running`, `waiting`, `kv_usage` come from a per-node `Load` given by the caller (the node's
last report); `in_flight` is the number of requests routed to the node and not yet finished
(in-flight accounting), which the node's own report may not show yet. With the defaults a whole
prompt on GPU (benefit 1.0) outweighs 20 waiting requests; an empty cache is decided by load alone.

Choice: the best tier present wins — live (or partial) nodes before stale ones before suspect
ones, since a suspect node's index may be wrong. Within the tier, `temperature == 0` (default)
takes the highest score (ties: more GPU tokens, more loadable tokens, node id); `temperature > 0`
samples with probabilities ∝ exp(score / temperature) from a seeded generator (`Scoring.seed`,
else derived from `request_id`, else 0), so equal requests get equal answers.

Nodes that can never match are not rows but `no_signal` entries with the reason: expired, another
model, no group specs or hash configuration published, a configuration that cannot be reproduced
(random seed, unknown algorithm), block sizes that are not whole hash units, or hash lists that do
not fit the node's groups.
"""
from __future__ import annotations

import hashlib
import math
import operator
import random
import time
from collections.abc import Callable, Mapping, Sequence

import msgspec

from kvpipe.processors.core.index import Index, NodeState
from kvpipe.processors.core.slots import NativeStore
from kvpipe.processors.router.hma import NodeModel, at_units, held_positions
from kvpipe.processors.router.hashing import PromptHasher, hash_views, layout_mismatch
from kvpipe.processors.router.cohort import Light, build_row, cohort_hits, touched_light
from kvpipe.processors.router.hits import Engine, HitSearch, Job
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.plan import Plan, label, plan
from kvpipe.processors.router.model import (
    HashConfigUsed,
    Load,
    NodeRoute,
    NoSignal,
    RouteAnswer,
    RouteError,
    RouteRequest,
    Scoring,
)
from kvpipe.processors.router.request import Checked, check_group_lists, check_request
from kvpipe.processors.router.rows import TIER, Pending, Zero, node_row, prepare, zero_rank, zero_row, zero_shape
from kvpipe.schemas.events import ExternalHash

Lists = dict[int, list[ExternalHash]]
_TIER = TIER
_NO_LOAD = Load()


def route(index: Index, req: RouteRequest, *, loads: Mapping[str, Load] | None = None,
          inflight: InFlight | None = None, now: float | None = None,
          stale_after_s: float | None = None, search: HitSearch | None = None) -> RouteAnswer:
    """One index's answer to `req`: `finish([route_local(...)])`. `loads`: per node id; `now`: wall
    clock (default: time.time()), for staleness (against the node's `last_seen`) and in-flight TTLs.
    With `req.request_id` and an `inflight`, the request is recorded as sent to the chosen node."""
    now = time.time() if now is None else now
    checked = check_request(req)
    local = route_local(index, req, loads=loads, inflight=inflight, now=now, stale_after_s=stale_after_s,
                        search=search, checked=checked)
    return finish([local], req, inflight=inflight, index=index, now=now, checked=checked)


def route_local(index: Index, req: RouteRequest, *, loads: Mapping[str, Load] | None = None,
                inflight: InFlight | None = None, now: float | None = None,
                stale_after_s: float | None = None, search: HitSearch | None = None,
                checked: Checked | None = None) -> RouteAnswer:
    """The rows of every eligible node of this index, ranked, nothing chosen or left out yet: the
    part of an answer one worker of several contributes (`finish` merges, chooses and trims).
    A row depends only on its node, so concatenating workers' rows loses nothing. `search`: the
    hit search engine (default: `set_default_search`'s, else native when built); `checked`:
    `check_request(req)` when the caller has it already."""
    checked = check_request(req) if checked is None else checked
    scoring = req.scoring or Scoring()
    now = time.time() if now is None else now
    if inflight is not None:
        inflight.sweep(now)
    planned = plan(index, req.model)  # eligibility and cohorts, kept while the index's nodes hold still
    no_signal: list[NoSignal] = list(planned.no_signal)
    hasher = PromptHasher(checked.token_ids, checked.keys) if checked.token_ids is not None else None
    if hasher is not None:
        no_signal.extend(planned.config_problems)
        cohorts = token_cohorts(planned, hasher, no_signal)
    elif checked.unit_hashes is not None:
        no_signal.extend(planned.config_problems)
        cohorts = unit_cohorts(planned, checked, no_signal)
    else:
        cohorts = _hash_cohorts(planned, checked, no_signal)
    t_search = time.perf_counter()
    loads = {} if loads is None else loads  # (not `or`: sizing a mapping can cost a pass over it)
    rows: list[NodeRoute] = []
    pending: list[Pending] = []
    jobs: list[Job] = []
    # A node holding nothing can only matter as the chosen one unless every row is shown or the
    # choice samples the whole tier: then only the best-ranked such node gets a row (its rank is
    # worked out without building the row), which leaves the finished answer unchanged.
    zeros = _Zeros(req.include_zero or scoring.temperature > 0, rows, scoring, loads, now, stale_after_s)
    search = search or _default_search()
    deferred: list[tuple[list, set[int], dict[int, Zero], Lists]] = []  # native cohorts' zero nodes
    light: list[Light] = []  # native cohorts' rows, ranked, built at the end (only those shown)
    for lists, members in cohorts.values():
        zero: dict[int, Zero] = {}  # by id(model): models outlive this call, so ids are not reused here
        # the common cohort in one native call (`router.cohort`): only nodes holding blocks answer
        touched = cohort_hits(index, search, lists, members, req, checked.num_tokens, inflight)
        if touched is not None:
            touched_light(light, zero, lambda node, model: _shape(planned, zero, node, model, lists, checked.num_tokens,
                                                                  req),
                          members, touched, scoring, loads, _NO_LOAD, now, stale_after_s)
            deferred.append((members, {t[0] for t in touched}, zero, lists))
            continue
        held = held_positions(index, lists)
        for node, model in members:
            node_held = held.get(node)
            if node_held is None and (inflight is None or not inflight.tracks(node.node_id)):
                # holds none of the request's blocks and has nothing in flight: no search, no sets
                zeros.add(_shape(planned, zero, node, model, lists, checked.num_tokens, req), node)
                continue
            p = prepare(node, model, lists, node_held or {}, checked.num_tokens, req, inflight, now,
                         stale_after_s)
            if p.searched:
                p.jobs = (len(jobs), len(jobs) + 1 if p.any_sets != p.gpu_sets else len(jobs))
                jobs.append(Job(model, p.groups, p.lens, p.gpu_sets, p.cap))
                if p.any_sets != p.gpu_sets:
                    jobs.append(Job(model, p.groups, p.lens, p.any_sets, p.cap))
            pending.append(p)
    if deferred and (zeros.every or not _zero_cannot_win(rows, light, scoring, loads)):
        for members, touched_set, zero, lists in deferred:
            zeros.add_members(members, touched_set, lambda node, model: _shape(
                planned, zero, node, model, lists, checked.num_tokens, req))
    zeros.finish()
    hits = search.search(jobs)  # every other node's hits in one call
    for p in pending:
        row = node_row(p, hits, req, scoring, loads.get(p.node.node_id, _NO_LOAD), inflight)
        if isinstance(row, str):
            no_signal.append(NoSignal(p.node.node_id, row, "specs"))
            continue
        rows.append(row)
    if light:
        store = index.store
        assert isinstance(store, NativeStore)  # light rows come from the native cohort call only
        _build_light(rows, light, req, scoring, store.media_names, store.media)
    rows.sort(key=_rank)
    models = planned.models
    return RouteAnswer(
        chosen=None, semantics=req.semantics,
        model=req.model if req.model is not None else (next(iter(models)) if len(models) == 1 else None),
        num_tokens=checked.num_tokens, hash_configs=hasher.used() if hasher else [], nodes=rows,
        no_signal=no_signal, hashing_s=round(hasher.seconds, 6) if hasher else 0.0,
        search_s=round(time.perf_counter() - t_search, 6))


class _Zeros:
    """Nodes holding nothing and nothing in flight: a row each when every row may be shown or the
    choice samples the tier (`every`), else only the best-ranked one (`zero_rank`, no row built)."""

    def __init__(self, every: bool, rows: list[NodeRoute], scoring: Scoring, loads: Mapping[str, Load], now: float,
                 stale_after_s: float | None) -> None:
        self.every, self.rows, self.scoring, self.loads = every, rows, scoring, loads
        self.now, self.stale_after_s = now, stale_after_s
        self.best: tuple | None = None

    def add(self, z: Zero, node: NodeState) -> None:
        load = self.loads.get(node.node_id, _NO_LOAD)
        if self.every:
            self.rows.append(zero_row(z, node, self.scoring, load, self.now, self.stale_after_s))
            return
        rank = zero_rank(z, node, self.scoring, load, self.now, self.stale_after_s)
        if self.best is None or rank < self.best[0]:
            self.best = (rank, z, node, load)

    def add_members(self, members: Sequence[tuple[NodeState, NodeModel]], skip: set[int],
                    shape: Callable[[NodeState, NodeModel], Zero]) -> None:
        """`add` for every member not in `skip`. Ranking only, the rank of `zero_rank` worked out inline: with
        nothing held a node's score is its load term alone (the benefit is 0.0 whatever its cap) and its tier
        depends on the node, not on the shape, so a shape is made only for the best node. An uncached prompt
        ranks every node of the fleet this way; per node this is a few attribute reads, not a row's rules."""
        if self.every:
            for m, (node, model) in enumerate(members):
                if m not in skip:
                    self.add(shape(node, model), node)
            return
        s = self.scoring
        rw, ww, kw = s.running_weight, s.waiting_weight, s.kv_usage_weight
        now, stale = self.now, self.stale_after_s
        get = self.loads.get
        best = self.best[0] if self.best is not None else None
        found = None
        for m, (node, model) in enumerate(members):
            if m in skip:
                continue
            tier = 2 if node.suspect else 1 if stale is not None and now - node.last_seen > stale else 0
            if best is not None and tier > best[0]:
                continue
            load = get(node.node_id, _NO_LOAD)
            # rows.score(0, 0, …) term by term: benefit 0.0 minus rows.penalty(load, 0, s)
            rank = (tier, -round(0.0 - (rw * load.running + ww * (load.waiting + 0) + kw * load.kv_usage), 9), 0, 0,
                    node.node_id)
            if best is None or rank < best:
                best, found = rank, (node, model, load)
        if found is not None:
            node, model, load = found
            self.best = (best, shape(node, model), node, load)

    def finish(self) -> None:
        if self.best is not None:
            _, z, node, load = self.best
            self.rows.append(zero_row(z, node, self.scoring, load, self.now, self.stale_after_s))


def _shape(planned: Plan, cache: dict[int, Zero], node: NodeState, model: NodeModel, lists: Lists,
           num_tokens: int | None, req: RouteRequest) -> Zero:
    """`zero_shape` once per model of a cohort (keyed by id: models outlive the call), and across
    requests of the same shape while the plan holds."""
    z = cache.get(id(model))
    if z is None:
        key = (id(model), tuple((g, len(lists[g])) for g in model.groups if g in lists), num_tokens,
               _form(req), req.semantics)
        z = planned.zeros.get(key)
        if z is None:
            if len(planned.zeros) >= _ZEROS_MAX:
                planned.zeros.clear()
            z = planned.zeros[key] = zero_shape(node, model, lists, num_tokens, req)
        cache[id(model)] = z
    return z


_ZEROS_MAX = 4096


_first = operator.itemgetter(0)


def _build_light(rows: list[NodeRoute], light: list[Light], req: RouteRequest, scoring: Scoring,
                 names: Callable[[int], str], media: Sequence[str]) -> None:
    """Build the rows of `light` into `rows`: all of them, or, when the answer shows at most
    `top_k` rows and the choice is the best-ranked row, only those this worker's part can
    contribute — its best-ranked row (the choice, if it wins across workers) and its first
    `top_k` rows with a hit (`finish` shows rows with a hit or chosen, the first `top_k`). No
    worker's dropped row could be shown, so the finished answer is unchanged."""
    if req.top_k is None or scoring.temperature > 0 or req.include_zero:
        rows.extend(build_row(x, names, media) for x in light)
        return
    ranked: list[tuple[tuple, NodeRoute | Light]] = [(_rank(r), r) for r in rows]
    ranked += [(x[0], x) for x in light]
    ranked.sort(key=_first)  # ranks are unique (they end with the node id): the row is never compared
    kept: list[NodeRoute] = []
    hits = 0
    for i, (_, r) in enumerate(ranked):
        has = bool(r.gpu_tokens or r.loadable_tokens) if isinstance(r, NodeRoute) else bool(r[5] or r[6])
        if i == 0 or (has and hits < req.top_k):
            kept.append(r if isinstance(r, NodeRoute) else build_row(r, names, media))
        hits += has
        if hits >= req.top_k:
            break
    rows[:] = kept


def _zero_cannot_win(rows: list[NodeRoute], light: list[Light], s: Scoring, loads: Mapping[str, Load]) -> bool:
    """Whether a row already outranks every node holding nothing, so none of those needs a rank: a
    live row with a positive score beats them when their score cannot be positive (load weights
    >= 0 and loads known to be >= 0: none given, or the index's, which refuses negative ones)."""
    if min(s.running_weight, s.waiting_weight, s.kv_usage_weight) < 0:
        return False
    if not getattr(loads, "nonnegative", False) and loads:  # (a mapping's size can cost a pass over it)
        return False
    return any(r.score > 0 and _TIER[r.state] == 0 for r in rows) or any(x[9] > 0 and x[0][0] == 0 for x in light)


def finish(answers: Sequence[RouteAnswer], req: RouteRequest, *, inflight: InFlight | None = None,
           index: Index | None = None, now: float | None = None, checked: Checked | None = None) -> RouteAnswer:
    """Merge `route_local` answers (one per worker; one alone for a single index), choose a node,
    apply `include_zero` and `top_k`. With `req.request_id`, an `inflight` and the `index` that
    holds the chosen node, the request is recorded as sent to it (with several workers the owner
    of the chosen node's partition records it: `record_sent`, behind `/route/sent`)."""
    checked = check_request(req) if checked is None else checked
    scoring = req.scoring or Scoring()
    rows = sorted((r for a in answers for r in a.nodes), key=_rank)
    no_signal = sorted((n for a in answers for n in a.no_signal), key=lambda n: n.node_id)
    if checked.token_ids is None and not rows:
        misfit = next((n for n in no_signal if n.cause == "lists"), None)
        if misfit is not None:
            raise RouteError(400, "block hashes do not fit the groups" if checked.hash_lists is not None else
                             "unit hashes do not fit the nodes' hash units", misfit.reason)
    chosen = _choose(rows, scoring, req.request_id)
    if chosen is not None and req.request_id is not None and inflight is not None and index is not None:
        record_sent(index, inflight, req.request_id, chosen, checked, time.time() if now is None else now)
    shown = [r for r in rows if req.include_zero or r.gpu_tokens or r.loadable_tokens or r.node_id == chosen]
    if req.top_k is not None and len(shown) > req.top_k:
        top = shown[:req.top_k]
        if chosen is not None and all(r.node_id != chosen for r in top):
            top[-1] = next(r for r in shown if r.node_id == chosen)
        shown = top
    used: dict[str, HashConfigUsed] = {}
    for a in answers:
        for h in a.hash_configs:
            prev = used.get(h.label)
            used[h.label] = h if prev is None else msgspec.structs.replace(
                prev, nodes=prev.nodes + h.nodes, hashing_s=round(prev.hashing_s + h.hashing_s, 6))
    models = {a.model for a in answers if a.model is not None}
    return RouteAnswer(
        chosen=chosen, semantics=req.semantics,
        model=req.model if req.model is not None else (next(iter(models)) if len(models) == 1 else None),
        num_tokens=checked.num_tokens, hash_configs=list(used.values()), nodes=shown, no_signal=no_signal,
        hashing_s=round(sum(a.hashing_s for a in answers), 6),  # every worker hashes for its own nodes
        search_s=max((a.search_s for a in answers), default=0.0))  # workers search in parallel


def record_sent(index: Index, inflight: InFlight, request_id: str, node_id: str, request: Checked | RouteRequest,
                now: float) -> str | None:
    """Record "request sent to node": its blocks, as the node hashes them, become speculative
    holdings there. Returns why nothing could be recorded (unknown node, no usable hash
    configuration), else None; the request then simply gets no speculative help."""
    checked = check_request(request) if isinstance(request, RouteRequest) else request
    node = index.nodes.get(node_id)
    if node is None or not node.group_specs:
        return f"node {node_id!r} is not in this index or has no group specs"
    specs = sorted(node.group_specs, key=lambda gs: gs.group_idx)
    if checked.token_ids is not None:
        if node.hash_config is None:
            return f"node {node_id!r} published no hash configuration"
        bad = layout_mismatch(node.hash_config, specs)
        hashes = PromptHasher(checked.token_ids, checked.keys).for_config(node.hash_config) if bad is None else bad
        if isinstance(hashes, str):
            return hashes
        lists: Lists = hashes.lists(specs)
    elif checked.unit_hashes is not None:
        cfg = node.hash_config
        if cfg is None or cfg.hash_block_size != checked.unit:
            return f"node {node_id!r} does not hash in units of {checked.unit} tokens"
        views = hash_views(checked.unit_hashes, checked.unit)
        lists = {gs.group_idx: views.at(gs.block_size) for gs in specs}  # type: ignore[misc]
    else:
        given = checked.hash_lists
        assert given is not None
        size = {gs.group_idx: gs.block_size for gs in specs}
        lists = {}
        for gs in specs:  # a group not named borrows a named group's list at its block size, as in a route
            named = gs.group_idx if gs.group_idx in given else next(
                (o for o in given if size.get(o) == gs.block_size), None)
            if named is not None:
                lists[gs.group_idx] = given[named]
    inflight.sent(request_id, node_id, lists, now)
    return None


_search: HitSearch | None = None


def set_default_search(engine: Engine | None) -> HitSearch:
    """The engine `route_local` uses when given none (the `route_search_engine` setting; None: native
    when built, else python). The native engine keeps its layouts, so one instance is shared."""
    global _search
    _search = HitSearch(engine)
    return _search


def _default_search() -> HitSearch:
    return _search if _search is not None else set_default_search(None)


# -- who is eligible, with which hash lists ---------------------------------------------------------


Cohorts = dict[tuple, tuple[Lists, list[tuple[NodeState, NodeModel]]]]


def token_cohorts(planned: Plan, hasher: PromptHasher, no_signal: list[NoSignal]) -> Cohorts:
    """The plan's cohorts with this prompt's hash lists: hashed once per configuration."""
    cohorts: Cohorts = {}
    for per in planned.by_config.values():
        cfg = per.config
        hashes = hasher.for_config(cfg)
        if isinstance(hashes, str):
            for cohort in per.cohorts.values():
                no_signal.extend(NoSignal(node.node_id, f"hash configuration {label(cfg)}: {hashes}", "config")
                                 for node, _ in cohort.members)
            continue
        for key, cohort in per.cohorts.items():
            hashes.nodes += len(cohort.members)
            lists = hashes.lists(cohort.specs)
            for g in cohort.fine:
                lists[g] = hashes.views.at(cfg.hash_block_size)  # type: ignore[assignment]
            cohorts[key] = (lists, cohort.members)
    return cohorts


def unit_cohorts(planned: Plan, checked: Checked, no_signal: list[NoSignal]) -> Cohorts:
    """The plan's cohorts with the request's hash-unit chain: each group's list is the chain's view at its block
    size, as with token ids (a group searched at the unit takes the chain itself), for nodes hashing in units of
    the chain's size; the others are no signal (cause "lists")."""
    units, unit = checked.unit_hashes, checked.unit
    assert units is not None and unit is not None
    views = hash_views(units, unit)
    cohorts: Cohorts = {}
    for per in planned.by_config.values():
        cfg = per.config
        if cfg.hash_block_size != unit:
            why = (f"unit_hashes are per {unit} tokens; this node hashes per {cfg.hash_block_size} "
                   f"({label(cfg)})")
            for cohort in per.cohorts.values():
                no_signal.extend(NoSignal(node.node_id, why, "lists") for node, _ in cohort.members)
            continue
        for key, cohort in per.cohorts.items():
            lists: Lists = {gs.group_idx: views.at(gs.block_size) for gs in cohort.specs}  # type: ignore[misc]
            for g in cohort.fine:
                lists[g] = views.at(unit)  # type: ignore[assignment]
            cohorts[key] = (lists, cohort.members)
    return cohorts


def _form(req: RouteRequest) -> str:
    """Which prompt form a request uses (the zero shapes differ: block lists cannot probe inside blocks)."""
    return "tokens" if req.token_ids is not None else "units" if req.unit_hashes is not None else "blocks"


def _hash_cohorts(planned: Plan, checked: Checked, no_signal: list[NoSignal]) -> Cohorts:
    """The plan's layout cohorts with this request's lists; the nodes of a layout the lists do not
    fit are no signal (cause "lists"; `finish` makes it a 400 when no node fits)."""
    given = checked.hash_lists
    assert given is not None
    cohorts: Cohorts = {}
    for key, (sizes, members) in planned.by_layout.items():
        why = check_group_lists(given, sizes, checked.num_tokens)
        if why is not None:
            no_signal.extend(NoSignal(node.node_id, why, "lists") for node, _ in members)
            continue
        lists = dict(given)
        for g, bs in sizes.items():  # a group not named borrows a named group's list at its block size
            if g not in lists:
                other = next((o for o in given if sizes[o] == bs), None)
                if other is not None:
                    lists[g] = given[other]
        # block-level lists: a group searched at the hash unit gets placeholders inside blocks
        cohorts[key] = (at_units(members[0][1], lists), members)
    return cohorts


# -- the choice ----------------------------------------------------------------------------------------


def _rank(row: NodeRoute) -> tuple:
    return (_TIER[row.state], -row.score, -row.gpu_tokens, -row.loadable_tokens, row.node_id)


def _choose(rows: list[NodeRoute], s: Scoring, request_id: str | None) -> str | None:
    """`rows` sorted by `_rank`: the first, or a seeded softmax sample from the best tier."""
    if not rows:
        return None
    if s.temperature <= 0:
        return rows[0].node_id
    tier = [r for r in rows if _TIER[r.state] == _TIER[rows[0].state]]
    top = tier[0].score
    weights = [math.exp((r.score - top) / s.temperature) for r in tier]  # shifted: no overflow
    seed = s.seed if s.seed is not None else (
        int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:8], "big") if request_id else 0)
    return random.Random(seed).choices(tier, weights)[0].node_id
