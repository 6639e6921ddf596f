"""The hybrid prefix-cache hit: how many leading tokens of a request a node can reuse.

Pure functions over "is this hash cached for this group?" — no block pool. The GPU coordinator
runs them with a lookup into its pool (the found values are the blocks); the router runs them with
what the index says a node holds (`longest_hybrid_hit` from fine hashes, `longest_hybrid_hit_in_views`
from per-group lists as the events publish them). One definition, two users, so a route decision
and the node's own hit cannot disagree.

Each group is searched by its kind's hit rule (`kvpipe.gpu.finders`: the per-type finders, and the
`HitRule` a kind's row in `kvpipe.gpu.kinds` names). Hybrid: spec groups (equal specs merged,
prefix rules — full attention — first) are visited in turn, each capping the candidate length, until
a pass leaves it unchanged (one pass when the model is "full attention + one other"). EAGLE groups
drop the last matched block, once per candidate length.

Fine-grained (partial) hits (vllm-semantics §2.5, §4.2-4.3): when a Mamba group in align mode has a
block larger than the hash unit (and every other cacheable group either has a fine-grained finder or
sits at the hash unit, `partial_hits_enabled`), hits land on the hash unit instead of the lcm, and a
fine-grained group is searched on the request's hash-unit list, not its block view.

A found list holds, per block slot, None for a null slot or the lookup's truthy value.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kvpipe.gpu.finders import HitRule, Lookup, cdiv, is_fine_grained, supports_fine_grained
# The per-type finders lived here before `finders` split off; these names stay importable from here.
from kvpipe.gpu.finders import find_chunked_local as find_chunked_local
from kvpipe.gpu.finders import find_for_spec as find_for_spec
from kvpipe.gpu.finders import find_full as find_full
from kvpipe.gpu.finders import find_mamba as find_mamba
from kvpipe.gpu.finders import find_sliding as find_sliding
from kvpipe.gpu.finders import sliding_blocks_needed as sliding_blocks_needed
from kvpipe.gpu.kinds import hit_rule
from kvpipe.gpu.specs import KVSpec
from kvpipe.schemas.events import ExternalHash

# --- the hybrid fixed point --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpecGroup:
    """Groups with equal specs, looked up together; `eagle` if any member drops a block."""

    spec: KVSpec
    group_ids: tuple[int, ...]
    eagle: bool = False

    @property
    def rule(self) -> HitRule:
        rule = hit_rule(self.spec)
        assert rule is not None, "split_spec_groups keeps prefix-cacheable groups only"
        return rule


def split_spec_groups(specs: Sequence[KVSpec], eagle_groups: Collection[int] = ()) -> list[SpecGroup]:
    """Prefix-cacheable groups merged by equal spec, full attention first (stable)."""
    merged: list[SpecGroup] = []
    for gid, spec in enumerate(specs):
        if not spec.prefix_cacheable:
            continue
        for k, sg in enumerate(merged):
            if sg.spec == spec:
                merged[k] = SpecGroup(spec, sg.group_ids + (gid,), sg.eagle or gid in eagle_groups)
                break
        else:
            merged.append(SpecGroup(spec, (gid,), gid in eagle_groups))
    if not merged:
        raise ValueError("no prefix-cacheable KV cache group")
    merged.sort(key=lambda sg: not sg.rule.prefix)
    return merged


def default_alignment(specs: Sequence[KVSpec], hash_block_size: int | None = None) -> int:
    """Where hits land: the hash unit when partial hits are on (`hash_block_size` given and
    `partial_hits_enabled`), else the lcm of all group block sizes (one group: its block size)."""
    if hash_block_size is not None and partial_hits_enabled(specs, hash_block_size):
        return hash_block_size
    return math.lcm(*(s.block_size for s in specs))


def partial_hits_enabled(specs: Sequence[KVSpec], hash_block_size: int) -> bool:
    """Whether a node with these groups and hash unit serves fine-grained (partial) hits.

    vLLM turns them on for a hybrid model (several groups; one group hits on its block) when some
    Mamba group in align mode has a block larger than the hash unit, and every other
    prefix-cacheable group either has a fine-grained finder or sits at the hash unit (a
    sliding-window group at a coarser block turns them off). Context parallelism (where equality
    also counts) is not modelled."""
    if len(specs) < 2:
        return False
    if not any(rule.enables_partial_hits and s.problem is None and s.block_size > hash_block_size
               for s in specs if (rule := hit_rule(s)) is not None):
        return False
    return all(supports_fine_grained(s) or s.block_size == hash_block_size
               for s in specs if s.prefix_cacheable)


def eagle_margin(spec: KVSpec, alignment: int) -> int:
    """Tokens an EAGLE group looks past the candidate before dropping them: one hash unit for a
    fine-grained finder, else one block."""
    if supports_fine_grained(spec) and is_fine_grained(spec.block_size, alignment):
        return alignment
    return spec.block_size


class ViewCache:
    """Group views of one request's fine hashes, built once per block size per search."""

    __slots__ = ("fine", "hash_block_size", "_views")

    def __init__(self, fine: Sequence[ExternalHash], hash_block_size: int) -> None:
        self.fine = fine
        self.hash_block_size = hash_block_size
        self._views: dict[int, Sequence[ExternalHash]] = {}

    def at(self, block_size: int) -> Sequence[ExternalHash]:
        v = self._views.get(block_size)
        if v is None:
            factor, rem = divmod(block_size, self.hash_block_size)
            if rem or factor == 0:
                raise ValueError(f"group block size {block_size} is not a multiple of the hash unit "
                                 f"{self.hash_block_size}")
            v = self.fine if factor == 1 else self.fine[factor - 1::factor]
            self._views[block_size] = v
        return v

    def for_spec_group(self, sg: SpecGroup, fine: bool = False) -> Sequence[ExternalHash]:
        return self.fine if fine else self.at(sg.spec.block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.fine) * self.hash_block_size


