"""A full disk under the processor's snapshots: ingest goes on, the failures are counted in
/stats, snapshots resume once there is space again, nothing is lost.

Where snapshots go: the compacted snapshot topic (processors/durability.py), i.e. the broker's log
dir; the processor's own state dir holds nothing durable (Faust runs with `memory://`). So the
failure is made real there: a broker of the test's own runs with two log dirs (JBOD), the second a
16 MiB tmpfs that holds the snapshot topic's partitions and nothing else, and the test fills it.
Kafka takes the full dir offline (its partitions lose their leader) and keeps the broker and the
events topic on the other dir running; a failed log dir comes back only when the broker restarts,
so "space returns" = the ballast is deleted and the broker restarted (the operator's fix).

Placement: Kafka puts a new partition in the log dir holding the fewest. So the broker first runs
with one dir while every other topic (events, DLQ, consumer offsets, Faust's own) is created,
then restarts with the tmpfs added and only then is the snapshot topic created: all of its
partitions land on the empty tmpfs (checked on disk).

Needs root (mount). Without it the test is skipped with that reason: nothing else can make a
filesystem full for one topic only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from kvpipe.infra.kafka.config import BrokerConfig
from kvpipe.infra.kafka.local import LocalKafka
from kvpipe.infra.topics import TopicSpec, ensure_topics
from kvpipe.bench.faultload import Load, Rig, check_index
from kvpipe.bench.procrun import free_port

pytestmark = pytest.mark.integration


@pytest.fixture
def small_fs(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("making a filesystem full needs root (mount -t tmpfs)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert r.returncode == 0, f"mount -t tmpfs failed: {r.stderr}"
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def fill(path: Path) -> int:
    """Write a ballast file until the filesystem refuses; returns its size."""
    written = 0
    chunk = b"\0" * (256 * 1024)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                written += f.write(chunk)
        except OSError:
            pass
        try:  # the last partial block too
            while f.write(b"\0" * 4096):
                written += 4096
        except OSError:
            pass
    return written


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


def test_a_full_snapshot_disk_is_counted_ingest_goes_on_and_snapshots_recover(tmp_path: Path, small_fs: Path) -> None:
    cfg = BrokerConfig(state_dir=tmp_path / "broker", port=free_port(), controller_port=free_port(), heap="256m")
    kafka = LocalKafka(cfg)
    kafka.up()
    rig = proc = None
    figures: dict = {}
    try:
        # Phase 1, one log dir: every topic but the snapshots', and Faust's own (one run of the app).
        rig = Rig(cfg.bootstrap, tmp_path / "rig", partitions=2)
        rig.processor("first").stop()
        rig.processes.clear()
        kafka.down(grace=20)

        # Phase 2: the tmpfs added as a second log dir; the snapshot topic lands there.
        kafka = LocalKafka(dataclasses.replace(cfg, extra_log_dirs=(small_fs,)))
        kafka.up()
        snap = f"{rig.snapshots}-small"
        ensure_topics(cfg.bootstrap, [TopicSpec(snap, 2, {"cleanup.policy": "compact", "segment.bytes": str(1 << 20)})])
        placed = lambda d: sorted(p.name for p in d.iterdir() if p.is_dir() and p.name.startswith(snap))  # noqa: E731
        deadline = time.monotonic() + 20
        while len(placed(small_fs)) + len(placed(cfg.data_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # the broker creates the partitions' dirs just after the topic exists
        assert placed(small_fs) == [f"{snap}-0", f"{snap}-1"], \
            f"the snapshot partitions must sit on the small filesystem; big dir holds {placed(cfg.data_dir)}"
        assert not [p for p in small_fs.iterdir() if p.is_dir() and rig.events in p.name], "events stay on the big one"

        proc = rig.processor(KVPIPE_SNAPSHOT_TOPIC=snap, KVPIPE_SNAPSHOT_TIMEOUT_S="3")
        load = Load(rig, nodes=4, step_s=0.005).start()
        wait_for(lambda s: s["durability"]["snapshots"] >= 2, 60, "no snapshot before the disk filled", proc)

        figures["ballast_bytes"] = fill(small_fs / "ballast")
        full_at = time.monotonic()
        stats = wait_for(lambda s: s["durability"]["snapshot_errors"] >= 2, 90, "snapshot failures not counted", proc)
        before = handled(stats)
        time.sleep(3)
        stats = proc.get("/stats")
        figures["snapshot_errors"] = stats["durability"]["snapshot_errors"]
        figures["last_error"] = stats["durability"]["snapshot_last_error"]["error"]
        figures["applied_while_full"] = handled(stats) - before
        assert figures["applied_while_full"] > 0, "the processor kept applying events while snapshots failed"
        assert proc.proc.poll() is None

        # Space returns: the ballast goes, the broker restarts (Kafka re-opens a failed dir only then).
        (small_fs / "ballast").unlink()
        kafka.down(grace=20)
        kafka.up()
        back_at = time.monotonic()
        ok_before = stats["durability"]["snapshot_ok_ts"]
        stats = wait_for(lambda s: s["durability"]["snapshot_ok_ts"] > ok_before + 1, 120, "snapshots did not resume", proc)
        figures["full_for_s"] = round(back_at - full_at, 1)
        figures["snapshot_back_after_restart_s"] = round(time.monotonic() - back_at, 1)

        assert load.stop() == 0
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
        if rig is not None:
            rig.close()
        kafka.down(purge=True, grace=10)
