"""The native ingest run (`kvpipe.processors.core.ingestrun`, native/src/ingestrun.rs and envelope.rs)
against the reference `Ingest.handle_batch` (one `Ingest.handle` per record): random record streams
of several nodes (duplicates, gaps, epoch changes, heartbeats, spec, model and load changes,
dropped events, lost batches, clears, new slots, capped slots, a refused node, a node tracked in
flight, clamped and expiring clocks, replayed and skipped offsets, two partitions, malformed,
oversize and wrongly headed messages) fed in random slices, as the consumer delivers them, to both.
Every `Batch`, every counter, the applied offsets and partition clocks, every node's state and the
index's contents must be equal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.processors.router.inflight import InFlight
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.nativecheck import require_native_core

require_native_core()

MAX_BYTES = 1500
NODES = ["a", "b", "c", "d"]  # max_nodes 3: one of them is refused while the others live
TRACKED = "c"  # has a request in flight: its envelopes take the reference path
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
HASH = st.integers(1, 12)  # a small pool: stores hit existing blocks, removes find them (or not)
# envelope fields given another type or an out-of-range value (native/src/envelope.rs must leave
# whatever the reference decoder refuses, and read what it accepts as it does)
FIELDS = ["v", "node_id", "epoch", "seq", "ts", "sent_ts", "model", "dp_rank", "dropped", "lost_batches", "num_events",
          "layout", "running", "waiting", "kv_usage", "spec_mismatches", "source", "upstream_seq", "group_specs",
          "hash_config", "batch"]
ODD_VALUES = [None, -1, 0, 1, 2, 1.5, 0.0, "x", "", "map", b"\x01", True, 2**64 - 1, -2**63, float("nan"),
              float("inf"), [1], {}]


@dataclass
class Rec:
    """A fetched record, as `Ingest.handle_batch` reads it (kvpipe.processors.core.ingest.KafkaRecord)."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None
    timestamp_type: int
    key: bytes | None
    value: Any
    headers: Any


@st.composite
def events(draw) -> list:
    out: list = []
    for _ in range(draw(st.integers(0, 5))):
        # sampled, not drawn as integers: hypothesis favours 0, which would make most events clears
        kind = draw(st.sampled_from(["store"] * 12 + ["remove"] * 10 + ["clear", "store-disk"]))
        group = draw(st.sampled_from([0] * 6 + [1, None]))
        medium = draw(st.sampled_from(["GPU"] * 6 + [None, "", "CPU"] + (["disk"] if kind == "store-disk" else [])))
        if kind == "clear":
            out.append(AllBlocksCleared())
        elif kind.startswith("store"):
            out.append(BlockStored(block_hashes=draw(st.lists(HASH, max_size=3)), parent_block_hash=None,
                                   token_ids=draw(st.lists(st.integers(0, 300), max_size=3)), block_size=16,
                                   lora_id=None, medium=medium, lora_name=None, group_idx=group))
        else:
            out.append(BlockRemoved(block_hashes=draw(st.lists(HASH, max_size=3)), medium=medium, group_idx=group))
    return out


@st.composite
def streams(draw) -> list[Rec]:
    seqs: dict[str, int] = {}
    epochs: dict[str, int] = {}
    offsets = {0: 0, 1: 0}
    clock = 1000.0
    out: list[Rec] = []
    for _ in range(draw(st.integers(1, 80))):
        node = draw(st.sampled_from(["a", "b"] * 5 + ["c", "d"]))
        epoch = epochs.get(node, 1)
        step = draw(st.sampled_from([1] * 20 + [0, 2, -1, "epoch+", "epoch-"]))
        if step == "epoch+":
            epoch += 1
            seq = 0
        elif step == "epoch-":  # one stale envelope; the node goes on in its epoch
            epoch = max(0, epoch - 1)
            seq = seqs.get(node, 0)
        else:
            seq = max(0, seqs.get(node, -1) + step)
        if step != "epoch-":
            epochs[node], seqs[node] = epoch, seq
        clock += draw(st.sampled_from([0.5] * 20 + [0.0, 80.0]))  # 80 s: past the ttl
        ts = clock + draw(st.sampled_from([0.0] * 20 + [30.0]))  # 30 s ahead: clamped
        fields: dict = {}
        if seq == 0 or draw(st.sampled_from([False] * 20 + [True])):
            fields["group_specs"] = SPECS
        if draw(st.sampled_from([False] * 25 + [True])):
            fields["dropped"] = 2
        if draw(st.sampled_from([False] * 30 + [True])):
            fields["lost_batches"] = 1
        evs = draw(events())
        layout = draw(st.sampled_from(["map"] * 20 + ["array"]))
        batch = b"" if draw(st.integers(0, 6)) == 0 else encode_vllm_batch(evs, ts, 0, layout)
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=ts,
                       sent_ts=draw(st.sampled_from([ts, ts, 0.0, ts + 0.25])),
                       model=draw(st.sampled_from(["m"] * 8 + [None, "m2"])),
                       dp_rank=draw(st.sampled_from([None, 0, 1])), num_events=len(evs),
                       batch=msgspec.Raw(batch), layout=layout,
                       spec_mismatches=draw(st.sampled_from([0, 0, 0, 2])),
                       running=draw(st.sampled_from([None, None, 3])), kv_usage=draw(st.sampled_from([None, 0.5])),
                       **fields)
        value: Any = encode_envelope(env)
        headers: Any = KAFKA_HEADERS
        bad = draw(st.sampled_from(["no"] * 40 + ["cut", "garbage", "big", "none", "header", "no header", "extra"]
                                   + ["field"] * 4))
        if bad == "cut":
            value = value[:draw(st.integers(0, len(value) - 1))]  # truncated
        elif bad == "garbage":
            value = b"\xc1garbage"
        elif bad == "big":
            value = value + bytes(MAX_BYTES)  # over the size limit
        elif bad == "none":
            value = None
        elif bad == "header":
            headers = [("kvpipe-schema", b"2")]
        elif bad == "no header":
            headers = None
        elif bad == "extra":
            value = msgspec.msgpack.encode({**msgspec.msgpack.decode(value), "extra": 1})  # unknown key
        elif bad == "field":  # a field of another type or out of range: refused, or read as the reference reads it
            value = msgspec.msgpack.encode({**msgspec.msgpack.decode(value),
                                            draw(st.sampled_from(FIELDS)): draw(st.sampled_from(ODD_VALUES))})
        partition = draw(st.sampled_from([0] * 8 + [1]))
        offset = offsets[partition]
        jump = draw(st.sampled_from([1] * 15 + [2, -1]))  # a hole, or a replayed offset
        offsets[partition] = max(offset + jump, 0)
        log_append = draw(st.booleans())
        out.append(Rec("events", partition, offset, int(clock * 1000) if log_append else None, 1 if log_append else 0,
                       None, value, headers))
    return out


