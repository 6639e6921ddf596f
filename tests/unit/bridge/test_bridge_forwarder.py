"""Sequencing rules of the bridge, one scenario per test, without sockets or Kafka."""
from __future__ import annotations

import pytest

from kvpipe.producer.bridge.forwarder import Forwarder
from kvpipe.producer.bridge.specs import SpecTracker
from kvpipe.schemas.envelope import GroupSpec

from tests.unit.bridge.fakes import ListDeadLetters, RecordingPublisher, RingReplay, frames, payload


def make(replay: RingReplay | None = None, specs: SpecTracker | None = None):
    pub, dlq = RecordingPublisher(), ListDeadLetters()
    return Forwarder("node/dp0", pub, dlq, replay=replay, specs=specs), pub, dlq


def feed(fwd: Forwarder, ring: RingReplay | None, seq: int, live: bool = True) -> bytes:
    data = payload(seq)
    if ring is not None:
        ring.add(seq, data)
    if live:
        fwd.on_frames(frames(seq, data))
    return data


def test_in_order_batches_forward_byte_identical_with_vllm_seq():
    fwd, pub, _ = make()
    sent = [feed(fwd, None, s) for s in range(5)]
    assert pub.seqs() == [0, 1, 2, 3, 4]
    assert [s.payload for s in pub.sent] == sent
    assert all(s.lost_batches == 0 and s.num_events == 1 for s in pub.sent)
    assert fwd.counters.batches == 5 and fwd.counters.gaps == 0


def test_dropped_live_batches_are_fetched_from_the_ring_in_order_before_the_live_one():
    ring = RingReplay()
    fwd, pub, _ = make(ring)
    for s in range(10):
        feed(fwd, ring, s, live=s not in (3, 4, 7))
    assert pub.seqs() == list(range(10))
    assert all(s.lost_batches == 0 for s in pub.sent)
    assert ring.requests == [(3, 5), (7, 8)]
    assert fwd.counters.replayed == 3 and fwd.counters.lost == 0 and fwd.counters.gaps == 2


def test_gap_older_than_the_ring_is_reported_as_lost_on_the_next_envelope():
    ring = RingReplay(size=3)
    fwd, pub, _ = make(ring)
    feed(fwd, ring, 0)
    for s in range(1, 9):
        feed(fwd, ring, s, live=False)  # ring keeps 6, 7, 8
    feed(fwd, ring, 9)  # ring now 7, 8, 9
    assert pub.seqs() == [0, 7, 8, 9]
    assert [s.lost_batches for s in pub.sent] == [0, 6, 0, 0]
    assert fwd.counters.lost == 6


def test_without_a_replay_endpoint_a_gap_is_all_lost():
    fwd, pub, _ = make(None)
    feed(fwd, None, 0)
    feed(fwd, None, 4)
    assert [(s.upstream_seq, s.lost_batches) for s in pub.sent] == [(0, 0), (4, 3)]


def test_a_bridge_joining_late_fetches_the_nodes_history_from_seq_0():
    ring = RingReplay()
    fwd, pub, _ = make(ring)
    for s in range(5):
        feed(fwd, ring, s, live=False)
    feed(fwd, ring, 5)
    assert ring.requests == [(0, 5)]
    assert pub.seqs() == [0, 1, 2, 3, 4, 5] and fwd.counters.lost == 0


def test_replay_timeout_counts_the_undelivered_rest_as_lost_and_moves_on():
    ring = RingReplay()
    ring.timeout_after = 2
    fwd, pub, _ = make(ring)
    feed(fwd, ring, 0)
    for s in range(1, 6):
        feed(fwd, ring, s, live=False)
    feed(fwd, ring, 6)
    assert pub.seqs() == [0, 1, 2, 6]
    assert [s.lost_batches for s in pub.sent] == [0, 0, 0, 3]
    assert fwd.counters.replay_timeouts == 1
    feed(fwd, ring, 7)  # and the stream goes on normally
    assert pub.sent[-1].upstream_seq == 7 and pub.sent[-1].lost_batches == 0


def test_seq_going_back_is_a_vllm_restart_and_starts_a_new_epoch():
    ring = RingReplay()
    fwd, pub, _ = make(ring)
    for s in range(4):
        feed(fwd, ring, s)
    ring.ring.clear()
    feed(fwd, ring, 0)
    feed(fwd, ring, 1)
    assert [(s.epoch, s.upstream_seq) for s in pub.sent] == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (2, 1)]
    assert fwd.counters.restarts == 1


def test_restart_seen_late_fetches_the_new_incarnations_start_and_forgets_old_losses():
    ring = RingReplay()
    fwd, pub, _ = make(ring)
    feed(fwd, ring, 0)
    fwd.on_frames(frames(5, payload(5)))  # seqs 1..4 missing and not in the ring
    assert pub.sent[-1].lost_batches == 4
    ring.ring.clear()
    feed(fwd, ring, 0, live=False)
    feed(fwd, ring, 1, live=False)
    feed(fwd, ring, 2)
    assert [(s.epoch, s.upstream_seq, s.lost_batches) for s in pub.sent[2:]] == [(2, 0, 0), (2, 1, 0), (2, 2, 0)]


