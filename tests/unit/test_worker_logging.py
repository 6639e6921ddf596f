"""The Faust worker both apps run (kvpipe.processors.core.appcli.make_worker) keeps the root logger at the level
asked for. Faust's own default, at WARN and above, adds its terminal spinner's handler and sets the root logger to
DEBUG for good: every `log.debug` of aiokafka then built a record nobody wrote."""
from __future__ import annotations

import logging

import faust
import pytest

from kvpipe.processors.core.appcli import make_worker


@pytest.fixture
def root_restored():
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("level", ["warning", "error", "info"])
def test_the_root_logger_stays_at_the_level_asked(root_restored, level):
    app = faust.App("kvpipe-test-worker-logging", broker="kafka://127.0.0.1:1", web_enabled=False)
    worker = make_worker(app, level)
    worker._setup_logging()  # what the worker does first when it runs
    assert root_restored.getEffectiveLevel() == getattr(logging, level.upper())
    assert not [h for h in root_restored.handlers if type(h).__name__ == "SpinnerHandler"]
    assert not logging.getLogger("aiokafka.consumer.fetcher").isEnabledFor(logging.DEBUG)


def test_faust_alone_would_set_debug(root_restored):
    # the behaviour make_worker undoes: if a Faust release stops doing this, the comment in appcli can go
    from faust.worker import Worker

    app = faust.App("kvpipe-test-worker-logging-2", broker="kafka://127.0.0.1:1", web_enabled=False)
    Worker(app, loglevel="warning", quiet=True)._setup_logging()
    assert root_restored.getEffectiveLevel() == logging.DEBUG
