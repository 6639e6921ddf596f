"""Golden bytes for the additive v1 field `GroupSpec.sink_len` (sink full attention's static sink, in
tokens). Kept beside the older vectors, which are never edited and stay valid with the field absent."""
import json
from pathlib import Path

import msgspec

from kvpipe.gpu.specs import SinkFullAttention, SlidingWindow, from_group_spec
from kvpipe.schemas.codec import decode_envelope, encode_envelope

HERE = Path(__file__).parent
GOLDEN = json.loads((HERE / "envelope_v1_sink.json").read_text())
OLDER = [json.loads(p.read_text()) for p in sorted(HERE.glob("envelope_v1*.json")) if p.name != "envelope_v1_sink.json"]


def test_sink_vector_decodes_and_reencodes_to_the_same_bytes() -> None:
    data = bytes.fromhex(GOLDEN["v1_added_group_sink_len"])
    env = decode_envelope(data)
    assert [(g.kind, g.block_size, g.sink_len) for g in env.group_specs] == [
        ("sink_full_attention", 16, 64), ("sliding_window", 16, None), ("sink_full_attention", 16, None)]
    assert encode_envelope(env) == data
    assert [from_group_spec(g) for g in env.group_specs] == [
        SinkFullAttention(16, 64), SlidingWindow(16, 128), SinkFullAttention(16)]


def test_the_new_key_is_appended_and_omitted_when_not_declared() -> None:
    groups = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["v1_added_group_sink_len"]))["group_specs"]
    assert list(groups[0])[-1] == "sink_len"
    assert "sink_len" not in groups[1] and "sink_len" not in groups[2]


def test_older_vectors_have_no_sink_and_reencode_unchanged() -> None:
    for vectors in OLDER:
        for name, hexbytes in vectors.items():
            env = decode_envelope(bytes.fromhex(hexbytes))
            assert all(g.sink_len is None for g in env.group_specs or ()), name
            assert encode_envelope(env) == bytes.fromhex(hexbytes), name


def test_a_reader_that_predates_the_field_ignores_it() -> None:
    class OldGroupSpec(msgspec.Struct):
        group_idx: int
        kind: str
        block_size: int

    class OldEnvelope(msgspec.Struct):
        node_id: str
        group_specs: list[OldGroupSpec]

    old = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["v1_added_group_sink_len"]), type=OldEnvelope)
    assert [(g.kind, g.block_size) for g in old.group_specs] == [
        ("sink_full_attention", 16), ("sliding_window", 16), ("sink_full_attention", 16)]
