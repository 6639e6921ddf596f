"""Layout rules over published group specs: the hash unit vLLM resolves, and layouts it refuses.

Pure arithmetic on `GroupSpec`/`HashConfig` (no hit rules), so the bridge can refuse a declared
layout at start, the processor can flag a node that publishes one, and the GPU side resolves its
own hash unit with the same function (`kvpipe.gpu.specs.resolve_block_sizes`).

Refused, as vLLM 0.33 refuses them (vllm-semantics §2.5, §4.3, §6):
* no prefix-cacheable group (cross-attention alone): nothing on the node could ever be hit;
* a Mamba group not in `align` mode while the node caches (it publishes events);
* a hash unit other than the one vLLM resolves (`resolve_hash_unit`), or an explicit
  `prefix_match_unit` that does not divide every cacheable block;
* EAGLE on a chunked-local group;
* several prefix-cacheable groups with prefill context parallelism > 1, and a cross-attention
  group under a KV store connector (the Mooncake store connector's rules).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from kvpipe.schemas.envelope import KIND_CHUNKED_LOCAL, KIND_CROSS, KIND_MAMBA, GroupSpec, HashConfig

# Kinds that never take part in prefix caching.
NOT_CACHEABLE = frozenset({KIND_CROSS})


def resolve_hash_unit(block_sizes: Sequence[int], cacheable: Sequence[bool], mamba_not_align: bool,
                      prefix_match_unit: int | None = None) -> tuple[int, int]:
    """`(scheduler_block_size, hash_block_size)` vLLM resolves with caching on; ValueError when
    it refuses the explicit unit. One group: both its block size (an explicit unit must equal
    it). Several: the lcm schedules; a Mamba group outside align mode hashes at the lcm too;
    else the explicit unit or the gcd of the cacheable blocks, dividing each of them."""
    if not block_sizes:
        raise ValueError("a model needs at least one KV cache group")
    if prefix_match_unit is not None and prefix_match_unit <= 0:
        raise ValueError(f"prefix_match_unit must be positive, got {prefix_match_unit}")
    if len(block_sizes) == 1:
        bs = block_sizes[0]
        if prefix_match_unit not in (None, bs):
            raise ValueError(f"prefix_match_unit {prefix_match_unit}: with one KV cache group hits land on "
                             f"its block size {bs}; unset it or set it to {bs}")
        return bs, bs
    scheduler = math.lcm(*block_sizes)
    if mamba_not_align:
        return scheduler, scheduler  # vLLM backs off silently, an explicit unit included
    sizes = [bs for bs, c in zip(block_sizes, cacheable) if c] or list(block_sizes)
    unit = prefix_match_unit if prefix_match_unit is not None else math.gcd(*sizes)
    if any(bs % unit for bs in sizes):
        raise ValueError(f"prefix_match_unit {unit}: every prefix-cacheable group block size must be a "
                         f"multiple of it, got {sizes}")
    return scheduler, unit


def layout_problem(group_specs: Sequence[GroupSpec], hash_config: HashConfig | None, *,
                   context_parallel: int = 1, store_connector: bool = False) -> str | None:
    """Why vLLM would refuse this layout; None when it accepts it. `hash_config` None skips the
    hash-unit checks (a bridge may not know it)."""
    if not group_specs:
        return "no group specs"
    ordered = sorted(group_specs, key=lambda gs: gs.group_idx)
    idxs = [gs.group_idx for gs in ordered]
    if len(set(idxs)) != len(idxs):
        return f"group_idx repeated in the group specs: {idxs}"
    cacheable = [gs.kind not in NOT_CACHEABLE for gs in ordered]
    if not any(cacheable):
        return ("no prefix-cacheable KV cache group (cross-attention never takes part in prefix caching): "
                "nothing on this node can be hit")
    for gs in ordered:
        if gs.kind == KIND_MAMBA and (gs.mamba_cache_mode or "align") != "align":
            return (f"group {gs.group_idx}: Mamba prefix caching needs mamba_cache_mode 'align', got "
                    f"{gs.mamba_cache_mode!r} (vLLM refuses to cache it)")
        if gs.kind == KIND_CHUNKED_LOCAL and gs.eagle:
            return f"group {gs.group_idx}: EAGLE with chunked local attention is not supported by vLLM"
    if context_parallel > 1 and sum(cacheable) > 1:
        return (f"{sum(cacheable)} prefix-cacheable KV cache groups with context parallelism {context_parallel}: "
                "vLLM supports several groups only without it")
    if store_connector and not all(cacheable):
        return "a cross-attention group with a KV store connector: vLLM's store connector refuses it"
    if hash_config is not None:
        unit, pmu = hash_config.hash_block_size, hash_config.prefix_match_unit
        if pmu is not None and pmu != unit:
            return f"hash_config: prefix_match_unit {pmu} but hash_block_size {unit}; they must agree"
        bad = [f"group {gs.group_idx} block size {gs.block_size}" for gs, c in zip(ordered, cacheable)
               if c and (unit <= 0 or gs.block_size % unit)]
        if bad:
            return f"{', '.join(bad)} not a multiple of the hash unit {unit}"
        try:
            want = resolve_hash_unit([gs.block_size for gs in ordered], cacheable,
                                     any(gs.kind == KIND_MAMBA and (gs.mamba_cache_mode or "align") != "align"
                                         for gs in ordered), pmu)[1]
        except ValueError as exc:
            return str(exc)
        if unit != want:
            rule = ("its block size (one group)" if len(ordered) == 1 else
                    f"prefix_match_unit {pmu}" if pmu is not None else "the gcd of the cacheable block sizes")
            return f"hash_block_size {unit} is not the unit vLLM uses for these groups: {want}, {rule}"
    return None
