"""One node's row of a route answer (`kvpipe.processors.router.decide`): the sets its hit search runs on
(`prepare`), then, with the search's answers, its groups, media, speculation and score (`node_row`).
A node that holds none of the request's blocks and has nothing in flight gets its row from a shape
shared by every such node of one model (`zero_shape`, `zero_row`): the same rules, run once.
"""
from __future__ import annotations

from collections.abc import Sequence, Set
from typing import NamedTuple

import msgspec

from kvpipe.processors.core.index import GPU, NodeState
from kvpipe.processors.router.hma import Held, NodeModel, block_positions, whole_blocks
from kvpipe.processors.router.hits import Hit
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import (PREFIX_PER_GROUP, GroupHit, Load, NodeRoute, NodeStateName, RouteRequest,
                                            Scoring)
from kvpipe.schemas.events import ExternalHash

Lists = dict[int, list[ExternalHash]]
NO_LOAD = Load()
_EMPTY: frozenset[int] = frozenset()  # shared, never changed


def score(gpu_tokens: int, loadable_tokens: int, num_tokens: int | None, load: Load, in_flight: int,
          s: Scoring) -> float:
    """The formula of `kvpipe.processors.router.decide`'s docstring."""
    cap = max((num_tokens or 0) - 1, 1)
    benefit = s.overlap_weight * (gpu_tokens + s.cpu_weight * loadable_tokens) / cap
    return benefit - penalty(load, in_flight, s)


def penalty(load: Load, in_flight: int, s: Scoring) -> float:
    """`score`'s load term (callers scoring many rows compute it once per load)."""
    return (s.running_weight * load.running + s.waiting_weight * (load.waiting + in_flight)
            + s.kv_usage_weight * load.kv_usage)


class Pending:
    """A node's row before the hit search: what `prepare` works out, then the search's job ids."""

    __slots__ = ("node", "model", "lists", "held", "groups", "specs", "lens", "cap", "num_tokens", "exact",
                 "reason", "state", "state_reason", "spec", "real_any", "gpu_sets", "any_sets", "searched",
                 "jobs")

    def __init__(self, node: NodeState, model: NodeModel, lists: Lists, held: Held, groups: tuple[int, ...],
                 specs: list, cap: int, num_tokens: int | None, exact: bool, reason: str | None,
                 state: NodeStateName, state_reason: str | None, spec: dict, real_any: Sequence[Set[int]],
                 gpu_sets: Sequence[Set[int]], any_sets: Sequence[Set[int]]) -> None:
        self.node, self.model, self.lists, self.held, self.groups, self.specs = node, model, lists, held, groups, specs
        self.lens = tuple(len(lists[g]) for g in groups)
        self.cap, self.num_tokens, self.exact, self.reason = cap, num_tokens, exact, reason
        self.state, self.state_reason, self.spec, self.real_any = state, state_reason, spec, real_any
        self.gpu_sets, self.any_sets = gpu_sets, any_sets
        self.searched = bool(specs) and any(any_sets)
        self.jobs = (0, 0)


class Zero(NamedTuple):
    """What the rows of a cohort's nodes with one model and nothing held share."""

    groups: list[GroupHit]
    exact: bool
    reason: str | None
    state: NodeStateName  # "live" or "partial", before suspect / stale
    state_reason: str | None
    num_tokens: int | None


def zero_shape(node: NodeState, model: NodeModel, lists: Lists, num_tokens: int | None,
                req: RouteRequest) -> Zero:
    """`prepare` and `node_row` for a node with nothing held and nothing in flight (their rules,
    kept in one place: the row comes out equal; tests/unit/router holds both paths)."""
    p = prepare(node, model, lists, {}, num_tokens, req, None, 0.0, None, live=False)
    row = node_row(p, [], req, Scoring(), NO_LOAD, None)
    assert not isinstance(row, str) and not p.searched
    return Zero(row.groups, p.exact, p.reason, p.state, p.state_reason, num_tokens)


