"""The analytics app's capacity tracker on the native core: `NativeCapacityTracker`, a drop-in for
`cputier.CapacityTracker` (re-stores with their LRU stack distances, `restores`; the CPU tier's copies behind
`from_cpu_blocks`, `cputier`) whose state lives in `kvpipe_native.CapacityCore` (native/src/captrack.rs).

Why: the Python tracker's dict work per stored hash and per ended lifetime was ~0.4 s of the event loop per 12k
messages of the analytics bench. A native ingest run calls the same `CapacityCore` from Rust for the common
messages; the others come here through `derive.message_rows`, one call per message, so both paths move one state.

The Python classes stay the reference: tests/property/test_native_capacity_tracker.py feeds both the same streams
through `message_rows` and holds rows, counts and state equal. Importable only where the native core runs
(`kvpipe.processors.core.native`): elsewhere the import raises ImportError with the reason.
"""
from __future__ import annotations

from typing import Iterator, Mapping, NamedTuple, Sequence, cast

from kvpipe.processors.analytics.cputier import CapacityTracking, NodeCopies
from kvpipe.processors.analytics.restores import RestoreRow, Slot, SlotKey
from kvpipe.processors.core import native
from kvpipe.processors.core.lifetimes import LifetimeColumns, LifetimeRow
from kvpipe.schemas.envelope import Envelope
from kvpipe.schemas.events import BlockRemoved, BlockStored, Event

try:
    native.require("the native capacity tracker")
except native.NativeUnavailable as exc:
    raise ImportError(str(exc)) from exc

_NO_KIND = ("", 0)


class SlotState(NamedTuple):
    """One slot as the native state holds it (the state a `restores.Slot` describes)."""

    partition: int
    keys: list[int]  # the stack's remembered hashes, least recently stored first (`StackDistance.order`)
    room: int  # stores before the stack next compacts (`StackDistance.room`)
    ended: dict[int, tuple[float, str]]  # of those hashes, the ones whose last lifetime ended: (removed_ts, reason)
    held: int
    forgotten: int  # hashes the stack dropped past max_keys


class NativeSlots:
    """The tracker's slots, read from the native state: `len`, the keys, and each slot's `SlotState` (a copy)."""

    def __init__(self, core: native.CapacityCore) -> None:
        self._core = core

    def __len__(self) -> int:
        return len(self._core)

    def __iter__(self) -> Iterator[SlotKey]:
        return iter(self._core.slot_keys())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 3 and self._core.slot_state(*key) is not None

    def __getitem__(self, key: SlotKey) -> SlotState:
        got = self._core.slot_state(*key)
        if got is None:
            raise KeyError(key)
        return SlotState(*got)

    def items(self) -> list[tuple[SlotKey, SlotState]]:
        return [(key, self[key]) for key in self]


class NativeCpuTier:
    """`cputier.CpuTier`'s calls on the native state (the counts live in the tracker's `CapacityCore`)."""

    def __init__(self, core: native.CapacityCore) -> None:
        self._core = core

    def observe(self, env: Envelope, events: Sequence[Event], hashes: Sequence[list[int]],
                partition: int) -> list[int] | list[None]:
        return self._core.cpu_observe(env.node_id, env.epoch, partition, _as_list(events), _as_list(hashes))

    def forget_partition(self, partition: int) -> None:
        self._core.cpu_forget_partition(partition)

    def install(self, partition: int, nodes: dict[str, NodeCopies]) -> None:
        self._core.cpu_install(partition, nodes)

    def entries(self) -> int:
        return self._core.cpu_entries()

    @property
    def unknown(self) -> set[int]:
        return set(self._core.cpu_unknown())

    @property
    def nodes(self) -> dict[str, NodeCopies]:
        """The counts per node, copied out (`CpuTier.nodes`' shape)."""
        return {node: NodeCopies(epoch, partition, groups)
                for node, epoch, partition, groups in self._core.cpu_nodes()}


class NativeCapacityTracker(CapacityTracking):
    """`cputier.CapacityTracker`'s calls and attributes on the native state. `loaded` stays here: only the agents
    read it. `slots` is a read-only view (`NativeSlots`); the state changes through the calls."""

    def __init__(self, max_keys_per_slot: int = 1 << 20) -> None:
        self.max_keys = max_keys_per_slot
        self.core = native.capacity_core(max_keys_per_slot, BlockStored, BlockRemoved)
        self.loaded: set[int] = set()
        self.cpu = NativeCpuTier(self.core)
        self.slots = NativeSlots(self.core)

    @property
    def restores(self) -> int:
        return self.core.restores

    def observe(self, env: Envelope, events: list[Event], lifetimes: list[LifetimeRow] | LifetimeColumns,
                partition: int, offset: int, kinds: Mapping[int, tuple[str, int]]) -> list[RestoreRow]:
        """`RestoreTracker.observe`: the re-stores of one applied message, its lifetimes walked in event order."""
        ends = _columns(lifetimes)
        got = self.core.observe(env.node_id, partition, _as_list(events), ends if len(ends) else None)
        if not got:
            return []
        node, epoch, ts = env.node_id, env.epoch, env.ts
        return [RestoreRow(node, epoch, group, kinds.get(group, _NO_KIND)[0], medium, h,
                           size or kinds.get(group, _NO_KIND)[1], removed_ts, ts, reason, distance, held,
                           partition, offset, idx)
                for idx, group, medium, size, h, removed_ts, reason, distance, held in got]

    def end_all(self, lifetimes: list[LifetimeRow] | LifetimeColumns) -> None:
        """Lifetimes ended outside a message (a node expiry by the timer)."""
        ends = _columns(lifetimes)
        if len(ends):
            self.core.end_all(ends)

    def forget_node(self, node_id: str) -> None:
        self.core.forget_node(node_id)

    def forget_partition(self, partition: int) -> None:
        """Drop one events partition's slots and CPU counts (revoked, or about to be rebuilt)."""
        self.core.forget_partition(partition)
        self.loaded.discard(partition)

    def install(self, partition: int, slots: dict[SlotKey, Slot]) -> None:
        """`CapacityTracker.install`: replace one partition's state with `slots` (a `restore_state.PartitionState`
        brings the CPU counts as `cpu`; a plain dict none, the partition's events then counting None). Each slot is
        copied in with its stack's order, room and bound, so it forgets what the Python stack would, when it would."""
        self.forget_partition(partition)
        for (node, group, medium), slot in slots.items():
            stack = slot.stack
            keys = cast(list[int], stack.order())  # a slot's stack holds u64 hashes (restores.py `_stored`)
            self.core.install_slot(node, group, medium, slot.partition, keys, stack.room(), slot.ended, slot.held,
                                   stack.max_keys)
        self.loaded.add(partition)
        cpu = getattr(slots, "cpu", None)
        if cpu is not None:
            self.cpu.install(partition, cpu)


def _columns(lifetimes: list[LifetimeRow] | LifetimeColumns) -> LifetimeColumns:
    return lifetimes if isinstance(lifetimes, LifetimeColumns) else LifetimeColumns.from_rows(lifetimes)


def _as_list(items: Sequence) -> list:
    return items if isinstance(items, list) else list(items)
