"""Node load in the analytics store: every load report the nodes publish becomes one `kv_node_load` row, and the
per-minute views and the occupancy query show, beside blocks, the report in force at the end of each minute —
checked against what the test computes on its own from what it published."""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timezone

import pytest

from tests.integration.analytics_helpers import FA, SWA, AnalyticsSession, Clock, RowModel, SimNode, removed, saved, \
    sql, stored, wait_written

pytestmark = pytest.mark.integration


class LoadModel:
    """Per node, the load reports it published: (ts, epoch, seq, running, waiting, kv_usage)."""

    def __init__(self) -> None:
        self.reports: dict[str, list[tuple]] = defaultdict(list)
        self.steps: list[tuple[str, float, list]] = []  # (node, ts, events)

    def in_force(self, node: str, before: float) -> tuple | None:
        """(running, waiting, kv_usage) of the node's latest report sent before `before`, None if none."""
        earlier = [r for r in self.reports[node] if r[0] < before]
        return max(earlier)[3:] if earlier else None


class LoadNode(SimNode):
    """A SimNode that remembers the load each envelope carried (the publisher resends the last report)."""

    def __init__(self, *args, loads: LoadModel, **kw) -> None:
        super().__init__(*args, **kw)
        self.loads, self.load, self.seq = loads, None, 0

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.pub.flush()  # envelopes already queued keep the load they were published with
        self.pub.set_load(running, waiting, kv_usage)
        self.load = (running, waiting, kv_usage)

    def step(self, *events) -> None:
        super().step(*events)
        if self.load is not None:
            self.loads.reports[self.node_id].append((self.clock.now, self.epoch, self.seq, *self.load))
        self.loads.steps.append((self.node_id, self.clock.now, list(events)))
        self.seq += 1

    def restart(self) -> None:
        super().restart()
        self.load, self.seq = None, 0  # a new publisher reports nothing until told


def test_load_rows_and_the_load_in_force_per_minute_equal_what_was_published(kafka_bootstrap, tmp_path):
    session = AnalyticsSession(kafka_bootstrap, tmp_path, partitions=2)
    model, loads, clock = RowModel(), LoadModel(), Clock(step_s=20)  # three steps a minute
    try:
        proc = session.analytics(snapshot_every_s=3600)
        a = LoadNode(session, model, clock, "node-a", loads=loads)
        b = LoadNode(session, model, clock, "node-b", loads=loads)  # never reports load
        a.step(stored([1, 2], FA), stored([1], SWA))  # before any report: NULL
        a.step(stored([3], FA))
        a.set_load(4, 0, 0.25)  # 0 waiting is a report, not a gap
        a.step(stored([4], FA))
        b.step(stored([7, 8], FA))
        a.step(removed([1], FA), stored([9], FA, "CPU"))
        a.set_load(6, 2, 0.5)
        for i in range(4):
            a.step(stored([10 + i], SWA))
        b.step(removed([7], FA))
        a.set_load(1, 0, 0.125)
        a.step(removed([2], FA))
        a.restart()  # the new publisher reports no load: the last report stays in force, minutes later too
        for i in range(4):
            a.step(stored([20 + i], FA))
        b.step(stored([30], FA))
        a.set_load(2, 3, 0.75)
        a.step(stored([24], FA))
        a.close()
        b.close()
        wait_written(proc, session.end_offsets())

        got = sql(proc, "SELECT node_id, toUnixTimestamp64Micro(ts) / 1e6 AS t, epoch, seq, running, waiting, kv_usage "
                        "FROM kv_node_load_final ORDER BY node_id, t")
        assert [(r["node_id"], r["t"], r["epoch"], r["seq"], r["running"], r["waiting"], r["kv_usage"]) for r in got] \
            == [(n, *rep) for n in sorted(loads.reports) for rep in loads.reports[n]]
        assert len(got) == 8 and "node-b" not in loads.reports

        # kv_node_minute: one row per (minute, node, group, medium) with events, the load in force at its end
        expected = {}
        for node, ts, events in loads.steps:
            minute = ts - ts % 60
            for ev in events:
                expected[(minute, node, ev.group_idx, ev.medium)] = loads.in_force(node, minute + 60)
        rows = sql(proc, "SELECT toUnixTimestamp(minute) AS m, node_id, group_idx, medium, running, waiting, kv_usage, "
                         "load_ts FROM kv_node_minute")
        got_minutes = {(r["m"], r["node_id"], r["group_idx"], r["medium"]):
                       None if r["running"] is None and r["kv_usage"] is None else
                       (r["running"], r["waiting"], r["kv_usage"]) for r in rows}
        assert got_minutes == expected
        assert {v for v in expected.values()} >= {None, (4, 0, 0.25), (6, 2, 0.5), (1, 0, 0.125), (2, 3, 0.75)}
        assert all(r["load_ts"] is None for r in rows if r["node_id"] == "node-b")

        # the occupancy query shows the same load beside the blocks, per bucket and node
        occupancy = saved(proc, "node_occupancy", {"bucket_s": 60})
        assert occupancy
        for r in occupancy:
            start = datetime.fromisoformat(r["bucket"]).replace(tzinfo=timezone.utc).timestamp()  # /sql: ISO text
            load = None if r["kv_usage"] is None else (r["running"], r["waiting"], r["kv_usage"])
            assert load == loads.in_force(r["node_id"], start + 60), r
    finally:
        session.close()
