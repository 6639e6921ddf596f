"""The analytics sink against the real embedded engine (chDB), through the saved queries.

chDB hosts one engine path per process at a time; each test gets its own path under tmp_path and
closes its sinks before the next test opens another (the `open_sink` fixture does).

The data set: two nodes with a full-attention group 0 and a sliding-window group 1 (block 16).
  node n1 (epoch 1; kinds on its BlockStored events)
    seq 0 @1000  stored g0 [1,2,3,4]; stored g1 [101,102,103,104]
    seq 1 @1010  removed g1 101; removed g1 102; removed g0 1
    seq 2 @1030  stored g1 [101] (re-store, 20 s after its removal); removed g1 103
    seq 3 @1070  removed g1 104; removed g1 101
  node n2 (epoch 7; kinds only in the envelope's group specs)
    seq 0 @1005  stored g0 [201,202]; stored g1 [301,302]
    seq 1 @1065  removed g0 201; removed g1 301
    seq 2 @1100  AllBlocksCleared
Evicted blocks: sliding window 6 (n1: 101,102,103,104,101; n2: 301), full attention 2 (1, 201).
"""
from __future__ import annotations

import asyncio
import re
import threading
from datetime import timezone
from pathlib import Path
from xml.etree import ElementTree

import clickhouse_connect
import msgspec
import pytest

from kvpipe.processors.analytics import tables
from kvpipe.processors.analytics.migrations import apply_migrations, load_migrations
from kvpipe.processors.analytics.rows import event_rows
from kvpipe.processors.core.lifetimes import LifetimeRow
from kvpipe.processors.analytics.saved import list_queries, run_query
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.processors.core import native
from kvpipe.schemas.codec import encode_vllm_batch
from kvpipe.schemas.envelope import Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

pytestmark = pytest.mark.integration

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]


def _stored(group, hashes, kind=None):
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[0] * 16 * len(hashes), block_size=16,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=group, kv_cache_spec_kind=kind)


def _removed(group, h):
    return BlockRemoved(block_hashes=[h], medium="GPU", group_idx=group)


FA, SWA = "full_attention", "sliding_window"
# (node, epoch, seq, ts, events); offsets: message i of the list is at offset i of partition 0 (n1)
# or 1 (n2), as one key per partition would put them.
MESSAGES = [
    ("n1", 1, 0, 1000.0, [_stored(0, [1, 2, 3, 4], FA), _stored(1, [101, 102, 103, 104], SWA)]),
    ("n1", 1, 1, 1010.0, [_removed(1, 101), _removed(1, 102), _removed(0, 1)]),
    ("n1", 1, 2, 1030.0, [_stored(1, [101], SWA), _removed(1, 103)]),
    ("n1", 1, 3, 1070.0, [_removed(1, 104), _removed(1, 101)]),
    ("n2", 7, 0, 1005.0, [_stored(0, [201, 202]), _stored(1, [301, 302])]),
    ("n2", 7, 1, 1065.0, [_removed(0, 201), _removed(1, 301)]),
    ("n2", 7, 2, 1100.0, [AllBlocksCleared()]),
]
# (node, epoch, group, hash, stored_ts, removed_ts, reason, partition, offset, idx) as the processor's index sees them
LIFETIMES = [
    ("n1", 1, 0, 1, 1000.0, 1010.0, "evicted", 0, 1, 2),
    ("n1", 1, 1, 101, 1000.0, 1010.0, "evicted", 0, 1, 0),
    ("n1", 1, 1, 102, 1000.0, 1010.0, "evicted", 0, 1, 1),
    ("n1", 1, 1, 103, 1000.0, 1030.0, "evicted", 0, 2, 1),
    ("n1", 1, 1, 104, 1000.0, 1070.0, "evicted", 0, 3, 0),
    ("n1", 1, 1, 101, 1030.0, 1070.0, "evicted", 0, 3, 1),
    ("n2", 7, 0, 201, 1005.0, 1065.0, "evicted", 1, 1, 0),
    ("n2", 7, 1, 301, 1005.0, 1065.0, "evicted", 1, 1, 1),
    ("n2", 7, 0, 202, 1005.0, 1100.0, "cleared", 1, 2, 0),
    ("n2", 7, 1, 302, 1005.0, 1100.0, "cleared", 1, 2, 0),
]


