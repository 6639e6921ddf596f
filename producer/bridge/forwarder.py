"""Per-rank forwarding: vLLM seq bookkeeping, gap repair, loss accounting, restarts.

Pure logic over three collaborators — the Kafka publisher, the dead-letter sink and the replay
client — so every rule below is tested without sockets. One `Forwarder` per data-parallel rank,
driven by that rank's thread only.

Rules (vLLM numbers batches 0, 1, 2, … per publisher process, docs/vllm-behaviour.md §2.2):
- `expected` is the next vLLM seq we need; it starts at 0, so a bridge that joins a running node
  first tries to fetch the node's history from the replay ring.
- seq > expected: a gap. Ask the replay ring for [expected, seq), forward what it returns in
  order, then the live batch. Whatever the ring no longer holds (or a timed-out replay did not
  deliver) is a real loss: the next envelope that reaches Kafka carries `lost_batches=N`, which
  makes the processor mark the node suspect.
- seq < expected: vLLM restarted (its counter went back). Its cache is gone: new epoch.
  A restart the counter does not show (the new process got past `expected` before we
  reconnected) is caught after a disconnect: the ring's copy of the last batch we forwarded must
  be byte-identical to ours (a new process cannot reproduce it: the batch carries a float
  timestamp); if it differs, it is a new incarnation. If the ring no longer has it, we cannot
  tell and treat the jump as a gap (counted lost, so the node is suspect anyway).
  Replies from the ring past the live seq are dropped, so a seq below `expected` on the live path
  is never a replay duplicate.
- A malformed message (frame shape, or a payload that does not decode) goes to the DLQ with a
  reason. An undecodable payload with a valid seq at or past `expected` still consumed that seq
  upstream, so it is counted lost; one behind `expected` is not taken as a restart (garbage must
  not end an epoch).
"""
from __future__ import annotations

import logging
from typing import Protocol

from kvpipe.producer.bridge.dlq import DeadLetters
from kvpipe.producer.bridge.metrics import Counters
from kvpipe.producer.bridge.replay import ReplayResult
from kvpipe.producer.bridge.specs import SpecTracker
from kvpipe.producer.bridge.subscriber import MalformedFrames, split_live_frames
from kvpipe.schemas.codec import DEFAULT_MAX_BYTES, DecodeError, decode_vllm_batch, hex_excerpt
from kvpipe.schemas.envelope import GroupSpec, HashConfig
from kvpipe.schemas.events import KVEventBatch

log = logging.getLogger("kvpipe.bridge")

_REASON_LIMIT = 400  # header bytes; the payload itself rides in the DLQ value


class PublisherLike(Protocol):
    def publish_raw(self, payload: bytes, *, num_events: int, ts: float, layout: str = "map",
                    upstream_seq: int | None = None, lost_batches: int = 0, dp_rank: int | None = None) -> bool: ...
    def new_epoch(self, epoch: int | None = None) -> int: ...
    def set_group_specs(self, specs: list[GroupSpec], hash_config: HashConfig | None = None) -> None: ...
    def close(self, timeout: float = ...) -> None: ...


class ReplayLike(Protocol):
    def fetch(self, start: int, stop: int) -> ReplayResult: ...


