"""A cohort's rows from one native call (`kvpipe_native.IndexStore.route_cohort`, native/src/route.rs):
the nodes holding any requested block, with their hits on GPU and on any medium and per group the
blocks used and their media, straight from the store's inverted view and bitsets — the work
`rows.prepare` and `rows.node_row` do per node on held-position sets, without a Python set or a
per-node search job. Rows are then built only for those nodes; the rest of the cohort holds
nothing and takes the zero path in `decide`.

Taken when the cohort is the common case: the default semantics, the native store and engine, no
group searched at the hash unit, no node of the cohort with in-flight guesses, a cap of at least
0, and every node's layout modelled natively. Otherwise `decide` runs the per-node path; the
router's benchmark routes every request on both and checks the answers equal.
"""
from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvpipe.processors.index import GPU, Index, NodeState
from kvpipe.processors.route_hma import NodeModel
from kvpipe.processors.router.hits import HitSearch, kvpipe_native
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import PREFIX_PER_GROUP, Load, NodeRoute, RouteRequest, Scoring
from kvpipe.processors.router.rows import Zero, liveness, score

Member = tuple[NodeState, NodeModel]
# per touched member: (member index, gpu tokens, any tokens, [(gpu blocks, blocks used, media ids)])
Touched = dict[int, tuple[int, int, list[tuple[int, int, list[int]]]]]


def cohort_hits(index: Index, search: HitSearch, lists: dict[int, list], members: Sequence[Member],
                req: RouteRequest, num_tokens: int | None, inflight: InFlight | None) -> Touched | None:
    """The touched members' answers, or None when this cohort takes the per-node path."""
    store = index.store
    if (req.semantics == PREFIX_PER_GROUP or store.kind != "native" or search.native_engine is None
            or store.media_overflow or not members):  # type: ignore[union-attr]
        return None
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
    answers = store.core.route_cohort(engine, [(g, lists[g]) for g in groups], table, args,  # type: ignore[union-attr]
                                      store.media_rank())  # type: ignore[union-attr]
    return {m: (gpu, any_, per_group) for m, gpu, any_, per_group in answers}


# A cohort's native member table, by the identity of its member list (the router's plan keeps one
# list per cohort until the index's nodes change; the list is kept in the value, so an id is never
# reused while its entry lives).
_tables: dict[int, tuple[Sequence[Member], object, list[NodeModel]]] = {}
_TABLES_MAX = 4096


def _table(members: Sequence[Member]) -> tuple[object, list[NodeModel]]:
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
    table = kvpipe_native.MemberTable([n.key for n, _ in members], index_of)
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


def touched_row(z: Zero, node: NodeState, answer: tuple[int, int, list[tuple[int, int, list[int]]]], media: list[str],
                scoring: Scoring, load: Load, now: float, stale_after_s: float | None) -> NodeRoute:
    """`rows.node_row` of a node the native call answered (its exactness and state are the
    cohort's `Zero` shape: the same rules, run once per model)."""
    gpu_tokens, any_tokens, per_group = answer
    state, state_reason = liveness(node, z.state, z.state_reason, now, stale_after_s)
    groups = []
    for g, (gpu_blocks, blocks, ids) in zip(z.groups, per_group):
        names = [GPU if i == kvpipe_native.GPU_MEDIUM else "?" if i == kvpipe_native.UNKNOWN_MEDIUM else media[i]
                 for i in ids]
        groups.append(msgspec.structs.replace(g, gpu_blocks=gpu_blocks, blocks=blocks,
                                              medium="+".join(sorted(names, key=lambda m: (m != GPU, m))) or "none"))
    loadable = any_tokens - gpu_tokens
    return NodeRoute(node_id=node.node_id, epoch=node.epoch, model=node.model, dp_rank=node.dp_rank, state=state,
                     state_reason=state_reason, gpu_tokens=gpu_tokens, loadable_tokens=loadable, groups=groups,
                     exact=z.exact, reason=z.reason or None,
                     score=round(score(gpu_tokens, loadable, z.num_tokens, load, 0, scoring), 9), speculative=False,
                     load=Load(load.running, load.waiting, load.kv_usage))
