"""A bridge whose SUB hears nothing warns (log + counter) once per silent spell."""
from __future__ import annotations

import logging
import time

import zmq

from kvpipe.producer.bridge.runner import Bridge, BridgeConfig
from kvpipe.producer.bridge.silence import SilenceWatch
from kvpipe.bench.testing_publisher import free_port_range


def test_watch_warns_once_per_spell_and_not_before_the_limit():
    w = SilenceWatch(5.0, now=100.0)
    assert w.check(104.9) is None
    assert w.check(105.0) == 5.0
    assert w.check(200.0) is None  # already warned for this spell
    assert w.frame(201.0) is True  # the spell ends
    assert w.check(205.0) is None
    assert w.check(206.5) == 5.5
    assert w.frame(207.0) is True and w.frame(207.1) is False


def test_a_zero_limit_never_warns():
    assert SilenceWatch(0, now=0.0).check(1e9) is None


def _wait(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_sub_pointed_where_nothing_publishes_warns_then_recovers(tmp_path, caplog):
    port = free_port_range(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    config = BridgeConfig(zmq_endpoint=endpoint, name="quiet", silence_warn_s=0.4)
    caplog.set_level(logging.INFO, logger="kvpipe.bridge")
    bridge = Bridge(config, record_dir=str(tmp_path)).start()  # record mode: no Kafka needed
    counters = bridge.workers[0].counters
    ctx = zmq.Context()
    pub = None
    try:
        assert _wait(lambda: counters.silence_warnings >= 1)
        time.sleep(0.6)
        assert counters.silence_warnings == 1  # one warning per silent spell, not one per poll
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("no frame from " + endpoint in m and "after connecting" in m for m in warnings), warnings
        assert "kvpipe_bridge_silence_warnings_total{node=\"quiet/dp0\"} 1.0" in bridge.metrics_text()

        pub = ctx.socket(zmq.PUB)
        pub.bind(endpoint)

        def published() -> bool:
            pub.send_multipart([b"kv-events", (1).to_bytes(8, "big"), b"\x93\x00\x90\x00"])
            return counters.recorded > 0

        assert _wait(published)
        assert any("frames arriving" in r.getMessage() for r in caplog.records)
    finally:
        bridge.stop()
        if pub is not None:
            pub.close(linger=0)
        ctx.term()
