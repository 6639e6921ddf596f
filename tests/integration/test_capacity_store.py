"""Every saved query on a demo-like workload in a real chDB store, filled by the analytics row path."""
from __future__ import annotations

from collections import defaultdict

import pytest

from kvpipe.processors.analytics.migrations import apply_migrations
from kvpipe.processors.analytics.saved import list_queries, run_query
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.processors.analytics.tables import RESTORES
from kvpipe.bench.workload import fill_store, serving_steps

STEPS = 3000


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    sink = AnalyticsSink(f"chdb://{tmp_path_factory.mktemp('capacity') / 'store'}")
    sink.start()
    counts = fill_store(sink, serving_steps(STEPS))
    # a replay of the same messages (a worker restarted from an older snapshot) must not count twice
    fill_store(sink, serving_steps(STEPS))
    yield sink, counts
    sink.close()


def records(sink, name, **params):
    result = run_query(sink, name, params)
    return [dict(zip(result["columns"], row)) for row in result["rows"]]


def test_every_saved_query_answers_with_rows(store):
    sink, _ = store
    for query in list_queries():
        assert records(sink, query.name), f"saved query {query.name} returned no rows on a demo-like workload"


def test_re_store_rows_are_stored_exactly_once(store):
    sink, counts = store
    got = sink.query("SELECT count() FROM kv_restores_final")["rows"][0][0]
    assert counts["restores"] > 1000 and got == counts["restores"]


def test_capacity_curve_is_a_fraction_that_grows_with_the_cache(store):
    sink, _ = store
    rows = records(sink, "capacity_curve")
    curves = defaultdict(list)
    for r in rows:
        assert 0 <= r["hits"] <= r["restores"] and 0.0 <= r["hit_fraction"] <= 1.0
        assert r["tokens_saved"] == 16 * r["hits"]
        curves[(r["node_id"], r["group_kind"], r["medium"])].append((r["cache_blocks"], r["hits"]))
    assert {k[2] for k in curves} == {"GPU", "CPU"} and {k[1] for k in curves} == {"full_attention", "sliding_window"}
    for key, points in curves.items():
        points.sort()
        assert [h for _, h in points] == sorted(h for _, h in points), key
        assert points[0][1] < points[-1][1], f"{key}: a 5x larger cache turns no more re-stores into hits"
    one = records(sink, "capacity_curve", node="node-1", group_kind="sliding_window", extra="0,1")
    assert {(r["node_id"], r["group_kind"]) for r in one} == {("node-1", "sliding_window")} and len(one) == 2


def test_re_store_and_lifetime_queries_agree_with_each_other(store):
    sink, counts = store
    reuse = records(sink, "reuse_distance")
    assert sum(r["restored"] for r in reuse) == counts["restores"]
    assert all(0 < r["restored"] <= r["removals"] and r["p50_s"] <= r["p90_s"] for r in reuse)
    wasted = records(sink, "wasted_recompute", minutes=1e6)
    assert sum(r["restores"] for r in wasted) == counts["restores"]
    assert all(r["tokens_recomputed"] == 16 * r["restores"] for r in wasted)
    assert any(r["after_clear_or_restart"] > 0 for r in wasted)  # the workload clears and restarts nodes
    soon = records(sink, "wasted_recompute", minutes=1)
    assert sum(r["restores"] for r in soon) < counts["restores"]
    for r in records(sink, "lifetime_quantiles"):
        assert r["group_kind"] in ("full_attention", "sliding_window") and r["p50_s"] <= r["p90_s"] <= r["p99_s"]
    top = records(sink, "top_evicted_prefixes", top=5)
    assert len(top) == 5 and top[0]["restores"] >= top[-1]["restores"] >= 1


def test_end_reasons_and_per_minute_views(store):
    sink, counts = store
    reasons = dict(sink.query("SELECT end_reason, count() FROM kv_block_lifetimes_final GROUP BY end_reason")["rows"])
    assert reasons.get("evicted", 0) > 0 and sum(reasons.values()) == counts["lifetimes"]
    assert set(reasons) == {"evicted", "cleared", "epoch_change"}  # the workload clears and restarts nodes
    minute = sink.query("SELECT sum(stored_blocks), sum(removed_blocks) FROM kv_node_minute")["rows"][0]
    events = sink.query("SELECT sumIf(num_blocks, kind = 'stored'), sumIf(num_blocks, kind = 'removed') "
                        "FROM kv_events_final")["rows"][0]
    assert list(minute) == list(events)
    assert sink.query("SELECT sum(restores) FROM kv_restore_delays")["rows"][0][0] == counts["restores"]


def test_migrations_are_idempotent(store):
    sink, _ = store
    assert apply_migrations(sink._client) == []  # a restart applies nothing
    from kvpipe.processors.analytics.migrations import load_migrations
    from kvpipe.processors.analytics.ddltext import split_statements

    for mig in load_migrations():  # every statement may run again (crash between DDL and its record)
        for statement in split_statements(mig.sql):
            sink._client.command(statement)
    assert sink.query("SELECT count() FROM kv_restores_final")["rows"][0][0] > 0


