"""Checking a RouteRequest: everything a request can get wrong is a `RouteError` with a reason that
says which field or group and what was expected — never a silently empty or zero answer.

Two checks happen at different times. `check_request` needs nothing but the request (one prompt
form, sane lengths, hex hashes parse). `check_group_lists` needs a node's group layout: a group's
hash list is that group's view at *its own* block size, so its length pins the prompt length to
`[len · block_size, (len + 1) · block_size)`; with `num_tokens` that is an exact check, without it
the lists of all groups must at least agree on one prompt length. A 16-token list sent to a group
with 32-token blocks fails one or the other (except for a lone group without `num_tokens`, which
nothing can check).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvpipe.gpu.hashing import LoRA, MMFeature, RequestKeys
from kvpipe.processors.router.model import RouteError, RouteRequest
from kvpipe.schemas.events import ExternalHash

MAX_TOKENS = 1_000_000
MAX_HASHES = 100_000


@dataclass(frozen=True, slots=True)
class Checked:
    """A checked request: exactly one of `token_ids` / `hash_lists` / `unit_hashes`."""

    token_ids: list[int] | None
    hash_lists: dict[int, list[ExternalHash]] | None
    num_tokens: int | None  # len(token_ids) on the token path
    keys: RequestKeys | None  # extra hash keys (token path only)
    unit_hashes: list[ExternalHash] | None = None  # the hash-unit chain (unit path), `unit` tokens per hash
    unit: int | None = None


def check_request(req: RouteRequest) -> Checked:
    if (req.token_ids is not None) + (req.block_hashes is not None) + (req.unit_hashes is not None) != 1:
        raise RouteError(400, "bad route request", "send exactly one of token_ids (the prompt), unit_hashes (its "
                                                   "hash-unit chain, with hash_block_size and num_tokens) or "
                                                   'block_hashes ({"<group_idx>": [hashes at that group\'s block '
                                                   "size]})")
    if req.hash_block_size is not None and req.unit_hashes is None:
        raise RouteError(400, "bad route request", "hash_block_size goes with unit_hashes")
    if req.num_tokens is not None and req.num_tokens < 1:
        raise RouteError(400, "bad num_tokens", f"num_tokens {req.num_tokens}; expected an integer >= 1")
    if req.top_k is not None and req.top_k < 1:
        raise RouteError(400, "bad top_k", f"top_k {req.top_k}; expected an integer >= 1 (or leave it out)")
    if (req.lora_name is None) != (req.lora_path is None):
        raise RouteError(400, "bad lora", "lora_name and lora_path go together: vLLM keys LoRA blocks by both")
    if req.scoring is not None:
        s = req.scoring
        if s.temperature < 0 or not math.isfinite(s.temperature):
            raise RouteError(400, "bad scoring", f"temperature {s.temperature}; expected a finite number >= 0")
        for name in ("overlap_weight", "cpu_weight", "running_weight", "waiting_weight", "kv_usage_weight"):
            if not math.isfinite(getattr(s, name)):
                raise RouteError(400, "bad scoring", f"{name} must be a finite number")
    if req.token_ids is not None:
        return _check_tokens(req)
    extra = [name for name in ("lora_name", "cache_salt", "mm_features") if getattr(req, name)]
    if extra:
        raise RouteError(400, "bad route request", f"{', '.join(extra)} enter token-id hashing only; with "
                                                   f"{'unit_hashes' if req.unit_hashes is not None else 'block_hashes'}"
                                                   " they are already in the hashes")
    if req.unit_hashes is not None:
        return _check_units(req)
    lists: dict[int, list[ExternalHash]] = {}
    assert req.block_hashes is not None
    if not req.block_hashes:
        raise RouteError(400, "bad route request", "block_hashes names no group")
    total = 0
    for group, values in sorted(req.block_hashes.items()):
        if group < 0:
            raise RouteError(400, "bad group index", f"block_hashes group {group}: must be >= 0")
        total += len(values)
        if total > MAX_HASHES:
            raise RouteError(413, "too many block hashes", f"more than {MAX_HASHES} hashes in all")
        lists[group] = [_parse_hash(v, group, i) for i, v in enumerate(values)]
    return Checked(None, lists, req.num_tokens, None)


def _check_tokens(req: RouteRequest) -> Checked:
    tokens = req.token_ids
    assert tokens is not None
    if not tokens:
        raise RouteError(400, "bad token_ids", "token_ids is empty")
    if len(tokens) > MAX_TOKENS:
        raise RouteError(413, "too many tokens", f"{len(tokens)} token ids; the limit is {MAX_TOKENS}")
    if req.num_tokens is not None and req.num_tokens != len(tokens):
        raise RouteError(400, "bad num_tokens", f"num_tokens {req.num_tokens} but {len(tokens)} token_ids; "
                                                "leave num_tokens out with token_ids")
    keys = RequestKeys(
        lora=LoRA(req.lora_name, req.lora_path or "") if req.lora_name is not None else None,
        mm_features=[MMFeature(m.identifier, m.offset, m.length) for m in sorted(req.mm_features or (),
                                                                                  key=lambda m: m.offset)],
        cache_salt=req.cache_salt)
    return Checked(list(tokens), None, len(tokens), None if keys.empty else keys)


def _check_units(req: RouteRequest) -> Checked:
    units, unit, n = req.unit_hashes, req.hash_block_size, req.num_tokens
    assert units is not None
    if unit is None or unit < 1:
        raise RouteError(400, "bad hash_block_size", f"hash_block_size {unit}: unit_hashes need the tokens per "
                                                     "hash unit (the nodes' hash_block_size), an integer >= 1")
    if n is None:
        raise RouteError(400, "bad num_tokens", "unit_hashes need num_tokens: the hit is capped at num_tokens - 1 "
                                                "and a partial unit is only known from it")
    if len(units) > MAX_HASHES:
        raise RouteError(413, "too many unit hashes", f"{len(units)} unit hashes; the limit is {MAX_HASHES}")
    if len(units) != n // unit:
        raise RouteError(400, "bad unit_hashes", f"{len(units)} unit hashes, expected {n // unit} (num_tokens {n} // "
                                                 f"hash_block_size {unit}: one hash per full hash unit)")
    return Checked(None, None, n, None, [_parse_hash(v, "units", i) for i, v in enumerate(units)], unit)


def _parse_hash(value: int | str, group: int | str, i: int) -> ExternalHash:
    if isinstance(value, int):
        if not 0 <= value < 1 << 64:
            raise RouteError(400, "bad block hash", f"{_where(group)}[{i}] = {value}: an int hash is "
                                                    "vLLM's external form, 0 <= h < 2**64")
        return value
    if value[:2].lower() == "0x":
        try:
            return bytes.fromhex(value[2:])
        except ValueError:
            pass
    raise RouteError(400, "bad block hash", f"{_where(group)}[{i}] = {value!r}: expected an int or a "
                                            '"0x..." hex string')


def _where(group: int | str) -> str:
    return "unit_hashes" if group == "units" else f"block_hashes[{group}]"


def check_group_lists(lists: Mapping[int, Sequence[ExternalHash]], block_sizes: Mapping[int, int],
                      num_tokens: int | None, node_id: str | None = None) -> str | None:
    """Why these per-group lists cannot be the views of one prompt on a node whose groups have
    `block_sizes` (group → tokens per block); None when they can."""
    where = f" (node {node_id!r})" if node_id else ""
    unknown = sorted(g for g in lists if g not in block_sizes)
    if unknown:
        return f"groups {unknown} are not among the node's groups {sorted(block_sizes)}{where}"
    if num_tokens is not None:
        for g, hashes in sorted(lists.items()):
            want = num_tokens // block_sizes[g]
            if len(hashes) != want:
                return (f"group {g}: {len(hashes)} hashes, expected {want} (num_tokens {num_tokens} // block size "
                        f"{block_sizes[g]}: one hash per full block of that group){where}")
        return None
    lo, hi = 0, math.inf  # prompt lengths consistent with every list so far: [lo, hi)
    for g, hashes in sorted(lists.items()):
        bs = block_sizes[g]
        g_lo, g_hi = len(hashes) * bs, (len(hashes) + 1) * bs
        if g_lo >= hi or g_hi <= lo:
            return (f"group {g}: {len(hashes)} hashes at block size {bs} cover {g_lo}..{g_hi - 1} tokens, but the "
                    f"other groups' lists cover {lo}..{hi - 1}: each group needs its own list at its own block "
                    f"size{where}")
        lo, hi = max(lo, g_lo), min(hi, g_hi)
    return None
