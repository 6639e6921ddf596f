"""When a stalled producer asks for metadata again (kvpipe.producer.stall), without Kafka."""
from __future__ import annotations

import pytest

from kvpipe.producer.stall import MAX_WAIT_S, DeliveryWatch


def test_nothing_in_flight_is_never_a_stall() -> None:
    w = DeliveryWatch(5.0)
    assert not any(w.stalled(t, sent=10, in_flight=0) for t in range(0, 100, 5))
    assert w.nudges == 0


def test_envelopes_waiting_with_none_leaving_is_a_stall_after_stall_s() -> None:
    w = DeliveryWatch(5.0)
    assert not w.stalled(0.0, sent=10, in_flight=3)
    assert not w.stalled(4.9, sent=10, in_flight=3)
    assert w.stalled(5.0, sent=10, in_flight=3)
    assert w.nudges == 1 and w.waited == 5.0


def test_more_sent_while_none_leaves_is_still_a_stall() -> None:
    # a busy node keeps handing envelopes over: in_flight grows with sent, nothing has left
    w = DeliveryWatch(5.0)
    assert not w.stalled(0.0, sent=10, in_flight=3)
    assert not w.stalled(2.0, sent=20, in_flight=13)
    assert w.stalled(5.0, sent=30, in_flight=23)


def test_any_delivery_restarts_the_clock() -> None:
    w = DeliveryWatch(5.0)
    w.stalled(0.0, sent=10, in_flight=3)
    assert not w.stalled(4.0, sent=10, in_flight=2)  # one left the client
    assert not w.stalled(8.0, sent=10, in_flight=2)
    assert w.stalled(9.0, sent=10, in_flight=2)


def test_a_long_stall_backs_off_to_once_a_minute_and_progress_resets_it() -> None:
    w = DeliveryWatch(5.0)
    w.stalled(0.0, sent=1, in_flight=1)
    nudged_at = [t / 10 for t in range(0, 4000) if w.stalled(t / 10, sent=1, in_flight=1)]
    gaps = [round(b - a, 1) for a, b in zip(nudged_at, nudged_at[1:])]
    assert nudged_at[0] == 5.0
    assert gaps[:4] == [10.0, 20.0, 40.0, MAX_WAIT_S] and set(gaps[4:]) == {MAX_WAIT_S}
    assert w.waited == nudged_at[-1]  # the whole stall, not the time since the last request
    # a delivery: back to the first interval
    assert not w.stalled(400.0, sent=1, in_flight=0)
    assert not w.stalled(401.0, sent=2, in_flight=1)
    assert w.stalled(406.0, sent=2, in_flight=1)


def test_stall_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        DeliveryWatch(0.0)
