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
from typing import Any

from kvpipe.schemas.events import BlockStored

_U64 = (1 << 64) - 1
MISSING = ("ai-dynamo-runtime not installed (bench extra: pip install 'kvpipe[bench-dynamo]', "
           "or ai-dynamo-runtime==1.6.1)")


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


def find(tree: Any, hashes: list[Any]) -> tuple[float, dict]:
    """Seconds of one `find_matches` and its scores (blocks matched per worker)."""
    seq = [_u64(h) for h in hashes]
    t = time.perf_counter()
    scores = tree.find_matches(seq).scores
    return time.perf_counter() - t, scores
