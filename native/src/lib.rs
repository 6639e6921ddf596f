//! `kvpipe_native`: the router's hybrid hit search for every candidate node of a request in one
//! call. Python (`processors/router/native_hit.py`) owns the API, the errors and the layout rules
//! (`gpu/layout.py`, `gpu/hit.split_spec_groups`); this module keeps each node's spec model by
//! layout id and runs `hit::find_hit` on held-position sets.

pub mod batch;
pub mod envelope;
pub mod hit;
pub mod route;
pub mod snapshot;
pub mod store;
pub mod tokenhash;

mod ingestrun;

use hit::{find_hit, Held, Kind, Layout, SpecGroup};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBytes, PyDict, PyInt, PyList, PySet};

/// Spec models by layout id, registered once per layout, searched many times.
#[pyclass(module = "kvpipe_native")]
#[derive(Default)]
struct HitEngine {
    layouts: Vec<Layout>,
}

type SpecGroupArgs = (u8, i64, i64, bool, Vec<usize>);
/// Per query: the hit in tokens and per group its mask as `(start, end)`.
type QueryHit = (i64, Vec<(usize, usize)>);

#[pymethods]
impl HitEngine {
    #[new]
    fn new() -> Self {
        Self::default()
    }

    /// Register a layout: `groups` groups searched together; `spec_groups` in search order, each
    /// `(kind, block_size, param, eagle, member positions)` with kind 0 full attention, 1 sliding
    /// window (param: window), 2 Mamba in align mode, 3 chunked local (param: chunk size).
    /// Returns its id.
    fn add_layout(
        &mut self,
        groups: usize,
        spec_groups: Vec<SpecGroupArgs>,
        alignment: i64,
    ) -> PyResult<usize> {
        if alignment <= 0 {
            return Err(PyValueError::new_err(format!(
                "alignment must be positive, got {alignment}"
            )));
        }
        let mut sgs = Vec::with_capacity(spec_groups.len());
        for (kind, block_size, param, eagle, members) in spec_groups {
            let kind = match kind {
                0 => Kind::Full,
                1 => Kind::Sliding { window: param },
                2 => Kind::Mamba,
                3 => Kind::Chunked { chunk: param },
                _ => {
                    return Err(PyValueError::new_err(format!(
                        "unknown spec group kind {kind}"
                    )))
                }
            };
            if block_size <= 0 || matches!(kind, Kind::Chunked { chunk } if chunk <= 0) {
                return Err(PyValueError::new_err(
                    "block sizes and chunk sizes must be positive",
                ));
            }
            if members.is_empty() || members.iter().any(|&m| m >= groups) {
                return Err(PyValueError::new_err(format!(
                    "spec group members {members:?} must be non-empty positions below {groups}"
                )));
            }
            sgs.push(SpecGroup {
                kind,
                block_size,
                eagle,
                members,
            });
        }
        self.layouts.push(Layout {
            groups,
            spec_groups: sgs,
            alignment,
        });
        Ok(self.layouts.len() - 1)
    }

    fn __len__(&self) -> usize {
        self.layouts.len()
    }