def message_rows(i: int) -> dict[str, list]:
    """What the analytics app submits for message i, by table: its event rows, the lifetimes it ended, its re-stores."""
    node, epoch, seq, ts, events = MESSAGES[i]
    specs = SPECS if seq == 0 else None
    env = Envelope(v=1, node_id=node, epoch=epoch, seq=seq, ts=ts, dp_rank=0, group_specs=specs,
                   batch=msgspec.Raw(encode_vllm_batch(events, ts)))
    partition = 0 if node == "n1" else 1
    offset = sum(1 for m in MESSAGES[:i] if m[0] == node)
    kinds = {g.group_idx: (g.kind, g.block_size) for g in SPECS}  # the processor remembers specs
    ev = event_rows(env, events, partition, offset, ingest_ts=5000.0 + i, group_kinds=kinds)
    lt = [LifetimeRow(n, e, g, "GPU", h, st, rt, why, p, o, idx)
          for n, e, g, h, st, rt, why, p, o, idx in LIFETIMES if (p, o) == (partition, offset)]
    return {tables.EVENTS: ev, tables.LIFETIMES: lt, tables.RESTORES: RESTORES[i]}


def _restores() -> list[list]:
    """Re-store rows per message, from one tracker fed the messages in order (as the app does)."""
    from kvpipe.processors.analytics.restores import RestoreTracker

    tracker, out = RestoreTracker(), []
    kinds = {g.group_idx: (g.kind, g.block_size) for g in SPECS}
    for i, (node, epoch, seq, ts, events) in enumerate(MESSAGES):
        env = Envelope(v=1, node_id=node, epoch=epoch, seq=seq, ts=ts, batch=msgspec.Raw(b"[]"))
        partition = 0 if node == "n1" else 1
        offset = sum(1 for m in MESSAGES[:i] if m[0] == node)
        lt = [LifetimeRow(n, e, g, "GPU", h, st, rt, why, p, o, idx)
              for n, e, g, h, st, rt, why, p, o, idx in LIFETIMES if (p, o) == (partition, offset)]
        out.append(tracker.observe(env, events, lt, partition, offset, kinds))
    return out


RESTORES = _restores()


# The writer's batches as native columns inserted as Native bytes (the default where the native core runs), and as
# Python columns through clickhouse-connect's encoding (the reference): every test holds for both.
WRITERS = ["native", "python"] if native.engine() == "native" else ["python"]


@pytest.fixture(params=WRITERS)
def open_sink(tmp_path: Path, request):
    sinks: list[AnalyticsSink] = []

    def _open(**kw) -> AnalyticsSink:
        kw.setdefault("flush_s", 0.1)
        kw.setdefault("native_rows", request.param == "native")
        sink = AnalyticsSink(f"chdb://{tmp_path / 'analytics'}", **kw)
        sink.start()
        sinks.append(sink)
        return sink

    yield _open
    for sink in sinks:
        sink.close()


def submit_all(sink: AnalyticsSink, indexes=range(len(MESSAGES))) -> None:
    for i in indexes:
        sink.submit(message_rows(i))
    assert sink.flush(30.0)


def epoch_s(naive_utc) -> float:
    """Seconds since the epoch of a DateTime('UTC') value (clickhouse-connect returns them naive)."""
    return naive_utc.replace(tzinfo=timezone.utc).timestamp()


def rows_of(result: dict) -> list[dict]:
    return [dict(zip(result["columns"], row)) for row in result["rows"]]


