"""`kvpipe bench analytics`: the analytics app's write rate, and what it costs the routing app.

In one run, on a fresh topic pre-filled with N envelopes of E events each:
- baseline: the same rows (derived in this process by the pure path: `Ingest` + `rows`) inserted
  directly with clickhouse-connect into a fresh embedded chDB store, in the sink's batch size;
  the clock covers column conversion and inserts;
- value: a real `kvpipe analytics` child consuming the topic from offset 0 into its own chDB store,
  rows/s taken from its /stats (rows acknowledged by the store) between the first sample that saw
  rows written and the one that saw them all (startup and migrations excluded);
- freshness: a real `kvpipe processor` (routing app) on the same topic; publish one envelope with a
  new block and poll /route until it shows, p50/p99 over the probes — once with the analytics app
  idle, once while a client keeps a heavy query running on the analytics app's /sql;
- optionally (`--queries-rows N`), saved-query latency on N rows
  (`kvpipe.bench.saved_queries.saved_query_latency`, reported "missing" if absent);
- capacity: the re-store tracker (LRU stack distances, `restores.RestoreTracker`, what the capacity curve
  is computed from) over `--capacity-events` events of the demo-like workload (`workload.serving_steps`),
  timed apart from generating and applying them; the HTML report's generation time on a store filled
  from that workload (`--report-steps` steps), and the tracker's rebuild from that store (what a restarted
  worker runs on assignment, `restore_state`). `--capacity-only` runs just this part (no Kafka).
- baseline_pipeline: the same messages through the app's own per-message path in one thread, no
  Kafka, Faust or writer thread (`pipeline_insert`: decode + index apply + rows + re-store tracking +
  the same conversions and inserts), rows/s over the same row count — what the app could reach if
  its machinery cost nothing. `baseline` leaves out the decode/apply/row work the app must do.
- lifetimes_path: that per-message path without any store, lifetimes as rows (the reference) and as
  columns (the app's), side by side on the workload and on one with long prompts (more evictions per
  message; also with capacity tracking off, which leaves what the two modes do differently):
  lifetimes/s and messages/s each (`kvpipe.bench.analytics_lifetimes`); `--lifetimes-only`
  runs just this part (no Kafka, no store).
value = app rows/s; ratio = value / baseline (target >= 0.8); ratio_pipeline = value / baseline_pipeline.
"""
from __future__ import annotations

import asyncio
import gc
import json
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import httpx
import msgspec

from kvpipe.processors.analytics.chclient import client_kwargs
from kvpipe.processors.analytics.rows import EVENT_COLUMNS, LIFETIME_COLUMNS, EventRow, event_columns, event_rows, \
    group_kinds_of, lifetime_columns, number_copies
from kvpipe.processors.core.lifetimes import LifetimeRow
from kvpipe.bench.ingest import _create_topics, _delete_topics, _prefill, _raw_consume, make_envelopes
from kvpipe.processors.core.index import APPLIED, Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.schemas.cliopts import Command, run as run_command
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope
from kvpipe.schemas.events import BlockStored, Event
from kvpipe.schemas.settings import load_settings

# CPU-heavy but read-only and within the analyst limits: a hash over a bounded cross join of the
# events table (the engine's max_execution_time ends it if it runs long; either way it loads the CPU).
HEAVY_SQL = ("SELECT count() AS n FROM kv_events AS a CROSS JOIN (SELECT seq FROM kv_events LIMIT 1000) AS b "
             "WHERE cityHash64(a.seq, a.kafka_offset, b.seq) % 97 = 0")


def derive_rows(records: list, max_bytes: int) -> tuple[list[EventRow], list[LifetimeRow]]:
    """The rows the analytics app writes for these records (the same pure code it runs)."""
    ingest = Ingest(Index(ttl_s=None), max_bytes)  # lifetimes as rows (the reference form)
    events: list[EventRow] = []
    lifetimes: list[LifetimeRow] = []
    for r in records:
        result = ingest.handle(r.value, r.headers, r.partition, r.offset, 0.0)
        env = result.env
        if result.outcome != APPLIED or env is None:  # applied means decoded: env is there
            continue
        node = ingest.index.nodes.get(env.node_id)
        kinds = group_kinds_of(env) if node is None or not node.group_specs else \
            {g.group_idx: (g.kind, g.block_size) for g in node.group_specs}
        events.extend(event_rows(env, result.events, r.partition, r.offset, time.time(), kinds))
        ended = result.lifetimes
        if ended:
            assert isinstance(ended, list)  # an Index() keeps rows, not LifetimeColumns
            number_copies(ended)
            lifetimes.extend(ended)
    return events, lifetimes


