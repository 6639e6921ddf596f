"""Re-stores across analytics restarts: a block evicted before the worker stopped (or was killed) and stored
again after it restarted is a re-store, written once, with the delay and LRU stack distance an uninterrupted
worker would have written — the tracker is rebuilt from the store for the restored snapshot's offset
(processors/analytics/restore_state.py). Real broker, real chDB, `kvpipe analytics` as a child process; the
expected rows come from the test's own model (tests/integration/analytics_helpers.RowModel)."""
from __future__ import annotations

import pytest

from tests.integration.analytics_helpers import FA, SWA, AnalyticsSession, Clock, RowModel, SimNode, removed, sql, \
    stored, wait_written

pytestmark = pytest.mark.integration

RESTORE_SQL = ("SELECT node_id, group_idx, medium, block_hash, delay_s, end_reason, stack_distance "
               "FROM kv_restores_final")


def flush(*nodes: SimNode) -> None:
    for node in nodes:
        node.pub.flush()


def restore_rows(proc) -> list[tuple]:
    return sorted(tuple(r.values()) for r in sql(proc, RESTORE_SQL))


def test_a_block_evicted_before_a_restart_and_stored_after_it_is_one_re_store(kafka_bootstrap, tmp_path):
    session = AnalyticsSession(kafka_bootstrap, tmp_path, partitions=2)
    model, clock = RowModel(), Clock(step_s=5)
    a, b = SimNode(session, model, clock, "node-a"), SimNode(session, model, clock, "node-b")
    try:
        # -- before the restart: stores and evictions, no re-store yet ----------------------------------------
        proc = session.analytics(snapshot_every_s=3600)  # snapshots only at shutdown (and at revocation)
        a.step(stored([1, 2, 3, 4, 5, 6], FA), stored([1, 2], SWA), stored([40, 41], FA, "CPU"))
        b.step(stored([9, 10, 11], FA))
        a.step(removed([1, 2], FA), removed([1], SWA), removed([40], FA, "CPU"))
        b.step(removed([9], FA))
        a.step(stored([7], FA))
        flush(a, b)
        wait_written(proc, session.end_offsets())
        assert model.restores == [] and restore_rows(proc) == []
        proc.stop()  # the shutdown snapshot covers everything so far

        # -- after a graceful restart: the evicted blocks come back ------------------------------------------
        proc = session.analytics(snapshot_every_s=3600)
        a.step(stored([1], FA), stored([1], SWA), stored([40], FA, "CPU"))  # FA 1: 2..7 stored since → distance 6
        b.step(stored([9], FA))
        flush(a, b)
        stats = wait_written(proc, session.end_offsets())
        assert stats["counters"]["messages"] == 2, "restored from the shutdown snapshot: only the new messages"
        assert len(model.restores) == 4 and {r[5] for r in model.restores} == {"evicted"}
        assert restore_rows(proc) == sorted(model.restores)
        rebuilt = stats["restore_tracker"]["rebuilds"]
        assert sum(r["hashes"] for r in rebuilt) > 0 and sorted(stats["restore_tracker"]["loaded_partitions"]) == [0, 1]

        # -- rows written past the last snapshot, then SIGKILL: the restart replays them ----------------------
        a.step(removed([3], FA), removed([1], SWA))
        a.step(stored([2], FA))  # evicted before the first restart, back now
        b.step(removed([10], FA))
        flush(a, b)
        stats = wait_written(proc, session.end_offsets())
        assert stats["durability"]["snapshots"] == 0, "no snapshot covers these rows"
        assert restore_rows(proc) == sorted(model.restores)
        proc.kill()

        proc = session.analytics(snapshot_every_s=3600)
        stats = wait_written(proc, session.end_offsets())
        assert stats["counters"]["messages"] == 5, "the tail since the shutdown snapshot was replayed"
        assert stats["sink"]["kv_restores_written"] == 5, "... and its re-stores written again (collapsed by FINAL)"
        a.step(stored([3], FA), stored([1], SWA))  # evicted in the replayed tail, back after the kill
        b.step(stored([10], FA))
        flush(a, b)
        wait_written(proc, session.end_offsets())
        rows = restore_rows(proc)
        assert rows == sorted(model.restores) and len(rows) == 8  # each once, delays and distances as uninterrupted
        assert ("node-a", FA, "GPU", 1, 15.0, "evicted", 6) in rows
    finally:
        a.close()
        b.close()
        session.close()
