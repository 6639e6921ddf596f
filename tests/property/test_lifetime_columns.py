"""Lifetimes as columns (`Index(lifetimes="columns")`, processors/core/lifetimes.py) equal the
reference rows (`LifetimeRow` lists) on random envelope streams, on both block stores: stores and
removes of int and bytes hashes (copies, unknown removes), clears, several groups and media, new
epochs, gaps, duplicates, stale epochs, real loss (resync), silence past the TTL, expiry by the
timer, per-slot and per-node caps. Equal means: the same lifetimes in the same order out of the
index, the same derived values (end reasons, group kinds, copy ordinals) and re-stores out of the
analytics app's derive step, and the same insert columns for ClickHouse, batch by batch.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpipe.processors.core import slots
from kvpipe.processors.core import lifetimes as lifecols
from kvpipe.processors.analytics import tables
from kvpipe.processors.analytics.derive import end_lifetimes, message_rows
from kvpipe.processors.core.lifetimes import LifetimeColumns
from kvpipe.processors.analytics.restores import RestoreTracker
from kvpipe.processors.analytics.rows import lifetime_columns, number_copies
from kvpipe.processors.core.index import Index
from kvpipe.processors.core.ingest import Ingest
from kvpipe.schemas.codec import KAFKA_HEADERS, encode_envelope, encode_vllm_batch
from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec
from tests.nativecheck import require_native_core
from tests.property.streams import events as event_strategy

require_native_core()

HASHES = st.one_of(st.integers(0, 12), st.integers(2**64 - 2, 2**64 - 1),
                   st.sampled_from([b"\x00" * 24 + (3).to_bytes(8, "big"), b"abc" * 11, b"\xff" * 32]))
SPECS = [GroupSpec(group_idx=0, kind="full_attention", block_size=16),
         GroupSpec(group_idx=1, kind="sliding_window", block_size=16, sliding_window=128)]


EVENT = event_strategy(HASHES, [None, "GPU", "GPU", "CPU"], 11)


@st.composite
def envelope(draw, t: float):
    node = draw(st.sampled_from(["a", "b", "c"]))
    epoch = draw(st.sampled_from([1, 1, 1, 1, 2, 0]))
    seq = draw(st.integers(0, 6))
    lost = draw(st.sampled_from([0] * 12 + [1]))
    ts = t + draw(st.sampled_from([0.0, 0.5, 1.0, 40.0]))  # 40 s: past the TTL below
    specs = draw(st.sampled_from([None, None, SPECS]))
    env = Envelope(v=SCHEMA_MAJOR, node_id=node, epoch=epoch, seq=seq, ts=ts, sent_ts=ts, lost_batches=lost,
                   group_specs=specs)
    timer = draw(st.sampled_from([None] * 6 + [0, 1]))  # the expiry timer fires for this partition after it
    return env, draw(st.lists(EVENT, max_size=6)), draw(st.sampled_from([0, 0, 1])), timer


@st.composite
def stream(draw):
    out, t = [], 100.0
    for _ in range(draw(st.integers(1, 30))):
        item = draw(envelope(t))
        t = item[0].ts
        out.append(item)
    return out


def pair(store: str, **kw) -> tuple[Index, Index]:
    return Index(store=store, lifetimes="rows", **kw), Index(store=store, lifetimes="columns", **kw)


@pytest.mark.parametrize("store", slots.STORES)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes=stream(), cap=st.sampled_from([None, 3]), slot_cap=st.sampled_from([None, 4]))
def test_the_index_ends_the_same_lifetimes_as_columns_as_rows(store, envelopes, cap, slot_cap):
    ref, col = pair(store, ttl_s=30.0, max_blocks_per_slot=cap, max_slots_per_node=slot_cap)
    for offset, (env, events, partition, timer) in enumerate(envelopes):
        outcome_r, rows = ref.apply(env.__copy__(), list(events), partition, offset)
        outcome_c, cols = col.apply(env.__copy__(), list(events), partition, offset)
        assert outcome_c == outcome_r
        assert isinstance(cols, LifetimeColumns) and len(cols) == len(rows)
        assert cols.rows() == rows
        if timer is not None:
            expired_r = ref.expire(env.ts + 35.0, partition=timer)
            expired_c = col.expire(env.ts + 35.0, partition=timer)
            assert expired_c.rows() == expired_r
    assert col.expire(envelopes[-1][0].ts + 100.0).rows() == ref.expire(envelopes[-1][0].ts + 100.0)
    assert col.ended == ref.ended and col.counters == ref.counters


def _message(env: Envelope, events: list) -> bytes:
    env = env.__copy__()
    env.num_events = len(events)
    env.batch = __import__("msgspec").Raw(encode_vllm_batch(events, env.ts))
    return encode_envelope(env)


@pytest.mark.parametrize("store", slots.STORES)
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes=stream(), batch=st.sampled_from([1, 3, 1000]))
def test_the_analytics_path_writes_the_same_rows_from_columns(store, envelopes, batch):
    """Decode (the native batch reader on the native store) + apply + derive + the sink's numbering
    and conversion: the same lifetime and re-store columns, cut into the same insert batches."""
    paths = []
    for mode in ("rows", "columns"):
        index = Index(store=store, lifetimes=mode, ttl_s=30.0, max_blocks_per_slot=4)
        paths.append((Ingest(index, 1 << 20), index, RestoreTracker()))
    written: list[list] = [[], []]  # per path: (lifetime insert columns, restores) per message or expiry
    pending: list = [[], LifetimeColumns()]  # what the sink's writer holds between inserts
    for offset, (env, events, partition, timer) in enumerate(envelopes):
        value = _message(env, events)
        for k, (ingest, index, tracker) in enumerate(paths):
            result = ingest.handle(value, KAFKA_HEADERS, partition, offset, 1e9)
            rows = message_rows(result, partition, offset, index, tracker, 0.0)
            lts, restores = rows[tables.LIFETIMES], rows.get(tables.RESTORES, [])
            ends = [lts]
            if timer is not None:
                expired = index.expire(env.ts + 35.0, partition=timer)
                end_lifetimes(index, tracker, None, expired)
                ends.append(expired)
            for lt in ends:
                if k == 0:
                    number_copies(lt)
                    pending[0].extend(lt)
                    written[0].append(([list(lt), restores]))
                else:
                    lifecols.number_copies(lt)
                    pending[1].extend(lt)
                    written[1].append(([lt.rows(), restores]))
                restores = []
        # what each path hands to ClickHouse, in the sink's batch size
        for i in range(0, len(pending[0]), batch):
            assert pending[1][i:i + batch].insert_columns() == lifetime_columns(pending[0][i:i + batch])
        assert len(pending[1]) == len(pending[0])
        pending = [[], LifetimeColumns()]
    assert written[1] == written[0]
