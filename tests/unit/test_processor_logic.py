"""Snapshots and the HTTP API's rules, without Kafka or a server."""
from __future__ import annotations

import msgspec
import pytest

from kvpipe.processors.router.decide import route
from kvpipe.processors.router.model import RouteError, RouteRequest, decode_request
from kvpipe.processors.router.request import check_request
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import DLQ, SKIPPED, Ingest
from kvpipe.processors.core.snapshot import decode_chunk, export_partition, import_chunks
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockStored


def stored(hashes, group=0, medium="GPU"):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def env(node, seq, events, partition_specs=None):
    return Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=100.0 + seq, group_specs=partition_specs,
                    batch=msgspec.Raw(encode_vllm_batch(events, 100.0)) if events else msgspec.Raw())


def test_snapshot_roundtrip_split_across_many_chunks_gives_the_same_index():
    index = Index()
    specs = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]
    index.apply(env("a", 0, [], specs), [stored(range(5000)), stored([1, 2]), stored([b"\x01" * 32], medium="CPU")], 0, 0)
    index.apply(env("b", 0, []), [stored(range(100, 200), group=1)], 0, 1)
    index.apply(env("c", 3, []), [stored([7])], 1, 0)  # other partition, suspect
    index.nodes["a"].load = (2, 5, 0.75)  # the latest reported load travels with the node
    chunks, nodes, blocks = export_partition(index, 0, gen=1, chunk_bytes=4096)
    assert len(chunks) > 5 and nodes == 2 and blocks == 5101
    restored = Index()
    import_chunks(restored, 0, [decode_chunk(c) for c in chunks])
    for node_id in ("a", "b"):
        old, new = index.nodes[node_id], restored.nodes[node_id]
        assert {k: (s.blocks, s.dups) for k, s in old.slots.items()} == {k: (s.blocks, s.dups) for k, s in new.slots.items()}
        assert (old.seq, old.epoch, old.group_specs, old.counters, old.load) == \
            (new.seq, new.epoch, new.group_specs, new.counters, new.load)
    assert "c" not in restored.nodes
    req = RouteRequest(block_hashes={0: list(range(10))}, num_tokens=161, include_zero=True)
    rows = lambda i: [(r.node_id, r.gpu_tokens, r.loadable_tokens) for r in route(i, req, now=200.0).nodes]  # noqa: E731
    assert rows(restored) == rows(index) == [("a", 160, 0)]


def test_ingest_skips_offsets_covered_by_a_restored_snapshot_and_dlqs_bad_bytes():
    ingest = Ingest(Index(), 1 << 20)
    ingest.applied_offset[0] = 5
    assert ingest.handle(encode_envelope(env("a", 0, [stored([1])])), KAFKA_HEADERS, 0, 5, 0.0).outcome == SKIPPED
    result = ingest.handle(b"\xc1", KAFKA_HEADERS, 0, 6, 0.0)
    assert result.outcome == DLQ and result.error.kind == "not_msgpack"
    bad_group = encode_envelope(env("a", 0, [stored([1], group=-1)]))
    assert ingest.handle(bad_group, KAFKA_HEADERS, 0, 7, 0.0).error.kind == "invalid"
    assert ingest.dlq_by_reason == {"not_msgpack": 1, "invalid": 1} and ingest.counters["offset_holes"] == 0


def test_route_request_forms_and_errors():
    checked = check_request(decode_request(b'{"block_hashes": {"0": [1, "0x0aff"]}}'))
    assert checked.hash_lists == {0: [1, b"\x0a\xff"]} and checked.token_ids is None
    assert check_request(decode_request(b'{"token_ids": [5, 6, 7]}')).num_tokens == 3
    for body in (b"{}", b"[]", b'{"block_hashes": {"g": [1]}}', b'{"block_hashes": {"0": [true]}}',
                 b'{"block_hashes": {"0": ["0xzz"]}}', b'{"block_hashes": {"-1": [1]}}', b'{"block_hashes": 5}',
                 b'{"block_hashes": [1, 2]}', b'{"token_ids": [1], "num_tokens": 2}', b"{not json"):
        with pytest.raises(RouteError) as exc:
            check_request(decode_request(body))
        assert exc.value.status == 400 and exc.value.detail, body

