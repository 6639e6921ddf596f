"""The analytics app writes the capacity rows the events imply: re-stores (delay, end reason, LRU stack
distance) and refined end reasons, checked against the test's own model (tests/integration/analytics_helpers)."""
from __future__ import annotations

import pytest

from kvpipe.schemas.events import AllBlocksCleared
from tests.integration.analytics_helpers import FA, KIND_OF_GROUP, SWA, AnalyticsSession, Clock, RowModel, SimNode, \
    removed, sql, stored, wait_written

pytestmark = pytest.mark.integration


def test_re_stores_and_end_reasons_equal_what_the_events_imply(kafka_bootstrap, tmp_path):
    session = AnalyticsSession(kafka_bootstrap, tmp_path, partitions=2)
    model, clock = RowModel(), Clock(step_s=7)
    try:
        proc = session.analytics(snapshot_every_s=3600)
        a, b = SimNode(session, model, clock, "node-a"), SimNode(session, model, clock, "node-b")
        a.step(stored([1, 2, 3, 4, 5, 6], FA), stored([1, 2], SWA))
        a.step(removed([1, 2], FA), removed([1], SWA))
        a.step(stored([7], FA), stored([1], FA))  # 1 again: 2..7 stored since its first store → distance 6
        a.step(removed([1], FA), stored([1], FA), stored([1], SWA))  # removed and back in one message: 0 s
        a.step(stored([40, 41], FA, "CPU"), removed([40], FA, "CPU"))
        a.step(stored([40], FA, "CPU"))  # the CPU tier re-stores too (distance 1: 41)
        a.step(AllBlocksCleared())  # GPU entries end as `cleared`; the CPU tier stays
        a.step(stored([2, 3], FA))  # back after the clear
        b.step(stored([9, 10], FA), stored([9], SWA), stored([50], FA, "CPU"))
        b.restart()
        b.step(stored([10, 9], FA), stored([50], FA, "CPU"))  # back after the restart: `epoch_change`
        a.close()
        b.close()
        wait_written(proc, session.end_offsets())
        # the default delivery: every message reached the row path in a partition's run, none one by one
        deliveries = proc.get("/stats")["deliveries"]
        assert deliveries["batched"] == sum(session.end_offsets().values()) and deliveries["direct"] == 0, deliveries
        got = sql(proc, "SELECT node_id, group_idx, medium, block_hash, delay_s, end_reason, stack_distance, "
                        "group_kind FROM kv_restores_final ORDER BY node_id, restored_ts, event_idx, block_hash")
        assert sorted(tuple(r.values())[:7] for r in got) == sorted(model.restores)
        # a: FA 1 twice, SWA 1, CPU 40, FA 2 (evicted) and 3 (cleared); b: FA 10, 9 and CPU 50 (epoch_change)
        assert len(model.restores) == 9
        assert all(r["group_kind"] == KIND_OF_GROUP[r["group_idx"]] for r in got)
        assert {r[5] for r in model.restores} == {"evicted", "cleared", "epoch_change"}
        reasons = sql(proc, "SELECT node_id, group_idx, medium, end_reason, count() AS n FROM kv_block_lifetimes_final "
                            "GROUP BY node_id, group_idx, medium, end_reason")
        assert {(r["node_id"], r["group_idx"], r["medium"], r["end_reason"]): r["n"] for r in reasons} == \
            dict(model.end_reasons)
        kinds = sql(proc, "SELECT DISTINCT group_idx, group_kind FROM kv_block_lifetimes_final")
        assert {(r["group_idx"], r["group_kind"]) for r in kinds} <= set(KIND_OF_GROUP.items())
    finally:
        session.close()

