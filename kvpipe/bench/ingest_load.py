"""The workload of `kvpipe bench ingest` (kvpipe.bench.ingest): envelopes a fleet of nodes would publish,
and a publisher that sends them at a fixed rate while probes time publish → routable.

Freshness is measured under load because that is where it matters: an idle processor answers in a
few milliseconds whatever its delivery costs, a loaded one only if it keeps ahead of the stream.
"""
from __future__ import annotations

import multiprocessing
import statistics
import time
import zlib
from typing import Any, Callable

import msgspec

from kvpipe.schemas.codec import PRODUCE_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored, Event

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=128)]


class EnvelopeSource:
    """`(key, value)` envelopes of `nodes` nodes, round robin, contiguous seqs per node; each stores
    about half its events' worth of new blocks and evicts the oldest ones, so the index stays at a
    steady size. `take` continues where the last call stopped (seqs, hashes), so a later phase of
    the bench applies, it is not skipped as a duplicate."""

    def __init__(self, events_per: int, nodes: int, seed_ts: float) -> None:
        self.events_per, self.nodes, self.seed_ts = events_per, nodes, seed_ts
        self.fifo: dict[int, list[tuple[int, int]]] = {i: [] for i in range(nodes)}
        self.seqs = dict.fromkeys(range(nodes), 0)
        self.k = 0
        self.next_hash = 1 << 40

    def take(self, n: int, ts: float | None = None) -> list[tuple[bytes, bytes]]:
        """`n` more envelopes, stamped `ts` (default: spaced 0.1 ms from the seed time)."""
        out = []
        for _ in range(n):
            node = self.k % self.nodes
            fifo = self.fifo[node]
            events: list[Any] = []
            for j in range(self.events_per - self.events_per // 2):
                h = self.next_hash
                events.append(BlockStored(block_hashes=[h], parent_block_hash=h - 1, token_ids=[1] * 16,
                                          block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=j % 2))
                fifo.append((h, j % 2))
                self.next_hash += 1
            while len(events) < self.events_per and len(fifo) > 256:
                h, g = fifo.pop(0)
                events.append(BlockRemoved(block_hashes=[h], medium="GPU", group_idx=g))
            stamp = self.seed_ts + self.k * 1e-4 if ts is None else ts
            seq = self.seqs[node]
            env = Envelope(v=SCHEMA_MAJOR, node_id=f"bench-node-{node}", epoch=1, seq=seq, ts=stamp, sent_ts=stamp,
                           group_specs=SPECS if seq == 0 else None, num_events=len(events),
                           batch=msgspec.Raw(encode_vllm_batch(events, stamp)))
            self.seqs[node] = seq + 1
            self.k += 1
            out.append((env.node_id.encode(), encode_envelope(env)))
        return out


def probe_envelope(node: str, seq: int, block_hash: int) -> bytes:
    """One envelope storing one new block: what a probe publishes and then looks for in /route."""
    ts = time.time()
    events: list[Event] = [BlockStored(block_hashes=[block_hash], parent_block_hash=None, token_ids=[], block_size=16,
                                       lora_id=None, medium="GPU", lora_name=None, group_idx=0)]
    env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=seq, ts=ts, sent_ts=ts, num_events=1,
                   batch=msgspec.Raw(encode_vllm_batch(events, ts)))
    return encode_envelope(env)


class Probes:
    """Publish one probe envelope at a time and time it until /route shows its block."""

    def __init__(self, kafka_conf: dict, topic: str, routable: Callable[[int], bool], node: str = "bench-probe") -> None:
        from confluent_kafka import Producer

        self.producer = Producer({**kafka_conf, "linger.ms": 0, "acks": "all"})
        self.topic, self.routable, self.node = topic, routable, node
        self.seq = 0

    def once(self, poll_pause_s: float = 0.0005) -> float:
        """Milliseconds from handing the probe to the client to seeing it routable."""
        h = (1 << 50) + (zlib.crc32(self.node.encode()) & 0xFFFF) * (1 << 32) + self.seq  # distinct per probe node
        value = probe_envelope(self.node, self.seq, h)
        self.seq += 1
        started = time.perf_counter()
        self.producer.produce(self.topic, value=value, key=self.node.encode(), headers=PRODUCE_HEADERS)
        self.producer.flush(30)
        while not self.routable(h):
            time.sleep(poll_pause_s)
        return (time.perf_counter() - started) * 1000

    def close(self) -> None:
        self.producer.flush(30)


