"""`kvpipe inspect`: every input kind it recognises, and what it says about garbage."""
from __future__ import annotations

import io
import json
import sys

import msgspec
import pytest

from kvpipe.producer.inspect import main, msgpack_end
from kvpipe.producer.sequencer import Sequencer
from kvpipe.schemas.codec import encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

EVENTS = [
    BlockStored([1, 2**63 + 5], None, list(range(32)), 16, None, "GPU", None,
                extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
    BlockRemoved([b"\xab" * 32], "GPU", group_idx=1),
    AllBlocksCleared(),
]


def run(capsys, tmp_path, data: bytes, *args: str) -> tuple[int, list[dict], str]:
    path = tmp_path / "input.bin"
    path.write_bytes(data)
    code = main([str(path), *args])
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def envelope(seq: Sequencer, payload: bytes | None, layout: str = "map") -> bytes:
    if payload is None:
        return encode_envelope(seq.heartbeat(now=3.0, mono=0.0, dropped_total=0))
    env = seq.stamp(ts=1.5, sent_ts=2.0, mono=0.0, dropped_total=0, batch=msgspec.Raw(payload), num_events=3, layout=layout)
    return encode_envelope(env)


def test_map_layout_payload(capsys, tmp_path) -> None:
    code, objs, _ = run(capsys, tmp_path, encode_vllm_batch(EVENTS, 1.5, dp_rank=2))
    assert code == 0 and len(objs) == 1
    batch = objs[0]
    assert (batch["kind"], batch["layout"], batch["ts"], batch["data_parallel_rank"]) == ("vllm_batch", "map", 1.5, 2)
    stored, removed, cleared = batch["events"]
    assert stored["type"] == "BlockStored" and stored["block_hashes"] == [1, 2**63 + 5]
    assert stored["token_ids"] == list(range(32)) and stored["group_idx"] == 0
    assert removed["block_hashes"] == ["ab" * 32]  # bytes hashes are always hex
    assert cleared == {"type": "AllBlocksCleared"}


def test_array_layout_payload_with_hex_hashes(capsys, tmp_path) -> None:
    code, objs, _ = run(capsys, tmp_path, encode_vllm_batch(EVENTS, 1.5, layout="array"), "--hashes", "hex")
    assert code == 0 and objs[0]["layout"] == "array"
    assert objs[0]["events"][0]["block_hashes"] == ["0000000000000001", "8000000000000005"]
    assert objs[0]["events"][0]["parent_block_hash"] is None


def test_envelope_shows_its_metadata_and_events(capsys, tmp_path) -> None:
    seq = Sequencer("node-a", 7, model="m", group_specs=[GroupSpec(0, "full_attention", 16)])
    code, objs, _ = run(capsys, tmp_path, envelope(seq, encode_vllm_batch(EVENTS, 1.5)))
    assert code == 0 and len(objs) == 1
    meta = objs[0]["envelope"]
    assert (objs[0]["kind"], meta["node_id"], meta["epoch"], meta["seq"], meta["model"]) == ("envelope", "node-a", 7, 0, "m")
    assert meta["group_specs"] == [{"group_idx": 0, "kind": "full_attention", "block_size": 16}]
    assert meta["heartbeat"] is False and "batch" not in meta
    assert [e["type"] for e in objs[0]["events"]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_concatenated_envelopes_from_stdin_including_a_heartbeat(capsys, monkeypatch) -> None:
    seq = Sequencer("node-a", 7)
    data = envelope(seq, encode_vllm_batch(EVENTS, 1.5)) + envelope(seq, None) + envelope(seq, encode_vllm_batch(EVENTS[:1], 2.5, layout="array"), "array")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    assert main(["-"]) == 0
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [o["envelope"]["seq"] for o in objs] == [0, 1, 2]
    assert objs[1]["envelope"]["heartbeat"] is True and objs[1]["events"] == []
    assert objs[2]["layout"] == "array" and len(objs[2]["events"]) == 1


def test_zmq_recording(capsys, tmp_path) -> None:
    from kvpipe.producer.bridge.recording import open_recording, write_frame

    payload = encode_vllm_batch(EVENTS, 1.5)
    with open_recording(tmp_path, "rank0") as fh:
        write_frame(fh, [b"kv", (41).to_bytes(8, "big"), payload], 10.0)
        write_frame(fh, [b"only-one-frame"], 10.5)  # malformed: skipped by the reader
    code = main([str(tmp_path / "rank0.kvrec")])
    objs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 0 and len(objs) == 1
    assert objs[0]["zmq"] == {"topic": "kv", "seq": 41, "recv_ts": 10.0}
    assert len(objs[0]["events"]) == 3


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (b"hello world\n", "wrong_shape"),  # valid msgpack ints, but no batch or envelope
        (b"\xc1\x00\x01", "not_msgpack"),  # 0xc1 is never used by msgpack
        (encode_vllm_batch(EVENTS, 1.5)[:-7], "not_msgpack"),  # truncated
        (b"\x93\x01\x02\x03", "wrong_shape"),  # an array, but not a batch
        (b"", "not_msgpack"),
    ],
)
def test_garbage_exits_1_with_the_classified_error(capsys, tmp_path, data: bytes, kind: str) -> None:
    code, objs, err = run(capsys, tmp_path, data)
    assert code == 1 and objs == []
    assert f"{kind}:" in err and "kvpipe inspect" in err


def test_missing_file_exits_1(capsys, tmp_path) -> None:
    assert main([str(tmp_path / "nope.bin")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_msgpack_end_splits_concatenated_objects() -> None:
    objs = [{"a": [1, 2.5, b"xy", "s" * 40]}, [None, True, -3, 2**40, [], {}], "x" * 300, b"\x00" * 70000]
    data = b"".join(msgspec.msgpack.encode(o) for o in objs)
    pos, out = 0, []
    while pos < len(data):
        end = msgpack_end(data, pos)
        out.append(msgspec.msgpack.decode(data[pos:end]))
        pos = end
    assert out == objs
