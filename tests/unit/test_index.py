"""The live cache index, without Kafka: ordering, reference counts, lifetimes, liveness, the inverted view."""
from __future__ import annotations

from kvpipe.processors.core.index import APPLIED, DUPLICATE, STALE, Index, partial_fields
from kvpipe.processors.router.hma import held_positions
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored

SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=64)]


def env(node: str = "n1", seq: int = 0, epoch: int = 1, ts: float = 100.0, **kw) -> Envelope:
    return Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=ts, sent_ts=ts, **kw)


def stored(hashes, group=0, medium="GPU") -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=None, token_ids=[], block_size=16,
                       lora_id=None, medium=medium, lora_name=None, group_idx=group)


def removed(hashes, group=0, medium="GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group)


def held(index: Index, hashes_by_group: dict) -> dict[str, dict]:
    """node id → (group, medium) → positions of the hashes it holds, read through the inverted view
    the router reads (expired nodes hold nothing)."""
    return {n.node_id: h for n, h in held_positions(index, hashes_by_group).items()}


def prefix(index: Index, node: str, hashes, group: int = 0, medium: str = "GPU") -> int:
    positions = held(index, {group: list(hashes)}).get(node, {}).get((group, medium), set())
    n = 0
    while n in positions:
        n += 1
    return n


class Feed:
    """Applies envelopes of one node with consecutive seqs, like a well-behaved publisher."""

    def __init__(self, index: Index, node: str = "n1", epoch: int = 1) -> None:
        self.index, self.node, self.epoch, self.seq, self.ts = index, node, epoch, 0, 100.0

    def send(self, *events, **kw):
        self.ts += 1
        result = self.index.apply(env(self.node, self.seq, self.epoch, self.ts, **kw), list(events), 0, self.seq)
        self.seq += 1
        return result


def test_duplicate_stores_are_refcounted_and_removing_one_copy_keeps_the_block_cached():
    index = Index()
    feed = Feed(index)
    feed.send(stored([1, 2, 3]), stored([2]))
    assert index.nodes["n1"].slots[(0, "GPU")].refcount(2) == 2
    _, closed = feed.send(removed([2]))
    assert closed == []
    assert prefix(index, "n1", [1, 2, 3]) == 3
    _, closed = feed.send(removed([2]))
    assert [(r.block_hash, r.reason, r.stored_ts, r.removed_ts) for r in closed] == [(2, "evicted", 101.0, 103.0)]
    assert prefix(index, "n1", [1, 2, 3]) == 1


def test_duplicate_envelope_is_skipped_and_counted():
    index = Index()
    index.apply(env(seq=0), [stored([1])])
    outcome, _ = index.apply(env(seq=0), [stored([1])])
    assert outcome == DUPLICATE
    assert index.counters["duplicates"] == 1
    assert index.nodes["n1"].slots[(0, "GPU")].refcount(1) == 1


def test_seq_gap_marks_node_suspect_until_a_new_epoch():
    index = Index()
    index.apply(env(seq=0), [stored([1])])
    index.apply(env(seq=3), [stored([2])])
    node = index.nodes["n1"]
    assert node.suspect and "expected seq 1, got 3" in node.reason
    assert index.counters["gaps"] == 1
    index.apply(env(seq=4), [])
    assert node.suspect
    index.apply(env(seq=0, epoch=2), [stored([7])])
    assert not node.suspect


def test_dropped_marks_suspect_and_lost_batches_resync_as_partial():
    index = Index()
    index.apply(env(node="a", seq=0, dropped=3), [])
    index.apply(env(node="b", seq=0, lost_batches=1), [])
    assert index.nodes["a"].suspect and "dropped 3" in index.nodes["a"].reason
    b = index.nodes["b"]
    assert not b.suspect and b.partial and b.partial_since == (1, 0, 100.0)


def test_lost_batches_clear_the_node_and_it_learns_again_exactly_without_ghosts():
    index = Index()
    feed = Feed(index)
    feed.send(stored([1, 2, 3]))
    feed.send(stored([4]))
    # batches lost upstream (say, 2 removed and 9 stored): the next envelope says so
    _, closed = feed.send(stored([10]), lost_batches=2)
    node = index.nodes["n1"]
    assert node.partial and not node.suspect and node.partial_since[1] == 2
    assert sorted(r.block_hash for r in closed) == [1, 2, 3, 4]  # every pre-loss entry left, as lifetimes
    feed.send(removed([9, 10]))  # 9 was stored during the loss: ignored, not a health signal
    feed.send(stored([11, 12]))
    assert prefix(index, "n1", [1, 2, 3]) == 0  # no ghosts of what the loss may have removed
    assert prefix(index, "n1", [11, 12]) == 2
    assert node.counters["unknown_removes"] == 0 and node.counters["partial_unknown_removes"] == 1
    row = partial_fields(node)
    assert row["partial"] and not node.suspect and row["partial_since"]["seq"] == 2
    feed.epoch, feed.seq = 2, 0  # a restart: an empty cache, exact again
    feed.send(stored([20]))
    assert not node.partial


def test_a_node_over_the_per_slot_cap_is_marked_and_the_excess_not_indexed():
    index = Index(max_blocks_per_slot=100)
    feed = Feed(index)
    feed.send(stored(range(90)))
    feed.send(stored(range(85, 2_000_000)))  # 5 copies of held hashes + 1,999,910 new
    node = index.nodes["n1"]
    assert len(node.slots[(0, "GPU")].blocks) == 100 and all(index.store.holders_of(0, i) for i in range(100))
    assert node.suspect and "cap of 100" in node.reason
    assert node.counters["capped_stores"] == 2_000_000 - 100


def test_node_ids_are_capped_and_expired_nodes_are_forgotten_after_retention():
    index = Index(ttl_s=10, retention_s=100, max_nodes=3)
    for i in range(3):
        index.apply(env(node=f"n{i}", ts=100.0 + i), [stored([i])])
    assert index.apply(env(node="n3", ts=103.0), [])[0] == "refused"
    assert index.counters["refused_envelopes"] == 1 and "n3" not in index.nodes
    index.expire(now=111.5)  # n0, n1 silent > 10 s: expired, still listed
    assert index.nodes["n0"].expired and index.nodes["n1"].expired and not index.nodes["n2"].expired
    assert index.apply(env(node="n3", ts=111.5), [])[0] == APPLIED  # room made: the longest-expired goes
    assert "n0" not in index.nodes and index.counters["forgotten_nodes"] == 1
    index.expire(now=111.0 + 101)  # n1 expired at 111.0: past retention now, forgotten
    assert "n1" not in index.nodes and index.counters["forgotten_nodes"] == 2


def test_new_epoch_clears_node_with_lifetimes_and_resets_seq():
    index = Index()
    feed = Feed(index)
    feed.send(stored([1, 2]), stored([5], medium="CPU"))
    outcome, closed = index.apply(env(seq=0, epoch=2, ts=200.0), [stored([9])], 0, 10)
    assert outcome == APPLIED
    assert sorted((r.block_hash, r.medium, r.reason, r.epoch, r.idx) for r in closed) == [
        (1, "GPU", "cleared", 1, -1), (2, "GPU", "cleared", 1, -1), (5, "CPU", "cleared", 1, -1)]
    assert prefix(index, "n1", [1]) == 0 and prefix(index, "n1", [9]) == 1
    assert index.nodes["n1"].seq == 0 and index.nodes["n1"].epoch == 2


def test_stale_epoch_is_skipped_and_counted():
    index = Index()
    index.apply(env(seq=0, epoch=5), [stored([1])])
    outcome, _ = index.apply(env(seq=7, epoch=4), [removed([1])])
    assert outcome == STALE and index.counters["stale"] == 1
    assert prefix(index, "n1", [1]) == 1


def test_all_blocks_cleared_clears_gpu_entries_of_all_groups_but_not_cpu():
    index = Index()
    feed = Feed(index)
    feed.send(stored([1, 2], group=0), stored([1, 2], group=1), stored([1, 2], group=0, medium="CPU"))
    _, closed = feed.send(AllBlocksCleared())
    assert sorted((r.group_idx, r.medium) for r in closed) == [(0, "GPU"), (0, "GPU"), (1, "GPU"), (1, "GPU")]
    assert prefix(index, "n1", [1, 2], group=0, medium="GPU") == 0
    assert prefix(index, "n1", [1, 2], group=1, medium="GPU") == 0
    assert prefix(index, "n1", [1, 2], group=0, medium="CPU") == 2


def test_group_none_is_group_0_and_medium_none_is_gpu():
    index = Index()
    feed = Feed(index)
    feed.send(BlockStored(block_hashes=[4, 5], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                          medium=None, lora_name=None))
    assert prefix(index, "n1", [4, 5], group=0, medium="GPU") == 2


def test_remove_of_unknown_key_is_counted_not_an_error():
    index = Index()
    Feed(index).send(removed([42]))
    assert index.counters["unknown_removes"] == 1


def test_ttl_expiry_removes_node_from_routing_with_node_expired_lifetimes():
    index = Index(ttl_s=30)
    index.apply(env(node="a", seq=0, ts=100.0), [stored([1, 2])], 0, 0)
    index.apply(env(node="b", seq=0, ts=125.0), [stored([1])], 0, 1)
    closed = index.expire(now=140.0)
    assert {(r.node_id, r.reason, r.removed_ts, r.offset) for r in closed} == {("a", "node_expired", 130.0, 0)}
    assert list(held(index, {0: [1, 2]})) == ["b"]


def test_node_silent_past_ttl_in_the_log_is_expired_on_replay_like_the_timer_would():
    live, replay = Index(ttl_s=30), Index(ttl_s=30)
    first, second = env(seq=0, ts=100.0), env(seq=1, ts=200.0)
    live.apply(first, [stored([1, 2])], 0, 0)
    timer_rows = live.expire(now=150.0)
    _, live_rows = live.apply(second, [stored([3])], 0, 1)
    replay.apply(first, [stored([1, 2])], 0, 0)
    _, replay_rows = replay.apply(second, [stored([3])], 0, 1)
    assert replay_rows == timer_rows + live_rows
    assert held(live, {0: [1, 3]}) == held(replay, {0: [1, 3]})
    assert replay.nodes["n1"].suspect and "dropped at expiry" in replay.nodes["n1"].reason


def test_sliding_window_blocks_evicted_while_full_attention_stays_shrinks_only_the_swa_prefix():
    index = Index()
    feed = Feed(index)
    blocks = list(range(100, 110))
    feed.send(stored(blocks, group=0), stored(blocks, group=1), group_specs=SPECS)
    # vLLM frees blocks that left the sliding window early; they get evicted on reuse.
    feed.send(*[removed([h], group=1) for h in blocks[2:6]])
    assert (prefix(index, "n1", blocks, 0), prefix(index, "n1", blocks, 1)) == (10, 2)
    assert held(index, {1: blocks})["n1"][(1, "GPU")] == {0, 1, 6, 7, 8, 9}  # the tail is still cached


def test_bytes_hashes_work_like_ints():
    index = Index()
    h1, h2 = bytes(32), b"\x01" * 32
    Feed(index).send(stored([h1, h2]))
    assert prefix(index, "n1", [h1, h2]) == 2


def test_spec_mismatches_reported_by_a_bridge_are_kept_per_node_as_the_latest_count():
    index = Index()
    feed = Feed(index, node="vllm/dp0")
    feed.send(stored([1]), spec_mismatches=1)
    feed.send(stored([2]), spec_mismatches=2)
    feed.send(stored([3]))  # an envelope without the field keeps the last known count
    assert index.nodes["vllm/dp0"].counters["spec_mismatches"] == 2
    assert "spec_mismatches" not in index.counters  # a per-node gauge, not an index-wide sum
