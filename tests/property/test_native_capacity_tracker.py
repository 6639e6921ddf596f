"""The native capacity tracker (processors/analytics/nativetrack.py over native/src/captrack.rs) against the Python
one (`cputier.CapacityTracker`): the same envelope streams through a real `Ingest` and `Index(lifetimes="columns")`
each, as the analytics app applies them, every message's rows made by `derive.message_rows` with each tracker, and
node expiries by the timer through `derive.end_lifetimes`. Equal: every re-store row (distance, held blocks, end),
every event's `from_cpu_blocks`, the `restores` count; at each check, every slot (the stack's order and room, held,
the ends of the hashes it remembers) and the CPU counts.

Streams: stores, removals and clears on GPU, CPU and unnamed media, groups 0..2 and none, int and bytes hashes of a
small pool (copies in one event, removals never stored), three nodes on two partitions, new and stale epochs, gaps,
duplicates, silences past the ttl. Mid-stream a partition is forgotten, or forgotten and installed again: from the
rows `restore_state.STATE_SQL` and `cputier.REBUILD_SQL` would return for the Python tracker's state (through
`build_slots`, `build_nodes` and `restore_state.install`, as a restarted worker does), as a plain dict without CPU
counts, or as copies of the Python tracker's own slots (its stacks' order and room: the continuations must match).
Small `max_keys` so that stacks forget; the long seeded streams make slots compact thousands of times, inside events
too (where restores.py's stale view of the stack decides `held`).
"""
from __future__ import annotations

import copy
import random
from collections import defaultdict
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.nativecheck import require_native_core

require_native_core()

from kvpipe.processors.analytics import restore_state  # noqa: E402
from kvpipe.processors.analytics.cputier import CapacityTracker, build_nodes  # noqa: E402
from kvpipe.processors.analytics.derive import end_lifetimes, message_rows  # noqa: E402
from kvpipe.processors.analytics.nativetrack import NativeCapacityTracker  # noqa: E402
from kvpipe.processors.analytics.rows import FROM_CPU_AT  # noqa: E402
from kvpipe.processors.analytics.tables import EVENTS, RESTORES  # noqa: E402
from kvpipe.processors.core.index import Index  # noqa: E402
from kvpipe.processors.core.ingest import Ingest  # noqa: E402
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch  # noqa: E402
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec  # noqa: E402
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from tests.property.streams import events as event_strategy  # noqa: E402

TTL = 20.0
MAX_BYTES = 1 << 20
PARTITION = {"a": 0, "b": 1, "c": 1}
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
HASHES = st.one_of(st.integers(0, 11), st.sampled_from([2**64 - 1, -5]),
                   st.sampled_from([b"\x00" * 24 + (3).to_bytes(8, "big"), b"x" * 32]))
EVENT = event_strategy(HASHES, [None, "GPU", "GPU", "CPU", "CPU", "STORAGE"], 9)
RESTORE_KINDS = ["rows", "plain", "own", "forget"]


class Pipeline:
    """One tracker with an index and ingest of its own, fed what the app is fed."""

    def __init__(self, tracker: CapacityTracker | NativeCapacityTracker) -> None:
        self.index = Index(ttl_s=TTL, lifetimes="columns")
        self.ingest = Ingest(self.index, MAX_BYTES, 1e9)
        self.tracker = tracker

    def message(self, value: bytes, partition: int, offset: int, now: float) -> tuple[list, list | None]:
        result = self.ingest.handle(value, KAFKA_HEADERS, partition, offset, now)
        rows = message_rows(result, partition, offset, self.index, self.tracker, now)
        events = rows.get(EVENTS)
        return rows.get(RESTORES, []), events.columns[FROM_CPU_AT] if events is not None and len(events) else None

    def expire(self, now: float, partition: int) -> None:
        closed = self.index.expire(now, TTL, partition=partition)
        if len(closed):
            end_lifetimes(self.index, self.tracker, None, closed)


