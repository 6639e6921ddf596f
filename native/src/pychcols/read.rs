//! Python column lists read into a fresh `TableCols` (`NativeRows.extend_columns`), value by value with
//! the type and range each column declares; a bad value is reported with its column and row.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyFloat, PyList, PyString};
use pyo3::Borrowed;
use pyo3::PyTypeInfo;

use crate::chcols::{Col, Schema, TableCols};

/// Columns read whole into a fresh `TableCols` (so a bad value leaves the caller's rows untouched).
pub(super) fn read_columns(
    py: Python<'_>,
    schema: &'static Schema,
    columns: &Bound<'_, PyAny>,
) -> PyResult<TableCols> {
    let given: Vec<Bound<'_, PyAny>> = columns.try_iter()?.collect::<PyResult<_>>()?;
    let names = || {
        schema
            .columns
            .iter()
            .map(|c| c.0)
            .collect::<Vec<_>>()
            .join(", ")
    };
    if given.len() != schema.columns.len() {
        return Err(PyValueError::new_err(format!(
            "{} takes {} columns ({}), got {}",
            schema.table,
            schema.columns.len(),
            names(),
            given.len()
        )));
    }
    let mut lists = Vec::with_capacity(given.len());
    for col in given {
        lists.push(match col.downcast_into::<PyList>() {
            Ok(list) => list,
            Err(e) => PyList::type_object(py)
                .call1((e.into_inner(),))?
                .downcast_into::<PyList>()?,
        });
    }
    let rows = lists[0].len();
    let mut cols = TableCols::new(schema);
    for (c, list) in lists.iter().enumerate() {
        if list.len() != rows {
            return Err(PyValueError::new_err(format!(
                "{}: column {} has {} rows, column {} has {rows}",
                schema.table,
                schema.columns[c].0,
                list.len(),
                schema.columns[0].0
            )));
        }
        fill(&mut cols.cols[c], list).map_err(|(row, wrong_type, expected)| {
            let item = list.get_item(row).ok();
            let shown = item
                .as_ref()
                .and_then(|i| i.repr().ok())
                .map(|r| r.to_string_lossy().chars().take(80).collect::<String>())
                .unwrap_or_default();
            let type_name = item
                .and_then(|i| i.get_type().name().ok().map(|n| n.to_string()))
                .unwrap_or_default();
            let msg = format!(
                "{}.{} row {row}: expected {expected}, got {shown} ({type_name})",
                schema.table, schema.columns[c].0
            );
            if wrong_type {
                PyTypeError::new_err(msg)
            } else {
                PyValueError::new_err(msg)
            }
        })?;
    }
    cols.set_rows(rows);
    Ok(cols)
}

