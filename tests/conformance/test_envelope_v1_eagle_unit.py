"""Golden bytes for two additive v1 fields: `GroupSpec.eagle` and `HashConfig.prefix_match_unit`.
Kept beside (not inside) envelope_v1.json, whose vectors are never edited."""
import json
from pathlib import Path

import msgspec

from kvpipe.schemas.codec import decode_envelope, encode_envelope

GOLDEN = json.loads((Path(__file__).parent / "envelope_v1_eagle_unit.json").read_text())
OLD = json.loads((Path(__file__).parent / "envelope_v1.json").read_text())


def test_vectors_decode_and_reencode_to_the_same_bytes() -> None:
    for name, hexbytes in GOLDEN.items():
        data = bytes.fromhex(hexbytes)
        assert encode_envelope(decode_envelope(data)) == data, name


def test_eagle_flag_and_explicit_unit_decode() -> None:
    env = decode_envelope(bytes.fromhex(GOLDEN["v1_added_group_eagle_and_prefix_match_unit"]))
    assert [(g.kind, g.block_size, g.eagle) for g in env.group_specs] == [
        ("mla_attention", 64, False), ("mamba", 768, False), ("full_attention", 64, True)]
    assert (env.hash_config.hash_block_size, env.hash_config.prefix_match_unit) == (16, 16)
    hb = decode_envelope(bytes.fromhex(GOLDEN["v1_added_group_eagle_without_unit"]))
    assert hb.group_specs[0].eagle and hb.hash_config.prefix_match_unit is None


def test_old_vectors_default_the_new_fields_and_old_readers_ignore_them() -> None:
    env = decode_envelope(bytes.fromhex(OLD["v1_first_batch_with_specs"]))
    assert not any(g.eagle for g in env.group_specs) and env.hash_config.prefix_match_unit is None
    generic = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["v1_added_group_eagle_and_prefix_match_unit"]))
    # the new keys sit last in their maps (appended), and are omitted where they hold defaults
    assert list(generic["group_specs"][2])[-1] == "eagle" and "eagle" not in generic["group_specs"][0]
    assert list(generic["hash_config"])[-1] == "prefix_match_unit"
