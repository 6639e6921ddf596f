"""In-memory stand-ins for the forwarder's collaborators (pure-logic tests only; the integration
tests use the real Publisher, broker and ZMQ)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvpipe.producer.bridge.replay import Replayed, ReplayResult
from kvpipe.schemas.codec import encode_vllm_batch
from kvpipe.schemas.events import BlockStored


@dataclass
class Sent:
    payload: bytes
    upstream_seq: int | None
    lost_batches: int
    layout: str
    num_events: int
    epoch: int


@dataclass
class RecordingPublisher:
    sent: list[Sent] = field(default_factory=list)
    epoch: int = 1
    specs: list = field(default_factory=list)
    accept: bool = True
    spec_mismatches: int = 0

    def publish_raw(self, payload, *, num_events, ts, layout="map", upstream_seq=None, lost_batches=0, dp_rank=None):
        if self.accept:
            self.sent.append(Sent(payload, upstream_seq, lost_batches, layout, num_events, self.epoch))
        return self.accept

    def new_epoch(self, epoch=None):
        self.epoch = epoch if epoch is not None else self.epoch + 1
        return self.epoch

    def set_group_specs(self, specs, hash_config=None):
        self.specs.append((specs, hash_config))

    def set_spec_mismatches(self, count):
        self.spec_mismatches = count

    def close(self, timeout=0.0):
        pass

    def seqs(self) -> list[int | None]:
        return [s.upstream_seq for s in self.sent]


@dataclass
class ListDeadLetters:
    letters: list[tuple[str, list[bytes], str]] = field(default_factory=list)

    def send(self, node_id, frames, reason):
        self.letters.append((node_id, frames, reason))
        return True


class RingReplay:
    """vLLM's ring: the last `size` payloads; `timeout_after` simulates a hang after N replies."""

    def __init__(self, size: int = 100) -> None:
        self.size = size
        self.ring: list[tuple[int, bytes]] = []
        self.requests: list[tuple[int, int]] = []
        self.timeout_after: int | None = None

    def add(self, seq: int, payload: bytes) -> None:
        self.ring = (self.ring + [(seq, payload)])[-self.size:]

    def fetch(self, start, stop):
        self.requests.append((start, stop))
        result = ReplayResult()
        for seq, payload in self.ring:
            if start <= seq < stop:
                if self.timeout_after is not None and len(result.batches) >= self.timeout_after:
                    result.timed_out = True
                    break
                result.batches.append(Replayed(seq, payload, [b"", seq.to_bytes(8, "big"), payload]))
        return result


def payload(seq: int, *, hashes=None, layout: str = "map") -> bytes:
    ev = BlockStored(block_hashes=hashes or [seq + 1000], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                     block_size=4, lora_id=None, medium="GPU", lora_name=None, group_idx=0,
                     kv_cache_spec_kind="full_attention")
    return encode_vllm_batch([ev], ts=float(seq), dp_rank=0, layout=layout)


def frames(seq: int, data: bytes, topic: bytes = b"kv") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), data]
