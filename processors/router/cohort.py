"""A cohort's rows from one native call (`kvpipe_native.IndexStore.route_cohort`, native/src/route.rs):
the nodes holding any requested block, with their hits on GPU and on any medium and per group the
blocks used and their media, straight from the store's inverted view and bitsets — the work
`rows.prepare` and `rows.node_row` do per node on held-position sets, without a Python set or a
per-node search job. Rows are then built only for those nodes; the rest of the cohort holds
nothing and takes the zero path in `decide`.

Taken when the cohort is the common case: the native store and engine (either semantics), no
group searched at the hash unit, no node of the cohort with in-flight guesses, a cap of at least
0, and every node's layout modelled natively. Otherwise `decide` runs the per-node path; the
router's benchmark routes every request on both and checks the answers equal.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec

from kvpipe.processors.core import native
from kvpipe.processors.core.index import GPU, Index, NodeState
from kvpipe.processors.core.slots import NativeStore
from kvpipe.processors.router.hma import NodeModel
from kvpipe.processors.router.hits import HitSearch
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import PREFIX_PER_GROUP, Load, NodeRoute, RouteRequest, Scoring
from kvpipe.processors.router.rows import TIER, Zero, liveness, penalty

Member = tuple[NodeState, NodeModel]
# per touched member, in member order: (member index, gpu tokens, any tokens,
# [(gpu blocks, blocks used, media mask, prefixes)] per group)
Touched = list[native.CohortRow]


def cohort_hits(index: Index, search: HitSearch, lists: dict[int, list], members: Sequence[Member],
                req: RouteRequest, num_tokens: int | None, inflight: InFlight | None) -> Touched | None:
    """The touched members' answers, or None when this cohort takes the per-node path."""
    store = index.store
    if not isinstance(store, NativeStore) or search.native_engine is None or not store.masks_media() or not members:
        return None  # (media past the answer's mask bits: read the reference way)
    groups = tuple(g for g in members[0][1].groups if g in lists)
    if not groups:
        return None
    if inflight is not None and inflight.tracking() and any(inflight.tracks(n.node_id) for n, _ in members):
        return None
    table, models = _table(members)
    engine = search.native_engine
    args = []
    for model in models:  # a cohort's nodes run few distinct spec models: per model, not per node
        got = _native_args(search, model, groups, lists, num_tokens)
        if got is None:
            return None
        args.append(got)
    if search.native_engine is not engine:  # the engine started afresh while registering: ids moved
        return None
    return store.route_cohort(engine, [(g, lists[g]) for g in groups], table, args, req.semantics == PREFIX_PER_GROUP)


# A cohort's native member table, by the identity of its member list (the router's plan keeps one
# list per cohort until the index's nodes change; the list is kept in the value, so an id is never
# reused while its entry lives).
_tables: dict[int, tuple[Sequence[Member], native.MemberTable, list[NodeModel]]] = {}
_TABLES_MAX = 4096


def _table(members: Sequence[Member]) -> tuple[native.MemberTable, list[NodeModel]]:
    got = _tables.get(id(members))
    if got is not None and got[0] is members:
        return got[1], got[2]
    models: list[NodeModel] = []
    at: dict[int, int] = {}
    index_of = []
    for _, model in members:
        i = at.get(id(model))
        if i is None:
            i = at[id(model)] = len(models)
            models.append(model)
        index_of.append(i)
    table = native.member_table([n.key for n, _ in members], index_of)
    if len(_tables) >= _TABLES_MAX:
        _tables.clear()
    _tables[id(members)] = (members, table, models)
    return table, models


def _native_args(search: HitSearch, model: NodeModel, groups: tuple[int, ...], lists: dict[int, list],
                 num_tokens: int | None) -> tuple[int, int, int] | None:
    if tuple(g for g in model.groups if g in lists) != groups or any(model.searched_at_unit(g) for g in groups):
        return None
    layout = search.native_layout(model, groups)
    if layout is None:
        return None
    cap = num_tokens - 1 if num_tokens is not None else max(len(lists[g]) * model.list_unit(g) for g in groups)
    if cap < 0:
        return None
    hashed = max(len(lists[g]) * u for g, u in zip(groups, layout.units))
    return layout.id, cap, hashed


# A touched node's row before it is built: its rank (`decide._rank` of the row), then what the
# row needs. Ranking first lets a route that shows few rows build only those (`decide.route_local`).
Light = tuple  # (rank, node, zero shape, state, state reason, gpu tokens, loadable, per group, load, score)


def touched_light(out: list[Light], zero: dict[int, Zero], shape: Callable[[NodeState, NodeModel], Zero],
                  members: Sequence[Member], touched: Touched, scoring: Scoring, loads: Mapping[str, Load],
                  no_load: Load, now: float, stale_after_s: float | None) -> None:
    """`rows.node_row`'s values for each node the native call answered, ranked, appended to `out`
    (exactness and state are the cohort's `Zero` shape per model: the same rules, run once per
    model). `build_row` makes the row."""
    # `rows.score` term by term in its order (the same floats), with the load term once per
    # distinct load and the cap once per model
    ow, cw = scoring.overlap_weight, scoring.cpu_weight
    no_penalty = penalty(no_load, 0, scoring)
    penalties: dict[int, float] = {}
    shapes: dict[int, tuple[Zero, int]] = {}
    append, get_load = out.append, loads.get
    for m, gpu_tokens, any_tokens, per_group in touched:
        node, model = members[m]
        got = shapes.get(id(model))
        if got is None:
            z = zero.get(id(model))
            if z is None:
                z = zero[id(model)] = shape(node, model)
            got = shapes[id(model)] = (z, max((z.num_tokens or 0) - 1, 1))
        z, cap = got
        state, state_reason = liveness(node, z.state, z.state_reason, now, stale_after_s)
        load = get_load(node.node_id, no_load)
        if load is no_load:
            pen = no_penalty
        else:
            got_pen = penalties.get(id(load))
            if got_pen is None:
                got_pen = penalties[id(load)] = penalty(load, 0, scoring)
            pen = got_pen
        loadable = any_tokens - gpu_tokens
        sc = round(ow * (gpu_tokens + cw * loadable) / cap - pen, 9)
        append(((TIER[state], -sc, -gpu_tokens, -loadable, node.node_id), node, z, state, state_reason,
                gpu_tokens, loadable, per_group, load, sc))


def build_row(light: Light, names: Callable[[int], str], media: Sequence[str]) -> NodeRoute:
    """The row of a `touched_light` entry; `names`: a media mask as the router's medium string
    (`slots.NativeStore.media_names`); `media`: the store's media by id (for prefixes)."""
    _, node, z, state, state_reason, gpu_tokens, loadable, per_group, load, sc = light
    replace = msgspec.structs.replace
    groups = []
    for g, (gpu_blocks, blocks, mask, prefix) in zip(z.groups, per_group):
        if prefix is None:
            groups.append(replace(g, gpu_blocks=gpu_blocks, blocks=blocks, medium=names(mask)))
        else:
            groups.append(replace(g, gpu_blocks=gpu_blocks, blocks=blocks, medium=names(mask),
                                  prefix_blocks=_prefixes(prefix, media)))
    return NodeRoute(node_id=node.node_id, epoch=node.epoch, model=node.model, dp_rank=node.dp_rank, state=state,
                     state_reason=state_reason, gpu_tokens=gpu_tokens, loadable_tokens=loadable, groups=groups,
                     exact=z.exact, reason=z.reason or None, score=sc, speculative=False, load=load)


def _prefixes(prefix: tuple[list[tuple[int, int]], int], media: Sequence[str]) -> dict[str, int]:
    """The native call's longest held prefixes as `rows.node_row` writes them: per medium held,
    by name, then "any"."""
    per, any_ = prefix
    out = dict(sorted((GPU if i < 0 else media[i], n) for i, n in per))
    out["any"] = any_
    return out
