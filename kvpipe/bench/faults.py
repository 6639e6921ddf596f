"""Fault probes with real processes: a broker outage, a processor SIGKILL, a processor SIGSTOP,
the leader of the busiest partition of a 3-node cluster SIGKILLed, a full disk under the snapshots.
Each returns its figures and what was lost (kvpipe/bench/faultload.py checks the index exactly
against what the nodes published).

tests/fault/ runs them small inside `make test`; `kvpipe bench faults --json` runs them large.
The outage, leader-kill and full-disk probes start brokers of their own (state under a temp dir,
free ports): stopping or killing a broker that anyone else uses is never part of a probe.
"""
from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, TypedDict

import click

from kvpipe.bench.faultload import (IngestPauses, Load, Progress, Rig, SnapshotDisk, check_analytics, check_index,
                                    full_disk_unavailable, wait_analytics_written)
from kvpipe.bench.procrun import free_port
from kvpipe.schemas.cliopts import Command, run as run_command


def _lost(result: dict) -> int:
    keys = ("index_missing", "index_ghosts", "suspect_nodes", "gaps", "publisher_failed", "publisher_dropped",
            "undelivered", "analytics_rows_wrong", "rebuild_missing", "rebuild_ghosts")
    return sum(int(result.get(k, 0)) for k in keys)


def _finish(result: dict, rig: Rig, load: Load, proc) -> dict:
    result["undelivered"] = load.stop()
    result.update(load.publisher_losses())
    end = rig.end_offsets()
    caught = time.monotonic()
    proc.wait_offsets(end, timeout=180)
    result["drain_s"] = round(time.monotonic() - caught, 2)
    result.update(check_index(proc, load))
    result["steps_published"] = sum(n.steps for n in load.nodes)
    result["messages"] = sum(end.values())
    result["processor_alive"] = proc.popen.poll() is None
    result["lost"] = _lost(result)
    return result


class _Common(TypedDict):
    """The load every probe runs under."""

    nodes: int
    step_s: float


def _kill(pid: int | None) -> None:
    """SIGKILL `pid` (a broker's `running_pid()`: None when it does not run) and wait until it is gone."""
    if pid is None:
        raise RuntimeError("the process to kill is not running")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return
        time.sleep(0.05)


def outage(tmp: Path, outage_s: float = 5.0, before_s: float = 2.0, after_s: float = 3.0,
           nodes: int = 4, step_s: float = 0.005, heap: str = "256m") -> dict:
    """A broker of our own is SIGKILLed while nodes publish, restarted `outage_s` later."""
    from kvpipe.infra.kafka.config import BrokerConfig
    from kvpipe.infra.kafka.local import LocalKafka

    kafka = LocalKafka(BrokerConfig(state_dir=tmp / "broker", port=free_port(), controller_port=free_port(), heap=heap))
    kafka.up()
    rig = None
    try:
        rig = Rig(kafka.cfg.bootstrap, tmp / "rig", partitions=2)
        proc = rig.processor()
        load = Load(rig, nodes, step_s).start()
        time.sleep(before_s)
        down_at = time.monotonic()
        _kill(kafka.running_pid())
        time.sleep(outage_s)
        kafka.up()  # restart: returns once it answers again
        up_at = time.monotonic()
        time.sleep(after_s)
        result = {"probe": "broker_outage", "outage_s": round(up_at - down_at, 2), "nodes": nodes,
                  "publish_during_outage": load.latency_ms(down_at, up_at), "publish_overall": load.latency_ms()}
        return _finish(result, rig, load, proc)
    finally:
        if rig is not None:
            rig.close()
        kafka.down(purge=True, grace=10)


def processor_kill(bootstrap: str, tmp: Path, before_s: float = 3.0, after_s: float = 3.0,
                   nodes: int = 4, step_s: float = 0.005) -> dict:
    """SIGKILL the processor mid-stream, restart it at once: its index must equal the truth and a
    rebuild from offset 0."""
    rig = Rig(bootstrap, tmp, partitions=2)
    try:
        proc = rig.processor()
        load = Load(rig, nodes, step_s).start()
        time.sleep(before_s)
        proc.kill()
        t0 = time.monotonic()
        proc.start(timeout=120)
        restart_s = time.monotonic() - t0
        end = rig.end_offsets()
        proc.wait_offsets(end, timeout=120)
        result = {"probe": "processor_kill", "nodes": nodes, "restart_s": round(restart_s, 2),
                  "caught_up_s": round(time.monotonic() - t0, 2)}
        time.sleep(after_s)
        result = _finish(result, rig, load, proc)
        rebuild = rig.rebuild()
        rebuild.wait_offsets(rig.end_offsets(), timeout=180)
        rb = check_index(rebuild, load)
        result.update(rebuild_missing=rb["index_missing"], rebuild_ghosts=rb["index_ghosts"])
        return result
    finally:
        rig.close()