def direct_insert(dsn: str, events: list, lifetimes: list, batch: int) -> float:
    """Seconds to insert these rows straight through clickhouse-connect (migrations excluded)."""
    import clickhouse_connect

    from kvpipe.processors.analytics.migrations import apply_migrations

    client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))
    try:
        apply_migrations(client)
        started = time.perf_counter()
        for table, rows, columns, convert in (("kv_events", events, EVENT_COLUMNS, event_columns),
                                              ("kv_block_lifetimes", lifetimes, LIFETIME_COLUMNS, lifetime_columns)):
            for i in range(0, len(rows), batch):
                client.insert(table, convert(rows[i:i + batch]), column_names=list(columns), column_oriented=True)
        return time.perf_counter() - started
    finally:
        client.close()


def pipeline_insert(dsn: str, records: list, max_bytes: int, batch: int, capacity: bool,
                    rows_engine: str = "native") -> tuple[float, int]:
    """The fair baseline: everything the app does per message except Kafka, Faust and the writer
    thread, in one thread — decode + index apply (`Ingest`), its row path (with the re-store tracker when
    capacity tracking is on) and the sink's batches, conversions and inserts (`tables`) in the sink's batch
    size. With native rows (`rows_engine` "native" where the native core runs, as the app chooses in
    processors/analytics/state.py) the records go in partition runs of `BatchDrainConsumer.max_run` through
    `Ingest.handle_batch` with the app's `derive.RunRows`, and the batches are native columns inserted as
    Native-format bytes; otherwise one message at a time through `derive.message_rows` and clickhouse-connect's
    encoding. Seconds (migrations excluded) and re-store rows written."""
    import clickhouse_connect

    from kvpipe.processors.analytics.derive import GC_THRESHOLDS, RunRows, message_rows
    from kvpipe.processors.analytics.tables import RESTORES, TABLES, native_batch, native_take
    from kvpipe.processors.analytics.migrations import apply_migrations
    from kvpipe.processors.analytics.cputier import CapacityTracker
    from kvpipe.processors.core import native
    from kvpipe.processors.core.batchdelivery import BatchDrainConsumer

    client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))
    thresholds = gc.get_threshold()
    gc.freeze()  # the worker's GC settings (agents.tune_gc), so GC costs the same on both sides
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        apply_migrations(client)
        index = Index(ttl_s=None, lifetimes="columns")  # as the app's (processors/analytics/state.py)
        native_rows = rows_engine == "native" and native.engine() == "native" and index.store.kind == "native"
        ingest = Ingest(index, max_bytes, native_runs=native_rows)
        tracker: Any = None  # the app's tracker (processors/analytics/state.py): re-stores and CPU-tier copies
        if capacity:
            if native_rows:
                from kvpipe.processors.analytics.nativetrack import NativeCapacityTracker
                tracker = NativeCapacityTracker()
            else:
                tracker = CapacityTracker()
        batches: dict[str, Any] = {t.name: native_batch(t) if native_rows else t.batch() for t in TABLES}
        written_restores = 0

        def take(table: Any, batch: Any, rows: Any) -> None:  # the sink writer's (processors/analytics/sink.py)
            if native_rows:
                native_take(table, batch, rows)
            else:
                table.take(batch, rows)

        def submit(rows: Any) -> None:
            nonlocal written_restores
            for table in TABLES:
                got = rows.get(table.name)
                if got is not None and len(got):  # lifetimes numbered per submit, as the writer does
                    take(table, batches[table.name], got)
            written_restores += len(rows.get(RESTORES, ()))

        def insert(final: bool) -> None:
            for table in TABLES:
                rows = batches[table.name]
                end = len(rows) if final else len(rows) - len(rows) % batch
                for i in range(0, end, batch):
                    j = min(i + batch, end)
                    if native_rows:
                        client.raw_insert(table.name, list(table.columns), insert_block=rows.encode(i, j),
                                          fmt="Native")
                    else:
                        client.insert(table.name, table.insert(rows[i:j]), column_names=list(table.columns),
                                      column_oriented=True)
                if native_rows:
                    rows.drop_front(end)
                else:
                    del rows[:end]

        run_rows = RunRows(index, tracker, submit) if native_rows else None
        started = time.perf_counter()
        for run in _partition_runs(records, BatchDrainConsumer.max_run):
            if run_rows is not None:
                done = 0
                while done < len(run):
                    done += ingest.handle_batch(run[done:] if done else run, rows=run_rows).handled
            else:
                for r in run:
                    record_ts = r.timestamp / 1000.0 if r.timestamp_type == 1 else None  # aiokafka's are ms
                    result = ingest.handle(r.value, r.headers, r.partition, r.offset, time.time(), record_ts)
                    submit(message_rows(result, r.partition, r.offset, index, tracker, time.time()))
            insert(final=False)
        insert(final=True)
        return time.perf_counter() - started, written_restores
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        client.close()


