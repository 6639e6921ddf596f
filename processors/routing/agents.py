"""The agent and the timers: short loops; the logic is in `ingest`, `index` and `durability`."""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

from kvpipe.processors.core import rebalance
from kvpipe.processors.routing.app import app, batch_handlers, settings
from kvpipe.processors.core.durability import SnapshotProducer
from kvpipe.processors.core.index import APPLIED, REFUSED
from kvpipe.processors.core.ingest import DLQ, dlq_record
from kvpipe.processors.core.lograte import RateLimitedLog
from kvpipe.processors.core.outcomes import Result
from kvpipe.processors.core.signals import connect
from kvpipe.processors.routing.state import runtime
from kvpipe.processors.routing.topics import dlq_topic, events_topic
from kvpipe.schemas.codec import DecodeError

log = logging.getLogger(__name__)


@app.agent(events_topic, name="kvpipe-ingest")
async def ingest(stream) -> None:
    # With batched delivery (the default) the consumer hands the events to `ingest_batch` below and
    # this stream gets none; it is the path of `processor_delivery = "message"`. Either way every
    # message goes through `Ingest.handle` once, in offset order, with the same side effects.
    # Iterating the stream itself, not `stream.events()`: that wrapper is one more async
    # generator hop per message (~6% of the worker); the event is `stream.current_event`.
    async for _ in stream:
        msg = stream.current_event.message
        try:
            # timestamp_type 1 = LogAppendTime: the broker's clock, stored with the record (ingest's doc)
            record_ts = msg.timestamp if msg.timestamp_type == 1 else None
            now = time.time()
            result = runtime.ingest.handle(msg.value, msg.headers, msg.partition, msg.offset, now, record_ts)
        except Exception as exc:  # a bug, not bad input: keep the message, keep going
            _rate_log.emit("ingest-bug", logging.ERROR, "message %s/%s at offset %s broke the ingest path",
                           msg.topic, msg.partition, msg.offset, exc_info=True)
            runtime.agent_errors += 1
            await send_to_dlq(msg, DecodeError("internal", f"{type(exc).__name__}: {exc}"))
            continue
        # an applied or refused result carries its envelope, a DLQ one its error (the None checks say so to mypy)
        if result.outcome == APPLIED and result.env is not None:
            runtime.metrics.observe_applied(result.env.sent_ts, result.env.ts, now)
        elif result.outcome == DLQ and result.error is not None:
            await send_to_dlq(msg, result.error)
        elif result.outcome == REFUSED:
            _log_refused(result)


async def ingest_batch(records, still_current) -> int:
    """One partition's fetched records in offset order, from the consumer (kvpipe.processors.core.batchdelivery):
    what the agent above does per message, per run. Returns how many were handled from the front:
    all of them, unless a rebalance began while a DLQ copy was being sent (the rest is fetched again)."""
    done = 0
    total = len(records)
    ingest_ = runtime.ingest
    while done < total:
        batch = ingest_.handle_batch(records[done:] if done else records)
        runtime.metrics.observe_published(batch.published, time.time())  # routable from now on
        for result in batch.refused:
            _log_refused(result)
        done += batch.handled
        msg = records[done - 1]
        if batch.failed is not None:  # a bug, not bad input: keep the message, keep going
            _rate_log.emit("ingest-bug", logging.ERROR, "message %s/%s at offset %s broke the ingest path",
                           msg.topic, msg.partition, msg.offset, exc_info=batch.failed)
            runtime.agent_errors += 1
            await send_to_dlq(msg, DecodeError("internal", f"{type(batch.failed).__name__}: {batch.failed}"))
        elif batch.dlq is not None and batch.dlq.error is not None:
            await send_to_dlq(msg, batch.dlq.error)
        else:
            continue
        if not still_current():  # a rebalance began while the copy was sent: leave the rest
            break
    return done


batch_handlers[settings.events_topic] = ingest_batch


_rate_log = RateLimitedLog(log)


def _log_refused(result: Result) -> None:
    """A new node id past `max_nodes`: counted in /stats; the log only says it is happening."""
    node_id = result.env.node_id[:128] if result.env is not None else "?"
    _rate_log.emit("node-cap", logging.WARNING, "node %r refused: %s node ids tracked (max_nodes), none expired",
                   node_id, len(runtime.index.nodes))


