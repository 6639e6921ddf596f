//! The capacity tracker's Python face (`kvpipe_native.CapacityCore`): the state is `captrack::CapacityCore`,
//! driven one message per call by processors/analytics/nativetrack.py (`NativeCapacityTracker`), and by
//! the crate's own callers through `core` (borrowed from a `PyRefMut<PyCapacityCore>`).
//!
//! The boundary is per message, never per hash: a call takes the message's events (vLLM's event
//! objects, read here as restores.py and cputier.py read them) and its ended lifetimes as the columns
//! of a `LifetimeColumns`, and returns the rows. Used from the event loop's thread only, like the
//! Python tracker: a plain class, the GIL its only lock.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyType};

use crate::captrack::{CapacityCore, Restored};
use crate::{err, key_of, keys_of};

/// (event index, group, medium, the event's block_size, block hash, removed_ts, end reason, stack distance,
/// held blocks): one re-store, `RestoreRow` less what the wrapper knows (node, epoch, kinds, coordinates)
type RestoreOut = (
    usize,
    i64,
    Py<PyAny>,
    Py<PyAny>,
    u64,
    f64,
    Py<PyString>,
    u64,
    u64,
);
/// (partition, keys oldest first, room, {hash: (removed_ts, reason)}, held, forgotten)
type SlotState = (i64, Vec<u64>, usize, Py<PyDict>, u64, u64);
/// (node, epoch, partition, {group: {hash: copies}})
type CpuNode = (String, i64, i64, Py<PyDict>);

#[pyclass(module = "kvpipe_native", name = "CapacityCore")]
pub(crate) struct PyCapacityCore {
    pub(crate) core: CapacityCore,
    stored_cls: Py<PyType>,
    removed_cls: Py<PyType>,
    /// Python strings of the core's reason ids, made once each
    reasons: Vec<Option<Py<PyString>>>,
    gpu: Py<PyString>,
    keys: Vec<u64>,
    out: Vec<Restored>,
}

/// A `LifetimeColumns`' columns the tracker reads (lists; the rows' `end_reason or reason`).
struct Ends<'py> {
    node: Bound<'py, PyList>,
    group: Bound<'py, PyList>,
    medium: Bound<'py, PyList>,
    hash: Bound<'py, PyList>,
    removed: Bound<'py, PyList>,
    reason: Bound<'py, PyList>,
    end_reason: Option<Bound<'py, PyList>>,
    /// each row's event index (-1: before the events)
    idx: Vec<i64>,
}

fn list<'py>(obj: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    match obj.downcast_into::<PyList>() {
        Ok(l) => Ok(l),
        Err(e) => {
            let obj = e.into_inner();
            PyList::new(obj.py(), obj.try_iter()?.collect::<PyResult<Vec<_>>>()?)
        }
    }
}

impl<'py> Ends<'py> {
    fn of(cols: &Bound<'py, PyAny>) -> PyResult<Self> {
        let py = cols.py();
        let col = |name: &Bound<'py, PyString>| list(cols.getattr(name)?);
        let end_reason = cols.getattr(pyo3::intern!(py, "end_reason"))?;
        let ends = Self {
            node: col(pyo3::intern!(py, "node_id"))?,
            group: col(pyo3::intern!(py, "group_idx"))?,
            medium: col(pyo3::intern!(py, "medium"))?,
            hash: col(pyo3::intern!(py, "block_hash"))?,
            removed: col(pyo3::intern!(py, "removed_ts"))?,
            reason: col(pyo3::intern!(py, "reason"))?,
            end_reason: if end_reason.is_none() {
                None
            } else {
                Some(list(end_reason)?)
            },
            idx: col(pyo3::intern!(py, "idx"))?.extract()?,
        };
        if ends.idx.len() != ends.hash.len() {
            return Err(err(format!(
                "ended lifetimes: {} event indexes for {} block hashes",
                ends.idx.len(),
                ends.hash.len()
            )));
        }
        Ok(ends)
    }

    fn len(&self) -> usize {
        self.idx.len()
    }

