"""The running bridge: one thread per data-parallel rank, each owning its sockets and `Forwarder`.

Ranks are independent nodes, so a replay stalling one rank (up to its timeout) never holds up the
others; ZMQ queues the stalled rank's live messages meanwhile (RCVHWM, like vLLM's PUB HWM).
Sockets are created, used and closed inside their rank's thread (ZMQ sockets are not
thread-safe). A handler exception is logged and the loop goes on: one bad message must not stop
the bridge.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpipe.producer.bridge.dlq import DeadLetters
from kvpipe.producer.bridge.forwarder import Forwarder, PublisherLike
from kvpipe.producer.bridge.metrics import Counters, registry, render
from kvpipe.producer.bridge.recording import open_recording, write_frame
from kvpipe.producer.bridge.replay import DEFAULT_TIMEOUT_S, ReplayClient
from kvpipe.producer.bridge.silence import SilenceWatch
from kvpipe.producer.bridge.specs import SpecTracker
from kvpipe.producer.bridge.subscriber import offset_endpoint, open_sub
from kvpipe.schemas.codec import DEFAULT_MAX_BYTES
from kvpipe.schemas.envelope import GroupSpec, HashConfig

log = logging.getLogger("kvpipe.bridge")

_DRAIN_MAX = 1000  # messages per wake-up before the stop flag is looked at again


@dataclass
class BridgeConfig:
    zmq_endpoint: str
    replay_endpoint: str | None = None
    name: str = "vllm"
    dp_ranks: int = 1
    dp_rank_start: int = 0
    node_id_format: str = "{name}/dp{rank}"
    bind: bool = False
    topic_filter: bytes = b""
    replay_timeout_s: float = DEFAULT_TIMEOUT_S
    max_bytes: int = DEFAULT_MAX_BYTES
    # Stop reading ZMQ while the publisher holds this many batches: its queue drops when full,
    # while ZMQ (RCVHWM) and vLLM's replay ring can hold a backlog without losing anything.
    publisher_queue_limit: int = 8_000
    # Warn (log + kvpipe_bridge_silence_warnings_total) when no frame arrives this long after
    # connecting or since the last frame; 0 turns it off (kvpipe.producer.bridge.silence).
    silence_warn_s: float = 30.0

    def ranks(self) -> range:
        return range(self.dp_rank_start, self.dp_rank_start + self.dp_ranks)

    def node_id(self, rank: int) -> str:
        return self.node_id_format.format(name=self.name, rank=rank)


class RankWorker:
    """One rank: SUB (+ replay client) → handler. `forwarder` is None in record mode."""

    def __init__(self, bridge: "Bridge", rank: int) -> None:
        cfg = bridge.config
        self.rank = rank
        self.node_id = cfg.node_id(rank)
        self.endpoint = offset_endpoint(cfg.zmq_endpoint, rank)
        self.replay_endpoint = offset_endpoint(cfg.replay_endpoint, rank) if cfg.replay_endpoint else None
        self.counters = Counters()
        self.specs = SpecTracker(bridge.declared_specs, bridge.hash_config, node_id=self.node_id)
        self.publisher: PublisherLike | None = None
        self.forwarder: Forwarder | None = None
        self._record: BinaryIO | None = None
        self._bridge = bridge
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"bridge-{self.node_id}", daemon=True)

    def _run(self) -> None:
        bridge, cfg = self._bridge, self._bridge.config
        replay: ReplayClient | None = None
        try:
            sub = open_sub(bridge.ctx, self.endpoint, bind=cfg.bind, topic_filter=cfg.topic_filter)
        except BaseException as exc:  # surfaced by Bridge.start
            self._error = exc
            self._ready.set()
            return
        if bridge.record_dir is not None:
            self._record = open_recording(bridge.record_dir, f"rank{self.rank}")
            handle = self._record_frames
        else:
            assert bridge.publisher_factory is not None and bridge.dead_letters is not None
            if self.replay_endpoint:
                replay = ReplayClient(bridge.ctx, self.replay_endpoint, cfg.replay_timeout_s)
            self.publisher = bridge.publisher_factory(self.node_id, self.rank)
            self.forwarder = Forwarder(self.node_id, self.publisher, bridge.dead_letters, replay=replay,
                                       specs=self.specs, counters=self.counters, max_bytes=cfg.max_bytes)
            handle = self.forwarder.on_frames
        log.info("node %s: %s %s%s", self.node_id, "recording" if self._record else "forwarding",
                 self.endpoint, f" (replay {self.replay_endpoint})" if replay else "")
        self._ready.set()
        # Disconnects matter to the forwarder: vLLM may come back as a new process (new epoch).
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        watch = SilenceWatch(cfg.silence_warn_s, time.monotonic())
        try:
            while not bridge.stopping.is_set():
                room = self._room()
                if room <= 0:
                    time.sleep(0.001)
                    continue
                ready = dict(poller.poll(100))
                if monitor in ready:
                    recv_monitor_message(monitor)
                    if self.forwarder is not None:
                        self.forwarder.peer_disconnected()
                if sub not in ready:
                    self._check_silence(watch)
                    continue
                for _ in range(min(room, _DRAIN_MAX)):
                    try:
                        frames = sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if watch.frame(time.monotonic()):
                        log.info("node %s: frames arriving from %s", self.node_id, self.endpoint)
                    try:
                        handle(frames)
                    except Exception:
                        log.exception("node %s: unexpected error handling a message; going on", self.node_id)
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if replay is not None:
                replay.close()
            if self._record is not None:
                self._record.close()

    def _check_silence(self, watch: SilenceWatch) -> None:
        silent_s = watch.check(time.monotonic())
        if silent_s is None:
            return
        self.counters.silence_warnings += 1
        since = "since the last one" if watch.frames else ("after " + ("binding" if self._bridge.config.bind
                                                                       else "connecting"))
        log.warning("node %s: no frame from %s for %.0f s %s; is vLLM publishing KV events there "
                    "(its kv-events-config endpoint and topic, --subscribe %r)?", self.node_id, self.endpoint,
                    silent_s, since, self._bridge.config.topic_filter.decode(errors="replace"))

    def _room(self) -> int:
        """How many more messages to read before looking at the publisher's backlog again."""
        counters = getattr(self.publisher, "counters", None)
        if counters is None:
            return _DRAIN_MAX
        return self._bridge.config.publisher_queue_limit - counters()["queue_depth"]

    def _record_frames(self, frames: list[bytes]) -> None:
        assert self._record is not None
        write_frame(self._record, frames, time.time())
        self.counters.recorded += 1


