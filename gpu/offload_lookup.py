"""Scheduler side of offloading (vLLM 0.33 `offloading/scheduler.py`): how many tokens beyond the
GPU prefix hit can be loaded from the CPU tier, and which chunks a group stores or loads.

Pure functions over keys and a `lookup(key) -> LookupResult` callable; hashing is not done here
(callers pass the request's fine block hashes from `kvpipe.gpu.hashing`).

Units: a *chunk* is `blocks_per_chunk` GPU blocks of one group (`tokens_per_chunk` tokens); a chunk's
key is the last fine hash inside it, tagged with the group — chained hashes make it name the whole
prefix. Hits are whole chunks only.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import cast

from kvpipe.gpu.cpu_tier import LookupResult, OffloadKey, make_offload_key
from kvpipe.gpu.kinds import RULE_CHUNKED_LOCAL, RULE_FULL, RULE_MAMBA, RULE_SLIDING, kind_of
from kvpipe.gpu.specs import ChunkedLocal, KVSpec

Lookup = Callable[[OffloadKey], LookupResult]

# Group kinds of the offload rules, named as the hit rules of the same families (a kind's row in
# `kvpipe.gpu.kinds` says which one it takes: its `offload`).
FULL, SLIDING, MAMBA, CHUNKED_LOCAL = RULE_FULL, RULE_SLIDING, RULE_MAMBA, RULE_CHUNKED_LOCAL


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class OffloadGroup:
    """Offload geometry of one KV cache group. `window_chunks` is None for full attention, else
    how many trailing chunks a hit needs: SWA `cdiv(W, tpc)`, chunked local `cdiv(C, tpc)`,
    Mamba 1 (one state)."""

    group_idx: int
    kind: str
    tokens_per_block: int
    blocks_per_chunk: int
    hash_block_size: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.tokens_per_chunk % self.hash_block_size:
            raise ValueError(f"group {self.group_idx}: a chunk of {self.tokens_per_chunk} tokens is not "
                             f"a whole number of hash blocks of {self.hash_block_size}")
        if self.kind == SLIDING and not self.sliding_window:
            raise ValueError(f"group {self.group_idx}: a sliding-window group needs sliding_window")
        if self.kind == CHUNKED_LOCAL and not self.attention_chunk_size:
            raise ValueError(f"group {self.group_idx}: a chunked-local group needs attention_chunk_size")

    @classmethod
    def from_spec(cls, group_idx: int, spec: KVSpec, blocks_per_chunk: int, hash_block_size: int) -> OffloadGroup:
        kind = kind_of(spec).offload
        if kind is None:
            raise ValueError(f"group {group_idx}: {type(spec).__name__} groups are not offloaded")
        return cls(group_idx=group_idx, kind=kind, tokens_per_block=spec.block_size,
                   blocks_per_chunk=blocks_per_chunk, hash_block_size=hash_block_size,
                   sliding_window=spec.window if kind == SLIDING else None,
                   attention_chunk_size=cast(ChunkedLocal, spec).attention_chunk_size
                   if kind == CHUNKED_LOCAL else None)

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk

    @property
    def hashes_per_chunk(self) -> int:
        return self.tokens_per_chunk // self.hash_block_size

    @property
    def window_chunks(self) -> int | None:
        if self.kind == SLIDING:
            assert self.sliding_window is not None
            return _cdiv(self.sliding_window, self.tokens_per_chunk)
        if self.kind == CHUNKED_LOCAL:
            assert self.attention_chunk_size is not None
            return _cdiv(self.attention_chunk_size, self.tokens_per_chunk)
        if self.kind == MAMBA:
            return 1
        return None

    def load_window_chunks(self, hit_end: int) -> int | None:
        """Chunks to hold a hit ending at token `hit_end`: for SWA one more when the end is not
        chunk-aligned and the window then straddles an extra chunk on the left."""
        window = self.window_chunks
        if self.kind == SLIDING and window is not None:
            assert self.sliding_window is not None
            window = max(window, _cdiv(self.sliding_window - 1 + (-hit_end % self.tokens_per_chunk),
                                       self.tokens_per_chunk))
        return window

    def first_needed_token(self, hit_end: int) -> int:
        """First token whose KV the next step can still read when the cache ends at `hit_end`."""
        if self.kind == SLIDING:
            assert self.sliding_window is not None
            return max(0, hit_end - self.sliding_window + 1)
        if self.kind == CHUNKED_LOCAL:
            assert self.attention_chunk_size is not None
            return hit_end // self.attention_chunk_size * self.attention_chunk_size
        if self.kind == MAMBA:
            return max(0, (_cdiv(hit_end, self.tokens_per_block) - 1) * self.tokens_per_block)
        return 0


def chunk_keys(fine_hashes: Sequence[bytes], group: OffloadGroup) -> list[OffloadKey]:
    """Keys of the request's complete chunks: the last fine hash of each, tagged with the group."""
    step = group.hashes_per_chunk
    return [make_offload_key(h, group.group_idx) for h in fine_hashes[step - 1::step]]


