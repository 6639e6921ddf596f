"""A full disk under the processor's snapshots: ingest goes on, the failures are counted in
/stats, snapshots resume once there is space again, nothing is lost.

Where snapshots go: the compacted snapshot topic (processors/core/durability.py), i.e. the broker's log
dir; the processor's own state dir holds nothing durable (Faust runs with `memory://`). So the
failure is made real there: a broker of the test's own runs with two log dirs (JBOD), the second a
16 MiB tmpfs that holds the snapshot topic's partitions and nothing else, and the test fills it
(`kvpipe.bench.faultload.SnapshotDisk` builds it and checks the placement on disk: the consumer
offsets topic on the tmpfs would take the group coordinator down with it, another fault).

What "ingest goes on" must survive: the consumer commits offsets every 2.8 s (a timer) and every
10,000 messages (awaited by the loop that hands fetched messages to the index), and Faust flushes
the app's producer before each commit. Snapshot records stuck in that producer held every commit,
and so ingest, from the 10,000th message on (RELIABILITY.md §8, full disk). So the window in which
ingest is checked lasts while more than 10,000 messages are published, and the processor must apply
through it, during snapshot failures that go on being counted.

Needs root (mount). Without it the test is skipped with that reason: nothing else can make a
filesystem full for one topic only. The long form with the longest ingest pause measured:
`kvpipe bench faults --only disk --json`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvpipe.bench.faultload import Load, SnapshotDisk, check_index, full_disk_unavailable

pytestmark = pytest.mark.integration

# Faust's broker_commit_every: the consumer's drain loop awaits an offset commit this often
COMMIT_EVERY = 10_000
# the window lasts while this many messages are published: it holds at least one such commit
WINDOW_MESSAGES = COMMIT_EVERY + 2_000


def wait_for(predicate, timeout: float, what: str, proc) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = proc.get("/stats")
        if predicate(stats):
            return stats
        time.sleep(0.2)
    raise AssertionError(f"{what} within {timeout} s; durability: {stats['durability']}\n{proc.log_tail(3000)}")


def handled(stats: dict) -> int:
    return sum(v.get("offset", -1) + 1 for v in stats["freshness"].values())


def published(rig) -> int:
    return sum(rig.end_offsets().values())


def test_a_full_snapshot_disk_is_counted_ingest_goes_on_and_snapshots_recover(tmp_path: Path) -> None:
    why = full_disk_unavailable()
    if why:
        pytest.skip(why)
    disk = SnapshotDisk(tmp_path, partitions=2)
    figures: dict = {}
    try:
        disk.start()
        rig = disk.rig
        proc = disk.processor(KVPIPE_SNAPSHOT_TIMEOUT_S="3")
        load = Load(rig, nodes=4, step_s=0.005).start()
        wait_for(lambda s: s["durability"]["snapshots"] >= 2, 60, "no snapshot before the disk filled", proc)

        disk.check_placement()  # neither the app nor the publishers put anything else there
        figures["ballast_bytes"] = disk.fill()
        full_at = time.monotonic()
        stats = wait_for(lambda s: s["durability"]["snapshot_errors"] >= 2, 90, "snapshot failures not counted", proc)

        # The window: from here while WINDOW_MESSAGES more are published, and until a further
        # snapshot failure is counted (the disk is still full through all of it).
        start = time.monotonic()
        applied0, published0, durability0 = handled(stats), published(rig), dict(stats["durability"])
        deadline = start + 90
        while True:
            time.sleep(0.5)
            published1 = published(rig)
            stats = proc.get("/stats")
            if (published1 - published0 >= WINDOW_MESSAGES
                    and stats["durability"]["snapshot_errors"] > durability0["snapshot_errors"]) \
                    or time.monotonic() > deadline:
                break
        applied1, durability1 = handled(stats), stats["durability"]
        figures.update(window_s=round(time.monotonic() - start, 1), published_in_window=published1 - published0,
                       applied_while_full=applied1 - applied0, snapshot_errors=durability1["snapshot_errors"],
                       last_error=durability1["snapshot_last_error"]["error"])
        assert published1 - published0 >= WINDOW_MESSAGES, \
            f"the load generator published only {published1 - published0} messages in {figures['window_s']} s"
        assert durability1["snapshot_errors"] > durability0["snapshot_errors"] \
            and durability1["snapshot_ok_ts"] == durability0["snapshot_ok_ts"], \
            f"snapshots did not keep failing through the window: {durability0} → {durability1}"
        assert applied1 >= published0 + COMMIT_EVERY, \
            (f"the processor did not keep applying events while snapshots failed: {applied1 - applied0} applied "
             f"in the window, {published0 - applied0} were waiting at its start and {published1 - published0} "
             f"published during it; freshness {stats['freshness']}")
        assert proc.proc.poll() is None

        # Space returns: the ballast goes, the broker restarts (Kafka re-opens a failed dir only then).
        disk.free()
        back_at = time.monotonic()
        ok_before = durability1["snapshot_ok_ts"]
        stats = wait_for(lambda s: s["durability"]["snapshot_ok_ts"] > ok_before + 1, 120, "snapshots did not resume", proc)
        figures["full_for_s"] = round(back_at - full_at, 1)
        figures["snapshot_back_after_restart_s"] = round(time.monotonic() - back_at, 1)

        # 60 s: a publisher that is stuck after the restart asks the cluster for metadata again at
        # 5, 15 and 35 s (producer/stall.py); the counters say what each one did if it stays stuck
        undelivered = load.stop(flush_timeout=60)
        assert undelivered == 0, \
            f"{undelivered} envelope(s) undelivered 60 s after the restart: {[n.publisher.counters() for n in load.nodes]}"
        end = rig.end_offsets()
        proc.wait_offsets(end, timeout=120)
        result = {**check_index(proc, load), **load.publisher_losses()}
        assert result == {"index_missing": 0, "index_ghosts": 0, "suspect_nodes": 0, "gaps": 0,
                          "publisher_failed": 0, "publisher_dropped": 0}

        # And the recovered snapshots are usable: a SIGKILLed processor restores from one.
        time.sleep(2.5)  # one more periodic snapshot covering the end
        proc.kill()
        proc.start(timeout=120)
        stats = proc.wait_offsets(end, timeout=120)
        restored = {r["partition"]: r["offset"] for r in stats["durability"]["restores"]}
        assert all(restored[p] >= 0 for p, n in end.items() if n), f"restored from a snapshot: {restored}"
        assert check_index(proc, load) == {"index_missing": 0, "index_ghosts": 0, "suspect_nodes": 0, "gaps": 0}
        print(json.dumps(figures, sort_keys=True))
    finally:
        disk.close()