    /// The rows in event order: as given when `idx` never decreases (the index closes them so), else
    /// sorted by it, stably (restores.py `observe`).
    fn order(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len()).collect();
        if self.idx.windows(2).any(|w| w[0] > w[1]) {
            order.sort_by_key(|&i| self.idx[i]);
        }
        order
    }

    /// RestoreTracker._end for row `i`.
    fn end(&self, core: &mut CapacityCore, i: usize) -> PyResult<()> {
        let node = self.node.get_item(i)?;
        let medium = self.medium.get_item(i)?;
        let mut reason = match &self.end_reason {
            Some(e) => e.get_item(i)?,
            None => self.reason.get_item(i)?,
        };
        if self.end_reason.is_some() && !reason.is_truthy()? {
            reason = self.reason.get_item(i)?; // "" (not refined): the index's reason
        }
        core.end(
            node.downcast::<PyString>()?.to_str()?,
            self.group.get_item(i)?.extract()?,
            medium.downcast::<PyString>()?.to_str()?,
            key_of(&self.hash.get_item(i)?)?,
            self.removed.get_item(i)?.extract()?,
            reason.downcast::<PyString>()?.to_str()?,
        );
        Ok(())
    }
}

impl PyCapacityCore {
    fn reason_str(&mut self, py: Python<'_>, id: u32) -> Py<PyString> {
        let i = id as usize;
        if self.reasons.len() <= i {
            self.reasons.resize_with(i + 1, || None);
        }
        let core = &self.core;
        self.reasons[i]
            .get_or_insert_with(|| PyString::new(py, core.reason(id)).unbind())
            .clone_ref(py)
    }
}

#[pymethods]
impl PyCapacityCore {
    /// `stored_cls`, `removed_cls`: vLLM's BlockStored and BlockRemoved classes (kvpipe.schemas.events).
    #[new]
    fn new(
        py: Python<'_>,
        max_keys: usize,
        stored_cls: Py<PyType>,
        removed_cls: Py<PyType>,
    ) -> Self {
        Self {
            core: CapacityCore::new(max_keys),
            stored_cls,
            removed_cls,
            reasons: Vec::new(),
            gpu: PyString::new(py, "GPU").unbind(),
            keys: Vec::new(),
            out: Vec::new(),
        }
    }

    #[getter]
    fn max_keys(&self) -> usize {
        self.core.max_keys()
    }

    #[getter]
    fn restores(&self) -> u64 {
        self.core.restores()
    }

    /// Slots held.
    fn __len__(&self) -> usize {
        self.core.slot_count()
    }

