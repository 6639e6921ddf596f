"""Latency of the saved capacity-planning queries on a store of realistic size, through the analyst path.

`saved_query_latency(rows)` builds a fresh chDB store in a temp dir (migrations applied), fills it with `rows`
block lifetimes and the KV events they imply, generated inside the engine by `INSERT ... SELECT FROM numbers()`
(this is the benchmark's own trusted path, not analyst SQL: it writes, and uses a table function), then times
every query in infra/clickhouse/queries/ through `AnalystQueries` with the default `QueryLimits`: one warm-up,
then the median of three. The target is under a second each. Also the re-store tracker's rebuild from the store
(`tracker_rebuild`: the app's own queries on assignment, the CPU tier's counts included; not analyst ones).

The synthetic fleet: 8 nodes, one epoch, two KV cache groups (0 full attention, 1 sliding window), GPU and CPU
media, a day of traffic. Each stored event carries 1..16 blocks (8.5 on average) drawn from a pool of recurring
prefixes, so removed hashes are stored again later (reuse distance has matches); lifetimes are exponential, short
for the sliding-window group, 95 % evicted, 4 % cleared, 1 % node_expired; each node reports its load once a
second (`kv_node_load`, 691,200 rows, whatever `rows` is). Each GPU store carries the count of its hashes the CPU
tier held, as the analytics app writes it (`from_cpu_blocks`), computed from the generated events by its SQL
definition (`cputier.event_counts_sql`; this fleet's prefixes never move between media, so it is 0). Rows arrive
in several parts per partition; timing starts once background merges have stopped (`settle`), with the parts they
left (FINAL still has work to do, as in a store that ingests continuously).

Run: `python -c "from kvpipe.bench.saved_queries import main; main()" [rows]`; `main(["--fill", DSN, rows])`
keeps a filled store, `main(["--compare", DSN, "--rounds", N, FILE, ...])` times query files on it in turn (old SQL
against new, back to back).
"""
from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import click
import clickhouse_connect

from kvpipe.processors.analytics.chclient import client_kwargs
from kvpipe.processors.analytics.cputier import event_counts_sql
from kvpipe.processors.analytics.migrations import apply_migrations
from kvpipe.processors.analytics.query import AnalystQueries, QueryLimits, SqlRequest, client_runner
from kvpipe.processors.analytics.rows import EVENT_COLUMNS
from kvpipe.processors.analytics.saved import SavedQuery, list_queries, load_query

TARGET_S = 1.0
BASE_TS = 1_767_225_600  # 2026-01-01 00:00:00 UTC
DAY_S = 86_400
NODES = 8
BLOCKS_PER_EVENT = 8.5  # mean of 1 + (i % 16)
PREFIX_POOL = 200_000  # distinct block-hash sequences; stores draw from it, so hashes recur
CAPACITY = 4096  # blocks per (node, group, medium) pool in the synthetic re-stores
STAGING = "kv_events_bench_fill"  # the generated events before their CPU-tier counts (dropped after the fill)


