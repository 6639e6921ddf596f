"""The CPU-tier counts the analytics app writes with each GPU store (`from_cpu_blocks`, migration 006) on real chDB.

A demo-like workload over two events partitions (CPU offload, clears, restarts, node expiries) goes through the
app's row path (`derive.message_rows` with its `cputier.CapacityTracker`) into a store. The counts equal their SQL
definition event by event; `cpu_tier_hits` on them equals a walk over the events; a worker restarted from
snapshots (counts rebuilt from the store for the snapshots' offsets) writes the same counts as one that never
stopped; and a store whose older rows carry no count (written before the migration) still answers the same.
"""
from __future__ import annotations

from collections import defaultdict

import pytest

from kvpipe.processors.analytics import restore_state
from kvpipe.processors.analytics.cputier import CapacityTracker, event_counts_sql
from kvpipe.processors.analytics.restores import RestoreTracker
from kvpipe.processors.analytics.rows import FROM_CPU_AT
from kvpipe.processors.analytics.saved import run_query
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.processors.analytics.tables import EVENTS
from kvpipe.schemas.events import BlockRemoved, BlockStored
from tests.integration.test_restore_state import Pipeline, messages

pytestmark = pytest.mark.integration

STEPS = 4000
CUT = {0: 1100, 1: 900}  # the restored snapshots' offsets, one per partition


def walk(trace) -> dict[tuple, list[int]]:
    """Independently of the app and the SQL: per (node, group), GPU stores, those whose hash had a live CPU copy
    (CPU stores minus removals of that (node, epoch, group, hash) before it), and their tokens."""
    cpu: dict[tuple, int] = defaultdict(int)
    out: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])
    for _p, _offset, env, events in trace:
        for ev in events:
            if not isinstance(ev, (BlockStored, BlockRemoved)):
                continue
            for h in ev.block_hashes:
                key = (env.node_id, env.epoch, ev.group_idx, h)
                if ev.medium == "CPU":
                    cpu[key] += 1 if isinstance(ev, BlockStored) else -1
                elif isinstance(ev, BlockStored):
                    acc = out[(env.node_id, ev.group_idx)]
                    acc[0] += 1
                    if cpu[key] > 0:
                        acc[1] += 1
                        acc[2] += ev.block_size
    return dict(out)


def answer(sink) -> dict[tuple, list[int]]:
    got = run_query(sink, "cpu_tier_hits")
    rows = [dict(zip(got["columns"], r)) for r in got["rows"]]
    return {(r["node_id"], r["group_idx"]): [r["gpu_stores"], r["from_cpu"], r["tokens_from_cpu"]] for r in rows}


class Counted(Pipeline):
    """The app's path, keeping each message's `from_cpu_blocks` column by (partition, offset)."""

    def __init__(self, tracker, index=None) -> None:
        super().__init__(tracker, index)
        self.counts: dict[tuple[int, int], list] = {}

    def apply(self, p, offset, env, events, sink=None) -> None:
        super().apply(p, offset, env, events, Capture(self.counts, (p, offset), sink))


class Capture:
    """A sink for `Pipeline.apply`: records the message's event counts, passes its rows on (if a sink is given)."""

    def __init__(self, counts: dict, key: tuple[int, int], sink) -> None:
        self.counts, self.key, self.sink = counts, key, sink

    def submit(self, rows) -> None:
        events = rows.get(EVENTS)
        if events is not None and len(events):
            self.counts[self.key] = events.columns[FROM_CPU_AT]
        if self.sink is not None:
            self.sink.submit(rows)


@pytest.fixture(scope="module")
def trace():
    return list(messages(STEPS))


def open_sink(path) -> AnalyticsSink:
    sink = AnalyticsSink(f"chdb://{path}")
    sink.start()
    return sink