    /// RestoreTracker.observe for one applied message of `node`: its events and the lifetimes it ended (a
    /// `LifetimeColumns`, or None when none), walked in event order; the re-stores as `RestoreOut` tuples.
    #[pyo3(signature = (node, partition, events, ends=None))]
    fn observe(
        &mut self,
        node: &str,
        partition: i64,
        events: &Bound<'_, PyList>,
        ends: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<RestoreOut>> {
        let py = events.py();
        let ends = ends.map(Ends::of).transpose()?;
        let order = ends.as_ref().map(Ends::order).unwrap_or_default();
        let (a_hashes, a_group, a_medium, a_size) = (
            pyo3::intern!(py, "block_hashes"),
            pyo3::intern!(py, "group_idx"),
            pyo3::intern!(py, "medium"),
            pyo3::intern!(py, "block_size"),
        );
        let stored_cls = self.stored_cls.bind(py).clone();
        let mut rows: Vec<RestoreOut> = Vec::new();
        let mut j = 0;
        for (idx, ev) in events.iter().enumerate() {
            if let Some(e) = &ends {
                while j < order.len() && e.idx[order[j]] <= idx as i64 {
                    e.end(&mut self.core, order[j])?;
                    j += 1;
                }
            }
            if !ev.get_type().is(&stored_cls) {
                continue;
            }
            let group = ev.getattr(a_group)?;
            let group: i64 = if group.is_none() { 0 } else { group.extract()? }; // `ev.group_idx or 0`
            let medium = ev.getattr(a_medium)?;
            let medium = if medium.is_truthy()? {
                medium
            } else {
                self.gpu.bind(py).clone().into_any()
            };
            let mut keys = std::mem::take(&mut self.keys);
            keys.clear();
            let hashes = ev.getattr(a_hashes)?;
            for h in list(hashes)?.iter() {
                keys.push(key_of(&h)?);
            }
            let mut out = std::mem::take(&mut self.out);
            out.clear();
            self.core.stored(
                node,
                group,
                medium.downcast::<PyString>()?.to_str()?,
                partition,
                &keys,
                &mut out,
            );
            if !out.is_empty() {
                let size = ev.getattr(a_size)?.unbind();
                for r in &out {
                    let reason = self.reason_str(py, r.reason);
                    let medium = medium.clone().unbind();
                    rows.push((
                        idx,
                        group,
                        medium,
                        size.clone_ref(py),
                        r.hash,
                        r.removed_ts,
                        reason,
                        r.distance,
                        r.held,
                    ));
                }
            }
            self.keys = keys;
            self.out = out;
        }
        if let Some(e) = &ends {
            for &i in &order[j..] {
                e.end(&mut self.core, i)?;
            }
        }
        Ok(rows)
    }

    /// RestoreTracker.end_all: lifetimes ended outside a message (a `LifetimeColumns`), in their order.
    fn end_all(&mut self, ends: &Bound<'_, PyAny>) -> PyResult<()> {
        let ends = Ends::of(ends)?;
        for i in 0..ends.len() {
            ends.end(&mut self.core, i)?;
        }
        Ok(())
    }

    /// CpuTier.observe: each event's `from_cpu_blocks` (a list of None when the partition's counts are
    /// unknown). `hashes`: each event's block hashes as u64, as the event rows carry them.
    fn cpu_observe<'py>(
        &mut self,
        node: &str,
        epoch: i64,
        partition: i64,
        events: &Bound<'py, PyList>,
        hashes: &Bound<'py, PyList>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = events.py();
        if !self.core.cpu_message(node, epoch, partition) {
            return PyList::new(py, (0..events.len()).map(|_| py.None()));
        }
        let (a_group, a_medium) = (pyo3::intern!(py, "group_idx"), pyo3::intern!(py, "medium"));
        let (stored_cls, removed_cls) = (self.stored_cls.bind(py), self.removed_cls.bind(py));
        let n = events.len().min(hashes.len()); // zip
        let mut out: Vec<u32> = Vec::with_capacity(n);
        for i in 0..n {
            let ev = events.get_item(i)?;
            let storing = ev.is_instance(stored_cls)?;
            if !storing && !ev.is_instance(removed_cls)? {
                out.push(0);
                continue;
            }
            let medium = ev.getattr(a_medium)?;
            let medium = match medium.downcast::<PyString>() {
                Ok(m) => m.to_str()?,
                Err(_) => "", // None: neither tier
            };
            let gpu = storing && medium == "GPU";
            if !gpu && medium != "CPU" {
                out.push(0);
                continue;
            }
            let group = ev.getattr(a_group)?;
            let group: i64 = if group.is_none() {
                -1
            } else {
                group.extract()?
            };
            let mut keys = std::mem::take(&mut self.keys);
            keys.clear();
            for h in list(hashes.get_item(i)?)?.iter() {
                keys.push(key_of(&h)?);
            }
            if gpu {
                out.push(self.core.cpu_gpu_store(node, group, &keys));
            } else {
                self.core
                    .cpu_add(node, group, &keys, if storing { 1 } else { -1 });
                out.push(0);
            }
            self.keys = keys;
        }
        PyList::new(py, out)
    }

    /// CapacityTracker.forget_partition: the partition's slots and CPU counts.
    fn forget_partition(&mut self, partition: i64) {
        self.core.forget_partition(partition);
    }

    /// RestoreTracker.forget_node: the node's slots.
    fn forget_node(&mut self, node: &str) {
        self.core.forget_node(node);
    }

    /// CpuTier.forget_partition: the partition's CPU counts only.
    fn cpu_forget_partition(&mut self, partition: i64) {
        self.core.cpu_forget_partition(partition);
    }

    /// One slot of RestoreTracker.install, replacing any of its key: its stack's `order()` and `room()`,
    /// `ended` ({hash: (removed_ts, reason)}), `held`, and its stack's `max_keys` (None: the tracker's).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (node, group, medium, partition, keys, room, ended, held, max_keys=None))]
    fn install_slot(
        &mut self,
        node: &str,
        group: i64,
        medium: &str,
        partition: i64,
        keys: &Bound<'_, PyAny>,
        room: usize,
        ended: &Bound<'_, PyDict>,
        held: u64,
        max_keys: Option<usize>,
    ) -> PyResult<()> {
        let keys = keys_of(keys)?;
        let mut ends: Vec<(u64, f64, String)> = Vec::with_capacity(ended.len());
        for (h, end) in ended.iter() {
            let (removed_ts, reason): (f64, String) = end.extract()?;
            ends.push((key_of(&h)?, removed_ts, reason));
        }
        let ends: Vec<(u64, f64, &str)> =
            ends.iter().map(|(h, t, r)| (*h, *t, r.as_str())).collect();
        self.core
            .install_slot(
                node, group, medium, partition, &keys, room, &ends, held, max_keys,
            )
            .map_err(err)
    }