def test_migrations_apply_once_and_a_restart_applies_nothing(open_sink, tmp_path):
    sink = open_sink()
    versions = rows_of(sink.query("SELECT version FROM kvpipe_migrations ORDER BY version"))
    on_disk = [m.version for m in load_migrations()]
    assert [r["version"] for r in versions] == on_disk and on_disk[:5] == [1, 2, 3, 4, 5]
    sink.close()
    sink = open_sink()
    assert len(sink.query("SELECT * FROM kvpipe_migrations")["rows"]) == len(on_disk)
    sink.close()
    client = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'analytics'}")
    try:
        assert apply_migrations(client) == []
    finally:
        client.close()


def test_event_and_lifetime_rows_land_with_their_values(open_sink):
    sink = open_sink()
    submit_all(sink)
    c = sink.counters()
    assert (c["kv_events_submitted"], c["kv_events_written"], c["store_state"]) == (14, 14, "up")
    assert (c["kv_block_lifetimes_written"], c["errors"], c["unwritten_rows"]) == (10, 0, 0)
    first = rows_of(sink.query(
        "SELECT toUnixTimestamp64Micro(ts) AS ts_us, node_id, epoch, seq, dp_rank, group_idx, medium, kind, spec_kind,"
        " block_hashes, has_parent, num_blocks, num_tokens, block_size, kafka_partition, kafka_offset, event_idx"
        " FROM kv_events_final WHERE node_id = 'n1' AND seq = 0 ORDER BY event_idx"))
    assert first[1] == dict(ts_us=1_000_000_000, node_id="n1", epoch=1, seq=0, dp_rank=0, group_idx=1, medium="GPU",
                            kind="stored", spec_kind="sliding_window", block_hashes=[101, 102, 103, 104], has_parent=0,
                            num_blocks=4, num_tokens=64, block_size=16, kafka_partition=0, kafka_offset=0, event_idx=1)
    cleared = rows_of(sink.query("SELECT node_id, group_idx, medium FROM kv_events_final WHERE kind = 'cleared'"))
    assert cleared == [dict(node_id="n2", group_idx=-1, medium="")]
    lt = rows_of(sink.query("SELECT node_id, group_idx, block_hash, lifetime_s, reason FROM kv_block_lifetimes_final"
                            " WHERE block_hash IN (104, 302) ORDER BY block_hash"))
    assert lt == [dict(node_id="n1", group_idx=1, block_hash=104, lifetime_s=70.0, reason="evicted"),
                  dict(node_id="n2", group_idx=1, block_hash=302, lifetime_s=95.0, reason="cleared")]


def test_saved_queries_give_the_hand_computed_answers(open_sink):
    sink = open_sink()
    submit_all(sink)
    assert_saved_answers(sink)


