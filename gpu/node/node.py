"""One simulated serving node: workload -> scheduler -> KV compute/offload -> events -> sink.

`Node.step()` is one engine step; its events (GPU pool first, then the CPU tier's — vLLM's
order) go to the sink in one non-blocking `publish` call, only when there are any. The sink is
the Kafka `Publisher`, or anything with the same `publish`/`new_epoch` (a capture list in tests,
a counter for `--no-publish`).

Restart (`restart()`): a new epoch first, then a fresh cache — new manager, zeroed tensors,
emptied CPU tier — and no events about the old cache: consumers drop a node's entries when its
epoch grows. In-flight requests are lost (a crashed server's clients see errors); their
conversations continue as if they had finished.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpipe.gpu.hashing import BlockHasher, coarse_hashes, external_hash, hash_request_blocks
from kvpipe.gpu.kv_cache_manager import KVCacheManager
from kvpipe.gpu.node.kv_compute import KVCompute, ModelShape
from kvpipe.gpu.node.offload_driver import OffloadDriver
from kvpipe.gpu.node.scheduler import Scheduler, StepResult
from kvpipe.gpu.node.workload import Workload
from kvpipe.gpu.specs import KVSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored


class EventSink(Protocol):
    def publish(self, events: list[Any], ts: float | None = None) -> bool: ...

    def new_epoch(self) -> int: ...


class CountingSink:
    """`--no-publish`: accept and forget (the node still counts what it would have sent)."""

    def __init__(self) -> None:
        self.batches = 0
        self.epoch = 0

    def publish(self, events: list[Any], ts: float | None = None) -> bool:
        self.batches += 1
        return True

    def new_epoch(self) -> int:
        self.epoch += 1
        return self.epoch


class CaptureSink(CountingSink):
    """Keeps every batch as `(epoch, events)` — the test hook for replaying the stream."""

    def __init__(self) -> None:
        super().__init__()
        self.captured: list[tuple[int, list[Any]]] = []

    def publish(self, events: list[Any], ts: float | None = None) -> bool:
        self.captured.append((self.epoch, list(events)))
        return super().publish(events, ts)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    node_id: str = "node-0"
    specs: tuple[KVSpec, ...] = ()
    gpu_blocks: int = 512
    cpu_chunks: int = 1024  # 0: no CPU tier
    blocks_per_chunk: int = 1
    cpu_policy: str = "lru"
    hash_algorithm: str = "sha256"
    retention: int | None = 0
    prefix_match_unit: int | None = None  # explicit hash unit below the gcd (vLLM --prefix-match-unit)
    eagle_groups: tuple[int, ...] = ()  # groups serving an EAGLE draft (their hits drop one block)
    token_budget: int = 256
    max_running: int = 16
    shape: ModelShape = field(default_factory=ModelShape)
    device: str = "cpu"  # where the KV tensors live; "cuda" runs the offload on side streams, pinned host memory


@dataclass(slots=True)
class EventCounts:
    by_type: Counter = field(default_factory=Counter)
    by_group: Counter = field(default_factory=Counter)
    by_medium: Counter = field(default_factory=Counter)
    hashes: Counter = field(default_factory=Counter)  # block hashes carried, by type
    batches: int = 0
    published_false: int = 0

    def add(self, events: Sequence[Any]) -> None:
        for ev in events:
            name = type(ev).__name__
            self.by_type[name] += 1
            if isinstance(ev, (BlockStored, BlockRemoved)):
                self.by_group[str(ev.group_idx)] += 1
                self.by_medium[str(ev.medium)] += 1
                self.hashes[name] += len(ev.block_hashes)


class Node:
    def __init__(self, config: NodeConfig, workload: Workload, sink: EventSink) -> None:
        if not config.specs:
            raise ValueError(f"node {config.node_id}: no KV cache groups configured")
        self.config = config
        self.workload = workload
        self.sink = sink
        self.hasher = BlockHasher(config.hash_algorithm)
        self.events = EventCounts()
        self.step_no = 0
        self.epochs = 1
        self.aborted = 0
        self.stop_requested = False  # set from a signal handler: the loop ends after the current step
        self._retired: list[Any] = []  # stats of cache incarnations before a restart
        self._build()

    def _build(self) -> None:
        c = self.config
        self.manager = KVCacheManager(c.specs, c.gpu_blocks, retention=c.retention, hasher=self.hasher,
                                      prefix_match_unit=c.prefix_match_unit, eagle_groups=c.eagle_groups)
        self.kv = KVCompute(c.specs, c.gpu_blocks, c.shape, device=c.device)
        self.offload = (OffloadDriver(self.manager, self.kv, c.cpu_chunks, c.blocks_per_chunk, c.cpu_policy)
                        if c.cpu_chunks > 0 else None)
        self.scheduler = Scheduler(self.manager, self.kv, self.offload, token_budget=c.token_budget,
                                   max_running=c.max_running)

    # -- what the publisher needs ------------------------------------------------------------------

    def group_specs(self) -> list:
        return self.manager.group_specs()

    def hash_config(self) -> Any:
        cfg = self.hasher.hash_config(self.manager.hash_block_size, int_hashes=True)
        if self.config.prefix_match_unit is not None and len(self.manager.specs) > 1:
            cfg.prefix_match_unit = self.manager.hash_block_size
        return cfg

    # -- the loop ----------------------------------------------------------------------------------

    def step(self) -> StepResult:
        for spec in self.workload.arrivals(self.step_no):
            self.scheduler.add(spec)
        result = self.scheduler.step(self.step_no)
        set_load = getattr(self.sink, "set_load", None)  # the Publisher's; a capture sink has none
        if set_load is not None:  # what the router's score reads (processors/router/decide.py)
            sched = self.scheduler
            set_load(len(sched.running), len(sched.waiting), round(self.manager.usage, 4))
        events = self.manager.take_events()
        if self.offload is not None:
            events += self.offload.take_events()
        if events:
            self.events.add(events)
            self.events.batches += 1
            if not self.sink.publish(events, time.time()):
                self.events.published_false += 1
        for st in result.finished:
            self.workload.on_finished(st.spec, self.step_no)
        self.step_no += 1
        return result

    def restart(self) -> None:
        """New epoch, empty cache, no events about the old one (see module docstring)."""
        self.sink.new_epoch()
        self.epochs += 1
        self._retired.append((self.scheduler.stats, self.offload.stats if self.offload else None))
        for st in self.scheduler.drop_all():
            self.aborted += 1
            self.workload.on_finished(st.spec, self.step_no)
        self.manager.take_events()  # whatever the old pool still queued dies with it
        self._build()

    def run(self, steps: int | None = None, duration: float | None = None, rate: float = 0.0,
            restart_at: int | None = None, progress: Any = None) -> float:
        """Run until `steps` steps or `duration` seconds; `rate` steps/s (0 = flat out).
        Returns the elapsed wall time."""
        start = time.monotonic()
        period = 1.0 / rate if rate > 0 else 0.0
        while not self.stop_requested:
            if steps is not None and self.step_no >= steps:
                break
            if duration is not None and time.monotonic() - start >= duration:
                break
            if restart_at is not None and self.step_no == restart_at:
                self.restart()
            self.step()
            if progress is not None and self.step_no % 100 == 0:
                progress(self)
            if period:
                delay = start + self.step_no * period - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
        return time.monotonic() - start

    # -- reporting ---------------------------------------------------------------------------------

    def _sum(self, field_names: Sequence[str], current: Any, idx: int) -> dict[str, int]:
        parts = [r[idx] for r in self._retired if r[idx] is not None] + ([current] if current else [])
        return {f: sum(getattr(p, f) for p in parts) for f in field_names}

    def summary(self, elapsed: float, publisher: Any = None) -> dict[str, Any]:
        s = self.scheduler.stats
        sched = self._sum(s.__slots__, s, 0)  # type: ignore[attr-defined]
        off = None
        if self.offload is not None:
            o = self.offload.stats
            off = self._sum(o.__slots__, o, 1)  # type: ignore[attr-defined]
        return {
            "node_id": self.config.node_id,
            "steps": self.step_no,
            "elapsed_s": round(elapsed, 3),
            "steps_per_s": round(self.step_no / elapsed, 1) if elapsed > 0 else None,
            "epochs": self.epochs,
            "requests": {k: sched[k] for k in ("arrived", "admitted", "finished", "preempted", "rejected")}
                        | {"aborted_by_restart": self.aborted, "running": len(self.scheduler.running),
                           "waiting": len(self.scheduler.waiting)},
            "tokens": {k: sched[k] for k in ("prompt_tokens", "computed_tokens", "generated_tokens",
                                            "gpu_hit_tokens", "cpu_hit_tokens", "max_step_tokens")},
            "events": {"total": sum(self.events.by_type.values()), "batches": self.events.batches,
                       "by_type": dict(self.events.by_type), "by_group": dict(self.events.by_group),
                       "by_medium": dict(self.events.by_medium), "hashes_by_type": dict(self.events.hashes),
                       "publish_refused": self.events.published_false},
            "offload": off,
            "cache": {"device": str(self.kv.caches.device), "gpu_blocks": self.config.gpu_blocks, "gpu_usage": round(self.manager.usage, 3),
                      "cpu_chunks": self.config.cpu_chunks,
                      "cpu_used_chunks": (self.offload.tier.num_chunks - self.offload.tier.num_free_chunks)
                      if self.offload else 0},
            "publisher": publisher.counters() if publisher is not None else None,
        }

    def export_prefixes(self) -> list[dict[str, Any]]:
        """One entry per system prompt: `name`, `token_ids` and `block_hashes` = `{"<group_idx>":
        [hashes]}` as published (external int form, the group's own view: the last hash unit of
        each full block) — the body `/route` takes as `{"block_hashes": entry["block_hashes"]}`."""
        hbs = self.manager.hash_block_size
        out = []
        for i, tokens in enumerate(self.workload.system_prompts):
            fine = hash_request_blocks(self.hasher, tokens, hbs)
            per_group = {str(g): [external_hash(h) for h in coarse_hashes(fine, spec.block_size // hbs)]
                         for g, spec in enumerate(self.manager.specs)}
            out.append({"name": f"system-{i}", "index": i, "num_tokens": len(tokens), "token_ids": tokens,
                        "block_hashes": per_group})
        return out