# -- per-group scans -------------------------------------------------------------------------------

def maximal_prefix_lookup(keys: Sequence[OffloadKey], lookup: Lookup) -> int | None:
    """Chunks hit from the start, stopping at the first MISS; None (defer) if any counted chunk
    is still being written or a RETRY was seen. A RETRY does not stop the scan, so the backend
    gets to start resolving every key it will be asked about again."""
    hits = 0
    defer = False
    for key in keys:
        result = lookup(key)
        if result is LookupResult.MISS:
            break
        if result is LookupResult.RETRY:
            defer = True
            continue
        hits += 1
        defer |= result is LookupResult.HIT_PENDING
    return None if defer else hits


def sliding_window_lookup(keys: Sequence[OffloadKey], window: int, lookup: Lookup,
                          initial_window: int | None = None) -> int | None:
    """End index (exclusive) of the rightmost run of `window` consecutive hits, scanning from the
    right; the first run counted may need `initial_window` (a partial rightmost chunk). Without
    such a run, the length of the run touching the first key. None (defer) if a RETRY was seen or
    a HIT_PENDING lies inside the accepted run."""
    defer = pending = False
    run = 0
    need = initial_window or window
    for idx in range(len(keys) - 1, -1, -1):
        result = lookup(keys[idx])
        if result is LookupResult.HIT or result is LookupResult.HIT_PENDING:
            run += 1
            pending |= result is LookupResult.HIT_PENDING
        else:
            defer |= result is LookupResult.RETRY
            run, pending, need = 0, False, window
        if run == need:
            return None if defer or pending else idx + need
    return None if defer or pending else run


# -- across groups ---------------------------------------------------------------------------------