def assert_saved_answers(sink: AnalyticsSink) -> None:
    ratio = rows_of(run_query(sink, "swa_fa_eviction_ratio"))
    assert ratio == [dict(medium="GPU", swa_evicted=6, fa_evicted=2, swa_fa_ratio=3.0)]

    evictions = rows_of(run_query(sink, "evictions_per_group", {"bucket_s": "60"}))
    assert [(epoch_s(r["bucket"]), r["group_idx"], r["group_kind"], r["evicted_blocks"]) for r in evictions] == [
        (960, 0, FA, 1), (960, 1, SWA, 2), (1020, 0, FA, 1), (1020, 1, SWA, 4)]

    lifetimes = {r["group_idx"]: r for r in rows_of(run_query(sink, "lifetime_quantiles"))}
    assert (lifetimes[0]["lifetimes"], lifetimes[0]["p50_s"]) == (2, 35.0)
    assert lifetimes[0]["p90_s"] == pytest.approx(55.0)
    # group 1 evicted lifetimes: 10, 10, 30, 40, 60, 70 s
    assert (lifetimes[1]["lifetimes"], lifetimes[1]["p50_s"], lifetimes[1]["max_s"]) == (6, 35.0, 70.0)
    assert lifetimes[1]["p90_s"] == pytest.approx(65.0)
    with_clears = {r["group_idx"]: r for r in rows_of(run_query(sink, "lifetime_quantiles", {"reasons": "evicted,cleared"}))}
    assert (with_clears[0]["lifetimes"], with_clears[0]["p50_s"]) == (3, 60.0)

    occupancy = {(r["node_id"], r["group_idx"], epoch_s(r["bucket"])): r["cached_blocks"]
                 for r in rows_of(run_query(sink, "node_occupancy", {"bucket_s": 60}))}
    assert occupancy == {
        ("n1", 0, 960): 3, ("n1", 1, 960): 2, ("n1", 1, 1020): 0,
        ("n2", 0, 960): 2, ("n2", 0, 1020): 1, ("n2", 0, 1080): 0,
        ("n2", 1, 960): 2, ("n2", 1, 1020): 1, ("n2", 1, 1080): 0,
    }

    reuse = {r["group_idx"]: r for r in rows_of(run_query(sink, "reuse_distance"))}
    # lifetimes ended in group 1: 6 evicted + n2's 302 cleared; one came back (101, 20 s later)
    assert (reuse[1]["removals"], reuse[1]["restored"], reuse[1]["p50_s"]) == (7, 1, 20.0)
    assert reuse[1]["reuse_ratio"] == pytest.approx(1 / 7)
    assert (reuse[0]["removals"], reuse[0]["restored"]) == (3, 0) and reuse[0]["p50_s"] is None
    # 101 came back 20 s after its removal; 102, 103, 104 were stored after its first store: distance 3
    [back] = rows_of(sink.query("SELECT block_hash, group_kind, delay_s, end_reason, stack_distance FROM kv_restores_final"))
    assert back == dict(block_hash=101, group_kind=SWA, delay_s=20.0, end_reason="evicted", stack_distance=3)


def test_replayed_and_overlapping_batches_count_once(open_sink, tmp_path):
    # Small batches so the first run and the replay cut the same rows into different inserts.
    sink = open_sink(batch_rows=3)
    # Merges stopped (a second client on the same engine), so the copies stay in the raw table and
    # only the ReplacingMergeTree key + FINAL can make the counts come out right.
    other = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'analytics'}")
    try:
        other.command("SYSTEM STOP MERGES kv_events")
        other.command("SYSTEM STOP MERGES kv_block_lifetimes")
        submit_all(sink, range(0, 5))  # 11 events
        sink.close()  # the processor dies after writing messages 0-4 ...
        sink = open_sink(batch_rows=4)
        submit_all(sink, range(2, 7))  # ... and replays from an older offset: 2-4 again (6 events), then 5-6 (3)
        submit_all(sink, range(0, 7))  # and the same batches all over again (14)
        raw = sink.query("SELECT count() FROM kv_events")["rows"][0][0]
        assert raw == 11 + 9 + 14
        assert sink.query("SELECT count() FROM kv_events_final")["rows"][0][0] == 14
        assert sink.query("SELECT count() FROM kv_block_lifetimes_final")["rows"][0][0] == 10
        assert_saved_answers(sink)
    finally:
        other.close()


def test_a_block_stored_twice_and_cleared_keeps_both_lifetimes_once(open_sink):
    sink = open_sink()
    twice = [LifetimeRow("n3", 1, 0, "GPU", 55, 10.0, 20.0, "cleared", 2, 9, 0) for _ in range(2)]
    for _ in range(2):  # written, then replayed
        sink.submit({tables.LIFETIMES: [msgspec.structs.replace(r) for r in twice]})
        assert sink.flush()
    assert sink.query("SELECT count() FROM kv_block_lifetimes_final")["rows"] == [[2]]


