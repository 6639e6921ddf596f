"""Each worker takes its startup heap out of the collector's full walks once it runs: the task is
registered with the app (Faust starts it with the worker) and freezes what exists."""
from __future__ import annotations

import asyncio
import gc

import pytest


def _task_named(app, name: str):
    tasks = [t for t in app._app_tasks if getattr(t, "__wrapped__", None) is not None and t.__wrapped__.__name__ == name]
    assert len(tasks) == 1, [getattr(t, "__name__", t) for t in app._app_tasks]
    return tasks[0]


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_the_routing_worker_freezes_its_startup_heap(restore_gc) -> None:
    from kvpipe.processors.routing import agents
    from kvpipe.processors.routing.app import app

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    asyncio.run(_task_named(app, agents.freeze_startup_heap.__name__)())
    assert gc.get_freeze_count() > 10_000  # modules, Faust, the app


def test_the_analytics_worker_freezes_and_sets_its_thresholds(restore_gc) -> None:
    from kvpipe.processors.analytics import agents, derive
    from kvpipe.processors.analytics.app import app

    gc.unfreeze()
    asyncio.run(_task_named(app, agents.tune_gc.__name__)())
    assert gc.get_freeze_count() > 10_000
    assert gc.get_threshold() == derive.GC_THRESHOLDS