def lookup_hit_tokens(groups: Sequence[OffloadGroup], keys: Sequence[Sequence[OffloadKey]], lookup: Lookup,
                      num_computed_tokens: int, num_tokens: int, *, max_new_tokens: int | None = None,
                      max_load_tokens: int | None = None, align_tokens: int | None = None,
                      being_loaded: Collection[OffloadKey] = ()) -> int | None:
    """Tokens loadable beyond `num_computed_tokens` (the GPU hit), 0 for none, None to retry later.

    Full-attention groups are scanned first (prefix), then windowed groups by window size,
    largest first. Each group can only lower the hit end; when a later group lowers it below a
    windowed group's earlier answer, the windowed groups are rescanned at the new end (a window
    that ended at the old end says nothing about the new one) until nothing changes — the same
    fixed point as the GPU coordinator. With windowed groups the last prompt token is never
    loaded (it must be recomputed for its logits), hence `limit - 1`.
    """
    limit = num_tokens
    if max_new_tokens is not None:
        limit = min(limit, num_computed_tokens + max_new_tokens)
    if max_load_tokens is not None:
        limit = min(limit, num_computed_tokens + max_load_tokens)
    full = [i for i, g in enumerate(groups) if g.window_chunks is None]
    windowed = sorted((i for i, g in enumerate(groups) if g.window_chunks is not None),
                      key=lambda i: groups[i].window_chunks or 0, reverse=True)
    if windowed:
        limit -= 1
        if align_tokens:
            limit = limit // align_tokens * align_tokens
    order = full + windowed
    hit = 0
    defer = False
    todo = order
    while todo:
        current, todo = todo, []
        scanned_window = False
        for i in current:
            g, group_keys = groups[i], keys[i]
            tpc = g.tokens_per_chunk
            limit = min(limit, len(group_keys) * tpc)
            if max_load_tokens is not None:
                limit = limit // tpc * tpc
            if limit - num_computed_tokens < tpc:
                return 0
            end_chunk = min(_cdiv(limit, tpc), len(group_keys))
            start_chunk = num_computed_tokens // tpc
            span = group_keys[start_chunk:end_chunk]
            if g.window_chunks is None:
                n = maximal_prefix_lookup(span, lookup)
            else:
                n = sliding_window_lookup(span, g.window_chunks, lookup,
                                          g.load_window_chunks(min(limit, end_chunk * tpc)))
            if n == 0:
                return 0
            if n is None:
                defer = True
            else:
                limit = min(limit, tpc * (start_chunk + n))
            new_hit = limit - num_computed_tokens
            if new_hit < tpc:
                return 0
            if new_hit < hit:
                if defer:  # rescan everything: the deferring key may lie beyond the new end
                    defer, todo = False, order
                elif scanned_window and not todo:
                    todo = windowed
            scanned_window |= g.window_chunks is not None
            hit = new_hit
    if defer:
        return None
    if being_loaded:
        end = num_computed_tokens + hit
        for g, group_keys in zip(groups, keys):
            first, last = load_chunk_range(g, num_computed_tokens, end)
            if any(k in being_loaded for k in group_keys[first:last]):
                return None  # another request is loading these chunks: wait instead of copying twice
    return hit


# -- which chunks move -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LoadPlan:
    """Chunks `[first_chunk, end_chunk)` to load for a group and the request-block positions
    `[first_block, end_block)` they fill; the first `skip` blocks of the first chunk are not
    loaded (they are computed already, or outside the window). `GroupTransfer.skip` takes it."""

    group_idx: int
    first_chunk: int
    end_chunk: int
    first_block: int
    end_block: int
    skip: int


def load_chunk_range(group: OffloadGroup, num_computed_tokens: int, hit_end: int) -> tuple[int, int]:
    """`[first, end)` chunk indices to load; windowed groups load only the window's tail."""
    plan = load_plan(group, num_computed_tokens, hit_end)
    return plan.first_chunk, plan.end_chunk


def load_plan(group: OffloadGroup, num_computed_tokens: int, hit_end: int) -> LoadPlan:
    """Blocks to fill for a hit `[num_computed_tokens, hit_end)`. A full-attention group loads
    all of it; SWA/Mamba/chunked-local groups only what the next step can read (their earlier
    blocks stay null on the GPU, so loading them would be wasted copies)."""
    tpb, bpc = group.tokens_per_block, group.blocks_per_chunk
    first_block = max(num_computed_tokens // tpb, group.first_needed_token(hit_end) // tpb)
    end_block = _cdiv(hit_end, tpb)
    first_block = min(first_block, end_block)
    return LoadPlan(group.group_idx, first_block // bpc, _cdiv(hit_end, group.tokens_per_chunk),
                    first_block, end_block, first_block % bpc)


def store_chunk_indices(group: OffloadGroup, next_chunk: int, num_offloadable_tokens: int,
                        block_ids: Sequence[int], num_keys: int, null_block_id: int = 0) -> list[int]:
    """Chunk indices to offer to `prepare_store` this step.

    Complete, keyed, allocated chunks from `next_chunk` on; a windowed group keeps only the last
    `window_chunks` of them — the window's tail, all a later hit at this end can use — and any
    chunk holding a null block (freed early, outside the window) is skipped: storing it would
    publish a chunk whose bytes were never written.
    """
    bpc = group.blocks_per_chunk
    end = min(num_offloadable_tokens // group.tokens_per_chunk, len(block_ids) // bpc, num_keys)
    start = next_chunk
    if group.window_chunks is not None:
        start = max(start, end - group.window_chunks)
    return [c for c in range(start, end)
            if all(b != null_block_id for b in block_ids[c * bpc:(c + 1) * bpc])]
