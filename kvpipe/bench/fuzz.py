"""Hostile input for the pure ingest path (`Ingest.handle` on a real `Index`), and a model to
check it against. Used by `tests/fuzz/test_fuzz_quick.py` (~10^4 inputs) and `kvpipe bench fuzz`
(>= 10^5 inputs, inputs/s, outcomes by reason, RSS growth).

A run interleaves envelopes of a few well-behaved nodes (`GOOD-node-<i>`, consecutive seqs, their
cache tracked by `Model`) with generated bad or hostile messages from other node ids (or from the
good ids when the message must be refused whole, e.g. a NaN timestamp). It checks that nothing
raises, that every message the DLQ gets has a reason other than `internal`, that messages built
to be rejected are, and that the good nodes' entries equal the model's exactly and none of them
was expired or marked suspect by someone else's input (the liveness timer runs on the partition
clock in between, as it does while a backlog is replayed).
"""
from __future__ import annotations

import os
import random
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import click
import msgspec

from kvpipe.processors.core.index import APPLIED, DUPLICATE, REFUSED, STALE, Index
from kvpipe.processors.core.ingest import DLQ, Ingest
from kvpipe.processors.core.slots import key_of
from kvpipe.processors.core.snapshot import decode_chunk, export_partition, import_chunks
from kvpipe.schemas.cliopts import Command, run as run_command
from kvpipe.schemas.codec import ERROR_KINDS, KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import HEADER_CONTENT_TYPE, HEADER_VERSION, SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored, Event

MAX_BYTES = 64 * 1024
TTL_S = 30.0
GOOD_NODES = 4
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
OUTCOMES = (APPLIED, DUPLICATE, STALE, REFUSED, DLQ)
MUST_DLQ = "must_dlq"  # built to be rejected whole
ANY = "any"  # may decode (then it is some attacker's valid envelope) or not


def _stored(hashes, group=0, medium="GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def _removed(hashes, group=0, medium="GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


def _env(node: str, seq: int, ts: float, events=(), epoch: int = 1, **kw) -> Envelope:
    batch = msgspec.Raw(encode_vllm_batch(list(events), ts)) if events else msgspec.Raw()
    return Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=ts, sent_ts=ts, batch=batch,
                    num_events=len(events), **kw)


