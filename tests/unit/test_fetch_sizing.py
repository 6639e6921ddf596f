"""Fetch sizing that follows the load (kvpipe.processors.core.fastpath): full-sized fetches while fetches come back with
records, Faust's own (answer on the first byte) once one comes back empty, so a quiet app does not poll; and what
`/stats` shows of it. The settings reaching a real worker's fetcher: tests/integration/test_processor_batches.py."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from kvpipe.processors.core.fastpath import QUIET_SIZING, fetch_in_effect, follow_load, next_sizing

BUSY = (16384, 2)


def test_full_sized_while_records_come_back_first_byte_once_one_is_empty():
    assert next_sizing(True, BUSY) == BUSY
    assert next_sizing(False, BUSY) == QUIET_SIZING == (1, 1500)


class _Fetcher:
    """aiokafka's Fetcher as `follow_load` uses it: two attributes read per request, one coroutine per fetch."""

    def __init__(self, answers: list[bool]) -> None:
        self.answers, self.sizes = answers, []
        self._fetch_min_bytes, self._fetch_max_wait_ms = 1, 500
        self._records: dict = {}  # partition → fetched records not consumed yet

    def _get_actions_per_node(self, assignment):  # builds the requests, reading the two attributes
        return (self._fetch_min_bytes, self._fetch_max_wait_ms)

    async def _proc_fetch_request(self, assignment, node_id, request) -> bool:
        self.sizes.append(request)
        return self.answers.pop(0)

    async def one(self) -> None:
        await self._proc_fetch_request(None, 0, self._get_actions_per_node(None))


def test_each_fetch_is_sized_by_the_one_before():
    fetcher = _Fetcher([True, True, False, False, True])
    counts = follow_load(fetcher, BUSY)

    async def five() -> None:
        for _ in range(5):
            await fetcher.one()

    asyncio.run(five())
    # starts quiet; full-sized after records; back to the first byte after an empty answer
    assert fetcher.sizes == [QUIET_SIZING, BUSY, BUSY, QUIET_SIZING, QUIET_SIZING]
    assert (fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms) == BUSY
    assert counts == {"fetches_with_records": 3, "fetches_empty": 2}


def test_a_fetch_built_while_records_wait_to_be_consumed_is_never_held_long():
    # the app is behind: partition 1's records wait; a fetch for the others (at their end, so empty) would be held
    # for the quiet wait and keep partition 1 from its next fetch meanwhile
    fetcher = _Fetcher([False, False, False])
    follow_load(fetcher, BUSY)
    fetcher._records = {1: object()}

    async def three() -> None:
        await fetcher.one()
        await fetcher.one()
        fetcher._records = {}  # consumed: the app caught up, and quiet partitions may wait for the first byte again
        await fetcher.one()

    asyncio.run(three())
    assert fetcher.sizes == [BUSY, BUSY, QUIET_SIZING]


def _consumer(fetcher, counts=None):
    return SimpleNamespace(_thread=SimpleNamespace(_consumer=SimpleNamespace(_fetcher=fetcher), fetch_counts=counts))


def test_stats_show_the_next_fetchs_sizing_and_the_counts():
    fetcher = SimpleNamespace(_fetch_min_bytes=16384, _fetch_max_wait_ms=2)
    assert fetch_in_effect(_consumer(fetcher, {"fetches_with_records": 4, "fetches_empty": 1})) == {
        "fetch_min_bytes": 16384, "fetch_max_wait_ms": 2, "fetches_with_records": 4, "fetches_empty": 1}


def test_nothing_before_the_client_starts_or_from_another_client():
    assert fetch_in_effect(_consumer(None)) == {}
    assert fetch_in_effect(SimpleNamespace()) == {}
    assert fetch_in_effect(_consumer(SimpleNamespace(min_bytes=1))) == {}
