"""LifetimeColumns (processors/core/lifetimes.py) against the row reference on hand-made cases
the index rarely produces: copies of one key, several nodes in one expiry, unrefined reasons."""
from __future__ import annotations

from kvpipe.processors.core import lifetimes as lifecols
from kvpipe.processors.core.lifetimes import LifetimeColumns
from kvpipe.processors.analytics.restores import RestoreTracker, refine_reason_columns, refine_reasons
from kvpipe.processors.analytics.rows import lifetime_columns, number_copies
from kvpipe.processors.core.lifetimes import LifetimeRow
from kvpipe.processors.core.index import Index
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from kvpipe.schemas.events import BlockRemoved, BlockStored


def rows() -> list[LifetimeRow]:
    return [
        LifetimeRow("a", 1, 0, "GPU", 7, 1.5, 2.25, "cleared", 0, 10, -1),
        LifetimeRow("a", 1, 0, "GPU", 7, 1.5, 2.25, "cleared", 0, 10, -1),  # a copy: same key
        LifetimeRow("a", 1, 1, "GPU", 7, 1.0, 2.25, "evicted", 0, 10, 3),  # same hash, other group
        LifetimeRow("b", 2, 0, "CPU", 9, 0.5, 3.0, "node_expired", 1, 4, -1),
        LifetimeRow("a", 1, 0, "GPU", 7, 1.5, 2.25, "cleared", 0, 10, -1),  # a third copy
    ]


def test_copies_of_one_key_are_numbered_as_the_rows_are():
    ref = rows()
    number_copies(ref)
    cols = LifetimeColumns.from_rows(rows())
    lifecols.number_copies(cols)
    assert cols.copy_idx == [r.copy_idx for r in ref] == [0, 1, 0, 0, 2]
    assert cols.insert_columns() == lifetime_columns(ref)


def test_reasons_and_kinds_on_columns_match_the_rows():
    env = Envelope(v=SCHEMA_MAJOR, node_id="a", epoch=2, seq=0, ts=3.0, sent_ts=3.0)
    ref, cols = rows(), LifetimeColumns.from_rows(rows())
    refine_reasons(env, ref)
    refine_reason_columns(env, cols)
    assert cols.end_reason == [r.end_reason for r in ref] == ["epoch_change", "epoch_change", "evicted",
                                                              "node_expired", "epoch_change"]
    kinds = {"a": {0: ("full_attention", 16), 1: ("sliding_window", 16)}, "b": {0: ("mamba", 16)}}
    lifecols.set_group_kinds(cols, kinds.__getitem__)
    assert cols.group_kind == ["full_attention", "full_attention", "sliding_window", "mamba", "full_attention"]


def test_unset_derived_columns_write_the_row_defaults_and_survive_extend_and_slices():
    acc = LifetimeColumns()
    plain = LifetimeColumns.from_rows(rows()[:2])
    plain.copy_idx = plain.group_kind = plain.end_reason = None  # as the index hands them over
    acc.extend(plain)
    acc.extend(LifetimeColumns.from_rows(rows()[2:]))
    assert acc.rows() == rows()
    assert acc[1:4].insert_columns() == lifetime_columns(rows()[1:4])
    del acc[:3]
    assert acc.rows() == rows()[3:]


def test_the_tracker_reports_the_same_restore_from_columns():
    """Evicted at event 1, stored again at event 2 of the same message: one re-store either way."""
    specs = [GroupSpec(group_idx=0, kind="full_attention", block_size=16)]
    store = BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=[], block_size=16, lora_id=None,
                        medium="GPU", lora_name=None, group_idx=0)
    events = [store, BlockRemoved(block_hashes=[1], medium="GPU", group_idx=0), store]
    got = []
    for mode in ("rows", "columns"):
        index, tracker = Index(lifetimes=mode), RestoreTracker()
        env = Envelope(v=SCHEMA_MAJOR, node_id="n", epoch=1, seq=0, ts=5.0, sent_ts=5.0, group_specs=specs)
        _, closed = index.apply(env, events, 0, 0)
        got.append((tracker.observe(env, events, closed, 0, 0, {0: ("full_attention", 16)}), dict(
            (k, (dict(s.ended), s.held)) for k, s in tracker.slots.items())))
    assert got[0] == got[1] and len(got[0][0]) == 1 and got[0][0][0].idx == 2


def test_the_bench_block_runs_both_paths_on_one_workload():
    from kvpipe.bench.analytics_lifetimes import lifetimes_path

    got = lifetimes_path(300, repeats=1, blocks_per_prompt=64, gpu_blocks=64)
    assert got["lifetimes"] > 0 and got["restores"] > 0  # it raises if the two paths count differently
    assert set(got["rows"]) == set(got["columns"]) >= {"lifetimes_per_s", "messages_per_s"}
