"""What the fault probes (kvpipe/bench/faults.py) share: throw-away topics on some cluster, real
`kvpipe processor` / `kvpipe analytics` child processes on them, simulated serving nodes that
publish through the real Publisher while timing every `publish()` call, and an exact check of the
index (and the analytics rows) against what the nodes published.

The truth is computed here, independently of processors/core/index.py: node i's step k stores one
new hash, and every fourth step removes the hash stored two steps before. So after the run each
node holds a known set of hashes, and "lost = 0" is checked exactly: the index holds every one
of them for that node (one `/route` with the whole list answers a prefix of its full length) and
nothing else (the node's block count equals the set's size), the node is not suspect and saw no
gap, and no publisher dropped or failed an envelope.
"""
from __future__ import annotations

import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.producer.publisher import Publisher
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored
from kvpipe.schemas.settings import load_settings

if TYPE_CHECKING:
    from kvpipe.infra.kafka.local import LocalKafka

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]
HASH_SPAN = 10**9  # node i's hashes are i * HASH_SPAN + step: no two nodes share one


class Rig:
    """Unique topics on `bootstrap` (replicated `replication` times) and the apps' settings."""

    def __init__(self, bootstrap: str, tmp: Path, partitions: int = 2, replication: int = 1) -> None:
        from kvpipe.infra.topics import default_specs, ensure_topics

        self.bootstrap, self.tmp, self.partitions = bootstrap, tmp, partitions
        self.tag = uuid.uuid4().hex[:10]
        self.events, self.dlq = f"fault-ev-{self.tag}", f"fault-dlq-{self.tag}"
        self.snapshots, self.analytics_snapshots = f"fault-snap-{self.tag}", f"fault-asnap-{self.tag}"
        self.specs = default_specs(self.events, self.dlq, self.snapshots, partitions, self.analytics_snapshots,
                                   replication=replication)
        ensure_topics(bootstrap, self.specs)  # retries while a new cluster settles
        tmp.mkdir(parents=True, exist_ok=True)
        self.processes: list[ProcessorProcess] = []

    def env(self, **extra: str) -> dict[str, str]:
        return {"KVPIPE_KAFKA_BOOTSTRAP": self.bootstrap, "KVPIPE_EVENTS_TOPIC": self.events,
                "KVPIPE_DLQ_TOPIC": self.dlq, "KVPIPE_SNAPSHOT_TOPIC": self.snapshots,
                "KVPIPE_ANALYTICS_SNAPSHOT_TOPIC": self.analytics_snapshots,
                "KVPIPE_PARTITIONS": str(self.partitions), "KVPIPE_PROCESSOR_ID": f"fault-idx-{self.tag}",
                "KVPIPE_ANALYTICS_ID": f"fault-ana-{self.tag}", "KVPIPE_WEB_PORT": str(free_port()),
                "KVPIPE_ANALYTICS_WEB_PORT": str(free_port()), "KVPIPE_STATE_DIR": str(self.tmp / "state"),
                # nodes never expire during a probe: an outage must not be mistaken for a dead node
                "KVPIPE_NODE_TTL_S": "3600", "KVPIPE_ANALYTICS_FLUSH_S": "0.2", **extra}

    def processor(self, name: str = "processor", snapshot_every_s: float = 1.0, **extra: str) -> ProcessorProcess:
        proc = ProcessorProcess(self.env(KVPIPE_SNAPSHOT_EVERY_S=str(snapshot_every_s), **extra),
                                self.tmp / f"{name}.log").start(timeout=120)
        self.processes.append(proc)
        return proc

    def rebuild(self) -> ProcessorProcess:
        """A processor of its own group that finds no snapshot (it reads the DLQ topic for them)
        and so rebuilds everything from offset 0."""
        return self.processor("rebuild", KVPIPE_PROCESSOR_ID=f"fault-rebuild-{uuid.uuid4().hex[:8]}",
                              KVPIPE_SNAPSHOT_TOPIC=self.dlq, KVPIPE_STATE_DIR=str(self.tmp / "rebuild-state"))

    def analytics(self, snapshot_every_s: float = 1.0) -> ProcessorProcess:
        proc = ProcessorProcess(self.env(KVPIPE_SNAPSHOT_EVERY_S=str(snapshot_every_s)), self.tmp / "analytics.log",
                                command="analytics").start(timeout=120)
        self.processes.append(proc)
        return proc

    def end_offsets(self) -> dict[int, int]:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({**load_settings().kafka_confluent_security(), "bootstrap.servers": self.bootstrap,
                             "group.id": "unused"})
        try:
            return {p: consumer.get_watermark_offsets(TopicPartition(self.events, p), timeout=30)[1]
                    for p in range(self.partitions)}
        finally:
            consumer.close()

    def close(self) -> None:
        from kvpipe.infra.topics import delete_topics

        for proc in self.processes:
            proc.kill()
        try:
            delete_topics(self.bootstrap, [s.name for s in self.specs])
        except Exception:  # cleanup only: a leftover probe topic is harmless
            pass


