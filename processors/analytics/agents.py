"""The analytics agent and timers: short loops over `ingest`, `index`, `rows` and the sink.

Progress rule: a snapshot claims an events offset only after the store acknowledged every row up
to it. (So the rows up to a restored snapshot's offset are all in the store: the re-store tracker is
rebuilt from them when a partition is assigned, `ensure_tracker`.) The agent awaits room in the sink *before* taking a message, then applies it and submits its
rows in the same event-loop turn (nothing awaits between the two). So whenever a snapshot takes
its slice of the index, the rows of every message in that slice are already submitted, and the
snapshot's flush (`sink.flush`) waits for exactly those; if the store does not acknowledge them in
time, no snapshot is written and a restart replays from the previous one.
"""
from __future__ import annotations

import asyncio
from typing import Any
import gc
import logging
import time

from tenacity import RetryCallState

from kvpipe.processors.core import rebalance
from kvpipe.schemas import retrying
from kvpipe.processors.analytics import derive, restore_state
from kvpipe.processors.analytics.app import app, batch_handlers, events_topic, settings
from kvpipe.processors.analytics.derive import message_rows
from kvpipe.processors.analytics.state import runtime
from kvpipe.processors.analytics.tables import LIFETIMES
from kvpipe.processors.core.durability import SnapshotProducer
from kvpipe.processors.core.ingest import Result
from kvpipe.processors.core.lifetimes import LifetimeColumns, LifetimeRow
from kvpipe.processors.core.signals import connect

log = logging.getLogger(__name__)

SNAPSHOT_FLUSH_S = 30.0  # how long a periodic snapshot waits for the store's acknowledgement
REVOKE_FLUSH_S = 10.0  # shorter while a rebalance waits for us
_LOG_EVERY_S = 30.0
_last_log: dict[str, float] = {}


def _log_rate_limited(key: str, level: int, msg: str, *args) -> None:
    now = time.monotonic()
    if now - _last_log.get(key, -_LOG_EVERY_S) >= _LOG_EVERY_S:
        _last_log[key] = now
        log.log(level, msg, *args)


@app.agent(events_topic, name="kvpipe-analytics-rows")
async def derive_rows(stream) -> None:
    # With batched delivery (the default) the consumer hands the events to `derive_batch` below and this
    # stream gets none; it is the path of `processor_delivery = "message"`. Either way every message goes
    # through `derive_one` once, in offset order.
    async for _ in stream:
        msg = stream.current_event.message
        if not await ready_for(msg.partition, msg.offset):
            continue
        # timestamp_type 1 = LogAppendTime: the broker's clock bounds node timestamps (processors/core/ingest.py);
        # a Faust message carries it in seconds
        derive_one(msg, msg.timestamp if msg.timestamp_type == 1 else None)


async def derive_batch(records, still_current) -> int:
    """One partition's fetched records in offset order, from the consumer (kvpipe.processors.core.batchdelivery):
    what the agent above does per message, without Faust's machinery per message. With native rows
    (`runtime.rows`) runs of common-case records are applied and their rows built by one native call each
    (`Ingest.handle_batch`), waiting for room in the sink before each call rather than each record. Returns how
    many were handled from the front: fewer than all only when a rebalance began while it waited (for the store,
    or for the partition's tracker), and then the rest is fetched again by the partition's owner."""
    done, total = 0, len(records)
    while done < total:
        r = records[done]
        if not await ready_for(r.partition, r.offset) or not still_current():
            break
        if runtime.rows is None:
            ts_ms = r.timestamp  # an aiokafka record's, in milliseconds
            derive_one(r, ts_ms / 1000.0 if r.timestamp_type == 1 and ts_ms is not None else None)
            done += 1
            continue
        batch = runtime.ingest.handle_batch(records[done:] if done else records, rows=runtime.rows)
        done += batch.handled
        if batch.failed is not None:  # a bug, not bad input: loud, counted, and the worker keeps going
            runtime.agent_errors += 1
            msg = records[done - 1]
            log.error("analytics: message %s/%s at offset %s broke the row path", msg.topic, msg.partition,
                      msg.offset, exc_info=batch.failed)
        # a DLQ outcome needs nothing here: the routing app sends the copy, this app counts it (`dlq_by_reason`)
    return done


async def ready_for(partition: int, offset: int) -> bool:
    """Wait until a message of `partition` at `offset` may be applied: its tracker rebuilt, room in the sink.
    False: a rebalance during the wait made it not next (see `stale_after_wait`); drop it unapplied."""
    if runtime.restores is not None and partition not in runtime.restores.loaded:
        # the rebalance hook could not rebuild it (the store refused): nothing of the partition is
        # applied before it is, or its re-stores of blocks ended before the snapshot would be missed
        await ensure_tracker_retrying(partition)
        if stale_after_wait(partition, offset):
            return False
    sink = runtime.sink
    if not sink.has_room():  # the store is behind: stop taking input until it catches up
        _log_rate_limited("room", logging.WARNING, "analytics: %d rows wait for the store (%s: %s); "
                          "consumption paused", sink.counters()["unwritten_rows"],
                          sink.counters()["store_state"], sink.counters()["store_reason"] or "slow")
        await sink.wait_for_room()
        if stale_after_wait(partition, offset):
            return False
    return True


