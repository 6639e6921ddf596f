"""A 3-node KRaft cluster (`kvpipe infra up --brokers 3` layout, its own ports and state dir):
publishers, `kvpipe processor` and `kvpipe analytics` run while the leader of the busiest events
partition is SIGKILLed. Replication 3 with min.insync.replicas 2 and acks=all + idempotence in the
publisher: nothing acknowledged is lost, nothing is duplicated, both apps carry on. The index equals
what the nodes published and the analytics rows (FINAL view) count every event once.
Long form: `kvpipe bench faults --only leader`.
"""
from __future__ import annotations

import json

import pytest

from kvpipe.bench.faults import leader_kill

pytestmark = pytest.mark.integration


def test_killing_the_busiest_partitions_leader_loses_nothing(tmp_path) -> None:
    r = leader_kill(tmp_path, before_s=3.0, after_s=5.0, nodes=3)
    print(json.dumps(r, sort_keys=True))
    assert r["processor_alive"] and r["analytics_alive"]
    assert (r["undelivered"], r["publisher_failed"], r["publisher_dropped"]) == (0, 0, 0)
    assert (r["index_missing"], r["index_ghosts"], r["suspect_nodes"], r["gaps"]) == (0, 0, 0, 0)
    assert r["messages"] == r["steps_published"], "idempotence: no envelope written twice across the leader change"
    assert r["analytics_rows_wrong"] == 0, r["analytics_diff"]
    assert r["lost"] == 0
