"""Raw captures of vLLM's ZMQ stream (`kvpipe bridge --record DIR`), and reading them back.

File format (`*.kvrec`, one file per data-parallel rank): the 8-byte magic `KVPREC01`, then one
record per received ZMQ message: a 4-byte big-endian length, then that many bytes of msgpack
`[recv_ts, [frame, ...]]` (float64 wall-clock receive time, the frames as `bin`, exactly as
received — malformed messages included, so a capture can reproduce a bad stream). Records are
flushed as they are written; a file cut short by a kill ends at its last complete record.

`read_recording` yields the well-formed live messages as `(topic, seq, payload, recv_ts)`;
`read_raw` yields every record's frames.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO, Iterator

import msgspec

from kvpipe.producer.bridge.subscriber import MalformedFrames, split_live_frames

MAGIC = b"KVPREC01"
SUFFIX = ".kvrec"
_LEN = struct.Struct(">I")


class Record(msgspec.Struct, array_like=True):
    ts: float
    frames: list[bytes]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Record)


class RecordingError(ValueError):
    pass


def open_recording(directory: str | Path, name: str) -> BinaryIO:
    """A new capture file `DIR/<name>.kvrec` (parents created), magic already written."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    fh = open(path / f"{name}{SUFFIX}", "wb")
    fh.write(MAGIC)
    return fh


def write_frame(fh: BinaryIO, frames: list[bytes], recv_ts: float, *, flush: bool = True) -> None:
    """Append one received ZMQ message."""
    body = _encoder.encode(Record(recv_ts, [bytes(f) for f in frames]))
    fh.write(_LEN.pack(len(body)) + body)
    if flush:
        fh.flush()


def recording_files(path: str | Path) -> list[Path]:
    """The capture files under `path` (a file, or a directory of `*.kvrec`), in name order."""
    p = Path(path)
    if p.is_dir():
        return sorted(p.glob(f"*{SUFFIX}"))
    return [p]


def _records(file: Path) -> Iterator[Record]:
    with open(file, "rb") as fh:
        if fh.read(len(MAGIC)) != MAGIC:
            raise RecordingError(f"{file}: not a kvpipe ZMQ recording (magic {MAGIC!r} missing)")
        while True:
            head = fh.read(_LEN.size)
            if len(head) < _LEN.size:
                return
            (n,) = _LEN.unpack(head)
            body = fh.read(n)
            if len(body) < n:
                return  # cut short by a kill: stop at the last complete record
            try:
                yield _decoder.decode(body)
            except msgspec.DecodeError as exc:
                raise RecordingError(f"{file}: corrupt record at byte {fh.tell() - n}: {exc}") from None


def read_raw(path: str | Path) -> Iterator[tuple[list[bytes], float]]:
    """Every recorded message's frames and receive time, malformed ones included."""
    for file in recording_files(path):
        for rec in _records(file):
            yield rec.frames, rec.ts


def read_recording(path: str | Path) -> Iterator[tuple[bytes, int, bytes, float]]:
    """`(topic, seq, payload, recv_ts)` of every well-formed live message in a file or directory."""
    for frames, ts in read_raw(path):
        try:
            topic, seq, payload = split_live_frames(frames)
        except MalformedFrames:
            continue
        yield topic, seq, payload, ts
