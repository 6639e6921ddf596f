"""The coordinator: one node's groups, their managers and the shared pool, seen as one cache.

It only coordinates — lookups go to `kvpipe.gpu.hit.find_hit` (the function the router also runs) with
lookups into the pool, and per-group work goes to the managers.

Decisions (vLLM 0.33's HybridKVCacheCoordinator):
* Hits land on the scheduler block (lcm of group block sizes). For hybrid models the amount
  offered for caching is rounded down to it as well, so no group caches a block that could only
  serve a hit at an unreachable length (a SWA bs16 group next to an FA bs32 group caches hashes
  0-5 of a 112-token prompt, not 0-6). One group: no rounding (its block is the scheduler block).
* Equal specs are merged and looked up together; cross-attention groups take no part.
* Fine-grained (partial) hits: when `kvpipe.gpu.hit.partial_hits_enabled` (a Mamba align group coarser
  than the hash unit), hits land on the hash unit and nothing offered for caching is rounded
  (partial entries sit inside blocks). The hash unit may be given explicitly below the gcd
  (`prefix_match_unit`).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from kvpipe.gpu.block_pool import BlockPool, KVBlock
from kvpipe.gpu.hit import Lookup, SpecGroup, ViewCache, find_hit, partial_hits_enabled, split_spec_groups
from kvpipe.gpu.retention import replay_boundaries
from kvpipe.gpu.single_type_managers import SingleTypeManager, make_manager
from kvpipe.gpu.specs import KVSpec, resolve_block_sizes


class KVCacheCoordinator:
    def __init__(self, specs: Sequence[KVSpec], num_blocks: int, *, enable_caching: bool = True,
                 enable_events: bool = False, retention: int | None = 0,
                 eagle_groups: Collection[int] = (), int_hashes: bool = True,
                 prefix_match_unit: int | None = None) -> None:
        self.specs = list(specs)
        self.scheduler_block_size, self.hash_block_size = resolve_block_sizes(self.specs, prefix_match_unit)
        self.prefix_match_unit = prefix_match_unit
        self.partial_hits = enable_caching and partial_hits_enabled(self.specs, self.hash_block_size)
        self.alignment = self.hash_block_size if self.partial_hits else self.scheduler_block_size
        self.hybrid = len(self.specs) > 1
        self.enable_caching = enable_caching
        if retention is not None and (retention < 0 or retention % self.scheduler_block_size):
            raise ValueError(f"retention interval {retention} must be 0, None, or a positive multiple "
                             f"of the scheduler block size {self.scheduler_block_size}")
        self.retention = retention
        self.eagle = bool(eagle_groups)
        self.pool = BlockPool(num_blocks, self.hash_block_size, enable_caching, enable_events,
                              int_hashes)
        self.managers: list[SingleTypeManager] = [
            make_manager(spec, self.pool, gid, self.alignment, gid in eagle_groups)
            for gid, spec in enumerate(self.specs)]
        self.spec_groups: list[SpecGroup] = split_spec_groups(self.specs, eagle_groups) if enable_caching else []
        self._lookups: list[Lookup] = [self._make_lookup(sg) for sg in self.spec_groups]

    def _make_lookup(self, sg: SpecGroup) -> Lookup:
        pool = self.pool
        if len(sg.group_ids) == 1:
            suffix = sg.group_ids[0].to_bytes(4, "big")
            get = pool.get_one_block
            return lambda h: get(h + suffix)
        ids = list(sg.group_ids)
        return lambda h: pool.get_cached_block(h, ids)

    # --- hits ---------------------------------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int
                               ) -> tuple[tuple[list[KVBlock], ...], int, int]:
        """`(hit blocks per group, hit length, uncached common prefix length)`; the last is how
        far some single group's hit reaches past the combined hit (0 if none)."""
        per_group: list[list[KVBlock]] = [[] for _ in self.specs]
        if not self.spec_groups:
            return tuple(per_group), 0, 0
        found, hit, longest = find_hit(self.spec_groups, ViewCache(block_hashes, self.hash_block_size),
                                       self._lookups, max_length, self.alignment)
        null = self.pool.null_block
        for sg, blocks in zip(self.spec_groups, found):
            if len(sg.group_ids) == 1:
                per_group[sg.group_ids[0]] = [b if b is not None else null for b in blocks]
            else:
                for j, gid in enumerate(sg.group_ids):
                    per_group[gid] = [b[j] if b is not None else null for b in blocks]
        return tuple(per_group), hit, longest - hit

    # --- allocation ---------------------------------------------------------------------------

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                               new_computed: Sequence[Sequence[KVBlock]], total_computed: int,
                               num_encoder_tokens: int = 0) -> int:
        total = 0
        for gid, m in enumerate(self.managers):
            if m.spec.prefix_cacheable:
                total += m.num_blocks_to_allocate(request_id, num_tokens, new_computed[gid], total_computed)
            else:
                total += m.num_blocks_to_allocate(request_id, num_encoder_tokens, (), 0)
        return total

    def add_computed_blocks(self, request_id: str, new_computed: Sequence[Sequence[KVBlock]],
                            num_computed_tokens: int) -> None:
        if any(request_id in m.num_cached_block for m in self.managers):
            return  # running request: no new hits
        for gid, m in enumerate(self.managers):
            m.add_computed_blocks(request_id, new_computed[gid], num_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_encoder_tokens: int = 0) -> tuple[list[KVBlock], ...]:
        return tuple(m.allocate_new_blocks(request_id, num_tokens if m.spec.prefix_cacheable
                                           else num_encoder_tokens) for m in self.managers)

    def remove_skipped_blocks(self, request_id: str, processed_tokens: int) -> None:
        for m in self.managers:
            m.remove_skipped_blocks(request_id, processed_tokens)

    # --- caching and freeing ------------------------------------------------------------------

    def num_cacheable_tokens(self, num_tokens: int, manager: SingleTypeManager) -> int:
        if not self.hybrid or self.partial_hits:
            return num_tokens
        aligned = num_tokens // self.scheduler_block_size * self.scheduler_block_size
        if manager.eagle and aligned > 0:  # EAGLE matches one block past the boundary, then drops it
            return min(num_tokens, aligned + manager.block_size)
        return aligned

    def cache_blocks(self, request: Any, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        bounds = replay_boundaries(request.num_prompt_tokens, self.scheduler_block_size, self.eagle)
        for m in self.managers:
            m.cache_blocks(request, self.num_cacheable_tokens(num_tokens, m), self.retention, bounds)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def block_table(self, request_id: str) -> tuple[list[KVBlock], ...]:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)
