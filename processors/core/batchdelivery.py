"""Batched delivery: each partition's run of fetched records goes to one handler call, instead of
one Faust event per message (`processor_delivery = "batch"`, the default; BENCHMARKS.md, ingest).

Why: with direct delivery (kvpipe.processors.core.fastpath) the worker still paid Faust's machinery once per
message: a `ConsumerMessage`, the conductor's flow-control and producer-buffer awaits, an `Event`,
the stream queue, the stream iterator with its ack. Here the drain loop hands a partition's records,
as the client fetched them, to the handler registered for their topic, and does Faust's bookkeeping
once per run. Options measured in BENCHMARKS.md: Faust's own `Stream.take_events` batches only the
agent's side and keeps every per-message step before it; this seam removes them.

What is kept from Faust 0.15.3 (`Consumer.getmany`, `_drain_messages` and `ack` in its
transport/consumer.py), per run instead of per message:
- records below the partition's read offset are not delivered (a re-fetch after a seek); holes in
  the offsets are recorded (`_add_gap`) so commits can pass them; `broker_commit_every` commits;
- the handled records are acked as the stream would ack them: their offsets join `_acked`, so
  Faust's commit timer commits them as before (correctness never trusts a committed offset, see
  kvpipe.processors.core.durability, but it is the group's lag for every Kafka tool);
- the read offset moves to the last handled record.
Faust's per-message sensor hooks are not called for batched records (this app's `QuietMonitor`
ignores them anyway); the end-offset tracking and the stream's last-event time (what Faust's
livelock check reads) are kept, once per run.

Rebalance: a run is delivered only while no rebalance is in progress (consumer flow active, the
streams' flow control active, the consumer generation the records were fetched in). Otherwise the
rest of the fetch is dropped undelivered and unacked. That is what Faust does with such records
(`getmany` stops, the stream skips other generations), and it is safe for the same reason: every
rebalance ends with a seek of every assigned partition (Faust's `perform_seek`, to the offsets
kvpipe.processors.core.durability commits), so the records are fetched again by the partition's owner.
The handler is synchronous except for its side effects (the routing app's DLQ send) and its waits (the
analytics app waits for room in its sink); after each await it asks `still_current()` and stops if a
rebalance began (having handled none, if it waited before its first record), and the records it did not
report handled are neither acked nor skipped over.

Ordering: a partition's records reach the handler in offset order, one call at a time, from this
loop only; in this mode no message of a batched topic goes through the conductor to a stream.
Topics with no batch handler are delivered one message at a time as `FastDrainConsumer` does.
"""
from __future__ import annotations

import asyncio
from time import monotonic
from typing import Any, Awaitable, Callable, Mapping, Sequence, cast

import faust
from faust.transport.consumer import CONSUMER_FETCHING
from faust.types.tuples import ack_lock
from mode.utils.futures import notify

from kvpipe.processors.core import fastpath

# (records of one partition in offset order, still_current) → how many were handled from the front:
# all of them unless still_current() turned False (a rebalance began while it awaited a side effect)
BatchHandler = Callable[[Sequence[Any], Callable[[], bool]], Awaitable[int]]


def ack_offsets(consumer: Any, tp: Any, offsets: list[int]) -> int:
    """Faust's `Consumer.ack` for the delivered `offsets` of `tp` at once: offsets below the
    committed one and offsets acked already are left out, as `ack` leaves them. Returns how many
    were acked."""
    with ack_lock:
        committed = consumer._committed_offset[tp]
        if committed is not None and offsets and offsets[0] < committed:
            offsets = [o for o in offsets if o >= committed]
        index = consumer._acked_index[tp]
        if index and not index.isdisjoint(offsets):  # a re-delivery after a seek back
            offsets = [o for o in offsets if o not in index]
        if offsets:
            index.update(offsets)
            consumer._acked[tp].extend(offsets)
            consumer._n_acked += len(offsets)
        notify(consumer._waiting_for_ack)
        return len(offsets)


def holes(offsets: list[int], read_offset: int | None) -> list[tuple[int, int]]:
    """The `(first, last)` offset ranges Faust records as gaps before each of `offsets` (its
    `_drain_messages`: a jump of more than one from the previous read offset, none before the
    first record after a seek to 0)."""
    out = []
    prev = read_offset
    for o in offsets:
        if prev and o - prev > 1:
            out.append((prev + 1, o))
        prev = o
    return out


