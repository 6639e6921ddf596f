//! The index's block store's Python face (`kvpipe_native.IndexStore`, `kvpipe_native.MemberTable`):
//! `processors/core/slots.py` drives it; the storage itself is `store::Store`.

use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBytes, PyDict, PyList, PySet};

use crate::pyhit::HitEngine;
use crate::{batch, err, key_of, keys_of, route, snapshot, store, with_buffer, Batch};

/// The index's per-block storage (`store::Store`) for `processors/core/index.py`: slots by id, blocks
/// by 64-bit key. Hash arguments are ints or bytes (vLLM's external forms), read with `key_of`.
///
/// The storage sits behind a reader-writer lock shared with the native route server's threads
/// (`decide.rs`), which read it without the GIL while ingest writes; every method here takes the
/// lock for its own call only, so a writer never waits behind more than one route's read.
#[pyclass(module = "kvpipe_native")]
#[derive(Default)]
pub(crate) struct IndexStore {
    pub(crate) inner: Shared,
}

/// The store as the route server shares it.
pub(crate) type Shared = Arc<RwLock<store::Store>>;

pub(crate) fn read(s: &Shared) -> RwLockReadGuard<'_, store::Store> {
    s.read().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn write(s: &Shared) -> RwLockWriteGuard<'_, store::Store> {
    s.write().unwrap_or_else(|e| e.into_inner())
}

type Closed = (Vec<u64>, Vec<f64>);
type Prefixes = Option<(Vec<(i64, usize)>, usize)>;
type CohortRow = (usize, i64, i64, Vec<(usize, usize, u64, Prefixes)>);
type Applied = (
    usize,
    usize,
    usize,
    usize,
    Vec<(u32, usize)>,
    Vec<u64>,
    Vec<f64>,
    Vec<usize>,
    Vec<u32>,
);

#[pymethods]
impl IndexStore {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// A new slot of `group`, owned by node `owner` (a key the caller assigns), on medium id
    /// `medium` (`gpu`: the GPU medium); `route_cohort` reports per owner and medium.
    #[pyo3(signature = (group, owner=0, medium=0, gpu=true))]
    fn new_slot(&mut self, group: u64, owner: u32, medium: u16, gpu: bool) -> PyResult<u32> {
        write(&self.inner)
            .new_slot(group, store::SlotMeta { owner, medium, gpu })
            .map_err(err)
    }

    /// Store `hashes` at `ts` (cap: blocks per slot, None for none). Returns (kept, refused).
    #[pyo3(signature = (slot, hashes, ts, cap=None))]
    fn store(
        &mut self,
        slot: u32,
        hashes: &Bound<'_, PyAny>,
        ts: f64,
        cap: Option<usize>,
    ) -> PyResult<(usize, usize)> {
        let keys = keys_of(hashes)?;
        write(&self.inner).store(slot, &keys, ts, cap).map_err(err)
    }

    /// Remove one copy of each hash. Returns (removed, unknown, ended keys, their store times).
    fn remove(
        &mut self,
        slot: u32,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize, Vec<u64>, Vec<f64>)> {
        let keys = keys_of(hashes)?;
        let r = write(&self.inner).remove(slot, &keys).map_err(err)?;
        Ok((r.removed, r.unknown, r.keys, r.ts))
    }

    /// Drop the slot and every entry; returns them (keys, store times) sorted by (time, key).
    fn close(&mut self, slot: u32) -> PyResult<Closed> {
        write(&self.inner).close(slot).map_err(err)
    }

    fn load(
        &mut self,
        slot: u32,
        keys: &Bound<'_, PyAny>,
        ts: Vec<f64>,
        extra: Vec<(u64, u32)>,
    ) -> PyResult<()> {
        let keys = keys_of(keys)?;
        write(&self.inner)
            .load(slot, &keys, &ts, &extra)
            .map_err(err)
    }

    fn slot_len(&self, slot: u32) -> PyResult<usize> {
        read(&self.inner).len(slot).map_err(err)
    }

    fn get(&self, slot: u32, hash: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
        read(&self.inner).get(slot, key_of(hash)?).map_err(err)
    }

    /// Copies of `hash` the slot holds (0 when none).
    fn copies(&self, slot: u32, hash: &Bound<'_, PyAny>) -> PyResult<u32> {
        read(&self.inner).copies(slot, key_of(hash)?).map_err(err)
    }

    fn items(&self, slot: u32) -> PyResult<Closed> {
        read(&self.inner).items(slot).map_err(err)
    }

    fn dup_items(&self, slot: u32) -> PyResult<Vec<(u64, u32)>> {
        read(&self.inner).dup_items(slot).map_err(err)
    }

    fn holders(&self, group: u64, hash: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        Ok(read(&self.inner).holders(group, key_of(hash)?))
    }