def test_malformed_messages_go_to_the_dlq_and_good_ones_keep_flowing():
    fwd, pub, dlq = make()
    feed(fwd, None, 0)
    fwd.on_frames([b"kv", (1).to_bytes(8, "big")])  # 2 frames
    fwd.on_frames([b"kv", b"\x01\x02", payload(1)])  # seq frame too short
    fwd.on_frames([b"garbage"] * 4)
    feed(fwd, None, 1)
    assert pub.seqs() == [0, 1] and all(s.lost_batches == 0 for s in pub.sent)
    reasons = [r for _, _, r in dlq.letters]
    assert len(reasons) == 3 and all(r.startswith("malformed_frames") for r in reasons)
    assert dlq.letters[0][1] == [b"kv", (1).to_bytes(8, "big")]  # raw frames, unchanged
    assert fwd.counters.malformed == 3 and fwd.counters.dlq == 3


def test_an_undecodable_payload_in_sequence_is_dead_lettered_and_counted_lost():
    fwd, pub, dlq = make()
    feed(fwd, None, 0)
    fwd.on_frames(frames(1, b"\xc1 not msgpack"))
    fwd.on_frames(frames(2, b"\x93\x01"))  # truncated msgpack
    feed(fwd, None, 3)
    assert pub.seqs() == [0, 3] and pub.sent[-1].lost_batches == 2
    assert [r.split(":")[0] for _, _, r in dlq.letters] == ["undecodable_payload"] * 2
    assert "not_msgpack" in dlq.letters[0][2]


def test_garbage_with_an_old_seq_does_not_end_the_epoch():
    fwd, pub, dlq = make()
    for s in range(3):
        feed(fwd, None, s)
    fwd.on_frames(frames(0, b"junk"))
    feed(fwd, None, 3)
    assert fwd.counters.restarts == 0 and pub.sent[-1].upstream_seq == 3 and pub.sent[-1].lost_batches == 0
    assert len(dlq.letters) == 1


def test_both_layouts_are_forwarded_and_labelled():
    fwd, pub, _ = make()
    legacy = payload(0, layout="array")
    fwd.on_frames(frames(0, legacy))
    fwd.on_frames(frames(1, payload(1)))
    assert [(s.layout, s.payload) for s in pub.sent][0] == ("array", legacy)
    assert pub.sent[1].layout == "map"


def test_a_refused_publish_keeps_the_loss_for_the_next_batch():
    fwd, pub, _ = make()
    feed(fwd, None, 0)
    pub.accept = False
    fwd.on_frames(frames(3, payload(3)))  # 1, 2 lost; 3 refused by a full publisher queue
    pub.accept = True
    feed(fwd, None, 4)
    assert [(s.upstream_seq, s.lost_batches) for s in pub.sent] == [(0, 0), (4, 2)]
    assert fwd.counters.publish_rejected == 1


def test_spec_mismatch_is_counted_once_and_the_events_win():
    specs = SpecTracker([GroupSpec(group_idx=0, kind="sliding_window", block_size=4, sliding_window=128)], node_id="n")
    fwd, pub, _ = make(specs=specs)
    for s in range(3):
        feed(fwd, None, s)
    assert fwd.counters.spec_mismatches == 2  # kind and window
    assert pub.spec_mismatches == 2  # and every envelope from now on says so
    assert len(pub.specs) == 1
    (group,) = pub.specs[0][0]
    assert (group.kind, group.block_size, group.sliding_window) == ("full_attention", 4, None)


@pytest.mark.parametrize("seq", [0, 2**63, 2**64 - 2])
def test_any_unsigned_64_bit_seq_is_accepted(seq):
    fwd, pub, _ = make(None)
    fwd.expected = seq
    fwd.on_frames(frames(seq, payload(1)))
    assert pub.seqs() == [seq]


def test_a_restart_hidden_behind_a_reconnect_is_found_by_comparing_the_last_batch():
    ring = RingReplay()
    fwd, pub, _ = make(ring)
    for s in range(5):
        feed(fwd, ring, s)
    fwd.peer_disconnected()
    ring.ring = [(s, payload(s + 100)) for s in range(8)]  # a new process published 0..7 meanwhile
    fwd.on_frames(frames(8, payload(108)))
    assert fwd.counters.restarts == 1
    assert [(s.epoch, s.upstream_seq) for s in pub.sent[5:]] == [(2, s) for s in range(9)]


def test_a_reconnect_to_the_same_process_is_just_a_gap():
    ring = RingReplay()
    fwd, pub, _ = make(ring)
    for s in range(5):
        feed(fwd, ring, s)
    fwd.peer_disconnected()
    for s in range(5, 8):
        feed(fwd, ring, s, live=False)
    feed(fwd, ring, 8)
    assert fwd.counters.restarts == 0 and pub.seqs() == list(range(9)) and {s.epoch for s in pub.sent} == {1}