def processor_pause(bootstrap: str, tmp: Path, pause_s: float = 5.0, before_s: float = 2.0, after_s: float = 2.0,
                    nodes: int = 4, step_s: float = 0.005) -> dict:
    """SIGSTOP the processor under load for `pause_s`, SIGCONT: the time until it has handled
    everything published up to the SIGCONT."""
    rig = Rig(bootstrap, tmp, partitions=2)
    try:
        proc = rig.processor()
        load = Load(rig, nodes, step_s).start()
        time.sleep(before_s)
        proc.popen.send_signal(signal.SIGSTOP)
        time.sleep(pause_s)
        end = rig.end_offsets()
        proc.popen.send_signal(signal.SIGCONT)
        t0 = time.monotonic()
        proc.wait_offsets(end, timeout=120)
        result = {"probe": "processor_pause", "nodes": nodes, "pause_s": pause_s,
                  "published_at_resume": sum(end.values()), "caught_up_s": round(time.monotonic() - t0, 2)}
        time.sleep(after_s)
        return _finish(result, rig, load, proc)
    finally:
        rig.close()


def free_port_run(n: int) -> int:
    """A base port with `n` consecutive free ports after it (the cluster's layout)."""
    for _ in range(50):
        base = free_port()
        if base + n >= 65535:
            continue
        ok = True
        for port in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no run of free loopback ports found")


def leader_kill(tmp: Path, before_s: float = 4.0, after_s: float = 6.0, nodes: int = 4, step_s: float = 0.005,
                heap: str = "256m", partitions: int = 2) -> dict:
    """A 3-node cluster of our own; publishers, `kvpipe processor` and `kvpipe analytics` run while
    the leader of the busiest events partition is SIGKILLed. Figure: the longest time either app
    made no progress."""
    from confluent_kafka.admin import AdminClient

    from kvpipe.infra.kafka.cluster import LocalCluster
    from kvpipe.infra.kafka.config import BrokerConfig

    base = free_port_run(6)
    cluster = LocalCluster(BrokerConfig(state_dir=tmp / "cluster", port=base, controller_port=base + 1, heap=heap), 3)
    cluster.up()
    rig = None
    progress = []
    try:
        rig = Rig(cluster.bootstrap, tmp / "rig", partitions=partitions, replication=3)
        proc, ana = rig.processor(), rig.analytics()
        progress = [Progress(proc), Progress(ana)]
        load = Load(rig, nodes, step_s).start()
        time.sleep(before_s)
        end = rig.end_offsets()
        busiest = max(end, key=lambda p: end[p])
        md = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(rig.events, timeout=30)
        leader = md.topics[rig.events].partitions[busiest].leader
        victim = cluster.nodes[leader - 1]
        killed_at = time.monotonic()
        _kill(victim.running_pid())
        time.sleep(after_s)
        stopped_at = time.monotonic()
        result = {"probe": "cluster_leader_kill", "nodes": nodes, "partition": busiest, "killed_node": leader,
                  "publish_after_kill": load.latency_ms(killed_at, stopped_at)}
        result = _finish(result, rig, load, proc)
        for p in progress:
            p.stop()
        result["processor_stall_s"] = progress[0].longest_stall_s(killed_at - 0.5, stopped_at)
        result["analytics_stall_s"] = progress[1].longest_stall_s(killed_at - 0.5, stopped_at)
        wait_analytics_written(ana, rig.end_offsets())
        result.update(check_analytics(ana, load))
        result["analytics_alive"] = ana.popen.poll() is None
        result["lost"] = _lost(result)
        return result
    finally:
        for p in progress:
            p.stop()
        if rig is not None:
            rig.close()
        cluster.down(purge=True, grace=10)


