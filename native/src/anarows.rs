//! The analytics app's rows of a native ingest run: what `processors/analytics/derive.py: message_rows`
//! makes of one applied message (event rows, ended lifetimes, re-stores with their stack distances, the
//! CPU tier's copies of each GPU store, the load report), built for every record `ingestrun::run`
//! applies, straight into the tables' native columns (`chcols`), with the re-store tracker's state in
//! `captrack`. The Python rows (`processors/analytics/rows.py`, `restores.py`, `cputier.py`) stay the
//! reference; tests/property/test_native_analytics_run.py holds the two equal.
//!
//! Only the ingest run's common case comes here (a known node at its next seq, stores and removes into
//! slots it has, no clear): so every ended lifetime is an eviction of one event's remove, its end
//! reason is `evicted`, and no message ends the same block twice (its copy ordinal is 0).

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::batch::{Parsed, NO_MEDIUM, STORED};
use crate::captrack::{CapacityCore, Restored};
use crate::chcols::{self, ev, ld, lt, rs, TableCols};
use crate::envelope::Env;
use crate::ingestrun::{self, Limits, RunOut};
use crate::pycaptrack::PyCapacityCore;
use crate::pychcols::NativeRows;
use crate::IndexStore;

const GPU: &str = "GPU";
const CPU: &str = "CPU";
const KIND_STORED: &str = "stored";
const KIND_REMOVED: &str = "removed";
const EVICTED: &str = "evicted";

/// `rows.py: _us`: seconds as the microseconds a DateTime64(6) column takes, rounded half to even as
/// Python's `round` does.
fn us(ts: f64) -> i64 {
    (ts * 1_000_000.0).round_ties_even() as i64
}

/// `rows.py: _count`: a UInt32 load figure, or NULL for a value no scheduler reports.
fn count(v: Option<i64>) -> Option<u32> {
    v.and_then(|v| u32::try_from(v).ok())
}

/// A node's group specs as (group, kind, block size) from its `NodeState.group_specs` (none: empty).
pub(crate) fn node_kinds(state: &Bound<'_, PyAny>) -> PyResult<Vec<(i64, String, i64)>> {
    let specs = state.getattr("group_specs")?;
    let mut out: Vec<(i64, String, i64)> = Vec::new();
    if specs.is_none() {
        return Ok(out);
    }
    for spec in specs.try_iter()? {
        let spec = spec?;
        let group: i64 = spec.getattr("group_idx")?.extract()?;
        let kind: String = spec.getattr("kind")?.extract()?;
        let size: i64 = spec.getattr("block_size")?.extract()?;
        // a later spec of the same group wins, as in `derive.node_kinds`'s dict
        match out.iter_mut().find(|(g, _, _)| *g == group) {
            Some(slot) => *slot = (group, kind, size),
            None => out.push((group, kind, size)),
        }
    }
    Ok(out)
}

fn kind_of(kinds: &[(i64, String, i64)], group: i64) -> (&str, i64) {
    kinds
        .iter()
        .find(|(g, _, _)| *g == group)
        .map_or(("", 0), |(_, k, s)| (k.as_str(), *s))
}

/// Where a message came from and when the run read the clock for it (its rows' `ingest_ts`).
pub(crate) struct At {
    pub partition: i64,
    pub offset: i64,
    pub now: f64,
}

/// The rows of one run, table by table, and the tracker they update (None: capacity tracking off).
pub(crate) struct AnalyticsRows<'a> {
    pub tracker: Option<&'a mut CapacityCore>,
    pub events: TableCols,
    pub lifetimes: TableCols,
    pub restores: TableCols,
    pub loads: TableCols,
    /// The current message's ended lifetimes: (event index, key, store time), in event order.
    ended: Vec<(usize, u64, f64)>,
    restored: Vec<Restored>,
}

impl<'a> AnalyticsRows<'a> {
    pub fn new(tracker: Option<&'a mut CapacityCore>) -> Self {
        AnalyticsRows {
            tracker,
            events: TableCols::new(&chcols::EVENTS),
            lifetimes: TableCols::new(&chcols::LIFETIMES),
            restores: TableCols::new(&chcols::RESTORES),
            loads: TableCols::new(&chcols::LOADS),
            ended: Vec::new(),
            restored: Vec::new(),
        }
    }

    /// The entries event `event`'s remove ended (keys and their store times).
    pub fn ended(&mut self, event: usize, keys: &[u64], ts: &[f64]) {
        self.ended
            .extend(keys.iter().zip(ts).map(|(&k, &t)| (event, k, t)));
    }

    pub fn discard(&mut self) {
        self.ended.clear();
    }

