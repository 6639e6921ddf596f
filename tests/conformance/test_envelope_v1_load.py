"""Golden bytes for the additive v1 load fields (`running`, `waiting`, `kv_usage`: the router's score
reads them). Like envelope_v1.json these vectors are never edited; the older vectors stay valid
and decode with the fields absent (None)."""
import json
from pathlib import Path

import msgspec

from kvpipe.schemas.codec import decode_envelope, encode_envelope
from kvpipe.schemas.envelope import Envelope

HERE = Path(__file__).parent
GOLDEN = json.loads((HERE / "envelope_v1_load.json").read_text())
OLDER = json.loads((HERE / "envelope_v1.json").read_text())


def test_load_vector_decodes_and_reencodes_to_the_same_bytes():
    data = bytes.fromhex(GOLDEN["v1_added_load"])
    env = decode_envelope(data)
    assert (env.running, env.waiting, env.kv_usage, env.seq, env.model) == (3, 5, 0.625, 9, "m")
    assert encode_envelope(env) == data
    assert list(msgspec.msgpack.decode(data))[-3:] == ["running", "waiting", "kv_usage"]


def test_older_vectors_have_no_load_and_reencode_unchanged():
    for name, hexbytes in OLDER.items():
        env = decode_envelope(bytes.fromhex(hexbytes))
        assert (env.running, env.waiting, env.kv_usage) == (None, None, None), name
        assert encode_envelope(env) == bytes.fromhex(hexbytes), name


def test_a_reader_that_predates_the_load_fields_ignores_them():
    class OldEnvelope(msgspec.Struct):  # the fields an older v1 reader knows, enough to tell
        v: int
        node_id: str
        seq: int

    old = msgspec.msgpack.decode(bytes.fromhex(GOLDEN["v1_added_load"]), type=OldEnvelope)
    assert (old.v, old.node_id, old.seq) == (1, "node-a", 9)
    assert isinstance(decode_envelope(bytes.fromhex(GOLDEN["v1_added_load"])), Envelope)
