"""Bridge counters, and a tiny HTTP server exposing them on `/metrics` (prometheus_client's exposition).

Each rank's thread is the only writer of its `Counters`; the HTTP thread and the log line only
read them, so plain ints suffice (a read may be one increment behind, never torn).
"""
from __future__ import annotations

import hmac
import threading
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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


class _BridgeCollector:
    def __init__(self, nodes: list[tuple[str, Counters, list[Mismatch]]]) -> None:
        self.nodes = nodes

    def collect(self):
        for field, (name, text) in FAMILIES.items():
            family = CounterMetricFamily(f"kvpipe_bridge_{name}", text, labels=["node"])
            for node, c, _ in self.nodes:
                family.add_metric([node], getattr(c, field))
            yield family
        dlq = CounterMetricFamily("kvpipe_bridge_dlq_messages", "messages for the dead-letter topic, by outcome",
                                  labels=["node", "outcome"])
        for node, c, _ in self.nodes:
            for field, outcome in DLQ_OUTCOMES.items():
                dlq.add_metric([node, outcome], getattr(c, field))
        yield dlq
        # One series per distinct mismatch so an operator sees what to fix, not just that it happened.
        mismatch = GaugeMetricFamily("kvpipe_bridge_spec_mismatch", "declared spec contradicted by events "
                                     "(value always 1)", labels=["node", "group", "field", "declared", "observed"])
        for node, _, mismatches in self.nodes:
            for m in mismatches:
                mismatch.add_metric([node, str(m.group_idx), m.field, str(m.declared), str(m.observed)], 1)
        yield mismatch


def render(nodes: Iterable[tuple[str, Counters, list[Mismatch]]]) -> str:
    """Prometheus text exposition (prometheus_client): the counters by node, and process metrics."""
    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    registry.register(_BridgeCollector(list(nodes)))
    return generate_latest(registry).decode()


def bearer_ok(header: str | None, token: str) -> bool:
    """True if an Authorization header carries `token` (constant-time; as kvpipe.processors.core.webauth)."""
    scheme, _, value = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class MetricsServer:
    """`GET /metrics` on a daemon thread; `port=0` picks a free port (see `.port`). With a `token`,
    a scrape must send `Authorization: Bearer <token>` (401 otherwise)."""

    def __init__(self, host: str, port: int, render_fn: Callable[[], str], token: str = "") -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                if token and not bearer_ok(self.headers.get("Authorization"), token):
                    body = b'{"error": "unauthorized", "detail": "send Authorization: Bearer <KVPIPE_API_TOKEN>"}'
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", "Bearer")
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics lives here")
                    return
                body = render_fn().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # scrapes are not worth a log line each
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="bridge-metrics", daemon=True)

    def start(self) -> "MetricsServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
