"""Nodes with a known cache state, published into a real `kvpipe.processors.core.index.Index` as events.

A node here is its group specs, its hash configuration and, per (group, medium), the *positions*
of the prompt's blocks it holds; `publish` turns positions into that group's real block hashes (the
node's own hashing, the group's own block size) and applies `BlockStored` events.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvpipe.gpu.hashing import hash_request_blocks, hasher_from_config
from kvpipe.gpu.hit import ViewCache
from kvpipe.processors.core.index import Index
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec, HashConfig
from kvpipe.schemas.events import BlockStored, BlockRemoved

FA16 = GroupSpec(group_idx=0, kind="full_attention", block_size=16)


def fa(g: int, bs: int) -> GroupSpec:
    return GroupSpec(group_idx=g, kind="full_attention", block_size=bs)


def swa(g: int, bs: int, window: int) -> GroupSpec:
    return GroupSpec(group_idx=g, kind="sliding_window", block_size=bs, sliding_window=window)


def mamba(g: int, bs: int) -> GroupSpec:
    return GroupSpec(group_idx=g, kind="mamba", block_size=bs, mamba_cache_mode="align")


# Layouts: groups at different block sizes, two sliding windows, Mamba; hash unit = gcd.
LAYOUTS: dict[str, tuple[list[GroupSpec], int]] = {
    "fa": ([fa(0, 16)], 16),
    "fa16+swa32": ([fa(0, 16), swa(1, 32, 64)], 16),
    "fa+2swa": ([fa(0, 16), swa(1, 16, 32), swa(2, 16, 80)], 16),
    "fa32+mamba64": ([fa(0, 32), mamba(1, 64)], 32),
    "fa16+swa16+mamba32": ([fa(0, 16), swa(1, 16, 48), mamba(2, 32)], 16),
}
CONFIGS = {
    "sha256-int": dict(algorithm="sha256", int_hashes=True),
    "cbor-bytes": dict(algorithm="sha256_cbor", int_hashes=False),
    "cbor-seeded": dict(algorithm="sha256_cbor", none_hash_seed_rule="pythonhashseed", none_hash_seed="7"),
}


def hash_config(name: str, hash_block_size: int) -> HashConfig:
    return HashConfig(hash_block_size=hash_block_size, **CONFIGS[name])


def group_lists(cfg: HashConfig, specs: Sequence[GroupSpec], tokens: Sequence[int]) -> dict[int, list]:
    fine = hash_request_blocks(hasher_from_config(cfg), tokens, cfg.hash_block_size)
    from kvpipe.gpu.hashing import external_hash

    views = ViewCache([external_hash(d, cfg.int_hashes) for d in fine], cfg.hash_block_size)
    return {gs.group_idx: list(views.at(gs.block_size)) for gs in specs}


class Publisher:
    """One node's envelopes, seq by seq."""

    def __init__(self, index: Index, node_id: str, specs: Sequence[GroupSpec] | None, cfg: HashConfig | None,
                 model: str | None = "m", ts: float = 100.0) -> None:
        self.index, self.node_id, self.specs, self.cfg, self.model, self.ts = index, node_id, specs, cfg, model, ts
        self.seq = 0
        self.epoch = 1

    def send(self, events: list, ts: float | None = None) -> None:
        first = self.seq == 0
        env = Envelope(v=SCHEMA_MAJOR, node_id=self.node_id, epoch=self.epoch, seq=self.seq,
                       ts=self.ts if ts is None else ts, model=self.model,
                       group_specs=list(self.specs) if first and self.specs else None,
                       hash_config=self.cfg if first else None)
        self.index.apply(env, events, 0, self.seq)
        self.seq += 1

    def store(self, lists: Mapping[int, Sequence], held: Mapping[tuple[int, str], Sequence[int]]) -> None:
        events = [stored([lists[g][i] for i in sorted(pos)], g, self._bs(g), medium)
                  for (g, medium), pos in held.items() if pos]
        self.send(events)

    def _bs(self, g: int) -> int:
        return next(s.block_size for s in self.specs or () if s.group_idx == g) if self.specs else 16


def stored(hashes: list, group: int, block_size: int = 16, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=block_size,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def removed(hashes: list, group: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def shared_document(rng, layout: Sequence[GroupSpec], units: tuple[int, int], nodes: int,
                    held: Callable[[int], Mapping[tuple[int, str], Sequence[int]]], unit: int = 16):
    """One document of `units` (a range) hash units hashed with "sha256-int", and `nodes` nodes ("n00"…, live
    now) that each hold `held(n)` of it (positions per (group, medium); `n`: the document's units). Returns
    the index, the document's tokens, its per-group lists and the node names."""
    cfg = hash_config("sha256-int", unit)
    n = rng.randint(*units)
    doc = [rng.randrange(50_000) for _ in range(n * unit)]
    lists = group_lists(cfg, layout, doc)
    index = Index()
    now = time.time()
    names = [f"n{i:02d}" for i in range(nodes)]
    for node in names:
        Publisher(index, node, layout, cfg, ts=now).store(lists, held(n))
        index.nodes[node].last_seen = now
    return index, doc, lists, names