    /// CpuTier.install: `nodes` ({node: NodeCopies}) replace the partition's counts, known again after.
    fn cpu_install(&mut self, partition: i64, nodes: &Bound<'_, PyDict>) -> PyResult<()> {
        let py = nodes.py();
        let (a_epoch, a_partition, a_groups) = (
            pyo3::intern!(py, "epoch"),
            pyo3::intern!(py, "partition"),
            pyo3::intern!(py, "groups"),
        );
        let mut read = Vec::with_capacity(nodes.len());
        for (node, copies) in nodes.iter() {
            let node: String = node.extract()?;
            let epoch: i64 = copies.getattr(a_epoch)?.extract()?;
            let part: i64 = copies.getattr(a_partition)?.extract()?;
            let groups = copies.getattr(a_groups)?;
            let groups = groups.downcast::<PyDict>()?;
            let mut counts = Vec::with_capacity(groups.len());
            for (g, held) in groups.iter() {
                let held = held.downcast_into::<PyDict>()?;
                let (mut hs, mut ns) = (
                    Vec::with_capacity(held.len()),
                    Vec::with_capacity(held.len()),
                );
                for (h, n) in held.iter() {
                    hs.push(key_of(&h)?);
                    ns.push(n.extract::<i64>()?);
                }
                counts.push((g.extract::<i64>()?, hs, ns));
            }
            read.push((node, epoch, part, counts));
        }
        // read whole before changing anything: a bad entry leaves the counts as they were
        self.core.cpu_forget_partition(partition);
        for (node, epoch, part, counts) in &read {
            self.core.cpu_install_node(node, *epoch, *part);
            for (g, hs, ns) in counts {
                self.core.cpu_install_counts(node, *g, hs, ns);
            }
        }
        self.core.cpu_known(partition);
        Ok(())
    }

    // -- introspection (tests, /stats, moving state back to Python) ----------------------------

    /// Hashes the slots' stacks remember.
    fn hashes(&self) -> usize {
        self.core.hashes()
    }

    /// Every slot's (node, group, medium).
    fn slot_keys(&self) -> Vec<(String, i64, String)> {
        self.core
            .slots()
            .map(|s| (s.node.to_owned(), s.group, s.medium.to_owned()))
            .collect()
    }

    /// One slot as `SlotState`, or None.
    fn slot_state(
        &self,
        py: Python<'_>,
        node: &str,
        group: i64,
        medium: &str,
    ) -> PyResult<Option<SlotState>> {
        let Some(s) = self.core.slot(node, group, medium) else {
            return Ok(None);
        };
        let ended = PyDict::new(py);
        for (h, removed_ts, reason) in s.ended() {
            ended.set_item(h, (removed_ts, reason))?;
        }
        Ok(Some((
            s.partition,
            s.order(),
            s.room(),
            ended.unbind(),
            s.held,
            s.forgotten(),
        )))
    }

    fn cpu_entries(&self) -> usize {
        self.core.cpu_entries()
    }

    /// Partitions whose CPU counts are unknown, sorted.
    fn cpu_unknown(&self) -> Vec<i64> {
        self.core.cpu_unknown()
    }

    /// Each node's CPU counts as `CpuNode` tuples.
    fn cpu_nodes(&self, py: Python<'_>) -> PyResult<Vec<CpuNode>> {
        let mut out = Vec::new();
        for (node, epoch, partition, groups) in self.core.cpu_nodes() {
            let by_group = PyDict::new(py);
            for (g, counts) in groups {
                let held = PyDict::new(py);
                for (h, n) in counts {
                    held.set_item(h, n)?;
                }
                by_group.set_item(g, held)?;
            }
            out.push((node.to_owned(), epoch, partition, by_group.unbind()));
        }
        Ok(out)
    }
}
