"""KV cache group specs: what kind of attention a group serves and at which block size.

Specs are frozen values: two groups with *equal* specs are merged by the coordinator and looked up
together (a block hits only if every member group holds it), exactly as vLLM merges equal
`KVCacheSpec`s. Equality therefore includes every field that changes hit semantics.

Block-size arithmetic (`resolve_block_sizes`): the scheduler block is the lcm of all group block
sizes (hits and hybrid caching land on it); the hash unit is the gcd of the prefix-cacheable
groups' block sizes (every group's block is a whole number of hash units). One group: both equal
its block size.

What each kind does (manager, hit rule, retention, offload) is its row in `kvpipe.gpu.kinds`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpipe.gpu.kinds import hit_rule, read_as
from kvpipe.schemas.envelope import (
    KIND_CHUNKED_LOCAL,
    KIND_CROSS,
    KIND_FULL,
    KIND_MAMBA,
    KIND_SINK_FULL,
    KIND_SLIDING,
    GroupSpec,
)
from kvpipe.schemas.layout import resolve_hash_unit


@dataclass(frozen=True, slots=True)
class KVSpec:
    """A group's spec. What kvpipe does for each kind (manager, hit rule, retention, offload) is the
    row of `kind` in `kvpipe.gpu.kinds.KINDS`; the class holds the fields and their wire form."""

    block_size: int

    kind = "unknown"
    label = "unknown"  # how a message names the kind

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"{type(self).__name__}: block_size must be positive, got {self.block_size}")

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the kind takes part in prefix caching at all (it has a hit rule)."""
        return hit_rule(self) is not None

    @property
    def problem(self) -> str | None:
        """Why a group with this spec cannot be prefix-cached as declared (None: it can)."""
        return None

    @property
    def window(self) -> int | None:
        """Sliding window in tokens (published as kv_cache_spec_sliding_window), else None."""
        return None

    def to_group_spec(self, group_idx: int) -> GroupSpec:
        return GroupSpec(group_idx=group_idx, kind=self.kind, block_size=self.block_size,
                         sliding_window=self.window)

    @classmethod
    def from_group_spec(cls, gs: GroupSpec) -> KVSpec:
        """The spec of a published group whose kind reads as this class (`kvpipe.gpu.kinds.read_as`)."""
        return cls(gs.block_size)


@dataclass(frozen=True, slots=True)
class FullAttention(KVSpec):
    kind = KIND_FULL
    label = "full attention"


@dataclass(frozen=True, slots=True)
class SinkFullAttention(FullAttention):
    """Full attention behind `sink_len` tokens of static sink KV (vLLM's `SinkFullAttentionSpec`).

    The sink's KV is the model's, kept outside every request's blocks, so blocks, hits, retention and
    offload are full attention's; the kind stays its own (published as `sink_full_attention`, never
    merged with a plain full-attention group). vLLM requires the sink to fill whole blocks; it does
    not publish `sink_len`, so a group read from the wire may not know it (None)."""

    sink_len: int | None = None

    kind = KIND_SINK_FULL
    label = "sink full attention"

    def __post_init__(self) -> None:
        KVSpec.__post_init__(self)
        if self.sink_len is not None and (self.sink_len <= 0 or self.sink_len % self.block_size):
            raise ValueError(f"SinkFullAttention: sink_len must be a positive multiple of block_size "
                             f"{self.block_size}, got {self.sink_len}")

    def to_group_spec(self, group_idx: int) -> GroupSpec:
        return GroupSpec(group_idx=group_idx, kind=self.kind, block_size=self.block_size, sink_len=self.sink_len)

    @classmethod
    def from_group_spec(cls, gs: GroupSpec) -> KVSpec:
        return cls(gs.block_size, gs.sink_len)


@dataclass(frozen=True, slots=True)
class SlidingWindow(KVSpec):
    sliding_window: int = 0

    kind = KIND_SLIDING
    label = "sliding window"

    def __post_init__(self) -> None:
        KVSpec.__post_init__(self)
        if self.sliding_window <= 0:
            raise ValueError(f"SlidingWindow: sliding_window must be positive, got {self.sliding_window}")

    @property
    def window(self) -> int:
        return self.sliding_window

    @classmethod
    def from_group_spec(cls, gs: GroupSpec) -> KVSpec:
        if not gs.sliding_window:
            raise ValueError(f"group {gs.group_idx}: {gs.kind} without sliding_window")
        return cls(gs.block_size, gs.sliding_window)