def test_query_rejects_writes_and_runs_read_only(open_sink):
    sink = open_sink()
    for sql, says in [("INSERT INTO kv_events (node_id) VALUES ('x')", "INSERT"), ("DROP TABLE kv_events", "DROP"),
                      ("SELECT 1; TRUNCATE TABLE kv_events", "statements"), ("SELECT 1 INTO OUTFILE 'o.csv'", "OUTFILE")]:
        with pytest.raises(ValueError, match=says):
            sink.query(sql)
    # table functions that reach outside the store are refused before the engine sees them
    # (tests/integration/test_sql_attacks.py holds the full attack list)
    with pytest.raises(ValueError, match="table function file"):
        sink.query("SELECT * FROM file('anything.csv', 'LineAsString')")
    assert sink.query("SELECT 1 AS one") == {"columns": ["one"], "types": ["UInt8"], "rows": [[1]]}
    sink.close()
    reader = AnalyticsSink(sink.dsn)  # `kvpipe sql` against a server: query() without start()
    try:
        assert reader.query("SELECT count() AS n FROM kv_events_final")["rows"] == [[0]]
        with pytest.raises(RuntimeError, match="not running"):
            reader.submit(message_rows(0))
    finally:
        reader.close()


def test_a_row_the_store_rejects_is_retried_and_loud_never_dropped(open_sink):
    sink = open_sink(retry_max_s=0.2)
    good = message_rows(0)[tables.EVENTS]
    bad = msgspec.structs.replace(good[0], parent_hash=-5, offset=77)  # negative: no UInt64 for it (a bug)
    sink.submit({tables.EVENTS: [good[0], bad, good[1]]})
    assert not sink.flush(2.0), "not acknowledged, so no snapshot may claim these rows"
    c = sink.counters()
    assert (c["kv_events_written"], c["unwritten_rows"], c["store_up"], c["store_state"]) == (0, 3, False, "refusing")
    assert c["retries"] >= 3 and "parent_hash" in c["store_reason"] and c["refusing_for_s"] >= 0
    sink.close(timeout=0.5)  # gives up on the retries; the rows stay unacknowledged, not dropped as "done"
    assert sink.counters()["kv_events_written"] == 0


def test_a_wait_for_room_ends_with_the_insert_that_makes_room_not_a_poll(open_sink, tmp_path):
    sink = open_sink(retry_max_s=0.2, max_queue_rows=5)
    other = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'analytics'}")
    try:
        other.command("RENAME TABLE kv_events TO kv_events_away")
        sink.submit(message_rows(1))  # 3 events + 3 lifetimes: past the bound while the events are refused
        assert not sink.has_room()
        back = threading.Timer(0.3, other.command, ["RENAME TABLE kv_events_away TO kv_events"])
        back.start()
        # a poll every hour: only the writer's wake-up can end this wait within the test's 30 s
        asyncio.run(asyncio.wait_for(sink.wait_for_room(poll_s=3600.0), 30.0))
        back.join()
        assert sink.has_room() and sink.counters()["room_waits"] == 1
    finally:
        other.close()
    assert sink.flush(30.0)


def test_a_refusing_store_loses_nothing_and_the_queue_bound_waits_asynchronously(open_sink, tmp_path):
    sink = open_sink(retry_max_s=0.2, max_queue_rows=5)
    # a second client on the same path (allowed in one process) takes a table away from under the sink
    other = clickhouse_connect.get_client(dsn=f"chdb://{tmp_path / 'analytics'}")
    try:
        other.command("RENAME TABLE kv_block_lifetimes TO kv_block_lifetimes_away")
        sink.submit(message_rows(1))  # 3 events + 3 lifetimes
        assert not sink.flush(1.5)
        c = sink.counters()
        assert (c["kv_events_written"], c["kv_block_lifetimes_written"], c["store_state"]) == (3, 0, "refusing")
        assert "kv_block_lifetimes" in c["store_reason"]
        assert not sink.has_room() or c["unwritten_rows"] == 3

        sink.submit(message_rows(3))  # 2 events + 2 lifetimes more: the bound (5) is passed

        async def gate(timeout: float) -> bool:
            try:
                await asyncio.wait_for(sink.wait_for_room(poll_s=0.02), timeout)
                return True
            except asyncio.TimeoutError:
                return False

        assert not sink.has_room() and not asyncio.run(gate(0.5)), "no room while the store refuses"
        other.command("RENAME TABLE kv_block_lifetimes_away TO kv_block_lifetimes")
        assert asyncio.run(gate(30.0)), "room once the store acknowledges again"
    finally:
        other.close()
    assert sink.flush(30.0)
    c = sink.counters()
    assert (c["kv_events_written"], c["kv_block_lifetimes_written"], c["unwritten_rows"]) == (5, 5, 0)
    assert (c["store_up"], c["store_state"]) == (True, "up") and c["room_waits"] >= 1
    assert sink.query("SELECT count() FROM kv_block_lifetimes_final")["rows"] == [[5]]


