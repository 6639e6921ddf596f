"""The analytics app's native rows (native/src/anarows.rs through `Ingest.handle_batch(rows=...)`) against its
reference, one message at a time through `derive.message_rows` with the Python tracker: random record streams of
several nodes (stores and removes on GPU and CPU, groups and media left out, duplicates, parents, spec kinds,
gaps, epoch changes, clears, heartbeats, load reports, malformed records, expiring clocks, two partitions, node
expiries between slices) fed in random slices as the consumer delivers them. Every table's rows must be equal,
column by column, in order (but `ingest_ts`, the informational clock reading), and so must the trackers'
re-store counts and the indexes.
"""
from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.processors.analytics.cputier import CapacityTracker
from kvpipe.processors.analytics.derive import RunRows, end_lifetimes, message_rows
from kvpipe.processors.analytics.rows import EVENT_COLUMNS
from kvpipe.processors.analytics.tables import LIFETIMES, TABLES, native_batch, native_take
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.nativecheck import require_native_core
from tests.property.test_native_ingest_run import Rec

require_native_core()

from kvpipe.processors.analytics.nativetrack import NativeCapacityTracker  # noqa: E402 - needs the native core

MAX_BYTES = 4000
MAX_KEYS = 6  # the trackers forget past this many hashes per slot: their schedule must agree too
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=32, sliding_window=64)]
HASH = st.integers(1, 10)
INGEST_TS = EVENT_COLUMNS.index("ingest_ts")


@st.composite
def events(draw) -> list:
    out: list = []
    for _ in range(draw(st.integers(0, 6))):
        kind = draw(st.sampled_from(["store"] * 12 + ["remove"] * 10 + ["clear"]))
        group = draw(st.sampled_from([0] * 5 + [1, 1, None, 3]))
        medium = draw(st.sampled_from(["GPU"] * 5 + ["CPU"] * 3 + [None, ""]))
        hashes = draw(st.lists(HASH, max_size=4))
        if kind == "clear":
            out.append(AllBlocksCleared())
        elif kind == "store":
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=draw(st.sampled_from([None, 7, 2**64 - 1])),
                                   token_ids=draw(st.lists(st.integers(0, 300), max_size=40)),
                                   block_size=draw(st.sampled_from([16, 16, 0, 32])), lora_id=None, medium=medium,
                                   lora_name=None, group_idx=group,
                                   kv_cache_spec_kind=draw(st.sampled_from([None, None, "", "mamba"]))))
        else:
            out.append(BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group))
    return out


@st.composite
def streams(draw) -> list[Rec]:
    seqs: dict[str, int] = {}
    epochs: dict[str, int] = {}
    offsets = {0: 0, 1: 0}
    clock = 1000.0
    out: list[Rec] = []
    for _ in range(draw(st.integers(1, 60))):
        node = draw(st.sampled_from(["a", "b", "c"]))
        epoch = epochs.get(node, 1)
        step = draw(st.sampled_from([1] * 20 + [0, 2, "epoch+"]))
        if step == "epoch+":
            epoch, seq = epoch + 1, 0
        else:
            seq = max(0, seqs.get(node, -1) + step)
        epochs[node], seqs[node] = epoch, seq
        clock += draw(st.sampled_from([0.25] * 20 + [0.0, 80.0]))  # 80 s: past the ttl
        fields: dict = {}
        if seq == 0 and node != "c":  # c never says its specs: kinds and sizes unknown
            fields["group_specs"] = SPECS
        evs = draw(events())
        batch = b"" if draw(st.integers(0, 8)) == 0 else encode_vllm_batch(evs, clock, 0, "map")
        env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=clock, sent_ts=clock,
                       dp_rank=draw(st.sampled_from([None, 0, 1])), num_events=len(evs), batch=msgspec.Raw(batch),
                       running=draw(st.sampled_from([None, None, 3, 2**40])),
                       waiting=draw(st.sampled_from([None, 1])),
                       kv_usage=draw(st.sampled_from([None, 0.5, float("inf")])), **fields)
        value: Any = encode_envelope(env)
        if draw(st.sampled_from([False] * 30 + [True])):
            value = b"\xc1garbage"
        partition = 0 if node != "c" else 1  # Kafka key = node id: a node's messages share a partition
        out.append(Rec("events", partition, offsets[partition], None, 0, None, value, KAFKA_HEADERS))
        offsets[partition] += 1
    return out


