"""Block lifetimes as columns: `LifetimeRow`'s fields, one list each, filled a store call at a time.

The analytics app's path (`Index(lifetimes="columns")`). The index hands every store answer (the keys
and store times a `remove`, `close` or native run returns, already lists) over whole: each column is
extended once per answer, by the answer's list or a repeated value, so no object is made per ended
block. The derive steps (`restores.refine_reason_columns`, `set_group_kinds`, `number_copies`) and the sink's
conversion (`insert_columns`) work on whole columns too. The row path (`LifetimeRow` lists,
`rows.number_copies`, `rows.lifetime_columns`, `restores.refine_reasons`) stays the readable reference
of the same values; tests/property/test_lifetime_columns.py holds the two equal.

Columns `copy_idx`, `group_kind` and `end_reason` are derived after the index is done with the
lifetimes; until a step sets one it is None, meaning the row default (0, "", "") for every row.
"""
from __future__ import annotations

from itertools import repeat
from operator import sub
from typing import Callable, Iterable, Mapping

import msgspec

from kvpipe.schemas.events import ExternalHash

U64_MASK = (1 << 64) - 1
U32_MASK = (1 << 32) - 1

REASON_EVICTED = "evicted"
REASON_CLEARED = "cleared"
REASON_NODE_EXPIRED = "node_expired"


def hash_to_u64(h: ExternalHash) -> int:
    """A vLLM block hash as ClickHouse UInt64.

    Ints are vLLM's external form already (last 8 digest bytes, big-endian); masking keeps a
    stray negative or wider int in range instead of failing the whole insert. Bytes get vLLM's own
    conversion (`maybe_convert_block_hash`): the last 8 bytes, big-endian.
    """
    if isinstance(h, int):
        return h & U64_MASK
    return int.from_bytes(h[-8:], "big")


class LifetimeRow(msgspec.Struct, gc=False):
    """One block lifetime on one node, group and medium: stored → removed.

    `(partition, offset, idx)` are the coordinates of the event that ended the lifetime (for
    `node_expired`, whatever deterministic message the processor attributes the expiry to); with
    `block_hash` they identify the row, since one AllBlocksCleared ends many lifetimes.
    """

    node_id: str
    epoch: int
    group_idx: int
    medium: str
    block_hash: int  # u64
    stored_ts: float
    removed_ts: float
    reason: str  # REASON_EVICTED | REASON_CLEARED | REASON_NODE_EXPIRED
    partition: int
    offset: int
    idx: int  # -1: ended before the message's events (a new epoch's clear, a node expiry); see lifetime_columns
    copy_idx: int = 0  # set by the sink (number_copies); see there
    group_kind: str = ""  # the group's spec kind, set by the analytics app from the node's specs
    end_reason: str = ""  # `reason` refined by the analytics app (restores.refine_reasons); "" = same as reason




BASE_FIELDS = ("node_id", "epoch", "group_idx", "medium", "block_hash", "stored_ts", "removed_ts", "reason",
               "partition", "offset", "idx")
DERIVED_DEFAULTS = (("copy_idx", 0), ("group_kind", ""), ("end_reason", ""))
FIELDS = BASE_FIELDS + tuple(name for name, _ in DERIVED_DEFAULTS)
_DEFAULT = dict(DERIVED_DEFAULTS)
assert FIELDS == LifetimeRow.__struct_fields__, "LifetimeColumns must carry exactly LifetimeRow's fields"