def derive_one(msg, record_ts: float | None) -> None:
    """Apply one message and submit its rows in the same event-loop turn (the module doc says why)."""
    try:
        result = runtime.ingest.handle(msg.value, msg.headers, msg.partition, msg.offset, time.time(), record_ts)
        submit(result, msg.partition, msg.offset)
    except Exception:  # a bug, not bad input: loud, counted, and the worker keeps going
        runtime.agent_errors += 1
        log.exception("analytics: message %s/%s at offset %s broke the row path", msg.topic, msg.partition, msg.offset)


batch_handlers[settings.events_topic] = derive_batch


@app.task
async def tune_gc() -> None:
    """Garbage collection for a worker (see `derive.GC_THRESHOLDS`)."""
    gc.freeze()  # what exists once the worker runs (modules, Faust, the app) is never garbage
    gc.set_threshold(*derive.GC_THRESHOLDS)


def stale_after_wait(partition: int, offset: int) -> bool:
    """A rebalance during the wait may have revoked the message's partition or restored it from an
    older snapshot (and repositioned the consumer there). Then the held message is not next: drop
    it unapplied, the consumer delivers it again in order."""
    if partition not in runtime.durability.owned:
        return True
    last = runtime.ingest.applied_offset.get(partition)
    return last is not None and offset > last + 1


def submit(result: Result, partition: int, offset: int) -> None:
    """Queue a message's rows (synchronous: see the module doc). Undecodable input yields none; the
    routing app sends it to the DLQ, this app counts it (`dlq_by_reason` in /stats)."""
    rows = message_rows(result, partition, offset, runtime.index, runtime.restores, time.time())
    runtime.sink.submit(rows)


def end_lifetimes(env, lifetimes: list[LifetimeRow] | LifetimeColumns) -> None:
    """Lifetimes ended outside an applied message's events (expiry): kinds, reasons, tracker."""
    derive.end_lifetimes(runtime.index, runtime.restores, env, lifetimes)


# -- liveness: the same expiry as the routing app, so lifetimes end as they do in the index ---------


@app.timer(interval=max(0.5, min(5.0, settings.node_ttl_s / 4)))
async def expire_silent_nodes() -> None:
    now = time.time()
    for p in list(runtime.ingest.applied_offset):
        if runtime.restores is not None and p not in runtime.restores.loaded:
            continue  # restored, tracker not rebuilt yet: its ends would be lost to it (see ensure_tracker)
        closed = runtime.index.expire(partition_now(p, now), settings.node_ttl_s, partition=p)
        if closed:
            end_lifetimes(None, closed)
            runtime.sink.submit({LIFETIMES: closed})  # same turn as the expiry: a snapshot never sees one without the other


def partition_now(partition: int, now: float) -> float:
    return rebalance.partition_now(app, runtime.ingest, settings.events_topic, partition, now)


# -- durability: snapshots that claim only acknowledged rows ----------------------------------------


def owned_partitions() -> list[int]:
    return rebalance.owned_partitions(app, settings.events_topic)


def acknowledged(timeout: float):
    async def flush() -> None:
        if not await asyncio.to_thread(runtime.sink.flush, timeout):
            c = runtime.sink.counters()
            raise StoreBehind(f"the store has not acknowledged {c['unwritten_rows']} rows within {timeout:.0f} s "
                              f"({c['store_state']}: {c['store_reason'] or 'slow'})")
    return flush


class StoreBehind(RuntimeError):
    pass


# The snapshot topic's own producer, not the app's: Faust flushes the app's producer before every offset commit
# and the consumer waits for commits, so records stuck for a leaderless snapshot partition (a full log dir) would
# stop consumption (processors/core/durability.py: SnapshotProducer; RELIABILITY.md section 9).
snapshot_producer = SnapshotProducer(settings.bootstrap(), settings.analytics_snapshot_topic, settings.snapshot_timeout_s,
                                     max(settings.max_message_bytes, 2 * 1024 * 1024))


async def _snapshot(partitions: list[int], timeout: float) -> None:
    try:
        await runtime.durability.snapshot(snapshot_producer, partitions, acknowledged(timeout))
    except StoreBehind as exc:  # expected during an outage: progress waits for the store
        runtime.snapshot_skips += 1
        runtime.last_snapshot_skip = str(exc)
        _log_rate_limited("snapshot", logging.WARNING, "analytics: snapshot skipped, progress stays at the previous "
                          "one: %s", exc)


@app.timer(interval=settings.snapshot_every_s)
async def snapshot_partitions() -> None:
    try:
        await _snapshot(owned_partitions(), SNAPSHOT_FLUSH_S)
    except Exception:
        log.exception("analytics: periodic snapshot failed; a restart replays from the previous one")


