//! `kvpipe_native`: kvpipe's native index core, one extension module.
//!
//! - `store` (Python face `pystore::IndexStore`): the routing index's blocks per slot and the
//!   inverted view per group, for `processors/core/slots.py`;
//! - `batch`, `envelope`, `ingestrun`: vLLM's msgpack batch and our envelope read from bytes, and a
//!   partition's run of common-case records applied in one call (`processors/core/ingestrun.py`);
//!   `anarows`: the analytics app's rows of such a run, with `captrack` (the re-store and CPU-tier tracker)
//!   and `chcols` (the tables' columns and their Native-format encoding, Python face `pychcols::NativeRows`);
//! - `snapshot`: a slot's snapshot record written and read as msgspec's bytes;
//! - `hit` (Python face `pyhit::HitEngine`): vLLM's hybrid hit on held positions, and `route`: every
//!   node of a cohort searched from the store in one call (`processors/router/cohort.py`);
//! - `captrack` (Python face `pycaptrack::PyCapacityCore`, `CapacityCore` in Python): the analytics
//!   app's capacity tracker, re-stores with their LRU stack distances and the CPU tier's copies
//!   (`processors/analytics/nativetrack.py`; the rules of `restores.py` and `cputier.py`);
//! - `tokenhash`: vLLM's default block hash chained over token ids (`processors/router/hashing.py`),
//!   and `hashmemo`: the digests of units nodes hold, remembered so a routed prefix is hashed once;
//! - `decide` (Python face `pyroute::NativeRouter`): the route decision of the common request without
//!   Python, from a plan `processors/router/native.py` exports (`ask`: what a body asks, `askread`
//!   its fast reader; `answer`: the
//!   JSON written); `serve` (Python face
//!   `pyserve::RouteServer`): the HTTP server that runs it on threads of its own
//!   (`processors/routing/routeserve.py`), passing everything else to the Python app;
//! - `chcols` (Python face `pychcols::NativeRows`): the analytics tables' rows as typed columns and
//!   their ClickHouse Native-format blocks, for the analytics sink's inserts
//!   (`processors/analytics/tables.py`).
//!
//! Python owns the API, the errors and the layout rules (`gpu/layout.py`, `gpu/hit.py`); each part
//! has a Python reference that a property test holds it equal to.

mod anarows;
mod answer;
mod ask;
mod askread;
pub mod batch;
pub mod captrack;
pub mod chcols;
pub mod decide;
pub mod envelope;
mod generations;
pub mod hashmemo;
pub mod hit;
mod idtext;
mod memberhit;
mod reach;
pub mod route;
pub mod serve;
pub mod snapshot;
pub mod store;
#[cfg(test)]
mod testrng;
pub mod tokenhash;
mod topk;

mod ingestrun;
mod pycaptrack;
mod pychcols;
mod pyhit;
mod pyroute;
mod pyserve;
mod pystore;

use pyhit::HitEngine;

/// mimalloc for the crate's own allocations: the route server allocates per request on several threads,
/// where glibc malloc took ~10 % of the server's time (perf, `kvpipe bench route-load`).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyAny, PyBytes, PyInt, PyList};
pub(crate) use pystore::IndexStore;
use pystore::MemberTable;

/// A vLLM block hash as the 64-bit key the store uses: an int masked to 64 bits, bytes by their
/// last 8 bytes big-endian (`processors/analytics/rows.py: hash_to_u64`, the same rule).
pub(crate) fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<u64> {
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

pub(crate) fn keys_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    if let Ok(list) = obj.downcast::<PyList>() {
        let mut out = Vec::with_capacity(list.len());
        for item in list.iter() {
            out.push(key_of(&item)?);
        }
        return Ok(out);
    }
    obj.try_iter()?.map(|item| key_of(&item?)).collect()
}

pub(crate) fn err(e: String) -> PyErr {
    PyValueError::new_err(e)
}

/// A vLLM event batch read by `parse_batch` (`batch::parse`), kept native.
#[pyclass(module = "kvpipe_native", frozen)]
pub(crate) struct Batch {
    pub(crate) parsed: batch::Parsed,
}

type BatchEvent = (u8, Vec<u64>, Option<u64>, Option<String>);

#[pymethods]
impl Batch {
    fn __len__(&self) -> usize {
        self.parsed.events.len()
    }

    /// Event `i` as (kind 0 stored / 1 removed / 2 cleared, keys, group or None, medium or None).
    fn event(&self, i: usize) -> PyResult<BatchEvent> {
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
pub(crate) fn with_buffer<T>(
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

/// The version of the surface this module gives Python (its classes, their methods, the functions,
/// their arguments and answers). Bump it with any change to that surface, together with
/// `API_VERSION` in `processors/core/native.py` and `native/kvpipe_native.pyi`: an extension built
/// from other sources then reads as "not native" there, with the reason, instead of failing mid-run.
pub const API_VERSION: u32 = 3;

#[pymodule]
fn kvpipe_native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("API_VERSION", API_VERSION)?;
    m.add_class::<HitEngine>()?;
    m.add_class::<IndexStore>()?;
    m.add_class::<Batch>()?;
    m.add_class::<MemberTable>()?;
    m.add_class::<pyroute::NativeRouter>()?;
    m.add_class::<pyserve::RouteServer>()?;
    m.add_class::<pychcols::NativeRows>()?;
    m.add_class::<pycaptrack::PyCapacityCore>()?;
    m.add_function(wrap_pyfunction!(parse_batch, m)?)?;
    m.add_function(wrap_pyfunction!(sha256_token_chain, m)?)?;
    m.add_function(wrap_pyfunction!(ingestrun::ingest_run, m)?)?;
    m.add_function(wrap_pyfunction!(anarows::analytics_run, m)?)?;
    m.add_function(wrap_pyfunction!(read_slot_head, m)?)?;
    m.add_function(wrap_pyfunction!(pyserve::serve_static, m)?)?;
    m.add("GPU_MEDIUM", route::GPU_BIT)?;
    m.add("UNKNOWN_MEDIUM", route::UNKNOWN_BIT)?;
    m.add("MEDIA_BITS", route::MEDIA_BITS)?;
    Ok(())
}
