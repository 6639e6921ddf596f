"""Golden bytes pin schema v1 of the envelope. These vectors are never edited: a change that breaks
them is a new major version (see schemas/__init__.py for the evolution rule)."""
import json
from pathlib import Path

import msgspec

from kvpipe.schemas.codec import decode_envelope, encode_envelope, envelope_events
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope

GOLDEN = json.loads((Path(__file__).parent / "envelope_v1.json").read_text())


def test_every_v1_vector_decodes_and_reencodes_to_the_same_bytes():
    for name, hexbytes in GOLDEN.items():
        data = bytes.fromhex(hexbytes)
        env = decode_envelope(data)
        assert env.v == SCHEMA_MAJOR == 1, name
        assert encode_envelope(env) == data, name


def test_first_batch_carries_specs_hash_config_and_its_events():
    env = decode_envelope(bytes.fromhex(GOLDEN["v1_first_batch_with_specs"]))
    assert env.seq == 0 and env.node_id == "node-a"
    assert [(g.group_idx, g.kind, g.sliding_window) for g in env.group_specs] == [
        (0, "full_attention", None), (1, "sliding_window", 128)]
    assert env.hash_config.algorithm == "sha256" and env.hash_config.hash_block_size == 16
    (stored,) = envelope_events(env)
    assert stored.block_hashes == [1, 2] and stored.group_idx == 0


def test_heartbeat_has_no_batch_and_no_events():
    env = decode_envelope(bytes.fromhex(GOLDEN["v1_heartbeat"]))
    assert env.is_heartbeat and envelope_events(env) == []


def test_bridged_envelope_keeps_upstream_seq_and_loss():
    env = decode_envelope(bytes.fromhex(GOLDEN["v1_bridged_with_loss"]))
    assert (env.source, env.upstream_seq, env.lost_batches, env.dp_rank) == ("vllm-bridge", 41, 2, 1)


def test_an_additive_field_from_a_newer_writer_is_ignored_by_this_reader():
    # A future v1 writer appends an optional field; this reader must still decode the message.
    generic = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["v1_heartbeat"]))
    generic["some_future_field"] = {"x": [1, 2, 3]}
    env = decode_envelope(msgspec.msgpack.encode(generic))
    assert env.seq == 7


def test_an_older_writer_without_optional_fields_gets_defaults():
    minimal = msgspec.msgpack.encode({"v": 1, "node_id": "n", "epoch": 1, "seq": 0, "ts": 0.0})
    env = decode_envelope(minimal)
    assert (env.dropped, env.lost_batches, env.source, env.layout, env.is_heartbeat) == (0, 0, "kvpipe", "map", True)
    assert isinstance(env, Envelope)


def test_spec_mismatches_is_an_additive_v1_field_older_vectors_default_to_zero():
    env = decode_envelope(bytes.fromhex(GOLDEN["v1_added_spec_mismatches"]))
    assert (env.spec_mismatches, env.source, env.upstream_seq) == (2, "vllm-bridge", 77)
    assert decode_envelope(bytes.fromhex(GOLDEN["v1_bridged_with_loss"])).spec_mismatches == 0
    # and a reader that predates the field simply ignores the key
    generic = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["v1_added_spec_mismatches"]))
    assert generic["spec_mismatches"] == 2 and list(generic)[-1] == "spec_mismatches"