    /// The rows of one applied message (`events`: how many of `parsed.events` it has; `kinds`: its node's
    /// group specs), and the tracker's walk over it in event order.
    pub fn message(
        &mut self,
        env: &Env<'_>,
        parsed: &Parsed,
        events: usize,
        kinds: &[(i64, String, i64)],
        at: At,
    ) {
        let node = env.node_id;
        let (ts_us, now_us) = (us(env.ts), us(at.now));
        let dp_rank = env.dp_rank.unwrap_or(-1) as i32;
        // the CPU tier's counts: known for the partition, and reset on a new epoch (`cputier.CpuTier.observe`,
        // which `message_rows` calls for a message with events only)
        let cpu_known = match self.tracker.as_deref_mut() {
            Some(t) if events > 0 => t.cpu_message(node, env.epoch, at.partition),
            _ => false,
        };
        let mut ended = std::mem::take(&mut self.ended);
        let mut next_end = 0;
        for (j, e) in parsed.events[..events].iter().enumerate() {
            let keys = &parsed.keys[e.start..e.end];
            let group = e.group.map_or(-1, |g| g as i64);
            let medium = if e.medium == NO_MEDIUM {
                ""
            } else {
                parsed.medium(e).unwrap_or("")
            };
            let stored = e.kind == STORED;
            let from_cpu = match self.tracker.as_deref() {
                Some(t) if cpu_known => Some(if stored && medium == GPU {
                    t.cpu_gpu_store(node, group, keys)
                } else {
                    0
                }),
                _ => None,
            };
            if cpu_known {
                if let Some(t) = self.tracker.as_deref_mut() {
                    if medium == CPU {
                        t.cpu_add(node, group, keys, if stored { 1 } else { -1 });
                    }
                }
            }
            let (group_kind, group_size) = kind_of(kinds, group);
            let ev_rows = &mut self.events;
            ev_rows.push_i64(ev::TS, ts_us);
            ev_rows.push_i64(ev::INGEST_TS, now_us);
            ev_rows.push_str(ev::NODE_ID, node);
            ev_rows.push_u64(ev::EPOCH, env.epoch as u64);
            ev_rows.push_u64(ev::SEQ, env.seq as u64);
            ev_rows.push_i32(ev::DP_RANK, dp_rank);
            ev_rows.push_i32(ev::GROUP_IDX, group as i32);
            ev_rows.push_str(ev::MEDIUM, medium);
            ev_rows.push_u64s(ev::BLOCK_HASHES, keys);
            ev_rows.push_u32(ev::NUM_BLOCKS, keys.len() as u32);
            ev_rows.push_u32(ev::KAFKA_PARTITION, at.partition as u32);
            ev_rows.push_u64(ev::KAFKA_OFFSET, at.offset as u64);
            ev_rows.push_u32(ev::EVENT_IDX, j as u32);
            ev_rows.push_opt_u32(ev::FROM_CPU_BLOCKS, from_cpu);
            if stored {
                let f = &e.stored;
                ev_rows.push_str(ev::KIND, KIND_STORED);
                let own = if f.spec_kind == NO_MEDIUM {
                    None
                } else {
                    parsed.spec_kind(e)
                };
                ev_rows.push_str(ev::SPEC_KIND, own.unwrap_or(group_kind));
                ev_rows.push_u64(ev::PARENT_HASH, f.parent.unwrap_or(0));
                ev_rows.push_u8(ev::HAS_PARENT, f.parent.is_some() as u8);
                ev_rows.push_u32(ev::NUM_TOKENS, f.tokens as u32);
                ev_rows.push_u32(ev::BLOCK_SIZE, f.block_size as u32);
            } else {
                ev_rows.push_str(ev::KIND, KIND_REMOVED);
                ev_rows.push_str(ev::SPEC_KIND, group_kind);
                ev_rows.push_u64(ev::PARENT_HASH, 0);
                ev_rows.push_u8(ev::HAS_PARENT, 0);
                ev_rows.push_u32(ev::NUM_TOKENS, 0);
                ev_rows.push_u32(ev::BLOCK_SIZE, group_size as u32);
            }
            ev_rows.end_row();
            // the index's slot of the event: `ev.group_idx or 0`, `ev.medium or GPU`
            let slot_group = e.group.unwrap_or(0) as i64;
            let slot_medium = if medium.is_empty() { GPU } else { medium };
            let (slot_kind, slot_size) = kind_of(kinds, slot_group);
            let first = next_end;
            while next_end < ended.len() && ended[next_end].0 == j {
                next_end += 1;
            }
            for &(_, key, stored_ts) in &ended[first..next_end] {
                let l = &mut self.lifetimes;
                l.push_str(lt::NODE_ID, node);
                l.push_u64(lt::EPOCH, env.epoch as u64);
                l.push_i32(lt::GROUP_IDX, slot_group as i32);
                l.push_str(lt::MEDIUM, slot_medium);
                l.push_u64(lt::BLOCK_HASH, key);
                l.push_i64(lt::STORED_TS, us(stored_ts));
                l.push_i64(lt::REMOVED_TS, ts_us);
                l.push_f64(lt::LIFETIME_S, env.ts - stored_ts);
                l.push_str(lt::REASON, EVICTED);
                l.push_u32(lt::KAFKA_PARTITION, at.partition as u32);
                l.push_u64(lt::KAFKA_OFFSET, at.offset as u64);
                l.push_u32(lt::EVENT_IDX, j as u32);
                l.push_u16(lt::COPY_IDX, 0);
                l.push_str(lt::GROUP_KIND, slot_kind);
                l.push_str(lt::END_REASON, EVICTED);
                l.end_row();
                if let Some(t) = self.tracker.as_deref_mut() {
                    t.end(node, slot_group, slot_medium, key, env.ts, EVICTED);
                }
            }
            if !stored {
                continue;
            }
            let Some(t) = self.tracker.as_deref_mut() else {
                continue;
            };
            self.restored.clear();
            t.stored(
                node,
                slot_group,
                slot_medium,
                at.partition,
                keys,
                &mut self.restored,
            );
            let block_size = if e.stored.block_size != 0 {
                e.stored.block_size
            } else {
                slot_size
            };
            for r in &self.restored {
                let row = &mut self.restores;
                row.push_str(rs::NODE_ID, node);
                row.push_u64(rs::EPOCH, env.epoch as u64);
                row.push_i32(rs::GROUP_IDX, slot_group as i32);
                row.push_str(rs::GROUP_KIND, slot_kind);
                row.push_str(rs::MEDIUM, slot_medium);
                row.push_u64(rs::BLOCK_HASH, r.hash);
                row.push_u32(rs::BLOCK_SIZE, block_size as u32);
                row.push_i64(rs::REMOVED_TS, us(r.removed_ts));
                row.push_i64(rs::RESTORED_TS, ts_us);
                row.push_f64(rs::DELAY_S, env.ts - r.removed_ts);
                row.push_str(rs::END_REASON, t.reason(r.reason));
                row.push_u64(rs::STACK_DISTANCE, r.distance);
                row.push_u64(rs::HELD_BLOCKS, r.held);
                row.push_u32(rs::KAFKA_PARTITION, at.partition as u32);
                row.push_u64(rs::KAFKA_OFFSET, at.offset as u64);
                row.push_u32(rs::EVENT_IDX, j as u32);
                row.end_row();
            }
        }
        ended.clear();
        self.ended = ended;
        if env.reports_load() {
            let l = &mut self.loads;
            l.push_i64(ld::TS, ts_us);
            l.push_str(ld::NODE_ID, node);
            l.push_u64(ld::EPOCH, env.epoch as u64);
            l.push_u64(ld::SEQ, env.seq as u64);
            l.push_opt_u32(ld::RUNNING, count(env.running));
            l.push_opt_u32(ld::WAITING, count(env.waiting));
            l.push_opt_f64(ld::KV_USAGE, env.kv_usage.filter(|u| u.is_finite()));
            l.push_u32(ld::KAFKA_PARTITION, at.partition as u32);
            l.push_u64(ld::KAFKA_OFFSET, at.offset as u64);
            l.end_row();
        }
    }
}