def fill(client: Any, rows: int) -> dict:
    """Insert `rows` lifetimes and ~rows/8.5 stored + as many removed events (plus a few clears)."""
    step = DAY_S / rows
    client.command(f"""
        INSERT INTO kv_block_lifetimes (node_id, epoch, group_idx, medium, block_hash, stored_ts, lifetime_s,
                                        removed_ts, reason, kafka_partition, kafka_offset, event_idx, copy_idx,
                                        group_kind)
        SELECT
            concat('node-', toString(n % {NODES})) AS node_id,
            toUInt64(1) AS epoch,
            toInt32(intDiv(n, {NODES}) % 2) AS group_idx,
            if(intDiv(n, 16) % 5 = 0, 'CPU', 'GPU') AS medium,
            cityHash64(n % {PREFIX_POOL * 8}) AS block_hash,
            toDateTime64({BASE_TS} + n * {step!r}, 6, 'UTC') AS stored_ts,
            -- exponential lifetimes: mean 5 s for the sliding-window group, 60 s for full attention
            -log((cityHash64(n, 1) % 1000000 + 1) / 1000001) * if(group_idx = 1, 5, 60) AS lifetime_s,
            stored_ts + toIntervalMicrosecond(toInt64(lifetime_s * 1e6)) AS removed_ts,
            multiIf(n % 100 < 95, 'evicted', n % 100 < 99, 'cleared', 'node_expired') AS reason,
            toUInt32(n % 8) AS kafka_partition,
            intDiv(n, 8) AS kafka_offset,
            toUInt32(0) AS event_idx,
            toUInt16(0) AS copy_idx,
            if(group_idx = 1, 'sliding_window', 'full_attention') AS group_kind
        FROM (SELECT number AS n FROM numbers({rows}))
        SETTINGS max_memory_usage = 0""")
    stored_events = max(1, int(rows / BLOCKS_PER_EVENT))
    events = 2 * stored_events
    estep = DAY_S / events
    # the events go through a staging table first: the analytics app writes each GPU store with the count of its
    # hashes the CPU tier held (`from_cpu_blocks`, processors/analytics/cputier.py), so the store gets the same
    # count, computed from the events by its SQL definition (`cputier.event_counts_sql`)
    client.command(f"CREATE TABLE {STAGING} AS kv_events ENGINE = MergeTree "
                   "ORDER BY (kafka_partition, kafka_offset, event_idx)")
    client.command(f"""
        INSERT INTO {STAGING} (ts, ingest_ts, node_id, epoch, seq, dp_rank, group_idx, medium, kind, spec_kind,
                               block_hashes, parent_hash, has_parent, num_blocks, num_tokens, block_size,
                               kafka_partition, kafka_offset, event_idx)
        SELECT
            toDateTime64({BASE_TS} + i * {estep!r}, 6, 'UTC') AS ts,
            ts AS ingest_ts,
            concat('node-', toString(intDiv(i, 2) % {NODES})) AS node_id,  -- a store and its removal on one node
            toUInt64(1) AS epoch,
            intDiv(i, 2 * {NODES}) * 2 + i % 2 AS seq,  -- per node: a store, then its removal, then the next
            toInt32(0) AS dp_rank,
            toInt32(intDiv(i, 16) % 2) AS group_idx,
            if(kind = 'cleared', '', if(intDiv(i, 32) % 5 = 0, 'CPU', 'GPU')) AS medium,
            multiIf(i % 100003 = 0, 'cleared', i % 2 = 0, 'stored', 'removed') AS kind,
            if(kind = 'stored', if(group_idx = 0, 'full_attention', 'sliding_window'), '') AS spec_kind,
            if(kind = 'cleared', [],
               arrayMap(j -> cityHash64(intDiv(i, 2) % {PREFIX_POOL}, j), range(1 + intDiv(i, 2) % 16))) AS block_hashes,
            cityHash64(intDiv(i, 2) % {PREFIX_POOL}) AS parent_hash,
            toUInt8(1) AS has_parent,
            toUInt32(length(block_hashes)) AS num_blocks,
            num_blocks * 16 AS num_tokens,
            toUInt32(16) AS block_size,
            toUInt32(i % 8) AS kafka_partition,
            intDiv(i, 8) AS kafka_offset,
            toUInt32(0) AS event_idx
        FROM (SELECT number AS i FROM numbers({events}))
        SETTINGS max_memory_usage = 0""")
    generated = [c for c in EVENT_COLUMNS if c != "from_cpu_blocks"]
    client.command(f"""
        INSERT INTO kv_events ({", ".join(generated)}, from_cpu_blocks)
        SELECT {", ".join(f"e.{c}" for c in generated)},
            if(e.medium = 'GPU' AND e.kind = 'stored', c.from_cpu_blocks, 0)
        FROM {STAGING} AS e
        LEFT JOIN ({event_counts_sql(STAGING)}) AS c
            ON e.kafka_partition = c.kafka_partition AND e.kafka_offset = c.kafka_offset AND e.event_idx = c.event_idx
        SETTINGS max_memory_usage = 0, join_use_nulls = 0""")
    client.command(f"DROP TABLE {STAGING}")
    # as many re-stores as lifetimes (a store whose blocks keep coming back): stack distances spread around
    # the slot's pool of CAPACITY blocks, so the capacity curve has a real shape to compute
    client.command(f"""
        INSERT INTO kv_restores (node_id, epoch, group_idx, group_kind, medium, block_hash, block_size, removed_ts,
                                 restored_ts, delay_s, end_reason, stack_distance, held_blocks, kafka_partition,
                                 kafka_offset, event_idx)
        SELECT
            concat('node-', toString(n % {NODES})) AS node_id,
            toUInt64(1) AS epoch,
            toInt32(intDiv(n, {NODES}) % 2) AS group_idx,
            if(group_idx = 1, 'sliding_window', 'full_attention') AS group_kind,
            if(intDiv(n, 16) % 5 = 0, 'CPU', 'GPU') AS medium,
            cityHash64(n % {PREFIX_POOL * 8}) AS block_hash,
            toUInt32(16) AS block_size,
            toDateTime64({BASE_TS} + n * {step!r}, 6, 'UTC') AS removed_ts,
            removed_ts + toIntervalMicrosecond(toInt64(delay_s * 1e6)) AS restored_ts,  -- columns go by position
            -log((cityHash64(n, 2) % 1000000 + 1) / 1000001) * 120 AS delay_s,
            if(n % 100 < 97, 'evicted', 'cleared') AS end_reason,
            toUInt64(-log((cityHash64(n, 3) % 1000000 + 1) / 1000001) * {CAPACITY} * 1.5) AS stack_distance,
            toUInt64({CAPACITY} - 1 - cityHash64(n, 4) % 8) AS held_blocks,
            toUInt32(n % 8) AS kafka_partition,
            intDiv(n, 8) AS kafka_offset,
            toUInt32(0) AS event_idx
        FROM (SELECT number AS n FROM numbers({rows}))
        SETTINGS max_memory_usage = 0""")
    # load reports: every node once a second for the day (NULL kv_usage now and then: a report may leave it out)
    client.command(f"""
        INSERT INTO kv_node_load (ts, node_id, epoch, seq, running, waiting, kv_usage, kafka_partition, kafka_offset)
        SELECT
            toDateTime64({BASE_TS} + intDiv(j, {NODES}) + 0.5, 6, 'UTC') AS ts,
            concat('node-', toString(j % {NODES})) AS node_id,
            toUInt64(1) AS epoch,
            intDiv(j, {NODES}) AS seq,
            toUInt32(cityHash64(j, 5) % 64) AS running,
            toUInt32(cityHash64(j, 6) % 16) AS waiting,
            if(j % 97 = 0, NULL, (cityHash64(j, 7) % 1000) / 1000) AS kv_usage,
            toUInt32(j % 8) AS kafka_partition,
            intDiv(j, 8) AS kafka_offset
        FROM (SELECT number AS j FROM numbers({DAY_S * NODES}))
        SETTINGS max_memory_usage = 0""")
    counts = {t: int(client.query(f"SELECT count() FROM {t}").result_rows[0][0])
              for t in ("kv_block_lifetimes", "kv_events", "kv_restores", "kv_node_load")}
    return counts


