"""CPU-tier counts across analytics restarts: a GPU store of a hash whose CPU copy was stored before the worker
stopped (or was killed) is counted as loaded from CPU after it restarted — the counts are rebuilt from the store for
the restored snapshot's offset (processors/analytics/cputier.py, restore_state.py), and a replayed message gets the
count it got the first time. Real broker, real chDB, `kvpipe analytics` as a child process."""
from __future__ import annotations

import pytest

from tests.integration.analytics_helpers import FA, AnalyticsSession, Clock, RowModel, SimNode, removed, saved, sql, \
    stored, wait_written

pytestmark = pytest.mark.integration

COUNTS_SQL = ("SELECT node_id, kafka_offset, event_idx, from_cpu_blocks FROM kv_events_final "
              "WHERE medium = 'GPU' AND kind = 'stored' ORDER BY node_id, kafka_offset, event_idx")


def counts(proc) -> list[tuple]:
    return [(r["node_id"], r["from_cpu_blocks"]) for r in sql(proc, COUNTS_SQL)]


def test_cpu_copies_stored_before_a_restart_count_after_it(kafka_bootstrap, tmp_path):
    session = AnalyticsSession(kafka_bootstrap, tmp_path, partitions=2)
    model, clock = RowModel(), Clock(step_s=5)
    a, b = SimNode(session, model, clock, "node-a"), SimNode(session, model, clock, "node-b")
    try:
        proc = session.analytics(snapshot_every_s=3600)  # snapshots only at shutdown (and at revocation)
        a.step(stored([40, 41], FA, "CPU"), stored([40, 50], FA))  # 40 has a CPU copy, 50 none
        b.step(stored([40], FA))  # another node's CPU tier
        for node in (a, b):
            node.pub.flush()
        wait_written(proc, session.end_offsets())
        assert counts(proc) == [("node-a", 1), ("node-b", 0)]
        proc.stop()  # the shutdown snapshot covers everything so far

        # -- after a graceful restart: the CPU copies of 40 and 41 are known only from the store's rows ----------
        proc = session.analytics(snapshot_every_s=3600)
        a.step(stored([41, 40], FA))
        a.step(removed([41], FA, "CPU"), stored([42], FA, "CPU"))
        a.step(stored([41, 42], FA))  # 41's copy is gone, 42's is new
        a.pub.flush()
        stats = wait_written(proc, session.end_offsets())
        assert stats["counters"]["messages"] == 3, "restored from the shutdown snapshot: only the new messages"
        assert counts(proc) == [("node-a", 1), ("node-a", 2), ("node-a", 1), ("node-b", 0)]
        proc.kill()  # no snapshot covers the last three messages: the next worker replays them

        proc = session.analytics(snapshot_every_s=3600)
        wait_written(proc, session.end_offsets())
        a.step(stored([40, 41, 42], FA))
        a.pub.flush()
        wait_written(proc, session.end_offsets())
        assert counts(proc) == [("node-a", 1), ("node-a", 2), ("node-a", 1), ("node-a", 2), ("node-b", 0)]
        answer = {(r["node_id"], r["group_idx"]): (r["gpu_stores"], r["from_cpu"], r["tokens_from_cpu"])
                  for r in saved(proc, "cpu_tier_hits")}
        assert answer == {("node-a", FA): (9, 6, 6 * 16), ("node-b", FA): (1, 0, 0)}
    finally:
        a.close()
        b.close()
        session.close()
