"""`/route` latency, one worker vs two workers (scatter-gather), same index. Not a timed test:
`PYTHONPATH=. python tests/benchmarks/bench_route_workers.py [--envelopes N] [--requests N]`.

One fresh events topic (4 partitions) pre-filled with `kvpipe bench ingest`'s envelopes; worker A
alone consumes it and is measured; then worker B joins the group, the partitions split 2/2, and A
is measured again (every answer now needs B's local answer over HTTP). The merged answers are
checked equal to the single worker's. JSON out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from kvpipe.bench import ingest as bench
from kvpipe.bench.procrun import ProcessorProcess, free_port
from kvpipe.schemas.settings import load_settings

PARTITIONS = 4


def _latencies(proc: ProcessorProcess, bodies: list[dict], path: str = "/route") -> tuple[list[float], list[dict]]:
    out, answers = [], []
    for body in bodies:
        started = time.perf_counter()
        status, answer = proc.post(path, body)
        out.append((time.perf_counter() - started) * 1000)
        assert status == 200, answer
        answers.append(answer)
    return sorted(out), answers


def _summary(ms: list[float]) -> dict:
    return {"p50_ms": round(statistics.median(ms), 2), "p99_ms": round(ms[min(len(ms) - 1, int(len(ms) * 0.99))], 2)}


def _wait_split(workers: list[ProcessorProcess], end: dict[int, int], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = [w.get("/stats") for w in workers]
        owned = [set(s["cluster"]["owned_partitions"]) for s in stats]
        if all(owned) and set().union(*owned) == set(range(PARTITIONS)) and sum(map(len, owned)) == PARTITIONS and all(
                s["freshness"].get(str(p), {}).get("offset", -1) >= end[p] - 1 for s, mine in zip(stats, owned)
                for p in mine if end[p]):
            return
        time.sleep(0.2)
    raise TimeoutError("workers did not split the partitions")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envelopes", type=int, default=4000)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--hashes", type=int, default=64, help="hashes per group per request")
    args = parser.parse_args()
    settings = load_settings()
    bootstrap = settings.bootstrap()
    tag = uuid.uuid4().hex[:8]
    topic, dlq, snaps = f"bench-route-{tag}", f"bench-route-dlq-{tag}", f"bench-route-snap-{tag}"
    asyncio.run(bench._create_topics(bootstrap, [(topic, PARTITIONS, {}), (dlq, 1, {}),
                                                 (snaps, PARTITIONS, {"cleanup.policy": "compact"})]))
    tmp = Path(tempfile.mkdtemp(prefix="kvpipe-bench-route-"))
    group = f"bench-route-{tag}"
    workers: list[ProcessorProcess] = []
    try:
        messages = bench.make_envelopes(args.envelopes, 25, 32, time.time())
        asyncio.run(bench._prefill(bootstrap, topic, messages))
        for name in ("a", "b"):
            workers.append(ProcessorProcess({
                "KVPIPE_KAFKA_BOOTSTRAP": bootstrap, "KVPIPE_EVENTS_TOPIC": topic, "KVPIPE_DLQ_TOPIC": dlq,
                "KVPIPE_SNAPSHOT_TOPIC": snaps, "KVPIPE_PARTITIONS": str(PARTITIONS), "KVPIPE_PROCESSOR_ID": group,
                "KVPIPE_WEB_PORT": str(free_port()), "KVPIPE_STATE_DIR": str(tmp / f"state-{name}"),
                "KVPIPE_SNAPSHOT_EVERY_S": "3600", "KVPIPE_NODE_TTL_S": "3600"}, tmp / f"worker-{name}.log"))
        a, b = workers
        a.start()
        stats = a.get("/stats")
        while stats["counters"]["messages"] < args.envelopes:  # the whole topic is in A's index
            time.sleep(0.2)
            stats = a.get("/stats")
        end = {int(p): f["offset"] + 1 for p, f in stats["freshness"].items()}
        # probes: runs of the newest hashes (the ones still cached), both groups
        top = (1 << 40) + args.envelopes * 13
        # every node scored and listed (include_zero), as a router asking for a choice sees them
        bodies = [{"block_hashes": {"0": list(range(h, h + args.hashes)), "1": list(range(h, h + args.hashes))},
                   "num_tokens": args.hashes * 16 + 1, "include_zero": True}
                  for h in range(top - args.requests * 7, top, 7)][: args.requests]
        _latencies(a, bodies[:50])  # warm-up
        single, single_answers = _latencies(a, bodies)
        local, _ = _latencies(a, bodies, "/route?local=1")
        b.start()
        _wait_split([a, b], end)
        _latencies(a, bodies[:50])
        scattered, scattered_answers = _latencies(a, bodies)
        same = all(x["nodes"] == y["nodes"] and x["chosen"] == y["chosen"] and not y["partial"]
                   for x, y in zip(single_answers, scattered_answers))
        print(json.dumps({"bench": "route_workers", "requests": len(bodies), "hashes_per_group": args.hashes,
                          "nodes_in_answers_mean": round(statistics.mean(len(x["nodes"]) for x in single_answers), 1),
                          "single_worker": _summary(single), "single_worker_local_only": _summary(local),
                          "two_workers_scatter_gather": _summary(scattered), "answers_equal": same}))
    finally:
        for w in workers:
            w.kill()
        asyncio.run(bench._delete_topics(bootstrap, [topic, dlq, snaps]))


if __name__ == "__main__":
    main()
