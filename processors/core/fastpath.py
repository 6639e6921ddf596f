"""Faust's per-message overheads that this processor does not need, removed at two seams Faust
offers (the transport class and the `Monitor` sensor setting). Measured on the real worker with
py-spy, `kvpipe bench ingest`; numbers in BENCHMARKS.md.

1. Delivery without two tasks per message (`FastDrainConsumer`).

Why: profiling the real worker (py-spy, 40k envelopes) showed Faust's `Consumer._drain_messages`
wrapping *every* message in `Service.wait_first(callback(message), suspend_flow.wait())`: two
tasks, an `asyncio.wait` and a cancel per message. With an agent that only counts, that alone
held the worker at 5.4k msgs/s; delivering directly reached 12.3k msgs/s on the same machine.

What `wait_first` protects against: the callback (`Conductor.on_message`) can block — on flow
control while a rebalance has suspended the streams, on Faust's producer buffer (table changelogs;
we have none), on the conductor's callback lock, or on a full stream queue — and a rebalance must
be able to abandon such a blocked delivery. So the direct call is made only when the first and
the third cannot block (checked synchronously right before the call; nothing else runs on the
loop between the check and the call's first suspension point): consumer flow active,
`app.flow_control` not suspended (no rebalance in progress), the callback lock free. Otherwise
Faust's own `wait_first` delivery is used, so behaviour around a rebalance is Faust's.

The other two cannot hang the loop: a full stream queue is cleared by a rebalance
(`flow_control.clear()` cancels blocked putters, which ends the call), and the producer buffer
only fills from `send_soon` (table changelogs; this app has no tables) and its wait is a flush
that does not need this loop. Checking its size per message cost 5% (it reads `app.conf`).

2. `QuietMonitor`: Faust's `Monitor` sensor keeps per-event statistics (timings, per-stream
and per-task counters, a dict per event) on every message in and out: ~6% of the worker. Nothing
here reads them (`/stats` is ours), so those four hooks are no-ops but for the stream's last-event
time, which Faust's livelock check reads; the rest of the Monitor
(commit and end-offset tracking Faust calls directly) stays.

The rest of the loop (read offsets, gap tracking, `broker_commit_every`) is Faust 0.15.3's
`_drain_messages` unchanged; `install` refuses other Faust versions rather than guess.
"""
from __future__ import annotations

import asyncio
import logging
from time import monotonic
from typing import Any, cast

import faust
from faust.sensors import Monitor
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka

log = logging.getLogger(__name__)

SUPPORTED_FAUST = ("0.15.3",)


# Faust's own fetch sizing: the broker answers on the first byte, so a quiet topic costs nothing
QUIET_SIZING = (1, 1500)


def next_sizing(had_data: bool, busy: tuple[int, int]) -> tuple[int, int]:
    """The (fetch_min_bytes, fetch_max_wait_ms) of the next fetch: `busy` while fetches come back with records, Faust's
    own once one comes back empty. Full-sized fetches spare a busy app a fetch's fixed cost per few messages; on a
    quiet topic they would poll every wait (an idle routing app: 0.14 cores instead of 0.006, BENCHMARKS.md)."""
    return busy if had_data else QUIET_SIZING


