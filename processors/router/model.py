"""The router's request and answer: one set of msgspec Structs for the server, the client and the
OpenAPI document (`kvpipe.processors.router.openapi` generates the schema from these very classes).

A request names its prompt either as `token_ids` (the router hashes them with each candidate
node's own hash configuration) or as `block_hashes` per group (for routers that hash themselves;
validated against the nodes' group block sizes). Hashes travel as JSON ints (vLLM's default
external form) or "0x…" hex strings (bytes hashes).

Field names are the JSON names; every answer field a router acts on is typed here, so a client
decodes the answer into these classes rather than poking at dicts.
"""
from __future__ import annotations

from typing import Final, Literal, Union

import msgspec

from kvpipe.processors.core.answers import ErrorBody  # the 4xx body of both apps, named here for the router's users
from kvpipe.schemas.envelope import HashConfig

HMA: Final = "hma"  # Final: typed as its literal, so it is a `Semantics` default
PREFIX_PER_GROUP: Final = "prefix-per-group"
Semantics = Literal["hma", "prefix-per-group"]

# Node states in an answer. live: applied in order, recent; suspect: the index may miss some of
# its events (gap, drops, restart mid-epoch; the reason says which); stale: silent longer than the
# router's staleness bound but not yet expired; partial: the hit covers only some of its groups.
NodeStateName = Literal["live", "suspect", "stale", "partial"]
HashValue = Union[int, str]  # int, or "0x…" hex of a bytes hash


class MMItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A multimodal item `[offset, offset + length)` of the prompt, as vLLM keys its blocks."""

    identifier: str
    offset: int
    length: int


class Scoring(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Knobs of the score (formula: `kvpipe.processors.router.decide`). Defaults: deterministic argmax."""

    overlap_weight: float = 1.0  # weight of the cache benefit (fraction of the prompt reused)
    cpu_weight: float = 0.5  # a CPU-loadable token is worth this much of a GPU-resident one
    running_weight: float = 0.02  # per running request on the node
    waiting_weight: float = 0.05  # per waiting (queued or in-flight) request on the node
    kv_usage_weight: float = 0.5  # per unit of KV cache usage (0..1)
    temperature: float = 0.0  # 0: argmax; > 0: softmax sampling over score / temperature
    seed: int | None = None  # sampling seed (default: derived from request_id, else 0)


