"""`kvpipe inspect FILE|-`: decode whatever KV-event bytes you have to JSON, one object per batch.

\b
Output (-o): jsonl (the default) is one JSON object per line as each batch is decoded: a capture may
hold millions of batches, and a line per object streams in constant memory into `jq` or `grep`
(--json is its older spelling). json is the same objects as one JSON array; table one line per
event (where it came from, batch kind, node, time, rank, event, group, medium, blocks, hashes).

\b
Recognised inputs (FILE, or - for stdin), from the first bytes:
- a kvpipe ZMQ recording (`kvpipe.producer.bridge.recording`, magic `KVPREC01`);
- a capture of raw ZMQ frames, each a 4-byte big-endian length and the frame (`kvpipe.producer.frame_capture`);
- one or more concatenated msgpack objects, each either a vLLM `KVEventBatch` (an array; map or
  array event layout) or a kvpipe envelope (a map) — a single payload, a single envelope and a
  dump of many envelopes are all this case;
- a directory: every file in it (name order, hidden files skipped), each recognised on its own;
  every object then says which `file` it came from.

Hashes: bytes hashes are always hex; int hashes are JSON ints (`--hashes int`, exact but beyond
2^53 for many JSON tools) or 16 hex digits (`--hashes hex`: the big-endian 8 bytes, i.e. the tail
of the digest vLLM took them from). Errors are printed as the classified `DecodeError`; exit 1.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Iterator

import click
import msgspec

from kvpipe.schemas.codec import (
    DEFAULT_MAX_BYTES,
    NOT_MSGPACK,
    WRONG_SHAPE,
    DecodeError,
    decode_envelope,
    decode_vllm_batch,
)
from kvpipe.schemas.cliopts import Command, configure_logging, log_level_option, output_option, run
from kvpipe.schemas.envelope import Envelope
from kvpipe.schemas.events import Event

RECORDING_MAGIC = b"KVPREC01"  # kvpipe.producer.bridge.recording.MAGIC, repeated to detect without importing
_HASH_FIELDS = ("block_hashes", "parent_block_hash")

# msgpack type byte → (bytes of length prefix, bytes of fixed payload) for the non-fix formats.
_SIZED = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext (+1 type byte)
    0xCA: (0, 4), 0xCB: (0, 8),  # float
    0xCC: (0, 1), 0xCD: (0, 2), 0xCE: (0, 4), 0xCF: (0, 8),  # uint
    0xD0: (0, 1), 0xD1: (0, 2), 0xD2: (0, 4), 0xD3: (0, 8),  # int
    0xD4: (0, 2), 0xD5: (0, 3), 0xD6: (0, 5), 0xD7: (0, 9), 0xD8: (0, 17),  # fixext
}


def msgpack_end(data: bytes, pos: int = 0) -> int:
    """Offset just past the msgpack object starting at `pos` (to split concatenated objects)."""
    pending = 1
    try:
        while pending:
            pending -= 1
            b = data[pos]
            pos += 1
            if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
                continue
            if b <= 0x8F:
                pending += 2 * (b & 0x0F)
            elif b <= 0x9F:
                pending += b & 0x0F
            elif b <= 0xBF:
                pos += b & 0x1F
            elif b in (0xDC, 0xDD, 0xDE, 0xDF):
                width = 2 if b in (0xDC, 0xDE) else 4
                count = int.from_bytes(data[pos:pos + width], "big")
                pos += width
                pending += count * (2 if b >= 0xDE else 1)
            elif b in _SIZED:
                prefix, fixed = _SIZED[b]
                length = int.from_bytes(data[pos:pos + prefix], "big") if prefix else 0
                pos += prefix + fixed + length
            else:
                raise DecodeError(NOT_MSGPACK, f"byte 0x{b:02x} at offset {pos - 1} is not a msgpack type")
            if pos > len(data):
                raise IndexError
    except IndexError:
        raise DecodeError(NOT_MSGPACK, f"msgpack object starting at offset {pos} is truncated ({len(data)} bytes in all)") from None
    return pos


def _jsonable(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def _hash(value: Any, hex_ints: bool) -> Any:
    if isinstance(value, int) and hex_ints:
        return format(value, "016x")
    return _jsonable(value)


def event_json(event: Event, hex_ints: bool) -> dict[str, Any]:
    out = msgspec.to_builtins(event, builtin_types=(bytes,))
    for key in _HASH_FIELDS:
        if key == "block_hashes" and key in out:
            out[key] = [_hash(h, hex_ints) for h in out[key]]
        elif key in out:
            out[key] = _hash(out[key], hex_ints)
    return _jsonable(out)


def _batch_json(payload: bytes, max_bytes: int, hex_ints: bool, layout: str | None = None) -> dict[str, Any]:
    batch, layout = decode_vllm_batch(payload, max_bytes, layout)
    return {"layout": layout, "ts": batch.ts, "data_parallel_rank": batch.data_parallel_rank,
            "events": [event_json(e, hex_ints) for e in batch.events]}


def _envelope_json(data: bytes, max_bytes: int, hex_ints: bool) -> dict[str, Any]:
    env = decode_envelope(data, max_bytes)
    meta = {f: getattr(env, f) for f in Envelope.__struct_fields__ if f != "batch"}
    meta["heartbeat"] = env.is_heartbeat
    out: dict[str, Any] = {"kind": "envelope", "envelope": msgspec.to_builtins(meta)}
    if env.is_heartbeat:
        out.update(layout=None, ts=env.ts, data_parallel_rank=env.dp_rank, events=[])
    else:
        out.update(_batch_json(bytes(env.batch), max_bytes, hex_ints, env.layout if env.layout in ("map", "array") else None))
    return out


def decode_stream(data: bytes, max_bytes: int, hex_ints: bool) -> Iterator[dict[str, Any]]:
    """Concatenated msgpack objects: arrays are vLLM batches, maps are envelopes."""
    if not data:
        raise DecodeError(NOT_MSGPACK, "empty input: nothing to decode")
    pos = 0
    while pos < len(data):
        end = msgpack_end(data, pos)
        chunk, first = data[pos:end], data[pos]
        if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
            out = {"kind": "vllm_batch"}
            out.update(_batch_json(chunk, max_bytes, hex_ints))
        elif 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
            out = _envelope_json(chunk, max_bytes, hex_ints)
        elif pos == 0:
            raise DecodeError(WRONG_SHAPE, f"not a vLLM batch (msgpack array), kvpipe envelope (msgpack map), "
                                           f"ZMQ recording ({RECORDING_MAGIC.decode()}) or capture of 4-byte "
                                           f"big-endian length-prefixed frames: first byte 0x{first:02x}")
        else:
            raise DecodeError(WRONG_SHAPE, f"msgpack object at offset {pos} is neither a vLLM batch (array) "
                                           f"nor a kvpipe envelope (map): type byte 0x{first:02x}")
        out["offset"] = pos
        yield out
        pos = end


def decode_recording(path: str, max_bytes: int, hex_ints: bool) -> Iterator[dict[str, Any]]:
    try:
        from kvpipe.producer.bridge.recording import read_recording
    except ImportError as exc:
        raise DecodeError(WRONG_SHAPE, f"this looks like a ZMQ recording, but the reader is unavailable ({exc})") from None
    for topic, seq, payload, ts in read_recording(path):
        out: dict[str, Any] = {"kind": "zmq", "zmq": {"topic": topic.decode("utf-8", "replace"), "seq": seq, "recv_ts": ts}}
        out.update(_batch_json(payload, max_bytes, hex_ints))
        yield out


def decode_frame_capture(data: bytes, max_bytes: int, hex_ints: bool) -> Iterator[dict[str, Any]]:
    from kvpipe.producer.frame_capture import FrameCaptureError, messages, split_frames

    frames = split_frames(data) or []
    try:
        for msg in messages(frames):
            out: dict[str, Any] = {"kind": "zmq", "zmq": {"topic": None if msg.topic is None else
                                                          msg.topic.decode("utf-8", "replace"), "seq": msg.seq}}
            out.update(_batch_json(msg.payload, max_bytes, hex_ints))
            out["offset"] = msg.offset
            yield out
    except FrameCaptureError as exc:
        raise DecodeError(WRONG_SHAPE, str(exc)) from None


def decode_bytes(data: bytes, path: str, max_bytes: int, hex_ints: bool) -> Iterator[dict[str, Any]]:
    """One input's objects, its kind recognised from its first bytes (`path` only for the
    recording reader, which reads files)."""
    from kvpipe.producer.frame_capture import is_frame_capture

    if data.startswith(RECORDING_MAGIC):
        return decode_recording(path, max_bytes, hex_ints)
    if is_frame_capture(data):
        return decode_frame_capture(data, max_bytes, hex_ints)
    return decode_stream(data, max_bytes, hex_ints)


def decode_directory(path: str, max_bytes: int, hex_ints: bool) -> Iterator[dict[str, Any]]:
    names = sorted(n for n in os.listdir(path) if not n.startswith(".") and os.path.isfile(os.path.join(path, n)))
    if not names:
        raise DecodeError(WRONG_SHAPE, "the directory holds no files to decode")
    for name in names:
        file = os.path.join(path, name)
        with open(file, "rb") as fh:
            data = fh.read()
        try:
            for obj in decode_bytes(data, file, max_bytes, hex_ints):
                yield {"file": name, **obj}
        except DecodeError as exc:
            raise DecodeError(exc.kind, f"{name}: {exc.message}") from None


@click.command("inspect", cls=Command, help=__doc__.replace("`kvpipe inspect FILE|-`: d", "D", 1))
@click.argument("file")
@click.option("--hashes", type=click.Choice(("int", "hex")), default="int", show_default=True,
              help="how to print int block hashes")
@click.option("--max-bytes", type=int, default=DEFAULT_MAX_BYTES, show_default=True, help="largest message to accept")
@output_option(("jsonl", "json", "table"), default="jsonl", json_means="jsonl",
               help="JSON lines (one object per batch), one JSON array, or a table of events")
@log_level_option()
def inspect(file: str, hashes: str, max_bytes: int, output: str, log_level: str) -> int:
    configure_logging(log_level)
    hex_ints = hashes == "hex"
    out = sys.stdout.buffer
    write = _writer(output, out)
    tmp: str | None = None
    try:
        if file != "-" and os.path.isdir(file):
            objects = decode_directory(file, max_bytes, hex_ints)
        else:
            if file == "-":
                data = sys.stdin.buffer.read()
            else:
                with open(file, "rb") as fh:
                    data = fh.read()
            path = file
            if path == "-" and data.startswith(RECORDING_MAGIC):  # the recording reader takes a path
                fd, tmp = tempfile.mkstemp(suffix=".kvrec")
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
                path = tmp
            objects = decode_bytes(data, path, max_bytes, hex_ints)
        for obj in objects:
            write(obj)
        write(None)
        out.flush()
    except (DecodeError, ValueError) as exc:  # RecordingError is a ValueError
        out.flush()
        print(f"kvpipe inspect: {file}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvpipe inspect: cannot read {file}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    finally:
        if tmp:
            os.unlink(tmp)
    return 0


def _writer(output: str, out: Any) -> Any:
    """`write(obj)` for each decoded object, then `write(None)` at the end, in format `output`: each
    object goes out as it is decoded (no format holds the whole input)."""
    encoder = msgspec.json.Encoder()
    count = 0

    def write(obj: dict[str, Any] | None) -> None:
        nonlocal count
        if output == "jsonl":
            if obj is not None:
                out.write(encoder.encode(obj) + b"\n")
        elif output == "json":  # an array written as it goes: "[" before the first object, "]" after the last
            if obj is None:
                out.write(b"]\n" if count else b"[]\n")
            else:
                out.write((b",\n" if count else b"[\n") + encoder.encode(obj))
        else:
            if count == 0:
                out.write(_table_line([name for name, _ in TABLE_COLUMNS]))
            for row in ([] if obj is None else table_rows(obj)):
                out.write(_table_line(row))
        count += obj is not None
    return write


# `-o table`: one line per event, columns padded to these widths (a longer value widens its line only:
# the table streams, so no width is known in advance); the hashes come last, unpadded.
TABLE_COLUMNS = (("where", 14), ("kind", 10), ("node", 12), ("ts", 16), ("rank", 4), ("event", 16), ("group", 5),
                 ("medium", 6), ("blocks", 6), ("hashes", 0))


def _table_line(cells: list[str]) -> bytes:
    line = "  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, TABLE_COLUMNS))
    return line.rstrip().encode() + b"\n"


def table_rows(obj: dict[str, Any]) -> list[list[str]]:
    """The `-o table` rows of one decoded object: one per event; one for a batch without events (a
    heartbeat envelope says so)."""
    where = (f"{obj['file']}" if "file" in obj else "") + (
        f"@{obj['offset']}" if "offset" in obj else f"#{obj.get('zmq', {}).get('seq')}")
    if obj["kind"] == "envelope":
        node = str(obj["envelope"].get("node_id", ""))
    else:
        node = str((obj.get("zmq") or {}).get("topic") or "")
    ts = obj.get("ts")
    head = [where, obj["kind"], node, "" if ts is None else f"{ts:.3f}", _text(obj.get("data_parallel_rank"))]
    events = obj.get("events") or []
    if not events:
        heartbeat = obj["kind"] == "envelope" and obj["envelope"].get("heartbeat")
        return [head + ["(heartbeat)" if heartbeat else "(no events)", "", "", "", ""]]
    rows = []
    for event in events:
        hashes = event.get("block_hashes") or []
        shown = " ".join(str(h) for h in hashes[:2]) + (f" … {hashes[-1]}" if len(hashes) > 2 else "")
        rows.append(head + [event.get("type", ""), _text(event.get("group_idx")), _text(event.get("medium")),
                            str(len(hashes)) if "block_hashes" in event else "", shown])
    return rows


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    return int(run(inspect, argv, "kvpipe inspect"))
