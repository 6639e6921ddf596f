"""The hardening probes (RELIABILITY.md) as unit tests: each one failed on the processor before
the fix. Clocks, DLQ copies, HTTP bodies, /nodes pages, snapshots of bounded state."""
from __future__ import annotations

import asyncio

import msgspec
import pytest

from kvpipe.processors.core.httpbody import ApiError
from kvpipe.processors.routing.api import node_rows, page_rows, parse_nodes_query
from kvpipe.processors.core.httpbody import json_body, parse_json
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import APPLIED, DLQ, HEADER_ORIGINAL_SIZE, HEADER_TRUNCATED, Ingest, dlq_record
from kvpipe.processors.core.snapshot import decode_chunk, export_partition, import_chunks
from kvpipe.schemas.codec import KAFKA_HEADERS, DecodeError, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import BlockStored

TTL = 30.0


def stored(hashes):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium="GPU", lora_name=None, group_idx=0)


def msg(node, seq, ts, hashes=(), **kw) -> bytes:
    batch = msgspec.Raw(encode_vllm_batch([stored(hashes)], ts)) if hashes else msgspec.Raw()
    return encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=ts, sent_ts=ts, batch=batch, **kw))


def feed(ingest: Ingest, items, now_of=lambda i: 1000.0 + i, record_ts=None):
    for i, data in enumerate(items):
        ingest.handle(data, KAFKA_HEADERS, 0, i, now_of(i), None if record_ts is None else record_ts(i))


@pytest.mark.parametrize("poison", [1e300, 1000.0 + 120])
def test_a_future_timestamp_from_another_node_expires_nobody(poison):
    ingest = Ingest(Index(ttl_s=TTL), 1 << 20, max_skew_s=5.0)
    items = [msg("victim", 0, 1000.0, [1, 2, 3]), msg("attacker", 0, poison)]
    items += [msg("victim", s, 1000.0 + s, [10 + s]) for s in range(1, 4)]
    feed(ingest, items)
    # what the liveness timer does while the partition is behind: expire by the partition clock
    assert ingest.stream_ts[0] <= 1004.0 + 5.0
    assert ingest.index.expire(ingest.stream_ts[0], TTL, partition=0) == []
    victim, attacker = ingest.index.nodes["victim"], ingest.index.nodes["attacker"]
    assert not victim.expired and len(victim.slots[(0, "GPU")].blocks) == 6
    assert attacker.last_seen == 1001.0 + 5.0 and attacker.counters["clock_clamped"] == 1
    assert attacker.skew_s == pytest.approx(poison - 1001.0)
    assert ingest.counters["clock_clamped"] == 1
    row = node_rows(ingest.index, 1010.0, state="healthy")
    assert [r.clock_skew_s > 0 for r in row] == [True, False]


def test_record_timestamps_make_a_replay_clamp_exactly_as_the_live_run():
    items = [msg("v", s, 1000.0 + s, [s]) for s in range(5)] + [msg("x", 0, 5000.0, [99])]
    live, replay = Ingest(Index(ttl_s=TTL), 1 << 20, 5.0), Ingest(Index(ttl_s=TTL), 1 << 20, 5.0)
    feed(live, items, now_of=lambda i: 1000.0 + i, record_ts=lambda i: 1000.0 + i)
    feed(replay, items, now_of=lambda i: 9e9, record_ts=lambda i: 1000.0 + i)  # replayed much later
    for ing in (live, replay):
        assert ing.stream_ts[0] == 1005.0 and ing.index.nodes["x"].last_seen == 1010.0
        assert ing.index.nodes["x"].slots[(0, "GPU")].blocks == {99: 1010.0}  # lifetimes start clamped too
    assert {n: (s.last_seen, s.skew_s) for n, s in live.index.nodes.items()} == \
        {n: (s.last_seen, s.skew_s) for n, s in replay.index.nodes.items()}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_nan_infinite_and_negative_timestamps_go_to_the_dlq_as_invalid(bad):
    ingest = Ingest(Index(ttl_s=TTL), 1 << 20)
    result = ingest.handle(msg("n", 0, bad), KAFKA_HEADERS, 0, 0, 1000.0)
    assert result.outcome == DLQ and result.error.kind == "invalid" and "ts" in result.error.message
    assert "n" not in ingest.index.nodes


def test_a_snapshot_never_brings_back_a_poisoned_clock():
    index = Index(ttl_s=TTL)
    index.apply(Envelope(v=1, node_id="old", epoch=1, seq=0, ts=1e300), [stored([1])], 0, 0)  # as an old processor did
    chunks, _, _ = export_partition(index, 0, gen=1)
    restored = Index(ttl_s=TTL)
    import_chunks(restored, 0, [decode_chunk(c) for c in chunks], max_ts=2000.0)
    assert restored.nodes["old"].last_seen == 2000.0
    assert Ingest(restored, 1 << 20, 5.0).restored_clock(1e300, 1990.0) == 1995.0


def test_snapshots_carry_partial_state_and_skew():
    ingest = Ingest(Index(ttl_s=TTL), 1 << 20, 5.0)
    feed(ingest, [msg("p", 0, 1000.0, [1], lost_batches=3), msg("p", 1, 9999.0, [2])])
    chunks, _, _ = export_partition(ingest.index, 0, gen=1)
    restored = Index(ttl_s=TTL)
    import_chunks(restored, 0, [decode_chunk(c) for c in chunks])
    old, new = ingest.index.nodes["p"], restored.nodes["p"]
    assert new.partial_since == old.partial_since == (1, 0, 1000.0) and new.skew_s == old.skew_s > 0


def test_an_oversize_message_goes_to_the_dlq_as_a_bounded_excerpt_with_its_size():
    big = b"\x00" * 3_000_000
    error = DecodeError("too_large", "message of 3000000 bytes exceeds the 1048576-byte limit")
    value, headers = dlq_record(big, error, "kv-events", 2, 77, copy_max_bytes=512 * 1024, excerpt_bytes=1024)
    h = dict(headers)
    assert len(value) == 1024 and h[HEADER_ORIGINAL_SIZE] == b"3000000" and h[HEADER_TRUNCATED] == b"1"
    assert h["kvpipe-source-offset"] == b"77" and h["kvpipe-dlq-reason"].startswith(b"too_large")
    small, headers = dlq_record(b"\xc1", DecodeError("not_msgpack", "x"), "kv-events", 0, 1, 512 * 1024, 1024)
    assert small == b"\xc1" and HEADER_TRUNCATED not in dict(headers)
    _, headers = dlq_record(b"", DecodeError("invalid", "n" * 100_000), "t", 0, 1, 512 * 1024, 1024)
    assert len(dict(headers)["kvpipe-dlq-reason"]) <= 2048


def test_nodes_are_paged_and_filtered_by_state():
    index = Index(ttl_s=TTL)
    for i in range(25):
        index.apply(Envelope(v=1, node_id=f"n{i:02d}", epoch=1, seq=0 if i % 5 else 3, ts=1000.0), [], 0, i)
    limit, after, state = parse_nodes_query({"limit": "10"})
    pages, after = [], None
    while True:
        page, after = page_rows(node_rows(index, 1000.0, limit + 1, after, state), limit, after, state)
        pages.append([r.node_id for r in page])
        if after is None:
            break
    assert [len(p) for p in pages] == [10, 10, 5] and sum(pages, []) == sorted(index.nodes)
    suspect = node_rows(index, 1000.0, 100, None, "suspect")
    assert [r.node_id for r in suspect] == ["n00", "n05", "n10", "n15", "n20"]
    for bad in ({"limit": "0"}, {"limit": "x"}, {"state": "weird"}, {"limit": "100000"}):
        with pytest.raises(ApiError) as exc:
            parse_nodes_query(bad)
        assert exc.value.status == 400


@pytest.mark.parametrize("body,status", [(b"[" * 100_000, 400), (b'{"a":' * 50 + b"1" + b"}" * 50, 400),
                                         (b"\xff\xfe", 400), (b"{", 400), (b"x" * 2000, 413)])
def test_malformed_or_hostile_bodies_are_4xx(body, status):
    with pytest.raises(ApiError) as exc:
        parse_json(body, max_bytes=1000 if status == 413 else 1 << 20, max_depth=32)
    assert exc.value.status == status


def test_brackets_inside_strings_do_not_count_as_nesting():
    assert parse_json(b'{"s": "' + b"[" * 500 + b'", "block_hashes": [1, 2]}', 10_000, 32)["block_hashes"] == [1, 2]


class _LyingRequest:
    """Declares more bytes than it ever sends (aiohttp's request surface that httpbody reads)."""

    content_length = 100

    class content:  # noqa: N801
        @staticmethod
        async def read(n):
            await asyncio.sleep(3600)


def test_a_lying_content_length_times_out_as_408():
    with pytest.raises(ApiError) as exc:
        asyncio.run(json_body(_LyingRequest(), 1000, 32, timeout_s=0.2))
    assert exc.value.status == 408


def test_applied_outcome_unchanged_for_a_well_behaved_node():
    ingest = Ingest(Index(ttl_s=TTL), 1 << 20)
    assert ingest.handle(msg("n", 0, 1000.0, [1]), KAFKA_HEADERS, 0, 0, 1000.5).outcome == APPLIED
    assert ingest.counters["clock_clamped"] == 0