def zero_row(z: Zero, node: NodeState, scoring: Scoring, load: Load, now: float,
              stale_after_s: float | None) -> NodeRoute:
    state, state_reason = liveness(node, z.state, z.state_reason, now, stale_after_s)
    return NodeRoute(node_id=node.node_id, epoch=node.epoch, model=node.model, dp_rank=node.dp_rank, state=state,
                     state_reason=state_reason, gpu_tokens=0, loadable_tokens=0,
                     groups=[msgspec.structs.replace(g) for g in z.groups], exact=z.exact, reason=z.reason or None,
                     score=round(score(0, 0, z.num_tokens, load, 0, scoring), 9), speculative=False, load=load)


def zero_rank(z: Zero, node: NodeState, scoring: Scoring, load: Load, now: float,
              stale_after_s: float | None) -> tuple:
    """`zero_row`'s rank (`decide._rank` of the row) without building the row."""
    state, _ = liveness(node, z.state, z.state_reason, now, stale_after_s)
    return (TIER[state], -round(score(0, 0, z.num_tokens, load, 0, scoring), 9), 0, 0, node.node_id)


TIER = {"live": 0, "partial": 0, "stale": 1, "suspect": 2}  # rows rank by state first (`decide._rank`)


def liveness(node: NodeState, state: NodeStateName, state_reason: str | None, now: float,
              stale_after_s: float | None) -> tuple[NodeStateName, str | None]:
    """A suspect node, else a silent one, overrides the state ("live" or "partial") and its reason."""
    if node.suspect:
        return "suspect", node.reason
    if stale_after_s is not None and now - node.last_seen > stale_after_s:
        return "stale", f"silent for {now - node.last_seen:.1f} s (bound {stale_after_s} s)"
    return state, state_reason


def prepare(node: NodeState, model: NodeModel, lists: Lists, held: Held, num_tokens: int | None,
             req: RouteRequest, inflight: InFlight | None, now: float, stale_after_s: float | None,
             live: bool = True) -> Pending:
    groups = [g for g in model.groups if g in lists]
    specs = [s for g, s in zip(model.groups, model.specs) if g in lists]
    exact, reason = True, None
    state: NodeStateName = "live"
    state_reason: str | None = None
    if len(groups) < len(model.groups):
        left_out = [g for g in model.groups if g not in lists]
        state, exact = "partial", False
        state_reason = reason = (f"groups {left_out} not in the request and no requested group has their block "
                                 f"size: hit over groups {groups} only (an upper bound)")
    if (model.partial_hits and req.token_ids is None and req.unit_hashes is None
            and any(model.searched_at_unit(g) for g in groups)):
        exact = False
        reason = "; ".join(filter(None, [reason, "block-level hash lists: partial entries inside blocks not probed "
                                                 "(send token_ids for the exact fine-grained hit)"]))
    if num_tokens is not None:
        cap = num_tokens - 1
    else:
        cap = max(len(lists[g]) * model.list_unit(g) for g in groups)
        exact = False
        reason = "; ".join(filter(None, [reason, "num_tokens not given: the hit is not capped at num_tokens - 1 "
                                                 "and may count the last token"]))
    if live:
        state, state_reason = liveness(node, state, state_reason, now, stale_after_s)

    spec = inflight.positions(node.node_id, {g: lists[g] for g in groups}) if inflight is not None else {}
    if not held and not spec:  # most nodes of a large fleet hold none of a request's blocks
        empty = [_EMPTY] * len(groups)
        return Pending(node, model, lists, held, tuple(groups), specs, cap, num_tokens, exact, reason, state,
                        state_reason, spec, empty, empty, empty)
    real_gpu = [held.get((g, GPU), _EMPTY) for g in groups]
    real_any = [_union([p for (hg, _), p in held.items() if hg == g]) for g in groups]
    gpu_sets = [r | spec[g] if g in spec else r for g, r in zip(groups, real_gpu)]
    any_sets = [r | spec[g] if g in spec else r for g, r in zip(groups, real_any)]
    return Pending(node, model, lists, held, tuple(groups), specs, cap, num_tokens, exact, reason, state,
                    state_reason, spec, real_any, gpu_sets, any_sets)