class NodeTruth:
    """One simulated node: its publisher and the hashes it holds after each step."""

    def __init__(self, rig: Rig, index: int) -> None:
        self.node_id = f"fault-node-{index}"
        self.base = index * HASH_SPAN
        settings = load_settings(overrides={"kafka_bootstrap": rig.bootstrap, "events_topic": rig.events,
                                            "heartbeat_s": 3600.0})  # no heartbeats: counts stay exact
        self.publisher = Publisher(settings, self.node_id, group_specs=SPECS, epoch=1, model="fault-model")
        self.held: dict[int, None] = {}  # insertion-ordered set
        self.steps = self.removes = self.refused = 0

    def step(self) -> int:
        """Publish the next step; returns how long `publish()` took, in ns."""
        k = self.steps
        events: list = [BlockStored(block_hashes=[self.base + k], parent_block_hash=None, token_ids=[],
                                    block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0)]
        gone = self.base + k - 2
        if k % 4 == 3:
            events.append(BlockRemoved(block_hashes=[gone], medium="GPU", group_idx=0))
        t0 = time.perf_counter_ns()
        ok = self.publisher.publish(events)
        took = time.perf_counter_ns() - t0
        if not ok:
            self.refused += 1  # the node's own account: never expected here, counted as lost
            return took
        self.steps += 1
        self.held[self.base + k] = None
        if k % 4 == 3:
            del self.held[gone]
            self.removes += 1
        return took


class Load:
    """Nodes publishing one step each every `step_s` seconds from one thread (a serving loop)."""

    def __init__(self, rig: Rig, nodes: int = 4, step_s: float = 0.005) -> None:
        self.nodes = [NodeTruth(rig, i) for i in range(nodes)]
        self.step_s = step_s
        self.samples: list[tuple[float, int]] = []  # (monotonic time, publish() ns)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-load", daemon=True)

    def start(self) -> "Load":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            for node in self.nodes:
                self.samples.append((now, node.step()))
            self._stop.wait(self.step_s)

    def stop(self, flush_timeout: float = 120.0) -> int:
        """Stop stepping, wait for every envelope to be delivered; returns what remains undelivered."""
        self._stop.set()
        self._thread.join()
        left = sum(n.publisher.flush(flush_timeout) for n in self.nodes)
        for n in self.nodes:
            n.publisher.close(5.0)
        return left

    def latency_ms(self, since: float = 0.0, until: float = float("inf")) -> dict:
        ns = sorted(d for t, d in self.samples if since <= t <= until)
        if not ns:
            return {"calls": 0}
        pick = lambda q: round(ns[min(len(ns) - 1, int(q * len(ns)))] / 1e6, 4)  # noqa: E731
        return {"calls": len(ns), "p50_ms": pick(0.5), "p99_ms": pick(0.99), "max_ms": round(ns[-1] / 1e6, 4),
                "mean_ms": round(statistics.fmean(ns) / 1e6, 4)}

    def publisher_losses(self) -> dict:
        counters = [n.publisher.counters() for n in self.nodes]
        return {"publisher_failed": sum(c["failed"] for c in counters),
                "publisher_dropped": sum(c["dropped"] for c in counters) + sum(n.refused for n in self.nodes)}


def check_index(proc: ProcessorProcess, load: Load) -> dict:
    """The index against the truth: entries missing, entries invented, suspects, gaps."""
    rows = {r["node_id"]: r for r in proc.get("/nodes?limit=10000")["nodes"]}
    missing = ghosts = suspect = gaps = 0
    for node in load.nodes:
        row = rows.get(node.node_id)
        if row is None:
            missing += len(node.held)
            continue
        held = list(node.held)
        # per-group prefixes (the router's explanation form) read the node's GPU entries directly
        answer = proc.route({"0": held}, semantics="prefix-per-group", include_zero=True) if held else {"nodes": []}
        prefix = next((g["prefix_blocks"].get("GPU", 0) for r in answer["nodes"] if r["node_id"] == node.node_id
                       for g in r["groups"] if g["group_idx"] == 0 and g.get("prefix_blocks")), 0)
        missing += len(held) - prefix
        ghosts += max(0, row["blocks"].get("0/GPU", 0) - len(held))
        suspect += bool(row["suspect"])
        gaps += row["counters"].get("gaps", 0)
    return {"index_missing": missing, "index_ghosts": ghosts, "suspect_nodes": suspect, "gaps": gaps}