class LifetimeColumns:
    """Ended lifetimes as parallel lists in `LifetimeRow` field order. Row i is
    `LifetimeRow(*(column[i] for column in the columns))`; `rows()` builds exactly that."""

    __slots__ = FIELDS

    def __init__(self) -> None:
        self.node_id: list[str] = []
        self.epoch: list[int] = []
        self.group_idx: list[int] = []
        self.medium: list[str] = []
        self.block_hash: list[int] = []
        self.stored_ts: list[float] = []
        self.removed_ts: list[float] = []
        self.reason: list[str] = []
        self.partition: list[int] = []
        self.offset: list[int] = []
        self.idx: list[int] = []
        self.copy_idx: list[int] | None = None
        self.group_kind: list[str] | None = None
        self.end_reason: list[str] | None = None

    def __len__(self) -> int:
        return len(self.block_hash)

    # -- filled by the index, one store answer at a time ------------------------------------------

    def add(self, node_id: str, epoch: int, group: int, medium: str, keys: list[int], times: list[float],
            removed_ts: float, reason: str, partition: int, offset: int, idx: int) -> None:
        """The lifetimes one slot's `remove` or `close` ended (all of one event, or before the events)."""
        n = len(keys)
        if not n:
            return
        self.node_id += [node_id] * n
        self.epoch += [epoch] * n
        self.group_idx += [group] * n
        self.medium += [medium] * n
        self.block_hash += keys
        self.stored_ts += times
        self.removed_ts += [removed_ts] * n
        self.reason += [reason] * n
        self.partition += [partition] * n
        self.offset += [offset] * n
        self.idx += [idx] * n

    def add_run(self, node_id: str, epoch: int, groups: list[int], media: list[str], keys: list[int],
                times: list[float], removed_ts: float, reason: str, partition: int, offset: int,
                idxs: list[int]) -> None:
        """The lifetimes a native run ended: per row its own slot's group and medium and event index."""
        n = len(keys)
        if not n:
            return
        self.node_id += [node_id] * n
        self.epoch += [epoch] * n
        self.group_idx += groups
        self.medium += media
        self.block_hash += keys
        self.stored_ts += times
        self.removed_ts += [removed_ts] * n
        self.reason += [reason] * n
        self.partition += [partition] * n
        self.offset += [offset] * n
        self.idx += idxs

    # -- as lists of columns ----------------------------------------------------------------------

    def column(self, name: str) -> list:
        """A column by field name, a derived one filled with its default if no step set it."""
        got = getattr(self, name)
        if got is None:
            got = [_DEFAULT[name]] * len(self.block_hash)
        return got

    def columns(self) -> list[list]:
        return [self.column(name) for name in FIELDS]

    @classmethod
    def of(cls, columns: Iterable[list | None]) -> "LifetimeColumns":
        out = cls.__new__(cls)
        for name, values in zip(FIELDS, columns, strict=True):
            setattr(out, name, values)
        return out

    @classmethod
    def from_rows(cls, rows: list[LifetimeRow]) -> "LifetimeColumns":
        """The rows' values as columns (a reference-path list handed to the sink)."""
        return cls.of([getattr(r, name) for r in rows] for name in FIELDS)

    def rows(self) -> list[LifetimeRow]:
        """One `LifetimeRow` per lifetime: the reference form (tests; the derive steps do not need it)."""
        return [LifetimeRow(*values) for values in zip(*self.columns())]

    def extend(self, other: "LifetimeColumns") -> None:
        """Append `other`'s rows (derived columns made concrete on this side). Unrolled: the sink's
        writer calls it once per message."""
        m = len(self.block_hash)
        copy_idx = [0] * m if self.copy_idx is None else self.copy_idx
        group_kind = [""] * m if self.group_kind is None else self.group_kind
        end_reason = [""] * m if self.end_reason is None else self.end_reason
        self.node_id += other.node_id
        self.epoch += other.epoch
        self.group_idx += other.group_idx
        self.medium += other.medium
        self.block_hash += other.block_hash
        self.stored_ts += other.stored_ts
        self.removed_ts += other.removed_ts
        self.reason += other.reason
        self.partition += other.partition
        self.offset += other.offset
        self.idx += other.idx
        n = len(other.block_hash)
        copy_idx += [0] * n if other.copy_idx is None else other.copy_idx
        group_kind += [""] * n if other.group_kind is None else other.group_kind
        end_reason += [""] * n if other.end_reason is None else other.end_reason
        self.copy_idx, self.group_kind, self.end_reason = copy_idx, group_kind, end_reason

    def __getitem__(self, rows: slice) -> "LifetimeColumns":
        return LifetimeColumns.of(c[rows] for c in self.columns())

    def __delitem__(self, rows: slice) -> None:
        for name in FIELDS:
            got = getattr(self, name)
            if got is not None:
                del got[rows]

    def take(self, order: list[int]) -> "LifetimeColumns":
        """The rows in `order` (a permutation of row numbers)."""
        return LifetimeColumns.of(None if c is None else [c[i] for i in order]
                                  for c in (getattr(self, name) for name in FIELDS))

    def insert_columns(self) -> list[list]:
        """Column-oriented data in LIFETIME_COLUMNS order: `rows.lifetime_columns(self.rows())`, with
        the per-row arithmetic done by C-level maps where the values allow."""
        stored, removed, reason, idx = self.stored_ts, self.removed_ts, self.reason, self.idx
        end_reason = self.end_reason
        # times repeat (a message's blocks share its ts): each distinct one converted once (rows._us)
        stored_us = {t: round(t * 1_000_000) for t in set(stored)}
        removed_us = {t: round(t * 1_000_000) for t in set(removed)}
        return [
            self.node_id,
            self.epoch,
            self.group_idx,
            self.medium,
            self.block_hash,
            list(map(stored_us.__getitem__, stored)),
            list(map(removed_us.__getitem__, removed)),
            list(map(sub, removed, stored)),
            reason,
            self.partition,
            self.offset,
            # UInt32 event_idx: -1 as 2^32-1 (rows.lifetime_columns says why)
            [i & U32_MASK for i in idx] if idx and min(idx) < 0 else idx,
            self.column("copy_idx"),
            self.column("group_kind"),
            reason if end_reason is None else end_reason if "" not in end_reason
            else [e or r for e, r in zip(end_reason, reason)],
        ]


