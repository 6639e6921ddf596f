"""What a route works out per node before it looks at the request's blocks — which nodes are
eligible, with which spec model, and which of them share one hash configuration and group layout
(one set of hash lists, one pass over the index) — kept per index and reused until the index's
`generation` moves (a node came, went, expired, came back, or changed epoch, specs, hash
configuration or model: `processors/core/index.py`). Without it a route paid this per node, every time.

Nodes that are not eligible keep their reasons here too (`NoSignal`, by the same rules as before:
`kvpipe.processors.router.decide`). Only the request's own hashing stays per request: a configuration
whose hashes cannot be computed for this prompt turns its nodes into no-signal rows then.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from kvpipe.processors.core.index import Index, NodeState
from kvpipe.processors.router.hma import NodeModel, node_model
from kvpipe.processors.router.hashing import config_key, layout_mismatch
from kvpipe.processors.router.model import NoSignal
from kvpipe.schemas.envelope import GroupSpec, HashConfig

if TYPE_CHECKING:
    from kvpipe.processors.router.rows import Zero

Member = tuple[NodeState, NodeModel]


class Cohort(NamedTuple):
    """Nodes of one (hash configuration, group layout, groups searched at the hash unit)."""

    specs: list[GroupSpec]
    fine: tuple[int, ...]
    members: list[Member]


class ConfigNodes(NamedTuple):
    config: HashConfig
    cohorts: dict[tuple, Cohort]  # by cohort key, in node id order of first member


class Plan(NamedTuple):
    generation: int
    model: str | None
    no_signal: list[NoSignal]  # ineligible nodes (expired, another model, no spec model)
    eligible: list[Member]  # in node id order
    by_config: dict[tuple, ConfigNodes]  # token-id routes: eligible nodes with a usable configuration
    config_problems: list[NoSignal]  # token-id routes: eligible nodes whose hashes cannot be computed
    models: set[str | None]  # the eligible nodes' models (a node's model change moves the generation)
    # block-hash routes: eligible nodes by group layout (block size per group, groups searched at
    # the hash unit), in node id order of first member; the member lists are kept, so a cohort's
    # native member table is built once per plan, not per request
    by_layout: dict[tuple, tuple[dict[int, int], list[Member]]]
    # `rows.zero_shape` by what it reads (the model, its requested groups' list lengths, the token
    # count, the request's form and semantics), kept while the plan holds: models live as long
    # as the plan, so their ids are not reused meanwhile (`decide._shape`)
    zeros: dict[tuple, Zero]


def plan(index: Index, model: str | None) -> Plan:
    """The index's plan for requests of `model`, reused while the index's generation holds."""
    cached = index.route_plan
    if isinstance(cached, Plan) and cached.generation == index.generation and cached.model == model:
        return cached
    made = index.route_plan = _make(index, model)
    return made


def _make(index: Index, model: str | None) -> Plan:
    no_signal: list[NoSignal] = []
    eligible: list[Member] = []
    for node in sorted(index.nodes.values(), key=lambda n: n.node_id):
        why = model_mismatch(node, model)
        got = node_model(node) if why is None else why
        if isinstance(got, str):
            no_signal.append(NoSignal(node.node_id, got.removesuffix(": per-group prefix semantics"),
                                      "expired" if node.expired else "model" if why else "specs"))
        else:
            eligible.append((node, got))
    by_config: dict[tuple, ConfigNodes] = {}
    config_problems: list[NoSignal] = []
    for node, m in eligible:
        cfg = node.hash_config
        if cfg is None:
            config_problems.append(NoSignal(node.node_id, "no hash configuration published: its hashes cannot be "
                                                          "computed from token ids (send block_hashes)", "config"))
            continue
        specs = sorted(node.group_specs or (), key=lambda gs: gs.group_idx)
        bad = layout_mismatch(cfg, specs)
        if bad is not None:
            config_problems.append(NoSignal(node.node_id, f"hash configuration {label(cfg)}: {bad}", "config"))
            continue
        # groups searched at the hash unit (partial hits on) take the unit list, not the block view
        fine = tuple(gs.group_idx for gs in specs if m.searched_at_unit(gs.group_idx))
        ck = config_key(cfg)
        key = (ck, tuple((gs.group_idx, gs.block_size) for gs in specs), fine)
        per = by_config.get(ck)
        if per is None:
            per = by_config[ck] = ConfigNodes(cfg, {})
        cohort = per.cohorts.get(key)
        if cohort is None:
            cohort = per.cohorts[key] = Cohort(specs, fine, [])
        cohort.members.append((node, m))
    by_layout: dict[tuple, tuple[dict[int, int], list[Member]]] = {}
    for node, m in eligible:
        sizes = {g: s.block_size for g, s in zip(m.groups, m.specs)}
        fine = tuple(g for g in m.groups if m.searched_at_unit(g))
        layout = (tuple(sorted(sizes.items())), fine, m.hash_block_size if fine else 0)
        by_layout.setdefault(layout, (sizes, []))[1].append((node, m))
    return Plan(index.generation, model, no_signal, eligible, by_config, config_problems,
                {n.model for n, _ in eligible}, by_layout, {})


def label(cfg: HashConfig) -> str:
    return f"{cfg.algorithm}/{cfg.hash_block_size}/{cfg.none_hash_seed_rule}"


def model_mismatch(node: NodeState, model: str | None) -> str | None:
    if node.expired:
        return "expired: silent past the index TTL, its entries were dropped"
    if model is not None and node.model is not None and node.model != model:
        return f"serves model {node.model!r}, the request is for {model!r}"
    return None