def check_analytics(proc: ProcessorProcess, load: Load) -> dict:
    """Rows in the analytics store (deduplicated FINAL view) against the truth: events by node and kind."""
    status, answer = proc.post("/sql", {"sql": "SELECT node_id, kind, count() AS n, sum(num_blocks) AS blocks "
                                               "FROM kv_events_final GROUP BY node_id, kind"}, timeout=60)
    if status != 200:
        raise AssertionError(f"/sql answered {status}: {answer}")
    got = {(r[0], r[1]): (int(r[2]), int(r[3])) for r in answer["rows"]}
    want = {}
    for n in load.nodes:
        want[(n.node_id, "stored")] = (n.steps, n.steps)
        if n.removes:
            want[(n.node_id, "removed")] = (n.removes, n.removes)
    wrong = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
    return {"analytics_rows_wrong": len(wrong), "analytics_diff": {f"{k[0]}/{k[1]}": v for k, v in list(wrong.items())[:5]}}


def wait_analytics_written(proc: ProcessorProcess, end: dict[int, int], timeout: float = 120.0) -> dict:
    stats = proc.wait_offsets(end, timeout)
    deadline = time.monotonic() + timeout
    while stats["sink"]["unwritten_rows"] and time.monotonic() < deadline:
        time.sleep(0.1)
        stats = proc.get("/stats")
    return stats