@dataclass(frozen=True, slots=True)
class Mamba(KVSpec):
    """A state-space group; prefix caching needs `mode="align"` (one state per block end)."""

    mode: str = "align"

    kind = KIND_MAMBA
    label = "Mamba"

    @property
    def problem(self) -> str | None:
        if self.mode == "align":
            return None
        return f"Mamba mode {self.mode!r}: prefix caching needs mode 'align' (one state per block end)"

    def to_group_spec(self, group_idx: int) -> GroupSpec:
        return GroupSpec(group_idx=group_idx, kind=self.kind, block_size=self.block_size,
                         mamba_cache_mode=self.mode)

    @classmethod
    def from_group_spec(cls, gs: GroupSpec) -> KVSpec:
        # A node that publishes Mamba blocks caches them, which vLLM allows only in "align" mode.
        return cls(gs.block_size, gs.mamba_cache_mode or "align")


@dataclass(frozen=True, slots=True)
class ChunkedLocal(KVSpec):
    attention_chunk_size: int = 0

    kind = KIND_CHUNKED_LOCAL
    label = "chunked local attention"

    def __post_init__(self) -> None:
        KVSpec.__post_init__(self)
        if self.attention_chunk_size <= 0:
            raise ValueError("ChunkedLocal: attention_chunk_size must be positive")

    def to_group_spec(self, group_idx: int) -> GroupSpec:
        return GroupSpec(group_idx=group_idx, kind=self.kind, block_size=self.block_size,
                         attention_chunk_size=self.attention_chunk_size)

    @classmethod
    def from_group_spec(cls, gs: GroupSpec) -> KVSpec:
        if not gs.attention_chunk_size:
            raise ValueError(f"group {gs.group_idx}: {gs.kind} without attention_chunk_size")
        return cls(gs.block_size, gs.attention_chunk_size)


@dataclass(frozen=True, slots=True)
class CrossAttention(KVSpec):
    """Encoder-decoder cross attention: per-request encoder KV, never prefix-cached (no hit rule)."""

    kind = KIND_CROSS
    label = "cross-attention"


def resolve_block_sizes(specs: Sequence[KVSpec], prefix_match_unit: int | None = None
                        ) -> tuple[int, int]:
    """`(scheduler_block_size, hash_block_size)` for a model with these groups (caching on).

    `prefix_match_unit` is an explicit hash unit (vLLM's `--prefix-match-unit`): hybrid models
    hash at it instead of the gcd, provided every prefix-cacheable block is a whole number of
    units; a one-group model accepts only its own block size (its hits land on the block). The
    rule itself is `kvpipe.schemas.layout.resolve_hash_unit`, shared with the bridge and processor;
    a group that cannot cache as declared (`KVSpec.problem`: Mamba outside align mode) makes vLLM
    hash at the lcm."""
    return resolve_hash_unit([s.block_size for s in specs], [s.prefix_cacheable for s in specs],
                             any(s.problem is not None for s in specs), prefix_match_unit)


def from_group_spec(gs: GroupSpec) -> KVSpec:
    """The spec a published `GroupSpec` describes, for computing hits (the reverse of
    `KVSpec.to_group_spec`). Raises ValueError for a kind whose hit rule is unknown or a spec
    missing the field its rule needs — a caller must not guess a hit from it.

    Kinds another row `reads` (`kvpipe.gpu.kinds`) map to that row's class, so two groups differing
    only in that would merge here but not in vLLM; for full attention and sliding windows the hit is
    the same either way (a merged lookup accepts a length exactly when every member does)."""
    row = read_as(gs.kind)
    if row is None:
        raise ValueError(f"group {gs.group_idx}: no hit rule for kind {gs.kind!r}")
    return row.spec_class.from_group_spec(gs)
