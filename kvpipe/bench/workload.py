"""A demo-like serving workload, and a store filled from it by the analytics app's own row path.

`serving_steps` simulates nodes serving requests over a skewed set of prompts: each node has a full
attention and a sliding-window group, an LRU GPU pool per group and a CPU tier that receives what the GPU
evicts. A request touches its prompt's blocks: a cached block is a hit (vLLM publishes nothing), a
missing one is stored (BlockStored), evicting the least recently used block when the pool is full
(BlockRemoved). Now and then a node clears its GPU cache (AllBlocksCleared) or restarts (new epoch).
Every envelope reports load: `kv_usage` is the GPU pools' fill, `running`/`waiting` a fixed cycle.

`fill_store` runs those steps through the same pure code as the analytics agent (`Index.apply`,
`rows.event_rows`, `rows.load_row`, `restores.RestoreTracker`) and inserts the rows through `AnalyticsSink`, so the
saved queries, `kvpipe plan` and the report can be exercised on a realistic store without Kafka. The
tests use it small; `kvpipe bench analytics` uses it for the capacity-curve and report timings.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from typing import Iterator

import msgspec

from kvpipe.processors.analytics.restores import RestoreTracker, refine_reasons
from kvpipe.processors.analytics.rows import event_rows, load_row
from kvpipe.processors.analytics.tables import EVENTS, LIFETIMES, LOADS, RESTORES
from kvpipe.processors.core.index import APPLIED, Index
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
KINDS = {g.group_idx: (g.kind, g.block_size) for g in SPECS}


class _Node:
    def __init__(self, name: str, gpu_blocks: int, cpu_blocks: int) -> None:
        self.name, self.epoch, self.seq = name, 1, 0
        self.gpu: dict[int, OrderedDict[int, None]] = {g.group_idx: OrderedDict() for g in SPECS}  # LRU first
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self.gpu_blocks, self.cpu_blocks = gpu_blocks, cpu_blocks


def serving_steps(steps: int, nodes: int = 4, prompts: int = 400, blocks_per_prompt: int = 8,
                  gpu_blocks: int = 256, cpu_blocks: int = 512, seed: int = 1,
                  start_ts: float = 1_767_225_600.0, step_s: float = 0.5) -> Iterator[tuple[Envelope, list[Event]]]:
    """`(envelope, events)` per node step, in publish order. The envelope's batch is left empty: the
    events travel beside it (callers that publish encode them)."""
    rng = random.Random(seed)
    fleet = [_Node(f"node-{i}", gpu_blocks, cpu_blocks) for i in range(nodes)]
    weights = [1.0 / (1 + p) ** 0.9 for p in range(prompts)]  # Zipf-like prompt popularity
    for step in range(steps):
        node = fleet[step % nodes]
        ts = start_ts + step * step_s
        events: list[Event] = []
        if rng.random() < 0.0005:  # a restart: new epoch, empty caches
            node.epoch, node.seq = node.epoch + 1, 0
            node.gpu = {g.group_idx: OrderedDict() for g in SPECS}
            node.cpu = OrderedDict()
        elif rng.random() < 0.001:
            events.append(AllBlocksCleared())
            for pool in node.gpu.values():
                pool.clear()
        prompt = rng.choices(range(prompts), weights)[0]
        for group, pool in node.gpu.items():
            fresh: list[bytes | int] = []
            for b in range(blocks_per_prompt if group == 0 else min(4, blocks_per_prompt)):
                h = (prompt * 1000 + b) * 2 + group + 1
                if h in pool:
                    pool.move_to_end(h)
                    continue
                if len(pool) >= node.gpu_blocks:
                    old, _ = pool.popitem(last=False)
                    events.append(BlockRemoved(block_hashes=[old], medium="GPU", group_idx=group))
                    if group == 0:  # full-attention blocks go to the CPU tier on eviction
                        if len(node.cpu) >= node.cpu_blocks:
                            gone, _ = node.cpu.popitem(last=False)
                            events.append(BlockRemoved(block_hashes=[gone], medium="CPU", group_idx=0))
                        if old not in node.cpu:
                            node.cpu[old] = None
                            events.append(BlockStored(block_hashes=[old], parent_block_hash=None, token_ids=[],
                                                      block_size=16, lora_id=None, medium="CPU", lora_name=None,
                                                      group_idx=0))
                pool[h] = None
                fresh.append(h)
            if fresh:
                events.append(BlockStored(block_hashes=fresh, parent_block_hash=None, token_ids=[0] * 16 * len(fresh),
                                          block_size=16, lora_id=None, medium="GPU", lora_name=None, group_idx=group))
        turn = step // nodes  # not from rng: the events stay those of a workload without load
        usage = sum(map(len, node.gpu.values())) / (node.gpu_blocks * len(node.gpu))
        env = Envelope(v=SCHEMA_MAJOR, node_id=node.name, epoch=node.epoch, seq=node.seq, ts=ts, sent_ts=ts,
                       group_specs=SPECS if node.seq == 0 else None, num_events=len(events), batch=msgspec.Raw(b"[]"),
                       running=1 + turn % 8, waiting=turn % 3, kv_usage=round(usage, 4))
        node.seq += 1
        yield env, events


def fill_store(sink, steps, batch_messages: int = 200) -> dict[str, int]:
    """Apply `steps` with the analytics app's row path and write the rows through `sink` (started);
    returns row counts per table."""
    index, tracker = Index(ttl_s=None), RestoreTracker()
    counts = {"events": 0, "lifetimes": 0, "restores": 0, "loads": 0, "messages": 0}
    ev_rows: list = []
    lt_rows: list = []
    rs_rows: list = []
    ld_rows: list = []
    for offset, (env, events) in enumerate(steps):
        outcome, closed = index.apply(env, events, 0, offset)
        if outcome != APPLIED:
            continue
        assert isinstance(closed, list)  # Index() keeps ended lifetimes as rows (not `lifetimes="columns"`)
        refine_reasons(env, closed)
        for lt in closed:
            lt.group_kind = KINDS.get(lt.group_idx, ("", 0))[0]
        ev_rows += event_rows(env, events, 0, offset, env.ts, KINDS)
        rs_rows += tracker.observe(env, events, closed, 0, offset, KINDS)
        lt_rows += closed
        load = load_row(env, 0, offset)
        if load is not None:
            ld_rows.append(load)
        counts["messages"] += 1
        if counts["messages"] % batch_messages == 0:
            _flush(sink, counts, ev_rows, lt_rows, rs_rows, ld_rows)
            ev_rows, lt_rows, rs_rows, ld_rows = [], [], [], []
    _flush(sink, counts, ev_rows, lt_rows, rs_rows, ld_rows)
    if not sink.flush(600):
        raise RuntimeError(f"the store did not acknowledge the workload's rows: {sink.counters()['store_reason']}")
    return counts


def _flush(sink, counts: dict, ev: list, lt: list, rs: list, ld: list) -> None:
    counts["events"] += len(ev)
    counts["lifetimes"] += len(lt)
    counts["restores"] += len(rs)
    counts["loads"] += len(ld)
    sink.submit({EVENTS: ev, LIFETIMES: lt, RESTORES: rs, LOADS: ld})
