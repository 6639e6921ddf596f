"""A node's published layout (group specs + hash config) → what its hit search needs.

The router and the processor read a node's envelopes through `node_layout`: the layout rules
(`kvpipe.schemas.layout.layout_problem`, also used by the bridge) first, then the specs `kvpipe.gpu.hit` runs on,
the hash unit, where hits land (the unit when partial hits are on, else the lcm) and the EAGLE groups.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.gpu.finders import refusal, supports_fine_grained
from kvpipe.gpu.hit import default_alignment, partial_hits_enabled
from kvpipe.gpu.specs import KVSpec, from_group_spec, resolve_block_sizes
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from kvpipe.schemas.layout import layout_problem as wire_layout_problem


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Groups in group-index order, their specs, and where the node's hits land."""

    groups: tuple[int, ...]
    specs: tuple[KVSpec, ...]
    hash_block_size: int
    alignment: int  # the hash unit when partial hits are on, else the lcm of the block sizes
    partial_hits: bool
    eagle: frozenset[int]  # group indices of EAGLE groups

    def spec_of(self, group: int) -> KVSpec | None:
        return self.specs[self.groups.index(group)] if group in self.groups else None

    def searched_at_unit(self, group: int) -> bool:
        """With partial hits on, full-attention and Mamba groups coarser than the hash unit are
        searched on the request's hash-unit list (partial entries sit between block ends)."""
        spec = self.spec_of(group)
        return (self.partial_hits and spec is not None and supports_fine_grained(spec)
                and spec.block_size > self.hash_block_size)

    def list_unit(self, group: int) -> int:
        """Tokens per entry of the list this group is searched on."""
        spec = self.spec_of(group)
        assert spec is not None
        return self.hash_block_size if self.searched_at_unit(group) else spec.block_size

    def eagle_positions(self, groups: Sequence[int]) -> set[int]:
        """Positions in `groups` (a subset of the node's groups, in order) of EAGLE groups."""
        return {k for k, g in enumerate(groups) if g in self.eagle}


def node_layout(group_specs: Sequence[GroupSpec], hash_config: HashConfig | None) -> NodeLayout:
    """The layout the hit search runs on; ValueError (with the reason) for one vLLM refuses."""
    if not group_specs:
        raise ValueError("no group specs published")
    problem = wire_layout_problem(group_specs, hash_config)
    if problem is not None:
        raise ValueError(problem)
    ordered = sorted(group_specs, key=lambda gs: gs.group_idx)
    specs = tuple(from_group_spec(gs) for gs in ordered)
    unit = hash_config.hash_block_size if hash_config is not None else resolve_block_sizes(specs)[1]
    alignment = default_alignment(specs, unit)
    for s in specs:
        # a group whose rule cannot serve hits where they land (chunked local attention off its block)
        reason = refusal(s, False, alignment) if s.prefix_cacheable else None
        if reason is not None:
            raise ValueError(reason)
    eagle = frozenset(gs.group_idx for gs in ordered if gs.eagle)
    return NodeLayout(tuple(gs.group_idx for gs in ordered), specs, unit, alignment,
                      partial_hits_enabled(specs, unit), eagle)


def layout_problem(group_specs: Sequence[GroupSpec], hash_config: HashConfig | None, *,
                   context_parallel: int = 1, store_connector: bool = False) -> str | None:
    """Why vLLM would refuse this layout (None: accepted): the wire rules of `kvpipe.schemas.layout`
    plus those that need the hit rules (chunked local attention where hits land off its block)."""
    problem = wire_layout_problem(group_specs, hash_config, context_parallel=context_parallel,
                                  store_connector=store_connector)
    if problem is not None:
        return problem
    try:
        node_layout(group_specs, hash_config)
    except ValueError as exc:
        return str(exc)
    return None
