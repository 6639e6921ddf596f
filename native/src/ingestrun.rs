//! The ingest run: a partition's Kafka records handled in one call while each is the common case
//! of `processors/core/ingest.py: Ingest.handle` (see `processors/core/ingestrun.py`, which owns the rules'
//! description and applies the summary this returns to the Python state).
//!
//! Per record: the offset against the partition's last applied one, the headers, the envelope
//! (`envelope::decode`, its batch read in place), then the rules of `processors/core/index.py:
//! Index.apply` for a known node in the same epoch at the next seq, every event a store or remove
//! into a slot the node has; the blocks go straight into the store. The first record outside that
//! (or any doubt) stops the run *before* anything of it is applied; the caller runs it through
//! `Ingest.handle` and starts the next run after it. Nothing here keeps state between calls: each
//! call reads the nodes it meets from their `NodeState`s and returns what changed per node.

use std::sync::RwLockWriteGuard;
use std::time::{Duration, Instant};

use crate::anarows;
use crate::batch::{Parsed, CLEARED, STORED};
use crate::envelope;
use crate::{store, IndexStore};
use hashbrown::HashMap;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString, PyTuple};

/// How long a run keeps the store's write lock before it lets the route server's readers in: taken once per
/// event, the lock was asked for ~100 k times a second at 100 k events/s, and an ask behind a route's read can
/// put this thread (holding the GIL) to sleep until the scheduler wakes it. Held across envelopes, a reader waits
/// at most this plus one envelope. (Its effect on freshness was not measured on its own.)
const WRITE_SLICE: Duration = Duration::from_micros(200);

/// A node met in this run: what its `NodeState` said, then what the run changed.
struct NodeRun {
    state: PyObject,
    usable: bool, // not expired, not tracked in flight, fields as expected
    epoch: i64,
    seq: i64,
    last_seen: f64,
    model: Option<String>,
    slots: Vec<(u64, String, u32)>, // (group, medium, slot id)
    envelopes: u64,
    heartbeats: u64,
    events: u64,
    stored: u64,
    removed: u64,
    unknown: u64,
    last_offset: i64,
    dp_rank: Option<i64>,
    load: Option<(Option<i64>, Option<i64>, Option<f64>)>,
    spec_mismatches: i64,
    refused: Vec<(u32, usize)>,
    /// The node's group specs as (group, kind, block size): read only for the analytics rows.
    kinds: Vec<(i64, String, i64)>,
}

fn read_node(state: Bound<'_, PyAny>, tracked: bool, with_kinds: bool) -> NodeRun {
    let mut run = NodeRun {
        state: state.clone().unbind(),
        usable: false,
        epoch: 0,
        seq: 0,
        last_seen: 0.0,
        model: None,
        slots: Vec::new(),
        envelopes: 0,
        heartbeats: 0,
        events: 0,
        stored: 0,
        removed: 0,
        unknown: 0,
        last_offset: -1,
        dp_rank: None,
        load: None,
        spec_mismatches: 0,
        refused: Vec::new(),
        kinds: Vec::new(),
    };
    let read = |run: &mut NodeRun| -> PyResult<bool> {
        if tracked || state.getattr("expired")?.is_truthy()? {
            return Ok(false);
        }
        run.epoch = state.getattr("epoch")?.extract()?;
        run.seq = state.getattr("seq")?.extract()?;
        run.last_seen = state.getattr("last_seen")?.extract()?;
        run.model = state.getattr("model")?.extract()?;
        let slots = state.getattr("slots")?;
        for (key, slot) in slots.downcast::<PyDict>()?.iter() {
            let (group, medium): (u64, String) = key.extract()?;
            run.slots
                .push((group, medium, slot.getattr("sid")?.extract()?));
        }
        if with_kinds {
            run.kinds = anarows::node_kinds(&state)?;
        }
        Ok(true)
    };
    // a field of an unexpected type leaves the node to the reference path
    run.usable = read(&mut run).unwrap_or(false);
    run
}