def test_counts_equal_their_sql_definition_and_the_query_equals_a_walk(tmp_path, trace):
    sink = open_sink(tmp_path / "store")
    try:
        live = Counted(CapacityTracker())
        for p, offset, env, events in trace:
            live.apply(p, offset, env, events, sink)
        assert sink.flush(120)
        written = {(p, o, i): n for p, o, i, n in sink.query(
            "SELECT kafka_partition, kafka_offset, event_idx, from_cpu_blocks FROM kv_events_final "
            "WHERE medium = 'GPU' AND kind = 'stored'")["rows"]}
        defined = {(p, o, i): n for p, o, i, n in sink.query(
            f"SELECT * FROM ({event_counts_sql('kv_events_final')})")["rows"]}
        assert written == defined and sum(written.values()) > 100  # every GPU store counted, as SQL counts it
        others = sink.query("SELECT countIf(from_cpu_blocks != 0), countIf(from_cpu_blocks IS NULL) "
                            "FROM kv_events_final WHERE NOT (medium = 'GPU' AND kind = 'stored')")["rows"][0]
        assert list(others) == [0, 0]
        assert sink.query("SELECT countDistinct(epoch) FROM kv_events_final")["rows"][0][0] > 1  # restarts happened
        expected = walk(trace)
        assert answer(sink) == expected and sum(v[1] for v in expected.values()) > 100
    finally:
        sink.close()


def test_a_worker_restarted_from_snapshots_writes_the_same_counts(tmp_path, trace):
    sink = open_sink(tmp_path / "store")
    try:
        live = Counted(CapacityTracker())
        before = Counted(CapacityTracker())  # what the restored worker's index is at the cut (its snapshot)
        for p, offset, env, events in trace:
            live.apply(p, offset, env, events, sink)  # every row reaches the store, the tail past the cut too
            if offset <= CUT[p]:
                before.apply(p, offset, env, events)
        assert sink.flush(120)
        state = restore_state.query_state(sink.read_columns, dict(CUT), RestoreTracker().max_keys)
        rebuilt = CapacityTracker()
        for p in CUT:
            rebuilt.forget_partition(p)  # what the restore does first (state.AnalyticsDurability)
        restore_state.install(rebuilt, before.index, state)
        assert rebuilt.cpu.unknown == set() and rebuilt.cpu.entries() > 0
        after = Counted(rebuilt, before.index)
        for p, offset, env, events in trace:
            if offset > CUT[p]:
                after.apply(p, offset, env, events)
        expected = {k: v for k, v in live.counts.items() if k[1] > CUT[k[0]]}
        assert after.counts == expected and sum(sum(c) for c in expected.values()) > 50
    finally:
        sink.close()


def test_rows_written_before_the_counts_are_still_answered_right(tmp_path, trace):
    """Rows of the first part carry no count (NULL: before migration 006, or capacity off); then the app, restarted
    on the migrated store, rebuilds the counts from those rows and counts the rest. The query mixes both ways."""
    sink = open_sink(tmp_path / "store")
    try:
        old = Counted(RestoreTracker())  # no CPU-tier counting
        for p, offset, env, events in trace:
            if offset <= CUT[p]:
                old.apply(p, offset, env, events, sink)
        assert sink.flush(120)
        state = restore_state.query_state(sink.read_columns, dict(CUT), RestoreTracker().max_keys)
        upgraded = CapacityTracker()
        restore_state.install(upgraded, old.index, state)
        new = Counted(upgraded, old.index)
        for p, offset, env, events in trace:
            if offset > CUT[p]:
                new.apply(p, offset, env, events, sink)
        assert sink.flush(120)
        nulls, counted = sink.query("SELECT countIf(from_cpu_blocks IS NULL), countIf(from_cpu_blocks IS NOT NULL) "
                                    "FROM kv_events_final WHERE medium = 'GPU' AND kind = 'stored'")["rows"][0]
        assert nulls > 100 and counted > 100
        assert answer(sink) == walk(trace)
    finally:
        sink.close()
