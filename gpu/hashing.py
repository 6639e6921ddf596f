"""Prefix-cache block hashing, bit-identical to vLLM 0.33.

A block hash is `H((parent_digest, tuple(token_ids), extra_keys))` where `H` serialises the
3-tuple (pickle protocol 5 or canonical CBOR) and digests it (SHA-256 or xxh3-128). Hashes chain
over the whole prefix at `hash_block_size` tokens per unit, full units only; the first unit's
parent is `none_hash`, the digest of a seed string.

Why pickle: vLLM's default algorithm is `sha256` over pickle, so a router that must reproduce the
node's hashes has to build the *same Python object graph* (bytes parent, tuple of ints, tuple of
tuples or None). Only the `*_cbor` algorithms are reproducible outside CPython.

Groups with a block size of `k` hash units use the last fine hash of each coarse block
(`coarse_hashes`): the chain already covers the whole prefix, so that hash identifies the block.
"""
from __future__ import annotations

import bisect
import hashlib
import os
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2

try:  # optional: only if the package happens to be installed
    import xxhash as _xxhash

    if not hasattr(_xxhash, "xxh3_128_digest"):
        _xxhash = None
except ImportError:  # pragma: no cover - depends on the environment
    _xxhash = None

HashFn = Callable[[Any], bytes]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxh(data: bytes) -> bytes:
    if _xxhash is None:
        raise RuntimeError("the xxhash block-hash algorithms need the 'xxhash' package (not a kvpipe dependency)")
    return _xxhash.xxh3_128_digest(data)


