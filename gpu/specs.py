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

import math
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.envelope import (
    KIND_CHUNKED_LOCAL,
    KIND_CROSS,
    KIND_FULL,
    KIND_MAMBA,
    KIND_SLIDING,
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


def resolve_block_sizes(specs: Sequence[KVSpec]) -> tuple[int, int]:
    """`(scheduler_block_size, hash_block_size)` for a model with these groups (caching on)."""
    if not specs:
        raise ValueError("a model needs at least one KV cache group")
    sizes = [s.block_size for s in specs]
    if len(specs) == 1:
        return sizes[0], sizes[0]
    scheduler = math.lcm(*sizes)
    if any(isinstance(s, Mamba) and s.mode != "align" for s in specs):
        return scheduler, scheduler
    cacheable = [s.block_size for s in specs if s.prefix_cacheable] or sizes
    return scheduler, math.gcd(*cacheable)
