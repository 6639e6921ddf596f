"""Group specs and hash config of a bridged node: declared by the operator, observed in events.

A real vLLM node does not announce its KV cache groups on the event stream; the processor still
needs them (hit semantics differ per kind). So the operator declares them — `--group-spec` or a
`--specs-file` written from the vLLM config — and the bridge checks the declaration against what
vLLM 0.22+ stamps on every GPU `BlockStored` (`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`,
`block_size`, `group_idx`) and against the hash type (int vs bytes).

When they disagree, the events win: vLLM stamped them from its real `kv_cache_config`, and the
index must apply the events as vLLM meant them. The disagreement is logged as an ERROR, counted
once per distinct (group, field, observed value) — not per event — and kept for `/metrics`.

Partial prefix-cache entries (one hash unit of a coarser group, published with the unit as
block size when vLLM serves fine-grained hits) are recognised and not counted as mismatches.

Specs file (JSON): `{"group_specs": [{"group_idx": 0, "kind": "full_attention", "block_size": 16},
...], "hash_config": {"algorithm": "sha256", "hash_block_size": 16}, "model": "..."}`; a bare list
is taken as `group_specs`. Field names are those of `kvpipe.schemas.envelope.GroupSpec` / `HashConfig`.
`--groups` takes the grammar of `kvpipe.schemas.groupspec`; `--group-spec` one GroupSpec as a JSON object
(or the older `IDX:KIND:BLOCK_SIZE[:WINDOW]`, deprecated).
`apply_options` folds `--eagle-group` and `--prefix-match-unit` into the declaration, and
`kvpipe.schemas.layout.layout_problem` refuses a declared layout vLLM itself would refuse.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import msgspec

from kvpipe.schemas.envelope import KIND_UNKNOWN, KNOWN_KINDS, GroupSpec, HashConfig
from kvpipe.schemas.events import BlockStored
from kvpipe.schemas.groupspec import parse_group

log = logging.getLogger("kvpipe.bridge.specs")


class SpecsError(ValueError):
    pass


class SpecsFile(msgspec.Struct, forbid_unknown_fields=True):
    group_specs: list[GroupSpec] = []
    hash_config: HashConfig | None = None
    model: str | None = None


def parse_group_spec(text: str, on_deprecated: Callable[[str], None] | None = None) -> GroupSpec:
    """A JSON object with GroupSpec's fields, or the older `IDX:KIND:BLOCK_SIZE[:WINDOW]` (read by
    `kvpipe.schemas.groupspec`, the grammar `--groups` uses; `on_deprecated` hears of it)."""
    text = text.strip()
    try:
        if text.startswith("{"):
            spec = msgspec.json.decode(text, type=GroupSpec)
        else:
            spec, old = parse_group(text, 0)
            if not old:
                raise SpecsError(f"--group-spec {text!r}: without a group index, use --groups {text}")
            if on_deprecated is not None:
                on_deprecated(text)
    except (ValueError, msgspec.ValidationError) as exc:
        if isinstance(exc, SpecsError):
            raise
        raise SpecsError(f"--group-spec {text!r}: {exc}") from None
    _check(spec, f"--group-spec {text!r}")
    return spec


def _check(spec: GroupSpec, where: str) -> None:
    if spec.kind not in KNOWN_KINDS:
        raise SpecsError(f"{where}: unknown kind {spec.kind!r}; known: {', '.join(sorted(KNOWN_KINDS))}")
    if spec.block_size <= 0:
        raise SpecsError(f"{where}: block_size must be > 0, got {spec.block_size}")


def load_specs_file(path: str | Path) -> SpecsFile:
    try:
        raw = json.loads(Path(path).read_text())
        if isinstance(raw, list):
            raw = {"group_specs": raw}
        specs = msgspec.convert(raw, SpecsFile)
    except (OSError, ValueError, msgspec.ValidationError) as exc:
        raise SpecsError(f"specs file {path}: {exc}") from None
    for g in specs.group_specs:
        _check(g, f"specs file {path}")
    idxs = [g.group_idx for g in specs.group_specs]
    if len(set(idxs)) != len(idxs):
        raise SpecsError(f"specs file {path}: group_idx repeated: {idxs}")
    return specs


def apply_options(declared: list[GroupSpec], hash_config: HashConfig | None, eagle_groups: Iterable[int] = (),
                  prefix_match_unit: int | None = None) -> tuple[list[GroupSpec], HashConfig | None]:
    """The declaration with the EAGLE flag set on `eagle_groups` and the explicit hash unit in the
    hash config (hash_block_size follows it). SpecsError for a group not declared, or a unit with
    no hash config to carry it (the algorithm would be a guess)."""
    eagle = set(eagle_groups)
    missing = sorted(eagle - {g.group_idx for g in declared})
    if missing:
        raise SpecsError(f"--eagle-group {missing}: no such declared group (declare it with --group-spec)")
    out = [msgspec.structs.replace(g, eagle=True) if g.group_idx in eagle else g for g in declared]
    if prefix_match_unit is not None:
        if hash_config is None:
            raise SpecsError("--prefix-match-unit needs a hash_config in --specs-file (algorithm, seed rule)")
        if prefix_match_unit <= 0:
            raise SpecsError(f"--prefix-match-unit must be positive, got {prefix_match_unit}")
        hash_config = msgspec.structs.replace(hash_config, hash_block_size=prefix_match_unit,
                                              prefix_match_unit=prefix_match_unit)
    return out, hash_config


@dataclass(frozen=True, slots=True)
class Mismatch:
    group_idx: int
    field: str
    declared: str
    observed: str


class SpecTracker:
    """Declared specs of one node, corrected by what its events show. Not thread-safe (one per rank).

    `observe(events)` is on the hot path: an event whose (group, kind, window, block size, hash
    type) was seen before costs one tuple and one set lookup.
    """

    def __init__(self, declared: Iterable[GroupSpec] = (), hash_config: HashConfig | None = None, node_id: str = "") -> None:
        self.node_id = node_id
        self._declared = {g.group_idx: g for g in declared}
        self._declared_hash = hash_config
        self._seen: set[tuple] = set()
        self._mismatch_keys: set[tuple] = set()
        self.mismatches: list[Mismatch] = []
        self.reset()

    def reset(self) -> None:
        """Forget observations (vLLM restarted, possibly with another config); keep mismatch history."""
        self._seen.clear()
        self.specs: dict[int, GroupSpec] = dict(self._declared)
        self.hash_config = self._declared_hash

    def group_specs(self) -> list[GroupSpec] | None:
        return [self.specs[i] for i in sorted(self.specs)] or None

    def observe(self, events: list) -> bool:
        """Check the events' stamped specs; True when the effective specs or hash config changed."""
        changed = False
        for e in events:
            if type(e) is not BlockStored or not e.block_hashes:
                continue
            if self._is_partial_entry(e):
                continue
            key = (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window, e.block_size,
                   type(e.block_hashes[0]) is int)
            if key in self._seen:
                continue
            self._seen.add(key)
            changed |= self._learn(*key)
        return changed

    def _is_partial_entry(self, e: BlockStored) -> bool:
        """A partial prefix-cache entry (vLLM's `cache_partial_block`, fine-grained hits): one hash
        unit of a group whose block is a whole number of units larger. It carries the unit as its
        block_size, which is no evidence against the group's declared block size."""
        if len(e.block_hashes) != 1 or e.block_size <= 0:
            return False
        known = self.specs.get(0 if e.group_idx is None else e.group_idx)
        if known is None or known.block_size <= e.block_size or known.block_size % e.block_size:
            return False
        unit = self.hash_config.hash_block_size if self.hash_config is not None else None
        return unit is None or unit == e.block_size

    def _learn(self, group_idx: int | None, kind: str | None, window: int | None, block_size: int, int_hash: bool) -> bool:
        changed = self._learn_hash(int_hash)
        # Offloading placeholders carry block_size 0 and no spec: nothing to learn from them.
        if block_size <= 0 and kind is None:
            return changed
        idx = 0 if group_idx is None else group_idx  # pre-0.20 events: one group
        old = self.specs.get(idx)
        new_kind = kind or (old.kind if old else KIND_UNKNOWN)
        new_bs = block_size if block_size > 0 else (old.block_size if old else 0)
        new_window = window if kind is not None else (old.sliding_window if old else None)
        if new_bs <= 0:
            return changed
        if old is not None and (old.kind, old.block_size, old.sliding_window) == (new_kind, new_bs, new_window):
            return changed
        declared = self._declared.get(idx)
        if declared is not None or self._declared:
            self._report(idx, declared, new_kind, new_bs, new_window)
        keep = old if old is not None and old.kind == new_kind else None
        self.specs[idx] = GroupSpec(
            group_idx=idx, kind=new_kind, block_size=new_bs, sliding_window=new_window,
            attention_chunk_size=keep.attention_chunk_size if keep else None,
            mamba_cache_mode=keep.mamba_cache_mode if keep else None,
            num_layers=keep.num_layers if keep else None,
            eagle=keep.eagle if keep else False,
        )
        return True

    def _learn_hash(self, int_hash: bool) -> bool:
        # Without a declared hash config there is nothing to correct: the events alone do not
        # tell the algorithm or hash block size, and inventing them would mislead routers.
        current = self.hash_config
        if current is None or current.int_hashes == int_hash:
            return False
        self._add(Mismatch(-1, "int_hashes", str(current.int_hashes), str(int_hash)))
        self.hash_config = msgspec.structs.replace(current, int_hashes=int_hash)
        return True

    def _report(self, idx: int, declared: GroupSpec | None, kind: str, block_size: int, window: int | None) -> None:
        if declared is None:
            self._add(Mismatch(idx, "group", "absent", f"{kind}/{block_size}/{window}"))
            return
        for name, want, got in (("kind", declared.kind, kind), ("block_size", declared.block_size, block_size),
                                ("sliding_window", declared.sliding_window, window)):
            # An unknown observed kind (pre-0.22 events) is no evidence against the declaration.
            if want != got and not (name == "kind" and got == KIND_UNKNOWN):
                self._add(Mismatch(idx, name, str(want), str(got)))

    def _add(self, m: Mismatch) -> None:
        key = (m.group_idx, m.field, m.observed)
        if key in self._mismatch_keys:
            return
        self._mismatch_keys.add(key)
        self.mismatches.append(m)
        where = "hash config" if m.group_idx < 0 else f"group {m.group_idx}"
        log.error("node %s: %s %s declared %s but vLLM's events say %s; using the events' value",
                  self.node_id, where, m.field, m.declared, m.observed)
