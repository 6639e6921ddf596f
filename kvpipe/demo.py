"""`kvpipe demo`: the whole pipeline end to end on the embedded defaults.

Starts the local broker (unless one runs), the two apps — `kvpipe processor` (routing index) and
`kvpipe analytics` (rows into ClickHouse, analyst SQL), separate consumer groups on one topic — and
a few simulated serving nodes (hybrid
full-attention + sliding-window + Mamba model) that publish through Kafka; one node restarts half way
(new epoch) and a few malformed messages are injected to show the dead-letter path. While the nodes
run, a progress bar; at the end a summary: events/s, index size per group, DLQ count, route answers
for the nodes' shared system prompts (routing app), and analytics queries from ClickHouse (chDB),
answered by the analytics app.

Everything the demo creates is throw-away: topics and the processor id carry a run id, state goes
under `<state_dir>/demo/<run>`; both apps are stopped, the run's topics deleted, and the broker
stopped again if the demo started it. Exit status 0 only if every step worked.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
from tenacity import RetryError, retry_if_exception_type, stop_after_delay

from kvpipe.schemas.cliopts import Command, apply_bootstrap, bootstrap_server_option, configure_logging, log_level_option
from kvpipe.progress import Progress
from kvpipe.bench.procrun import free_port
from kvpipe.processors.analytics.saved import QUERIES_DIR
from kvpipe.processors.core.remote import ok_json
from kvpipe.schemas.retrying import retrying
from kvpipe.schemas.settings import Settings, load_settings

NODES = [
    # node id, seed, extra flags
    ("node-a", 1, []),
    ("node-b", 2, ["--restart-at", "{half}"]),
    # node-c serves another tenant: other system prompts, so routing has a real choice to make
    ("node-c", 3, ["--prompt-seed", "7"]),
]
MODEL = "full_attention:16,sliding_window:16:64,mamba:16"  # kind:block_size[:window]


@dataclass(frozen=True)
class DemoOptions:
    steps: int  # scheduler steps per node
    rate: float  # steps per second per node, 0 = flat out


def _http(url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    # the processor may require KVPIPE_API_TOKEN: kvpipe.processors.core.remote sends it
    return ok_json(url, body, timeout=timeout)


class Demo:
    def __init__(self, settings: Settings, args: DemoOptions) -> None:
        self.s = settings
        self.args = args
        self.run = f"demo-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self.state = settings.state_path("demo", self.run).resolve()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.analytics_port = free_port()
        self.analytics_base = f"http://127.0.0.1:{self.analytics_port}"
        self.topics = {k: f"kvpipe-{self.run}-{k}" for k in ("events", "dlq", "snapshots", "analytics-snapshots")}
        self.env = dict(os.environ)
        self.env.update({
            "KVPIPE_EVENTS_TOPIC": self.topics["events"],
            "KVPIPE_DLQ_TOPIC": self.topics["dlq"],
            "KVPIPE_SNAPSHOT_TOPIC": self.topics["snapshots"],
            "KVPIPE_ANALYTICS_SNAPSHOT_TOPIC": self.topics["analytics-snapshots"],
            "KVPIPE_PROCESSOR_ID": f"kvpipe-{self.run}",
            "KVPIPE_ANALYTICS_ID": f"kvpipe-{self.run}-analytics",
            "KVPIPE_WEB_PORT": str(self.port),
            "KVPIPE_ANALYTICS_WEB_PORT": str(self.analytics_port),
            "KVPIPE_STATE_DIR": str(self.state),
            "KVPIPE_PARTITIONS": "2",
        })
        self.procs: list[subprocess.Popen] = []
        self.started_broker = False

    # --- set-up and tear-down ----------------------------------------------------------------------

    def start_broker(self) -> None:
        from kvpipe.infra.cli import broker_config
        from kvpipe.infra.kafka.local import LocalKafka
        from kvpipe.infra.topics import default_specs, ensure_topics

        if self.s.is_local_kafka():
            st = LocalKafka(broker_config(self.s)).up(timeout=120)
            self.started_broker = st.started
            print(f"kafka: {'started' if st.started else 'already running'} at {st.bootstrap}", file=sys.stderr)
        specs = default_specs(self.topics["events"], self.topics["dlq"], self.topics["snapshots"], 2,
                              self.topics["analytics-snapshots"])
        ensure_topics(self.s.bootstrap(), specs)

    def start_app(self, command: str, base: str) -> None:
        """`kvpipe processor` or `kvpipe analytics` as a child, up once its /stats answers."""
        self.state.mkdir(parents=True, exist_ok=True)
        log_path = self.state / f"{command}.log"
        log = open(log_path, "w")
        proc = subprocess.Popen([sys.executable, "-m", "kvpipe", command], env=self.env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        def answers() -> None:
            if proc.poll() is not None:  # not retried: a RuntimeError
                raise RuntimeError(f"{command} exited with {proc.returncode}; see {log_path}")
            _http(f"{base}/stats", timeout=2)

        try:  # OSError, ValueError: not listening yet, or an error status while it starts
            retrying(first_s=0.1, max_s=0.5, stop=stop_after_delay(90),
                     retry=retry_if_exception_type((OSError, ValueError)))(answers)
        except RetryError:
            raise RuntimeError(f"{command} did not answer on {base} within 90 s; see {log_path}") from None
        print(f"{command}: up at {base}", file=sys.stderr)

    def start_nodes(self) -> list[tuple[str, subprocess.Popen, Path]]:
        nodes = []
        for node_id, seed, extra in NODES:
            prefixes = self.state / f"{node_id}-prefixes.json"
            cmd = [sys.executable, "-m", "kvpipe", "node", "--node-id", node_id, "--seed", str(seed),
                   "--steps", str(self.args.steps), "--groups", MODEL, "--rate", str(self.args.rate),
                   "--export-prefixes", str(prefixes), "-o", "json",
                   *(a.format(half=self.args.steps // 2) for a in extra)]
            out = open(self.state / f"{node_id}.out", "w")
            err = open(self.state / f"{node_id}.log", "w")
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=err, start_new_session=True)
            self.procs.append(proc)
            nodes.append((node_id, proc, prefixes))
        return nodes

    def inject_bad_messages(self) -> int:
        """Two malformed messages (garbage, a truncated envelope) to show the DLQ path."""
        from confluent_kafka import Producer

        from kvpipe.schemas.codec import encode_envelope
        from kvpipe.schemas.envelope import Envelope

        good = encode_envelope(Envelope(v=1, node_id="intruder", epoch=1, seq=0, ts=time.time()))
        p = Producer(self.s.kafka_confluent_config())
        p.produce(self.topics["events"], key=b"intruder", value=b"\xc1 definitely not msgpack")
        p.produce(self.topics["events"], key=b"intruder", value=good[: len(good) // 2])
        p.flush(10)
        return 2

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:
            from kvpipe.infra.topics import delete_topics

            delete_topics(self.s.bootstrap(), list(self.topics.values()))
        except Exception as exc:  # the demo's result stands; say what was left behind
            print(f"note: could not delete demo topics: {exc}", file=sys.stderr)
        if self.started_broker:
            from kvpipe.infra.cli import broker_config
            from kvpipe.infra.kafka.local import LocalKafka

            print(f"kafka: {LocalKafka(broker_config(self.s)).down()}", file=sys.stderr)

    # --- the run -----------------------------------------------------------------------------------

    def wait_for_nodes(self, nodes) -> dict[str, dict]:
        t0 = time.monotonic()
        expected = self.args.steps * len(nodes)
        with Progress("nodes publishing") as bar:
            while any(p.poll() is None for _, p, _ in nodes):
                counters = self._stats().get("counters", {})
                msgs = counters.get("messages", 0)
                bar.update(min(msgs / max(expected, 1), 0.99),
                           f"{time.monotonic() - t0:5.1f}s  messages {msgs}  events {counters.get('events', 0)}")
                time.sleep(0.5)
        summaries = {}
        for node_id, proc, _ in nodes:
            if proc.returncode != 0:
                raise RuntimeError(f"{node_id} exited with {proc.returncode}; see {self.state / (node_id + '.log')}")
            lines = (self.state / f"{node_id}.out").read_text().strip().splitlines()
            summaries[node_id] = json.loads(lines[-1])
        return summaries

    def wait_caught_up(self, published_messages: int, injected: int, timeout: float = 60) -> tuple[dict, dict]:
        """Both apps consumed everything, and the store acknowledged every analytics row."""
        deadline = time.monotonic() + timeout
        total = published_messages + injected
        with Progress("apps catching up") as bar:
            while True:
                stats, analytics = self._stats(), self._stats(self.analytics_base)
                seen = stats.get("counters", {}).get("messages", 0)
                rows_seen = analytics.get("counters", {}).get("messages", 0)
                pending = analytics.get("store", {}).get("pending_rows")
                bar.update(min(seen, rows_seen) / max(total, 1),
                           f"routing app {seen}, analytics app {rows_seen} messages, {pending} rows pending")
                if (seen >= total and rows_seen >= total and pending == 0) or time.monotonic() > deadline:
                    return stats, analytics
                time.sleep(0.3)

    def _stats(self, base: str | None = None) -> dict:
        try:
            return _http(f"{base or self.base}/stats")
        except OSError:  # not answering (yet): no progress to show
            return {}

    def execute(self) -> int:
        self.start_broker()
        self.start_app("processor", self.base)
        self.start_app("analytics", self.analytics_base)
        injected = self.inject_bad_messages()
        t0 = time.monotonic()
        nodes = self.start_nodes()
        summaries = self.wait_for_nodes(nodes)
        published = sum((s.get("publisher") or {}).get("sent", 0) for s in summaries.values())
        stats, analytics = self.wait_caught_up(published, injected)
        elapsed = time.monotonic() - t0
        return self.report(summaries, stats, analytics, elapsed, nodes)

    def report(self, summaries: dict, stats: dict, analytics: dict, elapsed: float, nodes) -> int:
        events = sum(s.get("events", {}).get("total", 0) for s in summaries.values())
        print("\n=== kvpipe demo summary ===")
        print(f"nodes: {len(summaries)}, steps each: {self.args.steps}, wall time {elapsed:.1f} s")
        print(f"events published: {events}  ({events / max(elapsed, 1e-9):,.0f} events/s end to end)")
        c = stats.get("counters", {})
        print(f"routing app (kvpipe processor): messages {c.get('messages')}, events {c.get('events')} "
              f"(stored {c.get('stored')}, removed {c.get('removed')}), duplicates {c.get('duplicates')}, "
              f"gaps {c.get('gaps')}, new epochs {c.get('new_epochs')}, lifetimes closed {c.get('lifetimes')}")
        print(f"index size (live blocks) per group -> medium: {json.dumps(stats.get('index', {}), sort_keys=True)}")
        print(f"dead-letter queue: {c.get('dlq', 0)} messages {json.dumps(stats.get('dlq_by_reason', {}), sort_keys=True)}")
        ok = c.get("dlq", 0) >= 2 and c.get("events", 0) > 0
        nodes_view = _http(f"{self.base}/nodes")
        print("nodes:")
        for n in nodes_view.get("nodes", []):
            print(f"  {n.get('node_id')}: epoch {n.get('epoch')} seq {n.get('seq')} "
                  f"suspect={n.get('suspect')} live blocks group/medium={n.get('blocks')}")
        print("route answers for system prompts of two tenants (token ids in, as a router sends them): per node")
        print("the hma hit = the tokens vLLM's hybrid coordinator would reuse there (GPU, + loadable from CPU),")
        print("its score against the node's load, the chosen node; per-group prefixes only as an explanation:")
        seen_prompts: set[tuple] = set()
        for node_id, _, prefixes in nodes:
            if not prefixes.exists():
                continue
            for prompt in json.loads(prefixes.read_text())[:2]:
                key = tuple(prompt["token_ids"])
                if key in seen_prompts:
                    continue
                seen_prompts.add(key)
                # One more token after the system prompt (a user turn starts): vLLM never reuses a
                # request's last token, so the whole system prompt can be a hit.
                answer = _http(f"{self.base}/route", {"token_ids": prompt["token_ids"] + [0], "top_k": 3,
                                                      "semantics": "prefix-per-group"})
                print(f"  {prompt.get('name')} as served by {node_id} ({prompt.get('num_tokens')} tokens) -> "
                      f"chosen {answer.get('chosen')}:")
                for r in answer.get("nodes", []):
                    # the per-group prefix shows why a group-blind index misroutes: full attention
                    # holds the whole prefix on several nodes while a sliding-window group's tail may not
                    per_group = "  ".join(f"g{g['group_idx']}:{g.get('prefix_blocks', {}).get('any', 0)}"
                                          for g in r.get("groups", []))
                    print(f"    {r.get('node_id'):<8} {_hma_hit(r)}   prefix blocks per group: {per_group}")
                for n in answer.get("no_signal", []):
                    print(f"    {n.get('node_id'):<8} no signal: {n.get('reason')}")
        sink, store = analytics.get("sink", {}), analytics.get("store", {})
        print(f"analytics app (kvpipe analytics, own consumer group): messages "
              f"{analytics.get('counters', {}).get('messages')}, rows acknowledged by ClickHouse: events "
              f"{sink.get('kv_events_written')}, lifetimes {sink.get('kv_block_lifetimes_written')}; store "
              f"{store.get('state')}, {store.get('pending_rows')} rows pending")
        ok = ok and store.get("pending_rows") == 0
        queries = [
            "SELECT group_idx, kind, count() AS events, sum(num_blocks) AS blocks FROM kv_events_final "
            "GROUP BY group_idx, kind ORDER BY group_idx, kind",
            (QUERIES_DIR / "swa_fa_eviction_ratio.sql").read_text(),  # infra/ is inside kvpipe/ once installed
        ]
        for sql in queries:
            try:
                result = _http(f"{self.analytics_base}/sql", {"sql": sql}, timeout=30)
            except OSError as exc:  # HttpStatusError carries the app's reason
                print(f"analytics query failed: {exc}")
                return 1
            title = next((line[len("-- title:"):].strip() for line in sql.splitlines()
                          if line.startswith("-- title:")), sql)
            print(f"analytics (ClickHouse, via the analytics app's /sql): {title}")
            print(f"  {result.get('columns')}")
            for row in result.get("rows", []):
                print(f"  {row}")
            ok = ok and bool(result.get("rows"))
        from kvpipe.processors.analytics.report import build_report  # the capacity report, read through /sql
        from kvpipe.processors.core.remote import ProcessorSql

        report = build_report(ProcessorSql(self.analytics_base, timeout=60), self.state / "report.html")
        print(f"capacity-planning report (open in a browser, works offline): {report}")
        return 0 if ok else 1


def _hma_hit(row: dict) -> str:
    """`"hma hit <GPU> tok + <CPU> loadable, score <s>"` of a route row (and why it is not exact)."""
    load = row.get("load") or {}
    out = (f"hma hit {row.get('gpu_tokens')} tok + {row.get('loadable_tokens')} loadable, score "
           f"{row.get('score', 0.0):.3f} (running {load.get('running', 0)}, waiting {load.get('waiting', 0)}, "
           f"kv {load.get('kv_usage', 0.0):.2f})")
    return out if row.get("exact", True) else f"{out} [not exact: {row.get('reason')}]"


@click.command("demo", cls=Command, help=__doc__.replace("`kvpipe demo`: t", "T", 1))
@click.option("--steps", type=int, default=300, help="scheduler steps per node (default 300)")
@click.option("--rate", type=float, default=25.0, help="steps per second per node, 0 = flat out (default 25)")
@bootstrap_server_option()
@log_level_option()
def demo(steps: int, rate: float, bootstrap_server: str | None, log_level: str) -> int:
    apply_bootstrap(bootstrap_server)  # exported: the apps and nodes the demo starts inherit the brokers
    os.environ["KVPIPE_LOG_LEVEL"] = configure_logging(log_level)  # and the level
    run = Demo(load_settings(), DemoOptions(steps=steps, rate=rate))
    try:
        return run.execute()
    except Exception as exc:
        print(f"\nkvpipe demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        run.stop()