def xxhash(obj: Any) -> bytes:
    return _xxh(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    return _xxh(cbor2.dumps(obj, canonical=True))


ALGORITHMS: dict[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor}
if _xxhash is not None:
    ALGORITHMS["xxhash"] = xxhash
    ALGORITHMS["xxhash_cbor"] = xxhash_cbor

# Algorithms whose seed may be public: collision resistance does not depend on it.
CRYPTOGRAPHIC = frozenset({"sha256", "sha256_cbor"})


def resolve_none_hash_seed(algorithm: str, env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """`(seed, rule)`: PYTHONHASHSEED (the string) if set; else the fixed default seed for the
    cryptographic algorithms; else a fresh random seed (xxhash: a predictable seed would let an
    attacker precompute collisions). `rule` is the HashConfig name of the case."""
    env = os.environ if env is None else env
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed, "pythonhashseed"
    if algorithm in CRYPTOGRAPHIC:
        return DEFAULT_NONE_HASH_SEED, "default"
    return os.urandom(32).hex(), "random"


class BlockHasher:
    """One node's hashing configuration: algorithm plus the resolved `none_hash`.

    The seed is resolved once, at construction, like vLLM's process-wide NONE_HASH; a hasher is a
    value a router can rebuild from the envelope's HashConfig (`seed` given explicitly).
    """

    __slots__ = ("algorithm", "fn", "seed", "seed_rule", "none_hash")

    def __init__(self, algorithm: str = "sha256", seed: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        if algorithm not in ALGORITHMS:
            known = ", ".join(sorted(ALGORITHMS))
            raise ValueError(f"unknown block-hash algorithm {algorithm!r}; available here: {known}")
        self.algorithm = algorithm
        self.fn: HashFn = ALGORITHMS[algorithm]
        if seed is None:
            seed, rule = resolve_none_hash_seed(algorithm, env)
        else:
            rule = "default" if seed == DEFAULT_NONE_HASH_SEED else "pythonhashseed"
        self.seed = seed
        self.seed_rule = rule
        self.none_hash: bytes = self.fn(seed)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int],
                   extra_keys: tuple[Any, ...] | None = None) -> bytes:
        """One chained unit. A falsy parent (None or b"") means "first unit"."""
        return self.fn((parent or self.none_hash, tuple(tokens), extra_keys))

    def hash_config(self, hash_block_size: int, int_hashes: bool = True) -> Any:
        """The envelope's HashConfig describing this hasher."""
        from kvpipe.schemas.envelope import HashConfig

        return HashConfig(algorithm=self.algorithm, hash_block_size=hash_block_size,
                          none_hash_seed_rule=self.seed_rule,
                          none_hash_seed=None if self.seed_rule == "default" else self.seed,
                          int_hashes=int_hashes)


# --- extra keys ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MMFeature:
    """A multimodal item occupying `[offset, offset + length)` of the prompt."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class LoRA:
    name: str
    path: str
    adapter_id: int = 0


@dataclass(slots=True)
class RequestKeys:
    """What besides token ids enters a request's block hashes.

    `mm_features` must be sorted by offset and non-overlapping (as vLLM requires);
    `prompt_embeds` is a tensor of one row per prompt token, or None.
    """

    lora: LoRA | None = None
    mm_features: Sequence[MMFeature] = ()
    cache_salt: str | None = None
    prompt_embeds: Any = None
    _mm_ends: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._mm_ends = [f.offset + f.length for f in self.mm_features]

    @property
    def empty(self) -> bool:
        return (self.lora is None and not self.mm_features and not self.cache_salt
                and self.prompt_embeds is None)


def block_extra_keys(keys: RequestKeys | None, start: int, end: int) -> tuple[Any, ...] | None:
    """Tagged extra keys of the unit `[start, end)`, in vLLM's order lora → mm → salt → embeds;
    None when there are none."""
    if keys is None or keys.empty:
        return None
    out: list[Any] = []
    if keys.lora is not None:
        out.append(("lora", keys.lora.name, keys.lora.path))
    if keys.mm_features:
        # First feature ending after `start`; features are sorted, so ends are sorted too.
        i = bisect.bisect_right(keys._mm_ends, start)
        feats = keys.mm_features
        while i < len(feats) and feats[i].offset < end:
            out.append(("mm", feats[i].identifier, feats[i].offset - start))
            i += 1
    if start == 0 and keys.cache_salt:
        out.append(("cache_salt", keys.cache_salt))
    if keys.prompt_embeds is not None:  # rows past the prompt hash as an empty slice, like vLLM
        out.append(("prompt_embeds", _embeds_digest(keys.prompt_embeds[start:end])))
    return tuple(out) if out else None


def _embeds_digest(rows: Any) -> bytes:
    """SHA-256 of the rows' raw bytes (flattened, contiguous, on CPU), as vLLM hashes them."""
    import torch

    data = rows.flatten().cpu().contiguous().view(torch.uint8).numpy().data
    return hashlib.sha256(data).digest()


def to_event_extra_keys(per_block: Iterable[tuple[Any, ...] | None] | None) -> list[tuple[Any, ...] | None] | None:
    """The untagged per-block form published in events: mm keys become `(identifier, offset)`,
    every other key its bare value (LoRA name — the path is dropped —, salt, embeds digest)."""
    if not per_block:
        return None
    out = [None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
           for keys in per_block]
    return out or None


# --- the chain -------------------------------------------------------------------------------


def hash_request_blocks(hasher: BlockHasher, token_ids: Sequence[int], hash_block_size: int,
                        keys: RequestKeys | None = None, prior: Sequence[bytes] = ()) -> list[bytes]:
    """Hashes of the full units of `token_ids` not yet in `prior` (the already-hashed units).

    Incremental like vLLM's request block hasher: call again after appending tokens with the
    hashes computed so far; a trailing partial unit produces nothing.
    """
    start = len(prior) * hash_block_size
    parent = prior[-1] if prior else hasher.none_hash
    fn = hasher.fn
    plain = keys is None or keys.empty
    out: list[bytes] = []
    n = len(token_ids)
    while start + hash_block_size <= n:
        end = start + hash_block_size
        extra = None if plain else block_extra_keys(keys, start, end)
        parent = fn((parent, tuple(token_ids[start:end]), extra))
        out.append(parent)
        start = end
    return out


def coarse_hashes(fine: Sequence[bytes], factor: int) -> list[bytes]:
    """The hash list seen by a group whose block is `factor` hash units: the last fine hash of
    each complete coarse block."""
    if factor == 1:
        return list(fine)
    return list(fine[factor - 1::factor])


def external_hash(digest: bytes, int_hashes: bool = True) -> int | bytes:
    """The published form: the last 8 bytes big-endian (vLLM's default) or the raw digest."""
    if not int_hashes:
        return digest
    return int.from_bytes(digest, "big") & _U64


def group_key(digest: bytes, group_idx: int) -> bytes:
    """Prefix-cache key of one group's block: digest followed by the group as u32 big-endian
    (vLLM's BlockHashWithGroupId layout, also the OffloadKey layout)."""
    return digest + group_idx.to_bytes(4, "big")


def hasher_from_config(config: Any) -> BlockHasher:
    """The hasher a node's published `HashConfig` describes, so a router reproduces its hashes.

    Raises ValueError saying why when that is impossible: a per-process random seed (never
    published, so no one else can compute the node's `none_hash`), a "pythonhashseed" rule without
    the seed, or an algorithm this process cannot run."""
    rule = config.none_hash_seed_rule
    if rule == "random":
        raise ValueError(f"{config.algorithm} with a random per-process none-hash seed: its hashes cannot be "
                         "recomputed elsewhere (set PYTHONHASHSEED on the node)")
    if rule == "default":
        seed = DEFAULT_NONE_HASH_SEED
    elif rule == "pythonhashseed":
        if config.none_hash_seed is None:
            raise ValueError("none-hash seed rule 'pythonhashseed' without the seed string")
        seed = config.none_hash_seed
    else:
        raise ValueError(f"unknown none-hash seed rule {rule!r}")
    return BlockHasher(config.algorithm, seed=seed)
