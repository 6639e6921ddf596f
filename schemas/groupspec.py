"""The one command-line grammar for KV cache groups (`kvpipe node --groups`, `kvpipe bridge --groups`).

    KIND:BLOCK_SIZE[:WINDOW|CHUNK][,KIND:BLOCK_SIZE[:WINDOW|CHUNK]...]

Items are in group order (the first is group 0). KIND is vLLM's name (`full_attention`,
`sliding_window`, `mamba`, `chunked_local_attention`, ... — `kvpipe.schemas.envelope.KNOWN_KINDS`) or a
short one (`full`, `swa`, `local`, ...: `SHORT_KINDS`). A kind with a parameter
(`kvpipe.schemas.envelope.KIND_PARAMS`: sliding-window kinds their window in tokens, chunked-local
attention its chunk size) takes it as the third item; the other kinds take none.

The bridge's older per-group form `IDX:KIND:BLOCK_SIZE[:WINDOW]` (an explicit group index first)
is still read, and `parse_groups` reports it through `on_deprecated` so a command can say which
spelling to use instead. Errors are `GroupSpecError` (a ValueError) naming the item and the grammar.
"""
from __future__ import annotations

from typing import Callable

import msgspec

from kvpipe.schemas.envelope import (
    KIND_CHUNKED_LOCAL,
    KIND_CROSS,
    KIND_ENCODER_ONLY,
    KIND_FIXED,
    KIND_FULL,
    KIND_MLA,
    KIND_PARAMS,
    KIND_SINK_FULL,
    KIND_SLIDING,
    KIND_SLIDING_MLA,
    KNOWN_KINDS,
    GroupSpec,
)

GRAMMAR = (f"KIND:BLOCK_SIZE[:{'|'.join(dict.fromkeys(p.placeholder for p in KIND_PARAMS.values()))}], "
           "comma separated in group order")
EXAMPLE = "full_attention:16,sliding_window:16:128,mamba:16"

SHORT_KINDS = {
    "full": KIND_FULL, "fa": KIND_FULL, "mla": KIND_MLA, "sink": KIND_SINK_FULL,
    "sliding": KIND_SLIDING, "swa": KIND_SLIDING, "swa_mla": KIND_SLIDING_MLA,
    "chunked_local": KIND_CHUNKED_LOCAL, "local": KIND_CHUNKED_LOCAL,
    "cross": KIND_CROSS, "encoder_only": KIND_ENCODER_ONLY,
}


class GroupSpecError(ValueError):
    pass


def kind_name(text: str) -> str | None:
    """vLLM's kind name for a short or vLLM name; None when neither."""
    name = text.strip().lower()
    if name in KNOWN_KINDS:
        return name
    return SHORT_KINDS.get(name)


def _int(text: str, item: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise GroupSpecError(f"group {item!r}: {text!r} is not an integer ({GRAMMAR}, e.g. {EXAMPLE})") from None
    if value <= 0:
        raise GroupSpecError(f"group {item!r}: {value} must be positive")
    return value


def _spec(idx: int, kind_text: str, nums: list[str], item: str) -> GroupSpec:
    kind = kind_name(kind_text)
    if kind is None:
        known = ", ".join(sorted(KNOWN_KINDS - {"unknown"}) + sorted(SHORT_KINDS))
        raise GroupSpecError(f"group {item!r}: unknown kind {kind_text!r}; known: {known}")
    if not nums or len(nums) > 2:
        raise GroupSpecError(f"group {item!r}: expected {GRAMMAR} (e.g. {EXAMPLE})")
    param = KIND_PARAMS.get(kind)
    if param is not None and param.required and len(nums) != 2:
        raise GroupSpecError(f"group {item!r}: {kind} needs BLOCK_SIZE:{param.words.upper().replace(' ', '_')} "
                             f"(its {param.words} in tokens)")
    if param is None and len(nums) == 2:
        raise GroupSpecError(f"group {item!r}: {kind} takes only BLOCK_SIZE")
    block_size = _int(nums[0], item)
    fields: dict[str, object] = dict(KIND_FIXED.get(kind, {}))
    if param is not None and len(nums) == 2:
        fields[param.field] = _int(nums[1], item)
    return msgspec.structs.replace(GroupSpec(group_idx=idx, kind=kind, block_size=block_size), **fields)


def parse_group(item: str, idx: int) -> tuple[GroupSpec, bool]:
    """One item; `(spec, deprecated)` where deprecated means the legacy `IDX:KIND:...` form was used
    (its index wins over `idx`)."""
    item = item.strip()
    parts = item.split(":")
    if parts[0].strip().lstrip("-").isdigit():  # legacy bridge form: IDX:KIND:BLOCK_SIZE[:WINDOW]
        if len(parts) < 3:
            raise GroupSpecError(f"group {item!r}: expected {GRAMMAR} (or the older IDX:KIND:BLOCK_SIZE[:WINDOW])")
        legacy_idx = int(parts[0])
        if legacy_idx < 0:
            raise GroupSpecError(f"group {item!r}: group index must be >= 0")
        return _spec(legacy_idx, parts[1], parts[2:], item), True
    return _spec(idx, parts[0], parts[1:], item), False


def parse_groups(text: str, on_deprecated: Callable[[str], None] | None = None,
                 first_idx: int = 0) -> list[GroupSpec]:
    """Every item of `text` (see the module docstring), group indexes from `first_idx` in order."""
    items = [p for p in (s.strip() for s in text.split(",")) if p]
    if not items:
        raise GroupSpecError(f"no groups in {text!r}: expected {GRAMMAR} (e.g. {EXAMPLE})")
    specs = []
    for n, item in enumerate(items):
        spec, old = parse_group(item, first_idx + n)
        if old and on_deprecated is not None:
            on_deprecated(item)
        specs.append(spec)
    idxs = [s.group_idx for s in specs]
    if len(set(idxs)) != len(idxs):
        raise GroupSpecError(f"groups {text!r}: a group index repeats ({idxs})")
    return specs


def format_groups(specs: list[GroupSpec]) -> str:
    """The grammar's text for `specs` in group order (the inverse of `parse_groups`)."""
    out = []
    for s in sorted(specs, key=lambda g: g.group_idx):
        param = KIND_PARAMS.get(s.kind)
        third = getattr(s, param.field) if param is not None else None
        out.append(f"{s.kind}:{s.block_size}" + (f":{third}" if third else ""))
    return ",".join(out)
