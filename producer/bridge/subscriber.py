"""The live side of vLLM's KV-event stream: endpoints, the SUB socket, and frame checks.

vLLM's rule (`_is_bind_endpoint`): an endpoint containing `*` or `::`, or starting with `ipc://` /
`inproc://`, is bound; anything else is connected to. So the usual deployment is vLLM binding
`tcp://*:5557` and the bridge connecting to `tcp://<node>:5557`; when vLLM is given a concrete
address (`tcp://bridge-host:5557`) it connects, and the bridge must bind (`--bind`, or a wildcard
endpoint, which can only be bound). The replay ROUTER is always bound by vLLM, so the bridge
always connects to it.

A live message is exactly three frames `[topic, seq (8 bytes, big-endian, unsigned), payload]`;
anything else is malformed and goes to the DLQ without touching the sequence bookkeeping.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import zmq

SEQ_BYTES = 8
# vLLM's sizing: PUB HWM defaults to 100 000 batches; match it on our side so a slow moment of
# the bridge queues in ZMQ instead of dropping (which would cost a replay).
DEFAULT_RCVHWM = 100_000

_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


class MalformedFrames(ValueError):
    """A ZMQ message that is not `[topic, seq8, payload]`; `reason` is short and countable."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LiveMessage(NamedTuple):
    topic: bytes
    seq: int
    payload: bytes


def vllm_binds(endpoint: str) -> bool:
    """Whether vLLM's publisher binds (True) or connects (False) this endpoint."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _tcp_host(endpoint: str) -> str | None:
    m = re.match(r"^tcp://(.*):(\d+|\*)$", endpoint)
    return m.group(1) if m else None


def bridge_binds(endpoint: str, force_bind: bool = False) -> bool:
    """Whether the bridge binds its SUB socket: on request, or for a wildcard (not connectable)."""
    return force_bind or _tcp_host(endpoint) in _WILDCARD_HOSTS


def offset_endpoint(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank `rank` uses, by vLLM's rule (`offset_endpoint_port`).

    Rank 0 and TCP port 0 are unchanged; TCP ports move up by the rank; inproc endpoints get the
    suffix `_dp{rank}`. vLLM rejects other transports for rank > 0, so do we.
    """
    if rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r}: a data-parallel rank needs a numeric TCP port")
        return endpoint if int(port) == 0 else f"{head}:{int(port) + rank}"
    raise ValueError(f"endpoint {endpoint!r}: data-parallel ranks need a tcp:// or inproc:// endpoint")


def split_live_frames(frames: list[bytes]) -> LiveMessage:
    """Check the frame shape of one live message; raises `MalformedFrames`."""
    if len(frames) != 3:
        raise MalformedFrames(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq, payload = frames
    if len(seq) != SEQ_BYTES:
        raise MalformedFrames(f"seq frame is {len(seq)} bytes, expected {SEQ_BYTES}")
    return LiveMessage(bytes(topic), int.from_bytes(seq, "big"), bytes(payload))


def _needs_ipv6(endpoint: str) -> bool:
    host = _tcp_host(endpoint)
    return bool(host) and (host.startswith("[") or host == "::")


def open_sub(
    ctx: zmq.Context, endpoint: str, *, bind: bool = False, topic_filter: bytes = b"", rcvhwm: int = DEFAULT_RCVHWM
) -> zmq.Socket:
    """A SUB socket on one rank's endpoint, subscribed to `topic_filter` (a prefix; b"" = all)."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, rcvhwm)
    sock.setsockopt(zmq.LINGER, 0)
    if _needs_ipv6(endpoint):
        sock.setsockopt(zmq.IPV6, 1)
    sock.setsockopt(zmq.SUBSCRIBE, topic_filter)
    if bridge_binds(endpoint, bind):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock
