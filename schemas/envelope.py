"""kvpipe's envelope: one Kafka message = one node step (or one heartbeat).

The envelope is a msgpack **map** (field names on the wire) so it can grow: within a major
version, new fields are optional and appended; old readers ignore unknown keys, new readers fill
defaults. The vLLM event batch rides inside it as raw msgpack (`batch`), exactly the bytes vLLM's
encoder produces (`KVEventBatch`), so a vLLM consumer can decode it unchanged and the bridge can
forward a real node's payload without re-encoding it.

Ordering contract: per node, envelopes are applied in `(epoch, seq)` order. `epoch` identifies one
incarnation of the node's cache (a larger epoch means the previous cache is gone); `seq` is
contiguous from 0 within an epoch. Group specs and the hash config travel at least on the first
envelope of an epoch (seq 0) and periodically after that.
"""
from __future__ import annotations

from typing import NamedTuple

import msgspec

SCHEMA_MAJOR = 1

# Spec kinds as vLLM names them (KVCacheSpecKind).
KIND_FULL = "full_attention"
KIND_MLA = "mla_attention"
KIND_SLIDING = "sliding_window"
KIND_SLIDING_MLA = "sliding_window_mla"
KIND_MAMBA = "mamba"
KIND_CHUNKED_LOCAL = "chunked_local_attention"
KIND_SINK_FULL = "sink_full_attention"
KIND_ENCODER_ONLY = "encoder_only_attention"
KIND_CROSS = "cross_attention"
KIND_UNKNOWN = "unknown"
KNOWN_KINDS = frozenset(
    {KIND_FULL, KIND_MLA, KIND_SLIDING, KIND_SLIDING_MLA, KIND_MAMBA, KIND_CHUNKED_LOCAL,
     KIND_SINK_FULL, KIND_ENCODER_ONLY, KIND_CROSS, KIND_UNKNOWN}
)


class KindParam(NamedTuple):
    """The one number a kind's group carries beside its block size (the `--groups` grammar's third item)."""

    field: str  # the GroupSpec field holding it
    words: str  # how a message names it
    placeholder: str  # how the grammar names it
    required: bool = True  # False: a group of the kind may leave it out


# Kinds with a parameter, as data, for the grammar (`kvpipe.schemas.groupspec`); what each kind does
# is the GPU side's (`kvpipe.gpu.kinds`).
KIND_PARAMS: dict[str, KindParam] = {
    KIND_SLIDING: KindParam("sliding_window", "window", "WINDOW"),
    KIND_SLIDING_MLA: KindParam("sliding_window", "window", "WINDOW"),
    KIND_CHUNKED_LOCAL: KindParam("attention_chunk_size", "chunk size", "CHUNK"),
    KIND_SINK_FULL: KindParam("sink_len", "sink length", "SINK_LEN", required=False),
}
# Fields every group of a kind declares with one value: a Mamba group that caches is in align mode.
KIND_FIXED: dict[str, dict[str, str]] = {KIND_MAMBA: {"mamba_cache_mode": "align"}}


class GroupSpec(msgspec.Struct, omit_defaults=True):
    """One KV cache group of a node (vLLM's `kv_cache_groups[group_idx]`)."""

    group_idx: int
    kind: str
    block_size: int  # tokens per block of this group
    sliding_window: int | None = None  # tokens, sliding-window kinds
    attention_chunk_size: int | None = None  # tokens, chunked-local attention
    mamba_cache_mode: str | None = None  # "align" | "all" | "none", Mamba groups
    num_layers: int | None = None
    # Added in v1 (additive): the group serves an EAGLE draft, so its hit drops the last matched
    # block (or hash unit when partial hits are on) before the generation point.
    eagle: bool = False
    # Added in v1 (additive): tokens of static sink KV a sink-full-attention group keeps outside the
    # requests' blocks (a multiple of block_size). vLLM does not publish it: None when not declared.
    sink_len: int | None = None


class HashConfig(msgspec.Struct, omit_defaults=True):
    """How the node computes block hashes, so a router can recompute them from token ids."""

    algorithm: str = "sha256"  # sha256 | sha256_cbor | xxhash | xxhash_cbor
    hash_block_size: int = 16  # tokens per hash unit (gcd of group block sizes for hybrid models)
    # Seed rule for NONE_HASH: "default" (the constant "vllm-none-hash"), "pythonhashseed"
    # (the seed string below), "random" (per-process, not reproducible).
    none_hash_seed_rule: str = "default"
    none_hash_seed: str | None = None
    int_hashes: bool = True  # external form: last 8 bytes as int (True) or raw digest bytes
    # Added in v1 (additive): the explicit hash unit the node was configured with (vLLM's
    # prefix_match_unit), None when it follows the default rule (gcd of the group block sizes).
    # When set, hash_block_size equals it.
    prefix_match_unit: int | None = None


# The one "no batch" value; see Envelope.__post_init__.
_NO_BATCH = msgspec.Raw()


class Envelope(msgspec.Struct, omit_defaults=True):
    v: int  # schema major version
    node_id: str
    epoch: int
    seq: int
    ts: float  # wall clock when the node produced the batch (vLLM's batch ts)
    sent_ts: float = 0.0  # wall clock when the publisher handed it to Kafka
    model: str | None = None
    dp_rank: int | None = None
    group_specs: list[GroupSpec] | None = None
    hash_config: HashConfig | None = None
    dropped: int = 0  # events the producer had to drop since the previous envelope
    lost_batches: int = 0  # upstream batches known lost (bridge: gone from vLLM's replay ring)
    num_events: int = 0
    # vLLM KVEventBatch bytes (array [ts, events, dp_rank]) embedded as-is; empty (omitted on
    # the wire) for a heartbeat. msgspec.Raw cannot be Optional, so "absent" is the empty Raw.
    batch: msgspec.Raw = _NO_BATCH
    source: str = "kvpipe"  # "kvpipe" (our GPU side) | "vllm-bridge"
    upstream_seq: int | None = None  # the vLLM ZMQ seq of this batch, when bridged
    layout: str = "map"  # "map" (vLLM >= 0.24 events) | "array" (vLLM <= 0.23 events)
    # Added in v1 (additive): distinct contradictions between the declared group specs and what the
    # node's own events say (kind, block size, window), cumulative for the epoch. Bridge-filled.
    spec_mismatches: int = 0
    # Added in v1 (additive): the node's load when it sent the batch, for the router's score
    # (processors/router/decide.py). None: not reported. The simulated node fills them from its
    # scheduler, the bridge from the engine's Prometheus /metrics.
    running: int | None = None  # requests being computed
    waiting: int | None = None  # requests queued
    kv_usage: float | None = None  # fraction of KV cache blocks in use, 0..1

    def __post_init__(self) -> None:
        # omit_defaults compares by identity for Raw: an *equal* empty Raw would be written as a key
        # with no value (broken msgpack). Normalise every empty batch to the default object.
        if self.batch is not _NO_BATCH and len(self.batch) == 0:
            self.batch = _NO_BATCH

    @property
    def is_heartbeat(self) -> bool:
        return len(self.batch) == 0


HEADER_VERSION = "kvpipe-schema"
HEADER_CONTENT_TYPE = "content-type"
CONTENT_TYPE = "application/vnd.kvpipe.envelope+msgpack"
