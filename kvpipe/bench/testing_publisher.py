"""A vLLM-like KV event publisher for tests and the benchmark, written from docs/vllm-behaviour.md §2.

`TestingPublisher` behaves like vLLM's `ZmqEventPublisher` where a subscriber can tell:
- a PUB socket (HWM `hwm`), bound or connected by vLLM's endpoint rule, and a ROUTER replay socket,
  always bound; data-parallel rank r uses TCP port + r (port 0 unchanged) and inproc suffix `_dp{r}`;
- live messages `[topic, seq8, payload]`, seq from 0 per incarnation, one per batch;
- a ring of the last `buffer_steps` (seq, payload); a replay request `[id, b"", start8]` gets every
  ring entry with seq >= start as `[id, b"", topic, seq8, payload]` and the end marker
  `[id, b"", b"", ff×8, b""]` (`legacy_replay=True`: the pre-0.26 frames without the topic);
  requests of any other shape get no reply at all;
- one background thread does both, replay first, like vLLM's.

Test controls that vLLM does not have: `drop(seq, …)` keeps chosen batches off the live path (they
still enter the ring), `send_frames` injects arbitrary messages without consuming a seq,
`restart()` starts a new incarnation (seq back to 0, empty ring; the sockets stay, which a
subscriber cannot tell from a fast restart), and `replay_mute` reads replay requests without
answering (a hung node). `tcp://*:0` binds loopback (vLLM binds the node IP); see `.endpoint`.

`CacheSim` generates plausible event batches and tracks the node's true cache content, so an
end-to-end test can compare the processor's index with it.
"""
from __future__ import annotations

import queue
import random
import socket
import threading
import time
from collections import deque
from itertools import count

import zmq
import zmq.utils.monitor

from kvpipe.producer.bridge.subscriber import offset_endpoint, vllm_binds
from kvpipe.schemas.codec import LAYOUT_MAP, encode_vllm_batch
from kvpipe.schemas.envelope import KIND_SLIDING, GroupSpec
from kvpipe.schemas.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Event

END_SEQ = b"\xff" * 8


def free_port_range(n: int = 1, host: str = "127.0.0.1") -> int:
    """A base port such that base .. base+n-1 are free right now (for DP port offsets)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            held = []
            for p in range(base, base + n):
                t = socket.socket()
                held.append(t)
                t.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for t in held:
                t.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    if endpoint == "tcp://*:0":
        sock.bind("tcp://127.0.0.1:*")
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.bind(endpoint)
    return endpoint


class TestingPublisher:
    __test__ = False  # not a pytest test class

    def __init__(
        self,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        *,
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        topic: str = "",
        legacy_replay: bool = False,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.dp_rank = dp_rank
        self.topic = topic.encode()
        self.legacy_replay = legacy_replay
        self.replay_mute = False
        self._ctx = ctx or zmq.Context.instance()
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue = queue.Queue()
        self._drop: set[int] = set()
        self._lock = threading.Lock()
        self._seq = count()
        self.sent = 0  # batches that went out on the live path
        self.replay_requests = 0

        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._monitor = self._pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            endpoint = offset_endpoint(endpoint, dp_rank)
            if vllm_binds(endpoint):
                self.endpoint = _bind(self._pub, endpoint)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, offset_endpoint(replay_endpoint, dp_rank))
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name=f"testing-publisher-dp{dp_rank}", daemon=True)
        self._thread.start()

    # -- the test's side -------------------------------------------------------------------------

    def wait_for_subscriber(self, timeout: float = 5.0) -> None:
        """Block until a peer completed the ZMQ handshake, plus a moment for its subscription."""
        if not self._monitor.poll(timeout * 1000):
            raise TimeoutError(f"no subscriber connected to {self.endpoint} within {timeout}s")
        zmq.utils.monitor.recv_monitor_message(self._monitor)
        time.sleep(0.1)  # the SUBSCRIBE message follows the handshake

    def publish(self, events: list[Event], *, ts: float | None = None, layout: str = LAYOUT_MAP) -> int:
        """Queue one batch; returns its seq. The payload is encoded like vLLM's (dp rank filled)."""
        payload = encode_vllm_batch(events, time.time() if ts is None else ts, self.dp_rank, layout)
        return self.publish_payload(payload)

    def publish_payload(self, payload: bytes) -> int:
        """Queue pre-encoded (or deliberately broken) payload bytes as the next batch."""
        with self._lock:
            seq = next(self._seq)
            # Decided now, not in the thread, so a later restart() cannot change it.
            self._queue.put(("batch", seq, payload, seq not in self._drop))
        return seq

    def send_frames(self, frames: list[bytes]) -> None:
        """Put an arbitrary message on the PUB socket (no seq consumed, not in the ring)."""
        self._queue.put(("frames", 0, frames, True))

    def drop(self, *seqs: int) -> None:
        """Keep these seqs off the live path; they still enter the replay ring."""
        with self._lock:
            self._drop.update(seqs)

    def restart(self) -> None:
        """A new incarnation: seq from 0 again, empty ring (queued batches go out first)."""
        with self._lock:
            self._seq = count()
            self._drop.clear()
            self._queue.put(("restart", 0, None, False))

    def wait_sent(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self._queue.unfinished_tasks} batches still queued after {timeout}s")
            time.sleep(0.005)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.disable_monitor()
        self._monitor.close(linger=0)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def __enter__(self) -> "TestingPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.005)
            except queue.Empty:
                continue
            if item is None:
                self._queue.task_done()
                return
            kind, seq, data, live = item
            if kind == "batch":
                if live:
                    self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), data))
                    self.sent += 1
                self._ring.append((seq, data))
            elif kind == "frames":
                self._pub.send_multipart(data)
            else:  # restart
                self._ring.clear()
            self._queue.task_done()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        request = self._replay.recv_multipart()
        self.replay_requests += 1
        if len(request) != 3 or self.replay_mute:
            return  # vLLM ignores malformed requests without a reply
        ident, _, start_bytes = request
        start = int.from_bytes(start_bytes, "big")
        head = [ident, b""] if self.legacy_replay else [ident, b"", self.topic]
        for seq, payload in self._ring:
            if seq >= start:
                self._replay.send_multipart([*head, seq.to_bytes(8, "big"), payload])
        end = [ident, b"", END_SEQ, b""] if self.legacy_replay else [ident, b"", b"", END_SEQ, b""]
        self._replay.send_multipart(end)