def node_row(p: Pending, hits: Sequence[Hit | str], req: RouteRequest, scoring: Scoring, load: Load,
              inflight: InFlight | None) -> NodeRoute | str:
    node, model, held, groups, specs = p.node, p.model, p.held, p.groups, p.specs
    spec, real_any, gpu_sets, any_sets = p.spec, p.real_any, p.gpu_sets, p.any_sets
    exact, reason, state, state_reason, num_tokens = p.exact, p.reason, p.state, p.state_reason, p.num_tokens
    kinds = {gs.group_idx: gs.kind for gs in node.group_specs or ()}
    spans_gpu: Sequence[tuple[int, int]] = [(0, 0)] * len(groups)
    spans_any = spans_gpu
    gpu_tokens = any_tokens = 0
    if p.searched:
        hg, ha = hits[p.jobs[0]], hits[p.jobs[1]]
        if isinstance(hg, str) or isinstance(ha, str):  # a layout vLLM itself rejects
            return f"no hit rule for this node's groups: {hg if isinstance(hg, str) else ha}"
        gpu_tokens, spans_gpu = hg.length, hg.spans
        any_tokens, spans_any = ha.length, ha.spans

    group_rows = []
    used_spec = False
    if not held and not spec:  # nothing held, nothing guessed: the zero row, without the per-block work
        per_group = {"any": 0} if req.semantics == PREFIX_PER_GROUP else None
        group_rows = [GroupHit(group_idx=g, kind=kinds.get(g, s.kind), block_size=s.block_size, gpu_blocks=0,
                               blocks=0, medium="none", speculative_blocks=0,
                               prefix_blocks=dict(per_group) if per_group is not None else None)
                      for g, s in zip(groups, specs)]
        specs = []  # the loop below has nothing left to do
    for k, (g, s) in enumerate(zip(groups, specs)):
        used = range(*spans_any[k]) if any_tokens else range(0)
        media: list[str] = []
        if used:
            # positions are hash units for a group searched at the unit: compare block slots
            off_gpu = sorted((hm, block_positions(model, g, p)) for (hg, hm), p in held.items()
                             if hg == g and hm != GPU)
            gpu_slots = block_positions(model, g, gpu_sets[k])
            # each used block's medium: GPU if there, else the first other medium holding it, else "?"
            left = set(used)
            left.difference_update(gpu_slots)
            if len(left) < len(used):
                media.append(GPU)
            for hm, positions in off_gpu:
                if not left:
                    break
                found = left.intersection(positions)
                if found:
                    media.append(hm)
                    left -= found
            if left:
                media.append("?")
        n_spec = sum(1 for i in used if i not in block_positions(model, g, real_any[k])) if g in spec else 0
        used_spec = used_spec or n_spec > 0
        prefix = None
        if req.semantics == PREFIX_PER_GROUP:
            prefix = {m: _prefix_len(whole_blocks(model, g, p)) for (hg, m), p in sorted(held.items()) if hg == g}
            prefix["any"] = _prefix_len(whole_blocks(model, g, any_sets[k]))
        group_rows.append(GroupHit(group_idx=g, kind=kinds.get(g, s.kind), block_size=s.block_size,
                                   gpu_blocks=spans_gpu[k][1] - spans_gpu[k][0] if gpu_tokens else 0, blocks=len(used),
                                   medium="+".join(sorted(media, key=lambda m: (m != GPU, m))) or "none",
                                   speculative_blocks=n_spec, prefix_blocks=prefix))
    in_flight = inflight.running(node.node_id) if inflight is not None else 0
    loadable = any_tokens - gpu_tokens
    effective = Load(load.running, load.waiting + in_flight, load.kv_usage)
    return NodeRoute(node_id=node.node_id, epoch=node.epoch, model=node.model, dp_rank=node.dp_rank, state=state,
                     state_reason=state_reason, gpu_tokens=gpu_tokens, loadable_tokens=loadable, groups=group_rows,
                     exact=exact, reason=reason or None,
                     score=round(score(gpu_tokens, loadable, num_tokens, load, in_flight, scoring), 9),
                     speculative=used_spec, load=effective)


def _union(sets: list[set[int]]) -> set[int]:
    if len(sets) == 1:
        return sets[0]
    return set().union(*sets)


def _prefix_len(positions: set[int]) -> int:
    n = 0
    while n in positions:
        n += 1
    return n
