"""NVIDIA Dynamo's `RadixTree` on the route bench's workload, for `kvpipe bench route`'s baseline.

Optional: `ai-dynamo-runtime` is the `bench-dynamo` extra (`pip install 'kvpipe[bench-dynamo]'`, or
`pip install ai-dynamo-runtime==1.6.1` into the venv; never in requirements.lock); without it the bench says the baseline is missing. The tree knows one group
and no media, so it is fed every node's full-attention blocks (GPU and CPU alike, chained as the
node stored them) and asked `find_matches` for the request's full-attention block hashes: a
one-group prefix lookup, timed next to our hybrid search of the same request.
"""
from __future__ import annotations

import json
import time
from typing import Any, Callable

from kvpipe.schemas.events import BlockStored

_U64 = (1 << 64) - 1
MISSING = ("ai-dynamo-runtime not installed (bench extra: pip install 'kvpipe[bench-dynamo]', "
           "or ai-dynamo-runtime==1.6.1)")


# lookups, with pauses, that settle the tree's thread before `back_to_back` times anything
SETTLE_CALLS = 200


def load() -> Any | None:
    try:
        from dynamo._core import RadixTree
    except ImportError:
        return None
    return RadixTree


def _u64(h: Any) -> int:
    return (h if isinstance(h, int) else int.from_bytes(h[-8:], "big")) & _U64


def build(radix_tree: Any, fleet: list[tuple[Any, list[BlockStored]]]) -> Any:
    """A tree holding every node's group-0 blocks; node n is worker n."""
    tree = radix_tree()
    event_id = 0
    for worker, (_, events) in enumerate(fleet):
        parent = None
        for ev in events:
            if ev.group_idx != 0:
                parent = None  # the next group-0 event starts another document
                continue
            if not ev.block_hashes:
                continue
            blocks = [{"block_hash": _u64(h), "tokens_hash": _u64(h)} for h in ev.block_hashes]
            event_id += 1
            tree.apply_event(worker, json.dumps({"event_id": event_id, "data": {
                "stored": {"parent_hash": parent, "blocks": blocks}}}).encode())
            parent = blocks[-1]["block_hash"]
    tree.find_matches([0])  # the tree applies events on its own thread: wait for them
    return tree


def back_to_back(tree: Any, cases: list[tuple[list[Any], dict[str, Callable[[], Any]]]]) -> dict[str, list[float]]:
    """Seconds of each call asked twice in a row, the second one timed: Dynamo's `find_matches` for each case's
    full-attention hashes, in a loop of their own once the tree's thread settled, then each of our calls.

    Why: `find_matches` is a round trip to the tree's own thread. In the main loop, where each lookup follows
    milliseconds of other work, a lookup took 120-300 µs; in a loop of lookups alone, after a phase with short pauses
    between them, 15-23 µs at 288 k entries and 31-45 µs at 1.58 M (right after loading, hundreds of back-to-back
    lookups stayed near 100 µs until such a pause; with our calls between its lookups it fell back to that). The
    settled loop is Dynamo at its best, the steady state of a busy router: the unfavourable comparison for us,
    reported next to the interleaved one (BENCHMARKS.md)."""
    if not cases:
        return {}
    seq0 = [_u64(h) for h in cases[0][0]]
    for _ in range(SETTLE_CALLS):
        tree.find_matches(seq0)
        time.sleep(0.0005)
    times: dict[str, list[float]] = {"dynamo": [], **{name: [] for name in cases[0][1]}}
    # Dynamo's lookups in one loop of their own, then ours: with other work between its calls the tree's thread
    # fell back to the slow round trip (BENCHMARKS.md)
    for hashes, _ in cases:
        seq = [_u64(h) for h in hashes]
        tree.find_matches(seq)
        t = time.perf_counter()
        tree.find_matches(seq).scores
        times["dynamo"].append(time.perf_counter() - t)
    time.sleep(0.2)  # the tree's thread idle again before ours are timed (the process used up to 1.2 cores in its loop)
    for _, ours in cases:
        for name, call in ours.items():
            call()
            t = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t)
    return times


def find(tree: Any, hashes: list[Any]) -> tuple[float, dict]:
    """Seconds of one `find_matches` and its scores (blocks matched per worker)."""
    seq = [_u64(h) for h in hashes]
    t = time.perf_counter()
    scores = tree.find_matches(seq).scores
    return time.perf_counter() - t, scores
