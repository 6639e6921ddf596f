"""The analytics app's pure path with lifetimes as rows (the reference) and as columns, side by side.

In one process, no Kafka, Faust, writer thread or store: the demo-like workload (`workload.serving_steps`,
many evictions) encoded as Kafka messages once, then per mode a fresh index (`Index(lifetimes="rows")`
or `"columns"`) and re-store tracker, and per message what the app does with it: decode + index apply
(`Ingest.handle`), its derive step (`derive.message_rows`: event columns, lifetimes' reasons and kinds,
re-stores, load), and what the sink's writer does before an insert (copy ordinals, the lifetimes in
insert-column form per batch of `batch_rows`). The modes alternate, `repeats` times each, best run
kept. `agent_s` is the event loop's share (decode + apply + derive), `writer_s` the writer's.
"""
from __future__ import annotations

import gc
import time
from typing import Any

import msgspec

from kvpipe.bench.workload import serving_steps
from kvpipe.processors.core import lifetimes as lifecols
from kvpipe.processors.analytics.derive import GC_THRESHOLDS, message_rows
from kvpipe.processors.analytics.tables import EVENTS, LIFETIMES, RESTORES
from kvpipe.processors.core.lifetimes import LifetimeColumns
from kvpipe.processors.analytics.cputier import CapacityTracker
from kvpipe.processors.analytics.rows import EventColumns, lifetime_columns, number_copies
from kvpipe.processors.core.index import Index, LifetimesMode
from kvpipe.processors.core.ingest import Ingest
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch

MODES: tuple[LifetimesMode, ...] = ("rows", "columns")


def encoded_workload(steps: int, **workload: Any) -> list[bytes]:
    """The workload's messages as the bridge publishes them (envelope + vLLM batch bytes)."""
    out = []
    for env, events in serving_steps(steps, **workload):
        env.num_events = len(events)
        env.batch = msgspec.Raw(encode_vllm_batch(events, env.ts))
        out.append(encode_envelope(env))
    return out


def run_once(mode: LifetimesMode, messages: list[bytes], batch_rows: int, max_bytes: int, capacity: bool = True) -> dict:
    index = Index(ttl_s=None, lifetimes=mode)
    ingest, tracker = Ingest(index, max_bytes), CapacityTracker() if capacity else None
    columns = mode == "columns"
    events = EventColumns()
    pending: Any = LifetimeColumns() if columns else []
    lifetimes = restores = 0
    agent_s = writer_s = 0.0
    clock = time.perf_counter
    now = time.time()
    for offset, value in enumerate(messages):
        t0 = clock()
        result = ingest.handle(value, KAFKA_HEADERS, 0, offset, now)
        rows = message_rows(result, 0, offset, index, tracker, now)
        ev, lt, rs = rows.get(EVENTS, ()), rows.get(LIFETIMES, ()), rows.get(RESTORES, ())
        t1 = clock()
        agent_s += t1 - t0
        if isinstance(ev, EventColumns) and len(ev):  # event columns in both modes
            events.extend(ev)
        del events[:]  # events are the same work in both modes: not held
        restores += len(rs)
        if len(lt):
            lifetimes += len(lt)
            if isinstance(lt, LifetimeColumns):  # mode "columns"
                lifecols.number_copies(lt)
            elif isinstance(lt, list):  # mode "rows": LifetimeRow objects
                number_copies(lt)
            pending.extend(lt)
            while len(pending) >= batch_rows:
                if columns:
                    pending[:batch_rows].insert_columns()
                else:
                    lifetime_columns(pending[:batch_rows])
                del pending[:batch_rows]
        writer_s += clock() - t1
    t1 = clock()
    if columns:
        pending[:].insert_columns()
    else:
        lifetime_columns(pending)
    writer_s += clock() - t1
    return {"agent_s": agent_s, "writer_s": writer_s, "lifetimes": lifetimes, "restores": restores}


def lifetimes_path(steps: int, repeats: int = 3, batch_rows: int = 5000, max_bytes: int = 8 << 20,
                   capacity: bool = True, **workload: Any) -> dict:
    """lifetimes/s and messages/s of the pure path per mode (see the module doc)."""
    messages = encoded_workload(steps, **workload)
    best: dict[str, dict] = {}
    thresholds = gc.get_threshold()
    gc.freeze()  # the worker's GC settings (agents.tune_gc)
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        for _ in range(repeats):
            for mode in MODES:
                got = run_once(mode, messages, batch_rows, max_bytes, capacity)
                total = got["agent_s"] + got["writer_s"]
                if mode not in best or total < best[mode]["agent_s"] + best[mode]["writer_s"]:
                    best[mode] = got
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    rows, cols = best["rows"], best["columns"]
    if (rows["lifetimes"], rows["restores"]) != (cols["lifetimes"], cols["restores"]):
        raise RuntimeError(f"the two paths disagree: rows {rows} columns {cols}")
    out: dict[str, Any] = {"messages": len(messages), "lifetimes": rows["lifetimes"], "restores": rows["restores"],
                           "lifetimes_per_message": round(rows["lifetimes"] / max(1, len(messages)), 2),
                           "workload": {"steps": steps, **workload}, "capacity_tracking": capacity,
                           "repeats": repeats}
    for name, got in best.items():
        total = got["agent_s"] + got["writer_s"]
        out[name] = {"lifetimes_per_s": round(got["lifetimes"] / total), "messages_per_s": round(len(messages) / total),
                     "agent_s": round(got["agent_s"], 3), "writer_s": round(got["writer_s"], 3)}
    out["speedup"] = round((rows["agent_s"] + rows["writer_s"]) / (cols["agent_s"] + cols["writer_s"]), 3)
    return out


def lifetimes_part(steps: int) -> dict:
    """The `kvpipe bench analytics` block: the workload, with long prompts, and those without the tracker."""
    # long prompts: blocks_per_prompt=64, gpu_blocks=512, ~100 lifetimes per message
    return {"serving_steps": lifetimes_path(steps, repeats=5),
            "serving_steps_long_prompts": lifetimes_path(steps // 4, repeats=5, blocks_per_prompt=64, gpu_blocks=512),
            # the re-store tracker's per-end dict work is the same in both modes: without it, what changed
            "serving_steps_long_prompts_no_tracker": lifetimes_path(steps // 4, repeats=5, capacity=False,
                                                                    blocks_per_prompt=64, gpu_blocks=512)}