def follow_load(fetcher: Any, busy: tuple[int, int]) -> dict[str, int]:
    """Make aiokafka's `fetcher` size each fetch by `next_sizing` of the one before (it reads its two attributes when
    it builds a request). Returns the counts it keeps: fetches answered with records and without.

    One exception: a fetch built while fetched records still wait to be consumed (the app is behind) is busy-sized
    whatever the one before said. aiokafka sends it for the partitions without buffered records once the others'
    have waited `prefetch_backoff` (0.1 s), and keeps one fetch in flight per broker: held for Faust's 1.5 s because
    those partitions are at their end, it kept the others, consumed meanwhile, from fetching their next records (the
    analytics app catching up behind its store: both threads idle for ~1.1 s, twice a run, py-spy)."""
    counts = {"fetches_with_records": 0, "fetches_empty": 0}
    fetch = fetcher._proc_fetch_request
    plan = fetcher._get_actions_per_node

    async def fetch_then_size(assignment: Any, node_id: Any, request: Any) -> Any:
        had_data = await fetch(assignment, node_id, request)
        counts["fetches_with_records" if had_data else "fetches_empty"] += 1
        fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms = next_sizing(bool(had_data), busy)
        return had_data

    def plan_sized(assignment: Any) -> Any:
        if fetcher._records:  # records fetched and not consumed yet: no fetch may be held long now
            fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms = busy
        return plan(assignment)

    fetcher._proc_fetch_request = fetch_then_size
    fetcher._get_actions_per_node = plan_sized
    fetcher._fetch_min_bytes, fetcher._fetch_max_wait_ms = QUIET_SIZING
    return counts


class FetchTunedConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """Faust's consumer thread, its fetches sized by `follow_load` with the consumer's `fetch` (Faust's consumer has no
    setting for it; the settings `fetch_min_bytes`/`fetch_max_wait_ms` say why)."""

    fetch_counts: dict[str, int] | None = None

    async def on_start(self) -> None:
        await super().on_start()
        busy = getattr(self.consumer, "fetch", None)
        fetcher = getattr(self._consumer, "_fetcher", None)  # made by aiokafka's start
        if busy is not None and fetcher is not None and hasattr(fetcher, "_proc_fetch_request") \
                and hasattr(fetcher, "_get_actions_per_node") and hasattr(fetcher, "_records"):
            self.fetch_counts = follow_load(fetcher, busy)


def fetch_in_effect(consumer: Any) -> dict[str, int]:
    """The sizing the running client's next fetch uses and the fetch counts (what `/stats` shows); empty before it
    starts, or from a client built differently."""
    thread = getattr(consumer, "_thread", None)
    fetcher = getattr(getattr(thread, "_consumer", None), "_fetcher", None)
    sizing = {"fetch_min_bytes": getattr(fetcher, "_fetch_min_bytes", None),
              "fetch_max_wait_ms": getattr(fetcher, "_fetch_max_wait_ms", None),
              **(getattr(thread, "fetch_counts", None) or {})}
    return {k: v for k, v in sizing.items() if isinstance(v, int)}


def deliveries(consumer: Any) -> dict[str, int | None]:
    """How the consumer handed messages over, for `/stats` of either app: directly vs through Faust's wait
    (this module), runs to the batch handler, their records and those left for a re-fetch after a rebalance
    (`batchdelivery`), and the fetch sizing; null where the consumer lacks that path."""
    return {"direct": getattr(consumer, "direct_deliveries", None), "waited": getattr(consumer, "waited_deliveries", None),
            **getattr(consumer, "batch_stats", {}), **fetch_in_effect(consumer)}


class FastDrainConsumer(faust_aiokafka.Consumer):
    # how many messages took the direct call vs Faust's wait_first (shown in /stats)
    direct_deliveries = 0
    waited_deliveries = 0
    # (fetch_min_bytes, fetch_max_wait_ms) for the worker's consumer, set per app by `install`; None: Faust's
    fetch: tuple[int, int] | None = None

    def _new_consumer_thread(self) -> faust_aiokafka.AIOKafkaConsumerThread:
        return FetchTunedConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - exercised by the worker
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        get_read_offset = self._read_offset.__getitem__
        set_read_offset = self._read_offset.__setitem__
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for
        app = self.app
        flow_control = app.flow_control
        callback_lock = cast(Any, app.topics)._tp_to_callback_lock
        suspend_flow = self.suspend_flow

        yield_every = 100
        num_since_yield = 0
        sleep = asyncio.sleep
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(CONSUMER_FETCHING)
                ait = getmany(timeout=1.0)
                await self.sleep(0)  # Faust's: getmany may return at once, again and again
                if not self.should_stop:
                    async for tp, message in ait:
                        num_since_yield += 1
                        if num_since_yield > yield_every:
                            await sleep(0)
                            num_since_yield = 0
                        offset = message.offset
                        r_offset = get_read_offset(tp)
                        if r_offset is None or offset >= r_offset:
                            gap = offset - (r_offset or 0)
                            if gap > 1 and r_offset and acks_enabled_for(message.topic):
                                await self._add_gap(tp, r_offset + 1, offset)
                            if commit_every is not None and self._n_acked >= commit_every:
                                self._n_acked = 0
                                await self.commit()
                            if (self.flow_active and not suspend_flow.is_set() and flow_control.is_active()
                                    and not callback_lock.locked()):
                                self.direct_deliveries += 1
                                await callback(message)
                            else:
                                self.waited_deliveries += 1
                                await self.wait_first(callback(message), suspend_flow.wait())
                            set_read_offset(tp, offset)
                    self.diag.unset_flag(CONSUMER_FETCHING)
        except BaseException as exc:
            if drain_stopped(self, exc):
                return
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)


