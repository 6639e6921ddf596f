"""Rows/s the analytics sink writes into embedded chDB, against raw inserts of the same columns.

    python tests/benchmarks/bench_analytics_sink.py [--rows 200000] [--batch 5000] [--per-submit 50]

Rows look like a hybrid model's stream: 2 groups, mostly single-hash BlockRemoved and 1-8-hash
BlockStored events, submitted per message as the processor does. Prints one JSON object. Not a test
(pytest does not collect it); the store lives in a temporary directory removed afterwards.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import clickhouse_connect

from kvpipe.processors.analytics.rows import EVENT_COLUMNS, EventRow, event_columns
from kvpipe.processors.analytics.sink import AnalyticsSink
from kvpipe.processors.analytics.tables import EVENTS


def make_rows(n: int, seed: int = 7) -> list[EventRow]:
    rnd = random.Random(seed)
    rows = []
    for i in range(n):
        stored = rnd.random() < 0.4
        hashes = [rnd.getrandbits(64) for _ in range(rnd.randint(1, 8) if stored else 1)]
        rows.append(EventRow(f"node-{i % 8}", 1, i // 50, 0, i % 2, "GPU", "stored" if stored else "removed", hashes,
                             rnd.getrandbits(64) if stored else None, len(hashes), 16 * len(hashes) if stored else 0, 16,
                             "full_attention" if i % 2 == 0 else "sliding_window", 1.7e9 + i / 1000, 1.7e9 + i / 1000,
                             i % 4, i // 50, i % 50))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("--per-submit", type=int, default=50)
    args = ap.parse_args()
    rows = make_rows(args.rows)
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-bench-"))
    try:
        sink = AnalyticsSink(f"chdb://{tmp / 'sink'}", batch_rows=args.batch, flush_s=1.0, max_queue_rows=10 * args.rows)
        sink.start()
        t0 = time.perf_counter()
        submit_s = 0.0
        for i in range(0, len(rows), args.per_submit):
            s0 = time.perf_counter()
            sink.submit({EVENTS: rows[i:i + args.per_submit]})
            submit_s += time.perf_counter() - s0
        assert sink.flush(600)
        sink_s = time.perf_counter() - t0
        counters = sink.counters()
        stored = sink.query("SELECT count() FROM kv_events_final")["rows"][0][0]
        sink.close()

        client = clickhouse_connect.get_client(dsn=f"chdb://{tmp / 'sink'}")
        client.command("TRUNCATE TABLE kv_events")
        t0 = time.perf_counter()
        for i in range(0, len(rows), args.batch):
            client.insert("kv_events", event_columns(rows[i:i + args.batch]), column_names=list(EVENT_COLUMNS),
                          column_oriented=True)
        raw_s = time.perf_counter() - t0
        client.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n = len(rows)
    print(json.dumps({
        "bench": "analytics_sink", "rows": n, "batch_rows": args.batch, "rows_per_submit": args.per_submit,
        "value": round(n / sink_s), "unit": "rows/s", "baseline": round(n / raw_s), "ratio": round(raw_s / sink_s, 3),
        "sink_s": round(sink_s, 3), "raw_insert_s": round(raw_s, 3),
        "submit_us_per_call": round(1e6 * submit_s / (n / args.per_submit), 2),
        "rows_in_store": stored, "written": counters["kv_events_written"], "retries": counters["retries"],
        "submit_blocked": counters["submit_blocked"],
    }, sort_keys=True))


if __name__ == "__main__":
    main()