class GroupViews:
    """Per-group hash lists given as they are: group g's i-th entry is its block i's hash (the
    form KV events publish). Members of one spec group have equal specs, hence one block size and
    one view; the shortest member list bounds the search (it is all that was asked about).

    With fine-grained (partial) hits, a group searched at the hash unit takes its list at the hash
    unit (`unit`): entry j is the hash of the prefix ending at unit j, whose every k-th entry is
    the block view (the value a whole block is published under)."""

    __slots__ = ("group_hashes", "num_tokens", "unit")

    def __init__(self, specs: Sequence[KVSpec], group_hashes: Sequence[Sequence[Any]],
                 unit: int | None = None) -> None:
        if len(group_hashes) != len(specs):
            raise ValueError(f"{len(group_hashes)} hash lists for {len(specs)} groups")
        self.group_hashes = group_hashes
        self.unit = unit
        self.num_tokens = max((len(h) * (unit if unit and is_fine_grained(s.block_size, unit)
                                         and supports_fine_grained(s) else s.block_size)
                               for s, h in zip(specs, group_hashes)), default=0)

    def for_spec_group(self, sg: SpecGroup, fine: bool = False) -> Sequence[Any]:
        return min((self.group_hashes[g] for g in sg.group_ids), key=len)


class HashViews(Protocol):
    """What `find_hit` needs from a request's hashes: each spec group's view, and how many
    tokens they cover (the EAGLE margin may look one block past the cap, never past that)."""

    @property
    def num_tokens(self) -> int: ...

    def for_spec_group(self, sg: SpecGroup, fine: bool = False) -> Sequence[Any]: ...


def find_hit(spec_groups: Sequence[SpecGroup], views: HashViews, lookups: Sequence[Lookup],
             max_length: int, alignment: int) -> tuple[list[list[Any]], int, int]:
    """The hybrid search. Returns `(found list per spec group, hit length, longest single-group
    hit)`; full-attention lists are truncated to the hit. `lookups[k]` serves `spec_groups[k]`."""
    hit = max_length
    longest = 0
    found: list[list[Any] | None] = [None] * len(spec_groups)
    lengths = [0] * len(spec_groups)
    rules = [sg.rule for sg in spec_groups]
    simple = len(spec_groups) == 2 and rules[0].prefix
    eagle_verified: set[int] = set()
    num_hashed = views.num_tokens
    while True:
        cur = hit
        for k, sg in enumerate(spec_groups):
            spec, rule = sg.spec, rules[k]
            if rule.prefix and found[k] is not None:
                cur = min(cur, lengths[k])  # downward closed: looked up once, then clamped
                continue
            drop = sg.eagle and k not in eagle_verified
            limit = cur
            if drop and rule.eagle_lookahead:
                limit = min(cur + eagle_margin(spec, alignment), num_hashed)
            fine = rule.fine_grained and is_fine_grained(spec.block_size, alignment)
            reason = spec.problem or rule.refuses(spec, drop, alignment)  # find_for_spec's check, inlined
            if reason is not None:
                raise ValueError(reason)
            blocks, new_len = rule.find(spec, views.for_spec_group(sg, fine), limit, alignment, lookups[k], drop)
            if drop:
                eagle_verified.add(k)
            elif new_len < cur:
                eagle_verified.clear()
            cur = new_len
            found[k] = blocks
            lengths[k] = new_len
            longest = max(longest, cur)
        if cur >= hit:
            break
        hit = cur
        if simple:
            break
    out: list[list[Any]] = []
    for k, sg in enumerate(spec_groups):
        kept = found[k] or []
        if rules[k].prefix:
            del kept[cdiv(hit, sg.spec.block_size):]
        out.append(kept)
    return out, hit, longest