class ReferenceRows:
    """The reference target: every record through `message_rows` with the Python tracker."""

    tracker = None

    def __init__(self, index: Index, tracker: CapacityTracker, submit) -> None:
        self.index, self._tracker, self.submit = index, tracker, submit

    def take(self, rows) -> None:  # never called: the reference path runs no native run
        raise AssertionError("the reference ran a native run")

    def derive(self, record, result) -> None:
        self.submit(message_rows(result, record.partition, record.offset, self.index, self._tracker, 0.0))


def run(native: bool, records: list[Rec], cuts: list[int], expire_at: list[int]) -> tuple:
    index = Index(ttl_s=60.0, store="native", lifetimes="columns")
    ingest = Ingest(index, MAX_BYTES, max_skew_s=10.0, native_runs=native)
    assert ingest.native_runs is native
    tracker: Any = NativeCapacityTracker(MAX_KEYS) if native else CapacityTracker(MAX_KEYS)
    batches = {t.name: native_batch(t) if native else t.batch() for t in TABLES}

    def submit(rows) -> None:
        for table in TABLES:
            got = rows.get(table.name)
            if got is not None and len(got):
                if native:
                    native_take(table, batches[table.name], got)
                else:
                    table.take(batches[table.name], got)

    target: Any = RunRows(index, tracker, submit) if native else ReferenceRows(index, tracker, submit)
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        return 1e5 + calls[0] * 0.25

    start = 0
    for cut in sorted(set(cuts)) + [len(records)]:
        piece = records[start:cut]
        done = 0
        while done < len(piece):
            done += ingest.handle_batch(piece[done:], clock, rows=target).handled
        start = max(start, cut)
        if cut in expire_at:  # the liveness timer between slices: lifetimes ended outside a message
            for p in list(ingest.applied_offset):
                closed = index.expire(2e5, 60.0, partition=p)
                if len(closed):
                    end_lifetimes(index, tracker, None, closed)
                    submit({LIFETIMES: closed})
    tables = {}
    for table in TABLES:
        batch = batches[table.name]
        columns = batch.columns() if native else table.insert(batch[0:len(batch)])
        tables[table.name] = [list(c) for c in columns]
    tables["kv_events"][INGEST_TS] = []  # the clock reading of either path, informational
    return tables, tracker.restores, index.counters, dict(ingest.counters), index.store.entries()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(streams(), st.lists(st.integers(0, 60), max_size=4), st.lists(st.integers(0, 60), max_size=2))
def test_native_rows_equal_the_reference(records, cuts, expire_at):
    native, reference = run(True, records, cuts, expire_at), run(False, records, cuts, expire_at)
    for name in native[0]:
        assert native[0][name] == reference[0][name], name
    assert native[1:] == reference[1:]


def test_common_records_take_the_native_run():
    """The native path is taken: a node's first envelope (with specs) goes through `handle`, the rest natively,
    and the rows are the reference's."""
    envs = []
    for seq in range(6):
        evs = [BlockStored(block_hashes=[2 * seq, 2 * seq + 1], parent_block_hash=None, token_ids=[1] * 32,
                           block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=0),
               BlockRemoved(block_hashes=[2 * seq - 2] if seq else [], medium="GPU", group_idx=0)]
        envs.append(encode_envelope(Envelope(v=SCHEMA_MAJOR, node_id="a", epoch=1, seq=seq, ts=10.0 + seq,
                                             group_specs=SPECS if seq == 0 else None, running=2,
                                             batch=msgspec.Raw(encode_vllm_batch(evs, 10.0)))))
    records = [Rec("events", 0, i, None, 0, None, v, KAFKA_HEADERS) for i, v in enumerate(envs)]
    index = Index(ttl_s=60.0, store="native", lifetimes="columns")
    ingest = Ingest(index, MAX_BYTES, native_runs=True)
    handled = []
    original = ingest.handle

    def counting(*args, **kwargs):
        handled.append(args[3])  # the offset
        return original(*args, **kwargs)

    ingest.handle = counting  # type: ignore[method-assign]
    got: list = []
    tracker = NativeCapacityTracker()
    assert ingest.handle_batch(records, lambda: 20.0, rows=RunRows(index, tracker, got.append)).handled == 6
    assert handled == [0]
    native_rows = [rows for rows in got if type(rows["kv_events"]).__name__ == "NativeRows" and len(rows["kv_events"])]
    assert [len(rows["kv_events"]) for rows in native_rows] == [10]  # offsets 1..5, two events each
    assert [len(rows["kv_block_lifetimes"]) for rows in native_rows] == [5]
    assert [len(rows["kv_node_load"]) for rows in native_rows] == [5]
    assert run(True, records, [], []) == run(False, records, [], [])