def serving_messages(steps: int, nodes: int) -> list[tuple[bytes, bytes]]:
    """`(key, value)` of the demo-like workload's steps as a node publishes them (key = node id)."""
    from kvpipe.bench.workload import serving_steps

    out = []
    for env, events in serving_steps(steps, nodes=nodes):
        env.num_events = len(events)
        env.batch = msgspec.Raw(encode_vllm_batch(events, env.ts))
        out.append((env.node_id.encode(), encode_envelope(env)))
    return out


def _partition_runs(records: list, longest: int) -> list[list]:
    """The records as batched delivery hands them over: consecutive records of one partition, at most `longest`."""
    runs: list[list] = []
    for r in records:
        if runs and runs[-1][0].partition == r.partition and len(runs[-1]) < longest:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def app_rate(proc: ProcessorProcess, total_rows: int, timeout: float) -> dict:
    samples: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = proc.get("/stats")
        sink = stats["sink"]
        written = sink["kv_events_written"] + sink["kv_block_lifetimes_written"]
        samples.append((time.perf_counter(), written))
        if written >= total_rows:
            break
        time.sleep(0.05)
    moving = [s for s in samples if s[1] > 0]
    if len(moving) < 2 or moving[-1][1] < total_rows:
        raise RuntimeError(f"analytics app wrote {samples[-1][1] if samples else 0}/{total_rows} rows in {timeout} s; "
                           f"log:\n{proc.log_tail()}")
    (t0, r0), (t1, r1) = moving[0], moving[-1]
    # where the app waited: for room in its sink (the store behind), and how its consumer handed messages over
    sink = stats["sink"]
    return {"seconds": t1 - t0, "rows": r1 - r0,
            "app": {"inserts": sink["batches"], "room_waits": sink["room_waits"],
                    "room_wait_s": round(sink["room_wait_s"], 2), "deliveries": stats.get("deliveries", {})}}