class HybridHit(NamedTuple):
    length: int
    # Per group index: mask[i] is True when block slot i is a real (non-null) block to reuse or
    # load; [] for groups that take no part in prefix caching.
    masks: tuple[list[bool], ...]
    # Longest hit of any single spec group; above `length` it marks a shared prefix that a sparse
    # group has not cached (vLLM pins it as `shared_prefix_boundary`).
    longest_group_hit: int


IsCached = Callable[[int, Any], bool] | Sequence[Container[Any]]


def longest_hybrid_hit(
    specs: Sequence[KVSpec],
    block_hashes: Sequence[bytes],
    hash_block_size: int,
    is_cached: IsCached,
    max_length: int,
    alignment: int | None = None,
    eagle_groups: Collection[int] = (),
) -> HybridHit:
    """The hit a node with `specs` would compute for a request.

    `block_hashes` are the request's fine hashes (at `hash_block_size`); a group with a coarser
    block sees the last fine hash of each of its blocks. `is_cached(group_idx, hash)` or one
    container of hashes per group says what the node holds. `max_length` is the cap (vLLM uses
    the request's token count minus one). `alignment` defaults to the hash unit when partial hits
    are on (`partial_hits_enabled`), else the lcm of the block sizes.
    """
    alignment = alignment or default_alignment(specs, hash_block_size)
    if alignment != hash_block_size and any(
            supports_fine_grained(s) and is_fine_grained(s.block_size, alignment) for s in specs):
        raise ValueError(f"hits landing inside blocks (alignment {alignment}) must land on the hash unit "
                         f"{hash_block_size}: fine-grained finders search hash units")
    return _hybrid_hit(specs, ViewCache(block_hashes, hash_block_size), is_cached, max_length,
                       alignment, eagle_groups)


def longest_hybrid_hit_in_views(
    specs: Sequence[KVSpec],
    group_hashes: Sequence[Sequence[Any]],
    is_cached: IsCached,
    max_length: int,
    alignment: int | None = None,
    eagle_groups: Collection[int] = (),
) -> HybridHit:
    """`longest_hybrid_hit` when the request is already viewed per group: `group_hashes[g]` is
    group g's list at its own block size (what the events of group g publish). Any hashable
    values work — the router passes block positions and answers `is_cached` from the index.
    When `alignment` is below a fine-grained group's block (partial hits), that group's list is
    at the hash unit (= `alignment`) instead (see `GroupViews`)."""
    fine_unit = alignment if alignment and any(
        supports_fine_grained(s) and is_fine_grained(s.block_size, alignment) for s in specs) else None
    return _hybrid_hit(specs, GroupViews(specs, group_hashes, fine_unit), is_cached, max_length,
                       alignment, eagle_groups)


def _hybrid_hit(specs: Sequence[KVSpec], views: HashViews, is_cached: IsCached, max_length: int,
                alignment: int | None, eagle_groups: Collection[int]) -> HybridHit:
    spec_groups = split_spec_groups(specs, eagle_groups)
    lookups = [_lookup(sg.group_ids, is_cached) for sg in spec_groups]
    found, hit, longest = find_hit(spec_groups, views, lookups, max_length,
                                   alignment or default_alignment(specs))
    masks: list[list[bool]] = [[] for _ in specs]
    for sg, blocks in zip(spec_groups, found):
        mask = [b is not None for b in blocks]
        for g in sg.group_ids:
            masks[g] = list(mask)
    return HybridHit(hit, tuple(masks), longest)


def _lookup(ids: tuple[int, ...], is_cached: IsCached) -> Lookup:
    """One spec group's lookup: hit only when every member group holds the hash."""
    if callable(is_cached):
        fn = is_cached
        if len(ids) == 1:
            only = ids[0]
            return lambda h: fn(only, h)
        return lambda h: all(fn(g, h) for g in ids)
    sets = [is_cached[g] for g in ids]
    if len(sets) == 1:
        return sets[0].__contains__
    return lambda h: all(h in s for s in sets)
