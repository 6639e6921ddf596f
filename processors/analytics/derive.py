"""The rows the analytics app submits for one ingested message: a plain function of the ingest
result, the index and the re-store tracker, so the agent (`agents.submit`) and the benchmark's
in-process baseline (`kvpipe.bench.analytics.pipeline_insert`) run the same code."""
from __future__ import annotations

import time
from typing import Callable

from kvpipe.processors.core import lifetimes as lifecols, native
from kvpipe.processors.core.lifetimes import LifetimeColumns
from kvpipe.processors.analytics.cputier import CapacityTracking
from kvpipe.processors.analytics.restores import RestoreTracker, refine_reason_columns, refine_reasons
from kvpipe.processors.analytics.rows import FROM_CPU_AT, HASHES_AT, event_columns_of, group_kinds_of, load_row
from kvpipe.processors.analytics.tables import EVENTS, LIFETIMES, LOADS, RESTORES, MessageRows
from kvpipe.processors.core.index import APPLIED, Index
from kvpipe.processors.core.ingest import Result
from kvpipe.processors.core.outcomes import KafkaRecord

# Cyclic GC, measured in the worker during `kvpipe bench analytics` (BENCHMARKS.md, analytics): with
# the default thresholds ~1,100 young and 9 full collections per 12k-message backlog took ~1.2 s
# of a ~4.5 s write phase. Per-message garbage is freed by reference counting; what trips the
# young generation is rows and fetched records that live until written, and every full collection
# then walks Faust's and the index's whole heap. Fewer, larger young collections (0.4 s in the same
# run), and the startup heap frozen out of the collector's walks.
# The worker sets these (`agents.tune_gc`); the bench's in-process baseline runs under them too.
GC_THRESHOLDS = (50_000, 20, 100)


def message_rows(result: Result, partition: int, offset: int, index: Index,
                 tracker: RestoreTracker | CapacityTracking | None, now: float) -> MessageRows:
    """A message's rows by analytics table (`tables`: event columns, lifetimes, re-stores, load). Undecodable input yields none; a
    message not applied may still end lifetimes (its node's epoch moved on); only an applied one
    (heartbeats too) reports load, as only an applied one moves the index's `node.load`. The app's tracker
    (`cputier.CapacityTracking`: the Python `CapacityTracker` or the native one) also counts each GPU store's
    CPU-tier copies (`from_cpu_blocks`).

    Lifetimes come as the index made them: `LifetimeRow`s (the reference) or `LifetimeColumns`
    (`Index(lifetimes="columns")`, the app's), derived column by column without a row object."""
    if result.outcome != APPLIED:
        if result.lifetimes:
            end_lifetimes(index, tracker, result.env, result.lifetimes)
        return {LIFETIMES: result.lifetimes}
    env = result.env
    if env is None:  # applied means decoded: never, but say so to the reader (and the type checker)
        raise ValueError("an applied ingest result carries its envelope")
    kinds = node_kinds(index, env.node_id, env)
    if isinstance(result.lifetimes, LifetimeColumns):
        if len(result.lifetimes):  # most messages end none
            refine_reason_columns(env, result.lifetimes)
            lifecols.set_group_kinds(result.lifetimes, lambda _node: kinds)  # the message's kinds for every row
    else:  # the reference: one row object at a time
        refine_reasons(env, result.lifetimes)
        for lt in result.lifetimes:
            lt.group_kind = kinds.get(lt.group_idx, ("", 0))[0]
    rows = event_columns_of(env, result.events, partition, offset, now, kinds)
    if isinstance(tracker, CapacityTracking) and len(rows):  # otherwise not counted: NULL, the query's old way
        cols = rows.columns
        cols[FROM_CPU_AT] = tracker.cpu.observe(env, result.events, cols[HASHES_AT], partition)
    restores = tracker.observe(env, result.events, result.lifetimes, partition, offset, kinds) if tracker else []
    load = load_row(env, partition, offset)
    return {EVENTS: rows, LIFETIMES: result.lifetimes, RESTORES: restores, LOADS: [load] if load is not None else []}


class RunRows:
    """Where the rows of a batch go when the native core applies runs of it (`ingestrun.RowsTarget`): a run's rows
    as the native side built them, and every record it left to the reference path through `message_rows`, to
    `submit` (the sink's, or the benchmark's batches). `tracker`: the app's tracker; a native one
    (`nativetrack.NativeCapacityTracker`), whose state the runs update in place, or None."""

    def __init__(self, index: Index, tracker: RestoreTracker | CapacityTracking | None,
                 submit: Callable[[MessageRows], None]) -> None:
        core = getattr(tracker, "core", None)
        if tracker is not None and core is None:
            raise TypeError("native runs update the native tracker's state: a Python tracker would miss them")
        self.index, self._tracker, self.tracker, self.submit = index, tracker, core, submit

    def take(self, rows: native.RunRows) -> None:
        events, lifetimes, restores, loads = rows
        self.submit({EVENTS: events, LIFETIMES: lifetimes, RESTORES: restores, LOADS: loads})

    def derive(self, record: KafkaRecord, result: Result) -> None:
        self.submit(message_rows(result, record.partition, record.offset, self.index, self._tracker, time.time()))


def node_kinds(index: Index, node_id: str, env=None) -> dict[int, tuple[str, int]]:
    """`group → (spec kind, block size)` the index remembers for the node (or this envelope's specs)."""
    node = index.nodes.get(node_id)
    if node is not None and node.group_specs:
        return {g.group_idx: (g.kind, g.block_size) for g in node.group_specs}
    return group_kinds_of(env) if env is not None else {}


def end_lifetimes(index: Index, tracker: RestoreTracker | CapacityTracking | None, env,
                  lifetimes: list | LifetimeColumns) -> None:
    """Lifetimes ended outside an applied message's events (expiry, epoch change): kinds, reasons, tracker."""
    if isinstance(lifetimes, LifetimeColumns):
        refine_reason_columns(env, lifetimes)
        lifecols.set_group_kinds(lifetimes, lambda node_id: node_kinds(index, node_id))
    else:
        refine_reasons(env, lifetimes)
        for lt in lifetimes:
            lt.group_kind = node_kinds(index, lt.node_id).get(lt.group_idx, ("", 0))[0]
    if tracker is not None:
        tracker.end_all(lifetimes)
