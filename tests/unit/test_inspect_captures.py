"""`kvpipe inspect` on captures of length-prefixed ZMQ frames and on directories of captures."""
from __future__ import annotations

import json
import struct

from kvpipe.producer.bridge.recording import open_recording, write_frame
from kvpipe.producer.inspect import main
from kvpipe.schemas.codec import encode_vllm_batch
from kvpipe.schemas.events import BlockRemoved, BlockStored


def _batch(first_hash: int, ts: float) -> bytes:
    return encode_vllm_batch([BlockStored([first_hash, first_hash + 1], None, list(range(8)), 4, None, "GPU", None,
                                          group_idx=0, kv_cache_spec_kind="full_attention"),
                              BlockRemoved([first_hash - 1], "GPU", group_idx=0)], ts)


def _frames(*frames: bytes) -> bytes:
    return b"".join(struct.pack(">I", len(f)) + f for f in frames)


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def _run(capsys, *argv: str) -> tuple[int, list[dict], str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, [json.loads(line) for line in out.splitlines()], err


def test_live_pub_messages_and_a_replay_answer_in_one_capture(capsys, tmp_path):
    data = _frames(b"kv-events", _seq(7), _batch(100, 1.0),      # live: [topic, seq, payload]
                   b"", _seq(8), _batch(200, 2.0),               # live with an empty topic
                   b"", b"kv-events", _seq(5), _batch(50, 0.5),  # replay answer as a DEALER sees it
                   b"", b"", b"\xff" * 8, b"")                   # end of the replay
    path = tmp_path / "pub.frames"
    path.write_bytes(data)
    code, objs, err = _run(capsys, str(path))
    assert code == 0, err
    assert [(o["kind"], o["zmq"]["topic"], o["zmq"]["seq"]) for o in objs] == [
        ("zmq", "kv-events", 7), ("zmq", "", 8), ("zmq", "kv-events", 5)]
    assert objs[0]["events"][0]["block_hashes"] == [100, 101] and objs[0]["ts"] == 1.0
    assert objs[2]["events"][1]["block_hashes"] == [49]
    assert objs[0]["offset"] == 0


def test_pre_026_replay_frames_and_bare_payload_frames(capsys, tmp_path):
    path = tmp_path / "old.bin"
    path.write_bytes(_frames(_seq(3), _batch(10, 3.0), _batch(20, 4.0)))
    code, objs, err = _run(capsys, str(path), "--hashes", "hex")
    assert code == 0, err
    assert [(o["zmq"]["topic"], o["zmq"]["seq"]) for o in objs] == [(None, 3), (None, None)]
    assert objs[1]["events"][0]["block_hashes"] == ["0000000000000014", "0000000000000015"]


def test_a_frame_that_is_no_vllm_message_is_reported_with_its_offset(capsys, tmp_path):
    path = tmp_path / "bad.bin"
    path.write_bytes(_frames(b"kv-events", _seq(1), _batch(1, 1.0), b"\x01\x02\x03"))
    code, objs, err = _run(capsys, str(path))
    assert code == 1 and len(objs) == 1  # what decoded before the bad frame is still printed
    assert "frame 3" in err and "not part of a vLLM message" in err


def test_a_directory_of_captures_of_every_kind(capsys, tmp_path):
    captures = tmp_path / "captures"
    fh = open_recording(captures, "rank0")  # kvpipe's own recording
    write_frame(fh, [b"kv-events", _seq(1), _batch(300, 5.0)], recv_ts=5.5)
    fh.close()
    (captures / "rank1.frames").write_bytes(_frames(b"kv-events", _seq(2), _batch(400, 6.0)))
    (captures / "payload.msgpack").write_bytes(_batch(500, 7.0))  # one bare payload
    (captures / ".hidden").write_bytes(b"ignored")
    code, objs, err = _run(capsys, str(captures))
    assert code == 0, err
    assert [(o["file"], o["kind"]) for o in objs] == [
        ("payload.msgpack", "vllm_batch"), ("rank0.kvrec", "zmq"), ("rank1.frames", "zmq")]
    assert [o["events"][0]["block_hashes"][0] for o in objs] == [500, 300, 400]
    assert objs[1]["zmq"]["recv_ts"] == 5.5


def test_an_empty_directory_is_an_error_not_silence(capsys, tmp_path):
    code, objs, err = _run(capsys, str(tmp_path))
    assert code == 1 and objs == [] and "no files" in err


def test_a_bad_file_in_a_directory_is_named(capsys, tmp_path):
    (tmp_path / "a.frames").write_bytes(_frames(b"kv-events", _seq(2), _batch(400, 6.0)))
    (tmp_path / "b.txt").write_bytes(b"hello")
    code, objs, err = _run(capsys, str(tmp_path))
    assert code == 1 and len(objs) == 1 and "b.txt" in err