    /// Search many (node, held sets) queries at once. Per query `q`: `layout_ids[q]`, the cap
    /// `caps[q]` (tokens), `num_hashed[q]` (tokens the lists cover), and for each of the layout's
    /// groups in order its list length (in `lens`, flat) and a set of held positions (in `sets`,
    /// flat). Returns per query `(hit_tokens, [(start, end) per group])`: group g's mask is
    /// `end` slots long with real blocks at `start..end` (groups outside every spec group: (0, 0)).
    fn search(
        &self,
        layout_ids: Vec<usize>,
        caps: Vec<i64>,
        num_hashed: Vec<i64>,
        lens: Vec<usize>,
        sets: &Bound<'_, PyList>,
    ) -> PyResult<Vec<QueryHit>> {
        let n = layout_ids.len();
        if caps.len() != n || num_hashed.len() != n {
            return Err(PyValueError::new_err(
                "layout_ids, caps and num_hashed differ in length",
            ));
        }
        let mut out = Vec::with_capacity(n);
        let mut at = 0usize; // position in the flat per-group inputs
        let mut words: Vec<Vec<u64>> = Vec::new();
        for q in 0..n {
            let layout = self.layouts.get(layout_ids[q]).ok_or_else(|| {
                PyValueError::new_err(format!("unknown layout id {}", layout_ids[q]))
            })?;
            if caps[q] < 0 {
                return Err(PyValueError::new_err(format!("negative cap {}", caps[q])));
            }
            let g = layout.groups;
            if at + g > lens.len() || at + g > sets.len() {
                return Err(PyValueError::new_err(
                    "fewer lists or sets than the layouts' groups",
                ));
            }
            // One bitset per spec group: the intersection of its members' sets over the shortest list.
            words.resize_with(layout.spec_groups.len(), Vec::new);
            let mut views = Vec::with_capacity(layout.spec_groups.len());
            for (k, sg) in layout.spec_groups.iter().enumerate() {
                let len = sg.members.iter().map(|&m| lens[at + m]).min().unwrap_or(0);
                let w = &mut words[k];
                w.clear();
                w.resize(len.div_ceil(64).max(1), 0);
                for (i, &m) in sg.members.iter().enumerate() {
                    let member = bitset(&sets.get_item(at + m)?, len)?;
                    if i == 0 {
                        w.copy_from_slice(&member);
                    } else {
                        w.iter_mut().zip(&member).for_each(|(a, b)| *a &= b);
                    }
                }
                views.push(len);
            }
            let held: Vec<Held> = words
                .iter()
                .zip(&views)
                .map(|(w, &len)| Held { bits: w, len })
                .collect();
            let (found, hit) = find_hit(layout, &held, caps[q], num_hashed[q]);
            let mut masks = vec![(0usize, 0usize); g];
            for (sg, f) in layout.spec_groups.iter().zip(found) {
                for &m in &sg.members {
                    masks[m] = (f.start, f.end);
                }
            }
            out.push((hit, masks));
            at += g;
        }
        Ok(out)
    }
}

/// A set (or any iterable) of non-negative ints as a bitset of `len` bits; larger ones are
/// dropped (the search never probes past the list).
fn bitset(obj: &Bound<'_, PyAny>, len: usize) -> PyResult<Vec<u64>> {
    let mut w = vec![0u64; len.div_ceil(64).max(1)];
    let mut put = |i: usize| {
        if i < len {
            w[i >> 6] |= 1 << (i & 63);
        }
    };
    if let Ok(set) = obj.downcast::<PySet>() {
        for item in set.iter() {
            put(item.extract::<usize>()?);
        }
    } else {
        for item in obj.try_iter()? {
            put(item?.extract::<usize>()?);
        }
    }
    Ok(w)
}

/// A vLLM block hash as the 64-bit key the store uses: an int masked to 64 bits, bytes by their
/// last 8 bytes big-endian (`processors/analytics/rows.py: hash_to_u64`, the same rule).
fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        let d = b.as_bytes();
        return Ok(d[d.len().saturating_sub(8)..]
            .iter()
            .fold(0u64, |v, &x| (v << 8) | x as u64));
    }
    if obj.is_instance_of::<PyInt>() {
        // SAFETY: obj is a live int; the call masks any int to 64 bits and fails only on non-ints.
        let v = unsafe { pyo3::ffi::PyLong_AsUnsignedLongLongMask(obj.as_ptr()) };
        if v == u64::MAX {
            if let Some(err) = PyErr::take(obj.py()) {
                return Err(err);
            }
        }
        return Ok(v);
    }
    Err(PyTypeError::new_err(format!(
        "a block hash must be int or bytes, got {}",
        obj.get_type().name()?
    )))
}

fn keys_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(list) = obj.downcast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(key_of(&item)?);
        }
        return Ok(out);
    }
    obj.try_iter()?.map(|item| key_of(&item?)).collect()
}

fn err(e: String) -> PyErr {
    PyValueError::new_err(e)
}

/// The index's per-block storage (`store::Store`) for `processors/index.py`: slots by id, blocks
/// by 64-bit key. Hash arguments are ints or bytes (vLLM's external forms), read with `key_of`.
#[pyclass(module = "kvpipe_native")]
#[derive(Default)]
struct IndexStore {
    inner: store::Store,
}