def test_capacity_curve_in_sql_on_a_cyclic_trace_is_a_step_at_k(store):
    """Cyclic accesses over K = 10 blocks through an LRU pool of 4: every re-store has distance 9, so a cache
    below 10 blocks turns none into hits and one of 10 or more all of them."""
    from tests.unit.test_capacity import run_lru_trace

    sink, _ = store
    rows = run_lru_trace([i % 10 for i in range(60)], capacity=4)
    for r in rows:
        r.node_id = "cyclic"
    sink.submit({RESTORES: rows})
    assert sink.flush(30)
    curve = records(sink, "capacity_curve", node="cyclic", extra="-0.5,0,1,1.25,1.5,2")
    assert {r["capacity"] for r in curve} == {4} and {r["restores"] for r in curve} == {50}
    assert [(r["cache_blocks"], r["hits"]) for r in curve] == [(2, 0), (4, 0), (8, 0), (9, 0), (10, 50), (12, 50)]


def test_cpu_tier_hits_equal_a_walk_over_the_workload_events(store):
    """Independently of the SQL: walk the events in order, count each (node, epoch, group, hash)'s live CPU copies,
    and call a GPU store with a copy alive a CPU-tier hit."""
    from kvpipe.schemas.events import BlockRemoved, BlockStored

    sink, _ = store
    cpu: dict[tuple, int] = defaultdict(int)
    expected: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0])  # (node, group) → stores, from CPU, tokens
    for env, events in serving_steps(STEPS):
        for ev in events:
            if not isinstance(ev, (BlockStored, BlockRemoved)):
                continue
            for h in ev.block_hashes:
                key = (env.node_id, env.epoch, ev.group_idx, h)
                if ev.medium == "CPU":
                    cpu[key] += 1 if isinstance(ev, BlockStored) else -1
                elif isinstance(ev, BlockStored):
                    acc = expected[(env.node_id, ev.group_idx)]
                    acc[0] += 1
                    if cpu[key] > 0:
                        acc[1] += 1
                        acc[2] += ev.block_size
    got = {(r["node_id"], r["group_idx"]): [r["gpu_stores"], r["from_cpu"], r["tokens_from_cpu"]]
           for r in records(sink, "cpu_tier_hits")}
    assert got == dict(expected) and sum(v[1] for v in got.values()) > 100


def test_capacity_curve_tokens_follow_each_re_store_block_size_when_they_differ(store):
    """Tokens saved are hits x block size; a slot whose rows carry different block sizes (an unknown size is 0)
    sums each hit's own size."""
    from kvpipe.processors.analytics.restores import RestoreRow

    sink, _ = store
    rows = [RestoreRow("mixed", 1, 0, "full_attention", "GPU", 1000 + i, (16, 32, 0)[i % 3], 1.0, 2.0, "evicted",
                       d, 9, 0, 900_000 + i, 0) for i, d in enumerate([0, 3, 5, 8, 12, 15, 20, 30, 40])]
    uniform = [RestoreRow("uniform", 1, 0, "full_attention", "GPU", 1000 + i, 16, 1.0, 2.0, "evicted", d, 9, 0,
                          910_000 + i, 0) for i, d in enumerate([0, 3, 5, 8, 12, 15, 20, 30, 40])]
    sink.submit({RESTORES: rows + uniform})
    assert sink.flush(30)
    for node, group in (("mixed", rows), ("uniform", uniform)):
        curve = records(sink, "capacity_curve", node=node, extra="-0.5,0,1,4")
        assert [r["cache_blocks"] for r in curve] == [5, 10, 20, 50]
        for r in curve:
            hit = [x for x in group if x.stack_distance < r["cache_blocks"]]
            assert (r["hits"], r["tokens_saved"]) == (len(hit), sum(x.block_size for x in hit)), (node, r)


def test_the_dashboards_panels_read_the_saved_queries_through_the_time_picker(store):
    """Each Grafana panel's SQL (processors/analytics/grafana.py), its time macro expanded as the
    ClickHouse plugin does: over all time it answers what the saved query answers; over a range
    before the data it answers no data rows."""
    import re

    from kvpipe.processors.analytics.grafana import TIME_SERIES, dashboard

    sink, _ = store

    def expand(sql: str, start: int, end: int, query) -> str:
        sql = re.sub(r"\$__timeFilter\((\w+)\)", rf"(\1 >= toDateTime({start}) AND \1 <= toDateTime({end}))", sql)
        for p in query.params:
            sql = sql.replace(f"${{{p.name}}}", p.default)
        return sql

    def canon(rows):
        return sorted(repr(r) for r in rows)

    for panel, query in zip(dashboard()["panels"], list_queries()):
        sql = panel["targets"][0]["rawSql"]
        whole = sink.query(expand(sql, 0, 4_102_444_800, query))["rows"]
        assert canon(whole) == canon(run_query(sink, query.name)["rows"]), query.name
        before = sink.query(expand(sql, 0, 1, query))["rows"]
        if query.name in TIME_SERIES:
            assert before == [], query.name
        else:  # aggregates over no rows: no groups, or one row of zeros / NULLs
            assert len(before) <= 1 and all(v in (0, None) or v != v for r in before for v in r
                                            if isinstance(v, (int, float)) or v is None), (query.name, before)
