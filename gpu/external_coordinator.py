"""Hits against an external KV pool (a shared store holding `(group, hash)` entries).

The same hybrid search as the node's own cache (`kvpipe.gpu.hit`), over a membership set instead of a
block pool, so an external pool and the GPU agree on what a prefix is worth. Masks tell, per
group, which block slots must actually be loaded: sparse groups (sliding window, Mamba) load only
their tail, full attention loads everything up to the hit.

`load_masks` runs the search over a pool that holds everything, for a length already decided
(no EAGLE drop: the length given is final), which yields exactly the slots each group reads.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence

from kvpipe.gpu.hit import HybridHit, default_alignment, longest_hybrid_hit, split_spec_groups
from kvpipe.gpu.kinds import kind_of
from kvpipe.gpu.retention import reachable_block_mask, replay_boundaries
from kvpipe.gpu.specs import KVSpec, resolve_block_sizes


def validate_external_config(specs: Sequence[KVSpec], *, prefill_context_parallel: int = 1,
                             decode_context_parallel: int = 1) -> None:
    """Reject layouts an external pool cannot serve; one message lists every problem."""
    problems: list[str] = []
    if not any(s.prefix_cacheable for s in specs):
        problems.append("no prefix-cacheable KV cache group")
    for gid, spec in enumerate(specs):
        if not spec.prefix_cacheable:
            problems.append(f"group {gid}: {spec.label} KV is never prefix-cached, so it cannot be shared")
        elif spec.problem is not None:
            problems.append(f"group {gid}: {spec.problem}")
    cp = prefill_context_parallel * decode_context_parallel
    if sum(s.prefix_cacheable for s in specs) > 1 and cp > 1:
        problems.append(f"context parallelism (prefill {prefill_context_parallel} x decode "
                        f"{decode_context_parallel}) with more than one KV cache group")
    if problems:
        raise ValueError("external KV pool does not support this model: " + "; ".join(problems))


class ExternalCoordinator:
    def __init__(self, specs: Sequence[KVSpec], *, eagle_groups: Collection[int] = (),
                 retention: int | None = None, prefix_match_unit: int | None = None,
                 partial_hits: bool = True) -> None:
        """`partial_hits`: whether the serving core resolved fine-grained hits (then, as there,
        hits land on the hash unit when `kvpipe.gpu.hit.partial_hits_enabled`; else on the lcm)."""
        validate_external_config(specs)
        self.specs = list(specs)
        self.scheduler_block_size, self.hash_block_size = resolve_block_sizes(self.specs, prefix_match_unit)
        self.alignment = (default_alignment(self.specs, self.hash_block_size) if partial_hits
                          else self.scheduler_block_size)
        self.eagle_groups = frozenset(eagle_groups)
        self.retention = retention
        split_spec_groups(self.specs)  # fail early on a layout with nothing cacheable

    def find_longest_cache_hit(self, block_hashes: Sequence[bytes], max_length: int,
                               present: Collection[tuple[int, bytes]] | None,
                               apply_eagle: bool = True) -> HybridHit:
        """`present` holds `(group_idx, group-view hash)` pairs; None means "everything"."""
        if present is None:
            def is_cached(g: int, h: bytes) -> bool:
                return True
        else:
            def is_cached(g: int, h: bytes) -> bool:
                return (g, h) in present
        return longest_hybrid_hit(self.specs, block_hashes, self.hash_block_size, is_cached, max_length,
                                  self.alignment, self.eagle_groups if apply_eagle else ())

    def load_masks(self, block_hashes: Sequence[bytes], token_len: int) -> tuple[list[bool], ...]:
        return self.find_longest_cache_hit(block_hashes, token_len, None, apply_eagle=False).masks

    def store_masks(self, aligned_token_len: int, start_token: int = 0,
                    num_prompt_tokens: int | None = None) -> tuple[list[bool] | None, ...]:
        """Per group, which blocks of `[start_token, aligned_token_len)` are worth storing (the ones
        the node's own cache would keep); None = all of them. A kind whose row in `kvpipe.gpu.kinds`
        says `external=False` (Mamba states) never goes through this path."""
        if aligned_token_len % self.scheduler_block_size:
            raise ValueError(f"aligned_token_len {aligned_token_len} is not a multiple of the scheduler "
                             f"block size {self.scheduler_block_size}")
        bounds = () if num_prompt_tokens is None else replay_boundaries(
            num_prompt_tokens, self.scheduler_block_size, bool(self.eagle_groups))
        out: list[list[bool] | None] = []
        for gid, spec in enumerate(self.specs):
            start, end = start_token // spec.block_size, aligned_token_len // spec.block_size
            if not kind_of(spec).external:
                out.append([False] * max(end - start, 0))
                continue
            out.append(reachable_block_mask(spec, start, end, self.scheduler_block_size,
                                            gid in self.eagle_groups, self.retention, bounds))
        return tuple(out)
