"""`kvpipe bench ingest`: how fast the processor applies events, against raw consumption.

In one run, on fresh topics pre-filled with the same N envelopes of E events each (one topic per
delivery mode, so every mode starts from the same backlog):
- baseline: raw consumption of the topic (aiokafka, the client Faust runs on; nothing decoded);
- pure path: `Ingest.handle` (check headers, decode, validate, `Index.apply`) over the same bytes,
  in this process, no Kafka, one call per record; then `Ingest.handle_batch` over the same records
  in per-partition slices as batched delivery hands them over, with the reference (one `handle`
  per record) and with native runs (kvpipe.processors.core.ingestrun), each on a fresh index;
- agent, per delivery mode (`--delivery`, default `message,batch`: before and after batched
  delivery, kvpipe.processors.core.batchdelivery): a real `kvpipe processor` child consuming its topic from
  offset 0, rate taken from its /stats counters between the first and the last sample that saw
  progress (startup excluded); its index must equal the pure path's;
- freshness, per mode: publish one envelope with a new block and poll /route until it shows, one
  probe at a time; idle (nothing else published), then paced: while the load is published at
  `--paced-rate` block events/s for `--paced-s` seconds (the issue's goal: p99 at 100 k/s);
- for the last mode: restart from the shutdown snapshot vs a full rebuild from offset 0.
value = the last mode's agent block events/s; ratio = value / baseline. With `--pure-only` (no
processor, no freshness): value = the native-run pure path's block events/s.
"""
from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click

from kvpipe.bench.ingest_load import EnvelopeSource, Probes, paced_freshness, summary
from kvpipe.processors.core import native
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.schemas.cliopts import Command, run as run_command
from kvpipe.schemas.codec import KAFKA_HEADERS
from kvpipe.schemas.settings import load_settings

DELIVERY_MODES = ("message", "batch")  # settings.processor_delivery


def make_envelopes(n: int, events_per: int, nodes: int, seed_ts: float) -> list[tuple[bytes, bytes]]:
    """`n` envelopes of `nodes` nodes (kvpipe.bench.ingest_load.EnvelopeSource)."""
    return EnvelopeSource(events_per, nodes, seed_ts).take(n)


def _security() -> dict:
    """TLS/SASL keyword arguments from the settings (docs/security.md): a secured cluster benches too."""
    from kvpipe.processors.core.kafkaconf import aiokafka_kwargs

    return aiokafka_kwargs(load_settings())


def _security_env() -> dict[str, str]:
    """The KVPIPE_KAFKA_* security variables of this process, for the processor child."""
    return {k: v for k, v in os.environ.items()
            if k.startswith(("KVPIPE_KAFKA_SECURITY", "KVPIPE_KAFKA_SASL", "KVPIPE_KAFKA_SSL", "KVPIPE_KAFKA_OAUTH"))}


async def _create_topics(bootstrap: str, specs: list[tuple[str, int, dict]]) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **_security())
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, p, 1, topic_configs=cfg) for name, p, cfg in specs])
    finally:
        await admin.close()


async def _delete_topics(bootstrap: str, names: list[str]) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **_security())
    await admin.start()
    try:
        await admin.delete_topics(names)
    finally:
        await admin.close()


async def _prefill(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=20, max_batch_size=1 << 20,
                                max_request_size=8 << 20, compression_type="lz4", **_security())
    await producer.start()
    try:
        futures = [await producer.send(topic, value=v, key=k, headers=KAFKA_HEADERS) for k, v in messages]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


async def _raw_consume(bootstrap: str, topic: str, expected: int) -> tuple[float, list]:
    """Seconds to consume `expected` messages from offset 0, and the records (for the pure path)."""
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest",
                                enable_auto_commit=False, max_partition_fetch_bytes=8 << 20, fetch_max_bytes=64 << 20,
                                **_security())
    await consumer.start()
    records = []
    try:
        first = await consumer.getone()  # connection + metadata + first fetch are not consumption
        records.append(first)
        started = time.perf_counter()
        while len(records) < expected:
            batch = await consumer.getmany(timeout_ms=1000, max_records=10_000)
            for recs in batch.values():
                records.extend(recs)
        return time.perf_counter() - started, records
    finally:
        await consumer.stop()