type RowsOut = (NativeRows, NativeRows, NativeRows, NativeRows);

/// `ingest_run` for the analytics app (`processors/core/ingestrun.py: handle_batch` with rows): the same
/// run, answer and stop rules, and the rows of every record it applied as `NativeRows` of kv_events,
/// kv_block_lifetimes, kv_restores and kv_node_load. `tracker`: the app's capacity tracker (None: off).
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (store, records, start, partition, last_offset, stream_ts, nodes, clock,
                    max_bytes, max_skew_s, ttl_s, cap, headers, tracker))]
pub fn analytics_run(
    store: &Bound<'_, IndexStore>,
    records: &Bound<'_, PyList>,
    start: usize,
    partition: i64,
    last_offset: Option<i64>,
    stream_ts: f64,
    nodes: &Bound<'_, PyDict>,
    clock: &Bound<'_, PyAny>,
    max_bytes: usize,
    max_skew_s: f64,
    ttl_s: Option<f64>,
    cap: Option<usize>,
    headers: Vec<(String, Vec<u8>)>,
    tracker: Option<Bound<'_, PyCapacityCore>>,
) -> PyResult<(RunOut, RowsOut)> {
    let limits = Limits {
        max_bytes,
        max_skew_s,
        ttl_s,
        cap,
    };
    let mut guard = tracker.as_ref().map(|t| t.borrow_mut());
    let mut rows = AnalyticsRows::new(guard.as_deref_mut().map(|t| &mut t.core));
    let out = ingestrun::run(
        store,
        records,
        start,
        partition,
        last_offset,
        stream_ts,
        nodes,
        None,
        clock,
        &limits,
        &headers,
        Some(&mut rows),
    )?;
    let AnalyticsRows {
        events,
        lifetimes,
        restores,
        loads,
        ..
    } = rows;
    Ok((
        out,
        (
            NativeRows::from_cols(events),
            NativeRows::from_cols(lifetimes),
            NativeRows::from_cols(restores),
            NativeRows::from_cols(loads),
        ),
    ))
}
