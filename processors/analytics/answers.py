"""The analytics app's HTTP answers: `GET /stats`, `GET /health` and `POST /sql`, one Struct per record; `views`
encodes these, `kvpipe.processors.analytics.apidoc` documents them (the request of `/sql` is
`kvpipe.processors.analytics.query.SqlRequest`).

The JSON is what these endpoints answered before they were typed, every key present (null included), so no
`omit_defaults`. What stays a free-form mapping says why where it is declared.
"""
from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from kvpipe.processors.core.answers import DurabilityStats


class StoreHealth(msgspec.Struct):
    """The store as `/health` shows it, open without the token: its state, never the engine's error text."""

    state: str  # "up" | "refusing" (`kvpipe.processors.analytics.sink`)
    up: bool
    refusing_for_s: float | None  # null while up
    pending_rows: int  # rows handed to the sink the store has not acknowledged
    max_queue_rows: int
    consumption_paused: bool  # pending_rows reached max_queue_rows: the agent waits for room


class StoreState(StoreHealth):
    """`/stats` `store`: the same and the store's last refusal, as the engine worded it."""

    reason: str

    def health(self) -> StoreHealth:
        return StoreHealth(**{name: getattr(self, name) for name in StoreHealth.__struct_fields__})


class AnalyticsFreshness(msgspec.Struct):
    """One events partition's position in this app."""

    offset: int
    lag_messages: int | None  # null: end offset unknown
    lag_s: float | None
    snapshotted: bool


class AnalyticsDurability(DurabilityStats):
    last_skip: str  # why the latest snapshot was not written (the store had not acknowledged its rows); "" if none


class RestoreTrackerStats(msgspec.Struct):
    """The re-store tracker (capacity curve) of this worker."""

    loaded_partitions: list[int]
    slots: int
    # the latest rebuilds from the store (`agents.rebuild_restore_tracker`): sizes of what was read, offsets per
    # partition, timing; a mapping, as its sizes follow `restore_state.restore_info`
    rebuilds: list[dict[str, Any]]


class AnalyticsStats(msgspec.Struct):
    """`GET /stats` of one analytics worker (what `/metrics` exports too)."""

    app: Literal["analytics"]
    analytics_id: str
    uptime_s: float
    # index, ingest and app counters by name (`restores` null when the tracker is off): a mapping, as each
    # feature adds its own
    counters: dict[str, int | None]
    dlq_by_reason: dict[str, int]  # an open set: decode errors name their kind
    store: StoreState
    # the sink's counters: submitted and written rows per table of the table registry, batches, retries, the
    # last error; a mapping, as its names follow the tables
    sink: dict[str, Any]
    freshness: dict[str, AnalyticsFreshness]  # by partition
    durability: AnalyticsDurability
    restore_tracker: RestoreTrackerStats | None  # null: the tracker is off (KVPIPE_ANALYTICS_CAPACITY=false)
    # how the consumer handed messages to the row path (`kvpipe.processors.core.fastpath.deliveries`): a mapping,
    # as which counters exist depends on the consumer in use
    deliveries: dict[str, int | None] = {}


class AnalyticsHealth(msgspec.Struct):
    """Liveness: 200 while the worker runs, whatever the store does; open without the token."""

    status: Literal["ok"]
    app: Literal["analytics"]
    analytics_id: str
    store: StoreHealth


class SqlAnswer(msgspec.Struct):
    """`POST /sql`: the statement's result by row, with each column's name and engine type."""

    columns: list[str]
    types: list[str]  # ClickHouse type names, e.g. "UInt64", "Nullable(String)", "DateTime64(6)"
    # each cell as JSON has it; a value JSON lacks is its text (a DateTime "2025-01-01 12:00:00"), bytes "0x…" hex
    rows: list[list[Any]]


def encode_sql(answer: SqlAnswer) -> bytes:
    """`/sql`'s body. Cells keep the text they always had: json's rendering, and for what JSON lacks its text or
    "0x…" hex (msgspec would write a DateTime with a "T", bytes as base64, a NaN as null)."""
    return json.dumps(msgspec.structs.asdict(answer), default=_cell_text).encode()


def _cell_text(value: Any) -> str:
    if isinstance(value, bytes):
        return "0x" + value.hex()
    return str(value)