PURE_PATHS = ("handle", "batch", "run")  # see `_pure_path`
MAX_RUN = 256  # records per `handle_batch` call, as batched delivery slices them (`BatchDrainConsumer.max_run`)


def _pure_path(records: list, max_bytes: int, how: str = "handle") -> tuple[float, int, dict]:
    """Seconds, events applied and the index's sizes over `records`: `how` = "handle": one
    `Ingest.handle` per record, as the agent did before batched delivery; "batch":
    `Ingest.handle_batch` on per-partition slices with the reference (a `handle` per record);
    "run": the same with native runs, as the batched agent runs it now."""
    # as the routing app runs it: native store and batch reader when built, lifetimes counted only
    ingest = Ingest(Index(ttl_s=None, lifetimes=False), max_bytes, native_batches=True, native_runs=how == "run")
    if how == "run" and not ingest.native_runs:
        raise click.ClickException(f"the native ingest run needs the native core: {native.reason()}")
    slices = _partition_slices(records) if how != "handle" else []
    started = time.perf_counter()
    if how == "handle":
        for r in records:
            record_ts = r.timestamp / 1000.0 if r.timestamp_type == 1 else None
            ingest.handle(r.value, r.headers, r.partition, r.offset, time.time(), record_ts)
    else:
        handle_batch = ingest.handle_batch
        for piece in slices:
            done = 0
            while done < len(piece):  # a stop (a DLQ copy due) hands over the rest, as the agent does
                done += handle_batch(piece[done:] if done else piece).handled
    return time.perf_counter() - started, ingest.index.counters["events"], ingest.index.sizes()


def _partition_slices(records: list) -> list[list]:
    """The records as the consumer delivers them: runs of one partition, at most `MAX_RUN` long."""
    out: list[list] = []
    for r in records:
        if not out or out[-1][0].partition != r.partition or len(out[-1]) >= MAX_RUN:
            out.append([])
        out[-1].append(r)
    return out


def _pure_paths(records: list, max_bytes: int, repeats: int) -> dict[str, tuple[float, int, dict]]:
    """Each pure path `repeats` times, interleaved (a busy host slows them alike); the fastest run."""
    best: dict[str, tuple[float, int, dict]] = {}
    for _ in range(repeats):
        for how in PURE_PATHS:
            got = _pure_path(records, max_bytes, how)
            if how not in best or got[0] < best[how][0]:
                best[how] = got
    return best