fn headers_ok(headers: &Bound<'_, PyAny>, expected: &[(String, Vec<u8>)]) -> bool {
    // `codec.check_headers`: a known header with another value refuses the message; others pass
    let check = |pair: Bound<'_, PyAny>| -> bool {
        let Ok(pair) = pair.downcast::<PyTuple>() else {
            return false;
        };
        if pair.len() != 2 {
            return false;
        }
        let (Ok(key), Ok(value)) = (pair.get_item(0), pair.get_item(1)) else {
            return false;
        };
        let Ok(key) = key.downcast::<PyString>() else {
            return false;
        };
        let Ok(key) = key.to_str() else {
            return false;
        };
        match expected.iter().find(|(k, _)| k == key) {
            None => true,
            Some((_, want)) => {
                value.is_none()
                    || value
                        .downcast::<PyBytes>()
                        .is_ok_and(|v| v.as_bytes() == want.as_slice())
            }
        }
    };
    if headers.is_none() {
        return true;
    }
    if let Ok(list) = headers.downcast::<PyList>() {
        return list.iter().all(check);
    }
    if let Ok(tuple) = headers.downcast::<PyTuple>() {
        return tuple.iter().all(check);
    }
    false
}

/// The value of a fallible step, or the end of the run at this record (nothing of it applied yet:
/// the reference path meets the same failure and reports it as it always does).
macro_rules! ok {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(_) => break,
        }
    };
}

/// The run's answer; see `ingest_run`.
type NodeOut = (
    PyObject,
    i64,
    f64,
    i64,
    (u64, u64, u64, u64, u64, u64),
    Option<i64>,
    Option<(Option<i64>, Option<i64>, Option<f64>)>,
    i64,
    Vec<(u32, usize)>,
);
pub(crate) type RunOut = (
    usize,
    Option<f64>,
    Option<i64>,
    f64,
    Option<f64>,
    Vec<f64>,
    (u64, u64, u64, u64),
    Vec<NodeOut>,
    Option<String>,
);

/// Handle `records[start..]` of `partition` while each is the common case (module doc). Returns
/// `(stop, now at stop, applied offset, stream ts, ingest ts, published, (messages, skipped,
/// offset holes, ended entries), per node changed (state, seq, last_seen, last_offset,
/// (envelopes, heartbeats, events, stored, removed, unknown), dp_rank, load, spec_mismatches,
/// [(slot, refused stores)]), error)`. `stop` is the first record not handled; `now at stop` the
/// clock already read for it (the reference path must use that reading, not a new one). `error`:
/// the store refused an operation (a bug): the record before `stop` was counted but not fully
/// applied.
#[allow(clippy::too_many_arguments)]
#[pyfunction]
#[pyo3(signature = (store, records, start, partition, last_offset, stream_ts, nodes, tracks, clock,
                    max_bytes, max_skew_s, ttl_s, cap, headers))]
pub fn ingest_run(
    store: &Bound<'_, IndexStore>,
    records: &Bound<'_, PyList>,
    start: usize,
    partition: i64,
    last_offset: Option<i64>,
    stream_ts: f64,
    nodes: &Bound<'_, PyDict>,
    tracks: Option<Bound<'_, PyAny>>,
    clock: &Bound<'_, PyAny>,
    max_bytes: usize,
    max_skew_s: f64,
    ttl_s: Option<f64>,
    cap: Option<usize>,
    headers: Vec<(String, Vec<u8>)>,
) -> PyResult<RunOut> {
    let limits = Limits {
        max_bytes,
        max_skew_s,
        ttl_s,
        cap,
    };
    run(
        store,
        records,
        start,
        partition,
        last_offset,
        stream_ts,
        nodes,
        tracks,
        clock,
        &limits,
        &headers,
        None,
    )
}

/// The bounds `Ingest.handle` applies (the routing app's settings).
pub(crate) struct Limits {
    pub max_bytes: usize,
    pub max_skew_s: f64,
    pub ttl_s: Option<f64>,
    pub cap: Option<usize>,
}

