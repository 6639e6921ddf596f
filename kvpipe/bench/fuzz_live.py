"""Probe 2 against a real broker and `kvpipe processor` (RELIABILITY.md): messages over the
processor's size limit but under the events topic's, whose whole copy the DLQ would refuse,
ahead of a victim's envelopes. `kvpipe bench fuzz --oversize-live N`."""
from __future__ import annotations

import random
import tempfile
import time
import uuid
from pathlib import Path

import msgspec

from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.schemas.codec import PRODUCE_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import BlockStored
from kvpipe.schemas.settings import load_settings

PROCESSOR_LIMIT = 1 << 20
OVERSIZE = 2 << 20  # over the processor's limit, under the events topic's, over the broker's default


def oversize_live(count: int, victim_envelopes: int = 100) -> dict:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    bootstrap = load_settings().bootstrap()
    tag = uuid.uuid4().hex[:10]
    events, dlq, snaps = f"probe2-ev-{tag}", f"probe2-dlq-{tag}", f"probe2-snap-{tag}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.create_topics([
            NewTopic(events, 1, 1, config={"max.message.bytes": str(4 << 20), "message.timestamp.type": "LogAppendTime"}),
            NewTopic(dlq, 1, 1), NewTopic(snaps, 1, 1, config={"cleanup.policy": "compact"})]).values():
        f.result(timeout=30)
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-probe2-"))
    env = {"KVPIPE_KAFKA_BOOTSTRAP": bootstrap, "KVPIPE_EVENTS_TOPIC": events, "KVPIPE_DLQ_TOPIC": dlq,
           "KVPIPE_SNAPSHOT_TOPIC": snaps, "KVPIPE_PARTITIONS": "1", "KVPIPE_PROCESSOR_ID": f"probe2-{tag}",
           "KVPIPE_WEB_PORT": str(free_port()), "KVPIPE_STATE_DIR": str(tmp / "state"),
           "KVPIPE_MAX_MESSAGE_BYTES": str(PROCESSOR_LIMIT), "KVPIPE_SNAPSHOT_EVERY_S": "3600"}
    proc = ProcessorProcess(env, tmp / "processor.log").start()
    try:
        producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 5 << 20})
        rng, now = random.Random(1), time.time()
        for _ in range(count):
            producer.produce(events, key=b"big", value=rng.randbytes(OVERSIZE), headers=PRODUCE_HEADERS)
        for seq in range(victim_envelopes):
            ts = now + seq * 0.01
            batch = msgspec.Raw(encode_vllm_batch([BlockStored(block_hashes=[seq], parent_block_hash=None, token_ids=[],
                                                               block_size=16, lora_id=None, medium="GPU", lora_name=None,
                                                               group_idx=0)], ts))
            producer.produce(events, key=b"victim", headers=PRODUCE_HEADERS, value=encode_envelope(
                Envelope(v=SCHEMA_MAJOR, node_id="victim", epoch=1, seq=seq, ts=ts, sent_ts=ts, batch=batch)))
        producer.flush(60)
        started = time.monotonic()
        stats = proc.wait_offsets({0: count + victim_envelopes}, timeout=300)
        seconds = time.monotonic() - started
    finally:
        proc.stop()
        admin.delete_topics([events, dlq, snaps])
    c = stats["counters"]
    return {"oversize_messages": count, "victim_envelopes": victim_envelopes, "seconds_to_drain": round(seconds, 2),
            "dlq_by_reason": stats["dlq_by_reason"], "agent_errors": c["agent_errors"],
            "dlq_send_errors": c.get("dlq_send_errors"), "victim_envelopes_applied": c["envelopes"]}