# -- the analytics app's derive steps on columns (the row versions: derive.message_rows / end_lifetimes,
#    rows.number_copies; the reasons' is `restores.refine_reason_columns`, beside its row version) ---


def set_group_kinds(cols: LifetimeColumns, kinds_of: Callable[[str], Mapping[int, tuple[str, int]]]) -> None:
    """`group_kind` per row from its node's specs (`kinds_of(node_id)`: group → (kind, block size))."""
    nodes = cols.node_id
    n = len(nodes)
    if not n:
        cols.group_kind = []
        return
    first = nodes[0]
    if nodes.count(first) == n:  # the usual case: one message's node, one mapping
        kinds = kinds_of(first)
        groups = cols.group_idx
        if groups.count(groups[0]) == n:
            cols.group_kind = [kinds.get(groups[0], ("", 0))[0]] * n
        else:
            kind = {g: k for g, (k, _) in kinds.items()}
            cols.group_kind = list(map(kind.get, groups, repeat("")))
        return
    per_node = {node: {g: k for g, (k, _) in kinds_of(node).items()} for node in set(nodes)}
    cols.group_kind = [per_node[n].get(g, "") for n, g in zip(nodes, cols.group_idx)]


def number_copies(cols: LifetimeColumns) -> None:
    """`rows.number_copies` on columns: `copy_idx`, the ordinal of each row among the rows with the same key.
    Copies are rare, so sets (built without Python code per row) decide: distinct hashes, or else distinct
    keys, mean every ordinal is 0; only when two rows share a key are the ordinals counted one by one."""
    n = len(cols.block_hash)
    if len(set(cols.block_hash)) == n:
        cols.copy_idx = [0] * n
        return
    keys = list(zip(cols.node_id, cols.group_idx, cols.medium, cols.block_hash, cols.partition, cols.offset,
                    cols.idx))
    if len(set(keys)) == len(keys):
        cols.copy_idx = [0] * len(keys)
        return
    seen: dict[tuple, int] = {}
    out = []
    for key in keys:
        n = seen.get(key, 0)
        out.append(n)
        seen[key] = n + 1
    cols.copy_idx = out