/// `ingest_run`, and with `rows` the analytics app's rows of every record it applies (`anarows`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn run(
    store: &Bound<'_, IndexStore>,
    records: &Bound<'_, PyList>,
    start: usize,
    partition: i64,
    last_offset: Option<i64>,
    stream_ts: f64,
    nodes: &Bound<'_, PyDict>,
    tracks: Option<Bound<'_, PyAny>>,
    clock: &Bound<'_, PyAny>,
    limits: &Limits,
    headers: &[(String, Vec<u8>)],
    mut rows: Option<&mut anarows::AnalyticsRows<'_>>,
) -> PyResult<RunOut> {
    let Limits {
        max_bytes,
        max_skew_s,
        ttl_s,
        cap,
    } = *limits;
    let py = store.py();
    let core = store.borrow_mut();
    let (a_partition, a_offset, a_value, a_headers, a_ts, a_ts_type) = (
        pyo3::intern!(py, "partition"),
        pyo3::intern!(py, "offset"),
        pyo3::intern!(py, "value"),
        pyo3::intern!(py, "headers"),
        pyo3::intern!(py, "timestamp"),
        pyo3::intern!(py, "timestamp_type"),
    );
    let mut runs: Vec<NodeRun> = Vec::new();
    let mut by_id: HashMap<String, usize> = HashMap::new();
    let mut parsed = Parsed::default();
    let mut sids: Vec<u32> = Vec::new();
    let mut last = last_offset;
    let mut stream_ts = stream_ts;
    let mut ingest_ts = None;
    let mut published = Vec::new();
    let (mut messages, mut skipped, mut holes, mut ended) = (0u64, 0u64, 0u64, 0u64);
    let mut stop_now = None;
    let mut error = None;
    let n = records.len();
    let mut i = start;
    // the store's write lock, taken at the run's first event and let go every WRITE_SLICE (between envelopes)
    let mut held: Option<(RwLockWriteGuard<'_, store::Store>, Instant)> = None;
    while i < n {
        if held
            .as_ref()
            .is_some_and(|(_, since)| since.elapsed() >= WRITE_SLICE)
        {
            held = None;
        }
        let r = ok!(records.get_item(i));
        let Ok(p) = r.getattr(a_partition).and_then(|v| v.extract::<i64>()) else {
            break;
        };
        let Ok(offset) = r.getattr(a_offset).and_then(|v| v.extract::<i64>()) else {
            break;
        };
        if p != partition {
            break;
        }
        if last.is_some_and(|l| offset <= l) {
            // at or below the restored snapshot's offset: skipped (the clock is read all the same)
            if clock.call0().is_err() {
                break;
            }
            skipped += 1;
            i += 1;
            continue;
        }
        let value = ok!(r.getattr(a_value));
        let Ok(value) = value.downcast::<PyBytes>() else {
            break;
        };
        let data = value.as_bytes();
        if data.len() > max_bytes || !headers_ok(&ok!(r.getattr(a_headers)), headers) {
            break;
        }
        let Some(env) = envelope::decode(data, &mut parsed) else {
            break;
        };
        let at = match by_id.get(env.node_id) {
            Some(&at) => at,
            None => {
                let Some(state) = ok!(nodes.get_item(env.node_id)) else {
                    break; // a new node: the reference path creates it
                };
                let tracked = match &tracks {
                    Some(t) => ok!(t.call1((env.node_id,)).and_then(|v| v.is_truthy())),
                    None => false,
                };
                runs.push(read_node(state, tracked, rows.is_some()));
                by_id.insert(env.node_id.to_owned(), runs.len() - 1);
                runs.len() - 1
            }
        };
        let node = &mut runs[at];
        let same_model = match (env.model, &node.model) {
            (None, _) => true,
            (Some(m), Some(have)) => m == have,
            (Some(_), None) => false,
        };
        if !node.usable || env.epoch != node.epoch || env.seq != node.seq + 1 || !same_model {
            break;
        }
        let seen = env.seen();
        if ttl_s.is_some_and(|ttl| seen - node.last_seen > ttl) {
            break; // expiry before the envelope: the reference path's
        }
        let events = if env.has_batch {
            parsed.events.len()
        } else {
            0
        };
        sids.clear();
        for ev in &parsed.events[..events] {
            if ev.kind == CLEARED {
                break;
            }
            let group = ev.group.unwrap_or(0);
            let medium = parsed.medium(ev).unwrap_or("GPU");
            match node
                .slots
                .iter()
                .find(|(g, m, _)| *g == group && m == medium)
            {
                Some(&(_, _, sid)) => sids.push(sid),
                None => break, // a new slot: the reference path makes it (and checks the cap)
            }
        }
        if sids.len() != events {
            break;
        }
        let ts_type = r.getattr(a_ts_type).and_then(|v| v.extract::<i64>());
        let record_ts = match ts_type {
            Ok(1) => match r.getattr(a_ts).and_then(|v| v.extract::<Option<i64>>()) {
                Ok(ms) => ms.map(|ms| ms as f64 / 1000.0),
                Err(_) => break,
            },
            Ok(_) => None,
            Err(_) => break,
        };
        let Ok(now) = clock.call0().and_then(|v| v.extract::<f64>()) else {
            break;
        };
        // `Ingest._clamp` and the clamp count: a time past the trusted bound is the reference's
        let trusted = record_ts.unwrap_or(now);
        if seen > trusted + max_skew_s || seen - trusted > max_skew_s {
            stop_now = Some(now);
            break;
        }
        // the common case: apply
        if last.is_some_and(|l| offset > l + 1) {
            holes += 1;
        }
        last = Some(offset);
        messages += 1;
        node.seq = env.seq;
        node.last_offset = offset;
        if seen > node.last_seen {
            node.last_seen = seen;
        }
        if env.dp_rank.is_some() {
            node.dp_rank = env.dp_rank;
        }
        if env.reports_load() {
            node.load = Some((env.running, env.waiting, env.kv_usage));
        }
        if env.spec_mismatches != 0 {
            node.spec_mismatches = env.spec_mismatches;
        }
        node.envelopes += 1;
        if events == 0 {
            node.heartbeats += 1;
        } else {
            node.events += events as u64;
            let st = &mut held
                .get_or_insert_with(|| (crate::pystore::write(&core.inner), Instant::now()))
                .0;
            for (j, (ev, &sid)) in parsed.events.iter().zip(&sids).enumerate() {
                let keys = &parsed.keys[ev.start..ev.end];
                if ev.kind == STORED {
                    match st.store(sid, keys, env.ts, cap) {
                        Ok((kept, refused)) => {
                            node.stored += kept as u64;
                            if refused > 0 {
                                node.refused.push((sid, refused));
                            }
                        }
                        Err(e) => error = Some(e),
                    }
                } else {
                    match st.remove(sid, keys) {
                        Ok(rm) => {
                            node.removed += rm.removed as u64;
                            node.unknown += rm.unknown as u64;
                            ended += rm.keys.len() as u64;
                            if let Some(rows) = rows.as_deref_mut() {
                                rows.ended(j, &rm.keys, &rm.ts);
                            }
                        }
                        Err(e) => error = Some(e),
                    }
                }
                if error.is_some() {
                    break;
                }
            }
        }
        if let Some(rows) = rows.as_deref_mut() {
            if error.is_none() {
                let at = anarows::At {
                    partition,
                    offset,
                    now,
                };
                rows.message(&env, &parsed, events, &node.kinds, at);
            } else {
                rows.discard(); // a bug in the store: the record is reported failed, not written
            }
        }
        let stream_seen = record_ts.unwrap_or(seen);
        if stream_seen > stream_ts {
            stream_ts = stream_seen;
        }
        ingest_ts = Some(now);
        published.push(if env.sent_ts != 0.0 {
            env.sent_ts
        } else {
            env.ts
        });
        i += 1;
        if error.is_some() {
            break;
        }
    }
    drop(held);
    let changed = runs
        .into_iter()
        .filter(|r| r.envelopes > 0)
        .map(|r| {
            (
                r.state,
                r.seq,
                r.last_seen,
                r.last_offset,
                (
                    r.envelopes,
                    r.heartbeats,
                    r.events,
                    r.stored,
                    r.removed,
                    r.unknown,
                ),
                r.dp_rank,
                r.load,
                r.spec_mismatches,
                r.refused,
            )
        })
        .collect();
    Ok((
        i,
        stop_now,
        last,
        stream_ts,
        ingest_ts,
        published,
        (messages, skipped, holes, ended),
        changed,
        error,
    ))
}