def disk_full(tmp: Path, before_s: float = 10.0, full_s: float = 30.0, nodes: int = 4, step_s: float = 0.005,
              every_s: float = 0.02, snapshot_timeout_s: float = 3.0) -> dict:
    """The filesystem under the snapshot topic (and nothing else) fills while nodes publish
    (kvpipe/bench/faultload.py: SnapshotDisk); snapshots fail, counted. Figure: the longest ingest
    pause while it is full (goal ≤ 100 ms), beside the longest in the `before_s` before it filled,
    sampled every `every_s`. Then the space returns (ballast deleted, broker restarted) and the
    snapshots must resume. Needs root (mount); skipped otherwise."""
    why = full_disk_unavailable()
    if why:
        return {"probe": "snapshot_disk_full", "skipped": why}
    disk = SnapshotDisk(tmp)
    pauses = None
    try:
        disk.start()
        proc = disk.processor(KVPIPE_SNAPSHOT_TIMEOUT_S=str(snapshot_timeout_s))
        pauses = IngestPauses(proc, disk.rig, every_s)
        load = Load(disk.rig, nodes, step_s).start()
        time.sleep(2.0)  # the publishers' and the consumer's start is not what is measured
        before_at = time.monotonic()
        time.sleep(before_s)
        disk.check_placement()
        ok_before = proc.get("/stats")["durability"]["snapshots"]
        filled_at = time.monotonic()
        ballast = disk.fill()
        time.sleep(full_s)
        freed_at = time.monotonic()
        durability = proc.get("/stats")["durability"]
        disk.free()
        back_at = time.monotonic()
        deadline = back_at + 120
        while proc.get("/stats")["durability"]["snapshot_ok_ts"] <= durability["snapshot_ok_ts"] + 1:
            if time.monotonic() > deadline:
                raise AssertionError(f"snapshots did not resume within 120 s: {proc.get('/stats')['durability']}")
            time.sleep(0.1)
        pauses.stop()
        result = {"probe": "snapshot_disk_full", "nodes": nodes, "ballast_bytes": ballast,
                  "full_s": round(freed_at - filled_at, 1),
                  "longest_ingest_pause_full_ms": pauses.longest_pause_ms(filled_at, freed_at),
                  "longest_ingest_pause_before_ms": pauses.longest_pause_ms(before_at, filled_at),
                  "sampling_full": pauses.sample_gaps_ms(filled_at, freed_at),
                  "applied_while_full": (pauses.applied(freed_at) or 0) - (pauses.applied(filled_at) or 0),
                  "snapshots_before_full": ok_before, "snapshot_errors": durability["snapshot_errors"],
                  "snapshot_last_error": (durability["snapshot_last_error"] or {}).get("error"),
                  "snapshot_back_after_restart_s": round(time.monotonic() - back_at, 1)}
        return _finish(result, disk.rig, load, proc)
    finally:
        if pauses is not None:
            pauses.stop()
        disk.close()


PROBES = ("outage", "kill", "pause", "leader", "disk")


@click.command("faults", cls=Command, help=__doc__.split("\n\n")[0])
@click.option("--only", default=",".join(PROBES), show_default=True, help="comma-separated probes")
@click.option("--outage-s", type=float, default=30.0, show_default=True, help="seconds the broker stays down")
@click.option("--pause-s", type=float, default=30.0, show_default=True, help="seconds the processor stays stopped")
@click.option("--full-s", type=float, default=30.0, show_default=True,
              help="seconds the snapshot topic's filesystem stays full (disk)")
@click.option("--seconds", type=float, default=10.0, show_default=True, help="load before and after each fault")
@click.option("--nodes", type=int, default=8, show_default=True, help="publishing nodes")
@click.option("--step-ms", type=float, default=5.0, show_default=True,
              help="each node publishes one step this often")
def faults(only: str, outage_s: float, pause_s: float, full_s: float, seconds: float, nodes: int,
           step_ms: float) -> dict:
    from kvpipe.schemas.settings import load_settings

    chosen = {p.strip() for p in only.split(",") if p.strip()}
    if unknown := chosen - set(PROBES):
        raise click.BadParameter(f"unknown probes {sorted(unknown)}; known: {', '.join(PROBES)}", param_hint="--only")
    common = _Common(nodes=nodes, step_s=step_ms / 1000)
    bootstrap = load_settings().bootstrap()
    probes: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvpipe-faults-") as d:
        tmp = Path(d)
        if "outage" in chosen:
            probes["outage"] = outage(tmp / "outage", outage_s, seconds, seconds, **common)
        if "kill" in chosen:
            probes["kill"] = processor_kill(bootstrap, tmp / "kill", seconds, seconds, **common)
        if "pause" in chosen:
            probes["pause"] = processor_pause(bootstrap, tmp / "pause", pause_s, seconds, seconds, **common)
        if "leader" in chosen:
            probes["leader"] = leader_kill(tmp / "leader", seconds, seconds, **common)
        if "disk" in chosen:
            probes["disk"] = disk_full(tmp / "disk", seconds, full_s, **common)
    for r in probes.values():
        r["lost"] = _lost(r)
    outage_p99 = probes.get("outage", {}).get("publish_during_outage", {}).get("p99_ms")
    return {"bench": "faults", "value": sum(r["lost"] for r in probes.values()), "unit": "events lost (all probes)",
            "baseline": 0, "ratio": 1.0 if all(r["lost"] == 0 for r in probes.values()) else 0.0,
            "publish_p99_during_outage_ms": outage_p99,
            "disk_full_longest_ingest_pause_ms": probes.get("disk", {}).get("longest_ingest_pause_full_ms"),
            "probes": probes}


def run(argv: list[str]) -> dict[str, Any] | int:
    """`kvpipe bench faults`: the probes at bench size (the suite runs them small). The result, or
    an exit code after help or a usage error."""
    return run_command(faults, argv, "kvpipe bench faults")