class Bridge:
    """Forwards (or records) every configured rank until `stop()`."""

    def __init__(
        self,
        config: BridgeConfig,
        *,
        publisher_factory: Callable[[str, int], PublisherLike] | None = None,
        dead_letters: DeadLetters | None = None,
        declared_specs: list[GroupSpec] | None = None,
        hash_config: HashConfig | None = None,
        record_dir: str | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        if record_dir is None and (publisher_factory is None or dead_letters is None):
            raise ValueError("a forwarding bridge needs a publisher factory and a dead-letter sink")
        self.config = config
        self.publisher_factory = publisher_factory
        self.dead_letters = dead_letters
        self.declared_specs = declared_specs or []
        self.hash_config = hash_config
        self.record_dir = record_dir
        self.ctx = ctx or zmq.Context.instance()
        self.stopping = threading.Event()
        self.workers = [RankWorker(self, r) for r in config.ranks()]

    def start(self, timeout: float = 30.0) -> "Bridge":
        for w in self.workers:
            w._thread.start()
        for w in self.workers:
            if not w._ready.wait(timeout) or w._error is not None:
                self.stop()
                raise RuntimeError(f"node {w.node_id}: cannot open {w.endpoint}: {w._error}")
        return self

    def stop(self, flush_timeout: float = 10.0) -> None:
        """Stop reading, then flush and close every publisher (what was read reaches Kafka)."""
        self.stopping.set()
        for w in self.workers:
            if w._thread.is_alive():
                w._thread.join()
        for w in self.workers:
            if w.publisher is not None:
                w.publisher.close(flush_timeout)  # flushes first
        flush = getattr(self.dead_letters, "flush", None)
        if flush is not None:
            flush(flush_timeout)

    def counters(self) -> dict[str, dict[str, int]]:
        return {w.node_id: w.counters.as_dict() for w in self.workers}

    def _metric_nodes(self):
        return [(w.node_id, w.counters, w.specs.mismatches) for w in self.workers]

    def metrics_text(self) -> str:
        return render(self._metric_nodes())

    def metrics_registry(self):
        """The registry `/metrics` serves (producer/bridge/metrics.py), reading the workers at each scrape."""
        return registry(self._metric_nodes)

    def summary(self) -> str:
        total = Counters()
        for w in self.workers:
            for k, v in w.counters.as_dict().items():
                setattr(total, k, getattr(total, k) + v)
        return " ".join(f"{k}={v}" for k, v in total.as_dict().items())