async def probe_freshness(proc: ProcessorProcess, bootstrap: str, topic: str, node_id: str, probes: int) -> list[float]:
    """ms from publish to the block showing in the routing app's /route, per probe."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0)
    await producer.start()
    base = int(uuid.uuid4().int % (1 << 40)) << 16
    latencies = []
    try:
        for i in range(probes):
            h = base + i
            ts = time.time()
            events: list[Event] = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], block_size=16,
                                               lora_id=None, medium="GPU", lora_name=None, group_idx=0)]
            env = Envelope(v=SCHEMA_MAJOR, node_id=node_id, epoch=1, seq=i, ts=ts, sent_ts=ts, num_events=1,
                           batch=msgspec.Raw(encode_vllm_batch(events, ts)))
            started = time.perf_counter()
            await producer.send_and_wait(topic, value=encode_envelope(env), key=node_id.encode(), headers=KAFKA_HEADERS)
            while not (await asyncio.to_thread(proc.route, {"0": [h]}))["nodes"]:
                pass
            latencies.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(0.02)
    finally:
        await producer.stop()
    return latencies


class HeavyQueries:
    """A client that keeps one heavy query running on the analytics app's /sql."""

    def __init__(self, url: str) -> None:
        self.url, self.stop = url, threading.Event()
        self.durations: list[float] = []  # seconds per query
        self.statuses: list[int] = []  # HTTP status per query (0: no answer)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = json.dumps({"sql": HEAVY_SQL}).encode()
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                started = time.perf_counter()
                try:
                    resp = client.post(self.url + "/sql", content=body, headers={"content-type": "application/json"})
                    self.statuses.append(resp.status_code)
                except httpx.TransportError:
                    self.statuses.append(0)
                self.durations.append(time.perf_counter() - started)

    def __enter__(self) -> "HeavyQueries":
        self.thread.start()
        time.sleep(1.0)  # the first query is running before the probes start
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(180)


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return round(values[min(len(values) - 1, int(len(values) * q))], 2)


def queries_part(rows: int | None) -> dict | str | None:
    if not rows:
        return None
    try:
        from kvpipe.bench.saved_queries import saved_query_latency
    except ImportError:
        return "missing"
    return saved_query_latency(rows)


def capacity_part(events: int, report_steps: int) -> dict:
    """Tracker time per event and block on the workload, and report generation time (see the module doc)."""
    from kvpipe.processors.analytics.report import build_report
    from kvpipe.processors.analytics.restore_state import query_state, restore_info
    from kvpipe.processors.analytics.restores import RestoreTracker
    from kvpipe.processors.analytics.sink import AnalyticsSink
    from kvpipe.bench.workload import KINDS, fill_store, serving_steps

    index, tracker = Index(ttl_s=None), RestoreTracker()
    seen = blocks = 0
    tracker_s = 0.0
    for offset, (env, evs) in enumerate(serving_steps(steps=1 << 40)):
        if seen >= events:
            break
        _, closed = index.apply(env, evs, 0, offset)
        assert isinstance(closed, list)  # an Index() keeps ended lifetimes as rows
        started = time.perf_counter()
        tracker.observe(env, evs, closed, 0, offset, KINDS)
        tracker_s += time.perf_counter() - started
        seen += len(evs)
        blocks += sum(len(e.block_hashes) for e in evs if e.__class__ is BlockStored)
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-bench-report-"))
    sink = AnalyticsSink(f"chdb://{tmp / 'store'}")
    sink.start()
    try:
        rows = fill_store(sink, serving_steps(report_steps))
        started = time.perf_counter()
        build_report(sink, tmp / "report.html")
        report_s = time.perf_counter() - started
        # what a restarted worker does on assignment: the tracker rebuilt from that store (one partition, all of it)
        started = time.perf_counter()
        state = query_state(sink.read_columns, {0: report_steps - 1}, tracker.max_keys)
        rebuild_s = time.perf_counter() - started
    finally:
        sink.close()
    return {"events": seen, "stored_blocks": blocks, "restores": tracker.restores, "tracker_s": round(tracker_s, 2),
            "tracker_us_per_stored_block": round(1e6 * tracker_s / max(1, blocks), 3),
            "report_s": round(report_s, 2), "report_store_rows": rows,
            "tracker_rebuild_s": round(rebuild_s, 3), "tracker_rebuild": restore_info(state)}


@click.command("analytics", cls=Command, help=__doc__.split("\n\n")[0])
@click.option("--envelopes", type=int, default=20_000, show_default=True, help="envelopes pre-filled on the topic")
@click.option("--events", type=int, default=25, show_default=True, help="events per envelope")
@click.option("--nodes", type=int, default=32, show_default=True, help="publishing nodes")
@click.option("--workload", type=click.Choice(["synthetic", "serving"]), default="synthetic", show_default=True,
              help="synthetic: every envelope --events new blocks stored and old ones evicted (no re-store); serving: "
                   "the demo-like workload (kvpipe/bench/workload.py: small steps, re-stores, a CPU tier, clears, "
                   "restarts, load reports; --envelopes steps of --nodes nodes), the unfavourable case")
