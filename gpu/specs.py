"""KV cache group specs: what kind of attention a group serves and at which block size.

Specs are frozen values: two groups with *equal* specs are merged by the coordinator and looked up
together (a block hits only if every member group holds it), exactly as vLLM merges equal
`KVCacheSpec`s. Equality therefore includes every field that changes hit semantics.

Block-size arithmetic (`resolve_block_sizes`): the scheduler block is the lcm of all group block
sizes (hits and hybrid caching land on it); the hash unit is the gcd of the prefix-cacheable
groups' block sizes (every group's block is a whole number of hash units). One group: both equal
its block size.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.schemas.layout import resolve_hash_unit
from kvpipe.schemas.envelope import (
    KIND_CHUNKED_LOCAL,
    KIND_CROSS,
    KIND_FULL,
    KIND_MAMBA,
    KIND_MLA,
    KIND_SINK_FULL,
    KIND_SLIDING,
    KIND_SLIDING_MLA,
    GroupSpec,
)


@dataclass(frozen=True, slots=True)
class KVSpec:
    block_size: int

    kind = "unknown"
    prefix_cacheable = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"{type(self).__name__}: block_size must be positive, got {self.block_size}")

    @property
    def window(self) -> int | None:
        """Sliding window in tokens (published as kv_cache_spec_sliding_window), else None."""
        return None

    def to_group_spec(self, group_idx: int) -> GroupSpec:
        return GroupSpec(group_idx=group_idx, kind=self.kind, block_size=self.block_size,
                         sliding_window=self.window)


@dataclass(frozen=True, slots=True)
class FullAttention(KVSpec):
    kind = KIND_FULL


@dataclass(frozen=True, slots=True)
class SlidingWindow(KVSpec):
    sliding_window: int = 0

    kind = KIND_SLIDING

    def __post_init__(self) -> None:
        KVSpec.__post_init__(self)
        if self.sliding_window <= 0:
            raise ValueError(f"SlidingWindow: sliding_window must be positive, got {self.sliding_window}")

    @property
    def window(self) -> int:
        return self.sliding_window


@dataclass(frozen=True, slots=True)
class Mamba(KVSpec):
    """A state-space group; prefix caching needs `mode="align"` (one state per block end)."""

    mode: str = "align"

    kind = KIND_MAMBA

    def to_group_spec(self, group_idx: int) -> GroupSpec:
        return GroupSpec(group_idx=group_idx, kind=self.kind, block_size=self.block_size,
                         mamba_cache_mode=self.mode)


@dataclass(frozen=True, slots=True)
class ChunkedLocal(KVSpec):
    attention_chunk_size: int = 0

    kind = KIND_CHUNKED_LOCAL

    def __post_init__(self) -> None:
        KVSpec.__post_init__(self)
        if self.attention_chunk_size <= 0:
            raise ValueError("ChunkedLocal: attention_chunk_size must be positive")

    def to_group_spec(self, group_idx: int) -> GroupSpec:
        return GroupSpec(group_idx=group_idx, kind=self.kind, block_size=self.block_size,
                         attention_chunk_size=self.attention_chunk_size)


@dataclass(frozen=True, slots=True)
class CrossAttention(KVSpec):
    """Encoder-decoder cross attention: per-request encoder KV, never prefix-cached."""

    kind = KIND_CROSS
    prefix_cacheable = False


def resolve_block_sizes(specs: Sequence[KVSpec], prefix_match_unit: int | None = None
                        ) -> tuple[int, int]:
    """`(scheduler_block_size, hash_block_size)` for a model with these groups (caching on).

    `prefix_match_unit` is an explicit hash unit (vLLM's `--prefix-match-unit`): hybrid models
    hash at it instead of the gcd, provided every prefix-cacheable block is a whole number of
    units; a one-group model accepts only its own block size (its hits land on the block). The
    rule itself is `kvpipe.schemas.layout.resolve_hash_unit`, shared with the bridge and processor."""
    return resolve_hash_unit([s.block_size for s in specs], [s.prefix_cacheable for s in specs],
                             any(isinstance(s, Mamba) and s.mode != "align" for s in specs), prefix_match_unit)


# Kinds whose hit rule is full attention's (vLLM: MLA and sink subclasses use the same manager).
_FULL_KINDS = frozenset({KIND_FULL, KIND_MLA, KIND_SINK_FULL})
_SLIDING_KINDS = frozenset({KIND_SLIDING, KIND_SLIDING_MLA})


def from_group_spec(gs: GroupSpec) -> KVSpec:
    """The spec a published `GroupSpec` describes, for computing hits (the reverse of
    `KVSpec.to_group_spec`). Raises ValueError for a kind whose hit rule is unknown or a spec
    missing the field its rule needs — a caller must not guess a hit from it.

    MLA/sink kinds map to their rule's class, so two groups differing only in that would merge
    here but not in vLLM; for full attention and sliding windows the hit is the same either way
    (a merged lookup accepts a length exactly when every member does)."""
    if gs.kind in _FULL_KINDS:
        return FullAttention(gs.block_size)
    if gs.kind in _SLIDING_KINDS:
        if not gs.sliding_window:
            raise ValueError(f"group {gs.group_idx}: {gs.kind} without sliding_window")
        return SlidingWindow(gs.block_size, gs.sliding_window)
    if gs.kind == KIND_MAMBA:
        # A node that publishes Mamba blocks caches them, which vLLM allows only in "align" mode.
        return Mamba(gs.block_size, gs.mamba_cache_mode or "align")
    if gs.kind == KIND_CHUNKED_LOCAL:
        if not gs.attention_chunk_size:
            raise ValueError(f"group {gs.group_idx}: {gs.kind} without attention_chunk_size")
        return ChunkedLocal(gs.block_size, gs.attention_chunk_size)
    if gs.kind == KIND_CROSS:
        return CrossAttention(gs.block_size)
    raise ValueError(f"group {gs.group_idx}: no hit rule for kind {gs.kind!r}")
