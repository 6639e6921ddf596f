"""Exactly-once analytics across a SIGKILL: real broker, real chDB, `kvpipe analytics` as a child process.

The story (one test, phases in order):
1. Periodic snapshots every second. Three nodes publish FA + sliding-window stores, evictions, a
   duplicate store of one hash, an unknown removal, CPU blocks, an AllBlocksCleared and a node
   restart (new epoch). Every row the analytics app wrote — counted through `POST /sql` on the
   `*_final` views and three saved queries — equals what the test computes on its own (RowModel).
2. Graceful stop (shutdown snapshot covers everything), restart with snapshots every hour: from
   here the last snapshot is known exactly. More events are published, applied and their rows
   written to ClickHouse (the sink is drained, and /sql sees them) — and no snapshot covers them.
   SIGKILL now.
3. Restart: restore from the shutdown snapshot, replay the tail, so the tail's rows are inserted a
   second time (the sink's written counters prove it). Counts still equal the model: the
   ReplacingMergeTree key collapsed the copies. More events after the replay land once as well.
"""
from __future__ import annotations

import random
import time

import pytest

from kvpipe.bench.procrun import ProcessorProcess
from kvpipe.schemas.events import AllBlocksCleared
from tests.integration.analytics_helpers import (
    FA,
    KIND_OF_GROUP,
    SWA,
    AnalyticsSession,
    Clock,
    RowModel,
    SimNode,
    removed,
    saved,
    sql,
    stored,
    wait_written,
)

pytestmark = pytest.mark.integration

UNKNOWN_HASH = 999_999_999


def chain(family: int, length: int = 8) -> list[int]:
    return [family * 1000 + i for i in range(length)]


def churn(rng: random.Random, nodes: list[SimNode], steps: int) -> None:
    """Steps like a serving node's: prefixes stored in both groups, the window sliding (SWA blocks
    evicted early), occasional FA evictions, CPU offload and CPU evictions."""
    for _ in range(steps):
        node = rng.choice(nodes)
        fam = chain(rng.randrange(8))
        n = rng.randrange(1, 9)
        events = [stored(fam[:n], FA), stored(fam[:n], SWA)]
        if rng.random() < 0.5:
            events.append(removed(fam[:rng.randrange(1, 5)], SWA))
        if rng.random() < 0.3:
            events.append(removed([rng.choice(fam)], FA))
        if rng.random() < 0.3:
            events.append(stored(fam[:n], FA, "CPU"))
        if rng.random() < 0.2:
            events.append(removed(fam[:2], FA, "CPU"))
        node.step(*events)


def assert_rows_match(proc: ProcessorProcess, model: RowModel) -> None:
    got_events = {(r["node_id"], r["group_idx"], r["medium"], r["kind"]): (r["n"], r["blocks"]) for r in sql(
        proc, "SELECT node_id, group_idx, medium, kind, count() AS n, sum(num_blocks) AS blocks "
              "FROM kv_events_final GROUP BY node_id, group_idx, medium, kind")}
    assert got_events == {k: (n, model.blocks[k]) for k, n in model.events.items()}

    got_lifetimes = {(r["node_id"], r["epoch"], r["group_idx"], r["medium"], r["reason"]): (r["n"], r["s"]) for r in sql(
        proc, "SELECT node_id, epoch, group_idx, medium, reason, count() AS n, sum(lifetime_s) AS s "
              "FROM kv_block_lifetimes_final GROUP BY node_id, epoch, group_idx, medium, reason")}
    assert got_lifetimes == {k: (n, model.lifetime_s[k]) for k, n in model.lifetimes.items()}

    ratio = {r["medium"]: r for r in saved(proc, "swa_fa_eviction_ratio")}
    assert sorted(ratio) == model.mediums()
    for medium, row in ratio.items():
        swa, fa = model.evicted_blocks(SWA, medium), model.evicted_blocks(FA, medium)
        assert (row["swa_evicted"], row["fa_evicted"]) == (swa, fa), medium
        assert row["swa_fa_ratio"] == (None if fa == 0 else pytest.approx(swa / fa)), medium

    per_group: dict[tuple, int] = {}
    for r in saved(proc, "evictions_per_group", {"bucket_s": 86400}):  # bound through /sql's params
        key = (r["group_idx"], r["group_kind"], r["medium"])
        per_group[key] = per_group.get(key, 0) + r["evicted_blocks"]
    assert per_group == {(g, KIND_OF_GROUP[g], m): model.evicted_blocks(g, m)
                         for g in (FA, SWA) for m in model.mediums() if model.evicted_blocks(g, m)}

    quantiles = {(r["group_idx"], r["medium"]): r for r in saved(proc, "lifetime_quantiles", {"reasons": "evicted"})}
    assert sorted(quantiles) == sorted(model.evicted_s)
    for key, lifetimes in model.evicted_s.items():
        row = quantiles[key]
        assert (row["lifetimes"], row["max_s"]) == (len(lifetimes), max(lifetimes)), key
        assert row["mean_s"] == pytest.approx(sum(lifetimes) / len(lifetimes)), key


def count(proc: ProcessorProcess, table: str) -> int:
    return sql(proc, f"SELECT count() AS n FROM {table}")[0]["n"]


