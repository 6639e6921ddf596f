"""Scatter-gather merge: several workers' local answers rank exactly as one index would."""
from __future__ import annotations

import asyncio

import pytest

from processors import scatter
from processors.api import ApiError, answer_route
from processors.index import Index
from schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from schemas.events import BlockStored


def _stored(hashes, group=0, medium="GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def _apply(index: Index, node: str, partition: int, events) -> None:
    specs = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
             GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]
    env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=1, seq=0, ts=1.0, sent_ts=1.0, num_events=len(events),
                   group_specs=specs)
    index.apply(env, events, partition, 0)


NODES = {  # node → (partition, events)
    "a": (0, [_stored([1, 2, 3]), _stored([1, 2], group=1)]),
    "b": (1, [_stored([1, 2, 3, 4])]),
    "c": (2, [_stored([1, 2], medium="CPU"), _stored([1], group=1)]),
    "d": (3, [_stored([1, 2, 3], group=1)]),
}


def _local(index: Index, partitions: list[int], body: dict) -> dict:
    own = index.known_groups()
    answer = answer_route(index, body, scatter.hinted_groups(body, own))  # what views._local_route runs
    for row in answer["nodes"]:
        row["partition"] = index.nodes[row["node_id"]].partition
    return {**answer, "partitions": partitions, "known_groups": own}


def _split(owners: dict[str, list[int]]) -> dict[str, Index]:
    out = {w: Index(ttl_s=None) for w in owners}
    for node, (p, events) in NODES.items():
        for w, parts in owners.items():
            if p in parts:
                _apply(out[w], node, p, events)
    return out


def _gather(body: dict, owners: dict[str, list[int]], down: frozenset = frozenset()) -> dict:
    indexes = _split(owners)
    first, *others = owners

    async def ask(url: str, b: dict) -> dict:
        if url in down:
            raise TimeoutError(url)
        return {**_local(indexes[url], owners[url], b), "worker": url}

    return asyncio.run(scatter.route(body, lambda b: _local(indexes[first], owners[first], b), others, ask, range(4)))


def test_two_workers_merge_to_the_single_index_answer_for_both_request_forms():
    one = _split({"all": [0, 1, 2, 3]})["all"]
    for body in ({"block_hashes": {"0": [1, 2, 3, 4], "1": [1, 2, 3]}}, {"block_hashes": [1, 2, 3, 4]}):
        single = _local(one, [0, 1, 2, 3], body)
        merged = _gather(body, {"x": [0, 2], "y": [1, 3]})
        assert merged["nodes"] == [{k: v for k, v in r.items() if k != "partition"} for r in single["nodes"]]
        assert merged["groups"] == single["groups"] and merged["partial"] is False


def test_known_groups_differ_between_workers_the_all_groups_form_still_matches_one_index():
    # x's only node (b) has blocks in group 0 only, so x alone does not know group 1; one index
    # does, and scores b on both of its groups (min → 0). The second round makes x use group 1.
    one = _split({"all": [0, 1, 2, 3]})["all"]
    body = {"block_hashes": [1, 2, 3]}
    merged = _gather(body, {"x": [1], "y": [0, 2, 3]})
    single = _local(one, [0, 1, 2, 3], body)
    assert [r["node_id"] for r in merged["nodes"]] == [r["node_id"] for r in single["nodes"]]
    assert [r["score"] for r in merged["nodes"]] == [r["score"] for r in single["nodes"]]
    assert next(r for r in merged["nodes"] if r["node_id"] == "b")["score"] == 0


def test_a_silent_worker_costs_its_partitions_and_a_partition_is_taken_from_one_answer_only():
    merged = _gather({"block_hashes": {"0": [1, 2]}}, {"x": [0, 2], "y": [1, 3]}, down=frozenset({"y"}))
    assert merged["partial"] is True and merged["missing_partitions"] == [1, 3]
    assert {r["node_id"] for r in merged["nodes"]} == {"a", "c"}
    # mid-rebalance both claim partition 1: its node appears once
    answers = [{"semantics": "s", "groups": [0], "partitions": [0, 1], "nodes": [{"node_id": "b", "partition": 1,
               "suspect": False, "score": 2, "gpu_score": 2, "total": 2}]},
               {"semantics": "s", "groups": [0], "partitions": [1, 2, 3], "nodes": [{"node_id": "b", "partition": 1,
               "suspect": False, "score": 2, "gpu_score": 2, "total": 2}]}]
    merged = scatter.merge_route(answers, range(4))
    assert [r["node_id"] for r in merged["nodes"]] == ["b"] and merged["missing_partitions"] == []


def test_hma_rows_merge_to_the_single_index_answer_for_both_request_forms():
    one = _split({"all": [0, 1, 2, 3]})["all"]
    for raw in ({"0": [1, 2, 3, 4], "1": [1, 2, 3, 4]}, [1, 2, 3, 4]):
        body = {"block_hashes": raw, "semantics": "hma"}
        single = _local(one, [0, 1, 2, 3], body)
        merged = _gather(body, {"x": [0, 2], "y": [1, 3]})
        assert merged["semantics"] == "hma" and merged["partial"] is False
        assert merged["nodes"] == [{k: v for k, v in r.items() if k != "partition"} for r in single["nodes"]]
        # a: FA 3 blocks, SWA run touching 0 of 2 → 32; c: CPU FA 2 + SWA 1 → 16 on "any" only
        assert [(r["node_id"], r["hit_tokens"]["GPU"], r["hit_tokens"]["any"]) for r in merged["nodes"]] == [
            ("a", 32, 32), ("c", 0, 16), ("b", 0, 0), ("d", 0, 0)]


def test_a_peer_refusing_the_request_refuses_the_whole_answer_not_a_partial_one():
    x, y = Index(ttl_s=None), Index(ttl_s=None)
    _apply(x, "a", 0, NODES["a"][1])
    mixed = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
             GroupSpec(group_idx=1, kind="sliding_window", block_size=32, sliding_window=64)]
    y.apply(Envelope(v=SCHEMA_MAJOR, node_id="m", epoch=1, seq=0, ts=1.0, group_specs=mixed), [_stored([1, 2])], 1, 0)
    body = {"block_hashes": [1, 2, 3], "semantics": "hma"}

    async def ask(url: str, b: dict) -> dict:
        return {**_local(y, [1, 2, 3], b), "worker": url}

    with pytest.raises(ApiError) as exc:
        asyncio.run(scatter.route(body, lambda b: _local(x, [0], b), ["y"], ask, range(4)))
    assert exc.value.status == 400 and "'m'" in exc.value.detail


def test_peers_come_from_the_assignor_map_without_self():
    dist = {"http://127.0.0.1:1/": {"ev": [2, 0]}, "http://127.0.0.1:2": {"ev": [1, 3], "other": [0]},
            "http://127.0.0.1:3": {"other": [1]}}
    assert scatter.peers(dist, "ev", "http://127.0.0.1:2") == {"http://127.0.0.1:1/": [0, 2]}