class Progress:
    """Samples an app's handled offsets every `every_s`; the longest stretch without progress."""

    def __init__(self, proc: ProcessorProcess, every_s: float = 0.1) -> None:
        self.proc, self.every_s = proc, every_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fault-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                fresh = self.proc.get("/stats", timeout=2.0)["freshness"]
                self.samples.append((time.monotonic(), sum(v.get("offset", -1) + 1 for v in fresh.values())))
            except (OSError, ValueError, KeyError):
                pass  # paused or busy: no sample is no progress
            self._stop.wait(self.every_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def longest_stall_s(self, since: float, until: float) -> float:
        """Longest time in [since, until] between two samples with more handled messages."""
        last_t, last_v, worst = since, None, 0.0
        for t, v in self.samples:
            if t < since:
                last_v = v
                continue
            if t > until:
                break
            if last_v is None or v > last_v:
                worst = max(worst, t - last_t)
                last_t, last_v = t, v
        return round(max(worst, min(until, self.samples[-1][0] if self.samples else until) - last_t), 2)


def _sample_ingest(url: str, headers: dict, bootstrap: str, topic: str, partitions: int, every_s: float, path: str,
                   stop) -> None:
    """IngestPauses' sampler (a child process): `monotonic applied published` lines into `path`."""
    from confluent_kafka import Consumer, TopicPartition

    from kvpipe.processors.core.remote import ok_json

    tps = [TopicPartition(topic, p) for p in range(partitions)]
    broker = Consumer({**load_settings().kafka_confluent_security(), "bootstrap.servers": bootstrap, "group.id": "unused"})
    try:
        with open(path, "w", buffering=1) as out:
            while not stop.is_set():
                t0 = time.monotonic()
                try:
                    # before /stats: what the processor could have applied by the time it answers
                    published = sum(broker.get_watermark_offsets(tp, timeout=5)[1] for tp in tps)
                    fresh = ok_json(url + "/stats", timeout=5.0, headers=headers)["freshness"]
                    applied = sum(v.get("offset", -1) + 1 for v in fresh.values())
                    out.write(f"{time.monotonic()} {applied} {published}\n")
                except Exception:  # noqa: BLE001 - broker restarting, processor busy: no sample is no progress
                    pass
                stop.wait(max(0.0, every_s - (time.monotonic() - t0)))
    finally:
        broker.close()


class IngestPauses:
    """Samples, every `every_s`, how many messages the processor has applied (its /stats) and how many
    the broker holds (the events topic's end offsets): the longest pause of ingest is the longest
    time no sample saw the applied count advance while messages were waiting. A sample is timed
    when its /stats answer arrived, so a blocked event loop shows as a pause too. The resolution
    is the sampling interval (`sample_gaps_ms` says what it was). The sampler is a process of its
    own: in this one it would wait for the GIL behind the publishing nodes' threads."""

    def __init__(self, proc: ProcessorProcess, rig: Rig, every_s: float = 0.02) -> None:
        import multiprocessing
        import tempfile

        self.every_s = every_s
        self.samples: list[tuple[float, int, int]] = []  # (monotonic time, applied, published), after stop()
        fd, self._path = tempfile.mkstemp(prefix="kvpipe-pauses-", suffix=".txt")
        import os

        os.close(fd)
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._proc = ctx.Process(target=_sample_ingest, name="fault-pauses", daemon=True,
                                 args=(proc.url, proc.headers, rig.bootstrap, rig.events, rig.partitions, every_s,
                                       self._path, self._stop))
        self._proc.start()

    def stop(self) -> None:
        """Stop sampling and load the samples."""
        import os

        if self._stop.is_set():
            return
        self._stop.set()
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
        try:
            with open(self._path) as f:
                self.samples = [(float(t), int(a), int(p)) for t, a, p in (line.split() for line in f if line.strip())]
        finally:
            os.unlink(self._path)

    def applied(self, at: float) -> int | None:
        """The applied count of the last sample at or before `at`."""
        before = [a for t, a, _ in self.samples if t <= at]
        return before[-1] if before else None

    def window(self, since: float, until: float) -> list[tuple[float, int, int]]:
        return [s for s in self.samples if since <= s[0] <= until]

    def longest_pause_ms(self, since: float, until: float) -> float:
        """Longest time in [since, until] from a sample that saw progress (or nothing waiting) to the
        next such sample, when the samples in between saw messages waiting and none applied."""
        worst, last_t, last_applied = 0.0, None, 0  # last_applied is read only once last_t is set
        for t, applied, published in self.window(since, until):
            if last_t is None:
                last_t, last_applied = t, applied
                continue
            if applied > last_applied or published <= applied:
                worst = max(worst, t - last_t)
                last_t, last_applied = t, applied
        if last_t is not None and self.samples:  # a pause still going on at `until`
            end = min(until, self.samples[-1][0])
            if end > last_t and any(p > a for t, a, p in self.window(last_t, end)):
                worst = max(worst, end - last_t)
        return round(worst * 1000, 1)

    def sample_gaps_ms(self, since: float, until: float) -> dict:
        ts = [s[0] for s in self.window(since, until)]
        gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
        if not gaps:
            return {"samples": len(ts)}
        return {"samples": len(ts), "p50_ms": round(gaps[len(gaps) // 2] * 1000, 1),
                "max_ms": round(gaps[-1] * 1000, 1)}


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


def full_disk_unavailable() -> str | None:
    """Why `SnapshotDisk` cannot run here, or None."""
    import os

    if os.geteuid() != 0:
        return "making a filesystem full needs root (mount -t tmpfs)"
    return None


class SnapshotDisk:
    """A broker of its own whose snapshot topic, and nothing else, sits on a small tmpfs (a second
    log dir, JBOD), a rig of topics on it, and the means to fill the tmpfs and give the space back.

    Kafka takes a full log dir offline (its partitions lose their leader) and keeps the broker and
    the partitions on the other dir running; a failed dir comes back only when the broker restarts,
    so `free()` deletes the ballast and restarts the broker (the operator's fix).

    Placement: Kafka puts a new partition in the log dir holding the fewest. So the broker first runs
    with one dir while every other topic is created — the rig's topics, and `__consumer_offsets`,
    which Kafka creates only on a group's first coordinator lookup: left to the processor's start it
    may come after the restart and land (mostly) on the tmpfs, and filling it then takes the consumer
    group's coordinator offline too (offset commits fail with NOT_COORDINATOR, the consumer's commit
    retries for ever and ingest waits behind it), a different fault. Then it
    restarts with the tmpfs added and only then is the snapshot topic created. `start` checks on
    disk that the tmpfs holds the snapshot topic's partitions and nothing else. Needs root (mount).
    """

    def __init__(self, tmp: Path, partitions: int = 2, size: str = "16m", heap: str = "256m") -> None:
        self.tmp, self.partitions, self.size, self.heap = tmp, partitions, size, heap
        self.small = tmp / "small"
        self._kafka: LocalKafka | None = None
        self._rig: Rig | None = None
        self.snapshots = ""
        self._mounted = False

    @property
    def kafka(self) -> LocalKafka:
        if self._kafka is None:
            raise RuntimeError("SnapshotDisk: start() first")
        return self._kafka

    @property
    def rig(self) -> Rig:
        if self._rig is None:
            raise RuntimeError("SnapshotDisk: start() first")
        return self._rig

    def start(self) -> "SnapshotDisk":
        import dataclasses
        import subprocess

        from kvpipe.infra.kafka.config import BrokerConfig
        from kvpipe.infra.kafka.local import LocalKafka
        from kvpipe.infra.topics import TopicSpec, ensure_topics

        why = full_disk_unavailable()
        if why:
            raise RuntimeError(why)
        self.small.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.small)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"mount -t tmpfs failed: {r.stderr}")
        self._mounted = True
        cfg = BrokerConfig(state_dir=self.tmp / "broker", port=free_port(), controller_port=free_port(), heap=self.heap)
        self._kafka = LocalKafka(cfg)
        self.kafka.up()
        # Phase 1, one log dir: every topic but the snapshots', Faust's own (one run of the app) and
        # the group coordinator's.
        self._rig = Rig(cfg.bootstrap, self.tmp / "rig", partitions=self.partitions)
        self.rig.processor("first").stop()
        self.rig.processes.clear()
        self._create_offsets_topic(cfg)
        self.kafka.down(grace=20)

        # Phase 2: the tmpfs added as a second log dir; the snapshot topic lands there.
        self._kafka = LocalKafka(dataclasses.replace(cfg, extra_log_dirs=(self.small,)))
        self.kafka.up()
        self.snapshots = f"{self.rig.snapshots}-small"
        ensure_topics(cfg.bootstrap, [TopicSpec(self.snapshots, self.partitions,
                                                {"cleanup.policy": "compact", "segment.bytes": str(1 << 20)})])
        want = [f"{self.snapshots}-{p}" for p in range(self.partitions)]
        deadline = time.monotonic() + 20
        while sorted(self.small_dirs() + self._dirs(cfg.data_dir, self.snapshots)) != want and time.monotonic() < deadline:
            time.sleep(0.2)  # the broker creates the partitions' dirs just after the topic exists
        self.check_placement()
        return self

    def check_placement(self) -> None:
        """The small filesystem holds the snapshot topic's partitions and nothing else (AssertionError)."""
        want = [f"{self.snapshots}-{p}" for p in range(self.partitions)]
        if self.small_dirs() != want:
            raise AssertionError(f"the small filesystem must hold the snapshot partitions {want} and nothing else; "
                                 f"it holds {self.small_dirs()}")

    @staticmethod
    def _dirs(root: Path, prefix: str = "") -> list[str]:
        return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith(prefix))

    def small_dirs(self) -> list[str]:
        """The partition dirs on the small filesystem."""
        return self._dirs(self.small)

    def _create_offsets_topic(self, cfg) -> None:
        """A group coordinator lookup makes Kafka create `__consumer_offsets` (all its partitions)
        now, on the one log dir; waits for their dirs on disk."""
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer({**load_settings().kafka_confluent_security(), "bootstrap.servers": cfg.bootstrap,
                             "group.id": f"fault-coordinator-{self.rig.tag}"})
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    consumer.committed([TopicPartition(self.rig.events, 0)], timeout=10)
                    break
                except Exception:  # noqa: BLE001 - the coordinator is loading the new topic: ask again
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
        finally:
            consumer.close()
        deadline = time.monotonic() + 30
        while len(self._dirs(cfg.data_dir, "__consumer_offsets-")) < 8:  # offsets.topic.num.partitions (infra)
            if time.monotonic() > deadline:
                raise AssertionError(f"__consumer_offsets not on disk: {self._dirs(cfg.data_dir)}")
            time.sleep(0.2)

    def processor(self, **extra: str) -> ProcessorProcess:
        """`kvpipe processor` writing its snapshots to the topic on the small filesystem."""
        return self.rig.processor(name="processor", snapshot_every_s=1.0, KVPIPE_SNAPSHOT_TOPIC=self.snapshots, **extra)

    def fill(self) -> int:
        return fill(self.small / "ballast")

    def free(self) -> None:
        """Space returns: the ballast goes, the broker restarts (Kafka re-opens a failed dir only then)."""
        (self.small / "ballast").unlink(missing_ok=True)
        self.kafka.down(grace=20)
        self.kafka.up()

    def close(self) -> None:
        import subprocess

        try:
            if self._rig is not None:
                self._rig.close()
        finally:
            try:
                if self._kafka is not None:
                    self._kafka.down(purge=True, grace=10)
            finally:
                if self._mounted:
                    subprocess.run(["umount", "-l", str(self.small)], capture_output=True)
