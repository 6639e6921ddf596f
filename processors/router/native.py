"""The native route path's Python half: what `kvpipe_native.NativeRouter` (native/src/decide.rs) needs to answer
`POST /route` without Python, exported from the index.

The native side answers the common request — token ids, the hash-unit chain (`unit_hashes`) or per-group
`block_hashes` with `num_tokens`, at most `top_k` — exactly as `decide.route` does on its native cohort path; this module hands it everything that is not per request, worked out by the same code the
Python path runs (`plan.plan`, `hashing`, `hits.HitSearch.native_layout`, the answer's own Structs encoded by
msgspec), so the rules stay in one place:

- the plan, re-exported when the index's generation moves (`Index.on_move` tells the native side at once, so it
  hands requests to Python until the new plan is in): per hash configuration its none-hash and the head of its
  `hash_configs` entry; per cohort its groups, member table and per spec model the native layout and the heads
  of its `GroupHit` rows; per node the head of its row; the `no_signal` list; the answer's `model`;
- the nodes' live state (suspect and why, last seen, load), pushed by `refresh` — the routing app calls it after
  ingest, at most every few milliseconds, so a load or a suspect mark reaches native answers that much later;
- whether the native path is open at all: not while in-flight accounting holds a guess (the per-node path
  speculates then), not while this worker does not hold every partition (several workers scatter), not when a
  cohort needs what only Python does (a configuration other than the default sha256 chain, groups searched at
  the hash unit, a layout the native engine does not model).
"""
from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvpipe.processors.core import native
from kvpipe.processors.core.index import Index, NodeState
from kvpipe.processors.core.slots import NativeStore
from kvpipe.processors.router.hma import NodeModel
from kvpipe.processors.router.hashing import _hasher, config_key
from kvpipe.processors.router.hits import HitSearch
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import GroupHit, HashConfigUsed, NodeRoute
from kvpipe.processors.router.plan import Plan, plan

_encode = msgspec.json.encode


def _head(struct: msgspec.Struct, cut: str) -> str:
    """`struct`'s JSON up to (not including) field `cut`: the part of a record the native side copies."""
    text = _encode(struct).decode()
    return text[:text.index(f'"{cut}":')]


class NativeRoute:
    """Keeps a `kvpipe_native.NativeRouter` in step with `index` (see the module doc)."""

    def __init__(self, index: Index, search: HitSearch, stale_after_s: float | None,
                 serves_all: Callable[[], bool] = lambda: True, memo_entries: int = native.MEMO_ENTRIES) -> None:
        store = index.store
        if not isinstance(store, NativeStore):
            native.require("the native route path")  # says why the Python engine runs, if it does
            raise RuntimeError("the native route path needs the native index store (index_store=native)")
        self.index, self.store, self.search, self.stale_after_s = index, store, search, stale_after_s
        self.serves_all = serves_all
        self.router = store.router(memo_entries)
        self.exported: int | None = None  # the generation of the plan the native side holds
        self.servable = False  # that plan's cohorts all take the native path
        self.why_not = "no plan exported yet"
        self._nodes: list[NodeState] = []
        self._media = 0
        self._seen: int | None = None
        self.last_refresh = 0.0
        index.on_move = self.router.set_generation
        self.router.set_generation(index.generation)

    # -- what the routing app calls ------------------------------------------------------------------

    def refresh(self, inflight: InFlight | None, now: float | None = None, seen: int | None = None) -> None:
        """Export the plan if the index moved, push the nodes' live state, open or close the native path.
        `seen`: a count that moves whenever a message is handled (the ingest's); while it holds still no node's
        state can have changed, and the push is skipped."""
        self.last_refresh = time.monotonic()
        index, store = self.index, self.store
        if self.exported != index.generation or self._media != len(store.media):
            self._export()
        elif seen is None or seen != self._seen:
            self.router.set_live([_live(n) for n in self._nodes])
        self._seen = seen
        if inflight is not None and inflight.tracking():
            inflight.sweep(time.time() if now is None else now)
        reason = (self.why_not if not self.servable else
                  "in-flight accounting holds guesses" if inflight is not None and inflight.tracking() else
                  "this worker does not hold every partition" if not self.serves_all() else "")
        self.open_reason = reason
        self.router.set_open(not reason)

    def answer(self, body: bytes) -> bytes | None:
        """The native answer to a `/route` body, or None where Python answers (in process)."""
        return self.router.route(body)

    # -- the plan ----------------------------------------------------------------------------------------

    def _export(self) -> None:
        index, store, search = self.index, self.store, self.search
        planned = plan(index, None)
        self.exported, self._media = planned.generation, len(store.media)
        got = _plan_args(planned, search) if store.masks_media() else "more media than the answer's mask has bits"
        if isinstance(got, str):
            self.servable, self.why_not = False, got
            self._nodes = []
            return
        configs, cohorts, nodes = got
        self._nodes = nodes
        no_signal = sorted([*planned.no_signal, *planned.config_problems], key=lambda n: n.node_id)
        models = planned.models
        model = next(iter(models)) if len(models) == 1 else None
        stale = (float(self.stale_after_s), f"{self.stale_after_s}") if self.stale_after_s is not None else None
        engine = search.native_engine
        # Block-hash routes search every eligible node by its layout, whatever its hash configuration
        # (`plan.Plan.by_layout`), and their `no_signal` leaves configuration problems out: the native
        # cohorts (by configuration) hold the same nodes and the same list only where there are none.
        self.router.set_plan(planned.generation, engine, configs, cohorts,
                             [(n.node_id, _head(_row(n), "state")) for n in nodes],
                             _encode(no_signal).decode(), _encode(model).decode(),
                             list(store.media_rank()), list(store.media), stale,
                             [_live(n) for n in nodes], block_routes=not planned.config_problems,
                             no_signal_entries=[(n.node_id, _encode(n).decode()) for n in no_signal])
        self.servable, self.why_not = True, ""


