"""The bridge's load scrape: vLLM's Prometheus gauges, served by a small local HTTP server, become
each rank's (running, waiting, kv_usage)."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpipe.producer.bridge.engine_load import EngineLoad, LoadScraper, parse_load
from kvpipe.producer.bridge.cli import bridge
from kvpipe.schemas.cliopts import parse

# The shape of vLLM's /metrics for two data-parallel engines (gauges per engine, plus noise)
PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="google/gemma-3-4b-it"} 7.0
vllm:num_requests_running{engine="1",model_name="google/gemma-3-4b-it"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="google/gemma-3-4b-it"} 3.0
vllm:num_requests_waiting{engine="1",model_name="google/gemma-3-4b-it"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="google/gemma-3-4b-it"} 0.8125
vllm:kv_cache_usage_perc{engine="1",model_name="google/gemma-3-4b-it"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="google/gemma-3-4b-it"} 12345.0
"""
LEGACY = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""


def test_each_rank_reads_its_own_engine_and_an_unlabelled_page_counts_whole():
    assert parse_load(PAGE, 0) == EngineLoad(7, 3, 0.8125)
    assert parse_load(PAGE, 1) == EngineLoad(2, 0, 0.25)
    assert parse_load(PAGE, None) == EngineLoad(9, 3, 0.8125)  # summed queues, the fullest cache
    assert parse_load(LEGACY, 0) == EngineLoad(1, 0, 0.5)  # no engine label; the deprecated usage name
    assert parse_load("# TYPE other gauge\nother 1\n", 0) is None


class _Metrics(BaseHTTPRequestHandler):
    page = PAGE.encode()
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_a_scrape_hands_every_rank_its_load_and_a_failure_keeps_the_last(engine):
    got: dict[int, tuple] = {}
    url = f"http://127.0.0.1:{engine.server_port}/metrics"
    scraper = LoadScraper(url, [(r, lambda *load, r=r: got.__setitem__(r, load)) for r in (0, 1)], timeout_s=2.0)
    assert scraper.scrape_once() and got == {0: (7, 3, 0.8125), 1: (2, 0, 0.25)}
    _Metrics.status = 500
    try:
        assert not scraper.scrape_once()
    finally:
        _Metrics.status = 200
    assert got[0] == (7, 3, 0.8125) and scraper.counters == {"scrapes": 1, "failures": 1, "no_load_metrics": 0}
    # the background loop keeps scraping
    scraper.every_s = 0.05
    scraper.start()
    try:
        for _ in range(100):
            if scraper.counters["scrapes"] >= 3:
                break
            threading.Event().wait(0.05)
    finally:
        scraper.stop()
    assert scraper.counters["scrapes"] >= 3


def test_the_bridge_cli_takes_the_metrics_url_and_refuses_a_non_http_one():
    params = parse(bridge, ["--zmq", "tcp://x:1", "--node-id", "n", "--metrics-url", "http://n:8000/metrics"])
    assert params["metrics_url"] == "http://n:8000/metrics" and params["metrics_every"] == 1.0
    with pytest.raises(ValueError, match="expected http"):
        LoadScraper("file:///etc/passwd", [])
