//! The hit search engine's Python face (`kvpipe_native.HitEngine`): spec models registered once
//! per layout id, then every candidate node of a request searched in one call (`hit::find_hit`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyList, PySet};

use crate::hit::{find_hit, rules, Held, Kind, Layout, SpecGroup};

/// Spec models by layout id, registered once per layout, searched many times.
#[pyclass(module = "kvpipe_native")]
#[derive(Default)]
pub(crate) struct HitEngine {
    pub(crate) layouts: Vec<Layout>,
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

    /// The hit rules this engine implements, `{name: code}` (native/src/hit_rules.toml, the one
    /// definition): `add_layout` takes the codes, Python names the rules (`gpu/kinds.py`).
    #[classattr]
    #[pyo3(name = "RULES")]
    fn rules() -> Vec<(&'static str, u8)> {
        rules::RULES.to_vec()
    }

    /// Register a layout: `groups` groups searched together; `spec_groups` in search order, each
    /// `(rule, block_size, param, eagle, member positions)` with `rule` a code of `RULES` and
    /// `param` its one number (sliding window: the window; chunked local: the chunk size; else
    /// ignored). Returns its id.
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
        for (code, block_size, param, eagle, members) in spec_groups {
            let kind = Kind::from_code(code, param).ok_or_else(|| {
                PyValueError::new_err(format!(
                    "unknown hit rule code {code} (known: {:?})",
                    rules::RULES
                ))
            })?;
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
