"""`kvpipe bench route-load`: route decisions/s and latency under concurrent load, with and without ingest.

The fleet and the request mix of `kvpipe bench route`'s HTTP part (kvpipe.bench.route_http): 256 nodes,
64 shared 2048-token documents, 8 cached per node, published through Kafka into a real `kvpipe
processor` child. `--bodies` distinct `/route` bodies (2048 token ids each, `top_k` 1) are generated
up front: `--uncached` of them prompts no node holds, `--whole` whole documents, the rest a cached
document prefix plus fresh tokens. `wrk` cycles through them (a Lua script written at run time reads
them from a file) over keep-alive connections, at each count of `--connections` (wrk threads =
min(2, connections)), each count twice:
- without ingest: nothing but the requests;
- with ingest: a publisher process sends block events from `--ingest-nodes` extra nodes (announced
  before the first step, so every step sees the same fleet) to the same events topic at
  `--ingest-rate` block events/s, so the processor applies them while it serves; meanwhile probes
  (kvpipe.bench.ingest_load.Probes, as `kvpipe bench ingest` measures freshness) publish one fresh
  block at a time for a probe node and poll /route until it is routable: freshness under load.
  After the step the processor must catch up to the topic's end before the next one starts.
- `--share S` (with ingest): one more step per share right after each step with ingest, wrk held to S times
  the decisions/s that step reached, the same ingest and probes beside it: freshness while serving at a
  share of the maximum (`paced` in the output: the share reached and its freshness).
Any request that errored (socket error, timeout, non-2xx) fails the run loudly, naming the step.

Before the steps: a short unrecorded warm-up (with `--ingest-warmup-s`, also that long with ingest), and the
idle freshness (no wrk, no ingest), the baseline freshness is compared with. Contract of `kvpipe.bench`: `value` = decisions/s at 32
connections without ingest, `baseline` = decisions/s at 1 connection (sequential on one keep-alive
connection), `ratio` = their quotient (what concurrency buys); `freshness_p99_ms` (and p50) pools
the probes of every step with ingest, `freshness_idle_ms` is its baseline. CPU: the processor's
share (cores used, from /proc) per step and its decisions per CPU-second (steadier than decisions/s on a
shared host), wrk's, the host's busy share and the rest of it. `--cpus 0` pins the processor child to
CPU 0 with taskset (`--cpus 0,1`: both), so one core vs two can be compared. `--processor-env` passes
settings to the processor child (`KVPIPE_ROUTE_PORT=auto`: a free port for the native route server,
and wrk's requests go there; the probes keep asking the app's web port).
"""
from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import subprocess
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import click
import msgspec

from kvpipe.bench import route as bench
from kvpipe.gpu.hashing import external_hash, hash_request_blocks, hasher_from_config
from kvpipe.schemas.cliopts import Command, run as run_command
from kvpipe.schemas.codec import PRODUCE_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockStored, Event

DEFAULT_CONNECTIONS = (1, 8, 32, 128)
VALUE_CONNECTIONS = 32  # `value` is the rate at this count without ingest
WRK_MARK = "KVPIPE_WRK "  # the Lua done() summary line starts with it
TOKEN_ENV = "KVPIPE_WRK_TOKEN"  # the bearer token reaches wrk's Lua through its environment, never a file
PROBE_TIMEOUT_S = 60.0  # one probe not routable after this long fails the run
FLEET_WINDOWS = 1  # the fleet's sliding-window groups beside full attention (`bench.route.layout`)


# ---- pure parts (tests/unit/test_bench_route_load.py) ----

def parse_connections(value: str) -> list[int]:
    """`--connections`: comma-separated positive counts, in order, duplicates dropped."""
    out: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"a comma-separated list of positive connection counts; got {value!r}")
        if int(part) not in out:
            out.append(int(part))
    if not out:
        raise ValueError(f"a comma-separated list of positive connection counts; got {value!r}")
    return out


def parse_cpus(value: str, allowed: set[int]) -> list[int]:
    """`--cpus`: taskset's list syntax (`0`, `0,1`, `0-3`), every CPU one this process may run on;
    "" = no pinning (an empty list)."""
    cpus: set[int] = set()
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"a CPU list such as 0 or 0,1 or 0-1; got {value!r}")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise ValueError(f"a CPU range runs upwards; got {part!r}")
        cpus.update(range(lo, hi + 1))
    missing = sorted(cpus - allowed)
    if missing:
        raise ValueError(f"CPU(s) {missing} not available here (this process may use {sorted(allowed)})")
    return sorted(cpus)