def settle(client: Any, timeout_s: float = 180.0) -> dict:
    """Wait until the engine runs no background merge, then report the active parts per table.

    A store that ingests continuously keeps merging in the background; timing queries while the fill's parts are
    being merged measures the merge, not the query. The parts left still make FINAL do real work.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if int(client.query("SELECT count() FROM system.merges").result_rows[0][0]) == 0:
            break
        time.sleep(1.0)
    rows = client.query("SELECT table, count() FROM system.parts WHERE active AND database = currentDatabase() "
                        "AND table IN ('kv_events', 'kv_block_lifetimes', 'kv_restores', 'kv_node_load') GROUP BY table"
                        ).result_rows
    return {str(t): int(n) for t, n in rows}


def tracker_rebuild(client: Any) -> dict:
    """Seconds to rebuild the re-store tracker of every partition from this store (what a restarted worker owning
    them all runs on assignment: `restore_state`), split into the query and the rebuilding in Python; the same for the
    CPU tier's counts (`cpu_*`)."""
    from kvpipe.processors.analytics.cputier import REBUILD_SQL, build_nodes
    from kvpipe.processors.analytics.restore_state import build_slots, restore_info, STATE_SQL
    from kvpipe.processors.analytics.restores import RestoreTracker

    ends = dict(client.query("SELECT kafka_partition, max(kafka_offset) FROM kv_events GROUP BY kafka_partition")
                .result_rows)
    parts = sorted(ends)
    max_keys = RestoreTracker().max_keys
    started = time.perf_counter()
    result = client.query(STATE_SQL, parameters={"partitions": parts, "offsets": [ends[p] for p in parts],
                                                 "max_keys": max_keys}, settings={"readonly": 1})
    columns = dict(zip(result.column_names, result.result_columns))
    query_s = time.perf_counter() - started
    started = time.perf_counter()
    state = build_slots(columns, max_keys)
    build_s = time.perf_counter() - started
    # the CPU tier's counts, rebuilt beside it (`restore_state.query_state` runs both)
    started = time.perf_counter()
    result = client.query(REBUILD_SQL, parameters={"partitions": parts, "offsets": [ends[p] for p in parts]},
                          settings={"readonly": 1})
    cpu_query_s = time.perf_counter() - started
    started = time.perf_counter()
    cpu = build_nodes(dict(zip(result.column_names, result.result_columns)))
    cpu_build_s = time.perf_counter() - started
    return {"query_s": round(query_s, 2), "build_s": round(build_s, 2), **restore_info(state),
            "cpu_query_s": round(cpu_query_s, 2), "cpu_build_s": round(cpu_build_s, 2),
            "cpu_copies": sum(len(held) for nodes in cpu.values() for n in nodes.values()
                              for held in n.groups.values())}


