"""How the drain loops end (`fastpath.drain_stopped`, shared by the fast and the batched consumer):
quietly when the app is stopping and the consumer was stopped or cancelled, otherwise the exception
goes on, logged when it is an error."""
from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest

from kvpipe.processors.core.fastpath import drain_stopped


class Stopped(Exception):
    pass


def consumer(stopping: bool, log: logging.Logger) -> SimpleNamespace:
    return SimpleNamespace(consumer_stopped_errors=(Stopped,), log=log,
                           transport=SimpleNamespace(app=SimpleNamespace(should_stop=stopping)))


@pytest.mark.parametrize("exc, stopping, quiet", [
    (Stopped(), True, True), (Stopped(), False, False),
    (asyncio.CancelledError(), True, True), (asyncio.CancelledError(), False, False),
    (RuntimeError("boom"), True, False), (RuntimeError("boom"), False, False),
])
def test_drain_loops_end_as_faust_does(exc, stopping, quiet, caplog):
    log = logging.getLogger("drain-test")
    with caplog.at_level(logging.INFO, logger="drain-test"):
        assert drain_stopped(consumer(stopping, log), exc) is quiet
    logged_error = any(r.levelno >= logging.ERROR for r in caplog.records)
    assert logged_error == isinstance(exc, RuntimeError)  # only a real error is logged as one
    assert any("shutting down" in r.getMessage() for r in caplog.records) == quiet