def parse_processor_env(values: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--processor-env KVPIPE_NAME=VALUE`s: the settings given to the processor child."""
    out: dict[str, str] = {}
    for item in values:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not re.fullmatch(r"KVPIPE_[A-Z0-9_]+", key):
            raise ValueError(f"KVPIPE_NAME=VALUE; got {item!r}")
        out[key] = value
    return out


def wrk_threads(connections: int) -> int:
    return min(2, connections)


def wrk_command(wrk: str, url: str, connections: int, duration_s: float, script: str, timeout_s: float) -> list[str]:
    """wrk's argv: keep-alive (its default) connections, `--latency` for the percentile table."""
    return [wrk, "-t", str(wrk_threads(connections)), "-c", str(connections), "-d", f"{max(1, round(duration_s))}s",
            "--timeout", f"{max(1, round(timeout_s))}s", "--latency", "-s", script, url]


def _lua_string(s: str) -> str:
    """A Lua string literal for `s` (a path: no control characters expected, escaped anyway)."""
    out = []
    for ch in s:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\{ord(ch):03d}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


# A thread's requests at a fixed rate: each request waits for its slot on the thread's own schedule (one slot
# per `pace` ms, from a monotonic clock read through LuaJIT's FFI, which wrk embeds). A thread behind its
# schedule catches up at most `lag` ms of slots at once (a burst, as clients' bursts are) and forgets the rest,
# so the rate is the target unless the server cannot keep up with the connections. wrk truncates a delay to
# whole ms: a request may leave up to 1 ms before its slot, never drifting, since the slots advance by `pace`.
_RATE_PACING = """
local ffi = require("ffi")
ffi.cdef[[
typedef struct {{ long tv_sec; long tv_nsec; }} kvpipe_timespec;
int clock_gettime(int clock_id, kvpipe_timespec *tp);
]]
local now_ts = ffi.new("kvpipe_timespec")
local function now_ms()
  ffi.C.clock_gettime(1, now_ts)  -- CLOCK_MONOTONIC
  return tonumber(now_ts.tv_sec) * 1000 + tonumber(now_ts.tv_nsec) / 1e6
end
local pace = {pace_ms!r}
local lag = 10
local slot = 0

function delay()
  local now = now_ms()
  if slot < now - lag then
    slot = now - lag
  end
  local wait = slot > now and slot - now or 0
  slot = slot + pace
  return wait
end
"""


def lua_script(bodies_path: str, path: str = "/route", delay_ms: int = 0, rate_per_thread: float = 0.0) -> str:
    """The wrk script: every thread reads the bodies (one JSON object per line) and cycles through
    them, threads starting at different bodies; the bearer token, if any, comes from the
    environment; `done()` prints one `KVPIPE_WRK {json}` line with the counts and percentiles (µs).
    `delay_ms` > 0: each connection waits that long after an answer before its next request (wrk's
    `delay()`), which holds the rate near connections ÷ (latency + delay). `rate_per_thread` > 0
    instead: each wrk thread sends at most that many requests a second, on a fixed schedule (wrk
    cannot pace a rate itself): how a step serves at a chosen share of a measured maximum."""
    if delay_ms > 0 and rate_per_thread > 0:
        raise ValueError("a step paces by a delay or by a rate, not both")
    if rate_per_thread > 0:
        pacing = _RATE_PACING.format(pace_ms=round(1000.0 / rate_per_thread, 6))
    else:
        pacing = f"\nfunction delay()\n  return {int(delay_ms)}\nend\n" if delay_ms > 0 else ""
    return f"""-- kvpipe bench route-load: cycle through pre-generated {path} bodies
local bodies_path = {_lua_string(bodies_path)}
local reqs = {{}}
local i = 0
local nthreads = 0

function setup(thread)
  thread:set("tid", nthreads)
  nthreads = nthreads + 1
end

function init(args)
  local headers = {{["Content-Type"] = "application/json"}}
  local token = os.getenv("{TOKEN_ENV}")
  if token ~= nil and token ~= "" then
    headers["Authorization"] = "Bearer " .. token
  end
  for line in io.lines(bodies_path) do
    if #line > 0 then
      reqs[#reqs + 1] = wrk.format("POST", {_lua_string(path)}, headers, line)
    end
  end
  if #reqs == 0 then
    error("no request bodies in " .. bodies_path)
  end
  i = ((tid or 0) * 17) % #reqs
end

function request()
  i = (i % #reqs) + 1
  return reqs[i]
end
{pacing}
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('{WRK_MARK}{{"requests": %d, "duration_us": %.0f, "bytes": %.0f, '
    .. '"connect_errors": %d, "read_errors": %d, "write_errors": %d, "status_errors": %d, "timeouts": %d, '
    .. '"p50_us": %.1f, "p90_us": %.1f, "p99_us": %.1f, "max_us": %.1f, "mean_us": %.1f}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""


_UNITS_US = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6, "h": 3600e6}
_SIZE = {"": 1, "B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}


def duration_us(text: str) -> float:
    """wrk's printed duration (`635.91us`, `1.20ms`, `2.00s`, `1.00m`) in microseconds."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(us|ms|s|m|h)\s*", text)
    if not m:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(m.group(1)) * _UNITS_US[m.group(2)]


def parse_wrk(text: str) -> dict[str, Any]:
    """What one wrk run printed: the Lua `done()` line when there is one (exact counts), else the
    `--latency` text. Keys: requests, duration_s, requests_per_s, p50_us, p90_us, p99_us (and
    max_us, mean_us from Lua), socket error counts, non_2xx (wrk's "Non-2xx or 3xx responses":
    statuses ≥ 400), errors (their sum) and source ("lua" or "text")."""
    for line in text.splitlines():
        if line.startswith(WRK_MARK):
            d = json.loads(line[len(WRK_MARK):])
            seconds = d["duration_us"] / 1e6
            out = {"source": "lua", "requests": d["requests"], "duration_s": round(seconds, 3),
                   "requests_per_s": d["requests"] / seconds if seconds > 0 else 0.0,
                   "p50_us": d["p50_us"], "p90_us": d["p90_us"], "p99_us": d["p99_us"], "max_us": d["max_us"],
                   "mean_us": d["mean_us"], "bytes": d["bytes"],
                   "socket_errors": {"connect": d["connect_errors"], "read": d["read_errors"],
                                     "write": d["write_errors"], "timeout": d["timeouts"]},
                   "non_2xx": d["status_errors"]}
            break
    else:
        out = _parse_wrk_text(text)
    out["errors"] = sum(out["socket_errors"].values()) + out["non_2xx"]
    return out


def _parse_wrk_text(text: str) -> dict[str, Any]:
    pct = {int(m.group(1)): duration_us(m.group(2))
           for m in re.finditer(r"^\s*(\d+)%\s+([\d.]+\s*(?:us|ms|s|m|h))\s*$", text, re.M)}
    total = re.search(r"^\s*(\d+) requests in ([\d.]+\s*(?:us|ms|s|m|h)), ([\d.]+)([KMGT]?B) read", text, re.M)
    if not total or not {50, 90, 99} <= pct.keys():
        raise ValueError(f"wrk printed no result (was it run with --latency?):\n{text[-2000:]}")
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    seconds = duration_us(total.group(2)) / 1e6
    requests = int(total.group(1))
    return {"source": "text", "requests": requests, "duration_s": round(seconds, 3),
            "requests_per_s": requests / seconds if seconds > 0 else 0.0,
            "p50_us": pct[50], "p90_us": pct[90], "p99_us": pct[99],
            "bytes": float(total.group(3)) * _SIZE[total.group(4)],
            "socket_errors": dict(zip(("connect", "read", "write", "timeout"),
                                      (int(x) for x in sock.groups()) if sock else (0, 0, 0, 0))),
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def step_problem(parsed: dict[str, Any]) -> str | None:
    """Why a step's requests count as failed (any socket error, timeout or non-2xx; none done), or None."""
    if parsed["requests"] <= 0:
        return "wrk completed no request"
    if parsed["errors"]:
        sock = ", ".join(f"{k} {v}" for k, v in parsed["socket_errors"].items() if v)
        return (f"{parsed['errors']} request(s) errored: non-2xx {parsed['non_2xx']}"
                + (f", socket {sock}" if sock else ""))
    return None


def make_bodies(docs: list[list[int]], n: int, uncached: float, whole: float, tokens: int,
                rng: random.Random) -> list[tuple[str, list[int]]]:
    """`n` (kind, token ids) prompts of `tokens` tokens each, shuffled: round(n·uncached) "uncached"
    (fresh random tokens no node holds), round(n·whole) "whole" (a document as it is), the rest
    "prefix" (a document cut at a random length in [tokens/4, tokens − 16], then fresh tokens)."""
    if not 0 <= uncached + whole <= 1:
        raise ValueError("uncached + whole must be a share between 0 and 1")
    n_unc, n_whole = round(n * uncached), round(n * whole)
    out: list[tuple[str, list[int]]] = []
    for _ in range(n_unc):
        out.append(("uncached", [rng.randrange(150_000) for _ in range(tokens)]))
    for _ in range(n_whole):
        out.append(("whole", list(rng.choice(docs)[:tokens])))
    for _ in range(n - n_unc - n_whole):
        doc = rng.choice(docs)
        cut = rng.randint(min(len(doc), tokens) // 4, max(min(len(doc), tokens) - 16, min(len(doc), tokens) // 4))
        out.append(("prefix", doc[:cut] + [rng.randrange(150_000) for _ in range(tokens - cut)]))
    rng.shuffle(out)
    return out


FORMS = ("tokens", "units", "blocks")


def body_of(tokens: list[int], form: str = "tokens") -> dict[str, Any]:
    """One request: the prompt as token ids, as its hash-unit chain in vLLM's external int form (`units`), or as each
    group's block hashes (`blocks`, the fleet's layout) — what a router front end that hashes prompts itself sends
    (the fleet's nodes hash with `bench.CONFIGS[0]`) — and `top_k` 1 (the router's decision)."""
    if form == "tokens":
        return {"token_ids": tokens, "top_k": 1}
    if form not in FORMS:
        raise ValueError(f"form {form!r}: expected one of {', '.join(FORMS)}")
    cfg = bench.CONFIGS[0]
    chain = [external_hash(d, True) for d in hash_request_blocks(hasher_from_config(cfg), tokens, cfg.hash_block_size)]
    if form == "blocks":
        lists = bench.group_lists(chain, bench.layout(FLEET_WINDOWS))
        return {"block_hashes": {str(g): v for g, v in lists.items()}, "num_tokens": len(tokens), "top_k": 1}
    return {"unit_hashes": chain, "hash_block_size": cfg.hash_block_size, "num_tokens": len(tokens), "top_k": 1}


def body_line(tokens: list[int], form: str = "tokens") -> str:
    """`body_of` as one line of JSON."""
    return json.dumps(body_of(tokens, form), separators=(",", ":"))


def pick_value(rates: dict[int, float]) -> tuple[int, float]:
    """(connections, decisions/s) reported as `value`: at 32 connections, else the nearest count measured."""
    c = min(rates, key=lambda k: (abs(k - VALUE_CONNECTIONS), k))
    return c, rates[c]


def proc_cpu_s(stat_line: str, ticks: int) -> float:
    """user + system CPU seconds from a /proc/<pid>/stat line (the command name may hold spaces)."""
    fields = stat_line.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime: fields 14 and 15 of the line


def host_busy(cpu_line: str) -> tuple[int, int]:
    """(busy, total) jiffies from /proc/stat's `cpu` line (idle and iowait are not busy)."""
    vals = [int(x) for x in cpu_line.split()[1:9]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


# ---- the run ----

class IngestSource:
    """Envelopes of `nodes` extra nodes (`ingest-node-NN`, the fleet's model, layout and hash
    configuration, announced by their seq 0), `events_per` block events each: new blocks (full
    attention and the sliding window, alternating) and, once a node holds 256, evictions of its
    oldest in every other slot, so the index stays at a steady size. `take` continues seqs and
    hashes, so every step's envelopes apply."""

    def __init__(self, nodes: int, events_per: int) -> None:
        from kvpipe.bench import route as bench

        self.nodes, self.events_per = nodes, events_per
        self.specs = bench.layout(FLEET_WINDOWS)
        self.hash_config = bench.CONFIGS[0]
        self.fifo: dict[int, list[tuple[int, int]]] = {i: [] for i in range(nodes)}
        self.seqs = dict.fromkeys(range(nodes), 0)
        self.k = 0
        self.next_hash = 3 << 60  # far from the fleet's hashes and the probes'

    def announce(self) -> list[tuple[bytes, bytes]]:
        """Every node's seq 0 (layout, hash configuration, model; no events)."""
        return [self._envelope(n, []) for n in range(self.nodes)]

    def _envelope(self, node: int, events: list) -> tuple[bytes, bytes]:
        from kvpipe.schemas.codec import encode_envelope, encode_vllm_batch
        from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope

        seq = self.seqs[node]
        ts = time.time()
        first = seq == 0
        env = Envelope(v=SCHEMA_MAJOR, node_id=f"ingest-node-{node:02d}", epoch=1, seq=seq, ts=ts, sent_ts=ts,
                       model="bench" if first else None, group_specs=self.specs if first else None,
                       hash_config=self.hash_config if first else None, num_events=len(events),
                       batch=msgspec.Raw(encode_vllm_batch(events, ts)))
        self.seqs[node] = seq + 1
        return env.node_id.encode(), encode_envelope(env)

    def take(self, n: int) -> list[tuple[bytes, bytes]]:
        """`n` more envelopes of exactly `events_per` block events each."""
        from kvpipe.schemas.events import BlockRemoved, BlockStored

        out = []
        for _ in range(n):
            node = self.k % self.nodes
            parity = self.k // self.nodes % 2  # a node's envelopes alternate which slots evict: even on average
            self.k += 1
            fifo = self.fifo[node]
            events: list[Any] = []
            for j in range(self.events_per):
                if (j + parity) % 2 and len(fifo) > 256:
                    h, g = fifo.pop(0)
                    events.append(BlockRemoved(block_hashes=[h], medium="GPU", group_idx=g))
                    continue
                spec = self.specs[j % len(self.specs)]
                h = self.next_hash
                self.next_hash += 1
                events.append(BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[1] * spec.block_size,
                                          block_size=spec.block_size, lora_id=None, medium="GPU", lora_name=None,
                                          group_idx=spec.group_idx))
                fifo.append((h, spec.group_idx))
            out.append(self._envelope(node, events))
        return out


class ProbeSeries:
    """Freshness probes (kvpipe.bench.ingest_load.Probes) of one probe node across phases: each
    phase gets a fresh client (none lives across the paced publisher's fork) that continues the
    node's seqs; a probe not routable within PROBE_TIMEOUT_S fails the run."""

    def __init__(self, kafka_conf: dict, topic: str, proc: Any, node: str = "bench-probe",
                 route_url: str | None = None) -> None:
        self.kafka_conf, self.topic, self.proc, self.node = kafka_conf, topic, proc, node
        self.route_url = route_url  # the native route server: probes ask it with token ids, as routers do
        self.seq = 0
        self.current: Any = None

    def _routable(self) -> Callable[[int], bool]:
        probe: int | None = None  # the block waited for, and until when
        deadline = 0.0

        def routable(block_hash: int) -> bool:
            nonlocal probe, deadline
            now = time.monotonic()
            if block_hash != probe:
                probe, deadline = block_hash, now + PROBE_TIMEOUT_S
            elif now > deadline:
                raise TimeoutError(f"probe block {block_hash} of {self.node} not routable after {PROBE_TIMEOUT_S} s")
            return bool(self.proc.route({"0": [block_hash]})["nodes"])

        return routable

    def open(self) -> Any:
        """A fresh client continuing the node's seqs (`paced_freshness` takes this as its factory)."""
        from kvpipe.bench.ingest_load import Probes

        self.close()
        if self.route_url is not None:
            self.current = TokenProbes(self.kafka_conf, self.topic, self.route_url, self.proc.headers, self.node)
        else:
            self.current = Probes(self.kafka_conf, self.topic, self._routable(), self.node)
        self.current.seq = self.seq
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.seq = self.current.seq  # taken before the probe is sent: a failed probe's seq is not reused
            self.current.close()
            self.current = None


class TokenProbes:
    """Probes for the native route server, which answers token ids: each probe stores the block of 16 fresh
    tokens (hashed as the fleet's nodes hash) on a probe node that publishes its specs, then asks the route port
    with those tokens until the probe node is chosen with that block on GPU."""

    CONFIG = bench.CONFIGS[0]
    SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]

    def __init__(self, kafka_conf: dict, topic: str, url: str, headers: dict, node: str) -> None:
        import http.client
        from urllib.parse import urlsplit

        from confluent_kafka import Producer

        self.producer = Producer({**kafka_conf, "linger.ms": 0, "acks": "all"})
        self.topic, self.node, self.seq = topic, node, 0
        parts = urlsplit(url)
        if parts.hostname is None:
            raise ValueError(f"route URL {url!r}: expected http://host:port/route")
        self.path, self.headers = parts.path, {"Content-Type": "application/json", **headers}
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=PROBE_TIMEOUT_S)
        self.hasher = hasher_from_config(self.CONFIG)
        self.last_ack_ms = 0.0

    def once(self, poll_pause_s: float = 0.0005) -> float:
        tokens = [900_000 + self.seq % 1000, *(zlib.crc32(f"{self.node}/{self.seq}/{i}".encode()) % 150_000
                                               for i in range(15))]
        (digest,) = hash_request_blocks(self.hasher, tokens, 16)
        h = external_hash(digest, self.CONFIG.int_hashes)
        ts = time.time()
        events: list[Event] = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16,
                                           lora_id=None, medium="GPU", lora_name=None, group_idx=0)]
        env = Envelope(v=SCHEMA_MAJOR, node_id=self.node, epoch=1, seq=self.seq, ts=ts, sent_ts=ts, num_events=1,
                       group_specs=self.SPECS, hash_config=self.CONFIG,
                       batch=msgspec.Raw(encode_vllm_batch(events, ts)))
        self.seq += 1
        body = msgspec.json.encode({"token_ids": [*tokens, 1], "top_k": 1})
        deadline = time.monotonic() + PROBE_TIMEOUT_S
        started = time.perf_counter()
        self.producer.produce(self.topic, value=encode_envelope(env), key=self.node.encode(), headers=PRODUCE_HEADERS)
        self.producer.flush(30)
        self.last_ack_ms = (time.perf_counter() - started) * 1000  # the broker's part of the probe
        while True:
            self.conn.request("POST", self.path, body=body, headers=self.headers)
            answer = msgspec.json.decode(self.conn.getresponse().read())
            rows = answer.get("nodes") or []
            if answer.get("chosen") == self.node and rows and rows[0].get("gpu_tokens", 0) >= 16:
                return (time.perf_counter() - started) * 1000
            if time.monotonic() > deadline:
                raise TimeoutError(f"probe {self.seq - 1} of {self.node} not routable after {PROBE_TIMEOUT_S} s")
            time.sleep(poll_pause_s)

    def close(self) -> None:
        self.producer.flush(30)
        self.conn.close()


def _proc_cpu(pid: int) -> float:
    return proc_cpu_s(Path(f"/proc/{pid}/stat").read_text(), os.sysconf("SC_CLK_TCK"))


def _host() -> tuple[int, int]:
    with open("/proc/stat") as f:
        return host_busy(f.readline())


def _affinity(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _pin(pid: int, cpus: list[int]) -> str:
    """taskset every thread of `pid` (threads it starts later inherit the mask); the mask read back."""
    taskset = shutil.which("taskset")
    if taskset is None:
        raise click.ClickException("--cpus needs taskset (util-linux)")
    subprocess.run([taskset, "-a", "-p", "-c", ",".join(map(str, cpus)), str(pid)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=30)
    return _affinity(pid)


def _watermarks(kafka_conf: dict, topic: str, partitions: int) -> dict[int, int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({**kafka_conf, "group.id": f"bench-route-load-wm-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False})
    try:
        return {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)}
    finally:
        consumer.close()


def _behind(stats: dict, ends: dict[int, int]) -> int:
    fresh = stats["freshness"]
    return sum(max(0, end - 1 - fresh.get(str(p), {}).get("offset", -1)) for p, end in ends.items() if end)


class _Rig:
    """The processor, wrk and the publishers of one run."""

    def __init__(self, args: SimpleNamespace, proc: Any, topic: str, kafka_conf: dict, tmp: Path, token: str,
                 url: str) -> None:
        self.args, self.proc, self.topic, self.kafka_conf, self.tmp = args, proc, topic, kafka_conf, tmp
        self.script = tmp / "route-load.lua"
        self.env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        if token:
            self.env[TOKEN_ENV] = token
        self.url = url
        self.wrk_runs = 0
        self.replicas: list = []  # router replicas beyond `proc`
        self.broker_gc_log: Path | None = None  # the local broker's GC log (none for a cluster elsewhere)

    def cpu_s(self) -> float:
        """CPU seconds of every router process so far."""
        return sum(_proc_cpu(p.proc.pid) for p in [self.proc, *self.replicas])

    def start_wrk(self, connections: int, duration_s: float, rate: float = 0.0) -> tuple[subprocess.Popen, Path]:
        """wrk at `connections` for `duration_s`; `rate` > 0: at most that many requests a second in all."""
        self.wrk_runs += 1
        out = self.tmp / f"wrk-{self.wrk_runs}.out"
        script = self.script
        if rate > 0:
            script = self.tmp / f"route-load-rate-{self.wrk_runs}.lua"
            script.write_text(lua_script(str(self.tmp / "bodies.jsonl"),
                                         rate_per_thread=rate / wrk_threads(connections)))
        cmd = wrk_command(self.args.wrk, self.url, connections, duration_s, str(script), self.args.wrk_timeout_s)
        with open(out, "wb") as f:
            popen = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=self.tmp)
        return popen, out

    def finish_wrk(self, popen: subprocess.Popen, out: Path, duration_s: float) -> tuple[dict, float, str]:
        """wrk's parsed result, its CPU seconds (rusage of the children reaped meanwhile: wrk alone)
        and its output; a wrk that overruns its duration by a minute is killed."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        try:
            popen.wait(timeout=duration_s + 60)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(30)
            text = out.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"wrk did not finish within {duration_s + 60:.0f} s:\n{text}")
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        text = out.read_text(errors="replace")
        if popen.returncode != 0:
            raise RuntimeError(f"wrk exited with {popen.returncode}:\n{text[-3000:]}")
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return parse_wrk(text), cpu, text


def _step(rig: _Rig, connections: int, ingest: IngestSource | None, probes: ProbeSeries,
          rate: float = 0.0, duration_s: float | None = None) -> dict[str, Any]:
    """One wrk run at `connections` for `duration_s` (default `--duration-s`), with or without the paced ingest and
    the probes beside it; `rate` > 0 holds wrk to that many requests a second."""
    from kvpipe.bench.ingest_load import paced_freshness, summary

    args, proc = rig.args, rig.proc
    name = f"{connections} connection(s), {'with' if ingest else 'without'} ingest"
    duration = args.duration_s if duration_s is None else duration_s
    messages: list = []
    if ingest is not None:  # generated before the clock starts
        messages = ingest.take(max(1, round(args.ingest_rate * duration / args.ingest_events)))
    stats0 = proc.get("/stats")
    cpu0, host0, t0, wall0 = rig.cpu_s(), _host(), time.perf_counter(), time.time()
    popen, out = rig.start_wrk(connections, duration, rate)
    latencies: list[float] = []
    probe_at: list[tuple[float, float | None]] = []
    sent: dict = {}
    try:
        if ingest is not None:
            rate_msgs = args.ingest_rate / args.ingest_events
            latencies, sent = paced_freshness(rig.kafka_conf, rig.topic, messages, rate_msgs, probes.open,
                                              args.probe_every_ms / 1000, at=probe_at)
    except BaseException:
        popen.kill()
        popen.wait(30)
        raise
    finally:
        probes.close()
    parsed, wrk_cpu, text = rig.finish_wrk(popen, out, duration)
    t1, cpu1, host1 = time.perf_counter(), rig.cpu_s(), _host()
    stats1 = proc.get("/stats")
    wall = t1 - t0
    busy, ncpu = (host1[0] - host0[0]) / max(1, host1[1] - host0[1]), os.cpu_count() or 1
    problem = step_problem(parsed)
    if problem:
        raise RuntimeError(f"route-load step FAILED ({name}): {problem}\nwrk output:\n{text[-3000:]}")
    c0, c1 = stats0["counters"], stats1["counters"]
    row: dict[str, Any] = {
        "connections": connections, "wrk_threads": wrk_threads(connections), "ingest": ingest is not None,
        "decisions_per_s": round((parsed["requests"] - parsed["non_2xx"]) / parsed["duration_s"], 1),
        "requests": parsed["requests"], "seconds": parsed["duration_s"],
        "p50_ms": round(parsed["p50_us"] / 1000, 3), "p90_ms": round(parsed["p90_us"] / 1000, 3),
        "p99_ms": round(parsed["p99_us"] / 1000, 3),
        **({"max_ms": round(parsed["max_us"] / 1000, 3)} if "max_us" in parsed else {}),
        "non_2xx": parsed["non_2xx"], "socket_errors": parsed["socket_errors"],
        "processor_cpu_cores": round((cpu1 - cpu0) / wall, 3),
        # decisions per second of the processor's own CPU: steadier than decisions/s on a shared host
        "decisions_per_cpu_s": round((parsed["requests"] - parsed["non_2xx"]) / (cpu1 - cpu0), 1)
        if cpu1 > cpu0 else None,
        "wrk_cpu_cores": round(wrk_cpu / wall, 3),
        "host_cpu_busy": round(busy, 3),
        # the rest of the host's busy cores: broker, publisher, probes, this process, other tenants
        "other_cpu_cores": round(max(0.0, busy * ncpu - (cpu1 - cpu0 + wrk_cpu) / wall), 3),
        "applied_events_per_s": round((c1.get("events", 0) - c0.get("events", 0)) / wall),
    }
    if rate > 0:
        row["target_decisions_per_s"] = round(rate, 1)
    for key in ("dlq", "gaps", "duplicates", "refused_envelopes", "stale"):
        if c1.get(key, 0) - c0.get(key, 0):
            row[f"{key}_during_step"] = c1.get(key, 0) - c0.get(key, 0)
    if ingest is not None:
        ends = _watermarks(rig.kafka_conf, rig.topic, args.partitions)
        row["behind_at_end_msgs"] = _behind(stats1, ends)
        started = time.perf_counter()
        for p in [proc, *rig.replicas]:
            p.wait_offsets(ends, timeout=args.drain_timeout_s)  # caught up before the next step
        row["drain_s"] = round(time.perf_counter() - started, 2)
        row["published_events_per_s"] = round(len(messages) * args.ingest_events / sent["seconds"]) \
            if sent.get("seconds") else None
        row["freshness_ms"] = summary(latencies)
        d0, d1 = stats0.get("durability", {}), stats1.get("durability", {})
        row["snapshots_during_step"] = d1.get("snapshots", 0) - d0.get("snapshots", 0)
        row["snapshot_export_ms_last"] = d1.get("snapshot_export_ms_last")  # the event loop held that long
        row["step_started_unix_s"] = round(wall0, 3)  # to find the slow probes' moments in the broker's log
        # the five slowest probes, [s into the step, ms, ms of it until the broker acknowledged (token probes)]:
        # bunched = a pause somewhere, spread = the scheduler
        slowest = sorted(zip(probe_at, latencies), key=lambda p: -p[1])[:5]
        row["freshness_slowest"] = [[round(t, 2), round(ms, 1), *([round(a, 1)] if a is not None else [])]
                                    for (t, a), ms in slowest]
        row["_latencies"] = latencies
        if rig.broker_gc_log is not None:
            _broker_pauses(row, rig.broker_gc_log, wall0, wall0 + wall, sent.get("probes_begun_unix_s", wall0),
                           slowest)
    return row


def _broker_gc_log(settings: Any) -> Path | None:
    """The GC log of the broker `kvpipe infra up` started on this host, where the bench talks to it."""
    if settings.kafka_bootstrap or settings.kafka_local_brokers > 1:
        return None
    from kvpipe.infra.cli import broker_config

    return broker_config(settings).gc_log


def _broker_pauses(row: dict[str, Any], log: Path, wall0: float, wall1: float, begun: float,
                   slowest: list[tuple[tuple[float, float | None], float]]) -> None:
    """The broker's GC pauses in the step (count, longest, total ms) and, per slowest probe ((s after `begun`,
    ack ms), ms) as `freshness_slowest` lists them, the ms of them that fell between its send and its being
    routable: a probe the broker stopped for, not the app."""
    from kvpipe.infra.kafka.gclog import overlap_ms, read_pauses, window_summary

    pauses = read_pauses(log, since_unix_s=wall0 - 1)
    row["broker_gc"] = window_summary(pauses, wall0, wall1)
    row["freshness_slowest_broker_gc_ms"] = [round(overlap_ms(pauses, begun + t, begun + t + ms / 1000), 1)
                                             for (t, _), ms in slowest]


def _warm(rig: _Rig) -> None:
    """An unrecorded wrk run; it must not error either (a 401 or a broken body shows here first)."""
    if rig.args.warmup_s <= 0:
        return
    popen, out = rig.start_wrk(8, rig.args.warmup_s)
    parsed, _, text = rig.finish_wrk(popen, out, rig.args.warmup_s)
    problem = step_problem(parsed)
    if problem:
        raise RuntimeError(f"route-load warm-up FAILED: {problem}\nwrk output:\n{text[-3000:]}")


def _check_bodies(url: str, headers: dict[str, str], bodies: list[tuple[str, list[int]]],
                  form: str = "tokens") -> dict[str, Any]:
    """Each body once at `url` (it must answer 200; the first may wait 30 s for the server to
    listen): the best hit per kind, for the report."""
    from kvpipe.processors.core.remote import post_json

    hits: dict[str, list[int]] = {}
    deadline = time.monotonic() + 30
    for kind, tokens in bodies:
        while True:
            try:
                status, answer = post_json(url, body_of(tokens, form), 30, headers)
                break
            except OSError:  # nothing listens yet: a route server still starting
                if hits or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        if status != 200:
            raise RuntimeError(f"/route answered {status} to a {kind} body: {str(answer)[:500]}")
        best = answer["nodes"][0] if answer.get("nodes") else {}
        hits.setdefault(kind, []).append(best.get("gpu_tokens", 0) + best.get("loadable_tokens", 0))
    return {kind: {"bodies": len(h), "mean_best_hit_tokens": round(sum(h) / len(h), 1),
                   "zero_hit_bodies": sum(1 for x in h if x == 0)} for kind, h in sorted(hits.items())}


def _cpus_option(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return parse_cpus(value, set(os.sched_getaffinity(0)))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _env_option(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    try:
        return parse_processor_env(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _connections_option(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return parse_connections(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command("route-load", cls=Command, help=__doc__.split("\n\n")[0])
@click.option("--connections", default=",".join(map(str, DEFAULT_CONNECTIONS)), show_default=True,
              callback=_connections_option, help="keep-alive connection counts to run, in order")
@click.option("--duration-s", type=click.IntRange(1, 600), default=10, show_default=True,
              help="seconds of wrk per step (each count runs twice: without and with ingest)")
@click.option("--ingest-rate", type=click.FloatRange(0), default=8000.0, show_default=True,
              help="block events/s published during the steps with ingest (0: no ingest steps)")
@click.option("--ingest-nodes", type=click.IntRange(1), default=32, show_default=True,
              help="extra nodes the ingest comes from")
@click.option("--ingest-events", type=click.IntRange(2), default=25, show_default=True,
              help="block events per ingest envelope")
@click.option("--probes", type=click.IntRange(1), default=50, show_default=True,
              help="idle freshness probes (no wrk, no ingest): the freshness baseline")
@click.option("--probe-every-ms", type=click.FloatRange(0), default=50.0, show_default=True,
              help="one freshness probe per this many ms during the steps with ingest")
@click.option("--cpus", default="", show_default=False, callback=_cpus_option,
              help="pin the processor child to these CPUs with taskset (0, 0,1, 0-1); default: not pinned")
@click.option("--bodies", type=click.IntRange(1), default=50, show_default=True, help="distinct request bodies")
@click.option("--form", type=click.Choice(FORMS), default="tokens", show_default=True,
              help="the prompt in each body: token ids, its hash-unit chain (unit_hashes) or each group's block "
                   "hashes (block_hashes), hashed up front")
@click.option("--delay-ms", type=click.IntRange(0, 1000), default=0, show_default=True,
              help="per connection, ms between an answer and the next request (0: as fast as answered); "
                   "with --connections it sets the rate a step serves at")
@click.option("--share", multiple=True, type=click.FloatRange(0, 1, min_open=True), metavar="SHARE",
              help="after each step with ingest, one more at this share of the decisions/s it reached (wrk held "
                   "to that rate; same ingest and probes): freshness at a share of the maximum (repeatable)")
@click.option("--uncached", type=click.FloatRange(0, 1), default=0.3, show_default=True,
              help="share of bodies no node holds any of")
@click.option("--whole", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="share of bodies that are a whole document (the rest: a cached prefix plus fresh tokens)")
@click.option("--warmup-s", type=click.FloatRange(0, 60), default=2.0, show_default=True,
              help="unrecorded wrk seconds (8 connections) before the steps")
@click.option("--ingest-warmup-s", type=click.FloatRange(0, 300), default=0.0, show_default=True,
              help="with ingest: unrecorded seconds of the ingest and wrk (the most connections) before the steps, "
                   "for a broker started just before the run")
@click.option("--nodes", type=click.IntRange(1), default=256, show_default=True, help="serving nodes of the fleet")
@click.option("--documents", type=click.IntRange(1), default=64, show_default=True,
              help="shared prompts the nodes cache parts of")
@click.option("--prompt-tokens", type=click.IntRange(64), default=2048, show_default=True,
              help="tokens of each document and each request")
@click.option("--per-node", type=click.IntRange(1), default=8, show_default=True, help="documents each node caches")
@click.option("--partitions", type=click.IntRange(1), default=4, show_default=True,
              help="partitions of the events topic")
@click.option("--seed", type=int, default=0, show_default=True, help="workload seed")
@click.option("--wrk", default="wrk", show_default=True, help="the wrk executable")
@click.option("--wrk-timeout-s", type=click.FloatRange(1), default=10.0, show_default=True,
              help="wrk's per-request timeout (a timeout fails the step)")
@click.option("--drain-timeout-s", type=click.FloatRange(1), default=300.0, show_default=True,
              help="longest wait for the processor to catch up after a step with ingest")
@click.option("--processor-env", multiple=True, metavar="KVPIPE_NAME=VALUE", callback=_env_option,
              help="a setting for the processor child (repeatable), e.g. KVPIPE_PROCESSOR_DELIVERY=message; "
                   "KVPIPE_ROUTE_PORT=auto picks a free port for the native route server and aims wrk at it")
@click.option("--replicas", type=click.IntRange(1, 8), default=1, show_default=True,
              help="router replicas: processors in consumer groups of their own, each holding the whole index, "
                   "sharing the native route port (SO_REUSEPORT; needs KVPIPE_ROUTE_PORT)")
@click.option("--keep-topics", is_flag=True, help="leave the bench topics on the broker")
def route_load_bench(**params: Any) -> dict[str, Any]:
    args = SimpleNamespace(**params)
    if args.per_node > args.documents:
        raise click.BadParameter("--per-node must not exceed --documents")
    if args.uncached + args.whole > 1:
        raise click.BadParameter("--uncached + --whole must not exceed 1")
    if args.share and (args.ingest_rate <= 0 or args.delay_ms > 0):
        raise click.BadParameter("--share paces steps with ingest: it needs --ingest-rate > 0 and no --delay-ms")
    wrk = shutil.which(args.wrk)
    if wrk is None:
        raise click.ClickException(f"{args.wrk} not found: install wrk (apt-get install wrk)")
    args.wrk = wrk
    return _run(args)


def _run(args: SimpleNamespace) -> dict[str, Any]:
    from kvpipe.bench import route as bench
    from kvpipe.bench.ingest import _security_env
    from kvpipe.bench.ingest_load import publish_paced, summary
    from kvpipe.bench.procrun import ProcessorProcess, free_port
    from kvpipe.bench.route_http import _delete, _publish
    from kvpipe.schemas.settings import load_settings

    settings = load_settings()
    bootstrap, security = settings.bootstrap(), settings.kafka_confluent_security()
    kafka_conf = settings.kafka_confluent_config()
    token = settings.api_token_value()
    rng = random.Random(args.seed)
    t_build = time.perf_counter()
    envelopes, docs = bench.fleet(args.nodes, args.documents, args.prompt_tokens, args.per_node, 1, rng, FLEET_WINDOWS)
    bodies = make_bodies(docs, args.bodies, args.uncached, args.whole, args.prompt_tokens,
                         random.Random(args.seed + 1))
    build_s = time.perf_counter() - t_build
    tag = uuid.uuid4().hex[:8]
    topic, dlq, snaps = f"bench-route-load-{tag}", f"bench-route-load-dlq-{tag}", f"bench-route-load-snap-{tag}"
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-bench-route-load-"))
    (tmp / "bodies.jsonl").write_text("".join(body_line(t, args.form) + "\n" for _, t in bodies))
    ingest = IngestSource(args.ingest_nodes, args.ingest_events) if args.ingest_rate > 0 else None
    proc = None
    replicas: list = []  # router replicas beyond the first (--replicas)
    steps: list[dict[str, Any]] = []
    try:
        t_load = time.perf_counter()
        _publish(bootstrap, topic, args.partitions, envelopes, security)
        if ingest is not None:  # the extra nodes join the fleet before any step
            publish_paced(kafka_conf, topic, ingest.announce(), 1e9)
        env = {**_security_env(), "KVPIPE_KAFKA_BOOTSTRAP": bootstrap, "KVPIPE_EVENTS_TOPIC": topic,
               "KVPIPE_DLQ_TOPIC": dlq, "KVPIPE_SNAPSHOT_TOPIC": snaps, "KVPIPE_PARTITIONS": str(args.partitions),
               "KVPIPE_PROCESSOR_ID": f"bench-load-{tag}", "KVPIPE_WEB_PORT": str(free_port()),
               "KVPIPE_STATE_DIR": str(tmp / "state"), "KVPIPE_SNAPSHOT_EVERY_S": "3600",
               "KVPIPE_NODE_TTL_S": "3600", "KVPIPE_ROUTE_STALE_AFTER_S": "3600"}
        if token:  # the configured token protects the child too; wrk and the probes send it
            env["KVPIPE_API_TOKEN"] = token
        env.update(args.processor_env)
        if env.get("KVPIPE_ROUTE_PORT") == "auto":
            env["KVPIPE_ROUTE_PORT"] = str(free_port())
        route_port = int(env.get("KVPIPE_ROUTE_PORT") or 0)
        if args.replicas > 1:
            if not route_port:
                raise click.UsageError("--replicas needs the native route server (KVPIPE_ROUTE_PORT)")
            env["KVPIPE_ROUTE_REUSE_PORT"] = "true"
        proc = ProcessorProcess(env, tmp / "processor.log")
        proc.start()
        for r in range(1, args.replicas):  # own consumer group, web port and state; the same route port
            replica = ProcessorProcess({**env, "KVPIPE_PROCESSOR_ID": f"bench-load-{tag}-r{r}",
                                        "KVPIPE_WEB_PORT": str(free_port()),
                                        "KVPIPE_STATE_DIR": str(tmp / f"state-r{r}")}, tmp / f"processor-r{r}.log")
            replicas.append(replica)
            replica.start()
        affinity = _pin(proc.popen.pid, args.cpus) if args.cpus else _affinity(proc.popen.pid)
        for p in [proc, *replicas]:
            p.wait_offsets(_watermarks(kafka_conf, topic, args.partitions), timeout=600)
        load_s = time.perf_counter() - t_load
        stats = proc.get("/stats")
        url = f"http://127.0.0.1:{route_port}/route" if route_port else proc.url + "/route"
        mix = _check_bodies(url, proc.headers, bodies, args.form)
        rig = _Rig(args, proc, topic, kafka_conf, tmp, token, url)
        rig.replicas = replicas
        rig.broker_gc_log = _broker_gc_log(settings)
        rig.script.write_text(lua_script(str(tmp / "bodies.jsonl"), delay_ms=args.delay_ms))
        _warm(rig)
        probes = ProbeSeries(kafka_conf, topic, proc, route_url=url if route_port else None)
        if ingest is not None and args.ingest_warmup_s > 0:
            # unrecorded: a freshly started broker's JVM compiles its produce and fetch paths under the first
            # load, and took ~0.3 cores more through the first steps with ingest after its start (BENCHMARKS.md)
            _step(rig, max(args.connections), ingest, probes, duration_s=args.ingest_warmup_s)
        try:
            idle_probes = probes.open()
            idle = summary([idle_probes.once() for _ in range(args.probes)])
        finally:
            probes.close()
        for c in args.connections:
            steps.append(_step(rig, c, None, probes))
            if ingest is not None:
                top = _step(rig, c, ingest, probes)
                steps.append(top)
                if args.share and top["decisions_per_s"] <= 0:  # a rate of 0 would run wrk unpaced
                    raise RuntimeError(f"route-load: no decisions at {c} connections with ingest, no share of it")
                for share in args.share:  # the same load at a share of the rate just reached
                    row = _step(rig, c, ingest, probes, rate=share * top["decisions_per_s"])
                    row["target_share"] = share
                    row["share_of_max"] = round(row["decisions_per_s"] / top["decisions_per_s"], 3)
                    steps.append(row)
        nodes_seen = proc.get("/stats")["nodes"]
        # how the kernel spread the connections: native answers per replica
        native_per_replica = [p.get("/stats").get("route_server", {}).get("requests", {}).get("native", 0)
                              for p in [proc, *replicas]]
        # prompt units whose digest the route server remembered (native/src/hashmemo.rs) or computed
        hash_memo = [p.get("/stats").get("route_server", {}).get("hash_memo") for p in [proc, *replicas]]
    finally:
        for p in replicas:
            p.stop()
        if proc is not None:
            proc.stop()
        if not args.keep_topics:
            _delete(bootstrap, [topic, dlq, snaps], security)
        shutil.rmtree(tmp, ignore_errors=True)

    plain = {s["connections"]: s["decisions_per_s"] for s in steps if not s["ingest"]}
    value_c, value = pick_value(plain)
    base_c = min(plain)
    pooled = [x for s in steps for x in s.pop("_latencies", [])]
    loaded = summary(pooled)
    out: dict[str, Any] = {
        "bench": "route-load",
        "value": value,
        "unit": f"route decisions/s (wrk, {value_c} keep-alive connections, no ingest, top_k 1)",
        "baseline": plain[base_c],
        "baseline_is": f"decisions/s at {base_c} connection(s), no ingest",
        "ratio": round(value / plain[base_c], 4) if plain[base_c] else None,
        "value_connections": value_c,
        "decisions_per_s": {"no_ingest": {}, **({"ingest": {}} if ingest is not None else {})},
        "steps": steps,
        "cores": len(os.sched_getaffinity(0)),
        "cpus_allowed": sorted(os.sched_getaffinity(0)),
        "processor_cpus": affinity,
        "pinned": bool(args.cpus),
        "served_by": "route_port (native route server)" if route_port else "web_port (the app's web server)",
        "replicas": args.replicas,
        "native_answers_per_replica": native_per_replica,
        "hash_memo_per_replica": hash_memo,
        "processor_env": {k: v for k, v in args.processor_env.items() if not re.search("TOKEN|PASSWORD|SECRET", k)},
        "duration_s_per_step": args.duration_s,
        "connections": args.connections,
        "ingest_rate_events_per_s": args.ingest_rate,
        "ingest_nodes": args.ingest_nodes if ingest else 0,
        "fleet": {"nodes": args.nodes, "documents": args.documents, "prompt_tokens": args.prompt_tokens,
                  "per_node": args.per_node, "index_entries": stats["index_store"]["entries"],
                  "index_store": stats["index_store"]["kind"], "nodes_by_state": nodes_seen},
        "bodies": args.bodies, "body_form": args.form, "body_mix": mix, "delay_ms": args.delay_ms,
        "freshness_idle_ms": idle,
        "build_s": round(build_s, 2), "load_s": round(load_s, 2),
    }
    for s in steps:
        if "target_share" not in s:
            out["decisions_per_s"]["ingest" if s["ingest"] else "no_ingest"][str(s["connections"])] = \
                s["decisions_per_s"]
    if args.share:  # freshness at a share of the maximum with the same ingest (issue 17's goal 3 asks 0.8)
        out["paced"] = [{"connections": s["connections"], "target_share": s["target_share"],
                         "share_of_max": s["share_of_max"], "decisions_per_s": s["decisions_per_s"],
                         "applied_events_per_s": s["applied_events_per_s"], "freshness_ms": s["freshness_ms"]}
                        for s in steps if "target_share" in s]
    if ingest is not None:
        out["freshness_under_load_ms"] = loaded
        out["freshness_p50_ms"] = loaded.get("p50")
        out["freshness_p99_ms"] = loaded.get("p99")
        out["freshness_baseline_idle_p99_ms"] = idle.get("p99")
        # higher is better: 1.0 = as fresh under load as idle
        out["freshness_ratio_idle_over_load_p99"] = round(idle["p99"] / loaded["p99"], 4) \
            if loaded.get("p99") else None
    return out


def run(argv: list[str]) -> dict[str, Any] | int:
    """`kvpipe bench route-load`: the result, or an exit code after help or a usage error."""
    return run_command(route_load_bench, argv, "kvpipe bench route-load")
