"""The split into two apps, checked without a broker: the routing app's modules load no ClickHouse
code; analyst SQL requests are parsed and refused on the analytics side; the analytics app's
metrics are labelled Prometheus families."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvpipe.processors.analytics.metrics import render
from kvpipe.processors.analytics.query import QueryError, parse_sql_request
from kvpipe.bench.procrun import REPO

ROUTING_MODULES = ["kvpipe.processors.routing.app", "kvpipe.processors.routing.topics", "kvpipe.processors.routing.state", "kvpipe.processors.routing.agents",
                   "kvpipe.processors.routing.views", "kvpipe.processors.routing.cli", "kvpipe.processors.routing.api"]


def test_the_routing_app_imports_no_clickhouse_code():
    # A fresh interpreter: this test process itself may have loaded clickhouse_connect already.
    code = ("import importlib, json, sys\n"
            f"for m in {ROUTING_MODULES!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('clickhouse_connect', 'chdb', 'chdb_core', 'kvpipe'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert "kvpipe.processors.routing.agents" in loaded and "kvpipe.processors.routing.views" in loaded, "the routing app was really imported"
    assert [m for m in loaded if not m.startswith("kvpipe")] == [], "ClickHouse client code in the routing app"
    assert not {"kvpipe.processors.analytics.sink", "kvpipe.processors.analytics.app", "kvpipe.processors.analytics.query"} & set(loaded)


def test_the_analytics_app_does_not_import_the_routing_app():
    code = ("import sys\nfrom kvpipe.processors.analytics import agents, views\n"
            "print('kvpipe.processors.routing.app' in sys.modules, 'kvpipe.processors.routing.agents' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("body", [b'{"sql": "SELECT 1"}', b'{"sql": "SELECT {n:UInt8}", "params": {"n": 1}}'])
def test_sql_requests_parse(body):
    request = parse_sql_request(body)
    assert request.sql.startswith("SELECT")


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"sql": 5}', b'{"params": {}}',
                                  b'{"sql": "SELECT 1", "params": [60]}', b'{"sql": "SELECT 1", "params": {"f": true}}',
                                  b'{"sql": "SELECT 1", "params": {"x": null}}', b'{"sql": "SELECT 1", "params": {"x": [1]}}'])
def test_bad_sql_requests_are_400_with_a_reason(body):
    with pytest.raises(QueryError) as exc:
        parse_sql_request(body)
    assert exc.value.status == 400 and exc.value.body()["detail"]


def _stats(up: bool) -> dict:
    sink = {"kv_events_written": 7, "kv_events_submitted": 9, "kv_block_lifetimes_written": 2,
            "kv_block_lifetimes_submitted": 2, "retries": 3, "room_wait_s": 1.5}
    return {"sink": sink,
            "store": {"up": up, "reason": "" if up else "kv_events: ConnectionError: refused", "pending_rows": 2,
                      "max_queue_rows": 100},
            "freshness": {"0": {"offset": 9, "lag_messages": 4}, "1": {"offset": 3, "lag_messages": None}},
            "durability": {"snapshots": 2}, "counters": {"snapshot_skips": 1}, "dlq_by_reason": {"not_msgpack": 1}}


def test_analytics_metrics_are_labelled_families():
    text = render(lambda: _stats(up=False)).decode()
    assert 'kvpipe_analytics_rows_written_total{table="kv_events"} 7.0' in text
    assert 'kvpipe_analytics_store_up{reason="kv_events: ConnectionError: refused"} 0.0' in text
    assert "kvpipe_analytics_queue_rows 2.0" in text
    assert 'kvpipe_analytics_partition_lag_messages{partition="0"} 4.0' in text
    assert 'partition_lag_messages{partition="1"}' not in text  # unknown lag is absent, not 0
    assert "kvpipe_analytics_write_retries_total 3.0" in text
    assert 'kvpipe_analytics_store_up{reason=""} 1.0' in render(lambda: _stats(up=True)).decode()
