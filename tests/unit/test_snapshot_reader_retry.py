"""A restore that lands on a broker outage waits for the broker instead of crashing the worker
(`durability.snapshot_reader`; found in `tests/fault/test_broker_outage.py` when a rebalance met the outage's
start: the app crashed with KafkaConnectionError from the restore)."""
from __future__ import annotations

import asyncio

import aiokafka
import pytest
from aiokafka.errors import KafkaConnectionError

from kvpipe.processors.core import durability


class FlakyConsumer:
    """Stands in for aiokafka's consumer: `start` fails `fails` times over all instances, then works."""
    made: list["FlakyConsumer"] = []
    fails = 0
    error: type[BaseException] = KafkaConnectionError

    def __init__(self, **kwargs) -> None:
        self.started = self.stopped = False
        FlakyConsumer.made.append(self)

    async def start(self) -> None:
        if FlakyConsumer.fails > 0:
            FlakyConsumer.fails -= 1
            raise FlakyConsumer.error("Unable to bootstrap")
        self.started = True

    async def stop(self) -> None:
        self.stopped = True


@pytest.fixture
def flaky(monkeypatch):
    FlakyConsumer.made, FlakyConsumer.error = [], KafkaConnectionError
    monkeypatch.setattr(aiokafka, "AIOKafkaConsumer", FlakyConsumer)
    return FlakyConsumer


def test_an_unreachable_broker_is_waited_for_and_failed_clients_are_stopped(flaky):
    flaky.fails = 3
    consumer = asyncio.run(durability.snapshot_reader("127.0.0.1:1", wait_s=30))
    assert consumer.started and not consumer.stopped
    assert len(flaky.made) == 4 and all(c.stopped for c in flaky.made[:3])


def test_the_wait_is_bounded_and_other_errors_are_not_retried(flaky):
    flaky.fails = 10**6
    with pytest.raises(KafkaConnectionError):
        asyncio.run(durability.snapshot_reader("127.0.0.1:1", wait_s=0.5))
    flaky.made, flaky.fails, flaky.error = [], 1, ValueError
    with pytest.raises(ValueError):
        asyncio.run(durability.snapshot_reader("127.0.0.1:1", wait_s=30))
    assert len(flaky.made) == 1
