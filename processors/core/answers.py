"""HTTP answer records both Faust apps share: the 4xx body and the snapshot machinery's part of `/stats`.

Each app's own answers are Structs beside its views (`kvpipe.processors.routing.answers`,
`kvpipe.processors.analytics.answers`); the OpenAPI documents are generated from all of them
(`kvpipe.processors.core.apidoc`).

No `omit_defaults` here or in the apps' answer Structs: the answers were plain JSON objects before they were
typed, with every key present (null included), and clients read them that way.
"""
from __future__ import annotations

import msgspec


class ErrorBody(msgspec.Struct):
    """The body of every 4xx either app answers: a short `error` and a `detail` saying what to change."""

    error: str
    detail: str | None = None


class RestoreRecord(msgspec.Struct):
    """One partition's index slice restored at assignment (`Durability._restore_one`)."""

    partition: int
    offset: int  # the last offset the slice covers; -1: no snapshot, rebuilt from the log
    blocks: int
    ms: float
    ts: float


class SnapshotFailure(msgspec.Struct):
    """The latest snapshot the cluster refused or did not acknowledge in time."""

    ts: float
    partitions: list[int]
    error: str


class DurabilityStats(msgspec.Struct):
    """`/stats` `durability`: snapshots written and restores done by this worker (`kvpipe.processors.core.durability`)."""

    snapshots: int
    snapshot_ms_last: float
    snapshot_export_ms_last: float  # the longest partition export of the last snapshot: ingest waited that long
    snapshot_bytes_last: int
    restores: list[RestoreRecord]  # the latest 16
    restore_errors: int
    snapshot_errors: int
    snapshot_last_error: SnapshotFailure | None
    snapshot_ok_ts: float