async def _snapshot_revoked(partitions: list[int]) -> None:
    await _snapshot(partitions, REVOKE_FLUSH_S)


rebalance.connect(app, runtime.durability, runtime.ingest, settings.events_topic, _snapshot_revoked)


# -- the re-store tracker across restarts and rebalances ------------------------------------------------
# Not in the snapshots: rebuilt from the store for the restored offset (processors/analytics/restore_state.py
# says why). Restoring a partition drops its tracker state (state.AnalyticsDurability); the rebuild runs in
# on_rebalance_complete, which Faust awaits before the streams resume, and the agent retries it before a
# partition's first message if the store refused then.

_tracker_lock = asyncio.Lock()


async def ensure_tracker(partitions: list[int]) -> None:
    """Rebuild the tracker of these partitions (those restored and not rebuilt yet) from the store."""
    tracker = runtime.restores
    if tracker is None:
        return
    async with _tracker_lock:
        todo = {p: runtime.ingest.applied_offset.get(p, -1) for p in partitions
                if p not in tracker.loaded and p in runtime.durability.owned}
        if not todo:
            return
        started = time.perf_counter()
        state = await asyncio.to_thread(restore_state.query_state, runtime.sink.read_columns, todo, tracker.max_keys)
        # a rebalance during the query may have taken a partition away (or restored it again): install only
        # the state of partitions still ours, still at the offset it was built for
        state = {p: slots for p, slots in state.items() if p in runtime.durability.owned and p not in tracker.loaded
                 and runtime.ingest.applied_offset.get(p, -1) == todo[p]}
        restore_state.install(tracker, runtime.index, state)
        info = {**restore_state.restore_info(state), "offsets": {str(p): todo[p] for p in state},
                "ms": round((time.perf_counter() - started) * 1000, 1), "ts": time.time()}
        runtime.tracker_rebuilds = (runtime.tracker_rebuilds + [info])[-16:]
        log.info("analytics: re-store tracker rebuilt from the store: %s", info)


# The tracker's rebuild waits for the store as the sink's inserts do (kvpipe.schemas.retrying), from 0.5 s up
# to 30 s between tries: the partition stays paused meanwhile, its messages are not lost.
TRACKER_FIRST_RETRY_S = 0.5
TRACKER_MAX_RETRY_S = 30.0


class TrackerNotRebuilt(RuntimeError):
    """The rebuild answered, but the partition moved on while it ran (its state was not installed): try again."""


async def ensure_tracker_retrying(partition: int) -> None:
    """Rebuild the partition's tracker before its first message is applied, retrying while the store refuses;
    returns once it is rebuilt, or the partition was revoked meanwhile (the caller then drops the message)."""
    def refused(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        _log_rate_limited("tracker", logging.WARNING, "analytics: re-store tracker of partition %s not rebuilt "
                          "(%s: %s); partition paused, retrying", partition, type(exc).__name__, str(exc)[:300])

    await retrying.async_retrying(first_s=TRACKER_FIRST_RETRY_S, max_s=TRACKER_MAX_RETRY_S,
                                  before_sleep=refused)(_rebuild_tracker_once, partition)


async def _rebuild_tracker_once(partition: int) -> None:
    tracker = runtime.restores
    if tracker is None or partition in tracker.loaded or partition not in runtime.durability.owned:
        return  # nothing (more) to do: rebuilt, revoked, or no tracker at all
    await ensure_tracker([partition])
    if partition not in tracker.loaded and partition in runtime.durability.owned:
        raise TrackerNotRebuilt(f"partition {partition} moved on while its tracker was read from the store")


@connect(app.on_rebalance_complete)
async def rebuild_restore_tracker(app: Any, *args: Any, **kwargs: Any) -> None:
    if runtime.restores is None:
        return
    partitions = owned_partitions()
    try:
        await runtime.durability.restore(partitions)  # idempotent; the hooks of one signal run in no fixed order
        await ensure_tracker(partitions)
    except Exception:
        log.exception("analytics: re-store tracker not rebuilt at assignment; retried before each partition's "
                      "first message")


@connect(app.on_partitions_revoked)
async def forget_revoked_tracker(app: Any, revoked: Any, *args: Any, **kwargs: Any) -> None:
    if runtime.restores is None:
        return
    for tp in revoked:
        if tp.topic == settings.events_topic:
            runtime.restores.forget_partition(tp.partition)  # memory only: a later restore rebuilds it


@connect(app.on_before_shutdown)
async def snapshot_on_shutdown(app: Any, *args: Any, **kwargs: Any) -> None:
    try:
        await _snapshot(sorted(runtime.ingest.applied_offset), REVOKE_FLUSH_S)
    except Exception:
        log.exception("analytics: snapshot at shutdown failed (the next start replays from the previous one)")
    await snapshot_producer.stop()
    await asyncio.to_thread(runtime.sink.close, REVOKE_FLUSH_S)
