"""Envelope sequencing rules (kvpipe.producer.sequencer), without Kafka."""
from __future__ import annotations

import msgspec
import pytest

from kvpipe.producer.sequencer import Sequencer
from kvpipe.schemas.envelope import GroupSpec, HashConfig

SPECS = [GroupSpec(0, "full_attention", 16), GroupSpec(1, "sliding_window", 16, sliding_window=128)]
HASH = HashConfig(algorithm="sha256", hash_block_size=16)
BATCH = msgspec.Raw(b"\x93\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00\x90\x00")  # [1.5, [], 0]


def seq(**kw) -> Sequencer:
    kw.setdefault("group_specs", SPECS)
    kw.setdefault("hash_config", HASH)
    return Sequencer("node-a", 1000, **kw)


def stamp(s: Sequencer, mono: float = 0.0, dropped_total: int = 0, **kw):
    kw.setdefault("batch", BATCH)
    kw.setdefault("num_events", 3)
    return s.stamp(ts=1.5, sent_ts=2.0, mono=mono, dropped_total=dropped_total, **kw)


def test_seq_is_contiguous_from_zero_and_heartbeats_take_a_seq() -> None:
    s = seq()
    envs = [stamp(s), stamp(s), s.heartbeat(now=3.0, mono=0.1, dropped_total=0), stamp(s)]
    assert [e.seq for e in envs] == [0, 1, 2, 3]
    assert {e.epoch for e in envs} == {1000}
    assert envs[2].is_heartbeat and envs[2].num_events == 0
    assert not envs[3].is_heartbeat


def test_specs_travel_on_seq0_then_only_when_due_or_changed() -> None:
    s = seq(specs_every_s=30.0)
    first, second = stamp(s, mono=0.0), stamp(s, mono=1.0)
    assert first.group_specs == SPECS and first.hash_config == HASH
    assert second.group_specs is None and second.hash_config is None
    assert stamp(s, mono=30.5).group_specs == SPECS  # periodic resend
    assert stamp(s, mono=31.0).group_specs is None
    new = [GroupSpec(0, "full_attention", 32)]
    s.set_group_specs(new)
    changed = stamp(s, mono=32.0)
    assert changed.group_specs == new and changed.hash_config == HASH


def test_no_specs_configured_means_none_on_the_wire() -> None:
    s = Sequencer("node-a", 1)
    assert stamp(s).group_specs is None and stamp(s).hash_config is None


def test_dropped_is_the_count_between_enqueue_snapshots() -> None:
    s = seq()
    # batch A queued with 0 drops before it; 7 events dropped; batch B queued; 2 more dropped.
    assert stamp(s, dropped_total=0).dropped == 0
    assert stamp(s, dropped_total=7).dropped == 7
    assert s.heartbeat(now=0.0, mono=0.0, dropped_total=9).dropped == 2
    assert stamp(s, dropped_total=9).dropped == 0


def test_a_dropped_batch_leaves_no_seq_gap() -> None:
    s = seq()
    a = stamp(s, dropped_total=0)
    b = stamp(s, dropped_total=5)  # the batch in between was dropped at the queue, never stamped
    assert (a.seq, b.seq, b.dropped) == (0, 1, 5)


def test_new_epoch_restarts_seq_resends_specs_and_forgets_old_drops() -> None:
    s = seq()
    stamp(s, dropped_total=0)
    stamp(s, mono=1.0, dropped_total=4)
    s.new_epoch(2000, dropped_total=10)  # 6 more dropped in the old epoch: irrelevant now
    env = stamp(s, mono=2.0, dropped_total=10)
    assert (env.epoch, env.seq, env.dropped) == (2000, 0, 0)
    assert env.group_specs == SPECS


def test_new_epoch_must_grow() -> None:
    s = seq()
    with pytest.raises(ValueError, match="must be greater"):
        s.new_epoch(1000, 0)


def test_unstamp_returns_the_seq_and_reports_the_lost_events_next() -> None:
    s = seq()
    first = stamp(s, dropped_total=2)  # carries specs and 2 drops, but Kafka refuses it
    s.unstamp(first)
    s.note_lost(first.num_events)
    retry = stamp(s, mono=1.0, dropped_total=2)
    assert retry.seq == 0
    assert retry.dropped == 2 + 3
    assert retry.group_specs == SPECS  # the specs it carried were never seen
    with pytest.raises(ValueError):
        s.unstamp(first.__class__(**{**msgspec.structs.asdict(first), "seq": 5}))


def test_envelope_metadata_and_raw_fields_pass_through() -> None:
    s = seq(model="m", dp_rank=2, source="vllm-bridge")
    env = stamp(s, layout="array", upstream_seq=41, lost_batches=1)
    assert (env.node_id, env.model, env.dp_rank, env.source) == ("node-a", "m", 2, "vllm-bridge")
    assert (env.layout, env.upstream_seq, env.lost_batches, env.num_events) == ("array", 41, 1, 3)
    assert stamp(s, dp_rank=5).dp_rank == 5
    assert bytes(env.batch) == bytes(BATCH)


def test_invalid_identity_is_refused() -> None:
    with pytest.raises(ValueError, match="node_id"):
        Sequencer("", 1)
    with pytest.raises(ValueError, match="epoch"):
        Sequencer("n", -1)


def test_a_heartbeat_encodes_without_a_batch_key() -> None:
    s = seq()
    for env in (s.heartbeat(now=1.0, mono=0.0, dropped_total=0), stamp(s, batch=msgspec.Raw(b""), num_events=0)):
        data = msgspec.msgpack.encode(env)
        assert b"batch" not in data
        assert msgspec.msgpack.decode(data, type=type(env)).is_heartbeat


def test_spec_mismatch_count_rides_on_every_later_envelope():
    from kvpipe.producer.sequencer import Sequencer

    seq = Sequencer("n", 1, model=None, dp_rank=0, source="vllm-bridge", specs_every_s=30.0,
                    group_specs=None, hash_config=None, dropped_base=0)
    assert seq.stamp(ts=1.0, sent_ts=1.0, mono=1.0, dropped_total=0).spec_mismatches == 0
    seq.spec_mismatches = 3
    assert [seq.stamp(ts=t, sent_ts=t, mono=t, dropped_total=0).spec_mismatches for t in (2.0, 3.0)] == [3, 3]