def test_query_settings_are_merged_but_readonly_always_wins(open_sink):
    sink = open_sink()
    # what reaches the engine: the caller's limits, and readonly=1 whatever the caller asked for
    # (that the engine enforces such limits is tests/integration/test_sql_attacks.py's)
    # (on a read client, never the writer's: the limits ride as the statement's SETTINGS clause)
    seen: list[str] = []
    with sink.readers.client() as reader:
        stream = reader.raw_stream

        def spy(query, *args, **kwargs):
            seen.append(query)
            return stream(query, *args, **kwargs)

        reader.raw_stream = spy
    assert sink.query("SELECT 1 AS x", settings={"readonly": 0, "max_result_rows": 7})["rows"] == [[1]]
    assert "readonly = 1" in seen[0] and "max_result_rows = 7" in seen[0] and "readonly = 0" not in seen[0]


def test_every_saved_query_has_a_title_and_runs_on_an_empty_store(open_sink):
    sink = open_sink()
    for q in list_queries():
        assert q.title != q.name
        assert run_query(sink, q.name)["columns"]


def test_report_has_every_saved_query_and_inline_svg_plots(open_sink, tmp_path):
    from kvpipe.processors.analytics.report import PLOTS, build_report

    sink = open_sink()
    submit_all(sink)
    path = build_report(sink, tmp_path / "report")
    assert path.name == "report.html"
    text = path.read_text()
    for q in list_queries():
        assert f"<section id='{q.name}'>" in text
    assert "<td>GPU</td><td>6</td><td>2</td><td>3</td>" in text  # the SWA/FA ratio table
    svgs = re.findall(r"<svg.*?</svg>", text, re.DOTALL)
    assert len(svgs) == len(PLOTS)
    for svg in svgs:
        ElementTree.fromstring(svg)  # well-formed
        assert "<path" in svg


def test_a_burst_tail_is_written_when_input_goes_quiet_and_a_trickle_keeps_the_timer(open_sink):
    import time

    events = [r for i in range(len(MESSAGES)) for r in message_rows(i)[tables.EVENTS]]
    assert len(events) >= 5
    sink = open_sink(batch_rows=len(events) - 1, flush_s=60.0)  # one full batch, then a 1-row tail
    sink.submit({tables.EVENTS: events})
    deadline = time.monotonic() + 20.0
    while sink.counters()["kv_events_written"] < len(events) and time.monotonic() < deadline:
        time.sleep(0.02)
    c = sink.counters()
    assert (c["kv_events_written"], c["unwritten_rows"]) == (len(events), 0), "the tail did not wait for flush_s"
    assert c["batches"] == 2

    # more input after the tail, fewer rows than a batch: still the backlog's (a pause mid-backlog wrote the tail
    # before it), so it is written once input goes quiet too
    sink.submit({tables.EVENTS: events[:2]})
    deadline = time.monotonic() + 20.0
    while sink.counters()["kv_events_written"] < len(events) + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sink.counters()["kv_events_written"] == len(events) + 2 and sink.counters()["batches"] == 3

    sink.submit({tables.EVENTS: events[:2]})  # a trickle after two partial writes: it waits for the timer
    time.sleep(1.0)
    assert sink.counters()["kv_events_written"] == len(events) + 2
    assert sink.flush(30.0) and sink.counters()["kv_events_written"] == len(events) + 4
