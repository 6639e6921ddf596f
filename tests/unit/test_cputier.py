"""The CPU tier's live copies, counted as the analytics app writes events (`cputier`): each GPU store learns how many
of its hashes the node's CPU tier held just before it (`from_cpu_blocks`)."""
from __future__ import annotations

import msgspec

from kvpipe.processors.analytics.cputier import CapacityTracker, CpuTier, NodeCopies, build_nodes
from kvpipe.processors.analytics.restore_state import PartitionState
from kvpipe.processors.analytics.rows import FROM_CPU_AT, event_columns_of
from kvpipe.schemas.envelope import Envelope
from kvpipe.schemas.events import AllBlocksCleared, BlockRemoved, BlockStored


def env(node: str = "n1", epoch: int = 1, seq: int = 0) -> Envelope:
    return Envelope(v=1, node_id=node, epoch=epoch, seq=seq, ts=1.0, batch=msgspec.Raw(b"[]"))


def stored(hashes, medium, group=0) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                       medium=medium, lora_name=None, group_idx=group)


def removed(hashes, medium, group=0) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=medium, group_idx=group)


def observe(tier: CpuTier, events, e: Envelope | None = None, partition: int = 0):
    e = e or env()
    hashes = [list(getattr(ev, "block_hashes", [])) for ev in events]
    return tier.observe(e, events, hashes, partition)


def test_a_gpu_store_counts_the_hashes_the_cpu_tier_holds_before_it_in_the_same_message():
    tier = CpuTier()
    # the CPU store comes before the GPU store of 7 (counted), the CPU removal of 9 after it (still counted)
    got = observe(tier, [stored([7, 9], "CPU"), stored([7, 8, 9], "GPU"), removed([9], "CPU"), stored([9], "GPU")])
    assert got == [0, 2, 0, 0]


def test_copies_are_counted_so_one_removal_of_two_stores_leaves_a_live_copy():
    tier = CpuTier()
    two_stores_one_removal = [stored([5], "CPU"), stored([5], "CPU"), removed([5], "CPU"), stored([5], "GPU")]
    assert observe(tier, two_stores_one_removal) == [0, 0, 0, 1]
    assert observe(tier, [removed([5], "CPU"), stored([5], "GPU")]) == [0, 0]
    assert tier.entries() == 0  # a count back at 0 is dropped


def test_a_removal_never_stored_makes_the_next_store_no_live_copy():
    tier = CpuTier()
    assert observe(tier, [removed([3], "CPU"), stored([3], "CPU"), stored([3], "GPU")]) == [0, 0, 0]
    assert observe(tier, [stored([3], "CPU"), stored([3], "GPU")]) == [0, 1]


def test_groups_nodes_and_media_are_apart_and_a_clear_changes_nothing():
    tier = CpuTier()
    observe(tier, [stored([1], "CPU", group=0)])
    assert observe(tier, [stored([1], "GPU", group=1), stored([1], "GPU", group=0)]) == [0, 1]
    assert observe(tier, [stored([1], "GPU")], env("n2")) == [0]  # another node's CPU tier
    assert observe(tier, [stored([1], None), removed([1], "GPU"), stored([1], "STORAGE")]) == [0, 0, 0]  # no GPU store
    assert observe(tier, [AllBlocksCleared(), stored([1], "GPU")]) == [0, 1]  # a clear names no medium: not tracked


def test_a_new_epoch_starts_with_an_empty_cpu_tier():
    tier = CpuTier()
    observe(tier, [stored([4], "CPU")], env(epoch=1))
    assert observe(tier, [stored([4], "GPU")], env(epoch=2)) == [0]
    assert observe(tier, [stored([4], "CPU"), stored([4], "GPU")], env(epoch=2)) == [0, 1]


def test_a_forgotten_partition_is_not_counted_until_its_counts_are_installed():
    tier = CpuTier()
    observe(tier, [stored([4], "CPU")], env("a"), partition=0)
    observe(tier, [stored([6], "CPU")], env("b"), partition=1)
    tier.forget_partition(0)
    assert observe(tier, [stored([4], "GPU")], env("a"), partition=0) == [None]  # NULL: the query counts it
    assert observe(tier, [stored([6], "GPU")], env("b"), partition=1) == [1]  # other partitions keep theirs
    tier.install(0, {"a": NodeCopies(1, 0, {0: {4: 1}})})
    assert observe(tier, [stored([4], "GPU")], env("a"), partition=0) == [1]


def test_the_tracker_forgets_and_installs_cpu_counts_with_its_slots():
    tracker = CapacityTracker()
    observe(tracker.cpu, [stored([4], "CPU")])
    tracker.forget_partition(0)
    assert 0 in tracker.cpu.unknown and tracker.cpu.nodes == {}
    tracker.install(0, {})  # slots without counts (not rebuilt by restore_state): still not counted
    assert 0 in tracker.cpu.unknown and 0 in tracker.loaded
    tracker.install(0, PartitionState({}, {"n1": NodeCopies(1, 0, {0: {4: 2}})}))
    assert 0 not in tracker.cpu.unknown and observe(tracker.cpu, [stored([4], "GPU")]) == [1]


def test_counts_rebuilt_from_store_rows_become_nodes_per_partition():
    cols = {"kafka_partition": [0, 0, 1], "node_id": ["a", "a", "b"], "epoch": [2, 2, 1], "group_idx": [0, 1, 0],
            "block_hash": [7, 7, 9], "copies": [1, -1, 2]}
    nodes = build_nodes(cols)
    assert set(nodes) == {0, 1} and nodes[0]["a"].epoch == 2 and nodes[0]["a"].groups == {0: {7: 1}, 1: {7: -1}}
    assert nodes[1]["b"].groups == {0: {9: 2}} and nodes[1]["b"].partition == 1
    assert build_nodes({}) == {}


def test_derive_fills_the_column_only_with_the_apps_tracker():
    from kvpipe.processors.analytics.derive import message_rows
    from kvpipe.processors.analytics.restores import RestoreTracker
    from kvpipe.processors.analytics.tables import EVENTS
    from kvpipe.processors.core.index import APPLIED, Index
    from kvpipe.processors.core.ingest import Result

    events = [stored([2**64 + 5], "CPU"), stored([5, 6], "GPU")]  # hashes as u64, like the event rows
    e = env()
    for tracker, want in ((CapacityTracker(), [0, 1]), (RestoreTracker(), [None, None]), (None, [None, None])):
        index = Index(ttl_s=None)
        outcome, closed = index.apply(e, events, 0, 0)
        assert outcome == APPLIED
        rows = message_rows(Result(outcome, e, events, closed), 0, 0, index, tracker, 1.0)
        assert rows[EVENTS].columns[FROM_CPU_AT] == want
    assert event_columns_of(e, events, 0, 0, 1.0).columns[FROM_CPU_AT] == [None, None]
