"""The per-type hit finders, and the rule families the hybrid search (`kvpipe.gpu.hit`) runs them by.

Per-type rules (`n = max_length // block_size`, hashes viewed at the group's block size):
  full attention   longest prefix of cached blocks.
  sliding window   the rightmost run of `cdiv(window - 1, block_size)` consecutive cached blocks
                   (its right end aligned); the hit ends with the run and earlier slots are null.
                   No full run: the run touching block 0 (a prefix shorter than the window).
  Mamba (align)    the last cached block whose end is aligned; earlier slots are null.
  chunked local    blocks before the current chunk are null, then a prefix of cached blocks.
With fine-grained (partial) hits, a fine-grained group is searched on the request's hash-unit list:
  full attention   the cached prefix of whole blocks, then the hash units inside the next block
                   probed from high to low (a partial entry); EAGLE drops one hash unit.
  Mamba            the highest cached hash unit (a block end or a partial entry).
Sliding-window and chunked-local groups keep their block rules (they must sit at the hash unit).

Each family is a `HitRule` (`FULL`, `SLIDING`, `MAMBA`, `CHUNKED_LOCAL`): its finder over a spec and
the facts the hybrid search needs about it. Which kind uses which is its row in `kvpipe.gpu.kinds`;
the native engine (native/src/hit.rs) implements the same families, by the codes of
native/src/hit_rules.toml.

Pure functions, no I/O: the router runs them too.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from kvpipe.gpu.kinds import RULE_CHUNKED_LOCAL, RULE_FULL, RULE_MAMBA, RULE_SLIDING, hit_rule
from kvpipe.gpu.specs import ChunkedLocal, KVSpec, SlidingWindow

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
                state: list[Any] = [None] * (j // k)
                state.append(v)
                return state, (j + 1) * alignment
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


# --- the rules: a finder and the facts the hybrid search needs -------------------------------------

Finder = Callable[[KVSpec, Sequence[Any], int, int, Lookup, bool], tuple[list[Any], int]]


def _accepts(spec: KVSpec, eagle: bool, alignment: int) -> str | None:
    return None


def _no_param(spec: KVSpec) -> int:
    return 0


@dataclass(frozen=True, slots=True)
class HitRule:
    """How one family of kinds finds its hit (vLLM: its manager's `find_longest_cache_hit`), named
    by the kinds' rows in `kvpipe.gpu.kinds`. `find(spec, hashes, max_length, alignment, lookup,
    drop_eagle)` runs on hashes already viewed at the group's block size (or hash unit)."""

    name: str  # kvpipe.gpu.kinds.RULE_*; native/src/hit_rules.toml gives the native engine's code for it
    find: Finder
    # Hits are prefixes of cached blocks, so shorter lengths hit too (full attention): searched first,
    # looked up once and then clamped, its blocks cut to the hybrid hit.
    prefix: bool
    # Its finder can search the hash units inside a block (partial hits).
    fine_grained: bool
    # EAGLE reaches one drop unit past the candidate before dropping (not a single state: Mamba).
    eagle_lookahead: bool = True
    # A block above the hash unit turns partial hits on (vLLM: a Mamba group in align mode).
    enables_partial_hits: bool = False
    # Why a group cannot be searched with this rule here (spec, EAGLE, alignment); None: it can.
    refuses: Callable[[KVSpec, bool, int], str | None] = _accepts
    # The one number the native engine takes beside the block size (a window, a chunk size).
    param: Callable[[KVSpec], int] = _no_param


def _find_full(spec: KVSpec, hashes: Sequence[Any], max_length: int, alignment: int, lookup: Lookup,
               drop_eagle: bool) -> tuple[list[Any], int]:
    return find_full(hashes, max_length, spec.block_size, alignment, lookup, drop_eagle)


def _window(spec: KVSpec) -> int:
    return cast(SlidingWindow, spec).sliding_window


def _find_sliding(spec: KVSpec, hashes: Sequence[Any], max_length: int, alignment: int, lookup: Lookup,
                  drop_eagle: bool) -> tuple[list[Any], int]:
    return find_sliding(hashes, max_length, spec.block_size, _window(spec), alignment, lookup, drop_eagle)


def _find_mamba(spec: KVSpec, hashes: Sequence[Any], max_length: int, alignment: int, lookup: Lookup,
                drop_eagle: bool) -> tuple[list[Any], int]:
    return find_mamba(hashes, max_length, spec.block_size, alignment, lookup)  # EAGLE keeps its state


def _chunk(spec: KVSpec) -> int:
    return cast(ChunkedLocal, spec).attention_chunk_size


def _chunked_refuses(spec: KVSpec, eagle: bool, alignment: int) -> str | None:
    if eagle:
        return "EAGLE with chunked local attention is not supported (as in vLLM)"
    if alignment != spec.block_size:
        return (f"chunked local attention needs hits on its block ({spec.block_size}), "
                f"but they land on {alignment}")
    return None


def _find_chunked_local(spec: KVSpec, hashes: Sequence[Any], max_length: int, alignment: int, lookup: Lookup,
                        drop_eagle: bool) -> tuple[list[Any], int]:
    return find_chunked_local(hashes, max_length, spec.block_size, _chunk(spec), alignment, lookup)


FULL = HitRule(RULE_FULL, _find_full, prefix=True, fine_grained=True)
SLIDING = HitRule(RULE_SLIDING, _find_sliding, prefix=False, fine_grained=False, param=_window)
MAMBA = HitRule(RULE_MAMBA, _find_mamba, prefix=False, fine_grained=True, eagle_lookahead=False,
                enables_partial_hits=True)
CHUNKED_LOCAL = HitRule(RULE_CHUNKED_LOCAL, _find_chunked_local, prefix=False, fine_grained=False,
                        refuses=_chunked_refuses, param=_chunk)


def refusal(spec: KVSpec, eagle: bool, alignment: int) -> str | None:
    """Why `spec`'s group cannot be searched here: its own parameters (`KVSpec.problem`), no hit
    rule, or its rule's limits (EAGLE, alignment). None: `find_for_spec` can search it."""
    rule = hit_rule(spec)
    if rule is None:
        return f"{type(spec).__name__} groups never take part in prefix caching"
    return spec.problem or rule.refuses(spec, eagle, alignment)


def find_for_spec(spec: KVSpec, hashes: Sequence[bytes], max_length: int, alignment: int,
                  lookup: Lookup, drop_eagle: bool = False) -> tuple[list[Any], int]:
    """The finder of `spec`'s hit rule (hashes already viewed at its block size); ValueError with
    the `refusal` when it cannot search."""
    reason = refusal(spec, drop_eagle, alignment)
    rule = hit_rule(spec)
    if reason is not None or rule is None:
        raise ValueError(reason)
    return rule.find(spec, hashes, max_length, alignment, lookup, drop_eagle)


def supports_fine_grained(spec: KVSpec) -> bool:
    """Groups whose finder can search hash units inside a block (vLLM: full attention incl. MLA
    and sink, and Mamba); the others need hits on their block boundaries."""
    rule = hit_rule(spec)
    return rule is not None and rule.fine_grained
