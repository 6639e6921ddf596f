//! The analytics rows' Python face (`kvpipe_native.NativeRows`): one table's rows as native columns
//! (`chcols::TableCols`), filled from the column lists `processors/analytics/tables.py` builds (or by
//! a native ingest run), and encoded as the Native block the sink's `raw_insert` sends.
//!
//! Threads: the analytics app makes rows on its event loop and a writer thread extends, encodes and
//! drops them, so the columns sit behind a mutex (the class is `frozen`: PyO3 keeps no borrow flag
//! that a second thread could trip). No thread ever waits for that mutex while holding the GIL: work
//! without Python objects locks inside `allow_threads`, and work that needs the GIL too (reading
//! values back) takes the lock only when it is free, else waits for it with the GIL released. A
//! holder that loses the GIL (a finalizer run by an allocation) therefore never deadlocks a waiter.

mod read;

use std::sync::{Mutex, MutexGuard, PoisonError, TryLockError};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyString};

use crate::chcols::{self, Col, Schema, TableCols};
use read::read_columns;

/// One analytics table's rows as native columns; see the module's notes on threads.
#[pyclass(module = "kvpipe_native", frozen)]
pub struct NativeRows {
    schema: &'static Schema,
    inner: Mutex<TableCols>,
}

fn lock(m: &Mutex<TableCols>) -> MutexGuard<'_, TableCols> {
    // a panic while held could only be a bug in chcols; the rows stay whole between calls, so go on
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl NativeRows {
    /// Rows a native caller built (a native ingest run), handed to Python as they are.
    pub fn from_cols(cols: TableCols) -> Self {
        NativeRows {
            schema: cols.schema(),
            inner: Mutex::new(cols),
        }
    }

    /// The columns, for a caller that does not hold the GIL (it blocks while another thread uses them).
    pub fn cols(&self) -> MutexGuard<'_, TableCols> {
        lock(&self.inner)
    }

    /// `f` on the columns, for a caller holding the GIL: waits for them with the GIL released.
    pub fn with_cols<R>(&self, py: Python<'_>, f: impl FnOnce(&mut TableCols) -> R) -> R {
        loop {
            match self.inner.try_lock() {
                Ok(mut g) => return f(&mut g),
                Err(TryLockError::Poisoned(p)) => return f(&mut p.into_inner()),
                Err(TryLockError::WouldBlock) => py.allow_threads(|| drop(lock(&self.inner))),
            }
        }
    }
}

#[pymethods]
impl NativeRows {
    #[new]
    fn new(table: &str) -> PyResult<Self> {
        let schema = chcols::schema(table).ok_or_else(|| {
            PyValueError::new_err(format!(
                "no analytics table {table:?}: NativeRows holds one of kv_events, kv_block_lifetimes, kv_restores, \
                 kv_node_load"
            ))
        })?;
        Ok(Self::from_cols(TableCols::new(schema)))
    }

