"""The CPU-tier counts the analytics app writes (`from_cpu_blocks`, processors/analytics/cputier.py) equal a plain walk
on random envelope streams: per (node, epoch, group, u64 hash) the CPU tier's stores minus its removals so far, over
the events of every message the index applied, and each GPU store's hashes with a count above 0. Streams mix int
and bytes hashes (one u64 for both), copies in one event, removals never stored, clears, groups, media (None
too), new and stale epochs, duplicates and gaps, on two partitions; now and then a partition's counts are dropped
and reinstalled from the walk's own counts (what a restore rebuilds from the store)."""
from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.processors.analytics.cputier import CapacityTracker, NodeCopies
from kvpipe.processors.analytics.derive import message_rows
from kvpipe.processors.analytics.rows import FROM_CPU_AT
from kvpipe.processors.analytics.tables import EVENTS
from kvpipe.processors.core.index import APPLIED, Index
from kvpipe.processors.core.lifetimes import hash_to_u64
from kvpipe.processors.core.outcomes import Result
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import BlockRemoved, BlockStored
from tests.property.streams import events as event_strategy

HASHES = st.one_of(st.integers(0, 6), st.just(2**64 + 3),
                   st.sampled_from([b"\x00" * 24 + (3).to_bytes(8, "big"), b"x" * 32]))
EVENT = event_strategy(HASHES, [None, "GPU", "GPU", "CPU", "CPU"], 9)


@st.composite
def stream(draw):
    out = []
    seqs: dict[tuple[str, int], int] = defaultdict(int)
    for _ in range(draw(st.integers(1, 40))):
        node = draw(st.sampled_from(["a", "b", "c"]))
        epoch = draw(st.sampled_from([1, 1, 1, 1, 2, 0]))
        seq = seqs[(node, epoch)] + draw(st.sampled_from([0, 0, 0, 1, -1]))  # mostly in order; gaps, duplicates
        seqs[(node, epoch)] = max(seq + 1, seqs[(node, epoch)])
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=max(seq, 0), ts=1.0, sent_ts=1.0)
        out.append((env, draw(st.lists(EVENT, max_size=6)), draw(st.sampled_from([False] * 8 + [True]))))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream())
def test_counts_equal_a_walk_over_the_applied_events(messages):
    index = Index(ttl_s=None)  # never forgets a node: an older epoch is never applied again
    tracker = CapacityTracker()
    copies: dict[tuple, int] = defaultdict(int)  # the walk: (node, epoch, group, hash) → CPU copies
    latest: dict[str, int] = {}  # node → epoch of its latest applied message
    for offset, (env, events, restore) in enumerate(messages):
        partition = 0 if env.node_id == "a" else 1
        if restore:  # the partition's counts dropped, then installed as rebuilt for this offset
            tracker.forget_partition(partition)
            tracker.install(partition, _rebuilt(copies, latest, partition))
        outcome, closed = index.apply(env, events, partition, offset)
        rows = message_rows(Result(outcome, env, events, closed), partition, offset, index, tracker, 1.0)
        if outcome != APPLIED:
            assert EVENTS not in rows
            continue
        latest[env.node_id] = env.epoch
        expected = []
        for ev in events:
            n = 0
            if isinstance(ev, (BlockStored, BlockRemoved)):
                group = -1 if ev.group_idx is None else ev.group_idx
                for h in ev.block_hashes:
                    key = (env.node_id, env.epoch, group, hash_to_u64(h))
                    if ev.medium == "CPU":
                        copies[key] += 1 if isinstance(ev, BlockStored) else -1
                    elif ev.medium == "GPU" and isinstance(ev, BlockStored) and copies[key] > 0:
                        n += 1
            expected.append(n)
        got = rows[EVENTS].columns[FROM_CPU_AT] if events else []
        assert got == expected, (env, events)


def _rebuilt(copies: dict[tuple, int], latest: dict[str, int], partition: int):
    """The walk's counts of this partition's nodes in their latest epoch, as `restore_state` hands them over."""
    from kvpipe.processors.analytics.restore_state import PartitionState

    nodes: dict[str, NodeCopies] = {}
    for (node, epoch, group, h), n in copies.items():
        if n and latest.get(node) == epoch and (0 if node == "a" else 1) == partition:
            nodes.setdefault(node, NodeCopies(epoch, partition)).groups.setdefault(group, {})[h] = n
    return PartitionState({}, nodes)
