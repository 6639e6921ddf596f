"""Envelopes become analytics rows: one per event, hashes as u64, nothing for a heartbeat."""
import hashlib

import msgspec
import pytest

from kvpipe.processors.analytics.rows import (
    EVENT_COLUMNS, LIFETIME_COLUMNS, event_columns, event_rows, lifetime_columns, number_copies,
)
from kvpipe.processors.core.lifetimes import LifetimeRow, hash_to_u64
from kvpipe.processors.analytics.ddltext import split_statements
from kvpipe.processors.analytics.sqlguard import check_read_only
from kvpipe.processors.analytics.tables import EVENTS, LOADS
from kvpipe.schemas.codec import encode_vllm_batch
from kvpipe.schemas.envelope import Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored


def _env(events, **kw) -> Envelope:
    base = dict(v=1, node_id="node-a", epoch=3, seq=17, ts=1234.5, dp_rank=1,
                batch=msgspec.Raw(encode_vllm_batch(events, 1234.5)) if events else msgspec.Raw())
    base.update(kw)
    return Envelope(**base)


def test_int_hash_is_kept_and_masked_to_64_bits():
    assert hash_to_u64(12345) == 12345
    assert hash_to_u64(2**64 - 1) == 2**64 - 1
    assert hash_to_u64(2**64 + 7) == 7
    assert hash_to_u64(-1) == 2**64 - 1


def test_bytes_hash_is_last_eight_bytes_big_endian_like_vllm():
    digest = hashlib.sha256(b"block").digest()
    assert hash_to_u64(digest) == int.from_bytes(digest, "big") & (2**64 - 1)
    assert hash_to_u64(b"\x01\x02") == 0x0102


def test_block_stored_row_carries_group_medium_kind_and_u64_hashes():
    digest = hashlib.sha256(b"parent").digest()
    ev = BlockStored(block_hashes=[5, b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x01\x00"], parent_block_hash=digest,
                     token_ids=list(range(40)), block_size=16, lora_id=None, medium="GPU", lora_name=None,
                     group_idx=1, kv_cache_spec_kind="sliding_window")
    [row] = event_rows(_env([ev]), [ev], partition=2, offset=99, ingest_ts=2000.0)
    assert (row.node_id, row.epoch, row.seq, row.dp_rank) == ("node-a", 3, 17, 1)
    assert (row.group_idx, row.medium, row.kind, row.spec_kind) == (1, "GPU", "stored", "sliding_window")
    assert row.block_hashes == [5, 256]
    assert row.parent_hash == hash_to_u64(digest)
    # token_ids may be longer than blocks * block_size (masked SWA blocks): reported as sent
    assert (row.num_blocks, row.num_tokens, row.block_size) == (2, 40, 16)
    assert (row.ts, row.ingest_ts, row.partition, row.offset, row.idx) == (1234.5, 2000.0, 2, 99, 0)


def test_removed_without_group_gets_minus_one_and_kind_from_the_envelope_specs():
    events = [BlockRemoved(block_hashes=[7], medium="CPU", group_idx=0), BlockRemoved(block_hashes=[8], medium=None)]
    env = _env(events, group_specs=[GroupSpec(group_idx=0, kind="full_attention", block_size=32)])
    a, b = event_rows(env, events, 0, 5, 1.0)
    assert (a.kind, a.group_idx, a.medium, a.spec_kind, a.block_size, a.parent_hash) == (
        "removed", 0, "CPU", "full_attention", 32, None)
    assert (b.group_idx, b.medium, b.spec_kind, b.block_size, b.idx) == (-1, "", "", 0, 1)


def test_kinds_remembered_by_the_processor_fill_envelopes_without_specs():
    ev = BlockRemoved(block_hashes=[7], medium="GPU", group_idx=2)
    [row] = event_rows(_env([ev]), [ev], 0, 5, 1.0, group_kinds={2: ("mamba", 64)})
    assert (row.spec_kind, row.block_size) == ("mamba", 64)


def test_all_blocks_cleared_is_one_row_without_group_or_medium():
    events = [BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0), AllBlocksCleared()]
    rows = event_rows(_env(events), events, 1, 2, 3.0)
    assert [(r.kind, r.group_idx, r.medium, r.block_hashes, r.idx) for r in rows] == [
        ("removed", 0, "GPU", [1], 0), ("cleared", -1, "", [], 1)]