async def send_to_dlq(msg, error: DecodeError) -> None:
    """Never raises: a DLQ the broker refuses (or cannot reach) must not stop the index. A message whose
    record a restore found already written (the replay after a crash: processors/routing/dlqtail.py) is
    not sent again; it still counts in `dlq_by_reason`, which counts classifications, not records."""
    if runtime.dlq_written.take(msg.partition, msg.offset):
        runtime.dlq_already_written += 1
        return
    value, headers = dlq_record(msg.value, error, msg.topic, msg.partition, msg.offset,
                                settings.dlq_copy_max_bytes, settings.dlq_excerpt_bytes)
    try:
        # force=True: send now, not when the offset commits (offset commits mean little here).
        key = msg.key if msg.key is None or len(msg.key) <= 1024 else msg.key[:1024]
        sent = await dlq_topic.send(key=key, value=value, force=True, headers=headers)
    except Exception as exc:
        _dlq_failed(msg, error, exc)
        return

    def settled(f: asyncio.Future[Any]) -> None:
        failure = None if f.cancelled() else f.exception()
        if failure is not None:
            _dlq_failed(msg, error, failure)
        elif not f.cancelled():
            runtime.dlq_sent += 1

    # Not awaited (a flood of bad input must not run at one broker round trip per message):
    # a refusal arrives on the future and is counted there. Faust declares an Awaitable; the producer hands
    # back its asyncio Future, which ensure_future returns as is (typed as the Future it is).
    asyncio.ensure_future(sent).add_done_callback(settled)


def _dlq_failed(msg, error: DecodeError, exc: BaseException) -> None:
    runtime.dlq_send_errors += 1
    _rate_log.emit("dlq-send", logging.WARNING, "DLQ copy of %s/%s offset %s (%s) not sent: %s: %s",
                   msg.topic, msg.partition, msg.offset, error.kind, type(exc).__name__, exc)


# -- the collector ----------------------------------------------------------------------------------


@app.task
async def freeze_startup_heap() -> None:
    """What exists once the worker runs (modules, Faust, aiokafka, the app: ~90 k objects, 16 ms of
    CPU per walk) is never garbage: out of the collector's full walks. Ingest is this loop's Python, so
    a full collection stops it; with two cores full, one such walk was seen taking 128 ms of wall time
    (docs/architecture.md, "Ingest beside a busy route server")."""
    gc.freeze()


# -- liveness ---------------------------------------------------------------------------------------


@app.timer(interval=max(0.5, min(5.0, settings.node_ttl_s / 4)))
async def expire_silent_nodes() -> None:
    now = time.time()
    for p in list(runtime.ingest.applied_offset):
        # The lifetimes it closes are the analytics app's business (kvpipe.processors.analytics.agents).
        runtime.index.expire(partition_now(p, now), settings.node_ttl_s, partition=p)


def partition_now(partition: int, now: float) -> float:
    return rebalance.partition_now(app, runtime.ingest, settings.events_topic, partition, now)


# -- durability -------------------------------------------------------------------------------------


def owned_partitions() -> list[int]:
    return rebalance.owned_partitions(app, settings.events_topic)


async def flush_side_effects() -> None:
    """Make DLQ messages durable before a snapshot claims their offsets."""
    await app.producer.flush()


# Snapshots go through a producer of their own, never the app's: Faust flushes the app's producer
# before each offset commit, and ingest waits for commits (durability.SnapshotProducer says how).
snapshot_producer = SnapshotProducer(settings.bootstrap(), settings.snapshot_topic, settings.snapshot_timeout_s,
                                     max(settings.max_message_bytes, 2 * 1024 * 1024))


@app.timer(interval=settings.snapshot_every_s)
async def snapshot_partitions() -> None:
    try:
        await runtime.durability.snapshot(snapshot_producer, owned_partitions(), flush_side_effects)
    except asyncio.TimeoutError:  # the cluster did not acknowledge (counted in /stats): no traceback to read
        log.warning("periodic snapshot not acknowledged within %g s (%d failed so far); ingest goes on, a restart "
                    "replays from the previous snapshot", runtime.durability.timeout_s,
                    runtime.durability.stats["snapshot_errors"])
    except Exception:
        log.exception("periodic snapshot failed; a restart replays from the previous one")


async def _snapshot_revoked(partitions: list[int]) -> None:
    await runtime.durability.snapshot(snapshot_producer, partitions, flush_side_effects)


rebalance.connect(app, runtime.durability, runtime.ingest, settings.events_topic, _snapshot_revoked)


@connect(app.on_before_shutdown)
async def snapshot_on_shutdown(app: Any, *args: Any, **kwargs: Any) -> None:
    try:
        await runtime.durability.snapshot(snapshot_producer, sorted(runtime.ingest.applied_offset), flush_side_effects)
    except Exception:
        log.exception("snapshot at shutdown failed (the next start replays from the previous one)")
    await snapshot_producer.stop()
