"""The engine's load for the router's score, scraped from vLLM's Prometheus `/metrics`
(`kvpipe bridge --metrics-url`): every envelope of a rank then carries `running`, `waiting` and
`kv_usage` (schemas/envelope.py; the score: processors/router/decide.py).

vLLM's metric names, as its engine exports them: the gauges
`vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`
(fraction 0..1 despite the name; `vllm:gpu_cache_usage_perc` is its deprecated older name, read
when the new one is absent). Each is one sample per engine, labelled `engine="<index>"` (and
`model_name`): a bridge rank reads the samples of its own data-parallel rank when the engine
label is there, else all samples (summed queues, the fullest cache).

A failed scrape (engine restarting, a timeout, an error status) keeps the last load on the envelopes and is
counted; the envelopes themselves never wait for a scrape.

The scrape is an `httpx.Client` kvpipe-wide (kvpipe.processors.core.httpclient, which producer/ may not import):
one per scraper, keeping its connection to the engine alive between scrapes, trusting the system's CA store as
urllib did.
"""
from __future__ import annotations

import logging
import ssl
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger("kvpipe.bridge")

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # current name first
MAX_BYTES = 8 * 1024 * 1024  # a metrics page is a few hundred kB at most; refuse anything absurd


class EngineLoad(NamedTuple):
    running: int
    waiting: int
    kv_usage: float


def parse_load(text: str, engine: int | None = None) -> EngineLoad | None:
    """The load in a Prometheus text page; None when it has none of vLLM's load gauges.
    `engine`: the data-parallel rank whose samples count (when the page labels engines)."""
    values: dict[str, list[tuple[dict[str, str], float]]] = {}
    wanted = {RUNNING, WAITING, *KV_USAGE}
    for family in text_string_to_metric_families(text):
        if family.name in wanted:
            values[family.name] = [(s.labels, s.value) for s in family.samples if s.name == family.name]
    if not values:
        return None

    def mine(name: str) -> list[float]:
        samples = values.get(name, [])
        if engine is not None and any("engine" in labels for labels, _ in samples):
            samples = [(labels, v) for labels, v in samples if labels.get("engine") == str(engine)]
        return [v for _, v in samples]

    usage_name = next((n for n in KV_USAGE if n in values), KV_USAGE[0])
    usage = mine(usage_name)
    return EngineLoad(running=int(sum(mine(RUNNING))), waiting=int(sum(mine(WAITING))),
                      kv_usage=min(1.0, max(0.0, max(usage))) if usage else 0.0)


def scrape_client() -> httpx.Client:
    return httpx.Client(verify=ssl.create_default_context(), follow_redirects=True)


def fetch(url: str, timeout_s: float, client: httpx.Client | None = None) -> str:
    """The page at `url` (an operator-given http(s) URL); httpx.HTTPError for no answer or an error status,
    ValueError past MAX_BYTES. `client`: a kept-alive one (the scraper's), else one for this call."""
    if client is None:
        with scrape_client() as own:
            return fetch(url, timeout_s, own)
    data = bytearray()
    with client.stream("GET", url, timeout=timeout_s) as resp:
        resp.raise_for_status()
        for chunk in resp.iter_bytes():
            data += chunk
            if len(data) > MAX_BYTES:  # read no further
                raise ValueError(f"{url}: metrics page over {MAX_BYTES} bytes")
    return data.decode("utf-8", "replace")


class LoadScraper:
    """Scrapes `url` every `every_s` and hands each rank its load (`targets`: rank → setter,
    e.g. a Publisher's `set_load`). `scrape_once` is the loop body, testable alone."""

    def __init__(self, url: str, targets: Sequence[tuple[int, Callable[[int, int, float], None]]],
                 every_s: float = 1.0, timeout_s: float = 2.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--metrics-url {url!r}: expected http(s)://host:port/metrics")
        if every_s <= 0:
            raise ValueError(f"scrape period {every_s}: must be > 0")
        self.url, self.targets, self.every_s, self.timeout_s = url, list(targets), every_s, timeout_s
        self.counters = {"scrapes": 0, "failures": 0, "no_load_metrics": 0}
        self._client: httpx.Client | None = None  # made by the first scrape, in the thread that scrapes
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bridge-load-scraper", daemon=True)

    def scrape_once(self) -> bool:
        if self._client is None:
            self._client = scrape_client()
        try:
            text = fetch(self.url, self.timeout_s, self._client)
        except (httpx.HTTPError, OSError, ValueError) as exc:
            self.counters["failures"] += 1
            if self.counters["failures"] in (1, 10) or self.counters["failures"] % 100 == 0:
                log.warning("engine metrics %s: %s (failure %d; envelopes keep the last load)", self.url, exc,
                            self.counters["failures"])
            return False
        self.counters["scrapes"] += 1
        found = False
        for rank, set_load in self.targets:
            load = parse_load(text, rank)
            if load is not None:
                set_load(*load)
                found = True
        if not found:
            self.counters["no_load_metrics"] += 1
            if self.counters["no_load_metrics"] == 1:
                log.warning("engine metrics %s: none of %s found", self.url, ", ".join((RUNNING, WAITING, *KV_USAGE)))
        return found

    def start(self) -> "LoadScraper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout_s + 1.0)
        if self._client is not None and not self._thread.is_alive():  # a scrape still running keeps it
            self._client.close()
            self._client = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.scrape_once()
            self._stop.wait(self.every_s)