def drain_stopped(consumer: Any, exc: BaseException) -> bool:
    """How a drain loop ends, as Faust 0.15.3's `_drain_messages` ends: True (return quietly) when
    the app is stopping and the consumer was stopped or the loop cancelled; otherwise the exception
    propagates, logged unless it is one of those two."""
    stopped = isinstance(exc, tuple(consumer.consumer_stopped_errors))
    if stopped or isinstance(exc, asyncio.CancelledError):
        if consumer.transport.app.should_stop:
            consumer.log.info("Broker stopped consumer, shutting down..." if stopped
                              else "Consumer shutting down for user cancel.")
            return True
        return False
    if isinstance(exc, Exception):
        consumer.log.exception("Drain messages raised: %r", exc)
    return False


class QuietMonitor(Monitor):
    """Faust's Monitor without the per-message and per-event bookkeeping (see the module doc)."""

    def on_message_in(self, tp, offset, message) -> None:
        pass

    def on_stream_event_in(self, tp, offset, stream, event) -> None:
        # the one field Faust itself reads back: its livelock check warns about a lagging partition
        # whose stream never processed anything
        self.stream_inbound_time[tp] = monotonic()

    def on_stream_event_out(self, tp, offset, stream, event, state=None) -> None:
        pass

    def on_message_out(self, tp, offset, message) -> None:
        pass


class FastDrainTransport(faust_aiokafka.Transport):
    Consumer = FastDrainConsumer


def supported(app: faust.App) -> bool:
    """Whether the drain loops here (and kvpipe.processors.core.batchdelivery's) fit `app`: the Faust version
    they were checked against, and a Kafka broker URL."""
    if faust.__version__ not in SUPPORTED_FAUST:
        log.warning("faust %s: fast drain not checked for this version; using Faust's own consumer", faust.__version__)
        return False
    return app.conf.broker_consumer[0].scheme.startswith("kafka")


def install(app: faust.App, fetch: tuple[int, int] | None = None) -> bool:
    """Give `app` the fast-drain transport (before anything creates its consumer), its consumer fetching with
    `fetch` = (fetch_min_bytes, fetch_max_wait_ms) if given. Returns False and leaves Faust's transport in
    place on a Faust version this was not checked against."""
    if not supported(app):
        return False
    app.transport = transport_for(app, FastDrainConsumer, fetch)
    return True


def transport_for(app: faust.App, consumer_base: type[FastDrainConsumer], fetch: tuple[int, int] | None,
                  **attrs: Any) -> FastDrainTransport:
    """A transport for `app` whose consumer is a subclass of `consumer_base` of its own (apps do not share
    class attributes) with `fetch` and `attrs`."""
    consumer_cls = type(f"App{consumer_base.__name__}", (consumer_base,), {"fetch": fetch, **attrs})
    transport_cls = type(f"App{consumer_base.__name__}Transport", (FastDrainTransport,), {"Consumer": consumer_cls})
    return transport_cls(app.conf.broker_consumer, app)
