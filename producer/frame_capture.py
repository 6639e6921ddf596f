"""Captures of raw ZMQ frames, each written as a 4-byte big-endian length and the frame's bytes.

This is what a generic capture tool (or a few lines around `socket.recv_multipart()`) writes when
it has no format of its own: no magic, no message boundaries, just frames back to back. kvpipe's own
recordings (`kvpipe.producer.bridge.recording`, magic `KVPREC01`) keep message boundaries and receive
times; this reader recovers the boundaries from the shapes vLLM's sockets send
(docs/vllm-behaviour.md §2):

- the PUB socket's messages are `[topic, seq, payload]`: seq an 8-byte big-endian int, payload a
  msgpack array (the `KVEventBatch`); the topic may be empty;
- the replay ROUTER's answers, as the requesting DEALER receives them, are `[b"", topic, seq,
  payload]` (vLLM >= 0.26) or `[b"", seq, payload]` (older); the empty delimiter frame is skipped and
  the end marker (seq ff×8, empty payload) carries no batch;
- a lone payload frame (a capture of payloads only) is a batch without topic or seq.

A frame that fits none of these is reported with its offset, not guessed at.
"""
from __future__ import annotations

import struct
from typing import Iterator, NamedTuple

_LEN = struct.Struct(">I")
SEQ_BYTES = 8
END_OF_REPLAY = b"\xff" * SEQ_BYTES  # the replay ROUTER's last message


class FrameCaptureError(ValueError):
    pass


class Frame(NamedTuple):
    offset: int  # of the length prefix in the file
    data: bytes


class CapturedMessage(NamedTuple):
    offset: int  # of the message's first frame
    topic: bytes | None
    seq: int | None
    payload: bytes


def split_frames(data: bytes) -> list[Frame] | None:
    """The frames of a length-prefixed capture, or None if `data` is not one (a prefix that runs
    past the end, or trailing bytes too short for a prefix)."""
    frames: list[Frame] = []
    pos, end = 0, len(data)
    while pos < end:
        if end - pos < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(data, pos)
        if pos + _LEN.size + n > end:
            return None
        frames.append(Frame(pos, data[pos + _LEN.size:pos + _LEN.size + n]))
        pos += _LEN.size + n
    return frames or None


def is_frame_capture(data: bytes) -> bool:
    # A msgpack batch or envelope starts with an array/map type byte (0x8x, 0x9x, 0xdc-0xdf); a
    # length prefix of a frame under 16 MiB starts with 0x00. Then the prefixes must tile the file.
    return bool(data) and data[0] == 0 and split_frames(data) is not None


def _is_batch(frame: bytes) -> bool:
    return bool(frame) and (0x90 <= frame[0] <= 0x9F or frame[0] in (0xDC, 0xDD))


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big")


def messages(frames: list[Frame]) -> Iterator[CapturedMessage]:
    """vLLM messages from a capture's frames (the shapes in the module doc)."""
    i, n = 0, len(frames)
    data = [f.data for f in frames]
    while i < n:
        here = frames[i].offset
        if i + 2 < n and len(data[i + 1]) == SEQ_BYTES and _is_batch(data[i + 2]) and not _is_batch(data[i]):
            yield CapturedMessage(here, data[i], _seq(data[i + 1]), data[i + 2])
            i += 3
        elif i + 1 < n and len(data[i]) == SEQ_BYTES and (_is_batch(data[i + 1]) or
                                                          (data[i] == END_OF_REPLAY and not data[i + 1])):
            if data[i + 1]:  # the end-of-replay marker carries no batch
                yield CapturedMessage(here, None, _seq(data[i]), data[i + 1])
            i += 2
        elif _is_batch(data[i]):
            yield CapturedMessage(here, None, None, data[i])
            i += 1
        elif not data[i] and i + 1 < n:  # an empty delimiter frame (ROUTER/DEALER envelopes)
            i += 1
        else:
            raise FrameCaptureError(
                f"frame {i} at byte {here} ({len(data[i])} bytes, first byte "
                f"{'none' if not data[i] else f'0x{data[i][0]:02x}'}) is not part of a vLLM message: expected "
                f"[topic, 8-byte seq, msgpack batch], [8-byte seq, msgpack batch] or a msgpack batch")
