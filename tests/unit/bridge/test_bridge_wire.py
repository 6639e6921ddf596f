"""Endpoints, frame shapes, replay replies and capture files, as vLLM defines them (docs/vllm-behaviour.md §2)."""
from __future__ import annotations

import pytest

from kvpipe.producer.bridge.recording import MAGIC, RecordingError, open_recording, read_raw, read_recording, write_frame
from kvpipe.producer.bridge.replay import END_SEQ, parse_reply
from kvpipe.producer.bridge.subscriber import MalformedFrames, bridge_binds, offset_endpoint, split_live_frames, vllm_binds


@pytest.mark.parametrize("endpoint, rank, expected", [
    ("tcp://node:5557", 0, "tcp://node:5557"),
    ("tcp://node:5557", 3, "tcp://node:5560"),
    ("tcp://*:5557", 1, "tcp://*:5558"),
    ("tcp://*:0", 2, "tcp://*:0"),  # an ephemeral port is left to the OS
    ("tcp://[::1]:5557", 1, "tcp://[::1]:5558"),
    ("inproc://kv", 2, "inproc://kv_dp2"),
])
def test_dp_rank_offsets_follow_vllm(endpoint, rank, expected):
    assert offset_endpoint(endpoint, rank) == expected


def test_dp_rank_offsets_reject_other_transports():
    with pytest.raises(ValueError, match="tcp:// or inproc://"):
        offset_endpoint("ipc:///tmp/kv", 1)


def test_bind_rules():
    assert vllm_binds("tcp://*:5557") and vllm_binds("ipc:///x") and vllm_binds("tcp://[::]:1")
    assert not vllm_binds("tcp://bridge-host:5557")
    # the bridge connects unless told to bind, or given a wildcard it could not connect to
    assert not bridge_binds("tcp://node:5557") and not bridge_binds("ipc:///x")
    assert bridge_binds("tcp://*:5557") and bridge_binds("tcp://0.0.0.0:5557") and bridge_binds("tcp://node:1", True)


def test_live_frames_must_be_topic_seq8_payload():
    assert split_live_frames([b"t", (7).to_bytes(8, "big"), b"p"]) == (b"t", 7, b"p")
    for bad in ([b"t", b"p"], [b"t", b"1234567", b"p"], [b"a", b"b", b"c", b"d"], []):
        with pytest.raises(MalformedFrames):
            split_live_frames(bad)


def test_replay_replies_with_and_without_topic_frame():
    seq = (5).to_bytes(8, "big")
    assert parse_reply([b"", b"topic", seq, b"x"]).seq == 5  # >= 0.26, as a DEALER sees it
    assert parse_reply([b"", b"", seq, b"x"]).payload == b"x"  # empty topic
    assert parse_reply([b"", seq, b"x"]).seq == 5  # < 0.26: no topic frame
    assert parse_reply([b"topic", seq, b"x"]).seq == 5  # delimiter already stripped
    assert parse_reply([b"", b"", END_SEQ, b""]) is None
    assert parse_reply([b"", END_SEQ, b""]) is None
    with pytest.raises(MalformedFrames):
        parse_reply([b"", b"t", b"short", b"x"])
    with pytest.raises(MalformedFrames):
        parse_reply([b"", b"a", b"b", b"c", b"d"])


def test_recording_round_trip_skips_malformed_and_survives_a_cut_tail(tmp_path):
    fh = open_recording(tmp_path, "rank0")
    write_frame(fh, [b"kv", (0).to_bytes(8, "big"), b"\x93"], 1.5)
    write_frame(fh, [b"only", b"two"], 1.6)
    write_frame(fh, [b"kv", (1).to_bytes(8, "big"), b"payload"], 1.7)
    fh.close()
    path = tmp_path / "rank0.kvrec"
    assert path.read_bytes().startswith(MAGIC)
    assert list(read_recording(tmp_path)) == [(b"kv", 0, b"\x93", 1.5), (b"kv", 1, b"payload", 1.7)]
    assert [f for f, _ in read_raw(path)][1] == [b"only", b"two"]
    path.write_bytes(path.read_bytes()[:-3])  # killed mid-write
    assert [seq for _, seq, _, _ in read_recording(path)] == [0]


def test_a_foreign_file_is_refused_with_its_name(tmp_path):
    bad = tmp_path / "x.kvrec"
    bad.write_bytes(b"hello world")
    with pytest.raises(RecordingError, match="x.kvrec"):
        list(read_recording(bad))