class RouteRequest(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    token_ids: list[int] | None = None
    # group index → that group's block hashes, at that group's own block size
    block_hashes: dict[int, list[HashValue]] | None = None
    # the prompt's hash-unit chain: one hash per `hash_block_size` tokens, the chain vLLM derives every group's block
    # hashes from (its request's block hashes); with num_tokens, partial hits are exact as with token_ids
    unit_hashes: list[HashValue] | None = None
    hash_block_size: int | None = None  # tokens per hash unit of unit_hashes
    num_tokens: int | None = None  # required with block_hashes and unit_hashes; with token_ids: len(token_ids)
    model: str | None = None  # only nodes serving this model can have a signal
    lora_name: str | None = None  # with lora_path: vLLM keys LoRA blocks by ("lora", name, path)
    lora_path: str | None = None
    cache_salt: str | None = None
    mm_features: list[MMItem] | None = None
    semantics: Semantics = HMA  # "prefix-per-group" adds per-group prefixes as an explanation
    top_k: int | None = None  # rows to return (the chosen node is always among them)
    include_zero: bool = False  # also list eligible nodes with no hit
    scoring: Scoring | None = None
    request_id: str | None = None  # record the request on the chosen node (in-flight accounting)


class Load(msgspec.Struct, frozen=True, omit_defaults=True):
    """A node's load as the score reads it (from its envelopes or metrics; see decide)."""

    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV cache blocks in use, 0..1


class GroupHit(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One group's part of a node's hit: real (non-null) blocks the hit reuses, and where."""

    group_idx: int
    kind: str
    block_size: int
    gpu_blocks: int  # real blocks of the GPU hit
    blocks: int  # real blocks of the GPU ∪ CPU hit
    medium: str  # where the GPU ∪ CPU hit's blocks are: "GPU", "CPU", "GPU+CPU", or "none"
    speculative_blocks: int = 0  # of `blocks`, those known only from in-flight accounting
    # semantics "prefix-per-group" only: the longest cached prefix of this group, per medium
    prefix_blocks: dict[str, int] | None = None


class NodeRoute(msgspec.Struct, kw_only=True):
    node_id: str
    epoch: int
    model: str | None = None
    dp_rank: int | None = None
    state: NodeStateName = "live"
    state_reason: str | None = None
    gpu_tokens: int  # vLLM's hybrid hit on GPU alone
    loadable_tokens: int  # further tokens the CPU tier can load: hit(GPU ∪ CPU) − hit(GPU)
    groups: list[GroupHit] = []
    exact: bool = True
    reason: str | None = None  # why not exact
    score: float = 0.0
    speculative: bool = False  # the hit uses blocks only in-flight accounting knows of
    load: Load | None = None


class HashConfigUsed(msgspec.Struct, kw_only=True):
    """One distinct hash configuration the router hashed the prompt with, and for which nodes."""

    label: str  # "algorithm/hash_block_size/seed rule/int|bytes", readable at a glance
    config: HashConfig
    nodes: int
    hash_blocks: int  # the prompt's whole hash units (the native path stops hashing where no node can hit)
    hashing_s: float


class NoSignal(msgspec.Struct):
    """A node that can never match this request, and why (never reported as a silent 0)."""

    node_id: str
    reason: str
    # expired | model (serves another) | specs (no usable group specs) | config (hash configuration
    # missing or not reproducible, block sizes not whole hash units) | lists (the request's hash
    # lists do not fit its groups)
    cause: Literal["expired", "model", "specs", "config", "lists"] = "specs"


class RouteAnswer(msgspec.Struct, kw_only=True):
    chosen: str | None  # node to send the request to; None when no node is eligible
    semantics: Semantics = HMA
    model: str | None = None
    num_tokens: int | None = None  # the request length the hit is capped by (hit ≤ num_tokens − 1)
    hash_configs: list[HashConfigUsed] = []  # empty when the request brought its own hashes
    nodes: list[NodeRoute] = []
    no_signal: list[NoSignal] = []
    hashing_s: float = 0.0
    search_s: float = 0.0
    # several workers: partitions of the events topic no worker answered for (their nodes are
    # missing from this answer: a worker down, or a rebalance under way)
    partial: bool = False
    missing_partitions: list[int] = []


class LocalRouteAnswer(RouteAnswer, kw_only=True):
    """One worker's part of an answer (`POST /route?local=1`): its `route_local` rows plus which
    events partitions it answers for and each listed node's partition, so the coordinator takes
    every partition from one worker only (`kvpipe.processors.router.serving.merge_local`)."""

    partitions: list[int] = []
    node_partitions: dict[str, int] = {}


class SentForward(msgspec.Struct, forbid_unknown_fields=True):
    """Worker to worker (`POST /route/sent?local=1`): record a sent request on the worker that
    owns the node's partition, with the request itself (token ids or hash lists)."""

    request_id: str
    node_id: str
    request: RouteRequest


class Recorded(msgspec.Struct):
    """Worker to worker: the answer of `POST /route/sent?local=1` and `/route/finished?local=1`, whether this
    worker held the node (sent) or the request (finished) and so recorded it."""

    recorded: bool


class SentReport(msgspec.Struct, forbid_unknown_fields=True):
    """"Request R was sent to node N" — for requests routed without `request_id`, or elsewhere."""

    request_id: str
    node_id: str
    token_ids: list[int]


class FinishedReport(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str


class RouteError(ValueError):
    """A request the router cannot answer; `status` is the HTTP status, `detail` the reason."""

    def __init__(self, status: int, error: str, detail: str | None = None) -> None:
        super().__init__(f"{error}: {detail}" if detail else error)
        self.status, self.error, self.detail = status, error, detail

    def body(self) -> ErrorBody:
        return ErrorBody(self.error, self.detail)


_request_decoder = msgspec.json.Decoder(RouteRequest)


def decode_request(body: bytes) -> RouteRequest:
    """JSON bytes → RouteRequest, a schema error becoming a 400 that names the field."""
    try:
        return _request_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise RouteError(400, "bad route request", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise RouteError(400, "bad route request", f"not JSON: {exc}") from None