class Model:
    """What the good nodes hold: `(node, group, medium) → hash → copies` (vLLM refcounts)."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int, str], Counter] = {}

    def apply(self, node: str, events) -> None:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                for key in [k for k in self.held if k[0] == node and k[2] == "GPU"]:
                    del self.held[key]
                continue
            held = self.held.setdefault((node, ev.group_idx or 0, ev.medium or "GPU"), Counter())
            for h in map(key_of, ev.block_hashes):  # the index keys blocks by their 64-bit form
                if isinstance(ev, BlockStored):
                    held[h] += 1
                elif held[h] > 0:
                    held[h] -= 1
                    if not held[h]:
                        del held[h]

    def mismatches(self, index: Index) -> list[str]:
        problems = []
        for i in range(GOOD_NODES):
            node_id = f"GOOD-node-{i}"
            node = index.nodes.get(node_id)
            if node is None:
                problems.append(f"{node_id} missing")
                continue
            if node.expired or node.suspect or node.partial:
                problems.append(f"{node_id}: expired={node.expired} suspect={node.reason!r} partial={node.partial}")
            keys = {k[1:] for k in self.held if k[0] == node_id and self.held[k]} | set(node.slots)
            for key in keys:
                want = self.held.get((node_id, *key), Counter())
                slot = node.slots.get(key)
                have = {} if slot is None else {h: 1 + slot.dups.get(h, 0) for h in slot.blocks}
                if have != dict(want):
                    problems.append(f"{node_id} {key}: index has {len(have)} keys, model {len(want)}")
                for h in have:
                    if slot not in index.store.holders_of(key[0], h):
                        problems.append(f"{node_id} {key}: hash {h} missing from the inverted view")
                        break
        return problems


class GoodNodes:
    """Well-behaved publishers: stores, removes of held blocks, the odd clear, CPU copies."""

    def __init__(self, rng: random.Random, model: Model) -> None:
        self.rng, self.model = rng, model
        self.seq = [0] * GOOD_NODES
        self.pool = [list(range(i * 1000, i * 1000 + 300)) for i in range(GOOD_NODES)]
        self.held: list[list[tuple[int, int, str]]] = [[] for _ in range(GOOD_NODES)]

    def next(self, ts: float) -> bytes:
        rng = self.rng
        i = rng.randrange(GOOD_NODES)
        node, held = f"GOOD-node-{i}", self.held[i]
        events: list[Event] = []
        for _ in range(rng.randint(0, 3)):
            r = rng.random()
            if r < 0.55:
                group, medium = rng.randrange(2), "GPU" if rng.random() < 0.8 else "CPU"
                hashes = rng.sample(self.pool[i], rng.randint(1, 6))
                events.append(_stored(hashes, group, medium))
                held.extend((h, group, medium) for h in hashes)
            elif r < 0.97 and held:
                picks = [held.pop(rng.randrange(len(held))) for _ in range(min(len(held), rng.randint(1, 4)))]
                for group, medium in {(g, m) for _, g, m in picks}:
                    events.append(_removed([h for h, g, m in picks if (g, m) == (group, medium)], group, medium))
            elif r >= 0.995:
                events.append(AllBlocksCleared())
                self.held[i] = held = [x for x in held if x[2] != "GPU"]
        seq = self.seq[i]
        self.seq[i] += 1
        self.model.apply(node, events)
        return encode_envelope(_env(node, seq, ts, events, group_specs=SPECS if seq == 0 else None))

    def good_id_refused(self, ts: float) -> Iterator[tuple[str, bytes]]:
        """Messages with a good node's id and next seq that must be refused whole."""
        i = self.rng.randrange(GOOD_NODES)
        node, seq = f"GOOD-node-{i}", self.seq[i]
        for bad_ts in (float("nan"), float("inf"), -1.0):
            yield "good_id_bad_ts", encode_envelope(_env(node, seq, bad_ts, [_stored([9_999_999])]))
        yield "good_id_wrong_version", msgspec.msgpack.encode({"v": 2, "node_id": node, "epoch": 1, "seq": seq, "ts": ts})
        yield "good_id_too_large", encode_envelope(_env(node, seq, ts, [_stored(range(10**9, 10**9 + MAX_BYTES // 4))]))
        yield "good_id_bad_utf8_key", _add_raw_key(encode_envelope(_env(node, seq, ts, [_stored([9_999_998])])), b"\xc3(")


def _add_raw_key(data: bytes, key: bytes, value: bytes = b"\x01") -> bytes:
    if 0x80 <= data[0] < 0x8F:
        head, rest = bytes([data[0] + 1]), data[1:]
    else:  # map16
        head, rest = b"\xde" + (int.from_bytes(data[1:3], "big") + 1).to_bytes(2, "big"), data[3:]
    return head + rest + bytes([0xA0 | len(key)]) + key + value


def _replace_once(data: bytes, old: bytes, new: bytes) -> bytes:
    i = data.find(old)
    return data if i < 0 else data[:i] + new + data[i + len(new):]


class Hostile:
    """Generators of bad and hostile messages; each yields `(label, expectation, bytes, headers)`."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.evil = 0
        self.cap_seq = 0

    def _evil_id(self) -> str:
        self.evil += 1
        return f"x{self.rng.randrange(400)}"  # a few hundred ids: the node cap is hit and recovers

    def _evil_env(self, ts: float, **kw) -> bytes:
        rng = self.rng
        events = [_stored([rng.getrandbits(64) for _ in range(rng.randint(1, 8))], rng.randrange(3)),
                  _removed([rng.getrandbits(64)], rng.randrange(3))]
        return encode_envelope(_env(self._evil_id(), rng.randrange(50), ts, events[:rng.randint(0, 2)], **kw))

    def cases(self) -> list[Callable[[float], tuple[str, str, bytes, object]]]:
        rng = self.rng
        h = KAFKA_HEADERS

        def random_bytes(ts):
            return "random_bytes", ANY, rng.randbytes(rng.randint(0, 200)), h

        def truncated(ts):
            data = self._evil_env(ts)
            return "truncated", MUST_DLQ, data[:rng.randrange(len(data))], h

        def bitflip(ts):
            data = bytearray(self._evil_env(ts))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            return "bitflip", ANY, bytes(data), h

        def wrong_shape(ts):
            value = rng.choice([[1, 2, 3], "envelope", 42, None, {"v": 1}, {"v": 1, "node_id": 5, "epoch": 1, "seq": 0, "ts": 0},
                                {"v": 1, "node_id": "x", "epoch": "1", "seq": 0, "ts": 0.0},
                                {"v": 1, "node_id": "x", "epoch": 1, "seq": 0, "ts": 0.0, "group_specs": "all"},
                                {"v": 1, "node_id": "x", "epoch": 1, "seq": 0, "ts": 0.0, "batch": [1, 2]}])
            return "wrong_shape", MUST_DLQ, msgspec.msgpack.encode(value), h

        def huge_numbers(ts):
            value = {"v": 1, "node_id": self._evil_id(), "epoch": 1, "seq": 0, "ts": ts}
            field = rng.choice(["epoch", "seq", "dropped", "lost_batches", "num_events", "dp_rank"])
            value[field] = rng.choice([2**64 - 1, 2**63, -(2**63), -1, -(10**12)])
            return "huge_or_negative", ANY, msgspec.msgpack.encode(value), h

        def bad_group(ts):
            events = [_stored([rng.getrandbits(64)], rng.choice([-1, -(2**40), 2**62]))]
            return "bad_group_idx", ANY, encode_envelope(_env(self._evil_id(), 0, ts, events)), h

        def deep(ts):
            depth = rng.choice([200, 1000, 5000, 20000])
            data = _add_raw_key(encode_envelope(_env(self._evil_id(), 0, ts)), b"deep", b"\x91" * depth + b"\xc0")
            return "deep_nesting", ANY if depth < 1000 else MUST_DLQ, data, h

        def bad_utf8(ts):
            where = rng.choice(["node_id", "model", "medium", "unknown_key"])
            node = self._evil_id()
            if where == "unknown_key":
                return "bad_utf8_unknown_key", MUST_DLQ, _add_raw_key(encode_envelope(_env(node, 0, ts)), b"\xff\xfe"), h
            if where == "medium":
                data = encode_envelope(_env(node, 0, ts, [_stored([1], medium="ZZZ")]))
                return "bad_utf8_medium", MUST_DLQ, _replace_once(data, b"ZZZ", b"\xed\xa0\x80"), h
            data = encode_envelope(_env(node, 0, ts, model="QQQQ"))
            return f"bad_utf8_{where}", MUST_DLQ, _replace_once(data, b"QQQQ" if where == "model" else node.encode(), b"\xff"), h

        def future_ts(ts):
            return "future_ts", ANY, self._evil_env(rng.choice([1e300, ts + 120, ts + 1e6, 1.7976931348623157e308])), h

        def bad_ts(ts):
            return "nan_inf_negative_ts", MUST_DLQ, self._evil_env(rng.choice([float("nan"), float("inf"), float("-inf"), -5.0])), h

        def wrong_version(ts):
            choice = rng.randrange(3)
            if choice == 0:
                return "wrong_version", MUST_DLQ, msgspec.msgpack.encode({"v": rng.choice([0, 2, 99]), "node_id": "x", "epoch": 1,
                                                                          "seq": 0, "ts": ts}), h
            if choice == 1:
                return "wrong_version_header", MUST_DLQ, self._evil_env(ts), [(HEADER_VERSION, b"7")]
            return "wrong_content_type", MUST_DLQ, self._evil_env(ts), [(HEADER_CONTENT_TYPE, b"application/json")]

        def unknown_tag(ts):
            batch = msgspec.msgpack.encode([ts, [rng.choice([{"type": "BlockExploded", "block_hashes": [1]}, ["Nope", 1, 2],
                                                             {"type": "BlockStored"}, {"no_type": 1}])], 0])
            env = Envelope(v=SCHEMA_MAJOR, node_id=self._evil_id(), epoch=1, seq=0, ts=ts, batch=msgspec.Raw(batch))
            return "unknown_tag", MUST_DLQ, encode_envelope(env), h

        def oversize(ts):
            return "oversize", MUST_DLQ, rng.randbytes(MAX_BYTES + rng.randint(1, 4096)), h

        def state_abuse(ts):
            kw = rng.choice([{"lost_batches": rng.randint(1, 10**6)}, {"dropped": 3}, {"epoch": rng.randrange(5)}, {}])
            return "state_abuse", ANY, self._evil_env(ts, **kw), h

        def cap_abuse(ts):  # a few ids pushing past the per-slot and per-node caps
            start = rng.getrandbits(40)
            events = [_stored(range(start, start + rng.choice([10, 3000, 6000])), rng.randrange(12))]
            self.cap_seq += 1
            return "cap_abuse", ANY, encode_envelope(_env(f"cap-{self.cap_seq % 3}", self.cap_seq // 3, ts, events)), h

        return [random_bytes, truncated, bitflip, wrong_shape, huge_numbers, bad_group, deep, bad_utf8, future_ts, bad_ts,
                wrong_version, unknown_tag, oversize, state_abuse, cap_abuse]


class FuzzReport(msgspec.Struct):
    inputs: int
    hostile: int
    good: int
    seconds: float
    outcomes: dict[str, int]
    dlq_by_reason: dict[str, int]
    by_label: dict[str, dict[str, int]]
    crashes: int
    crash_examples: list[str]
    misclassified: list[str]  # MUST_DLQ inputs that were applied, or DLQ reasons outside ERROR_KINDS
    model_mismatches: list[str]
    index_counters: dict[str, int]


def run_fuzz(inputs: int, seed: int = 1, hostile_share: float = 0.6, max_nodes: int = 200,
             max_blocks_per_slot: int = 5000, max_slots_per_node: int = 8) -> FuzzReport:
    rng = random.Random(seed)
    model = Model()
    good = GoodNodes(rng, model)
    hostile = Hostile(rng)
    cases = hostile.cases()
    index = Index(ttl_s=TTL_S, retention_s=60.0, max_nodes=max_nodes, max_blocks_per_slot=max_blocks_per_slot,
                  max_slots_per_node=max_slots_per_node)
    ingest = Ingest(index, MAX_BYTES, max_skew_s=5.0)
    outcomes: Counter = Counter()
    by_label: dict[str, Counter] = {}
    crashes = 0
    examples: list[str] = []
    misclassified: list[str] = []
    n_good = n_hostile = 0
    ts0 = 1_700_000_000.0
    offset = 0
    started = time.perf_counter()
    pending: list[tuple[str, str, bytes, object]] = []
    while offset < inputs:
        ts = ts0 + offset * 0.001  # a good node speaks every few ms: never silent past the TTL
        if pending:
            label, expect, data, headers = pending.pop()
        elif rng.random() >= hostile_share:
            label, expect, data, headers = "good", "good", good.next(ts), KAFKA_HEADERS
        elif rng.random() < 0.03:
            pending = [(lbl, MUST_DLQ, d, KAFKA_HEADERS) for lbl, d in good.good_id_refused(ts)]
            continue
        else:
            label, expect, data, headers = rng.choice(cases)(ts)
        try:
            result = ingest.handle(data, headers, 0, offset, ts, record_ts=ts)
            outcome = result.outcome
        except Exception as exc:  # the thing this fuzzer exists to find
            crashes += 1
            outcome = "crash"
            if len(examples) < 5:
                examples.append(f"{label}: {type(exc).__name__}: {exc} [first bytes {bytes(data[:32]).hex()}]")
            result = None
        offset += 1
        if expect == "good":
            n_good += 1
            if outcome != APPLIED and len(misclassified) < 20:
                misclassified.append(f"good envelope at offset {offset - 1}: {outcome} "
                                     f"{result.error if result is not None else ''}")
        else:
            n_hostile += 1
            reason = result.error.kind if result is not None and result.error is not None else None
            if outcome == DLQ and reason not in ERROR_KINDS and len(misclassified) < 20:
                misclassified.append(f"{label}: DLQ reason {reason!r}")
            if expect == MUST_DLQ and outcome not in (DLQ, "crash") and len(misclassified) < 20:
                misclassified.append(f"{label}: expected the DLQ, got {outcome}")
        outcomes[outcome] += 1
        seen = outcome
        if outcome == DLQ and result is not None and result.error is not None:  # a DLQ result names its reason
            seen = f"dlq:{result.error.kind}"
        by_label.setdefault(label, Counter())[seen] += 1
        if offset % 500 == 0:  # the liveness timer, on the partition clock (a backlog being replayed)
            index.expire(ingest.stream_ts.get(0, 0.0), TTL_S, partition=0)
    seconds = time.perf_counter() - started
    # what a restart would bring back: the snapshot of this state, restored, must hold the same
    restored = Index(ttl_s=TTL_S)
    chunks, _, _ = export_partition(index, 0, gen=1)
    import_chunks(restored, 0, [decode_chunk(c) for c in chunks])
    mismatches = model.mismatches(index)[:20] + [f"after snapshot restore: {m}" for m in model.mismatches(restored)[:20]]
    return FuzzReport(inputs=offset, hostile=n_hostile, good=n_good, seconds=round(seconds, 3), outcomes=dict(outcomes),
                      dlq_by_reason=dict(ingest.dlq_by_reason), by_label={k: dict(v) for k, v in sorted(by_label.items())},
                      crashes=crashes, crash_examples=examples, misclassified=misclassified,
                      model_mismatches=mismatches, index_counters={**index.counters, **ingest.counters})


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def node_flood(ids: int, max_nodes: int = 100_000, page: int = 1000) -> dict:
    """Probe 4: `ids` node ids sending one heartbeat each (then one 2,000,000-hash store from one
    id) into an index with the default caps; what is tracked, refused, and what a page of
    `/nodes` and a snapshot of the partition cost."""
    from kvpipe.processors.routing.api import node_rows

    rss0 = _rss_bytes()
    index = Index(ttl_s=TTL_S, retention_s=3600.0, max_nodes=max_nodes, max_blocks_per_slot=1_000_000,
                  max_slots_per_node=64)
    ingest = Ingest(index, 64 << 20, max_skew_s=10.0)
    ts = 1_700_000_000.0
    big = encode_envelope(_env("big-node", 0, ts, [_stored(range(2_000_000))]))
    outcome = ingest.handle(big, KAFKA_HEADERS, 1, 0, ts).outcome
    started = time.perf_counter()
    for i in range(ids):
        ingest.handle(encode_envelope(_env(f"flood-{i}", 0, ts)), KAFKA_HEADERS, 0, i, ts)
    flood_s = time.perf_counter() - started
    started = time.perf_counter()
    rows = node_rows(index, ts, page + 1, None, None)
    page_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    chunks, nodes, blocks = export_partition(index, 0, gen=1)
    snapshot_ms = (time.perf_counter() - started) * 1000
    rss1 = _rss_bytes()
    big_blocks = sum(len(s.blocks) for s in index.nodes["big-node"].slots.values())
    index.expire(ts + TTL_S + 3600.0 + 1)  # past the TTL and the retention: forgotten
    index.expire(ts + TTL_S + 3600.0 + 1 + TTL_S + 3601.0)
    return {"ids_sent": ids, "nodes_tracked": nodes, "refused_envelopes": index.counters["refused_envelopes"],
            "flood_inputs_per_s": round(ids / flood_s), "big_node_outcome": outcome,
            "big_node_blocks_indexed": big_blocks,
            "big_node_capped_stores": index.counters["capped_stores"], "nodes_page_rows": len(rows) - 1,
            "nodes_page_ms": round(page_ms, 1), "snapshot_bytes": sum(map(len, chunks)),
            "snapshot_ms": round(snapshot_ms, 1), "rss_growth_mb": round((rss1 - rss0) / 1e6, 1),
            "nodes_after_retention": len(index.nodes), "forgotten_nodes": index.counters["forgotten_nodes"]}


@click.command("fuzz", cls=Command, help="Hostile inputs through the pure ingest path (and, with --node-flood, "
                                          "probe 4's node-id flood; RELIABILITY.md).")
@click.option("--inputs", type=int, default=100_000, show_default=True, help="generated inputs, hostile and good")
@click.option("--seed", type=int, default=1, show_default=True, help="generator seed")
@click.option("--node-flood", type=int, default=0, show_default=True,
              help="flood this many node ids instead (e.g. 302000)")
@click.option("--oversize-live", type=int, default=0, show_default=True,
              help="instead: this many 2 MiB messages through the local broker and a processor")
def fuzz_bench(**params: Any) -> dict[str, Any]:
    args = SimpleNamespace(**params)
    if args.oversize_live:
        from kvpipe.bench.fuzz_live import oversize_live

        return {"bench": "fuzz-oversize-live", "value": None, "unit": "", "baseline": None, "ratio": None,
                **oversize_live(args.oversize_live)}
    if args.node_flood:
        return {"bench": "fuzz-node-flood", "value": None, "unit": "", "baseline": None, "ratio": None,
                **node_flood(args.node_flood)}
    baseline = run_fuzz(min(args.inputs, 20_000), seed=args.seed, hostile_share=0.0)  # good envelopes only
    rss_before = _rss_bytes()
    report = run_fuzz(args.inputs, seed=args.seed)
    rss_after = _rss_bytes()
    rate = report.inputs / report.seconds
    base_rate = baseline.inputs / baseline.seconds
    return {"bench": "fuzz", "value": round(rate), "unit": "inputs/s", "baseline": round(base_rate),
            "baseline_what": "well-behaved envelopes only, inputs/s", "ratio": round(rate / base_rate, 3),
            "inputs": report.inputs, "hostile": report.hostile, "good": report.good, "crashes": report.crashes,
            "crash_examples": report.crash_examples, "misclassified": report.misclassified,
            "model_mismatches": report.model_mismatches, "outcomes": report.outcomes,
            "dlq_by_reason": report.dlq_by_reason, "by_label": report.by_label,
            "rss_growth_mb": round((rss_after - rss_before) / 1e6, 1),
            "index_counters": report.index_counters}


def run(argv: list[str]) -> dict[str, Any] | int:
    """`kvpipe bench fuzz`: the result, or an exit code after help or a usage error."""
    return run_command(fuzz_bench, argv, "kvpipe bench fuzz")
