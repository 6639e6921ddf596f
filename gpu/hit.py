"""The hybrid prefix-cache hit: how many leading tokens of a request a node can reuse.

Pure functions over "is this hash cached for this group?" — no block pool. The GPU coordinator
runs them with a lookup into its pool (the found values are the blocks); the router runs them with
what the index says a node holds (`longest_hybrid_hit` from fine hashes, `longest_hybrid_hit_in_views`
from per-group lists as the events publish them). One definition, two users, so a route decision
and the node's own hit cannot disagree.

Per-type rules (`n = max_length // block_size`, hashes viewed at the group's block size):
  full attention   longest prefix of cached blocks.
  sliding window   the rightmost run of `cdiv(window - 1, block_size)` consecutive cached blocks
                   (its right end aligned); the hit ends with the run and earlier slots are null.
                   No full run: the run touching block 0 (a prefix shorter than the window).
  Mamba (align)    the last cached block whose end is aligned; earlier slots are null.
  chunked local    blocks before the current chunk are null, then a prefix of cached blocks.
Hybrid: spec groups (equal specs merged, full attention first) are visited in turn, each capping
the candidate length, until a pass leaves it unchanged (one pass when the model is "full attention
+ one other"). EAGLE groups drop the last matched block, once per candidate length.

Fine-grained (partial) hits (vllm-semantics §2.5, §4.2-4.3): when a Mamba group in align mode has a
block larger than the hash unit (and every other cacheable group either has a fine-grained finder or
sits at the hash unit, `partial_hits_enabled`), hits land on the hash unit instead of the lcm. A
fine-grained group is then searched on the request's hash-unit list, not its block view:
  full attention   the cached prefix of whole blocks, then the hash units inside the next block
                   probed from high to low (a partial entry); EAGLE drops one hash unit.
  Mamba            the highest cached hash unit (a block end or a partial entry).
Sliding-window and chunked-local groups keep their block rules (they must sit at the hash unit).

A found list holds, per block slot, None for a null slot or the lookup's truthy value.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Collection, Container, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from kvpipe.gpu.specs import ChunkedLocal, FullAttention, KVSpec, Mamba, SlidingWindow

# Lookup for one spec group: a truthy value when every member group holds the hash, else falsy.
Lookup = Callable[[bytes], Any]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- per-type finders --------------------------------------------------------------------------


def is_fine_grained(block_size: int, alignment: int) -> bool:
    """A fine-grained finder searches hash units: the alignment is the unit, below the block."""
    return alignment < block_size and block_size % alignment == 0


def find_full(hashes: Sequence[bytes], max_length: int, block_size: int, alignment: int,
              lookup: Lookup, drop_eagle: bool = False) -> tuple[list[Any], int]:
    fine = is_fine_grained(block_size, alignment)
    # Fine-grained: `hashes` is the hash-unit list; a whole block's hash is its last unit's.
    k = block_size // alignment if fine else 1
    blocks = hashes[k - 1::k] if fine else hashes
    found: list[Any] = []
    for h in blocks[: max_length // block_size]:
        v = lookup(h)
        if not v:
            break  # chained hashes: a miss means every later block misses too
        found.append(v)
    hit = len(found) * block_size
    if fine:
        # A partial entry inside the next block: probe its interior units, longest first.
        first = len(found) * k
        last = min(first + k - 1, max_length // alignment, len(hashes))
        for j in range(last - 1, first - 1, -1):
            v = lookup(hashes[j])
            if v:
                found.append(v)
                hit = (j + 1) * alignment
                break
    if drop_eagle and hit > 0:
        hit -= min(alignment, block_size)
    hit -= hit % alignment
    del found[cdiv(hit, block_size):]
    return found, hit


def sliding_blocks_needed(window: int, block_size: int, eagle: bool = False) -> int:
    """Consecutive cached blocks a sliding-window hit needs (one more when EAGLE drops one)."""
    return cdiv(window - 1, block_size) + (1 if eagle else 0)


def find_sliding(hashes: Sequence[bytes], max_length: int, block_size: int, window: int,
                 alignment: int, lookup: Lookup, drop_eagle: bool = False) -> tuple[list[Any], int]:
    need = sliding_blocks_needed(window, block_size, drop_eagle)
    n = min(max_length // block_size, len(hashes))
    found: list[Any] = [None] * n
    aligned_only = block_size != alignment
    run = 0
    matched = False
    for i in range(n - 1, -1, -1):
        if run == 0 and aligned_only:
            # A run may only end (at its right) on an aligned boundary; an unaligned block
            # cannot start one whether cached or not, so skip the lookup.
            if (((i if drop_eagle else i + 1) * block_size) % alignment) != 0:
                continue
        v = lookup(hashes[i])
        if v:
            found[i] = v
            run += 1
            if run >= need:
                del found[i + run:]
                matched = True
                break
        else:
            run = 0
    if not matched:
        del found[run:]  # the run touching block 0, possibly empty
        if aligned_only:
            while (len(found) * block_size) % alignment:
                found.pop()
    if drop_eagle and found:
        found.pop()
        if aligned_only:
            while (len(found) * block_size) % alignment:
                found.pop()
    return found, len(found) * block_size


def find_mamba(hashes: Sequence[bytes], max_length: int, block_size: int, alignment: int,
               lookup: Lookup) -> tuple[list[Any], int]:
    if is_fine_grained(block_size, alignment):
        # `hashes` is the hash-unit list: any cached unit (block end or partial entry) is a state.
        k = block_size // alignment
        for j in range(min(max_length // alignment, len(hashes)) - 1, -1, -1):
            v = lookup(hashes[j])
            if v:
                found = [None] * (j // k)
                found.append(v)
                return found, (j + 1) * alignment
        return [], 0
    n = min(max_length // block_size, len(hashes))
    aligned_only = block_size != alignment
    for i in range(n - 1, -1, -1):
        if aligned_only and ((i + 1) * block_size) % alignment:
            continue
        v = lookup(hashes[i])
        if v:
            found: list[Any] = [None] * i
            found.append(v)
            return found, (i + 1) * block_size
    return [], 0


def find_chunked_local(hashes: Sequence[bytes], max_length: int, block_size: int, chunk: int,
                       alignment: int, lookup: Lookup) -> tuple[list[Any], int]:
    if alignment != block_size:
        raise ValueError("chunked local attention needs every group at one block size "
                         f"(alignment {alignment} != block size {block_size})")
    n = min(max_length // block_size, len(hashes))
    start_block = (max_length // chunk * chunk if max_length > 0 else 0) // block_size
    found: list[Any] = [None] * start_block
    for i in range(start_block, n):
        v = lookup(hashes[i])
        if not v:
            break
        found.append(v)
    return found, len(found) * block_size


def find_for_spec(spec: KVSpec, hashes: Sequence[bytes], max_length: int, alignment: int,
                  lookup: Lookup, drop_eagle: bool = False) -> tuple[list[Any], int]:
    """Dispatch to the finder of `spec`'s type (hashes already viewed at its block size)."""
    bs = spec.block_size
    if isinstance(spec, FullAttention):
        return find_full(hashes, max_length, bs, alignment, lookup, drop_eagle)
    if isinstance(spec, SlidingWindow):
        return find_sliding(hashes, max_length, bs, spec.sliding_window, alignment, lookup, drop_eagle)
    if isinstance(spec, Mamba):
        if spec.mode != "align":
            raise ValueError(f"Mamba prefix caching needs mode 'align', got {spec.mode!r}")
        return find_mamba(hashes, max_length, bs, alignment, lookup)
    if isinstance(spec, ChunkedLocal):
        if drop_eagle:
            raise ValueError("EAGLE with chunked local attention is not supported (as in vLLM)")
        return find_chunked_local(hashes, max_length, bs, spec.attention_chunk_size, alignment, lookup)
    raise ValueError(f"{type(spec).__name__} groups never take part in prefix caching")