def make_ingest(native_runs: bool) -> Ingest:
    index = Index(ttl_s=60.0, max_nodes=3, max_blocks_per_slot=6, max_slots_per_node=3, store="native")
    inflight = InFlight(ttl_s=1e9)
    inflight.sent("r1", TRACKED, {0: [1, 2, 3]}, now=0.0)
    return Ingest(index, MAX_BYTES, max_skew_s=10.0, inflight=inflight, native_batches=True,
                  native_runs=native_runs)


def batch_view(b) -> tuple:
    return (b.handled, b.published, [(r.outcome, r.env.node_id) for r in b.refused],
            None if b.dlq is None else (b.dlq.outcome, b.dlq.error.kind, b.dlq.error.message),
            None if b.failed is None else repr(b.failed))


def state_view(ingest: Ingest) -> tuple:
    index = ingest.index
    nodes = {n: (s.epoch, s.seq, s.last_seen, s.suspect, s.reason, s.expired, s.partition, s.last_offset,
                 dict(s.counters), s.partial_since, s.skew_s, s.expired_at, s.load, s.dp_rank, s.model,
                 s.group_specs, s.hash_config,
                 {k: (sorted(sl.blocks.items()), sorted(dict(sl.dups).items())) for k, sl in sorted(s.slots.items())})
             for n, s in sorted(index.nodes.items())}
    return (dict(ingest.counters), dict(ingest.dlq_by_reason), dict(ingest.applied_offset), dict(ingest.stream_ts),
            dict(ingest.ingest_ts), dict(index.counters), index.ended, index.generation, nodes, index.sizes(),
            index.store.entries(), dict(ingest.inflight.counters), ingest.inflight.entries)


def feed(ingest: Ingest, records: list[Rec], cuts: list[int]) -> list[tuple]:
    """As the consumer and `processors/routing/agents.py: ingest_batch` do: slices, each handled until done."""
    calls = [0]

    def clock() -> float:  # read once per record by either path, in the same order
        calls[0] += 1
        # past every node clock of the stream: only the LogAppendTime records' own times clamp
        return 1e5 + calls[0] * 0.25

    out = []
    start = 0
    for cut in sorted(set(cuts)) + [len(records)]:
        piece = records[start:cut]
        done = 0
        while done < len(piece):
            b = ingest.handle_batch(piece[done:], clock)
            out.append(batch_view(b))
            done += b.handled
        start = max(start, cut)
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(streams(), st.lists(st.integers(0, 60), max_size=4))
def test_native_runs_equal_the_reference(records, cuts):
    fast, ref = make_ingest(True), make_ingest(False)
    assert fast.native_runs and not ref.native_runs
    assert feed(fast, records, cuts) == feed(ref, records, cuts)
    assert state_view(fast) == state_view(ref)


def test_a_run_applies_common_records_natively_and_leaves_the_rest():
    """The run is taken: native calls cover the common-case records; the node's first envelope
    (seq 0, with specs), a clear and the store after it (its slot is made again) go through
    `handle`, with the same results."""
    envs = []
    for seq in range(8):
        evs = [BlockStored(block_hashes=[seq], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                           medium="GPU", lora_name=None, group_idx=0)] if seq != 4 else [AllBlocksCleared()]
        envs.append(encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id="a", epoch=1, seq=seq, ts=10.0 + seq,
                                             group_specs=SPECS if seq == 0 else None,
                                             batch=msgspec.Raw(encode_vllm_batch(evs, 10.0)))))
    records = [Rec("events", 0, i, None, 0, None, v, KAFKA_HEADERS) for i, v in enumerate(envs)]
    fast, ref = make_ingest(True), make_ingest(False)
    handled = []
    original = fast.handle

    def counting(*args, **kwargs):
        handled.append(args[3])  # the offset
        return original(*args, **kwargs)

    fast.handle = counting  # type: ignore[method-assign]
    assert batch_view(fast.handle_batch(records, lambda: 20.0)) == batch_view(ref.handle_batch(records, lambda: 20.0))
    assert handled == [0, 4, 5]  # the rest went natively
    assert state_view(fast) == state_view(ref)
    assert fast.index.nodes["a"].seq == 7 and fast.index.counters["envelopes"] == 8