/// A bad value: (row, whether its type is wrong rather than its value, what was expected).
type Bad = (usize, bool, &'static str);

/// Item `row` of `list`, borrowed (the list holds it: no reference count traffic per value, which
/// was a third of the time under the stable ABI). The readers below run no Python code, so the list
/// cannot change under them, except `list(...)` of an array row given as another sequence: a list
/// that shrank meanwhile reads as a bad row, never as freed memory.
#[inline]
fn item<'a, 'py>(
    list: &'a Bound<'py, PyList>,
    row: usize,
) -> Result<Borrowed<'a, 'py, PyAny>, Bad> {
    // SAFETY: `list` is a live list; PyList_GetItem checks the index (NULL and IndexError past the end).
    let p = unsafe { ffi::PyList_GetItem(list.as_ptr(), row as ffi::Py_ssize_t) };
    // SAFETY: p is NULL or a reference the list holds while we hold the GIL and run no Python code.
    unsafe { Borrowed::from_ptr_or_opt(list.py(), p) }.ok_or_else(|| {
        PyErr::take(list.py());
        (row, true, "a column that does not change while it is read")
    })
}

#[inline]
fn is_int(item: &Bound<'_, PyAny>) -> bool {
    // SAFETY: item is a live object; the exact check is one compare, the subclass check (bool) a call.
    unsafe { ffi::PyLong_CheckExact(item.as_ptr()) != 0 || ffi::PyLong_Check(item.as_ptr()) != 0 }
}

/// An int as u64 (`Err(true)`: not an int; `Err(false)`: out of range).
#[inline]
fn as_u64(item: &Bound<'_, PyAny>) -> Result<u64, bool> {
    if !is_int(item) {
        return Err(true);
    }
    // SAFETY: item is an int; on failure the call sets an error, taken (cleared) here. Where `long` is
    // 64 bits, PyLong_AsUnsignedLong: CPython's `long long` form goes through a byte-array copy for
    // any value past 30 bits (block hashes), which cost more than the rest of reading the int.
    let v = unsafe {
        if std::mem::size_of::<std::os::raw::c_ulong>() == 8 {
            ffi::PyLong_AsUnsignedLong(item.as_ptr()) as u64
        } else {
            ffi::PyLong_AsUnsignedLongLong(item.as_ptr())
        }
    };
    if v == u64::MAX && PyErr::take(item.py()).is_some() {
        return Err(false);
    }
    Ok(v)
}

#[inline]
fn as_i64(item: &Bound<'_, PyAny>) -> Result<i64, bool> {
    if !is_int(item) {
        return Err(true);
    }
    // SAFETY: as in `as_u64` (an int: no `__index__` is called).
    let v = unsafe {
        if std::mem::size_of::<std::os::raw::c_long>() == 8 {
            ffi::PyLong_AsLong(item.as_ptr()) as i64
        } else {
            ffi::PyLong_AsLongLong(item.as_ptr())
        }
    };
    if v == -1 && PyErr::take(item.py()).is_some() {
        return Err(false);
    }
    Ok(v)
}

#[inline]
fn as_f64(item: &Bound<'_, PyAny>) -> Result<f64, bool> {
    if let Ok(f) = item.downcast::<PyFloat>() {
        return Ok(f.value());
    }
    if !is_int(item) {
        return Err(true);
    }
    item.extract::<f64>().map_err(|_| false)
}

/// `as_u64` narrowed to `T`.
#[inline]
fn as_uint<T: TryFrom<u64>>(item: &Bound<'_, PyAny>) -> Result<T, bool> {
    as_u64(item).and_then(|v| T::try_from(v).map_err(|_| false))
}

fn as_i32(item: &Bound<'_, PyAny>) -> Result<i32, bool> {
    as_i64(item).and_then(|v| i32::try_from(v).map_err(|_| false))
}

fn fill(col: &mut Col, list: &Bound<'_, PyList>) -> Result<(), Bad> {
    let rows = list.len();
    // Columns repeat one object over a message's rows (`[env.epoch] * n`, small ints, interned strs):
    // a row holding the previous row's object takes its value without reading it again.
    macro_rules! each {
        ($vec:expr, $expected:literal, $read:expr) => {{
            $vec.reserve(rows);
            let mut last = (std::ptr::null_mut(), Default::default());
            for row in 0..rows {
                let item = item(list, row)?;
                if item.as_ptr() != last.0 {
                    last = (
                        item.as_ptr(),
                        $read(&item).map_err(|t| (row, t, $expected))?,
                    );
                }
                $vec.push(last.1);
            }
        }};
    }
    match col {
        Col::I64(v) => each!(v, "an int (microseconds)", as_i64),
        Col::U8(v) => each!(v, "a bool or an int in UInt8 range", as_uint::<u8>),
        Col::U16(v) => each!(v, "an int in UInt16 range", as_uint::<u16>),
        Col::U32(v) => each!(v, "an int in UInt32 range", as_uint::<u32>),
        Col::U64(v) => each!(v, "an int in UInt64 range", as_u64),
        Col::I32(v) => each!(v, "an int in Int32 range", as_i32),
        Col::F64(v) => each!(v, "a float", as_f64),
        Col::Str { bytes, offs } => {
            offs.reserve(rows);
            for row in 0..rows {
                let item = item(list, row)?;
                let s = as_str(&item).map_err(|t| (row, t, "a str"))?;
                bytes.extend_from_slice(s.as_bytes());
                offs.push(bytes.len());
            }
        }
        Col::Lc { ids, dict } => each!(ids, "a str", |i| as_str(i).map(|s| dict.intern(s))),
        Col::Arr { values, offs } => {
            offs.reserve(rows);
            let expected = "a list of ints in UInt64 range";
            for row in 0..rows {
                let item = item(list, row)?;
                let inner = match item.downcast::<PyList>() {
                    Ok(l) => l.clone(),
                    Err(_) => PyList::type_object(list.py())
                        .call1((&*item,))
                        .and_then(|l| Ok(l.downcast_into::<PyList>()?))
                        .map_err(|_| (row, true, expected))?,
                };
                let n = inner.len();
                values.reserve(n);
                for i in 0..n {
                    let v = item_of(&inner, i, row)?;
                    values.push(as_u64(&v).map_err(|t| (row, t, expected))?);
                }
                offs.push(values.len());
            }
        }
        Col::OptU32 { nulls, values } => {
            nulls.reserve(rows);
            values.reserve(rows);
            for row in 0..rows {
                let item = item(list, row)?;
                let v = if item.is_none() {
                    None
                } else {
                    Some(as_uint::<u32>(&item))
                };
                let v = v
                    .transpose()
                    .map_err(|t| (row, t, "None or an int in UInt32 range"))?;
                nulls.push(v.is_none() as u8);
                values.push(v.unwrap_or(0));
            }
        }
        Col::OptF64 { nulls, values } => {
            nulls.reserve(rows);
            values.reserve(rows);
            for row in 0..rows {
                let item = item(list, row)?;
                let v = if item.is_none() {
                    None
                } else {
                    Some(as_f64(&item))
                };
                let v = v.transpose().map_err(|t| (row, t, "None or a float"))?;
                nulls.push(v.is_none() as u8);
                values.push(v.unwrap_or(0.0));
            }
        }
    }
    Ok(())
}

/// Item `i` of an array row (a bad row `row` if the array changed while read).
#[inline]
fn item_of<'a, 'py>(
    inner: &'a Bound<'py, PyList>,
    i: usize,
    row: usize,
) -> Result<Borrowed<'a, 'py, PyAny>, Bad> {
    item(inner, i).map_err(|(_, t, e)| (row, t, e))
}

fn as_str<'a>(item: &'a Bound<'_, PyAny>) -> Result<&'a str, bool> {
    let s = item.downcast::<PyString>().map_err(|_| true)?;
    // a str with lone surrogates has no UTF-8 form: a bad value, not a bad type
    s.to_str().map_err(|_| {
        PyErr::take(item.py());
        false
    })
}