def _agent_rate(proc: ProcessorProcess, total_messages: int, timeout: float) -> dict:
    samples: list[tuple[float, int, int]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = proc.get("/stats")["counters"]
        samples.append((time.perf_counter(), c["messages"], c["events"]))
        if c["messages"] >= total_messages:
            break
        time.sleep(0.05)
    moving = [s for s in samples if s[1] > 0]
    if len(moving) < 2 or moving[-1][1] < total_messages:
        raise RuntimeError(f"processor consumed {samples[-1][1] if samples else 0}/{total_messages} messages in {timeout} s")
    (t0, m0, e0), (t1, m1, e1) = moving[0], moving[-1]
    return {"seconds": t1 - t0, "messages": m1 - m0, "events": e1 - e0}


def _probes(proc: ProcessorProcess, topic: str, node: str) -> Probes:
    def routable(block_hash: int) -> bool:
        return bool(proc.route({"0": [block_hash]})["nodes"])

    return Probes(load_settings().kafka_confluent_config(), topic, routable, node)


def _mode_run(mode: str, topics: tuple[str, str, str], args, tag: str, tmp: Path, bootstrap: str,
              pure_sizes: dict, paced: list[tuple[bytes, bytes]], events_per_msg: float, last: bool) -> dict:
    """One delivery mode on its own topics: agent rate over the backlog, idle and paced freshness,
    and (last mode) restart from the snapshot vs rebuild."""
    topic, dlq, snaps = topics
    proc = ProcessorProcess({**_security_env(), "KVPIPE_KAFKA_BOOTSTRAP": bootstrap, "KVPIPE_EVENTS_TOPIC": topic,
                             "KVPIPE_DLQ_TOPIC": dlq, "KVPIPE_SNAPSHOT_TOPIC": snaps,
                             "KVPIPE_PARTITIONS": str(args.partitions), "KVPIPE_PROCESSOR_ID": f"bench-{tag}-{mode}",
                             "KVPIPE_WEB_PORT": str(free_port()), "KVPIPE_STATE_DIR": str(tmp / mode / "state"),
                             "KVPIPE_SNAPSHOT_EVERY_S": "3600", "KVPIPE_NODE_TTL_S": "3600",
                             "KVPIPE_PROCESSOR_DELIVERY": mode}, tmp / f"processor-{mode}.log")
    (tmp / mode).mkdir(exist_ok=True)
    out: dict = {}
    try:
        proc.start()
        agent = _agent_rate(proc, args.envelopes, timeout=600)
        stats = proc.get("/stats")
        out["agent_msgs_per_s"] = round(agent["messages"] / agent["seconds"])
        out["agent_events_per_s"] = round(agent["events"] / agent["seconds"])
        out["index_equals_pure_path"] = stats["index"] == pure_sizes
        out["deliveries"] = stats["cluster"]["deliveries"]
        probes = _probes(proc, topic, "bench-probe-idle")
        try:
            out["freshness_idle_ms"] = summary([probes.once() for _ in range(args.probes)])
        finally:
            probes.close()
        del probes  # no client of ours across the paced publisher's fork
        latencies, sent = paced_freshness(load_settings().kafka_confluent_config(), topic, paced,
                                          args.paced_rate / events_per_msg,
                                          lambda: _probes(proc, topic, "bench-probe-paced"), args.probe_every_ms / 1000)
        behind = sum(f["behind"] or 0 for f in proc.get("/stats")["freshness"].values())
        out["freshness_paced_ms"] = {**summary(latencies),
                                     "published_events_per_s": round(sent["sent"] * events_per_msg / sent["seconds"]),
                                     "published_msgs": sent["sent"], "behind_at_end_msgs": behind}
        if last:
            # every probe was seen, so the processor has handled the whole topic: these are its ends
            end = {int(p): f["offset"] + 1 for p, f in proc.wait_offsets(_end_offsets(proc), 120)["freshness"].items()}
            snap_started = time.perf_counter()
            proc.stop()  # graceful: writes the shutdown snapshot
            out["stop_with_snapshot_s"] = round(time.perf_counter() - snap_started, 2)
            out.update(_restore_vs_rebuild(proc, end))
    finally:
        proc.kill()
    return out


def _end_offsets(proc: ProcessorProcess) -> dict[int, int]:
    """The events topic's end offsets, from the processor's own view (/stats: offset + behind)."""
    fresh = proc.get("/stats")["freshness"]
    return {int(p): f["offset"] + 1 + (f["behind"] or 0) for p, f in fresh.items()}


def _delivery_modes(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """`--delivery` as the list of modes, in order; a usage error names the known ones."""
    modes = [m.strip() for m in value.split(",") if m.strip()]
    if not modes or any(m not in DELIVERY_MODES for m in modes):
        raise click.BadParameter(f"a comma-separated list of {', '.join(DELIVERY_MODES)}; got {value!r}")
    return modes


@click.command("ingest", cls=Command, help=__doc__.split("\n\n")[0])
@click.option("--envelopes", type=int, default=60_000, show_default=True, help="backlog the agent rate is taken over")
@click.option("--events", type=int, default=25, show_default=True, help="events per envelope")
@click.option("--nodes", type=int, default=32, show_default=True, help="publishing nodes")
@click.option("--partitions", type=int, default=4, show_default=True, help="partitions of the events topic")
@click.option("--delivery", default=",".join(DELIVERY_MODES), show_default=True, callback=_delivery_modes,
              help="processor_delivery modes to run, in order; value and ratio are the last one's")
@click.option("--probes", type=int, default=50, show_default=True, help="idle freshness probes per mode")
@click.option("--paced-rate", type=float, default=100_000, show_default=True,
              help="block events/s published while probing")
@click.option("--paced-s", type=float, default=10.0, show_default=True, help="seconds of paced publishing per mode")
@click.option("--probe-every-ms", type=float, default=20.0, show_default=True,
              help="one paced probe per this many ms")
@click.option("--keep-topics", is_flag=True, help="leave the bench topics on the broker")
@click.option("--pure-only", is_flag=True,
              help="raw consumption and the in-process pure paths only: no processor, no freshness")
@click.option("--pure-repeats", type=int, default=1, show_default=True,
              help="runs of each pure path (interleaved); the fastest is reported")
def ingest_bench(**params: Any) -> dict:
    args = SimpleNamespace(**params)
    modes: list[str] = args.delivery
    settings = load_settings()
    bootstrap = settings.bootstrap()
    tag = uuid.uuid4().hex[:8]
    if args.pure_only:
        modes = modes[:1]  # one topic to consume from; no processor runs on it
    topics = {m: (f"bench-ingest-{tag}-{m}", f"bench-ingest-dlq-{tag}-{m}", f"bench-ingest-snap-{tag}-{m}")
              for m in modes}
    specs: list[tuple[str, int, dict[str, str]]] = []
    for t, dlq, snaps in topics.values():
        specs += [(t, args.partitions, {}), (dlq, 1, {}), (snaps, args.partitions, {"cleanup.policy": "compact"})]
    asyncio.run(_create_topics(bootstrap, specs))
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-bench-ingest-"))
    results: dict[str, dict] = {}
    try:
        source = EnvelopeSource(args.events, args.nodes, time.time())
        messages = source.take(args.envelopes)
        events_per = args.events  # envelopes of the paced phase carry what the backlog's do
        paced = source.take(int(args.paced_rate * args.paced_s / events_per), ts=time.time())
        for t, _, _ in topics.values():
            asyncio.run(_prefill(bootstrap, t, messages))
        raw_s, records = asyncio.run(_raw_consume(bootstrap, topics[modes[0]][0], args.envelopes))
        raw_msgs = len(records) - 1  # the first record is outside the timed window
        pure = _pure_paths(records, settings.max_message_bytes, max(1, args.pure_repeats))
        pure_s, total_events, pure_sizes = pure["handle"]
        events_per_msg = total_events / len(records)
        del records
        for i, mode in enumerate([] if args.pure_only else modes):
            results[mode] = _mode_run(mode, topics[mode], args, tag, tmp, bootstrap, pure_sizes, paced,
                                      events_per_msg, last=i == len(modes) - 1)
    finally:
        if not args.keep_topics:
            asyncio.run(_delete_topics(bootstrap, [name for names in topics.values() for name in names]))

    raw_events_s = raw_msgs * events_per_msg / raw_s
    pure_block = {how: {"events_per_s": round(events / secs), "msgs_per_s": round(args.envelopes / secs),
                        "index_equals_handle": sizes == pure_sizes}
                  for how, (secs, events, sizes) in pure.items()}
    if args.pure_only:
        run_rate = pure_block["run"]["events_per_s"]
        return {"bench": "ingest", "value": run_rate, "unit": "block-events/s", "baseline": round(raw_events_s),
                "ratio": round(run_rate / raw_events_s, 4), "envelopes": args.envelopes,
                "events_per_envelope": round(events_per_msg, 2), "raw_msgs_per_s": round(raw_msgs / raw_s),
                "pure_path_events_per_s": round(total_events / pure_s),
                "pure_path_msgs_per_s": round(args.envelopes / pure_s),
                "pure_path_ratio": round(total_events / pure_s / raw_events_s, 4), "pure_path": pure_block,
                "run_over_batch_reference": round(pure["batch"][0] / pure["run"][0], 2)}
    for r in results.values():
        r["ratio"] = round(r["agent_events_per_s"] / raw_events_s, 4)
    last = results[modes[-1]]
    out = {
        "bench": "ingest",
        "value": last["agent_events_per_s"],
        "unit": "block-events/s",
        "baseline": round(raw_events_s),
        "ratio": last["ratio"],
        "delivery": modes[-1],
        "freshness_ms_p50": last["freshness_paced_ms"].get("p50"),
        "freshness_ms_p99": last["freshness_paced_ms"].get("p99"),
        "paced_events_per_s": last["freshness_paced_ms"]["published_events_per_s"],
        "envelopes": args.envelopes,
        "events_per_envelope": round(events_per_msg, 2),
        "raw_msgs_per_s": round(raw_msgs / raw_s),
        "pure_path_events_per_s": round(total_events / pure_s),
        "pure_path_msgs_per_s": round(args.envelopes / pure_s),
        "pure_path_ratio": round(total_events / pure_s / raw_events_s, 4),
        "pure_path": pure_block,
        "run_over_batch_reference": round(pure["batch"][0] / pure["run"][0], 2),
        "modes": results,
    }
    if "message" in results and "batch" in results:
        out["batch_over_message"] = round(results["batch"]["agent_events_per_s"] /
                                          results["message"]["agent_events_per_s"], 2)
    return out


def run(argv: list[str]) -> dict | int:
    """`kvpipe bench ingest`: the result, or an exit code after help or a usage error."""
    return run_command(ingest_bench, argv, "kvpipe bench ingest")


def _restore_vs_rebuild(proc: ProcessorProcess, end: dict[int, int]) -> dict:
    """Time until a restarted processor has the whole log's index: from the shutdown snapshot,
    vs a fresh consumer group with no snapshot (full rebuild from offset 0). Both include the
    process start and the group join; the difference is what the snapshot saves."""
    started = time.perf_counter()
    proc.start()
    stats = proc.wait_offsets(end, timeout=600)
    restore_s = time.perf_counter() - started
    restores = stats["durability"]["restores"]
    proc.kill()
    rebuild = ProcessorProcess({**{k: v for k, v in proc.env.items() if k.startswith("KVPIPE_")},
                                "KVPIPE_PROCESSOR_ID": f"{proc.env['KVPIPE_PROCESSOR_ID']}-rebuild",
                                "KVPIPE_SNAPSHOT_TOPIC": proc.env["KVPIPE_DLQ_TOPIC"],  # holds no snapshots
                                "KVPIPE_WEB_PORT": str(free_port())}, proc.log_path.with_name("rebuild.log"))
    started = time.perf_counter()
    rebuild.start()
    try:
        rebuilt = rebuild.wait_offsets(end, timeout=600)
        rebuild_s = time.perf_counter() - started
    finally:
        rebuild.kill()
    return {"restart_from_snapshot_s": round(restore_s, 2),
            "snapshot_read_ms": round(sum(r["ms"] for r in restores), 1),
            "restored_blocks": sum(r["blocks"] for r in restores),
            "replayed_after_restore": stats["counters"]["messages"],
            "restart_with_full_rebuild_s": round(rebuild_s, 2),
            "rebuild_index_equal": rebuilt["index"] == stats["index"],
            **({} if rebuilt["index"] == stats["index"] else
               {"rebuild_index": rebuilt["index"], "restored_index": stats["index"],
                "rebuild_counters": rebuilt["counters"], "restored_counters": stats["counters"],
                "rebuild_deliveries": rebuilt["cluster"]["deliveries"]})}
