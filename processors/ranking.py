"""The order of `/route` rows, in one place: a single index (`Index.route`, `route_hma`) and the
scatter-gather merge of several workers' rows (`processors.scatter`) sort with the same key, so a
merged answer ranks exactly as one index holding everything would.

A row's key depends only on the row (a node's score never depends on other nodes), which is what
makes concatenate-and-sort a correct merge.
"""
from __future__ import annotations


def rank_key(row: dict) -> tuple:
    """Healthy before suspect, then the semantics' own order, then node id (a stable tie-break)."""
    if "hit_tokens" in row:
        return _hma_key(row)
    return (row["suspect"], -row["score"], -row["gpu_score"], -row["total"], row["node_id"])


def _hma_key(row: dict) -> tuple:
    """GPU hit, then any-medium hit (a GPU hit beats a CPU hit of equal length: no load needed).
    A node whose hit could not be computed (no usable group specs) ranks after every node whose
    hit is known, by its per-group prefix in blocks: a known hit beats a guess."""
    hits = row["hit_tokens"]
    if hits is None:
        blocks = row["prefix_blocks"]
        return (row["suspect"], 1, -blocks["GPU"], -blocks["any"], row["node_id"])
    return (row["suspect"], 0, -hits["GPU"], -hits["any"], row["node_id"])
