"""Which newly full blocks a sparse group caches at all (vLLM's `reachable_block_mask`).

A sliding-window or Mamba group can only ever serve a hit from a few blocks per hit boundary (the
window's tail, or one state), so caching the others would only churn the pool — and, for us,
publish events nobody can use. The mask decides which blocks get a hash, hence which hashes
appear in `BlockStored` (skipped blocks still count in the event's token range).

Retention interval `R` (vLLM's `prefix_cache_retention_interval`):
  None  dense: keep the tail at every alignment boundary (everything for Mamba);
  0     keep only the tails ending at the reachable boundaries (production default);
  R>0   keep one tail per R-token segment, plus the reachable boundaries.
Reachable boundaries are the replay point `num_prompt_tokens - 1` (and a second one with EAGLE)
and the request's shared-prefix junction, each rounded down to the alignment.

`None` returned from a mask function means "every block" (the caller skips the per-block test).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from kvpipe.gpu.finders import sliding_blocks_needed
from kvpipe.gpu.kinds import kind_of
from kvpipe.gpu.specs import KVSpec, SlidingWindow

# A kind's retention rule (its row's `retention` in `kvpipe.gpu.kinds`): `(spec, start_block,
# end_block, alignment, eagle, retention, boundaries)` → the mask, None for every block.
Mask = Callable[[KVSpec, int, int, int | None, bool, int | None, Sequence[int]], list[bool] | None]


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at."""
    if not eagle:
        return (num_prompt_tokens - 1,)
    bs = scheduler_block_size
    resend = (num_prompt_tokens - 1) // bs * bs
    extension = num_prompt_tokens // bs * bs
    return tuple(sorted({max(resend - bs, 0), max(extension - bs, 0)}))


def sliding_mask(spec: KVSpec, start_block: int, end_block: int, alignment: int | None,
                 eagle: bool, retention: int | None, boundaries: Sequence[int]) -> list[bool] | None:
    """The window's tail before each boundary (and per retention segment)."""
    if alignment is None:
        return None
    bs = spec.block_size
    if alignment % bs:
        return None  # a block-granular mask cannot express a sub-block alignment: keep all
    need = sliding_blocks_needed(cast(SlidingWindow, spec).sliding_window, bs, eagle)
    shift = 1 if eagle else 0
    mask = [False] * (end_block - start_block)
    segment = alignment if retention is None else (retention or None)
    if segment is not None:
        per_segment = segment // bs
        if need >= per_segment:
            return None
        lo = per_segment - need
        for i in range(max(start_block, shift), end_block):
            if (i - shift) % per_segment >= lo:
                mask[i - start_block] = True
    if retention is not None:
        for b in boundaries:
            end = (b // alignment * alignment) // bs + shift
            for j in range(max(start_block, end - need), min(end_block, end)):
                mask[j - start_block] = True
    return mask


def mamba_mask(spec: KVSpec, start_block: int, end_block: int, alignment: int | None,
               eagle: bool, retention: int | None, boundaries: Sequence[int]) -> list[bool] | None:
    """The state block ending at each boundary (and per retention segment); EAGLE moves no state."""
    if retention is None or alignment is None:
        return None
    bs = spec.block_size
    mask = [False] * (end_block - start_block)
    if retention:
        per_segment = retention // bs
        if per_segment <= 1:
            return None
        first = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first - start_block, len(mask), per_segment):
            mask[i] = True
    for b in boundaries:
        block = (b // alignment * alignment) // bs - 1
        if start_block <= block < end_block:
            mask[block - start_block] = True
    return mask


def reachable_block_mask(spec: KVSpec, start_block: int, end_block: int, alignment: int | None,
                         eagle: bool = False, retention: int | None = None,
                         boundaries: Sequence[int] = ()) -> list[bool] | None:
    """Mask over blocks `[start_block, end_block)` of the group; None = cache every block."""
    mask = kind_of(spec).retention
    if mask is None:
        return None
    return mask(spec, start_block, end_block, alignment, eagle, retention, boundaries)