class Forwarder:
    def __init__(
        self,
        node_id: str,
        publisher: PublisherLike,
        dead_letters: DeadLetters,
        *,
        replay: ReplayLike | None = None,
        specs: SpecTracker | None = None,
        counters: Counters | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.node_id = node_id
        self.publisher = publisher
        self.dead_letters = dead_letters
        self.replay = replay
        self.specs = specs or SpecTracker(node_id=node_id)
        self.counters = counters or Counters()
        self.max_bytes = max_bytes
        self.expected = 0  # next vLLM seq wanted
        self.pending_lost = 0  # batches lost since the last envelope that reached the publisher
        self._last: tuple[int, bytes] | None = None  # (seq, payload) last handed to the publisher
        self._reconnected = False

    # -- entry points ----------------------------------------------------------------------------

    def on_frames(self, frames: list[bytes]) -> None:
        """One live ZMQ message."""
        try:
            msg = split_live_frames(frames)
        except MalformedFrames as exc:
            self._malformed(frames, f"malformed_frames: {exc.reason}")
            return
        self.on_message(msg.seq, msg.payload, frames)

    def peer_disconnected(self) -> None:
        """The SUB lost its connection: vLLM may come back as a new process."""
        self._reconnected = True

    def on_message(self, seq: int, payload: bytes, frames: list[bytes]) -> None:
        decoded = self._decode(seq, payload, frames)
        if self._reconnected and decoded is not None:
            self._reconnected = False
            if seq >= self.expected and self._is_new_incarnation():
                self._restart(f"after a reconnect, the replay ring's copy of seq {self.expected - 1} differs from ours")
        if decoded is None:
            if seq >= self.expected:
                self._catch_up(seq)
                self._lose(1)
                self.expected = seq + 1
            return
        if seq < self.expected:
            self._restart(f"vLLM seq went back from {self.expected - 1} to {seq}")
        if seq > self.expected:
            self._catch_up(seq)
        self._forward(seq, payload, *decoded)
        self.expected = seq + 1

    # -- steps -----------------------------------------------------------------------------------

    def _catch_up(self, seq: int) -> None:
        """Close the gap [expected, seq) from the replay ring; count the rest as lost."""
        start = self.expected
        self.counters.gaps += 1
        if self.replay is None:
            log.warning("node %s: vLLM seqs %d..%d missing and no replay endpoint: %d batches lost",
                        self.node_id, start, seq - 1, seq - start)
            self._lose(seq - start)
            return
        result = self.replay.fetch(start, seq)
        for frames, reason in result.malformed:
            self._malformed(frames, f"malformed_replay_frames: {reason}")
        cursor = start
        for item in result.batches:
            self._lose(item.seq - cursor)
            decoded = self._decode(item.seq, item.payload, item.frames)
            if decoded is None:
                self._lose(1)
            else:
                self._forward(item.seq, item.payload, *decoded)
                self.counters.replayed += 1
            cursor = item.seq + 1
        missing = seq - cursor
        self._lose(missing)
        if result.timed_out:
            self.counters.replay_timeouts += 1
        if missing or result.timed_out or len(result.batches) < seq - start:
            log.warning("node %s: gap %d..%d: replay returned %d batches%s; %d lost so far",
                        self.node_id, start, seq - 1, len(result.batches),
                        " before timing out" if result.timed_out else "", self.counters.lost)
        self.expected = seq

    def _is_new_incarnation(self) -> bool:
        if self._last is None or self.replay is None:
            return False
        last_seq, last_payload = self._last
        result = self.replay.fetch(last_seq, last_seq + 1)
        return bool(result.batches) and result.batches[0].payload != last_payload

    def _restart(self, why: str) -> None:
        self.counters.restarts += 1
        epoch = self.publisher.new_epoch()
        log.warning("node %s: vLLM publisher restarted (%s): new epoch %d", self.node_id, why, epoch)
        self.specs.reset()
        specs = self.specs.group_specs()
        if specs is not None or self.specs.hash_config is not None:
            self.publisher.set_group_specs(specs or [], self.specs.hash_config)
        self.expected = 0
        self.pending_lost = 0  # losses of the old incarnation died with its cache
        self._last = None

    def _forward(self, seq: int, payload: bytes, batch: KVEventBatch, layout: str) -> None:
        if self.specs.observe(batch.events):
            if self.counters.spec_mismatches != len(self.specs.mismatches):
                self.counters.spec_mismatches = len(self.specs.mismatches)
                # the processor shows it in /nodes: operators see it without reading bridge logs
                self.publisher.set_spec_mismatches(self.counters.spec_mismatches)
            self.publisher.set_group_specs(self.specs.group_specs() or [], self.specs.hash_config)
        n = len(batch.events)
        ok = self.publisher.publish_raw(
            payload, num_events=n, ts=batch.ts, layout=layout, upstream_seq=seq,
            lost_batches=self.pending_lost, dp_rank=batch.data_parallel_rank,
        )
        if ok:
            self._last = (seq, payload)
            self.pending_lost = 0
            self.counters.batches += 1
            self.counters.events += n
        else:
            # The publisher reports the drop itself (`dropped` on its next envelope); we keep
            # our pending loss for the next batch that gets through.
            self.counters.publish_rejected += 1

    def _decode(self, seq: int, payload: bytes, frames: list[bytes]) -> tuple[KVEventBatch, str] | None:
        try:
            return decode_vllm_batch(payload, self.max_bytes)
        except DecodeError as exc:
            self._malformed(frames, f"undecodable_payload: vLLM seq {seq}: {exc}")
            return None

    def _lose(self, n: int) -> None:
        if n > 0:
            self.pending_lost += n
            self.counters.lost += n

    def _malformed(self, frames: list[bytes], reason: str) -> None:
        c = self.counters
        c.malformed += 1
        reason = reason[:_REASON_LIMIT]
        if c.malformed <= 10 or c.malformed % 1000 == 0:  # a garbage flood must not flood the log
            log.warning("node %s: malformed message #%d to the DLQ: %s [%d frames, last: %s]", self.node_id,
                        c.malformed, reason, len(frames), hex_excerpt(frames[-1] if frames else b"", 16))
        if self.dead_letters.send(self.node_id, frames, reason):
            c.dlq += 1
        else:
            c.dlq_failed += 1