class BatchDrainConsumer(fastpath.FastDrainConsumer):
    """Faust's aiokafka consumer whose drain loop delivers runs of records (see the module doc)."""

    # topic → handler; set per app by `install` (a subclass per app, so apps do not share it)
    batch_handlers: dict[str, BatchHandler] = {}
    # Records per handler call: a run holds the event loop while it is applied, so a long one (a
    # backlog's fetch: up to broker_max_poll_records) is cut into slices with the loop yielded in
    # between, as Faust's drain loop yields every 100 messages. 256 × ~40 µs ≈ 10 ms of /route wait.
    max_run = 256

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # shown in /stats: runs handed to a handler, the records in them, records left for the re-fetch
        self.batch_stats = {"batches": 0, "batched": 0, "dropped_in_rebalance": 0}

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - exercised by the worker
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(CONSUMER_FETCHING)
                records, active = await self._wait_next_records(1.0)
                await self.sleep(0)  # Faust's: a fetch may return at once, again and again
                if records and not self.should_stop:
                    if self.flow_active:
                        await self._deliver_fetch(records, active)
                    else:  # as Faust's getmany: fetched while stopped → seek back, deliver nothing
                        try:
                            await self.perform_seek()
                        except Exception as exc:
                            self.log.warning("seek after a fetch while the flow was stopped failed: %r", exc)
                self.diag.unset_flag(CONSUMER_FETCHING)
        except BaseException as exc:
            if fastpath.drain_stopped(self, exc):
                return
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)

    def _still_current(self, generation: int) -> Callable[[], bool]:
        app = self.app
        flow_control = app.flow_control
        suspend_flow = self.suspend_flow

        def still_current() -> bool:
            return (self.flow_active and not suspend_flow.is_set() and flow_control.is_active()
                    and app.consumer_generation_id == generation)
        return still_current

    async def _deliver_fetch(self, records: Mapping[Any, list], active: set | None) -> None:
        current = self._still_current(self.app.consumer_generation_id)
        handlers = self.batch_handlers
        buffered = self._buffered_partitions
        track_end = self.app.monitor.track_tp_end_offset
        items = list(records.items())
        for i, (tp, recs) in enumerate(items):
            if not current():
                self.batch_stats["dropped_in_rebalance"] += sum(len(r) for _, r in items[i:])
                return
            if active is not None and tp not in active and tp not in buffered:
                continue
            track_end(tp, self.highwater(tp))
            handler = handlers.get(tp.topic)
            if handler is None:
                await self._deliver_each(tp, recs, current)
            else:
                await self._deliver_run(tp, recs, handler, current)

    async def _deliver_run(self, tp: Any, recs: list, handler: BatchHandler, current: Callable[[], bool]) -> None:
        read_offset = self._read_offset[tp]
        if read_offset is not None and recs[0].offset < read_offset:
            recs = [r for r in recs if r.offset >= read_offset]
            if not recs:
                return
        acks = self.app.topics.acks_enabled_for(tp.topic)
        first, last = recs[0].offset, recs[-1].offset
        if acks and ((read_offset and first - read_offset > 1) or last - first + 1 != len(recs)):
            for gap_from, gap_to in holes([r.offset for r in recs], read_offset):
                await self._add_gap(tp, gap_from, gap_to)
        if self._commit_every is not None and self._n_acked >= self._commit_every:
            self._n_acked = 0
            await self.commit()
        if not current():  # the awaits above let a rebalance begin
            self.batch_stats["dropped_in_rebalance"] += len(recs)
            return
        handled = 0
        step = self.max_run
        while handled < len(recs) and current():
            if handled:
                await asyncio.sleep(0)  # between slices: /route and the timers get the loop
            piece = recs if handled == 0 and len(recs) <= step else recs[handled:handled + step]
            n = await handler(piece, current)
            if n <= 0 and not current():
                break  # a rebalance began while the handler waited before its first record
            if n <= 0:
                raise RuntimeError(f"the batch handler of {tp.topic!r} handled none of {len(piece)} records")
            handled += n
        if handled < len(recs):
            self.batch_stats["dropped_in_rebalance"] += len(recs) - handled
        if handled <= 0 or not current():
            return  # not acked: after the rebalance's seek they come again (the index skips what it has)
        done = recs if handled == len(recs) else recs[:handled]
        if acks:
            ack_offsets(self, tp, [r.offset for r in done])
        self._read_offset[tp] = done[-1].offset
        self.batch_stats["batches"] += 1
        self.batch_stats["batched"] += handled
        # what a stream marks per event; Faust's livelock check reads it (fastpath.QuietMonitor)
        self.app.monitor.stream_inbound_time[tp] = monotonic()

    async def _deliver_each(self, tp: Any, recs: list, current: Callable[[], bool]) -> None:
        """A topic with no batch handler: one message at a time, as `FastDrainConsumer` does."""
        callback = self.callback
        acks_enabled_for = self.app.topics.acks_enabled_for
        callback_lock = cast(Any, self.app.topics)._tp_to_callback_lock
        for record in recs:
            if not current():
                return
            message = self._to_message(tp, record)
            offset = message.offset
            r_offset = self._read_offset[tp]
            if r_offset is None or offset >= r_offset:
                if offset - (r_offset or 0) > 1 and r_offset and acks_enabled_for(message.topic):
                    await self._add_gap(tp, r_offset + 1, offset)
                if self._commit_every is not None and self._n_acked >= self._commit_every:
                    self._n_acked = 0
                    await self.commit()
                if not callback_lock.locked():
                    self.direct_deliveries += 1
                    await callback(message)
                else:
                    self.waited_deliveries += 1
                    await self.wait_first(callback(message), self.suspend_flow.wait())
                self._read_offset[tp] = offset


def install(app: faust.App, handlers: dict[str, BatchHandler], fetch: tuple[int, int] | None = None) -> bool:
    """Give `app` the batch-delivering transport, `handlers` by topic name, fetching with `fetch` (as
    `fastpath.install`), before anything creates its consumer. Returns False, leaving the app as it was,
    where `fastpath` would not install."""
    if not fastpath.supported(app):
        return False
    app.transport = fastpath.transport_for(app, BatchDrainConsumer, fetch, batch_handlers=handlers)
    return True