class CacheSim:
    """Plausible event batches for one node, and the (group_idx, hash) pairs its GPU cache holds.

    Each step stores a few chained blocks per group and evicts a few cached ones (one hash per
    `BlockRemoved`, as vLLM's block pool does). `full_fields` fills every optional 0.33 field.
    """

    def __init__(self, groups: list[GroupSpec], *, int_hashes: bool = True, seed: int = 0, full_fields: bool = False) -> None:
        self.groups = groups
        self.int_hashes = int_hashes
        self.full_fields = full_fields
        self.rng = random.Random(seed)
        self.truth: set[tuple[int, int | bytes]] = set()
        self._cached: dict[int, list[int | bytes]] = {g.group_idx: [] for g in groups}

    def _hash(self) -> int | bytes:
        return self.rng.getrandbits(64) if self.int_hashes else self.rng.randbytes(32)

    def step(self, stores: int = 3, removes: int = 1) -> list[Event]:
        events: list[Event] = []
        for g in self.groups:
            cached = self._cached[g.group_idx]
            for _ in range(min(removes, len(cached))):
                h = cached.pop(self.rng.randrange(len(cached)))
                self.truth.discard((g.group_idx, h))
                events.append(BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=g.group_idx))
            hashes = [self._hash() for _ in range(stores)]
            cached.extend(hashes)
            self.truth.update((g.group_idx, h) for h in hashes)
            # drawn before the store's own fields, as always, so a seed gives the same events
            locality = ownership = session_id = None
            lookahead: list[list[int]] | None = None
            if self.full_fields:
                locality, ownership, session_id = "LOCAL", "kvcr", f"s{self.rng.randrange(9)}"
                lookahead = [[self.rng.randrange(50_000)] for _ in hashes]
            events.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=self._hash() if self.rng.random() < 0.5 else None,
                token_ids=[self.rng.randrange(50_000) for _ in range(stores * g.block_size)],
                block_size=g.block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=None,
                extra_keys=[None] * stores, group_idx=g.group_idx, kv_cache_spec_kind=g.kind,
                kv_cache_spec_sliding_window=g.sliding_window if g.kind == KIND_SLIDING else None,
                locality=locality, ownership=ownership, session_id=session_id, lookahead_token_ids=lookahead,
            ))
        return events

    def clear(self) -> list[Event]:
        """A cache reset: one `AllBlocksCleared`."""
        self.truth.clear()
        for cached in self._cached.values():
            cached.clear()
        return [AllBlocksCleared()]

