"""The index on the native block store (native/src/store.rs) equals the index on the dict reference
(`kvpipe.processors.core.slots.PyStore`) on random envelope streams: stores and removes of int and bytes
hashes (with repeated copies, 64-bit collisions between the two forms, unknown removes), clears,
several groups and media, new epochs, gaps, duplicates, stale epochs, real loss (resync), silence
past the TTL, per-slot and per-node caps, dropped partitions, and snapshot round trips. Equal means:
every outcome, every lifetime in order, every node's state and counters, every slot's entries and
copies, and the router's held positions for random requests.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.processors.core import slots
from kvpipe.processors.core.index import Index
from kvpipe.processors.router.hma import held_positions
from kvpipe.processors.core.snapshot import decode_chunk, export_partition, import_chunks
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import BlockStored
from tests.nativecheck import require_native_core
from tests.property.streams import events as event_strategy

require_native_core()

# ints, bytes, and bytes whose last 8 bytes equal an int of the pool (one 64-bit key, two forms)
HASHES = st.one_of(st.integers(0, 12), st.integers(2**64 - 3, 2**64 + 2), st.integers(-2, -1),
                   st.sampled_from([b"\x00" * 24 + (3).to_bytes(8, "big"), b"abc", b"\xff" * 32]))


# "": GPU, as vLLM reads a missing medium
EVENT = event_strategy(HASHES, [None, "GPU", "GPU", "CPU", ""], 9)


@st.composite
def envelope(draw, t: float):
    node = draw(st.sampled_from(["a", "b", "c"]))
    epoch = draw(st.sampled_from([1, 1, 1, 1, 2, 0]))
    seq = draw(st.integers(0, 6))
    lost = draw(st.sampled_from([0] * 12 + [1]))
    ts = t + draw(st.sampled_from([0.0, 0.5, 1.0, 40.0]))  # 40 s: past the TTL below
    env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=ts, sent_ts=ts, lost_batches=lost)
    return env, draw(st.lists(EVENT, max_size=5)), draw(st.sampled_from([0, 0, 1]))


@st.composite
def stream(draw):
    out, t = [], 100.0
    for _ in range(draw(st.integers(1, 30))):
        env, events, partition = draw(envelope(t))
        t = env.ts
        out.append((env, events, partition))
    return out


def state(index: Index) -> dict:
    out = {}
    for node_id, n in sorted(index.nodes.items()):
        out[node_id] = (n.epoch, n.seq, n.last_seen, n.suspect, n.reason, n.expired, n.partition, n.partial_since,
                        dict(n.counters), {key: (sorted(s.blocks.items()), sorted(dict(s.dups).items()))
                                           for key, s in sorted(n.slots.items())})
    return {"nodes": out, "counters": dict(index.counters)}


def held(index: Index, request: dict) -> dict:
    return {n.node_id: {k: sorted(v) for k, v in h.items()} for n, h in held_positions(index, request).items()}


def pair(**kw) -> tuple[Index, Index]:
    return Index(store="python", **kw), Index(store="native", **kw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream(), st.sampled_from([None, 3]), st.sampled_from([None, 4]), st.lists(HASHES, max_size=8),
       st.sampled_from([None, 0, 1]))
def test_native_store_equals_the_reference(envelopes, cap, slot_cap, request_hashes, dropped):
    ref, nat = pair(ttl_s=30.0, max_blocks_per_slot=cap, max_slots_per_node=slot_cap)
    for offset, (env, events, partition) in enumerate(envelopes):
        a = ref.apply(env.__copy__(), list(events), partition, offset)
        b = nat.apply(env.__copy__(), list(events), partition, offset)
        assert a == b
    assert ref.expire(envelopes[-1][0].ts + 100.0, 30.0, partition=1) == nat.expire(envelopes[-1][0].ts + 100.0, 30.0,
                                                                                     partition=1)
    assert state(ref) == state(nat)
    request = {0: request_hashes, 1: list(reversed(request_hashes)), 2: [None, *request_hashes]}
    assert held(ref, request) == held(nat, request)
    assert nat.store.entries() == ref.store.entries()
    if dropped is not None:
        assert ref.drop_partition(dropped) == nat.drop_partition(dropped)
        assert state(ref) == state(nat) and held(ref, request) == held(nat, request)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream())
def test_a_snapshot_moves_between_stores_unchanged(envelopes):
    """A snapshot written from either store restores into either store as the same index."""
    ref, nat = pair()
    for offset, (env, events, _) in enumerate(envelopes):
        ref.apply(env.__copy__(), list(events), 0, offset)
        nat.apply(env.__copy__(), list(events), 0, offset)
    for source in (ref, nat):
        chunks = [decode_chunk(c) for c in export_partition(source, 0, 1, chunk_bytes=512)[0]]
        for kind in slots.STORES:
            restored = Index(store=kind)
            import_chunks(restored, 0, chunks)
            want, got = state(source), state(restored)
            for node_id in want["nodes"]:  # counters of the index as a whole are not snapshotted
                assert got["nodes"][node_id][9] == want["nodes"][node_id][9]
                assert got["nodes"][node_id][:5] == want["nodes"][node_id][:5]


def test_memory_is_reported_and_entries_counted():
    index = Index(store="native")
    env = Envelope(v=SCHEMA_MAJOR, node_id="n", epoch=1, seq=0, ts=1.0, sent_ts=1.0)
    index.apply(env, [BlockStored(block_hashes=list(range(10_000)), parent_block_hash=None, token_ids=[],
                                  block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0)])
    assert index.store.entries() == 10_000
    per_entry = index.store.memory_bytes() / 10_000
    assert 12 <= per_entry <= 200  # tables at their allocated size: sane bounds, the bench reports the figure