# --- the hybrid fixed point --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SpecGroup:
    """Groups with equal specs, looked up together; `eagle` if any member drops a block."""

    spec: KVSpec
    group_ids: tuple[int, ...]
    eagle: bool = False


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
    merged.sort(key=lambda sg: not isinstance(sg.spec, FullAttention))
    return merged


def default_alignment(specs: Sequence[KVSpec], hash_block_size: int | None = None) -> int:
    """Where hits land: the hash unit when partial hits are on (`hash_block_size` given and
    `partial_hits_enabled`), else the lcm of all group block sizes (one group: its block size)."""
    if hash_block_size is not None and partial_hits_enabled(specs, hash_block_size):
        return hash_block_size
    return math.lcm(*(s.block_size for s in specs))


def supports_fine_grained(spec: KVSpec) -> bool:
    """Groups whose finder can search hash units inside a block (vLLM: full attention incl. MLA
    and sink, and Mamba); the others need hits on their block boundaries."""
    return isinstance(spec, (FullAttention, Mamba))


def partial_hits_enabled(specs: Sequence[KVSpec], hash_block_size: int) -> bool:
    """Whether a node with these groups and hash unit serves fine-grained (partial) hits.

    vLLM turns them on for a hybrid model (several groups; one group hits on its block) when some
    Mamba group in align mode has a block larger than the hash unit, and every other
    prefix-cacheable group either has a fine-grained finder or sits at the hash unit (a
    sliding-window group at a coarser block turns them off). Context parallelism (where equality
    also counts) is not modelled."""
    if len(specs) < 2:
        return False
    if not any(isinstance(s, Mamba) and s.mode == "align" and s.block_size > hash_block_size
               for s in specs):
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

    def __init__(self, fine: Sequence[bytes], hash_block_size: int) -> None:
        self.fine = fine
        self.hash_block_size = hash_block_size
        self._views: dict[int, Sequence[bytes]] = {}

    def at(self, block_size: int) -> Sequence[bytes]:
        v = self._views.get(block_size)
        if v is None:
            factor, rem = divmod(block_size, self.hash_block_size)
            if rem or factor == 0:
                raise ValueError(f"group block size {block_size} is not a multiple of the hash unit "
                                 f"{self.hash_block_size}")
            v = self.fine if factor == 1 else self.fine[factor - 1::factor]
            self._views[block_size] = v
        return v

    def for_spec_group(self, sg: SpecGroup, fine: bool = False) -> Sequence[bytes]:
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
    simple = len(spec_groups) == 2 and isinstance(spec_groups[0].spec, FullAttention)
    eagle_verified: set[int] = set()
    num_hashed = views.num_tokens
    while True:
        cur = hit
        for k, sg in enumerate(spec_groups):
            spec = sg.spec
            if isinstance(spec, FullAttention) and found[k] is not None:
                cur = min(cur, lengths[k])  # downward closed: looked up once, then clamped
                continue
            drop = sg.eagle and k not in eagle_verified
            limit = cur
            if drop and not isinstance(spec, Mamba):
                limit = min(cur + eagle_margin(spec, alignment), num_hashed)
            fine = supports_fine_grained(spec) and is_fine_grained(spec.block_size, alignment)
            blocks, new_len = find_for_spec(spec, views.for_spec_group(sg, fine), limit, alignment,
                                            lookups[k], drop)
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
        blocks = found[k] if found[k] is not None else []
        if isinstance(sg.spec, FullAttention):
            del blocks[cdiv(hit, sg.spec.block_size):]
        out.append(blocks)
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
            return lambda h, g=ids[0]: fn(g, h)
        return lambda h: all(fn(g, h) for g in ids)
    sets = [is_cached[g] for g in ids]
    if len(sets) == 1:
        return sets[0].__contains__
    return lambda h: all(h in s for s in sets)