def _time_query(queries: AnalystQueries, request: SqlRequest, repeats: int = 3) -> tuple[list[float], int | str]:
    async def once() -> dict:
        return await queries.execute(request)

    try:
        result = asyncio.run(once())  # warm-up
    except Exception as exc:  # noqa: BLE001 - a failing query is a result of the benchmark, not its end
        return [], f"{type(exc).__name__}: {exc}"[:300]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = asyncio.run(once())
        times.append(time.perf_counter() - t0)
    return times, len(result["rows"])


def _timing(queries: AnalystQueries, saved: SavedQuery) -> dict:
    times, result_rows = _time_query(queries, SqlRequest(sql=saved.sql, params=saved.bind()))
    median = statistics.median(times) if times else None
    return {
        "median_s": round(median, 4) if median is not None else None,
        "runs_s": [round(t, 4) for t in times],
        "rows": result_rows if isinstance(result_rows, int) else None,
        "error": result_rows if isinstance(result_rows, str) else None,
        "meets_target": median is not None and median < TARGET_S,
    }


def compare_files(dsn: str, files: list[str], rounds: int = 2) -> dict:
    """Time query files (a saved query's format: header comments, `{name:Type}` parameters with defaults) on an
    existing store, in turn for `rounds` rounds — e.g. a saved query's old text against its new one, back to back
    on the same store. The store is read only."""
    from pathlib import Path

    client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))
    try:
        queries = AnalystQueries(client_runner(client), QueryLimits())
        out: dict[str, list] = {f: [] for f in files}
        for _ in range(rounds):
            for f in files:
                out[f].append(_timing(queries, load_query(Path(f).stem, Path(f).resolve().parent)))
        queries.close()
        return out
    finally:
        client.close()


def fill_store(dsn: str, rows: int) -> dict:
    """Fill a store (a throwaway: it must not be kvpipe's own) as `saved_query_latency` does, and keep it."""
    client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))
    try:
        apply_migrations(client)
        return {"rows": fill(client, rows), "parts": settle(client)}
    finally:
        client.close()


def saved_query_latency(rows: int = 10_000_000, dsn: str | None = None) -> dict:
    """Per saved query: median seconds of 3 (after a warm-up), result rows, and whether it meets TARGET_S.

    With `dsn` the rows go into that store instead of a fresh temp chDB (it must be a throwaway store).
    """
    tmp = None
    if dsn is None:
        tmp = tempfile.mkdtemp(prefix="kvpipe-bench-sql-")
        dsn = f"chdb://{tmp}/store"
    client = clickhouse_connect.get_client(dsn=dsn, **client_kwargs(dsn))
    try:
        apply_migrations(client)
        t0 = time.perf_counter()
        counts = fill(client, rows)
        fill_s = time.perf_counter() - t0
        parts = settle(client)
        limits = QueryLimits()
        queries = AnalystQueries(client_runner(client), limits)
        out: dict[str, Any] = {"rows": counts, "fill_s": round(fill_s, 2), "parts": parts, "target_s": TARGET_S,
                               "limits": limits.engine_settings(), "queries": {}}
        for saved in list_queries():
            out["queries"][saved.name] = _timing(queries, saved)
        queries.close()
        out["tracker_rebuild"] = tracker_rebuild(client)
        return out
    finally:
        client.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


@click.command("saved-queries", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--fill", "fill_to", nargs=2, type=(str, int), metavar="DSN ROWS",
              help="fill a throwaway store at DSN with ROWS events and keep it")
@click.option("--compare", "compare_dsn", metavar="DSN", help="time the query FILES on the store at DSN in turn")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True, help="rounds of --compare")
@click.argument("rest", nargs=-1)
def cli(fill_to: tuple[str, int] | None, compare_dsn: str | None, rounds: int, rest: tuple[str, ...]) -> None:
    """`[ROWS]`: fill a temp store and time every saved query (and the tracker rebuild); `--fill DSN ROWS`;
    `--compare DSN [--rounds N] FILE...`. Prints one JSON object."""
    import json

    if fill_to is not None:
        out: Any = fill_store(*fill_to)
    elif compare_dsn is not None:
        out = compare_files(compare_dsn, list(rest), rounds)
    else:
        if len(rest) > 1:
            raise click.UsageError("at most one ROWS argument")
        try:
            rows = int(rest[0]) if rest else 10_000_000
        except ValueError:
            raise click.BadParameter(f"{rest[0]!r} is not a row count", param_hint="ROWS") from None
        out = saved_query_latency(rows)
    print(json.dumps(out, indent=2))


def main(argv: list[str] | None = None) -> None:
    """The command line of this module (BENCHMARKS.md runs it as `python -c "… import main; main()" ROWS`)."""
    cli.main(args=sys.argv[1:] if argv is None else argv, prog_name="saved_queries")


if __name__ == "__main__":
    main()