    #[getter]
    fn table(&self) -> &'static str {
        self.schema.table
    }

    /// The table's columns in insert order (`extend_columns` and `columns` use this order).
    #[getter]
    fn column_names(&self) -> Vec<&'static str> {
        self.schema.columns.iter().map(|&(name, _)| name).collect()
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.with_cols(py, |c| c.len())
    }

    /// Add `other`'s rows (the same table's) after these.
    fn extend(&self, py: Python<'_>, other: &Bound<'_, NativeRows>) -> PyResult<()> {
        let other = other.get();
        if !std::ptr::eq(self.schema, other.schema) {
            return Err(PyValueError::new_err(format!(
                "cannot extend {} rows with {} rows",
                self.schema.table, other.schema.table
            )));
        }
        py.allow_threads(|| {
            if std::ptr::eq(self, other) {
                let mut g = lock(&self.inner);
                let copy = g.clone();
                g.append(&copy);
                return;
            }
            // two locks, always taken in address order: `a.extend(b)` beside `b.extend(a)` cannot deadlock
            let (mut mine, theirs) = if (self as *const Self) < (other as *const Self) {
                let mine = lock(&self.inner);
                (mine, lock(&other.inner))
            } else {
                let theirs = lock(&other.inner);
                (lock(&self.inner), theirs)
            };
            mine.append(&theirs);
        });
        Ok(())
    }

    /// Append rows given as Python column lists in `column_names` order, in the forms
    /// `processors/analytics/tables.py` inserts. All or nothing: a bad value appends no row and the
    /// error names its column and row.
    fn extend_columns(&self, py: Python<'_>, columns: &Bound<'_, PyAny>) -> PyResult<()> {
        let staged = read_columns(py, self.schema, columns)?;
        if staged.is_empty() {
            return Ok(());
        }
        py.allow_threads(|| {
            let mut g = lock(&self.inner);
            if g.is_empty() {
                *g = staged;
            } else {
                g.append(&staged);
            }
        });
        Ok(())
    }

    /// The rows back as Python column lists, in the forms `extend_columns` takes (UInt8 as int).
    fn columns<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyList>>> {
        self.with_cols(py, |c| {
            c.cols.iter().map(|col| column_to_list(py, col)).collect()
        })
    }

    /// Rows `[start, end)` as one Native-format block (`raw_insert(..., fmt="Native")`).
    fn encode<'py>(&self, py: Python<'py>, start: i64, end: i64) -> PyResult<Bound<'py, PyBytes>> {
        let out = py
            .allow_threads(|| {
                let g = lock(&self.inner);
                let (s, e) = (usize::try_from(start), usize::try_from(end));
                match (s, e) {
                    (Ok(s), Ok(e)) if s <= e && e <= g.len() => {
                        let mut out = Vec::new();
                        g.encode(s, e, &mut out);
                        Ok(out)
                    }
                    _ => Err(format!(
                        "{}: no rows [{start}, {end}) in {} rows",
                        self.schema.table,
                        g.len()
                    )),
                }
            })
            .map_err(PyValueError::new_err)?;
        PyBytes::new_with(py, out.len(), |b| {
            py.allow_threads(|| b.copy_from_slice(&out));
            Ok(())
        })
    }

    /// Forget the first `n` rows (those inserted).
    fn drop_front(&self, py: Python<'_>, n: i64) -> PyResult<()> {
        py.allow_threads(|| {
            let mut g = lock(&self.inner);
            match usize::try_from(n) {
                Ok(n) if n <= g.len() => {
                    g.drop_front(n);
                    Ok(())
                }
                _ => Err(format!(
                    "{}: cannot drop {n} of {} rows",
                    self.schema.table,
                    g.len()
                )),
            }
        })
        .map_err(PyValueError::new_err)
    }
}

// -- Python columns out --------------------------------------------------------------------------

fn column_to_list<'py>(py: Python<'py>, col: &Col) -> PyResult<Bound<'py, PyList>> {
    match col {
        Col::I64(v) => PyList::new(py, v),
        Col::U8(v) => PyList::new(py, v),
        Col::U16(v) => PyList::new(py, v),
        Col::U32(v) => PyList::new(py, v),
        Col::U64(v) => PyList::new(py, v),
        Col::I32(v) => PyList::new(py, v),
        Col::F64(v) => PyList::new(py, v),
        Col::Str { bytes, offs } => PyList::new(
            py,
            offs.windows(2)
                .map(|w| std::str::from_utf8(&bytes[w[0]..w[1]]).expect("pushed as str")),
        ),
        Col::Lc { ids, dict } => {
            // one str object per distinct value, shared by its rows
            let mut made: Vec<Option<Bound<'py, PyString>>> = vec![None; dict.strs.len()];
            let items = ids.iter().map(|&id| {
                made[id as usize]
                    .get_or_insert_with(|| PyString::new(py, &dict.strs[id as usize]))
                    .clone()
            });
            PyList::new(py, items.collect::<Vec<_>>())
        }
        Col::Arr { values, offs } => {
            let rows = offs
                .windows(2)
                .map(|w| PyList::new(py, &values[w[0]..w[1]]));
            PyList::new(py, rows.collect::<PyResult<Vec<_>>>()?)
        }
        Col::OptU32 { nulls, values } => PyList::new(
            py,
            nulls
                .iter()
                .zip(values)
                .map(|(&n, &v)| (n == 0).then_some(v)),
        ),
        Col::OptF64 { nulls, values } => PyList::new(
            py,
            nulls
                .iter()
                .zip(values)
                .map(|(&n, &v)| (n == 0).then_some(v)),
        ),
    }
}
