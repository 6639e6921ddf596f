"""The analytics app (and, where a test wants it, the routing app beside it) on throwaway topics,
and the test's own model of the rows it must write.

`AnalyticsSession` owns the topics and the settings of one analytics app (its chDB store lives in
the session's state dir, so only that app may open it: tests read through its `POST /sql`).
`RowModel` recomputes, from the events the test publishes and independently of `kvpipe.processors.core.index`,
which `kv_events` and `kv_block_lifetimes` rows exactly-once analytics must hold.
`SimNode` publishes steps through the real `Publisher` with test-chosen timestamps, so lifetimes
are whole seconds and their sums can be compared exactly.
"""
from __future__ import annotations

import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any


from kvpipe.bench.procrun import ProcessorProcess, free_port
from tests.integration.processor_fixture import ProcessorTopics
from kvpipe.producer.publisher import Publisher
from kvpipe.schemas.envelope import GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvpipe.schemas.settings import load_settings

FA, SWA = 0, 1  # group indexes
SPECS = [GroupSpec(group_idx=FA, kind="full_attention", block_size=16),
         GroupSpec(group_idx=SWA, kind="sliding_window", block_size=16, sliding_window=64)]
KIND_OF_GROUP = {FA: "full_attention", SWA: "sliding_window"}


def stored(hashes: list[int], group: int = FA, medium: str = "GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def removed(hashes: list[int], group: int = FA, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


class RowModel:
    """Expected analytics rows. Per (node, group, medium): hash → [copies, first store ts].

    The rules it encodes (docs/vllm-behaviour.md §5, docs/architecture.md §7): a store of a held hash adds a copy and
    keeps the first store time; a lifetime ends when the last copy is removed (`evicted`); a
    removal of an unknown hash is an event row and nothing else; AllBlocksCleared ends every GPU
    entry of the node (`cleared`); a new epoch ends every entry, CPU too (`cleared`), at the new
    epoch's first envelope's ts, attributed to the old epoch.

    Capacity rows (`end_reasons`, `restores`): a new epoch's clear is `epoch_change` in `end_reason`; a
    store of a hash that is not held but whose lifetime on that (node, group, medium) ended before is a
    re-store, with the delay since that end and its LRU stack distance: the number of distinct hashes
    stored there since the hash's previous store (counted here by brute force over the store history).
    """

    def __init__(self) -> None:
        self.held: dict[tuple[str, int, str], dict[int, list]] = defaultdict(dict)
        self.epoch: dict[str, int] = {}
        self.events: Counter = Counter()  # (node, group, medium, kind) → rows
        self.blocks: Counter = Counter()  # (node, group, medium, kind) → sum(num_blocks)
        self.lifetimes: Counter = Counter()  # (node, epoch, group, medium, reason) → rows
        self.lifetime_s: Counter = Counter()  # same key → sum of lifetime seconds
        self.evicted_s: dict[tuple[int, str], list[float]] = defaultdict(list)  # (group, medium) → lifetimes
        self.end_reasons: Counter = Counter()  # (node, group, medium, end_reason) → lifetimes
        self.ended: dict[tuple, tuple[float, str]] = {}  # (node, group, medium, hash) → (end ts, end_reason)
        self.store_history: dict[tuple[str, int, str], list[int]] = defaultdict(list)
        self.restores: list[tuple] = []  # (node, group, medium, hash, delay_s, end_reason, stack_distance)

    def _end(self, node: str, key: tuple[str, int, str], h: int, ts: float, reason: str,
             end_reason: str | None = None) -> None:
        _, group, medium = key
        first_ts = self.held[key].pop(h)[1]
        self.end_reasons[(node, group, medium, end_reason or reason)] += 1
        self.ended[(*key, h)] = (ts, end_reason or reason)
        self.lifetimes[(node, self.epoch[node], group, medium, reason)] += 1
        self.lifetime_s[(node, self.epoch[node], group, medium, reason)] += ts - first_ts
        if reason == "evicted":
            self.evicted_s[(group, medium)].append(ts - first_ts)

    def _clear(self, node: str, ts: float, mediums: tuple[str, ...], end_reason: str = "cleared") -> None:
        for key in [k for k in self.held if k[0] == node and k[2] in mediums]:
            for h in list(self.held[key]):
                self._end(node, key, h, ts, "cleared", end_reason)

    def step(self, node: str, epoch: int, ts: float, events: list[Event]) -> None:
        if node in self.epoch and epoch > self.epoch[node]:
            self._clear(node, ts, ("GPU", "CPU"), "epoch_change")
        self.epoch[node] = epoch
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.events[(node, -1, "", "cleared")] += 1
                self._clear(node, ts, ("GPU",))
                continue
            key = (node, ev.group_idx, ev.medium)
            kind = "stored" if isinstance(ev, BlockStored) else "removed"
            self.events[(node, ev.group_idx, ev.medium, kind)] += 1
            self.blocks[(node, ev.group_idx, ev.medium, kind)] += len(ev.block_hashes)
            held = self.held[key]
            for h in ev.block_hashes:
                if kind == "stored":
                    history = self.store_history[key]
                    if h not in held and (*key, h) in self.ended:
                        end_ts, why = self.ended.pop((*key, h))
                        last = len(history) - 1 - history[::-1].index(h)
                        self.restores.append((node, ev.group_idx, ev.medium, h, ts - end_ts, why,
                                              len(set(history[last + 1:]))))
                    history.append(h)
                    held.setdefault(h, [0, ts])[0] += 1
                elif h in held:
                    held[h][0] -= 1
                    if held[h][0] == 0:
                        self._end(node, key, h, ts, "evicted")

    def evicted_blocks(self, group: int, medium: str) -> int:
        return sum(n for (_, g, m, kind), n in self.blocks.items() if kind == "removed" and g == group and m == medium)

    def mediums(self) -> list[str]:
        return sorted({m for (_, _, m, kind) in self.blocks if kind == "removed"})


class Clock:
    """Node timestamps: whole seconds from a base in the recent past, `step_s` per step."""

    def __init__(self, step_s: float = 1.0) -> None:
        self.step_s = step_s
        self.now = float(int(time.time()) - 3600)

    def tick(self) -> float:
        self.now += self.step_s
        return self.now


class SimNode:
    """One serving node: a real Publisher (per epoch) and the model fed with what it publishes."""

    def __init__(self, session: "AnalyticsSession", model: RowModel, clock: Clock, node_id: str, epoch: int = 1) -> None:
        self.session, self.model, self.clock, self.node_id = session, model, clock, node_id
        self.epoch = epoch
        self.pub = session.publisher(node_id, epoch)
        self.messages = 0

    def step(self, *events: Event) -> None:
        ts = self.clock.tick()
        assert self.pub.publish(list(events), ts=ts), f"{self.node_id}: publisher dropped a step"
        self.model.step(self.node_id, self.epoch, ts, list(events))
        self.messages += 1

    def restart(self) -> None:
        """The serving process restarts: a new publisher with a new epoch (the old cache is gone)."""
        self.pub.close()
        self.epoch += 1
        self.pub = self.session.publisher(self.node_id, self.epoch)

    def close(self) -> None:
        self.pub.close()


class AnalyticsSession:
    """Unique topics + the KVPIPE_* settings of one analytics app (and of a routing app beside it)."""

    def __init__(self, bootstrap: str, tmp: Path, partitions: int = 2, **extra: str) -> None:
        self.bootstrap, self.tmp, self.partitions = bootstrap, tmp, partitions
        self.topics = ProcessorTopics(bootstrap, "ana", partitions)
        self.events, self.dlq, self.snapshots = self.topics.events, self.topics.dlq, self.topics.snapshots
        self.env = self.topics.env(f"kvpipe-idx-{self.topics.tag}", free_port(), str(tmp / "state"),
                                   KVPIPE_ANALYTICS_ID=f"kvpipe-ana-{self.topics.tag}",
                                   KVPIPE_ANALYTICS_WEB_PORT=str(free_port()),
                                   KVPIPE_NODE_TTL_S="3600", KVPIPE_ANALYTICS_FLUSH_S="0.2",
                                   KVPIPE_SNAPSHOT_EVERY_S="3600", **extra)
        self.processes: list[ProcessorProcess] = []

    def analytics(self, snapshot_every_s: float, pythonpath: list[str] | None = None) -> ProcessorProcess:
        """A started `kvpipe analytics` worker (`pythonpath`: e.g. a test-only sitecustomize)."""
        env = {**self.env, "KVPIPE_SNAPSHOT_EVERY_S": str(snapshot_every_s)}
        proc = ProcessorProcess(env, self.tmp / "analytics.log", command="analytics", pythonpath=pythonpath).start()
        self.processes.append(proc)
        return proc

    def processor(self, snapshot_every_s: float = 3600) -> ProcessorProcess:
        """A started routing index app (`kvpipe processor`) on the same topic, its own group."""
        env = {**self.env, "KVPIPE_SNAPSHOT_EVERY_S": str(snapshot_every_s)}
        proc = ProcessorProcess(env, self.tmp / "processor.log").start()
        self.processes.append(proc)
        return proc

    def publisher(self, node_id: str, epoch: int) -> Publisher:
        settings = load_settings(overrides={"kafka_bootstrap": self.bootstrap, "events_topic": self.events,
                                            "heartbeat_s": 3600.0})  # no heartbeats: message counts are exact
        return Publisher(settings, node_id, group_specs=SPECS, epoch=epoch, model="test-model")

    def end_offsets(self) -> dict[int, int]:
        return self.topics.end_offsets()

    def close(self) -> None:
        for proc in self.processes:
            proc.stop()
        self.topics.delete()


def wait_written(proc: ProcessorProcess, end_offsets: dict[int, int], timeout: float = 60.0,
                 errors_allowed: bool = False) -> dict:
    """Wait until the analytics app applied everything up to `end_offsets` AND the store
    acknowledged every row those messages produced; returns /stats. The agent submits a message's
    rows in the same loop turn that advances its offset, so once /stats shows the offset, the rows
    are queued."""
    stats = proc.wait_offsets(end_offsets, timeout)
    deadline = time.monotonic() + timeout
    while True:
        sink = stats["sink"]
        assert errors_allowed or sink["errors"] == 0, sink["last_error"]
        if sink["unwritten_rows"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"sink did not flush: {sink}")
        time.sleep(0.1)
        stats = proc.get("/stats")


def sql(proc: ProcessorProcess, statement: str, params: dict[str, Any] | None = None) -> list[dict]:
    """Rows of a read-only statement run by the analytics app (which owns the chDB store)."""
    body: dict[str, Any] = {"sql": statement}
    if params:
        body["params"] = params
    status, answer = proc.post("/sql", body, timeout=60)
    assert status == 200, f"/sql answered {status}: {answer}"
    return [dict(zip(answer["columns"], row)) for row in answer["rows"]]


def saved(proc: ProcessorProcess, name: str, params: dict[str, Any] | None = None) -> list[dict]:
    """A saved query (infra/clickhouse/queries) run through /sql, parameters bound server-side."""
    from kvpipe.processors.analytics.saved import load_query

    query = load_query(name)
    return sql(proc, query.sql, query.bind(params))