class Run:
    """The Python and the native pipeline side by side."""

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.py = Pipeline(CapacityTracker(max_keys))
        self.nat = Pipeline(NativeCapacityTracker(max_keys))
        self.offsets: dict[int, int] = defaultdict(int)
        self.clock = 1000.0

    def message(self, node: str, epoch: int, seq: int, dt: float, events: list, specs: bool) -> None:
        self.clock += dt
        partition = PARTITION[node]
        offset = self.offsets[partition]
        self.offsets[partition] += 1
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=self.clock, sent_ts=self.clock,
                       group_specs=SPECS if specs else None, num_events=len(events),
                       batch=msgspec.Raw(encode_vllm_batch(events, self.clock) if events else b""))
        value = encode_envelope(env)
        want = self.py.message(value, partition, offset, self.clock)
        got = self.nat.message(value, partition, offset, self.clock)
        assert got == want, (env, events)
        assert self.nat.tracker.restores == self.py.tracker.restores

    def expire(self, dt: float, partition: int) -> None:
        self.clock += dt
        self.py.expire(self.clock, partition)
        self.nat.expire(self.clock, partition)

    def restore(self, kind: str, partition: int) -> None:
        """Forget the partition in both, then (unless `forget`) install the same state in both."""
        if kind == "forget":
            self.py.tracker.forget_partition(partition)
            self.nat.tracker.forget_partition(partition)
            return
        if kind == "own":  # the Python tracker's own state, copied: it goes on as if nothing happened
            slots = {k: s for k, s in self.py.tracker.slots.items() if s.partition == partition}
            nodes = {n: c for n, c in self.py.tracker.cpu.nodes.items() if c.partition == partition}
            state = restore_state.PartitionState(slots, nodes)
            self.py.tracker.install(partition, copy.deepcopy(state))
            self.nat.tracker.install(partition, copy.deepcopy(state))
            return
        rows, cpu_rows = state_rows(self.py.tracker, partition), cpu_state_rows(self.py.tracker, partition)
        for pipe in (self.py, self.nat):  # each its own objects: the Python tracker keeps the ones it installs
            slots: Any = restore_state.build_slots(rows, self.max_keys).get(partition, {})
            if kind == "rows":
                slots = restore_state.PartitionState(slots, build_nodes(cpu_rows).get(partition))
            restore_state.install(pipe.tracker, pipe.index, {partition: slots})

    def check_state(self) -> None:
        py, nat = self.py.tracker, self.nat.tracker
        assert len(nat.slots) == len(py.slots) and nat.loaded == py.loaded
        for key, slot in py.slots.items():
            got = nat.slots[key]
            order = slot.stack.order()
            ended = {h: end for h, end in slot.ended.items() if h in slot.stack}  # the others move nothing
            assert (got.partition, got.keys, got.room, got.held, got.ended) == \
                (slot.partition, order, slot.stack.room(), slot.held, ended), key
        assert nat.cpu.unknown == py.cpu.unknown and nat.cpu.entries() == py.cpu.entries()
        want = {n: (c.epoch, c.partition, {g: h for g, h in c.groups.items() if h}) for n, c in py.cpu.nodes.items()}
        got = {n: (c.epoch, c.partition, {g: h for g, h in c.groups.items() if h}) for n, c in nat.cpu.nodes.items()}
        assert got == want


def state_rows(tracker: CapacityTracker, partition: int) -> dict[str, list]:
    """The rows STATE_SQL returns for the tracker's slots of `partition`: each remembered hash's last store, and for
    those whose lifetime ended since, the end (positions only order them)."""
    cols: dict[str, list] = defaultdict(list)
    at = 0
    for (node, group, medium), slot in tracker.slots.items():
        if slot.partition != partition:
            continue
        for h in slot.stack.order():
            at += 2
            end = slot.ended.get(h)
            for name, value in (("kafka_partition", partition), ("node_id", node), ("group_idx", group),
                                ("medium", medium), ("block_hash", h), ("stored_at", at),
                                ("ended_at", at + 1 if end else 0), ("removed_us", round(end[0] * 1e6) if end else 0),
                                ("end_reason", end[1] if end else "")):
                cols[name].append(value)
    return cols