def test_heartbeat_gives_no_rows():
    assert event_rows(_env([]), [], 0, 0, 0.0) == []


def test_unknown_dp_rank_is_minus_one():
    ev = AllBlocksCleared()
    [row] = event_rows(_env([ev], dp_rank=None), [ev], 0, 0, 0.0)
    assert row.dp_rank == -1


def test_columns_match_the_declared_order_and_timestamps_become_microseconds():
    ev = BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1] * 16, block_size=16, lora_id=None,
                     medium="GPU", lora_name=None, group_idx=0)
    [row] = event_rows(_env([ev]), [ev], 4, 5, 2.25)
    cols = dict(zip(EVENT_COLUMNS, event_columns([row])))
    assert len(cols) == len(EVENT_COLUMNS)
    assert cols["ts"] == [1234500000] and cols["ingest_ts"] == [2250000]
    assert (cols["parent_hash"], cols["has_parent"]) == ([0], [False])
    assert (cols["kafka_partition"], cols["kafka_offset"], cols["event_idx"]) == ([4], [5], [0])


def test_lifetimes_ended_together_for_duplicate_blocks_get_distinct_copy_numbers():
    # vLLM stores the same hash twice when two requests compute one prefix in the same step.
    rows = [LifetimeRow("n", 1, 0, "GPU", 9, 1.0, 4.0, "cleared", 0, 10, 0) for _ in range(2)]
    rows.append(LifetimeRow("n", 1, 0, "GPU", 10, 1.0, 4.0, "cleared", 0, 10, 0))
    number_copies(rows)
    assert [r.copy_idx for r in rows] == [0, 1, 0]
    cols = dict(zip(LIFETIME_COLUMNS, lifetime_columns(rows)))
    assert cols["lifetime_s"] == [3.0, 3.0, 3.0] and cols["copy_idx"] == [0, 1, 0]


@pytest.mark.parametrize("sql", [
    "SELECT 1", "  with x AS (SELECT 1) SELECT * FROM x;", "SHOW TABLES", "DESCRIBE TABLE kv_events",
    "EXPLAIN SELECT 1", "-- note\nSELECT ';' AS semicolon_in_a_string", "/* INSERT */ SELECT 1",
])
def test_read_only_statements_pass_the_guard(sql):
    assert check_read_only(sql)


@pytest.mark.parametrize("sql, says", [
    ("INSERT INTO kv_events VALUES (1)", "INSERT"),
    ("drop table kv_events", "DROP"),
    ("/* SELECT */ ALTER TABLE kv_events DELETE WHERE 1", "ALTER"),
    ("SELECT 1; DROP TABLE kv_events", "2 statements"),
    ("SELECT 1 INTO OUTFILE 'x.csv'", "OUTFILE"),
    ("", "empty"),
])
def test_writes_are_rejected_naming_the_statement(sql, says):
    with pytest.raises(ValueError, match=says):
        check_read_only(sql)


def test_statements_split_on_semicolons_outside_literals_and_comments():
    assert split_statements("CREATE TABLE a (x String DEFAULT ';');\n-- done;\nCREATE VIEW b AS SELECT 1;\n") == [
        "CREATE TABLE a (x String DEFAULT ';')", "-- done;\nCREATE VIEW b AS SELECT 1"]


def test_a_lifetime_ended_before_the_events_fits_the_unsigned_event_idx_column():
    # A new epoch's clear (and a node expiry) ends lifetimes "before event 0": idx -1.
    rows = [LifetimeRow("n", 1, 0, "GPU", 9, 1.0, 4.0, "cleared", 0, 10, -1),
            LifetimeRow("n", 1, 0, "GPU", 9, 1.0, 4.0, "cleared", 0, 10, 0)]
    cols = dict(zip(LIFETIME_COLUMNS, lifetime_columns(rows)))
    assert cols["event_idx"] == [2**32 - 1, 0]


