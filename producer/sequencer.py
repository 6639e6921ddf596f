"""Envelope sequencing: which (epoch, seq) an envelope gets and what metadata rides on it.

Pure bookkeeping, no I/O and no clock of its own (callers pass the times), so the rules below are
tested without Kafka. The publisher's background thread is its only user; it is not thread-safe.
"""
from __future__ import annotations

import msgspec

from kvpipe.schemas.envelope import SCHEMA_MAJOR, Envelope, GroupSpec, HashConfig

# The Envelope's own default object, not an equal one: msgspec omits a default field by identity,
# and an explicitly passed empty Raw would be written as a key with no value (broken msgpack).
_NO_BATCH: msgspec.Raw = next(f.default for f in msgspec.structs.fields(Envelope) if f.name == "batch")


class Sequencer:
    """Stamps envelopes for one node.

    Invariants:
    - `seq` is contiguous from 0 within an epoch and is assigned when an envelope is stamped for
      sending, never when a batch is queued: a batch dropped at the queue leaves no gap, it shows up
      as `dropped` on the next envelope instead. A heartbeat takes a seq too, so a consumer checking
      contiguity needs no special case and a heartbeat can carry `dropped`.
    - `dropped` is the difference between two snapshots of the caller's monotone "events dropped so
      far" counter. Taking the snapshot at enqueue time (not at send time) puts each drop between
      the two batches it really fell between.
    - Group specs and hash config travel on seq 0, on the first envelope after they change, and
      whenever `specs_every_s` passed since they last travelled (a consumer that joined late or lost
      its state learns them within that period).
    - `unstamp` hands back the last seq when an envelope could not be handed to Kafka at all, and
      `note_lost` adds its events to the next envelope's `dropped`: the stream stays gap-free and
      still tells consumers that events are missing.
    """

    def __init__(
        self,
        node_id: str,
        epoch: int,
        *,
        model: str | None = None,
        dp_rank: int | None = 0,
        group_specs: list[GroupSpec] | None = None,
        hash_config: HashConfig | None = None,
        source: str = "kvpipe",
        specs_every_s: float = 30.0,
        dropped_base: int = 0,
    ) -> None:
        if not node_id:
            raise ValueError("node_id must be a non-empty string (it is the Kafka key and the index key)")
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.node_id = node_id
        self.epoch = epoch
        self.model = model
        self.dp_rank = dp_rank
        self.source = source
        self.specs_every_s = specs_every_s
        self.group_specs = group_specs
        self.hash_config = hash_config
        self.next_seq = 0
        self._specs_pending = True
        self._specs_sent_at: float | None = None
        self._dropped_reported = dropped_base
        self._dropped_extra = 0  # events lost after stamping (unstamp), reported on the next envelope
        self.spec_mismatches = 0  # sticky: every envelope reports the latest count (set by the bridge)
        self.load: tuple[int, int, float] | None = None  # sticky (running, waiting, kv_usage): the latest report

    # -- control ---------------------------------------------------------------------------------

    def new_epoch(self, epoch: int, dropped_total: int) -> None:
        """Start `epoch` at seq 0; drops of the old incarnation are irrelevant to the new one."""
        if epoch <= self.epoch:
            raise ValueError(f"node {self.node_id!r}: new epoch {epoch} must be greater than {self.epoch}")
        self.epoch = epoch
        self.next_seq = 0
        self._specs_pending = True
        self._dropped_reported = dropped_total
        self._dropped_extra = 0

    def set_group_specs(self, specs: list[GroupSpec], hash_config: HashConfig | None = None) -> None:
        self.group_specs = specs
        if hash_config is not None:
            self.hash_config = hash_config
        self._specs_pending = True

    def specs_due(self, mono: float) -> bool:
        if self.group_specs is None and self.hash_config is None:
            return False
        if self._specs_pending or self._specs_sent_at is None:
            return True
        return mono - self._specs_sent_at >= self.specs_every_s

    # -- stamping --------------------------------------------------------------------------------

    def stamp(
        self,
        *,
        ts: float,
        sent_ts: float,
        mono: float,
        dropped_total: int,
        batch: msgspec.Raw = _NO_BATCH,
        num_events: int = 0,
        layout: str = "map",
        upstream_seq: int | None = None,
        lost_batches: int = 0,
        dp_rank: int | None = None,
    ) -> Envelope:
        """The next envelope of this node; consumes one seq. An empty `batch` is a heartbeat."""
        dropped = max(0, dropped_total - self._dropped_reported) + self._dropped_extra
        self._dropped_reported = max(self._dropped_reported, dropped_total)
        self._dropped_extra = 0
        with_specs = self.specs_due(mono)
        if with_specs:
            self._specs_pending = False
            self._specs_sent_at = mono
        env = Envelope(
            v=SCHEMA_MAJOR,
            node_id=self.node_id,
            epoch=self.epoch,
            seq=self.next_seq,
            ts=ts,
            sent_ts=sent_ts,
            model=self.model,
            dp_rank=self.dp_rank if dp_rank is None else dp_rank,
            group_specs=self.group_specs if with_specs else None,
            hash_config=self.hash_config if with_specs else None,
            dropped=dropped,
            lost_batches=lost_batches,
            num_events=num_events,
            batch=batch if len(batch) else _NO_BATCH,
            source=self.source,
            upstream_seq=upstream_seq,
            layout=layout,
            spec_mismatches=self.spec_mismatches,
        )
        load = self.load
        if load is not None:
            env.running, env.waiting, env.kv_usage = load
        self.next_seq += 1
        return env

    def heartbeat(self, *, now: float, mono: float, dropped_total: int) -> Envelope:
        return self.stamp(ts=now, sent_ts=now, mono=mono, dropped_total=dropped_total)

    def unstamp(self, env: Envelope) -> None:
        """Undo the last `stamp` (the envelope never reached Kafka's queue)."""
        if env.epoch != self.epoch or env.seq != self.next_seq - 1:
            raise ValueError(f"can only unstamp the last envelope (seq {self.next_seq - 1}), got seq {env.seq}")
        self.next_seq -= 1
        self._dropped_extra += env.dropped  # the drops it was carrying go on the next envelope
        if env.group_specs is not None or env.hash_config is not None:
            self._specs_pending = True

    def note_lost(self, num_events: int) -> None:
        """Events lost after the queue (encode or produce error): reported as `dropped` next."""
        self._dropped_extra += num_events