def cpu_state_rows(tracker: CapacityTracker, partition: int) -> dict[str, list]:
    """The rows cputier.REBUILD_SQL returns for the tracker's CPU counts of `partition`."""
    cols: dict[str, list] = defaultdict(list)
    for node, copies in tracker.cpu.nodes.items():
        if copies.partition != partition:
            continue
        for group, held in copies.groups.items():
            for h, n in held.items():
                for name, value in (("kafka_partition", partition), ("node_id", node), ("epoch", copies.epoch),
                                    ("group_idx", group), ("block_hash", h), ("copies", n)):
                    cols[name].append(value)
    return cols


@st.composite
def streams(draw) -> list[tuple]:
    steps: list[tuple] = []
    seqs: dict[tuple[str, int], int] = defaultdict(int)
    for _ in range(draw(st.integers(1, 50))):
        what = draw(st.sampled_from(["msg"] * 12 + ["expire", "restore"]))
        if what == "expire":
            steps.append(("expire", draw(st.sampled_from([1.0, 30.0])), draw(st.sampled_from([0, 1]))))
        elif what == "restore":
            steps.append(("restore", draw(st.sampled_from(RESTORE_KINDS)), draw(st.sampled_from([0, 1]))))
        else:
            node = draw(st.sampled_from(["a", "b", "c"]))
            epoch = draw(st.sampled_from([1, 1, 1, 1, 2, 0]))
            seq = seqs[(node, epoch)] + draw(st.sampled_from([0, 0, 0, 1, -1]))  # mostly in order; gaps, duplicates
            seqs[(node, epoch)] = max(seq + 1, seqs[(node, epoch)])
            steps.append(("msg", node, epoch, max(seq, 0), draw(st.sampled_from([0.5, 0.5, 0.5, 25.0])),
                          draw(st.lists(EVENT, max_size=6)), seq == 0))
    return steps


def play(run: Run, steps: list[tuple]) -> None:
    for step in steps:
        if step[0] == "msg":
            run.message(*step[1:])
        elif step[0] == "expire":
            run.expire(*step[1:])
        else:
            run.restore(*step[1:])
            run.check_state()
    run.check_state()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.sampled_from([1, 2, 8, 64, 1 << 20]))
def test_rows_counts_and_state_equal_the_python_tracker(steps, max_keys):
    play(Run(max_keys), steps)


def long_stream(rng: random.Random, messages: int, pool: int) -> list[tuple]:
    """Two nodes' long lives (an epoch change, a silence past the ttl, restores now and then): stores of up to 12
    hashes of a small pool, removals of some, so that slots compact often and forget past small bounds."""
    steps: list[tuple] = []
    seqs = {"a": 0, "b": 0}
    epochs = {"a": 1, "b": 1}
    for i in range(messages):
        node = rng.choice("ab")
        if rng.random() < 0.002:
            epochs[node] += 1
            seqs[node] = 0
        events: list = []
        for _ in range(rng.randint(1, 4)):
            hashes = [rng.randrange(pool) for _ in range(rng.randint(1, 12))]
            group, medium = rng.choice([0, 0, 1, None]), rng.choice(["GPU", "GPU", "CPU", None])
            kind = rng.random()
            if kind < 0.55:
                events.append(BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16,
                                          lora_id=None, medium=medium, lora_name=None, group_idx=group))
            elif kind < 0.99:
                events.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
            else:
                events.append(AllBlocksCleared())
        dt = 25.0 if rng.random() < 0.003 else 0.1
        steps.append(("msg", node, epochs[node], seqs[node], dt, events, seqs[node] == 0))
        seqs[node] += 1
        if rng.random() < 0.003:
            steps.append(("restore", rng.choice(RESTORE_KINDS), rng.choice([0, 1])))
        if i % 500 == 499:
            steps.append(("expire", 0.0, rng.choice([0, 1])))
    return steps


@pytest.mark.parametrize("seed,max_keys,pool", [(0, 8, 40), (1, 16, 200), (2, 64, 300), (3, 3, 20)])
def test_long_streams_that_compact_and_forget_equal_the_python_tracker(seed, max_keys, pool):
    run = Run(max_keys)
    play(run, long_stream(random.Random(seed), 2500, pool))
    assert run.py.tracker.restores > 100  # the stream re-stores: the comparison compared something
