"""Encoders and decoders for everything kvpipe puts on the wire, built once and reused.

Every decode failure is a `DecodeError` with a `kind` a program can count and a message a human
can act on:

- `too_large`: the message exceeds the configured size limit (checked before parsing);
- `not_msgpack`: the bytes are not (complete) msgpack — garbage or a truncated message;
- `wrong_shape`: valid msgpack, but not an envelope / batch (which field, what was expected);
- `unknown_version`: an envelope of a schema major version this reader does not know;
- `invalid`: decodes, but breaks an invariant (negative seq, empty node id, a timestamp that is
  NaN, infinite or negative, ...);
- `bad_utf8`: a string (a field value or any map key, known or not) is not valid UTF-8;
- `too_deep`: msgpack nested deeper than the decoder recurses (a hostile or corrupt message).

Every exception the decoders can raise on bad bytes becomes one of these; anything else escaping
`decode_envelope` / `envelope_events` is a bug in this module, not bad input.

vLLM batches come in two layouts: events as tagged maps (vLLM >= 0.24) and as tagged arrays
(vLLM <= 0.23). `decode_vllm_batch` looks at the first event's msgpack type byte to pick the
decoder, so neither layout pays for a failed attempt at the other.
"""
from __future__ import annotations

import math
from typing import Iterable

import msgspec

from kvpipe.schemas.envelope import (
    CONTENT_TYPE,
    HEADER_CONTENT_TYPE,
    HEADER_VERSION,
    SCHEMA_MAJOR,
    Envelope,
)
from kvpipe.schemas.events import (
    Event,
    KVEventBatch,
    LegacyKVEventBatch,
    from_legacy,
    to_legacy,
)

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
MAX_COUNT = 2**32  # dropped / lost_batches of one envelope

TOO_LARGE = "too_large"
NOT_MSGPACK = "not_msgpack"
WRONG_SHAPE = "wrong_shape"
UNKNOWN_VERSION = "unknown_version"
INVALID = "invalid"
BAD_UTF8 = "bad_utf8"
TOO_DEEP = "too_deep"
ERROR_KINDS = (TOO_LARGE, NOT_MSGPACK, WRONG_SHAPE, UNKNOWN_VERSION, INVALID, BAD_UTF8, TOO_DEEP)

# What a decoder may raise on bad bytes (msgspec raises the last two itself, not as DecodeError).
_DECODE_FAILURES = (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError)

LAYOUT_MAP = "map"
LAYOUT_ARRAY = "array"


class DecodeError(ValueError):
    """A message that could not be decoded; `kind` is one of ERROR_KINDS."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


class _VersionOnly(msgspec.Struct):
    v: int


_envelope_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)
_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_legacy_batch_decoder = msgspec.msgpack.Decoder(LegacyKVEventBatch)
# Every key of the envelope map, values left raw: msgspec skips the values of unknown keys without
# looking at their key's bytes, so this pass (~0.3 us) is what rejects a non-UTF-8 unknown key.
_keys_decoder = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])


def hex_excerpt(data: bytes, limit: int = 32) -> str:
    """A short hex dump for logs and DLQ reasons."""
    head = bytes(data[:limit]).hex(" ")
    return head + (f" ... ({len(data)} bytes)" if len(data) > limit else f" ({len(data)} bytes)")


def _classify(exc: BaseException, what: str, data: bytes) -> DecodeError:
    if isinstance(exc, UnicodeDecodeError):
        return DecodeError(BAD_UTF8, f"{what} has a string that is not UTF-8 ({exc.reason} at byte {exc.start} of "
                                     f"the string) [bytes: {hex_excerpt(data)}]")
    if isinstance(exc, RecursionError):
        return DecodeError(TOO_DEEP, f"{what} nests msgpack containers too deep to decode [bytes: {hex_excerpt(data)}]")
    if isinstance(exc, msgspec.ValidationError):
        return DecodeError(WRONG_SHAPE, f"{what} has the wrong shape: {exc} [bytes: {hex_excerpt(data)}]")
    text = str(exc)
    if "truncated" in text:
        return DecodeError(NOT_MSGPACK, f"{what} is truncated msgpack: {text} [bytes: {hex_excerpt(data)}]")
    return DecodeError(NOT_MSGPACK, f"{what} is not msgpack: {text} [bytes: {hex_excerpt(data)}]")


# --- vLLM batches ----------------------------------------------------------------------------------


def encode_vllm_batch(events: list[Event], ts: float, dp_rank: int | None = 0, layout: str = LAYOUT_MAP) -> bytes:
    """The bytes vLLM's publisher would send for these events (`layout="array"`: vLLM <= 0.23)."""
    if layout == LAYOUT_ARRAY:
        return _batch_encoder.encode(LegacyKVEventBatch(ts=ts, events=[to_legacy(e) for e in events], data_parallel_rank=dp_rank))
    return _batch_encoder.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=dp_rank))


