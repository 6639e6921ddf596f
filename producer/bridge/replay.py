"""Asking vLLM's replay ROUTER for missed batches.

Protocol (docs/vllm-behaviour.md §2.3): the request is one 8-byte big-endian start seq; the ROUTER answers
with every batch still in its ring whose seq >= start, oldest first, as `[topic, seq8, payload]`,
then the end marker `[b"", ff×8, b""]`. Releases before 0.26 sent no topic frame (`[seq8, payload]`,
end `[ff×8, b""]`). A request of the wrong shape gets no answer at all, and what fell out of the
ring is silently absent — so the client needs a deadline, and the caller decides what is lost.

We use a DEALER, not a REQ: a REQ socket accepts exactly one reply message per request, while the
ROUTER streams many. The DEALER sees vLLM's empty delimiter frame first and strips it. After a
timeout the socket is thrown away and reopened, so late replies to an abandoned request can never
be mistaken for replies to the next one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

from kvpipe.producer.bridge.subscriber import SEQ_BYTES, MalformedFrames

END_SEQ = b"\xff" * SEQ_BYTES
DEFAULT_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class Replayed:
    seq: int
    payload: bytes
    frames: list[bytes]  # as received (minus the delimiter), for the DLQ if the payload is bad


@dataclass(slots=True)
class ReplayResult:
    batches: list[Replayed] = field(default_factory=list)  # seqs in [start, stop), ascending
    malformed: list[tuple[list[bytes], str]] = field(default_factory=list)
    timed_out: bool = False


def parse_reply(frames: list[bytes]) -> Replayed | None:
    """One replay reply as a DEALER receives it; None for the end marker.

    Accepts `[b"", topic, seq, payload]` (>= 0.26) and `[b"", seq, payload]` (< 0.26); the
    delimiter is optional so that a client which already stripped it can use this too.
    """
    body = frames[1:] if len(frames) in (3, 4) and frames[0] == b"" else frames
    if len(body) == 3:
        seq_frame, payload = body[1], body[2]
    elif len(body) == 2:
        seq_frame, payload = body[0], body[1]
    else:
        raise MalformedFrames(f"replay reply has {len(frames)} frames, expected [topic,] seq, payload")
    if len(seq_frame) != SEQ_BYTES:
        raise MalformedFrames(f"replay seq frame is {len(seq_frame)} bytes, expected {SEQ_BYTES}")
    if seq_frame == END_SEQ:
        return None
    return Replayed(int.from_bytes(seq_frame, "big"), bytes(payload), [bytes(f) for f in body])


class ReplayClient:
    """Fetches a seq range from one vLLM replay endpoint. Not thread-safe (one per rank)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._ctx = ctx
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            # vLLM can answer with a whole ring (10 000 batches by default): never drop replies.
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def fetch(self, start: int, stop: int) -> ReplayResult:
        """The batches with `start <= seq < stop` the ring still holds, ascending.

        Reads until the end marker (replies past `stop` are discarded; they also arrive live).
        On timeout returns what arrived so far with `timed_out=True`.
        """
        result = ReplayResult()
        sock = self._socket()
        sock.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
        deadline = time.monotonic() + self.timeout_s
        last = start - 1
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not sock.poll(remaining_ms):
                result.timed_out = True
                self._reset()
                return result
            frames = sock.recv_multipart()
            try:
                item = parse_reply(frames)
            except MalformedFrames as exc:
                result.malformed.append((frames, exc.reason))
                continue
            if item is None:
                return result
            # The ring is in order; anything else (a duplicate, a wrap) is not ours to forward.
            if start <= item.seq < stop and item.seq > last:
                result.batches.append(item)
                last = item.seq

    def close(self) -> None:
        self._reset()
