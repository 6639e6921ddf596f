"""The re-store tracker rebuilt from the store equals the one that consumed the whole history.

A demo-like workload over two events partitions, with node expiries (ended by the index while a message is
applied, and by the expiry timer), clears and restarts, goes through the analytics app's own row path into a
real chDB store — all of it, also the rows after the cut, as when a worker wrote rows no snapshot covers and
then crashed. The tracker rebuilt for the cut's offsets (`restore_state`), continued over the rest, writes
exactly the re-store rows of a tracker that never stopped.
"""
from __future__ import annotations

import pytest

from kvpipe.processors.analytics import restore_state
from kvpipe.processors.analytics.derive import end_lifetimes, message_rows
from kvpipe.processors.analytics.tables import LIFETIMES, RESTORES
from kvpipe.processors.analytics.restores import RestoreTracker
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.bench.workload import serving_steps
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Result

pytestmark = pytest.mark.integration

TTL_S = 3.0  # nodes step every 2 s (4 nodes, 0.5 s apart): the pauses below expire them


def messages(steps: int):
    """`(partition, offset, env, events)`: node i on partition i % 2, offsets per partition; every 400
    steps one node pauses for 6 s of node time (its next envelope finds it expired)."""
    offsets = [0, 0]
    shift: dict[str, float] = {}
    for step, (env, events) in enumerate(serving_steps(steps, nodes=4)):
        if step % 400 == 399:
            shift[env.node_id] = shift.get(env.node_id, 0.0) + 6.0
        env.ts += shift.get(env.node_id, 0.0)
        env.sent_ts = env.ts
        p = int(env.node_id.rsplit("-", 1)[1]) % 2
        yield p, offsets[p], env, events
        offsets[p] += 1


class Pipeline:
    """The analytics app's per-message path (`derive.message_rows`) and its expiry timer, on one index and tracker."""

    def __init__(self, tracker: RestoreTracker, index: Index | None = None) -> None:
        self.index = index or Index(ttl_s=TTL_S)
        self.tracker = tracker
        self.restores: list = []

    def apply(self, p: int, offset: int, env, events, sink=None) -> None:
        outcome, closed = self.index.apply(env, events, p, offset)
        rows = message_rows(Result(outcome, env, events, closed), p, offset, self.index, self.tracker, env.ts)
        self.restores += rows.get(RESTORES, [])
        if sink is not None:
            sink.submit(rows)
        if offset % 50 == 49:  # the timer: nodes silent past the TTL by this partition's clock
            expired = self.index.expire(env.ts, partition=p)
            end_lifetimes(self.index, self.tracker, None, expired)
            if sink is not None:
                sink.submit({LIFETIMES: expired})


def test_the_rebuilt_tracker_continues_exactly_like_the_uninterrupted_one(tmp_path):
    trace = list(messages(4000))
    cut = {0: 1100, 1: 900}  # the restored snapshots' offsets, one per partition
    sink = AnalyticsSink(f"chdb://{tmp_path / 'store'}")
    sink.start()
    try:
        live = Pipeline(RestoreTracker())
        before = Pipeline(RestoreTracker())  # what the restored worker's index is at the cut (its snapshot)
        after: Pipeline | None = None
        for p, offset, env, events in trace:
            live.apply(p, offset, env, events, sink)  # every row reaches the store, the tail past the cut too
            if offset <= cut[p]:
                before.apply(p, offset, env, events)
        assert sink.flush(120)
        reasons = dict(sink.query("SELECT end_reason, count() FROM kv_block_lifetimes_final GROUP BY end_reason")["rows"])
        assert {"evicted", "cleared", "epoch_change", "node_expired"} <= set(reasons), reasons

        state = restore_state.query_state(sink.read_columns, dict(cut), RestoreTracker().max_keys)
        rebuilt = RestoreTracker()
        restore_state.install(rebuilt, before.index, state)
        assert rebuilt.loaded == {0, 1} and restore_state.restore_info(state)["ended"] > 0
        after = Pipeline(rebuilt, before.index)
        expected = [r for r in live.restores if r.offset > cut[r.partition]]
        for p, offset, env, events in trace:
            if offset > cut[p]:
                after.apply(p, offset, env, events)
        assert len(expected) > 500 and {r.end_reason for r in expected} >= {"evicted", "node_expired"}
        assert after.restores == expected  # same rows, delays, distances, held blocks, in the same order
    finally:
        sink.close()


def test_a_partition_with_no_snapshot_rebuilds_empty_and_a_missing_store_row_is_no_state(tmp_path):
    sink = AnalyticsSink(f"chdb://{tmp_path / 'store'}")
    sink.start()
    try:
        state = restore_state.query_state(sink.read_columns, {0: -1, 3: 10}, 1 << 20)
        assert state == {0: {}, 3: {}}
        tracker = RestoreTracker()
        tracker.slots[("gone", 0, "GPU")] = restore_state.Slot(8, partition=3)
        restore_state.install(tracker, Index(ttl_s=None), state)
        assert tracker.slots == {} and tracker.loaded == {0, 3}  # the partition's old state is dropped
    finally:
        sink.close()
