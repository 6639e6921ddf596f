"""The routing app's native route server: `POST /route` answered on native threads beside ingest.

With `route_port` set, the app starts `kvpipe_native.NativeRouter.serve` on that port at start-up. The server reads
the index's native store under its reader-writer lock while the agent applies events, so queries neither wait for
the event loop nor make ingest wait behind them; it answers the common request itself (token ids or the
hash-unit chain, at most `top_k`: `processors/router/native.py` says exactly when) and passes every other request — other paths, other
request forms, and all of them while the native path is closed — to this app's own web port, which answers as
before. Auth, body size, read timeout and the error bodies are the app's (native/src/serve.rs).

A timer pushes the nodes' live state every `route_refresh_s` and re-exports the plan when the index's nodes move.
The server's counters and latency histograms are in `/stats` (`route_server`) and `/metrics`. It stops with the
app, letting requests in flight finish.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvpipe.processors.core.signals import connect
from kvpipe.processors.routing.app import app, settings
from kvpipe.processors.router.decide import _default_search
from kvpipe.processors.core import native
from kvpipe.processors.router.native import NativeRoute
from kvpipe.processors.routing.state import expected_partitions, owned_partitions, runtime

log = logging.getLogger(__name__)


class Serving:
    """The native route path of this worker, once started."""

    def __init__(self) -> None:
        self.route: NativeRoute | None = None
        self.server: native.RouteServer | None = None
        self.error = ""

    def start(self) -> None:
        if not settings.route_port:
            return
        if runtime.index.store.kind != "native":
            why = native.reason() or "the index store is the Python one (index_store=python)"
            self.error = f"{why}: /route is served by the web port only"
            log.warning("kvpipe: route_port %s set, but %s", settings.route_port, self.error)
            return
        threads = settings.route_threads or len(os.sched_getaffinity(0))
        self.route = NativeRoute(runtime.index, _default_search(), settings.route_stale_after_s,
                                 serves_all=lambda: set(owned_partitions()) >= set(expected_partitions()),
                                 memo_entries=settings.route_hash_memo_entries)
        self.route.refresh(runtime.inflight)
        self.server = self.route.router.serve(settings.web_host, settings.route_port, threads,
                                              settings.api_token_value() or None, settings.http_max_body_bytes,
                                              settings.http_read_timeout_s, settings.web_port,
                                              settings.route_reuse_port, settings.route_nice)
        log.info("kvpipe: native route server on %s:%s (%d threads; other requests go to port %s)",
                 settings.web_host, self.server.port, threads, settings.web_port)

    def refresh(self) -> None:
        if self.route is not None:
            self.route.refresh(runtime.inflight, seen=runtime.ingest.counters["messages"])

    def stats(self) -> dict:
        if self.server is None:
            return {"enabled": bool(settings.route_port), "running": False, "error": self.error}
        out = dict(self.server.stats())
        route = self.route
        assert route is not None
        out.update(enabled=True, running=self.server.running, port=self.server.port, native_open=route.router.ready,
                   closed_because=getattr(route, "open_reason", "") or None, plan_generation=route.exported,
                   hash_memo=dict(route.router.memo_stats()))
        return out

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(5.0)


class ServerCollector:
    """`/metrics` families of the native route server, read from its counters at scrape time."""

    def __init__(self, serving: Serving, prefix: str = "kvpipe_processor_route_server") -> None:
        self.serving, self.prefix = serving, prefix

    def collect(self) -> Iterator[Metric]:
        server = self.serving.server
        if server is None:
            return
        s = server.stats()
        requests = CounterMetricFamily(f"{self.prefix}_requests", "requests the native route server handled, by "
                                       "outcome (native: answered natively; forwarded: by the web port)",
                                       labels=["outcome"])
        for outcome, n in sorted(s["requests"].items()):
            requests.add_metric([outcome], n)
        yield requests
        yield GaugeMetricFamily(f"{self.prefix}_in_flight", "requests being answered now", value=s["in_flight"])
        yield GaugeMetricFamily(f"{self.prefix}_native_open", "1 while the native path answers /route (0: every "
                                "request goes to the web port; /stats route_server.closed_because says why)",
                                value=1 if self.serving.route is not None and self.serving.route.router.ready else 0)
        memo = self.serving.route.router.memo_stats() if self.serving.route is not None else None
        if memo is not None:
            units = CounterMetricFamily(f"{self.prefix}_hash_memo_units", "prompt units of token-id requests, by "
                                        "whether their digest came from the memo (hit) or was computed (miss)",
                                        labels=["outcome"])
            units.add_metric(["hit"], memo["hits"])
            units.add_metric(["miss"], memo["misses"])
            yield units
            yield GaugeMetricFamily(f"{self.prefix}_hash_memo_entries", "held units' digests remembered now "
                                    "(at most route_hash_memo_entries)", value=memo["entries"])
            yield CounterMetricFamily(f"{self.prefix}_id_text_ids", "token ids of requests read from the remembered "
                                      "text of held prefixes instead of digit by digit", value=memo["text_taken"])
            yield GaugeMetricFamily(f"{self.prefix}_id_text_held_ids", "token ids whose text is remembered now (at "
                                    "most 16 x route_hash_memo_entries)", value=memo["text_ids"])
        for name, what in (("native_latency", "body read to answer ready, native answers"),
                           ("request_latency", "whole requests, every outcome")):
            h = s[name]
            family = HistogramMetricFamily(f"{self.prefix}_{name}_seconds", what)
            family.add_metric([], [(floatToGoString(b), c) for b, c in zip(h["bounds"], h["cumulative"])],
                              sum_value=h["sum"])
            yield family


serving = Serving()
runtime.metrics.registry.register(ServerCollector(serving))


@app.task
async def start_route_server() -> None:
    serving.start()


if settings.route_port:
    @app.timer(interval=max(0.001, settings.route_refresh_s))
    async def refresh_route_server() -> None:
        serving.refresh()


@connect(app.on_before_shutdown)
async def stop_route_server(app: Any, *args: Any, **kwargs: Any) -> None:  # noqa: ARG001 - Faust's signal signature
    serving.stop()
