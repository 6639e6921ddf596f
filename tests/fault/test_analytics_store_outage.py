"""The store refuses writes for a while: the analytics app loses nothing and the routing app never
notices. Real broker, real chDB, both apps as child processes on the same topic.

The fault is injected at the client seam (tests/fault/refuse_inserts/sitecustomize.py, on the
analytics app's PYTHONPATH only): while a flag file exists, every clickhouse-connect insert raises.
As root, chmod would not stop chDB from writing, so this is how a down / read-only / full store
looks to the sink.

The story:
1. Both apps run; a first load is written and counted (the model, `RowModel`).
2. Outage: the flag appears. More load is published, beyond the sink's queue bound. The routing app
   applies all of it (its /stats offsets reach the end) while the analytics app reports the store
   refusing with the reason, pending rows at the bound, lag per partition, snapshots skipped —
   and its consumer group membership survives the whole stall (no new restore = no rebalance).
3. Recovery: the flag goes; every row lands, exactly the model's counts (0 lost).
4. Second outage, and the analytics worker is SIGKILLed in the middle of it; the store recovers
   and the worker restarts: the rows it never got acknowledged are replayed from the last snapshot
   and every count equals the model again, no duplicates (FINAL views).

ANALYTICS_OUTAGE_S (default 12) sets the first outage's length; 75 measures a stall beyond a minute.
"""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from tests.fault.test_processor_kill_analytics import assert_rows_match, churn
from tests.integration.analytics_helpers import FA, SWA, AnalyticsSession, Clock, RowModel, SimNode, stored, \
    wait_written

pytestmark = pytest.mark.integration

FAULT_DIR = str(Path(__file__).resolve().parent / "refuse_inserts")
OUTAGE_S = float(os.environ.get("ANALYTICS_OUTAGE_S", "12"))
QUEUE_ROWS = 300


def _publish(rng: random.Random, nodes: list[SimNode], steps: int) -> None:
    churn(rng, nodes, steps)
    for node in nodes:
        node.pub.flush()


def _wait(what: str, check, timeout: float = 60.0, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(every)


def _maps_of(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def test_store_outage_stalls_analytics_only_and_loses_no_row(kafka_bootstrap, tmp_path):
    flag = tmp_path / "store-refuses"
    session = AnalyticsSession(kafka_bootstrap, tmp_path, partitions=2, REFUSE_INSERTS_FLAG=str(flag),
                               KVPIPE_ANALYTICS_MAX_QUEUE_ROWS=str(QUEUE_ROWS), KVPIPE_ANALYTICS_RETRY_MAX_S="1",
                               KVPIPE_ANALYTICS_BATCH_ROWS="100")
    model, clock, rng = RowModel(), Clock(), random.Random(5)
    nodes = [SimNode(session, model, clock, f"node-{c}") for c in "abcd"]
    try:
        index = session.processor()
        analytics = session.analytics(snapshot_every_s=1, pythonpath=[FAULT_DIR])
        # the routing app holds no ClickHouse code, not even loaded shared objects
        maps = _maps_of(index.proc.pid)
        assert "chdb" not in maps and "clickhouse_connect" not in maps
        assert "clickhouse_connect" in _maps_of(analytics.proc.pid) or "chdb" in _maps_of(analytics.proc.pid)

        # -- 1. normal operation ------------------------------------------------------------------
        for n in nodes:
            n.step(stored([n.node_id.__hash__() & 0xFFFF], FA), stored([7], SWA))
        _publish(rng, nodes, 30)
        end = session.end_offsets()
        wait_written(analytics, end)
        assert_rows_match(analytics, model)
        before = analytics.get("/stats")
        restores_before = len(before["durability"]["restores"])
        _wait("a snapshot", lambda: analytics.get("/stats")["durability"]["snapshots"] > 0, 20)

        # -- 2. outage: the store refuses; analytics stalls, the index keeps applying -------------
        flag.touch()
        t_outage = time.monotonic()
        _publish(rng, nodes, 250)  # far more rows than the queue bound
        end = session.end_offsets()
        index.wait_offsets(end, timeout=60)  # the routing app applied everything during the outage
        # a fetched run's rows can fill the queue before the first insert has been refused: wait for both
        stats = _wait("analytics paused at its queue bound with the store refusing",
                      lambda: (s := analytics.get("/stats"))["store"]["consumption_paused"]
                      and s["store"]["state"] == "refusing" and s, 60)
        store = stats["store"]
        assert store["state"] == "refusing" and not store["up"] and "test fault" in store["reason"]
        assert store["pending_rows"] >= QUEUE_ROWS
        metrics = analytics.get("/metrics")
        assert "kvpipe_analytics_store_up{reason=" in metrics and "} 0.0" in metrics.split("kvpipe_analytics_store_up{")[1]
        assert "kvpipe_analytics_partition_lag_messages{partition=" in metrics
        _wait("a snapshot skipped for want of acknowledgement",
              lambda: analytics.get("/stats")["counters"]["snapshot_skips"] > 0, 60)

        # the index keeps applying while analytics stalls: more load, its offsets advance again
        _publish(rng, nodes, 20)
        end = session.end_offsets()
        index.wait_offsets(end, timeout=60)
        stalled = analytics.get("/stats")
        assert any(f["offset"] < end[int(p)] - 1 for p, f in stalled["freshness"].items())
        # lag per partition, asked once analytics is paused and more load came: before that pause one fetched run
        # can be applied whole (its rows queued past the bound), leaving no event unapplied, so no lag yet
        _wait("analytics reporting its lag while the store refuses",
              lambda: sum(f["lag_messages"] or 0 for f in analytics.get("/stats")["freshness"].values()) > 0, 30)

        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - t_outage)))
        stalled_s = time.monotonic() - t_outage

        # -- 3. recovery: every row lands; the worker never left its group -------------------------
        flag.unlink()
        stats = wait_written(analytics, end, timeout=120, errors_allowed=True)
        assert stats["store"]["state"] == "up" and stats["sink"]["retries"] > 0
        assert len(stats["durability"]["restores"]) == restores_before, \
            f"stalled {stalled_s:.0f} s: the worker was not rebalanced out of its group"
        assert_rows_match(analytics, model)
        assert analytics.proc.poll() is None and index.proc.poll() is None

        # -- 4. outage again, SIGKILL in the middle of it, restart after recovery -----------------
        flag.touch()
        _publish(rng, nodes, 120)
        end = session.end_offsets()
        index.wait_offsets(end, timeout=60)
        _wait("analytics refusing again", lambda: analytics.get("/stats")["store"]["state"] == "refusing", 30)
        analytics.kill()
        flag.unlink()
        analytics = session.analytics(snapshot_every_s=1, pythonpath=[FAULT_DIR])
        wait_written(analytics, end, timeout=120)
        assert_rows_match(analytics, model)  # FINAL counts: replayed rows collapsed, none missing
    finally:
        if flag.exists():
            flag.unlink()
        for node in nodes:
            node.close()
        session.close()