    /// Per slot holding any of the request's blocks, the set of positions it holds: `lists` is
    /// `[(group, hashes)]`, one lookup per (group, hash).
    fn held<'py>(
        &self,
        py: Python<'py>,
        lists: Vec<(u64, Bound<'py, PyAny>)>,
    ) -> PyResult<Vec<(u32, Bound<'py, PySet>)>> {
        let mut by_slot: Vec<(u32, Vec<usize>)> = Vec::new();
        let mut at: std::collections::HashMap<u32, usize> = std::collections::HashMap::new();
        for (group, hashes) in lists {
            let keys = keys_of(&hashes)?;
            read(&self.inner).for_each_held(group, &keys, |sid, i| {
                let k = *at.entry(sid).or_insert_with(|| {
                    by_slot.push((sid, Vec::new()));
                    by_slot.len() - 1
                });
                by_slot[k].1.push(i);
            });
        }
        by_slot
            .into_iter()
            .map(|(sid, pos)| Ok((sid, PySet::new(py, &pos)?)))
            .collect()
    }

    /// Apply `events[start..]` (BlockStored / BlockRemoved objects) of one node whose slots are
    /// `slots` ((group, medium) → object with `sid`), stopping at the first event this cannot
    /// apply alone: one of another class (a clear), or one whose (group, medium) has no slot yet.
    /// Returns (stopped at, stored, removed, unknown, [(slot, refused)], and the ended entries
    /// as columns: keys, store times, event indexes, slots).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (events, start, slots, ts, cap, stored_cls, removed_cls))]
    fn apply_events(
        &mut self,
        events: &Bound<'_, PyList>,
        start: usize,
        slots: &Bound<'_, PyDict>,
        ts: f64,
        cap: Option<usize>,
        stored_cls: &Bound<'_, PyAny>,
        removed_cls: &Bound<'_, PyAny>,
    ) -> PyResult<Applied> {
        let py = events.py();
        let gpu = pyo3::types::PyString::new(py, "GPU");
        let zero = 0i64.into_pyobject(py)?;
        let (a_hashes, a_group, a_medium, a_sid) = (
            pyo3::intern!(py, "block_hashes"),
            pyo3::intern!(py, "group_idx"),
            pyo3::intern!(py, "medium"),
            pyo3::intern!(py, "sid"),
        );
        let mut out = Applied::default();
        let n = events.len();
        let mut i = start;
        let mut keys: Vec<u64> = Vec::new();
        while i < n {
            let ev = events.get_item(i)?;
            let cls = ev.get_type();
            let storing = cls.is(stored_cls);
            if !storing && !cls.is(removed_cls) {
                break;
            }
            let group = ev.getattr(a_group)?;
            let group = if group.is_none() {
                zero.clone().into_any()
            } else {
                group
            };
            let medium = ev.getattr(a_medium)?;
            let medium = if medium.is_none() {
                gpu.clone().into_any()
            } else {
                medium
            };
            let key = pyo3::types::PyTuple::new(py, [group, medium])?;
            let Some(slot) = slots.get_item(key)? else {
                break;
            };
            let sid: u32 = slot.getattr(a_sid)?.extract()?;
            keys.clear();
            let hashes = ev.getattr(a_hashes)?;
            let list = hashes.downcast::<PyList>()?;
            keys.reserve(list.len());
            for h in list.iter() {
                keys.push(key_of(&h)?);
            }
            self.apply_keys(sid, storing, &keys, i, ts, cap, &mut out)?;
            i += 1;
        }
        out.0 = i;
        Ok(out)
    }

    /// `apply_events` for a batch read by `parse_batch`: the same stops (a clear, a (group,
    /// medium) with no slot yet: `batch_event(i)` gives that event to the per-event path).
    #[pyo3(signature = (batch, start, slots, ts, cap))]
    fn apply_batch(
        &mut self,
        batch: &Batch,
        start: usize,
        slots: &Bound<'_, PyDict>,
        ts: f64,
        cap: Option<usize>,
    ) -> PyResult<Applied> {
        let py = slots.py();
        let a_sid = pyo3::intern!(py, "sid");
        let parsed = &batch.parsed;
        let mut out = Applied::default();
        // (group, medium) → slot id, resolved once per call
        let mut known: Vec<(Option<u64>, u16, u32)> = Vec::new();
        let mut i = start;
        while i < parsed.events.len() {
            let ev = &parsed.events[i];
            if ev.kind == batch::CLEARED {
                break;
            }
            let sid = match known
                .iter()
                .find(|(g, m, _)| *g == ev.group && *m == ev.medium)
            {
                Some(&(_, _, sid)) => sid,
                None => {
                    let medium = parsed.medium(ev).unwrap_or("GPU");
                    let key = (ev.group.unwrap_or(0), medium).into_pyobject(py)?;
                    let Some(slot) = slots.get_item(key)? else {
                        break;
                    };
                    let sid: u32 = slot.getattr(a_sid)?.extract()?;
                    known.push((ev.group, ev.medium, sid));
                    sid
                }
            };
            let keys = &parsed.keys[ev.start..ev.end];
            self.apply_keys(sid, ev.kind == batch::STORED, keys, i, ts, cap, &mut out)?;
            i += 1;
        }
        out.0 = i;
        Ok(out)
    }

