"""Bridge counters, exposed on `/metrics` by prometheus_client's own WSGI app and server.

Each rank's thread is the only writer of its `Counters`; the HTTP thread and the log line only
read them, so plain ints suffice (a read may be one increment behind, never torn).
"""
from __future__ import annotations

import hmac
import json
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer

from kvpipe.producer.bridge.specs import Mismatch

# Counters field → (family name after `kvpipe_bridge_`, help). Families carry a `node` label
# (node id / dp rank); counters get `_total` from prometheus_client.
FAMILIES = {
    "batches": ("batches", "vLLM batches forwarded to Kafka (live and replayed)"),
    "events": ("kv_events", "KV events in the forwarded batches"),
    "gaps": ("seq_gaps", "seq jumps seen on the live stream"),
    "replayed": ("replayed_batches", "batches recovered from vLLM's replay ring and forwarded"),
    "lost": ("lost_batches", "batches known lost (gone from the replay ring, replay timed out, or undecodable)"),
    "replay_timeouts": ("replay_timeouts", "replay requests that hit the deadline"),
    "restarts": ("publisher_restarts", "vLLM publisher restarts seen (seq went backwards): new epochs"),
    "malformed": ("malformed_messages", "messages with a bad frame shape or an undecodable payload"),
    "publish_rejected": ("publish_rejected_batches", "batches the publisher refused (its queue was full; "
                         "reported as dropped)"),
    "spec_mismatches": ("spec_mismatches", "declared group specs / hash config contradicted by vLLM's events"),
    "recorded": ("recorded_messages", "messages written to a capture file (--record)"),
    "silence_warnings": ("silence_warnings", "times no frame arrived within --silence-warn-s (after connecting "
                         "or since the last frame)"),
}
# dead letters: one family, the outcome as a label
DLQ_OUTCOMES = {"dlq": "sent", "dlq_failed": "failed"}


@dataclass(slots=True)
class Counters:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    replay_timeouts: int = 0
    restarts: int = 0
    malformed: int = 0
    dlq: int = 0
    dlq_failed: int = 0
    publish_rejected: int = 0
    spec_mismatches: int = 0
    recorded: int = 0
    silence_warnings: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


Nodes = Iterable[tuple[str, Counters, list[Mismatch]]]


class _BridgeCollector:
    """The counters of the nodes `nodes()` names at each scrape (ranks come and go with the bridge)."""

    def __init__(self, nodes: Callable[[], Nodes]) -> None:
        self.nodes = nodes

    def collect(self):
        nodes = list(self.nodes())
        for field, (name, text) in FAMILIES.items():
            family = CounterMetricFamily(f"kvpipe_bridge_{name}", text, labels=["node"])
            for node, c, _ in nodes:
                family.add_metric([node], getattr(c, field))
            yield family
        dlq = CounterMetricFamily("kvpipe_bridge_dlq_messages", "messages for the dead-letter topic, by outcome",
                                  labels=["node", "outcome"])
        for node, c, _ in nodes:
            for field, outcome in DLQ_OUTCOMES.items():
                dlq.add_metric([node, outcome], getattr(c, field))
        yield dlq
        # One series per distinct mismatch so an operator sees what to fix, not just that it happened.
        mismatch = GaugeMetricFamily("kvpipe_bridge_spec_mismatch", "declared spec contradicted by events "
                                     "(value always 1)", labels=["node", "group", "field", "declared", "observed"])
        for node, _, mismatches in nodes:
            for m in mismatches:
                mismatch.add_metric([node, str(m.group_idx), m.field, str(m.declared), str(m.observed)], 1)
        yield mismatch


def registry(nodes: Callable[[], Nodes]) -> CollectorRegistry:
    """The bridge's registry: its counters by node (read at each scrape) and the process metrics."""
    reg = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=reg)
    reg.register(_BridgeCollector(nodes))
    return reg


def render(nodes: Nodes) -> str:
    """The exposition text of `nodes`' counters (the log and tests; the server serves `registry`)."""
    frozen = list(nodes)
    return generate_latest(registry(lambda: frozen)).decode()


def bearer_ok(header: str | None, token: str) -> bool:
    """True if an Authorization header carries `token` (constant-time; as kvpipe.processors.core.webauth)."""
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not worth a log line each
        pass


def _guarded(app: Callable, token: str) -> Callable:
    """`app` behind the bearer token (when one is set) and on `/metrics` only."""
    def guarded(environ: dict, start_response: Callable) -> Any:
        if token and not bearer_ok(environ.get("HTTP_AUTHORIZATION"), token):
            body = json.dumps({"error": "unauthorized",
                               "detail": "send Authorization: Bearer <KVPIPE_API_TOKEN>"}).encode()
            start_response("401 Unauthorized", [("WWW-Authenticate", "Bearer"), ("Content-Type", "application/json"),
                                                ("Content-Length", str(len(body)))])
            return [body]
        if environ.get("PATH_INFO", "") != "/metrics":
            body = b'{"error": "not found", "detail": "only /metrics lives here"}'
            start_response("404 Not Found", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        return app(environ, start_response)
    return guarded


class MetricsServer:
    """`GET /metrics` of `reg` on a daemon thread: prometheus_client's WSGI app (content negotiation,
    OpenMetrics, gzip) on its threading WSGI server; `port=0` picks a free port (see `.port`). With a
    `token`, a scrape must send `Authorization: Bearer <token>` (401 otherwise)."""

    def __init__(self, host: str, port: int, reg: CollectorRegistry, token: str = "") -> None:
        self._server = make_server(host, port, _guarded(make_wsgi_app(reg), token), ThreadingWSGIServer,
                                   handler_class=_Quiet)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="bridge-metrics", daemon=True)

    def start(self) -> "MetricsServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