def detect_layout(payload: bytes) -> str:
    """Which event layout a batch payload uses, from the first event's type byte.

    A batch is `fixarray(3)` (0x93), then a float64 (0xcb + 8 bytes) or another number, then the
    events array. We walk just enough msgpack to find the first event's header.
    """
    try:
        raw = msgspec.msgpack.decode(payload, type=tuple[msgspec.Raw, list[msgspec.Raw], msgspec.Raw])
    except Exception:
        return LAYOUT_MAP  # the real decoder will produce the precise error
    if not raw[1]:
        return LAYOUT_MAP
    first = bytes(raw[1][0])[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return LAYOUT_ARRAY
    return LAYOUT_MAP


def decode_vllm_batch(payload: bytes, max_bytes: int = DEFAULT_MAX_BYTES, layout: str | None = None) -> tuple[KVEventBatch, str]:
    """Decode a vLLM `KVEventBatch` of either layout; returns the batch (modern structs) and layout."""
    if len(payload) > max_bytes:
        raise DecodeError(TOO_LARGE, f"vLLM batch of {len(payload)} bytes exceeds the {max_bytes}-byte limit")
    if layout is None:
        # Fast path: modern layout; only a failed attempt pays for detection.
        try:
            return _batch_decoder.decode(payload), LAYOUT_MAP
        except _DECODE_FAILURES as exc:
            if isinstance(exc, (UnicodeDecodeError, RecursionError)) or detect_layout(payload) != LAYOUT_ARRAY:
                raise _classify(exc, "vLLM event batch", payload) from None
            layout = LAYOUT_ARRAY
    if layout == LAYOUT_ARRAY:
        try:
            legacy = _legacy_batch_decoder.decode(payload)
        except _DECODE_FAILURES as exc:
            raise _classify(exc, "vLLM event batch (array layout)", payload) from None
        events = [from_legacy(e) for e in legacy.events]
        return KVEventBatch(ts=legacy.ts, events=events, data_parallel_rank=legacy.data_parallel_rank), LAYOUT_ARRAY
    try:
        return _batch_decoder.decode(payload), LAYOUT_MAP
    except _DECODE_FAILURES as exc:
        raise _classify(exc, "vLLM event batch", payload) from None


# --- envelopes -------------------------------------------------------------------------------------


def encode_envelope(envelope: Envelope) -> bytes:
    return _envelope_encoder.encode(envelope)


def encode_envelope_into(envelope: Envelope, buffer: bytearray) -> None:
    """Encode into a reusable buffer (hot path of the publisher)."""
    _envelope_encoder.encode_into(envelope, buffer)


def validate_envelope(env: Envelope) -> None:
    """Invariants a decoded envelope must satisfy before anything applies it."""
    problems: list[str] = []
    if not env.node_id:
        problems.append("node_id is empty")
    if env.epoch < 0:
        problems.append(f"epoch {env.epoch} is negative")
    if env.seq < 0:
        problems.append(f"seq {env.seq} is negative")
    if env.dropped < 0 or env.lost_batches < 0:
        problems.append("dropped/lost_batches must be >= 0")
    elif env.dropped > MAX_COUNT or env.lost_batches > MAX_COUNT:
        # counters summing them must stay encodable (msgpack ints end at 2^64) in snapshots
        problems.append(f"dropped {env.dropped} / lost_batches {env.lost_batches}: more than {MAX_COUNT} is not a count")
    for name, count in (("running", env.running), ("waiting", env.waiting)):
        if count is not None and count < 0:
            problems.append(f"{name} {count} is negative")
    if env.kv_usage is not None and not 0.0 <= env.kv_usage < math.inf:
        problems.append(f"kv_usage {env.kv_usage!r} is not a finite, non-negative fraction")
    for name, value in (("ts", env.ts), ("sent_ts", env.sent_ts)):
        # NaN compares false with everything: `0 <= value < inf` rejects NaN, +-inf and negatives.
        if not 0.0 <= value < math.inf:
            problems.append(f"{name} {value!r} is not a finite, non-negative time (seconds since the epoch)")
    if env.group_specs is not None:
        seen = [g.group_idx for g in env.group_specs]
        if len(set(seen)) != len(seen):
            problems.append(f"group_specs repeat a group_idx: {seen}")
        for g in env.group_specs:
            if g.block_size <= 0:
                problems.append(f"group {g.group_idx}: block_size {g.block_size} must be > 0")
    if problems:
        raise DecodeError(INVALID, f"envelope from node {env.node_id!r} (epoch {env.epoch}, seq {env.seq}): " + "; ".join(problems))


def decode_envelope(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Envelope:
    """Decode and validate one envelope (the events stay raw; see `envelope_events`)."""
    if len(data) > max_bytes:
        raise DecodeError(TOO_LARGE, f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    try:
        env = _envelope_decoder.decode(data)
        _keys_decoder.decode(data)
    except (UnicodeDecodeError, RecursionError) as exc:
        raise _classify(exc, "kvpipe envelope", data) from None
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        # A future major version may have changed shape: say that rather than "wrong shape".
        try:
            version = _version_decoder.decode(data).v
        except Exception:
            version = SCHEMA_MAJOR
        if version != SCHEMA_MAJOR:
            raise DecodeError(UNKNOWN_VERSION, f"envelope schema major version {version}; this reader knows {SCHEMA_MAJOR}") from None
        raise _classify(exc, "kvpipe envelope", data) from None
    if env.v != SCHEMA_MAJOR:
        raise DecodeError(UNKNOWN_VERSION, f"envelope schema major version {env.v}; this reader knows {SCHEMA_MAJOR}")
    validate_envelope(env)
    return env


def envelope_events(env: Envelope, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Event]:
    """The events inside an envelope (empty for a heartbeat), decoded with the envelope's layout."""
    if env.is_heartbeat:
        return []
    layout = env.layout if env.layout in (LAYOUT_MAP, LAYOUT_ARRAY) else None
    batch, _ = decode_vllm_batch(bytes(env.batch), max_bytes, layout)
    return batch.events


# --- Kafka headers ---------------------------------------------------------------------------------

KAFKA_HEADERS: list[tuple[str, bytes]] = [
    (HEADER_VERSION, str(SCHEMA_MAJOR).encode()),
    (HEADER_CONTENT_TYPE, CONTENT_TYPE.encode()),
]
# The same headers, typed as confluent_kafka's `Producer.produce(headers=...)` takes them: its list is invariant in
# the value type (str | bytes | None), so a list of bytes values does not type-check there.
PRODUCE_HEADERS: list[tuple[str, str | bytes | None]] = list(KAFKA_HEADERS)


def check_headers(headers: Iterable[tuple[str, bytes | None]] | None) -> None:
    """Reject a message whose headers announce another major version or content type.

    Missing headers are accepted (the payload carries its own version); wrong ones are not.
    """
    for key, value in headers or ():
        if key == HEADER_VERSION and value is not None and value != KAFKA_HEADERS[0][1]:
            raise DecodeError(UNKNOWN_VERSION, f"header {HEADER_VERSION}={value!r}; this reader knows {SCHEMA_MAJOR}")
        if key == HEADER_CONTENT_TYPE and value is not None and value != KAFKA_HEADERS[1][1]:
            raise DecodeError(WRONG_SHAPE, f"header content-type={value!r}; expected {CONTENT_TYPE}")
