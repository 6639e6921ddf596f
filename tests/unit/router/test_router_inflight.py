"""In-flight accounting: a burst of one prefix sticks to one node before its events arrive; the
guesses yield to real events, expire, and stay within their memory bounds."""
from __future__ import annotations

import pytest

from kvpipe.processors.core.index import Index
from kvpipe.processors.router.decide import route
from kvpipe.processors.router.inflight import InFlight
from kvpipe.processors.router.model import RouteRequest
from kvpipe.schemas.events import AllBlocksCleared
from tests.unit.router.router_fixtures import LAYOUTS, Publisher, group_lists, hash_config, removed, stored

SPECS, HBS = LAYOUTS["fa16+swa32"]
CFG = hash_config("sha256-int", HBS)
TOKENS = list(range(1000, 1161))  # 10 blocks of 16, 5 of 32; cap 160


def cluster(n: int = 3) -> tuple[Index, dict[str, Publisher]]:
    index = Index()
    nodes = {}
    for i in range(n):
        nodes[f"n{i}"] = node = Publisher(index, f"n{i}", SPECS, CFG)
        node.send([])
    return index, nodes


def test_a_burst_of_one_prefix_sticks_to_the_first_chosen_node_and_its_rows_say_speculative():
    index, _ = cluster()
    inflight = InFlight(ttl_s=10.0)
    first = route(index, RouteRequest(token_ids=TOKENS, request_id="r1"), inflight=inflight, now=0.0)
    assert first.chosen == "n0" and first.nodes[0].gpu_tokens == 0  # empty cluster: the load tie-break
    for k in range(2, 6):
        answer = route(index, RouteRequest(token_ids=TOKENS, request_id=f"r{k}"), inflight=inflight, now=float(k))
        assert answer.chosen == "n0", k
        row = answer.nodes[0]
        assert row.speculative and row.gpu_tokens == 160
        assert row.groups[0].speculative_blocks == 10 and row.groups[1].speculative_blocks == 2
        assert row.load.waiting == k - 1  # the requests sent to n0 and not finished
    assert inflight.running("n0") == 5


def test_real_events_replace_the_guesses_and_finish_only_leaves_the_load():
    index, nodes = cluster()
    inflight = InFlight(ttl_s=10.0)
    route(index, RouteRequest(token_ids=TOKENS, request_id="r1"), inflight=inflight, now=0.0)
    lists = group_lists(CFG, SPECS, TOKENS)
    events = [stored(lists[0], 0), stored(lists[1][3:5], 1, 32)]
    nodes["n0"].send(events)
    inflight.on_events("n0", events)
    row = route(index, RouteRequest(token_ids=TOKENS), inflight=inflight, now=1.0).nodes[0]
    assert (row.node_id, row.gpu_tokens, row.speculative) == ("n0", 160, False)
    assert inflight.entries == 3  # the guesses for SWA blocks 0-2 (the node cached only its tail)
    assert inflight.finished("r1") and not inflight.finished("r1")
    assert inflight.running("n0") == 0 and inflight.entries == 3
    # a real removal is the truth too: the node evicted its tail, the guess does not resurrect it
    gone = [removed(lists[1][3:5], 1)]
    nodes["n0"].send(gone)
    inflight.on_events("n0", gone)
    row = route(index, RouteRequest(token_ids=TOKENS, include_zero=True), inflight=inflight, now=2.0).nodes[0]
    # SWA blocks 0-2 (32 tokens each) are still guessed: the window (64 → 2 blocks) ends at block 2
    assert row.node_id == "n0" and row.gpu_tokens == 96 and row.speculative
    assert row.groups[1].speculative_blocks == 2 and row.groups[0].speculative_blocks == 0


def test_guesses_and_load_expire_with_the_ttl():
    index, _ = cluster()
    inflight = InFlight(ttl_s=10.0)
    route(index, RouteRequest(token_ids=TOKENS, request_id="r1"), inflight=inflight, now=0.0)
    assert route(index, RouteRequest(token_ids=TOKENS), inflight=inflight, now=9.9).nodes[0].speculative
    answer = route(index, RouteRequest(token_ids=TOKENS, include_zero=True), inflight=inflight, now=10.0)
    assert all(r.gpu_tokens == 0 and not r.speculative and r.load.waiting == 0 for r in answer.nodes)
    assert inflight.entries == 0 and inflight.running("n0") == 0 and inflight.nodes() == []


def test_a_clear_or_new_epoch_drops_the_nodes_guesses():
    inflight = InFlight()
    inflight.sent("r", "n", {0: [1, 2, 3]}, now=0.0)
    inflight.on_events("n", [AllBlocksCleared()])
    assert inflight.entries == 0 and inflight.positions("n", {0: [1, 2, 3]}) == {}
    inflight.sent("r2", "n", {0: [1, 2]}, now=0.0)
    inflight.on_events("n", [], new_epoch=True)
    assert inflight.entries == 0 and inflight.running("n") == 2


def test_memory_is_bounded_by_request_and_entry_caps_oldest_first():
    inflight = InFlight(ttl_s=100.0, max_requests=3, max_entries=10)
    for k in range(5):
        inflight.sent(f"r{k}", "n", {0: [k * 100 + i for i in range(3)]}, now=float(k))
    assert inflight.running("n") == 3 and inflight.entries == 9 and inflight.counters["evicted"] == 2
    assert inflight.positions("n", {0: [0, 1, 2, 400]}) == {0: {3}}  # r0's blocks went with r0
    inflight.sent("big", "n", {0: list(range(1000, 1008))}, now=5.0)  # 9 + 8 > 10: oldest go
    assert inflight.entries <= 10 and inflight.positions("n", {0: [1000]}) == {0: {0}}


def test_a_resent_request_moves_to_its_new_node():
    inflight = InFlight()
    inflight.sent("r", "a", {0: [1]}, now=0.0)
    inflight.sent("r", "b", {0: [1]}, now=1.0)
    assert inflight.running("a") == 0 and inflight.running("b") == 1
    assert inflight.positions("a", {0: [1]}) == {} and inflight.positions("b", {0: [1]}) == {0: {0}}


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="ttl_s > 0"):
        InFlight(ttl_s=0)


def test_a_sent_report_hashes_the_prompt_the_nodes_way_and_unknown_nodes_are_explained():
    from kvpipe.processors.router.decide import record_sent

    index, _ = cluster()
    inflight = InFlight(ttl_s=10.0)
    assert record_sent(index, inflight, "r", "n2", RouteRequest(token_ids=TOKENS), now=0.0) is None
    answer = route(index, RouteRequest(token_ids=TOKENS), inflight=inflight, now=1.0)
    assert answer.chosen == "n2" and answer.nodes[0].speculative and answer.nodes[0].gpu_tokens == 160
    assert "not in this index" in record_sent(index, inflight, "r2", "ghost", RouteRequest(token_ids=TOKENS), now=0.0)
