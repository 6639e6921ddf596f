"""A snapshot the cluster never acknowledges fails after `timeout_s`, counted, and frees the lock
(the real full disk: tests/fault/test_snapshot_disk_full.py)."""
from __future__ import annotations

import asyncio

import pytest

from kvpipe.processors.core.durability import Durability
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest


class StuckTopic:
    """A topic whose sends are never acknowledged (a partition without a leader)."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, **kwargs):
        self.sent += 1
        return asyncio.get_running_loop().create_future()  # never resolved


class AckTopic:
    async def send(self, **kwargs):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut


async def no_flush() -> None:
    return None


def test_an_unacknowledged_snapshot_fails_counted_and_the_next_one_runs() -> None:
    async def scenario() -> dict:
        ingest = Ingest(Index(ttl_s=60.0), 1 << 20)
        ingest.applied_offset[0] = 41
        d = Durability(ingest, "unused:0", "ev", "snap", "p", timeout_s=0.05)
        with pytest.raises(asyncio.TimeoutError):
            await d.snapshot(StuckTopic(), [0], no_flush)
        with pytest.raises(asyncio.TimeoutError):
            await d.snapshot(StuckTopic(), [0], no_flush)
        assert d.stats["snapshots"] == 0 and d.stats["snapshot_ok_ts"] == 0.0
        await asyncio.wait_for(d.snapshot(AckTopic(), [0], no_flush), 1.0)  # the lock was released
        return d.stats

    stats = asyncio.run(scenario())
    assert stats["snapshot_errors"] == 2
    assert stats["snapshot_last_error"]["error"] == "not acknowledged within 0.05 s"
    assert stats["snapshot_last_error"]["partitions"] == [0]
    assert stats["snapshots"] == 1 and stats["snapshot_ok_ts"] > 0