type Closed = (Vec<u64>, Vec<f64>);
type CohortRow = (usize, i64, i64, Vec<(usize, usize, u64)>);
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
        self.inner
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
        self.inner.store(slot, &keys, ts, cap).map_err(err)
    }

    /// Remove one copy of each hash. Returns (removed, unknown, ended keys, their store times).
    fn remove(
        &mut self,
        slot: u32,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<(usize, usize, Vec<u64>, Vec<f64>)> {
        let keys = keys_of(hashes)?;
        let r = self.inner.remove(slot, &keys).map_err(err)?;
        Ok((r.removed, r.unknown, r.keys, r.ts))
    }

    /// Drop the slot and every entry; returns them (keys, store times) sorted by (time, key).
    fn close(&mut self, slot: u32) -> PyResult<Closed> {
        self.inner.close(slot).map_err(err)
    }

    fn load(
        &mut self,
        slot: u32,
        keys: &Bound<'_, PyAny>,
        ts: Vec<f64>,
        extra: Vec<(u64, u32)>,
    ) -> PyResult<()> {
        let keys = keys_of(keys)?;
        self.inner.load(slot, &keys, &ts, &extra).map_err(err)
    }

    fn slot_len(&self, slot: u32) -> PyResult<usize> {
        self.inner.len(slot).map_err(err)
    }

    fn get(&self, slot: u32, hash: &Bound<'_, PyAny>) -> PyResult<Option<f64>> {
        self.inner.get(slot, key_of(hash)?).map_err(err)
    }

    /// Copies of `hash` the slot holds (0 when none).
    fn copies(&self, slot: u32, hash: &Bound<'_, PyAny>) -> PyResult<u32> {
        self.inner.copies(slot, key_of(hash)?).map_err(err)
    }

    fn items(&self, slot: u32) -> PyResult<Closed> {
        self.inner.items(slot).map_err(err)
    }

    fn dup_items(&self, slot: u32) -> PyResult<Vec<(u64, u32)>> {
        self.inner.dup_items(slot).map_err(err)
    }

    fn holders(&self, group: u64, hash: &Bound<'_, PyAny>) -> PyResult<Vec<u32>> {
        Ok(self.inner.holders(group, key_of(hash)?))
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
            self.inner.for_each_held(group, &keys, |sid, i| {
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
    /// [(gpu blocks, blocks used, media mask)] per group)`: bit `id` per medium id, and the bits
    /// `GPU_MEDIUM` and `UNKNOWN_MEDIUM`; the caller keeps medium ids below `MEDIA_BITS`.
    fn route_cohort(
        &self,
        engine: PyRef<'_, HitEngine>,
        lists: Vec<(u64, Bound<'_, PyAny>)>,
        members: PyRef<'_, MemberTable>,
        models: Vec<(usize, i64, i64)>,
        media_rank: Vec<u32>,
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
        let out = route::route_cohort(
            &self.inner,
            &engine.layouts,
            &lists,
            &members.inner,
            &models,
            &media_rank,
        )
        .map_err(err)?;
        Ok(out
            .into_iter()
            .map(|n| {
                let groups = n
                    .groups
                    .into_iter()
                    .map(|g| (g.gpu_blocks, g.blocks, g.media))
                    .collect();
                (n.member, n.gpu_tokens, n.any_tokens, groups)
            })
            .collect())
    }

    /// Live (block × holder) entries.
    fn entries(&self) -> usize {
        self.inner.entries()
    }

    /// Heap bytes of the storage (tables at their allocated size).
    fn memory_bytes(&self) -> usize {
        self.inner.memory_bytes()
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
        let pieces = snapshot::write_slot(&self.inner, slot, group, medium, &cuts).map_err(err)?;
        Ok(pieces.iter().map(|p| PyBytes::new(py, p)).collect())
    }

    /// Load one snapshot record (any bytes-like object) into slot `slot`; returns its entries.
    fn load_snapshot(&mut self, slot: u32, data: &Bound<'_, PyAny>) -> PyResult<usize> {
        with_buffer(data, |d| snapshot::load_slot(&mut self.inner, slot, d)).map_err(err)
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
            let (kept, refused) = self.inner.store(sid, keys, ts, cap).map_err(err)?;
            out.1 += kept;
            if refused > 0 {
                out.4.push((sid, refused));
            }
        } else {
            let r = self.inner.remove(sid, keys).map_err(err)?;
            out.2 += r.removed;
            out.3 += r.unknown;
            let m = r.keys.len();
            out.5.extend(r.keys);
            out.6.extend(r.ts);
            out.7.extend(std::iter::repeat(idx).take(m));
            out.8.extend(std::iter::repeat(sid).take(m));
        }
        Ok(())
    }
}

/// A cohort's member table for `IndexStore.route_cohort`: per node its owner key and the index of
/// its spec model among the cohort's models. Built once per cohort, reused across requests.
#[pyclass(module = "kvpipe_native", frozen)]
struct MemberTable {
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

/// A vLLM event batch read by `parse_batch` (`batch::parse`), kept native.
#[pyclass(module = "kvpipe_native", frozen)]
struct Batch {
    parsed: batch::Parsed,
}

#[pymethods]
impl Batch {
    fn __len__(&self) -> usize {
        self.parsed.events.len()
    }

    /// Event `i` as (kind 0 stored / 1 removed / 2 cleared, keys, group or None, medium or None).
    fn event(&self, i: usize) -> PyResult<(u8, Vec<u64>, Option<u64>, Option<String>)> {
        let ev = self
            .parsed
            .events
            .get(i)
            .ok_or_else(|| pyo3::exceptions::PyIndexError::new_err(format!("no event {i}")))?;
        let medium = self.parsed.medium(ev).map(str::to_owned);
        Ok((
            ev.kind,
            self.parsed.keys[ev.start..ev.end].to_vec(),
            ev.group,
            medium,
        ))
    }

    /// Block keys over all events (stores and removes).
    fn blocks(&self) -> usize {
        self.parsed.keys.len()
    }
}

/// The batch read from bytes, or None when the reference decoder must read it (anything outside
/// the strict subset `batch::parse` accepts).
#[pyfunction]
fn parse_batch(data: &[u8]) -> Option<Batch> {
    batch::parse(data).map(|parsed| Batch { parsed })
}

/// A snapshot record checked whole without keeping its entries: `(group, medium, entries)`, or
/// ValueError saying where it is broken (`snapshot::read_slot`).
#[pyfunction]
fn read_slot_head(data: &Bound<'_, PyAny>) -> PyResult<(i128, String, usize)> {
    let rec = with_buffer(data, |d| snapshot::read_slot(d, false)).map_err(err)?;
    Ok((rec.group, rec.medium, rec.entries))
}

/// Run `f` on the bytes of a bytes-like object (bytes, msgspec.Raw, memoryview) without a copy.
fn with_buffer<T>(
    obj: &Bound<'_, PyAny>,
    f: impl FnOnce(&[u8]) -> Result<T, String>,
) -> Result<T, String> {
    if let Ok(b) = obj.downcast::<PyBytes>() {
        return f(b.as_bytes());
    }
    let buf = pyo3::buffer::PyBuffer::<u8>::get(obj).map_err(|e| e.to_string())?;
    if !buf.is_c_contiguous() {
        return Err("a snapshot record must be a contiguous buffer".into());
    }
    // SAFETY: a C-contiguous buffer of `len_bytes` bytes, held (and so kept alive and unmoved)
    // by `buf` for the call; nothing here writes to it.
    let d = unsafe { std::slice::from_raw_parts(buf.buf_ptr() as *const u8, buf.len_bytes()) };
    f(d)
}

/// vLLM's default block hashes (`sha256`, no extra keys) of every full `unit` of `tokens`,
/// chained from `parent` (`tokenhash::sha256_chain`), in the published form: the digest's last 8
/// bytes as an int (`int_hashes`) or the digest. None when a unit falls outside what the native
/// side writes (the caller hashes in Python then).
#[pyfunction]
fn sha256_token_chain<'py>(
    py: Python<'py>,
    parent: &[u8],
    tokens: &Bound<'py, PyAny>,
    unit: usize,
    int_hashes: bool,
) -> PyResult<Option<Vec<PyObject>>> {
    let Ok(tokens) = tokens.extract::<Vec<i64>>() else {
        return Ok(None); // a token past 64 bits, or not an int: the reference decides
    };
    let Some(digests) = py.allow_threads(|| tokenhash::sha256_chain(parent, &tokens, unit)) else {
        return Ok(None);
    };
    Ok(Some(
        digests
            .iter()
            .map(|d| {
                if int_hashes {
                    let tail: [u8; 8] = d[24..].try_into().expect("32-byte digest");
                    let Ok(int) = u64::from_be_bytes(tail).into_pyobject(py); // infallible for u64
                    int.into_any().unbind()
                } else {
                    pyo3::types::PyBytes::new(py, d).into_any().unbind()
                }
            })
            .collect(),
    ))
}

#[pymodule]
fn kvpipe_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<HitEngine>()?;
    m.add_class::<IndexStore>()?;
    m.add_class::<Batch>()?;
    m.add_class::<MemberTable>()?;
    m.add_function(wrap_pyfunction!(parse_batch, m)?)?;
    m.add_function(wrap_pyfunction!(sha256_token_chain, m)?)?;
    m.add_function(wrap_pyfunction!(ingestrun::ingest_run, m)?)?;
    m.add_function(wrap_pyfunction!(read_slot_head, m)?)?;
    m.add("GPU_MEDIUM", route::GPU_BIT)?;
    m.add("UNKNOWN_MEDIUM", route::UNKNOWN_BIT)?;
    m.add("MEDIA_BITS", route::MEDIA_BITS)?;
    Ok(())
}