@click.option("--partitions", type=int, default=4, show_default=True, help="partitions of the events topic")
@click.option("--probes", type=int, default=100, show_default=True, help="freshness probes per phase")
@click.option("--queries-rows", type=int, default=0, show_default=True,
              help="also measure saved-query latency on N rows")
@click.option("--capacity-events", type=int, default=2_000_000, show_default=True,
              help="events of the workload the re-store tracker is timed on (0: skip)")
@click.option("--report-steps", type=int, default=20_000, show_default=True,
              help="workload steps in the report's store")
@click.option("--capacity-only", is_flag=True, help="only the capacity and report timings")
@click.option("--lifetimes-steps", type=int, default=4000, show_default=True,
              help="workload steps of the rows-vs-columns lifetimes block (0: skip; long prompts: a quarter)")
@click.option("--lifetimes-only", is_flag=True, help="only the rows-vs-columns lifetimes block")
def analytics_bench(**params: Any) -> dict:
    args = SimpleNamespace(**params)
    from kvpipe.bench.analytics_lifetimes import lifetimes_part

    # not `lifetimes`: the Kafka part below names its lifetime rows so
    lifetimes_block = lifetimes_part(args.lifetimes_steps) if args.lifetimes_steps else None
    if args.lifetimes_only:
        main = lifetimes_block and lifetimes_block["serving_steps"]
        return {"bench": "analytics", "value": main and main["columns"]["lifetimes_per_s"],
                "unit": "lifetimes/s through the pure path as columns", "baseline": main
                and main["rows"]["lifetimes_per_s"], "ratio": main and main["speedup"],
                "lifetimes_path": lifetimes_block}
    capacity = capacity_part(args.capacity_events, args.report_steps) if args.capacity_events else None
    if args.capacity_only:
        return {"bench": "analytics", "value": capacity and round(capacity["events"] / max(capacity["tracker_s"], 1e-9)),
                "unit": "events/s through the re-store tracker", "baseline": None, "ratio": None, "capacity": capacity,
                "lifetimes_path": lifetimes_block}
    settings = load_settings()
    bootstrap = settings.bootstrap()
    tag = uuid.uuid4().hex[:8]
    topic, dlq = f"bench-ana-{tag}", f"bench-ana-dlq-{tag}"
    snaps, asnaps = f"bench-ana-snap-{tag}", f"bench-ana-asnap-{tag}"
    asyncio.run(_create_topics(bootstrap, [(topic, args.partitions, {}), (dlq, 1, {}),
                                           (snaps, args.partitions, {"cleanup.policy": "compact"}),
                                           (asnaps, args.partitions, {"cleanup.policy": "compact"})]))
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-bench-analytics-"))
    procs: list[ProcessorProcess] = []
    try:
        messages = (make_envelopes(args.envelopes, args.events, args.nodes, time.time() - 3600)
                    if args.workload == "synthetic" else serving_messages(args.envelopes, args.nodes))
        asyncio.run(_prefill(bootstrap, topic, messages))
        _, records = asyncio.run(_raw_consume(bootstrap, topic, args.envelopes))
        events, lifetimes = derive_rows(records, settings.max_message_bytes)
        total_rows = len(events) + len(lifetimes)
        direct_s = direct_insert(f"chdb://{tmp / 'direct'}", events, lifetimes, settings.analytics_batch_rows)
        del events, lifetimes
        pipeline_s, pipeline_restores = pipeline_insert(f"chdb://{tmp / 'pipeline'}", records, settings.max_message_bytes,
                                                        settings.analytics_batch_rows, settings.analytics_capacity,
                                                        settings.analytics_rows_engine)
        del records

        env = {"KVPIPE_KAFKA_BOOTSTRAP": bootstrap, "KVPIPE_EVENTS_TOPIC": topic, "KVPIPE_DLQ_TOPIC": dlq,
               "KVPIPE_SNAPSHOT_TOPIC": snaps, "KVPIPE_ANALYTICS_SNAPSHOT_TOPIC": asnaps,
               "KVPIPE_PARTITIONS": str(args.partitions), "KVPIPE_PROCESSOR_ID": f"bench-idx-{tag}",
               "KVPIPE_ANALYTICS_ID": f"bench-ana-{tag}", "KVPIPE_WEB_PORT": str(free_port()),
               "KVPIPE_ANALYTICS_WEB_PORT": str(free_port()), "KVPIPE_STATE_DIR": str(tmp / "state"),
               "KVPIPE_SNAPSHOT_EVERY_S": "3600", "KVPIPE_NODE_TTL_S": "36000",
               # the child sees only the KVPIPE_* given here (kvpipe/bench/procrun.py), so pass on what
               # the baselines were run with
               "KVPIPE_ANALYTICS_CAPACITY": str(settings.analytics_capacity).lower(),
               "KVPIPE_ANALYTICS_ROWS_ENGINE": settings.analytics_rows_engine,
               "KVPIPE_ANALYTICS_BATCH_ROWS": str(settings.analytics_batch_rows),
               "KVPIPE_ANALYTICS_FLUSH_S": str(settings.analytics_flush_s)}
        analytics = ProcessorProcess(env, tmp / "analytics.log", command="analytics").start()
        procs.append(analytics)
        rate = app_rate(analytics, total_rows, timeout=900)

        index = ProcessorProcess(env, tmp / "processor.log").start()
        procs.append(index)
        index.wait_offsets({p: 0 for p in range(args.partitions)} | _ends(analytics), timeout=600)
        idle = asyncio.run(probe_freshness(index, bootstrap, topic, f"probe-idle-{tag}", args.probes))
        with HeavyQueries(analytics.url) as heavy:
            loaded = asyncio.run(probe_freshness(index, bootstrap, topic, f"probe-heavy-{tag}", args.probes))
        queries = queries_part(args.queries_rows)
    finally:
        for proc in procs:
            proc.kill()
        asyncio.run(_delete_topics(bootstrap, [topic, dlq, snaps, asnaps]))

    direct_rows_s = total_rows / direct_s
    app_rows_s = rate["rows"] / rate["seconds"]
    return {
        "bench": "analytics",
        "value": round(app_rows_s),
        "unit": "rows/s into chDB through the analytics app",
        "baseline": round(direct_rows_s),
        "ratio": round(app_rows_s / direct_rows_s, 4),
        "baseline_pipeline": round(total_rows / pipeline_s),
        "ratio_pipeline": round(app_rows_s * pipeline_s / total_rows, 4),
        "rows": total_rows,
        "envelopes": args.envelopes,
        "workload": args.workload,
        "events_per_envelope": args.events if args.workload == "synthetic" else None,
        "direct_insert_s": round(direct_s, 2),
        "pipeline_s": round(pipeline_s, 2),
        "pipeline_restore_rows": pipeline_restores,
        "app_write_s": round(rate["seconds"], 2),
        "app_sink": rate["app"],
        "freshness_ms_p50_idle": round(statistics.median(idle), 2),
        "freshness_ms_p99_idle": _pct(idle, 0.99),
        "freshness_ms_p50_heavy_sql": round(statistics.median(loaded), 2),
        "freshness_ms_p99_heavy_sql": _pct(loaded, 0.99),
        "heavy_queries_run": len(heavy.durations),
        "heavy_query_s_median": round(statistics.median(heavy.durations), 2) if heavy.durations else None,
        "heavy_query_statuses": sorted(set(heavy.statuses)),
        "saved_query_latency": queries if queries is not None else "not requested (--queries-rows N)",
        "capacity": capacity,
        "lifetimes_path": lifetimes_block,
    }


def run(argv: list[str]) -> dict | int:
    """`kvpipe bench analytics`: the result, or an exit code after help or a usage error."""
    return run_command(analytics_bench, argv, "kvpipe bench analytics")


def _ends(proc: ProcessorProcess) -> dict[int, int]:
    """End offsets the analytics app has handled (it consumed the whole pre-filled topic)."""
    return {int(p): f["offset"] + 1 for p, f in proc.get("/stats")["freshness"].items()}