    /// One cohort's hits for every member node holding any requested block (`route::route_cohort`):
    /// `lists` `[(group, hashes)]` in the layouts' group order, `members` the cohort's table,
    /// `models` per spec model `(layout id in engine, cap, tokens hashed)`, `media_rank[medium id]`
    /// the order of non-GPU media. Returns per such node `(member index, gpu tokens, any tokens,
    /// [(gpu blocks, blocks used, media mask, prefixes)] per group)`: bit `id` per medium id, and
    /// the bits `GPU_MEDIUM` and `UNKNOWN_MEDIUM` (the caller keeps medium ids below `MEDIA_BITS`);
    /// `prefixes` None, or with `prefixes=True` `([(medium id, or -1 for GPU, blocks)], blocks on
    /// any medium)`: the longest held prefixes.
    #[pyo3(signature = (engine, lists, members, models, media_rank, prefixes=false))]
    fn route_cohort(
        &self,
        engine: PyRef<'_, HitEngine>,
        lists: Vec<(u64, Bound<'_, PyAny>)>,
        members: PyRef<'_, MemberTable>,
        models: Vec<(usize, i64, i64)>,
        media_rank: Vec<u32>,
        prefixes: bool,
    ) -> PyResult<Vec<CohortRow>> {
        let lists = lists
            .into_iter()
            .map(|(g, hashes)| Ok((g, keys_of(&hashes)?)))
            .collect::<PyResult<Vec<_>>>()?;
        if models.iter().any(|m| m.1 < 0) {
            return Err(PyValueError::new_err("negative cap"));
        }
        let models: Vec<route::ModelArgs> = models
            .into_iter()
            .map(|(layout, cap, num_hashed)| route::ModelArgs {
                layout,
                cap,
                num_hashed,
            })
            .collect();
        let lists: Vec<(u64, &[u64])> = lists.iter().map(|(g, k)| (*g, &k[..])).collect();
        let out = route::route_cohort(
            &read(&self.inner),
            &engine.layouts,
            &lists,
            &members.inner,
            &models,
            &media_rank,
            prefixes,
            None,
        )
        .map_err(err)?;
        Ok(out
            .nodes
            .into_iter()
            .map(|n| {
                let groups = n
                    .groups
                    .into_iter()
                    .map(|g| (g.gpu_blocks, g.blocks, g.media, g.prefix))
                    .collect();
                (n.member, n.gpu_tokens, n.any_tokens, groups)
            })
            .collect())
    }

    /// Live (block × holder) entries.
    fn entries(&self) -> usize {
        read(&self.inner).entries()
    }

    /// Heap bytes of the storage (tables at their allocated size).
    fn memory_bytes(&self) -> usize {
        read(&self.inner).memory_bytes()
    }

    /// Slot `slot`'s snapshot records (`snapshot::write_slot`): one msgpack `SlotSnap` per piece,
    /// piece `i` holding its entries `cuts[i]..cuts[i + 1]` in (store time, key) order.
    fn snapshot_slot<'py>(
        &self,
        py: Python<'py>,
        slot: u32,
        group: u64,
        medium: &str,
        cuts: Vec<usize>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let pieces =
            snapshot::write_slot(&read(&self.inner), slot, group, medium, &cuts).map_err(err)?;
        Ok(pieces.iter().map(|p| PyBytes::new(py, p)).collect())
    }

    /// Load one snapshot record (any bytes-like object) into slot `slot`; returns its entries.
    fn load_snapshot(&mut self, slot: u32, data: &Bound<'_, PyAny>) -> PyResult<usize> {
        with_buffer(data, |d| {
            snapshot::load_slot(&mut write(&self.inner), slot, d)
        })
        .map_err(err)
    }
}

impl IndexStore {
    #[allow(clippy::too_many_arguments)]
    fn apply_keys(
        &mut self,
        sid: u32,
        storing: bool,
        keys: &[u64],
        idx: usize,
        ts: f64,
        cap: Option<usize>,
        out: &mut Applied,
    ) -> PyResult<()> {
        if storing {
            let (kept, refused) = write(&self.inner).store(sid, keys, ts, cap).map_err(err)?;
            out.1 += kept;
            if refused > 0 {
                out.4.push((sid, refused));
            }
        } else {
            let r = write(&self.inner).remove(sid, keys).map_err(err)?;
            out.2 += r.removed;
            out.3 += r.unknown;
            let m = r.keys.len();
            out.5.extend(r.keys);
            out.6.extend(r.ts);
            out.7.extend(std::iter::repeat_n(idx, m));
            out.8.extend(std::iter::repeat_n(sid, m));
        }
        Ok(())
    }
}

/// A cohort's member table for `IndexStore.route_cohort`: per node its owner key and the index of
/// its spec model among the cohort's models. Built once per cohort, reused across requests.
#[pyclass(module = "kvpipe_native", frozen)]
pub(crate) struct MemberTable {
    inner: route::Members,
}

#[pymethods]
impl MemberTable {
    #[new]
    fn new(owners: Vec<u32>, models: Vec<u16>) -> PyResult<Self> {
        Ok(MemberTable {
            inner: route::Members::new(owners, models).map_err(err)?,
        })
    }

    fn __len__(&self) -> usize {
        self.inner.owners.len()
    }
}
