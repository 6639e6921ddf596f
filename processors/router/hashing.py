"""Token ids → every group's block hashes, once per distinct hash configuration among the nodes.

A node publishes how it hashes (`HashConfig`: algorithm, hash unit, none-hash seed rule, int or
bytes external form) and its groups (`GroupSpec`: block size per group). The prompt's fine chain
(one hash per `hash_block_size` tokens) depends only on the configuration, so it is computed once
per distinct configuration with `kvpipe.gpu.hashing` — the function the GPU side itself hashes with — and
each group's list is the view at that group's block size (`kvpipe.gpu.hit.ViewCache`: the last fine hash
of each of its blocks, docs/vllm-behaviour.md §3.5), built once per block size.

Hashing dominates the token-id path's cost (SHA-256 over a pickle per hash unit), so each
configuration's time is measured and reported with the answer.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import cast

from kvpipe.gpu.hashing import BlockHasher, RequestKeys, external_hash, hash_request_blocks, hasher_from_config
from kvpipe.gpu.hit import ViewCache
from kvpipe.processors.core import native
from kvpipe.processors.router.model import HashConfigUsed
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from kvpipe.schemas.events import ExternalHash

ConfigKey = tuple[str, int, str, str | None, bool]


def hash_views(fine: Sequence[ExternalHash], hash_block_size: int) -> ViewCache:
    """`kvpipe.gpu.hit.ViewCache` over a chain in its published form (ints or bytes). The GPU side annotates the
    chain as its digests (bytes); the views only slice it, so any hash form works."""
    return ViewCache(cast("Sequence[bytes]", fine), hash_block_size)


def config_key(config: HashConfig) -> ConfigKey:
    """Two nodes hash alike exactly when these agree (the seed string only matters for its rule)."""
    seed = config.none_hash_seed if config.none_hash_seed_rule == "pythonhashseed" else None
    return (config.algorithm, config.hash_block_size, config.none_hash_seed_rule, seed, config.int_hashes)


def layout_mismatch(config: HashConfig, specs: Sequence[GroupSpec]) -> str | None:
    """Why a node's groups cannot be views of its own hash chain (a block size that is not a whole
    number of hash units); None when they can."""
    hbs = config.hash_block_size
    if hbs <= 0:
        return f"hash_block_size {hbs} is not positive"
    bad = [f"group {gs.group_idx} block size {gs.block_size}" for gs in specs if gs.block_size % hbs]
    if bad:
        return f"{', '.join(bad)} not a multiple of the hash unit {hbs}"
    return None


# Hashers by configuration (a hasher digests its none-hash seed when made: once per configuration,
# not once per request), or why the configuration cannot be hashed here
_hashers: dict[ConfigKey, BlockHasher | str] = {}
_HASHERS_MAX = 1024


def _hasher(config: HashConfig) -> BlockHasher:
    key = config_key(config)
    got = _hashers.get(key)
    if got is None:
        try:
            got = hasher_from_config(config)
        except ValueError as exc:
            got = str(exc)
        if len(_hashers) >= _HASHERS_MAX:
            _hashers.clear()
        _hashers[key] = got
    if isinstance(got, str):
        raise ValueError(got)
    return got


class ConfigHashes:
    """One configuration's hashes of one prompt, and the per-block-size views of them."""

    __slots__ = ("config", "views", "hash_blocks", "seconds", "nodes")

    def __init__(self, config: HashConfig, token_ids: Sequence[int], keys: RequestKeys | None) -> None:
        hasher = _hasher(config)  # ValueError: the caller reports the node as no signal
        t0 = time.perf_counter()
        ints = config.int_hashes
        external: Sequence[ExternalHash] | None = None
        if config.algorithm == "sha256" and (keys is None or keys.empty):
            # vLLM's default hash built natively from the token ids (None: the Python engine, or a shape it
            # leaves to us); tests/property/test_native_token_hash.py holds it equal to `kvpipe.gpu.hashing`'s chain
            external = native.sha256_token_chain(hasher.none_hash, token_ids, config.hash_block_size, ints)
        if external is None:
            fine = hash_request_blocks(hasher, token_ids, config.hash_block_size, keys)
            external = [external_hash(d, ints) for d in fine]
        self.seconds = time.perf_counter() - t0
        self.config = config
        self.hash_blocks = len(external)
        self.views = hash_views(external, config.hash_block_size)
        self.nodes = 0

    def lists(self, specs: Sequence[GroupSpec]) -> dict[int, list[ExternalHash]]:
        """Each group's hash list at its own block size."""
        return {gs.group_idx: self.views.at(gs.block_size) for gs in specs}  # type: ignore[misc]

    def used(self) -> HashConfigUsed:
        c = self.config
        label = f"{c.algorithm}/{c.hash_block_size}/{c.none_hash_seed_rule}/{'int' if c.int_hashes else 'bytes'}"
        return HashConfigUsed(label=label, config=self.config, nodes=self.nodes, hash_blocks=self.hash_blocks,
                              hashing_s=round(self.seconds, 6))


class PromptHasher:
    """Hashes one request's tokens lazily, once per configuration actually needed; remembers
    configurations that cannot be reproduced, with the reason."""

    def __init__(self, token_ids: Sequence[int], keys: RequestKeys | None = None) -> None:
        self.token_ids = token_ids
        self.keys = keys
        self._done: dict[ConfigKey, ConfigHashes | str] = {}

    def for_config(self, config: HashConfig) -> ConfigHashes | str:
        key = config_key(config)
        got = self._done.get(key)
        if got is None:
            try:
                got = ConfigHashes(config, self.token_ids, self.keys)
            except ValueError as exc:
                got = str(exc)
            self._done[key] = got
        return got

    def used(self) -> list[HashConfigUsed]:
        return [h.used() for h in self._done.values() if isinstance(h, ConfigHashes) and h.nodes]

    @property
    def seconds(self) -> float:
        return sum(h.seconds for h in self._done.values() if isinstance(h, ConfigHashes))


def hash_lists(config: HashConfig, specs: Sequence[GroupSpec], token_ids: Sequence[int],
               keys: RequestKeys | None = None) -> dict[int, list[ExternalHash]]:
    """Convenience for one node: its groups' lists for these tokens (raises ValueError)."""
    return ConfigHashes(config, token_ids, keys).lists(specs)


def specs_by_group(specs: Sequence[GroupSpec]) -> Mapping[int, int]:
    return {gs.group_idx: gs.block_size for gs in specs}
