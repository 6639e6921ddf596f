"""Every way a message can be bad gets its own error kind and a message that says what to fix."""
import msgspec
import pytest

from kvpipe.schemas.codec import (
    INVALID, NOT_MSGPACK, TOO_LARGE, UNKNOWN_VERSION, WRONG_SHAPE, DecodeError, KAFKA_HEADERS,
    check_headers, decode_envelope, decode_vllm_batch, encode_envelope, encode_vllm_batch, envelope_events,
)
from kvpipe.schemas.envelope import Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved


def _env(**kw):
    base = dict(v=1, node_id="n1", epoch=1, seq=0, ts=1.0)
    base.update(kw)
    return Envelope(**base)


def _kind(data, **kw):
    with pytest.raises(DecodeError) as info:
        decode_envelope(data, **kw)
    return info.value


def test_truncated_envelope_is_not_msgpack_and_says_truncated():
    data = encode_envelope(_env(batch=msgspec.Raw(encode_vllm_batch([BlockRemoved([1], "GPU")], 1.0))))
    err = _kind(data[:-3])
    assert err.kind == NOT_MSGPACK and "truncated" in err.message


def test_garbage_bytes_are_rejected_with_a_hex_excerpt():
    err = _kind(b"\xc1\xc1 this is not msgpack")
    assert err.kind == NOT_MSGPACK and "c1 c1" in err.message


def test_msgpack_of_the_wrong_shape_names_the_field():
    err = _kind(msgspec.msgpack.encode({"v": 1, "node_id": "n", "epoch": "one", "seq": 0, "ts": 0.0}))
    assert err.kind == WRONG_SHAPE and "epoch" in err.message


def test_unknown_major_version_even_when_the_shape_changed():
    err = _kind(msgspec.msgpack.encode({"v": 2, "node": "renamed field"}))
    assert err.kind == UNKNOWN_VERSION and "2" in err.message


def test_size_limit_is_checked_before_parsing():
    err = _kind(encode_envelope(_env()), max_bytes=10)
    assert err.kind == TOO_LARGE and "10-byte limit" in err.message


def test_invariants_are_checked_after_decoding():
    err = _kind(encode_envelope(_env(seq=-1, node_id="")))
    assert err.kind == INVALID and "seq -1" in err.message and "node_id is empty" in err.message
    err = _kind(encode_envelope(_env(group_specs=[GroupSpec(0, "full_attention", 16), GroupSpec(0, "mamba", 16)])))
    assert err.kind == INVALID and "repeat a group_idx" in err.message


def test_bad_inner_batch_is_classified_when_events_are_read():
    env = decode_envelope(encode_envelope(_env(batch=msgspec.Raw(msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0])))))
    with pytest.raises(DecodeError) as info:
        envelope_events(env)
    assert info.value.kind == WRONG_SHAPE and "Nope" in info.value.message


def test_vllm_batch_size_limit():
    with pytest.raises(DecodeError) as info:
        decode_vllm_batch(b"\x93" + b"\x00" * 100, max_bytes=50)
    assert info.value.kind == TOO_LARGE


def test_headers_of_another_version_or_content_type_are_rejected():
    check_headers(KAFKA_HEADERS)
    check_headers(None)
    with pytest.raises(DecodeError) as info:
        check_headers([("kvpipe-schema", b"2")])
    assert info.value.kind == UNKNOWN_VERSION
    with pytest.raises(DecodeError) as info:
        check_headers([("content-type", b"application/json")])
    assert info.value.kind == WRONG_SHAPE


def test_an_envelope_built_with_an_empty_batch_still_encodes_as_a_valid_heartbeat():
    env = _env(batch=msgspec.Raw(b""))
    back = decode_envelope(encode_envelope(env))
    assert back.is_heartbeat and back.seq == 0


def _with_raw_key(env_bytes: bytes, key: bytes, value: bytes = b"\x01") -> bytes:
    """The envelope map with one more key (map header bumped), given as raw msgpack bytes."""
    if 0x80 <= env_bytes[0] < 0x8F:
        head, rest = bytes([env_bytes[0] + 1]), env_bytes[1:]
    else:
        assert env_bytes[0] == 0xDE  # map16
        head, rest = b"\xde" + (int.from_bytes(env_bytes[1:3], "big") + 1).to_bytes(2, "big"), env_bytes[3:]
    return head + rest + bytes([0xA0 | len(key)]) + key + value


def test_invalid_utf8_in_a_known_string_is_bad_utf8_not_a_crash():
    data = bytearray(encode_envelope(_env(node_id="abc")))
    data[data.find(b"abc")] = 0xFF
    err = _kind(bytes(data))
    assert err.kind == "bad_utf8" and "not UTF-8" in err.message


def test_invalid_utf8_in_an_unknown_key_is_rejected_too():
    err = _kind(_with_raw_key(encode_envelope(_env()), b"\xff\xfe"))
    assert err.kind == "bad_utf8"
    assert decode_envelope(_with_raw_key(encode_envelope(_env()), b"future")).node_id == "n1"  # valid unknown keys pass


def test_deeply_nested_msgpack_is_too_deep_not_a_recursion_error():
    deep = b"\x91" * 5000 + b"\xc0"
    err = _kind(_with_raw_key(encode_envelope(_env()), b"x", deep))
    assert err.kind == "too_deep"
    inner = b"\x93\xcb" + b"\x00" * 8 + deep + b"\xc0"  # a vLLM batch whose events nest 5000 deep
    assert _kind(encode_envelope(_env(batch=msgspec.Raw(inner)))).kind == "too_deep"
    with pytest.raises(DecodeError) as info:
        decode_vllm_batch(inner)
    assert info.value.kind in ("too_deep", "wrong_shape")  # msgspec may see the wrong shape before the depth


def test_invalid_utf8_inside_the_vllm_batch_is_bad_utf8():
    batch = bytearray(encode_vllm_batch([BlockRemoved([1], "GPU")], 1.0))
    batch[batch.find(b"GPU")] = 0xC3  # a lead byte with no continuation
    env = decode_envelope(encode_envelope(_env(batch=msgspec.Raw(bytes(batch)))))
    with pytest.raises(DecodeError) as info:
        envelope_events(env)
    assert info.value.kind == "bad_utf8"


@pytest.mark.parametrize("load", [{"running": -1}, {"waiting": -3}, {"kv_usage": -0.1}, {"kv_usage": float("nan")},
                                  {"kv_usage": float("inf")}])
def test_a_negative_or_non_finite_load_is_invalid(load):
    # the router relies on loads >= 0 (a node holding nothing never outscores a live hit then)
    assert _kind(encode_envelope(_env(**load))).kind == INVALID