def _plan_args(planned: Plan, search: HitSearch) -> tuple[list, list, list[NodeState]] | str:
    """`NativeRouter.set_plan`'s configurations, cohorts and nodes, or why the plan cannot be served natively."""
    if search.native_engine is None:
        return "the native hit engine is not in use"
    if not planned.by_config:
        return "no node with a usable hash configuration"
    configs: list = []
    cohorts: list = []
    nodes: list[NodeState] = []
    node_at: dict[str, int] = {}
    for per in planned.by_config.values():
        cfg = per.config
        if cfg.algorithm != "sha256":
            return f"hash algorithm {cfg.algorithm!r} is hashed in Python"
        try:
            hasher = _hasher(cfg)
        except ValueError as exc:
            return f"hash configuration {config_key(cfg)}: {exc}"
        members = sum(len(c.members) for c in per.cohorts.values())
        label = f"{cfg.algorithm}/{cfg.hash_block_size}/{cfg.none_hash_seed_rule}/{'int' if cfg.int_hashes else 'bytes'}"
        head = _head(HashConfigUsed(label=label, config=cfg, nodes=members, hash_blocks=0, hashing_s=0.0),
                     "hash_blocks")
        ci = len(configs)
        configs.append((bytes(hasher.none_hash), cfg.hash_block_size, head))
        for cohort in per.cohorts.values():
            if cohort.fine:
                return "a cohort searches groups at the hash unit"
            spec_of = {gs.group_idx: gs for gs in cohort.specs}
            first_model = cohort.members[0][1]
            groups = tuple(g for g in first_model.groups if g in spec_of)
            models: list[NodeModel] = []
            model_at: dict[int, int] = {}
            model_args: list = []
            owners, index_of, node_of = [], [], []
            for node, model in cohort.members:
                mi = model_at.get(id(model))
                if mi is None:
                    if tuple(g for g in model.groups if g in spec_of) != groups or any(
                            model.searched_at_unit(g) for g in groups):
                        return f"node {node.node_id}: groups the native cohort path does not search"
                    layout = search.native_layout(model, groups)
                    if layout is None:
                        return f"node {node.node_id}: a layout the native engine does not model"
                    kinds = {gs.group_idx: gs.kind for gs in node.group_specs or ()}
                    heads = [_head(GroupHit(group_idx=g, kind=kinds.get(g, spec_of[g].kind),
                                            block_size=spec_of[g].block_size, gpu_blocks=0, blocks=0, medium="none"),
                                   "gpu_blocks") for g in groups]
                    mi = model_at[id(model)] = len(models)
                    models.append(model)
                    model_args.append((layout.id, list(layout.units), heads))
                owners.append(node.key)
                index_of.append(mi)
                at = node_at.get(node.node_id)
                if at is None:
                    at = node_at[node.node_id] = len(nodes)
                    nodes.append(node)
                node_of.append(at)
            cohorts.append((ci, [(g, spec_of[g].block_size) for g in groups], owners, index_of, node_of, model_args))
    return configs, cohorts, nodes


def _row(node: NodeState) -> NodeRoute:
    return NodeRoute(node_id=node.node_id, epoch=node.epoch, model=node.model, dp_rank=node.dp_rank,
                     gpu_tokens=0, loadable_tokens=0)


def _live(node: NodeState) -> tuple:
    load = node.load
    running, waiting, kv = (load[0] or 0, load[1] or 0, load[2] or 0.0) if load is not None else (0, 0, 0.0)
    return (_encode(node.reason).decode() if node.suspect else None, float(node.last_seen), int(running),
            int(waiting), float(kv))