def test_sigkill_after_rows_were_written_replays_without_double_counting(kafka_bootstrap, tmp_path):
    session = AnalyticsSession(kafka_bootstrap, tmp_path)
    model, clock, rng = RowModel(), Clock(), random.Random(11)
    nodes = [SimNode(session, model, clock, f"node-{c}") for c in "abc"]
    a, b, c = nodes
    try:
        # -- phase 1: snapshots every second, a scenario with every kind of row -------------------
        proc = session.analytics(snapshot_every_s=1)
        a.step(stored(chain(1)[:6], FA), stored(chain(1)[:6], SWA))
        b.step(stored(chain(2)[:4], FA), stored(chain(2)[:4], SWA), stored(chain(2)[:4], FA, "CPU"))
        c.step(stored(chain(3)[:5], FA), stored(chain(3)[:5], SWA), stored(chain(3)[:2], FA, "CPU"))
        a.step(removed(chain(1)[:2], SWA))  # the window slides: SWA blocks evicted, FA keeps them
        a.step(stored(chain(1)[:1], FA))  # the same block computed twice: two copies of one hash
        a.step(removed(chain(1)[:1], FA))  # one copy left: no lifetime ends
        b.step(removed(chain(2)[:1], SWA), removed(chain(2)[3:4], FA, "CPU"))
        a.step(removed(chain(1)[:1], FA), removed([UNKNOWN_HASH], FA))  # last copy ends it; unknown: event only
        b.step(AllBlocksCleared())  # b's GPU entries end as `cleared`, its CPU blocks stay
        b.step(stored(chain(4)[:3], FA), stored(chain(4)[:3], SWA))
        c.restart()  # epoch 2: every epoch-1 entry of c ends as `cleared`, CPU included
        c.step(stored(chain(5)[:3], FA), stored(chain(5)[:3], SWA))
        churn(rng, nodes, 20)
        for node in nodes:
            node.pub.flush()
        end1 = session.end_offsets()
        stats = wait_written(proc, end1)
        assert stats["counters"]["dlq"] == 0 and stats["counters"]["unknown_removes"] >= 1
        reasons = {k[4] for k in model.lifetimes}
        assert reasons == {"evicted", "cleared"} and ("node-b", -1, "", "cleared") in model.events
        assert_rows_match(proc, model)
        deadline = time.monotonic() + 10
        while proc.get("/stats")["durability"]["snapshots"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.get("/stats")["durability"]["snapshots"] > 0, "periodic snapshots (they flush the sink) ran"
        proc.stop()  # SIGTERM: the shutdown snapshot covers end1

        # -- phase 2: rows written after the last snapshot, then SIGKILL --------------------------
        proc = session.analytics(snapshot_every_s=3600)
        stats = proc.wait_offsets(end1)
        assert stats["counters"]["messages"] == 0, "restored from the shutdown snapshot: nothing to replay"
        c.step(removed(chain(5)[:2], SWA), removed(chain(5)[2:3], FA))
        a.step(stored(chain(6)[:4], FA), stored(chain(6)[:4], FA), stored(chain(6)[:4], SWA))  # 4 duplicated hashes
        a.step(AllBlocksCleared())  # ends the duplicated hashes once each, and a's older GPU blocks
        churn(rng, nodes, 10)
        for node in nodes:
            node.pub.flush()
        end2 = session.end_offsets()
        tail = sum(end2.values()) - sum(end1.values())
        stats = wait_written(proc, end2)
        written = {t: stats["sink"][f"{t}_written"] for t in ("kv_events", "kv_block_lifetimes")}
        assert written["kv_events"] > 0 and written["kv_block_lifetimes"] > 0
        assert_rows_match(proc, model)  # the tail's rows are in ClickHouse ...
        assert stats["durability"]["snapshots"] == 0, "... and no snapshot covers them"
        proc.kill()

        # -- phase 3: restore + replay re-inserts the tail's rows; FINAL counts them once ---------
        proc = session.analytics(snapshot_every_s=3600)
        stats = wait_written(proc, end2)
        assert stats["counters"]["messages"] == tail > 0 and stats["counters"]["offset_holes"] == 0
        assert sorted((r["partition"], r["offset"]) for r in stats["durability"]["restores"]) == \
            [(p, end1[p] - 1) for p in sorted(end1)], "restored from the shutdown snapshot, not later"
        assert {t: stats["sink"][f"{t}_written"] for t in written} == written, "the replay wrote the tail again"
        assert_rows_match(proc, model)
        # Merges are lazy and background: usually the copies are still there (raw > final), but a
        # merge may already have collapsed them, so only >= is deterministic.
        raw, final = count(proc, "kv_events"), count(proc, "kv_events_final")
        assert raw >= final == sum(model.events.values())

        b.step(removed(chain(4)[:3], SWA), stored(chain(7)[:2], FA), stored(chain(7)[:2], SWA))
        c.step(removed(chain(5)[:3], FA))
        for node in nodes:
            node.pub.flush()
        wait_written(proc, session.end_offsets())
        assert_rows_match(proc, model)
    finally:
        for node in nodes:
            node.close()
        session.close()
