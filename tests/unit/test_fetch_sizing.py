"""`/stats` shows the fetch sizing the running client uses (kvpipe.processors.core.fastpath.fetch_in_effect): read
from the live fetcher, nothing before it starts or from a client built differently. The settings reaching a real
worker's fetcher: tests/integration/test_processor_batches.py."""
from __future__ import annotations

from types import SimpleNamespace

from kvpipe.processors.core.fastpath import fetch_in_effect


def _consumer(fetcher):
    return SimpleNamespace(_thread=SimpleNamespace(_consumer=SimpleNamespace(_fetcher=fetcher)))


def test_the_live_fetchers_sizing():
    fetcher = SimpleNamespace(_fetch_min_bytes=16384, _fetch_max_wait_ms=2)
    assert fetch_in_effect(_consumer(fetcher)) == {"fetch_min_bytes": 16384, "fetch_max_wait_ms": 2}


def test_nothing_before_the_client_starts_or_from_another_client():
    assert fetch_in_effect(_consumer(None)) == {}
    assert fetch_in_effect(SimpleNamespace()) == {}
    assert fetch_in_effect(_consumer(SimpleNamespace(min_bytes=1))) == {}