def publish_paced(kafka_conf: dict, topic: str, messages: list[tuple[bytes, bytes]], rate_msgs: float) -> dict:
    """Send `messages` at `rate_msgs` per second (a message is due at `start + k / rate`; late ones go
    at once, so the average rate holds); returns what was achieved."""
    from confluent_kafka import Producer

    # murmur2: aiokafka's partitioner (the prefill's), so a node's envelopes stay on one partition, in order
    producer = Producer({**kafka_conf, "linger.ms": 1, "compression.type": "lz4", "partitioner": "murmur2_random",
                         "queue.buffering.max.messages": 1_000_000})
    started = time.perf_counter()
    for k, (key, value) in enumerate(messages):
        delay = started + k / rate_msgs - time.perf_counter()
        if delay > 0.001:
            time.sleep(delay)
        producer.produce(topic, value=value, key=key, headers=PRODUCE_HEADERS)
        if not k % 512:
            producer.poll(0)
    producer.flush(60)
    return {"sent": len(messages), "seconds": time.perf_counter() - started}


def _publisher_main(conn, kafka_conf: dict, topic: str, messages: list, rate_msgs: float) -> None:
    conn.send(publish_paced(kafka_conf, topic, messages, rate_msgs))
    conn.close()


def paced_freshness(kafka_conf: dict, topic: str, messages: list[tuple[bytes, bytes]], rate_msgs: float,
                    probes: Callable[[], Probes], probe_every_s: float,
                    at: list[tuple[float, float | None]] | None = None) -> tuple[list[float], dict]:
    """Probe latencies (ms) while `messages` are published at `rate_msgs`; and the publisher's result.
    `at`, if given, receives each probe's start (s since the publisher started) and the probe's `last_ack_ms`
    (None if it has none), in the latencies' order: whether slow probes bunch (a pause somewhere) or spread (the
    scheduler), and whether the broker or the processor took the time, shows there.

    The publisher is a process of its own (forked before the probes' client exists): in a thread it
    would share this process's GIL and add its switch interval to the probes' timings."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)
    publisher = ctx.Process(target=_publisher_main, args=(send, kafka_conf, topic, messages, rate_msgs),
                            name="bench-paced-publisher", daemon=True)
    publisher.start()
    send.close()
    begun, begun_unix = time.perf_counter(), time.time()
    probe = probes()
    latencies = []
    try:
        time.sleep(min(1.0, len(messages) / rate_msgs / 10))  # probes start once the load runs
        while publisher.is_alive():
            started = time.perf_counter()
            latencies.append(probe.once())
            if at is not None:
                at.append((started - begun, getattr(probe, "last_ack_ms", None)))
            rest = probe_every_s - (time.perf_counter() - started)
            if rest > 0:
                time.sleep(rest)
        result = receive.recv() if receive.poll(60) else {"sent": 0, "seconds": float("nan")}
        result["probes_begun_unix_s"] = begun_unix  # what `at`'s starts count from
    finally:
        probe.close()
        publisher.join(60)
        if publisher.is_alive():
            publisher.kill()
    return latencies, result


def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * q))]


def summary(latencies: list[float]) -> dict:
    s = sorted(latencies)
    if not s:
        return {"probes": 0}
    return {"probes": len(s), "p50": round(statistics.median(s), 2), "p99": round(percentile(s, 0.99), 2),
            "max": round(s[-1], 2)}