def test_column_fast_path_equals_the_row_reference():
    digest = hashlib.sha256(b"p").digest()
    events = [
        BlockStored(block_hashes=[1, 2**64 - 3, digest], parent_block_hash=digest, token_ids=list(range(40)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=1),
        BlockStored(block_hashes=[9], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None, medium=None,
                    lora_name=None, group_idx=None, kv_cache_spec_kind="mamba"),
        BlockRemoved(block_hashes=[1, digest], medium="CPU", group_idx=1),
        AllBlocksCleared(),
        BlockRemoved(block_hashes=[5], medium=None, group_idx=None),
    ]
    specs = [GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
    for env in (_env(events), _env(events, dp_rank=None, group_specs=specs)):
        for kinds in (None, {1: ("full_attention", 32), -1: ("x", 8)}):
            from kvpipe.processors.analytics.rows import event_columns_of

            fast = event_columns_of(env, events, 3, 77, 99.5, kinds)
            assert fast.columns == event_columns(event_rows(env, events, 3, 77, 99.5, kinds))
            assert len(fast) == len(events)


# --- load: one row per applied envelope that reports it (kv_node_load) --------------------------------


def _ingested(envs: list[Envelope]):
    """Each envelope through the real decode + index path, with its message_rows."""
    from kvpipe.processors.analytics.derive import message_rows
    from kvpipe.processors.core.index import Index
    from kvpipe.processors.core.ingest import Ingest
    from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope

    index = Index(ttl_s=None)
    ingest = Ingest(index, 1 << 20)
    headers = [(k, v.encode() if isinstance(v, str) else v) for k, v in KAFKA_HEADERS]
    out = []
    for offset, env in enumerate(envs):
        result = ingest.handle(encode_envelope(env), headers, 0, offset, env.ts)
        out.append(message_rows(result, 0, offset, index, None, env.ts))
    return out


def test_load_row_carries_the_report_and_none_for_what_it_left_out():
    from kvpipe.processors.analytics.rows import LOAD_COLUMNS, load_columns, load_row

    assert load_row(_env([]), 0, 1) is None  # no load reported: no row
    row = load_row(_env([], running=3, waiting=0, kv_usage=0.25), 2, 40)
    assert (row.node_id, row.epoch, row.seq, row.ts, row.partition, row.offset) == ("node-a", 3, 17, 1234.5, 2, 40)
    assert (row.running, row.waiting, row.kv_usage) == (3, 0, 0.25)  # 0 waiting is a report, not a gap
    partial = load_row(_env([], kv_usage=0.5), 0, 1)
    assert (partial.running, partial.waiting, partial.kv_usage) == (None, None, 0.5)
    cols = dict(zip(LOAD_COLUMNS, load_columns([row, partial])))
    assert cols["ts"] == [1_234_500_000, 1_234_500_000] and cols["running"] == [3, None]
    assert cols["kafka_offset"] == [40, 1] and cols["kv_usage"] == [0.25, 0.5]


def test_load_a_column_cannot_hold_is_null_not_a_failed_insert():
    from kvpipe.processors.analytics.rows import load_row

    row = load_row(_env([], running=-1, waiting=2**40, kv_usage=float("nan")), 0, 1)
    assert (row.running, row.waiting, row.kv_usage) == (None, None, None)


def test_every_applied_envelope_reporting_load_gives_one_row_heartbeats_too_duplicates_none():
    stored = [BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                          medium="GPU", lora_name=None, group_idx=0)]
    step = _env(stored, seq=0, running=2, waiting=1, kv_usage=0.1)
    heartbeat = _env([], seq=1, ts=1240.0, running=0, waiting=0, kv_usage=0.1)
    silent = _env(stored, seq=2, ts=1241.0)  # reports no load
    duplicate = _env(stored, seq=0, running=9, waiting=9, kv_usage=0.9)  # a replayed seq: not applied
    rows = _ingested([step, heartbeat, silent, duplicate])
    loads = [r.get(LOADS, []) for r in rows]
    assert [[(x.seq, x.running, x.waiting, x.kv_usage, x.offset) for x in ld] for ld in loads] == [
        [(0, 2, 1, 0.1, 0)], [(1, 0, 0, 0.1, 1)], [], []]
    assert len(rows[0][EVENTS]) == 1 and len(rows[1][EVENTS]) == 0  # the heartbeat has load but no event rows
