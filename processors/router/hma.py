"""How the index feeds vLLM's hybrid hit (`kvpipe.gpu.hit`, the function the GPU side's coordinator runs)
for the router (`kvpipe.processors.router.decide`).

Per-group longest prefixes are wrong for hybrid models: with vLLM's default retention a
sliding-window or Mamba group caches only tail blocks, so its *prefix* is ~0 while the node would
serve a long hit. So each requested hash is looked up once per group in the inverted view
(the index's block store, `kvpipe.processors.core.slots`), giving per node and `(group, medium)` the *positions* of the request's blocks it
holds (`held_positions`); the hit search then runs on positions (`longest_hybrid_hit_in_views` takes
any hashable values) on the node's own group specs (`node_model`), so a node costs set lookups,
never another pass over the index.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set, Sized

import msgspec

from kvpipe.gpu.hit import HybridHit, longest_hybrid_hit_in_views
from kvpipe.gpu.layout import NodeLayout, node_layout
from kvpipe.processors.core.index import Index, NodeState
from kvpipe.schemas.events import ExternalHash

# Per node: (group, medium) → positions of the request's blocks (in that group's list) it holds.
Held = dict[tuple[int, str], set[int]]


# A node's groups as `kvpipe.gpu.hit` sees them: specs, hash unit, where hits land, EAGLE groups.
NodeModel = NodeLayout


# node_model's answers by the identity of the node's published specs and hash configuration: the
# index replaces (never edits) them when an envelope brings new ones, so identity means equal, and
# the layout rules run once per publication instead of once per node per query. The objects are
# kept in the value, so an id is never reused while its entry lives.
_models: dict[tuple[int, int], tuple[object, object, NodeModel | str]] = {}
_MODELS_MAX = 65_536
# ...and by their value, so nodes publishing equal specs (each decoded into its own objects) share
# one model: a route runs its per-model work (native layout, caps) once per distinct model, not
# once per node
_by_value: dict[bytes, NodeModel | str] = {}
_encode = msgspec.msgpack.Encoder().encode


def node_model(node: NodeState) -> NodeModel | str:
    """The node's model, or why there is none (the reason goes into its row): no specs, a kind
    without a hit rule, or a layout vLLM itself refuses (`kvpipe.gpu.layout`)."""
    specs, cfg = node.group_specs, node.hash_config
    key = (id(specs), id(cfg))
    hit = _models.get(key)
    if hit is not None and hit[0] is specs and hit[1] is cfg:
        return hit[2]
    value = _encode((specs, cfg))
    model = _by_value.get(value)
    if model is None:
        try:
            model = node_layout(specs or (), cfg)
        except ValueError as exc:
            model = f"{exc}: per-group prefix semantics"
        if len(_by_value) >= _MODELS_MAX:
            _by_value.clear()
        _by_value[value] = model
    if len(_models) >= _MODELS_MAX:
        _models.clear()
    _models[key] = (specs, cfg, model)
    return model


def at_units(model: NodeModel, lists: dict[int, list[ExternalHash]]) -> dict[int, list]:
    """The lists the hit search runs on: a group searched at the hash unit (partial hits on) needs
    one entry per unit, but a block-level list only knows block ends — the interior units get a
    placeholder that no node holds, so partial entries are not probed (a lower bound, noted)."""
    out: dict[int, list] = {}
    for g, hashes in lists.items():
        spec = model.spec_of(g)
        if spec is not None and model.searched_at_unit(g):
            k = spec.block_size // model.hash_block_size
            out[g] = [h if j % k == k - 1 else None for j, h in
                      ((j, hashes[j // k]) for j in range(len(hashes) * k))]
        else:
            out[g] = hashes
    return out


def block_positions(model: NodeModel, group: int, positions: Iterable[int]) -> set[int]:
    """Block slots of `group` that list positions fall in (identity unless searched at the unit)."""
    spec = model.spec_of(group)
    if spec is None or not model.searched_at_unit(group):
        return set(positions)
    k = spec.block_size // model.hash_block_size
    return {p // k for p in positions}


def whole_blocks(model: NodeModel, group: int, positions: Iterable[int]) -> set[int]:
    """Block slots of `group` whose whole block is held (its last unit's entry): partial entries
    inside a block do not count (identity unless searched at the unit)."""
    spec = model.spec_of(group)
    if spec is None or not model.searched_at_unit(group):
        return set(positions)
    k = spec.block_size // model.hash_block_size
    return {p // k for p in positions if p % k == k - 1}


def hybrid_hit(model: NodeModel, groups: Sequence[int], lists: Mapping[int, Sized], sets: Sequence[Set[int]],
               cap: int) -> HybridHit:
    """`kvpipe.gpu.hit`'s hybrid hit for a node on positions: `lists[g]` at the unit `model.list_unit(g)`,
    `sets[k]` the positions of `groups[k]` the node holds. The one rule, with EAGLE and partial hits."""
    specs = [model.spec_of(g) for g in groups]
    missing = [g for g, s in zip(groups, specs) if s is None]
    if missing:
        raise ValueError(f"groups {missing} are not the node's (its groups: {list(model.groups)})")
    positions = [range(len(lists[g])) for g in groups]
    return longest_hybrid_hit_in_views([s for s in specs if s is not None], positions, sets, cap, model.alignment,
                                       eagle_groups=model.eagle_positions(groups))


def held_positions(index: Index, hashes_by_group: dict[int, list[ExternalHash]]) -> dict[NodeState, Held]:
    """Which requested blocks each live node holds, per group and medium: one inverted-view lookup
    per (group, hash), all nodes at once. Unlike a prefix scan this cannot stop at the first
    miss — sparse groups hold tail blocks only."""
    by_slot = index.store.held(hashes_by_group)
    out: dict[NodeState, Held] = {}
    for slot, positions in by_slot.items():
        if not slot.node.expired:
            out.setdefault(slot.node, {})[(slot.group, slot.medium)] = positions
    return out
