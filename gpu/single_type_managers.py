"""Per-attention-type block bookkeeping for one KV cache group: allocate, cache, free, skip.

One manager per group; all managers of a node share one block pool. A manager owns each
request's block table (`req_to_blocks`, null blocks for skipped slots) and how many of its blocks
are already cached (`num_cached_block`), and decides which leading blocks attention no longer
reads (`num_skipped_tokens`) so they can be freed early. Hit *search* is not here: it is the pure
`kvpipe.gpu.hit` module, shared with the router. Which manager a kind gets is its row in
`kvpipe.gpu.kinds` (`make_manager`).

Invariants:
* `num_cached_block[r]` counts leading slots that were cached or deliberately skipped (hit
  blocks, nulls, masked blocks); only blocks past it are offered to the pool for caching.
* Early freeing replaces a block by the null block and frees it; a freed cached block stays
  cached in the free queue until reused (so `BlockRemoved` can come while the request runs).
* Freeing a finished request releases its blocks tail first (tail evicted first).
* Partial entries (fine-grained hits): a hit that ends inside a block shares that block; the
  request gets a private copy (copy-on-write) at its next allocation, and the shared block keeps
  its keys. A full-attention group coarser than the hash unit keys the prompt's last hash-unit
  boundary inside its block; a Mamba group keys the state at that boundary (the scheduler stops a
  prefill chunk there, `KVCacheManager.mamba_aligned_chunk`).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvpipe.gpu.block_pool import BlockPool, KVBlock
from kvpipe.gpu.finders import cdiv
from kvpipe.gpu.kinds import kind_of
from kvpipe.gpu.retention import reachable_block_mask
from kvpipe.gpu.specs import ChunkedLocal, KVSpec, SlidingWindow


class SingleTypeManager:
    def __init__(self, spec: KVSpec, pool: BlockPool, group_idx: int, alignment: int,
                 eagle: bool = False) -> None:
        self.spec = spec
        self.pool = pool
        self.group_idx = group_idx
        self.block_size = spec.block_size
        self.alignment = alignment  # where hits land; the masks need it
        self.eagle = eagle
        self.null = pool.null_block
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        # request -> slot of a shared block its hit ends inside (copied on its next allocation)
        self.partial_hits: dict[str, int] = {}

    # --- allocation ---------------------------------------------------------------------------

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens attention will not read again (0: keep everything)."""
        return 0

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               new_computed: Sequence[KVBlock], total_computed_tokens: int) -> int:
        required = cdiv(num_tokens, self.block_size)
        have = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:  # running: no new hits
            return max(required - have, 0)
        skipped = self.num_skipped_tokens(total_computed_tokens) // self.block_size
        new = max(required - max(skipped, len(new_computed) + have), 0)
        start = max(0, skipped - have)
        # Touching a hit block that sits in the free queue takes it out: count it too.
        evictable = sum(1 for b in new_computed[start:] if b.ref_cnt == 0 and not b.is_null)
        return new + evictable + self._cow_blocks(new_computed, total_computed_tokens)

    def _cow_blocks(self, new_computed: Sequence[KVBlock], num_computed_tokens: int) -> int:
        """1 when the hit ends inside a block (a partial entry): that block is copied."""
        return 1 if new_computed and num_computed_tokens % self.block_size else 0

    def add_computed_blocks(self, request_id: str, new_computed: Sequence[KVBlock],
                            num_computed_tokens: int) -> None:
        """Adopt a fresh request's hit blocks (those inside the window), nulls before them."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not blocks, f"request {request_id} already has blocks in group {self.group_idx}"
        skipped = self.num_skipped_tokens(num_computed_tokens) // self.block_size
        kept = new_computed[skipped:]
        self.pool.touch(kept)
        blocks.extend([self.null] * skipped)
        blocks.extend(kept)
        self.num_cached_block[request_id] = len(blocks)
        if kept and num_computed_tokens % self.block_size:
            # The hit ends inside its last block: cache that slot again once the copy is full.
            idx = num_computed_tokens // self.block_size
            self.partial_hits[request_id] = idx
            self.num_cached_block[request_id] = idx

    def _copy_on_write(self, request_id: str, blocks: list[KVBlock]) -> list[KVBlock]:
        """Give the request a private copy of the shared block its partial hit ends in; the shared
        one keeps its keys (released to the free queue, still cached)."""
        idx = self.partial_hits.pop(request_id, None)
        if idx is None or idx >= len(blocks) or blocks[idx].is_null:
            return []
        copy = self.pool.get_new_blocks(1)
        self.pool.free_blocks([blocks[idx]])
        blocks[idx] = copy[0]
        return copy

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        copied = self._copy_on_write(request_id, blocks)
        n = cdiv(num_tokens, self.block_size) - len(blocks)
        if n <= 0:
            return copied
        new = self.pool.get_new_blocks(n)
        blocks.extend(new)
        return copied + new

    # --- caching ------------------------------------------------------------------------------

    def cache_blocks(self, request: Any, num_tokens: int, retention: int | None,
                     boundaries: Sequence[int]) -> None:
        if not self.spec.prefix_cacheable:
            return
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        hashed_tokens = len(request.block_hashes) * self.pool.hash_block_size
        num_full = min(num_tokens, hashed_tokens) // self.block_size
        if num_cached >= num_full:
            return
        reachable = list(boundaries)
        if request.shared_prefix_boundary:
            reachable.append(request.shared_prefix_boundary)
            if self.eagle:
                reachable.append(request.shared_prefix_boundary - self.block_size)
        mask = reachable_block_mask(self.spec, num_cached, num_full, self.alignment, self.eagle,
                                    retention, reachable)
        self.pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full,
                                    self.block_size, self.group_idx, mask)
        self.num_cached_block[rid] = num_full

    # --- freeing ------------------------------------------------------------------------------

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.partial_hits.pop(request_id, None)
        start = 0
        while start < len(blocks) and blocks[start].is_null:
            start += 1
        self.pool.free_blocks(reversed(blocks[start:]))

    def remove_skipped_blocks(self, request_id: str, processed_tokens: int) -> None:
        skipped = self.num_skipped_tokens(processed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        self._null_range(request_id, blocks, min(skipped // self.block_size, len(blocks)))

    def _null_range(self, request_id: str, blocks: list[KVBlock], end: int) -> None:
        """Free blocks `[.., end)` going backwards, stopping at the first null (already freed)."""
        freed: list[KVBlock] = []
        for i in range(end - 1, -1, -1):
            if blocks[i].is_null:
                break
            freed.append(blocks[i])
            blocks[i] = self.null
        if freed:
            self.pool.free_blocks(freed)


class FullAttentionManager(SingleTypeManager):
    def cache_blocks(self, request: Any, num_tokens: int, retention: int | None,
                     boundaries: Sequence[int]) -> None:
        super().cache_blocks(request, num_tokens, retention, boundaries)
        unit = self.pool.hash_block_size
        if self.block_size == unit:
            return
        # The prompt's last hash-unit boundary, when it ends inside a block: a resend reuses up
        # to `prompt - 1` tokens (EAGLE reads the whole prompt before dropping a unit).
        limit = request.num_prompt_tokens if self.eagle else request.num_prompt_tokens - 1
        boundary = min(limit // unit, len(request.block_hashes)) * unit
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        idx = boundary // self.block_size
        if idx < len(blocks):
            self.pool.cache_partial_block(request, blocks[idx], boundary, self.group_idx, self.block_size)


class SlidingWindowManager(SingleTypeManager):
    """Tokens before `processed - window + 1` are never read again: their blocks go early."""

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - cast(SlidingWindow, self.spec).sliding_window + 1)


class ChunkedLocalManager(SingleTypeManager):
    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        chunk = cast(ChunkedLocal, self.spec).attention_chunk_size
        return num_computed_tokens // chunk * chunk


class MambaAlignManager(SingleTypeManager):
    """Mamba in align mode: a request holds one live state block, at the slot of its latest
    block end; earlier slots are null except the previous state (kept one step to copy from).

    Each block end reached by a step leaves its state in that block, which is what gets cached,
    so a Mamba group publishes one hash per state it kept (dense retention: every step's state).
    With a block larger than the hash unit, the state at the prompt's last hash-unit boundary is
    keyed as a partial entry of its block (the chunk stopped there); the next step would overwrite
    it, so the request continues in a private copy.
    Not reproduced: speculative-decoding blocks, exported prefill checkpoints, shared-prefix
    junction checkpoints and the same-step hit deferral for freshly written states.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.spec.problem is not None:
            raise ValueError(f"group {self.group_idx}: {self.spec.problem}")
        self.last_state_idx: dict[str, int] = {}
        self.retired: dict[str, int] = {}

    def num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               new_computed: Sequence[KVBlock], total_computed_tokens: int) -> int:
        new = cdiv(num_tokens, self.block_size) - len(new_computed) - len(self.req_to_blocks.get(request_id, ()))
        evictable = sum(1 for b in new_computed if b.ref_cnt == 0 and not b.is_null)
        cow = (self._cow_blocks(new_computed, total_computed_tokens)
               if request_id not in self.num_cached_block else int(request_id in self.partial_hits))
        return min(max(new, 0), 1) + evictable + cow

    def cache_blocks(self, request: Any, num_tokens: int, retention: int | None,
                     boundaries: Sequence[int]) -> None:
        super().cache_blocks(request, num_tokens, retention, boundaries)
        unit = self.pool.hash_block_size
        if self.block_size <= unit or num_tokens <= 0 or num_tokens % unit:
            return
        # The prompt's reusable boundary: `prompt - 1` floored to the unit (the state's hash needs
        # those tokens; a resend recomputes at least the last one).
        if num_tokens != (request.num_prompt_tokens - 1) // unit * unit:
            return
        rid = request.request_id
        idx = cdiv(num_tokens, self.block_size) - 1
        blocks = self.req_to_blocks[rid]
        if idx >= len(blocks) or blocks[idx].is_null or blocks[idx].key_tokens == num_tokens:
            return
        self.pool.cache_partial_block(request, blocks[idx], num_tokens, self.group_idx, self.block_size)
        if num_tokens % self.block_size:
            self.partial_hits[rid] = idx  # the next step continues in a copy
            self.num_cached_block[rid] = idx

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        copied = self._copy_on_write(request_id, blocks)
        required = cdiv(num_tokens, self.block_size)
        if required <= len(blocks):
            return copied
        if blocks:
            self.last_state_idx[request_id] = len(blocks) - 1
        if len(blocks) < required - 1:
            blocks.extend([self.null] * (required - 1 - len(blocks)))
        new = self.pool.get_new_blocks(required - len(blocks))
        blocks.extend(new)
        return copied + new

    def remove_skipped_blocks(self, request_id: str, processed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        end = min(max(processed_tokens - 1, 0) // self.block_size, len(blocks))
        start = self.retired.get(request_id, 0)
        if start < end:
            freed = []
            for i in range(end - 1, start - 1, -1):  # null gaps between states are skipped
                if not blocks[i].is_null:
                    freed.append(blocks[i])
                    blocks[i] = self.null
            if freed:
                self.pool.free_blocks(freed)
            self.retired[request_id] = end
        last = self.last_state_idx.get(request_id)
        if last is not None and last < cdiv(processed_tokens, self.block_size) - 1 and not blocks[last].is_null:
            self.pool.free_blocks([blocks[last]])
            blocks[last] = self.null

    def free(self, request_id: str) -> None:
        self.last_state_idx.pop(request_id, None)
        self.retired.pop(request_id, None)
        super().free(request_id)


class CrossAttentionManager(SingleTypeManager):
    """Encoder KV for one request: allocated from the encoder length, never cached or hit."""

    def cache_blocks(self, request: Any, num_tokens: int, retention: int | None,
                     boundaries: Sequence[int]) -> None:
        return None


def make_manager(spec: KVSpec, pool: BlockPool, group_idx: int, alignment: int,
                 eagle: bool = False) -> SingleTypeManager:
    """The manager of `spec`'s kind (its row in `kvpipe.gpu.kinds`)."""
    try:
        cls = kind_of(spec).manager
    except ValueError as exc:
        raise ValueError(f"group {group_idx}: no manager for {type(spec).__name__} ({exc})") from None
    return cls(spec, pool, group_idx, alignment, eagle)
