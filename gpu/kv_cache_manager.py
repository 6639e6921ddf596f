"""What a scheduler talks to: look up a request's hit, allocate its slots, free it, take events.

Call order per request, as vLLM's scheduler does it:
  blocks, hit = m.get_computed_blocks(req)            # first time only
  m.allocate_slots(req, n_new, hit, blocks)           # None: not enough free blocks, retry later
  req.num_computed_tokens = hit + n_new               # the scheduler advances the request
  ... later steps: m.allocate_slots(req, n_new)       # running request, no new hits
  m.free(req)
Events accumulate in emission order until `take_events()` (once per step).

`allocate_slots` frees blocks that left a window *before* allocating (so they can be reused in the
same step) and caches every block that becomes full with this step's tokens *before* the forward
pass — which is when vLLM emits `BlockStored`.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import msgspec

from kvpipe.gpu.block_pool import KVBlock
from kvpipe.gpu.coordinator import KVCacheCoordinator
from kvpipe.gpu.hashing import BlockHasher, RequestKeys
from kvpipe.gpu.request import Request
from kvpipe.gpu.specs import KVSpec, Mamba
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.events import BlockStored


class KVCacheManager:
    def __init__(self, specs: Sequence[KVSpec], num_blocks: int, *, enable_caching: bool = True,
                 enable_events: bool = True, retention: int | None = 0,
                 hasher: BlockHasher | None = None, int_hashes: bool = True,
                 eagle_groups: Collection[int] = (), prefix_match_unit: int | None = None) -> None:
        self.coordinator = KVCacheCoordinator(specs, num_blocks, enable_caching=enable_caching,
                                              enable_events=enable_events, retention=retention,
                                              eagle_groups=eagle_groups, int_hashes=int_hashes,
                                              prefix_match_unit=prefix_match_unit)
        self.eagle_groups = frozenset(eagle_groups)
        self.specs = self.coordinator.specs
        self.pool = self.coordinator.pool
        self.enable_caching = enable_caching
        self.hasher = hasher or BlockHasher()
        self.scheduler_block_size = self.coordinator.scheduler_block_size
        self.hash_block_size = self.coordinator.hash_block_size
        self._stamps = [(s.kind, s.window) for s in self.specs]
        mamba = [s.block_size for s in self.specs if isinstance(s, Mamba)]
        self._mamba_block_size: int | None = mamba[0] if mamba else None

    def make_request(self, request_id: str, prompt_token_ids: Sequence[int],
                     keys: RequestKeys | None = None, session_id: str | None = None) -> Request:
        return Request(request_id, prompt_token_ids, self.hasher, self.hash_block_size, keys, session_id)

    def group_specs(self) -> list[GroupSpec]:
        out = [s.to_group_spec(i) for i, s in enumerate(self.specs)]
        return [msgspec.structs.replace(g, eagle=True) if g.group_idx in self.eagle_groups else g for g in out]

    # --- the step API -------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVBlock], ...], int]:
        """The request's local hit, capped at `num_tokens - 1` (the last token is always
        recomputed for its logits). Records the shared-prefix junction on the request."""
        if not self.enable_caching:
            return tuple([] for _ in self.specs), 0
        blocks, hit, uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)
        request.shared_prefix_boundary = hit + uncached if uncached else 0
        return blocks, hit

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: Sequence[Sequence[KVBlock]] | None = None,
                       num_encoder_tokens: int = 0) -> tuple[list[KVBlock], ...] | None:
        if num_new_tokens <= 0 and num_new_computed_tokens <= 0:
            raise ValueError(f"request {request.request_id}: nothing to allocate")
        co = self.coordinator
        rid = request.request_id
        new_computed = new_computed_blocks if new_computed_blocks is not None else tuple(() for _ in self.specs)
        total_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens = total_computed + num_new_tokens
        co.remove_skipped_blocks(rid, total_computed)
        need = co.num_blocks_to_allocate(rid, num_tokens, new_computed, total_computed, num_encoder_tokens)
        if need > self.pool.num_free_blocks:
            return None
        if new_computed_blocks is not None:
            co.add_computed_blocks(rid, new_computed, total_computed)
        new_blocks = co.allocate_new_blocks(rid, num_tokens, num_encoder_tokens)
        co.cache_blocks(request, min(num_tokens, request.num_tokens))
        return new_blocks

    def mamba_aligned_chunk(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0) -> int:
        """Clip a prefill chunk so a Mamba (align) group materialises its states where they can
        be cached: chunk ends on a Mamba block boundary until the prompt's end, and stops at the
        last cacheable boundary `(num_tokens - 1)` floored to the block — to the hash unit when
        partial hits are on, so that state is keyed as a partial entry. No Mamba group: as is.
        (A simplification of vLLM's scheduler rule: no exported checkpoints, junction stops or EAGLE.)"""
        if self._mamba_block_size is None:
            return num_new_tokens
        bs = self._mamba_block_size
        start = request.num_computed_tokens + num_new_computed_tokens
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if start >= prefill_end:
            return num_new_tokens
        end = start + num_new_tokens
        if end < prefill_end and end // bs * bs > start:
            end = end // bs * bs
        unit = self.hash_block_size if self.coordinator.partial_hits else bs
        last_cache = (request.num_tokens - 1) // unit * unit
        if start < last_cache < end:
            end = last_cache
        return end - start

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        return self.coordinator.reset_prefix_cache()

    def evict_blocks(self, block_ids: Collection[int]) -> None:
        self.pool.evict_blocks(block_ids)

    def take_events(self) -> list[Any]:
        """This step's events in emission order; BlockStored stamped with its group's kind/window."""
        events = self.pool.take_events()
        stamps = self._stamps
        for ev in events:
            if type(ev) is BlockStored and ev.group_idx is not None and 0 <= ev.group_idx < len(stamps):
                ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window = stamps[ev.group_idx]
        return events

    @property
    def usage(self) -> float:
        return self.pool.usage()
