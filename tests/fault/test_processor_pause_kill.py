"""The processor stopped (SIGSTOP) or killed (SIGKILL) under load, on the shared broker.

Both leave the index exactly equal to what the nodes published (kvpipe/bench/faultload.py); after the
kill it also equals a rebuild from offset 0. tests/integration/test_processor.py covers the kill of
an idle processor with a known snapshot; here the kill lands mid-stream, with periodic snapshots
every second. Long forms: `kvpipe bench faults --only pause,kill`.
"""
from __future__ import annotations

import json

import pytest

from kvpipe.bench.faults import processor_kill, processor_pause

pytestmark = pytest.mark.integration


def test_a_paused_processor_catches_up_and_its_index_is_exact(kafka_bootstrap: str, tmp_path) -> None:
    r = processor_pause(kafka_bootstrap, tmp_path, pause_s=4.0, before_s=1.5, after_s=1.5, nodes=3)
    print(json.dumps(r, sort_keys=True))
    assert r["processor_alive"]
    assert r["published_at_resume"] > 0
    assert (r["index_missing"], r["index_ghosts"], r["suspect_nodes"], r["gaps"]) == (0, 0, 0, 0)
    assert r["lost"] == 0


def test_a_processor_killed_mid_stream_restarts_equal_to_a_rebuild(kafka_bootstrap: str, tmp_path) -> None:
    r = processor_kill(kafka_bootstrap, tmp_path, before_s=2.0, after_s=1.5, nodes=3)
    print(json.dumps(r, sort_keys=True))
    assert (r["index_missing"], r["index_ghosts"], r["suspect_nodes"], r["gaps"]) == (0, 0, 0, 0)
    assert (r["rebuild_missing"], r["rebuild_ghosts"]) == (0, 0), "a rebuild from offset 0 holds the same"
    assert r["lost"] == 0
