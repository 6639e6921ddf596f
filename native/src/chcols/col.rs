//! `chcols`' storage: one column's values (`Col`), interned strings (`Dict`), and each type's
//! Native-format bytes. `TableCols` (chcols.rs) keeps one `Col` per schema column.

use foldhash::fast::RandomState;
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use std::hash::BuildHasher;

use super::ChType;

/// Strings interned to dense ids, in first-seen order.
#[derive(Clone, Default)]
pub(crate) struct Dict {
    pub(crate) strs: Vec<Box<str>>,
    index: HashTable<u32>,
    hasher: RandomState,
    last: u32, // the id the last `intern` answered (a hint; checked against `strs`)
}

impl Dict {
    #[inline]
    pub(crate) fn intern(&mut self, s: &str) -> u32 {
        if let Some(last) = self.strs.get(self.last as usize) {
            if **last == *s {
                return self.last;
            }
        }
        let Dict {
            strs,
            index,
            hasher,
            last,
        } = self;
        let hash = hasher.hash_one(s);
        let id = match index.entry(
            hash,
            |&i| *strs[i as usize] == *s,
            |&i| hasher.hash_one(&*strs[i as usize]),
        ) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                let id = u32::try_from(strs.len()).expect("under 2^32 distinct values in a column");
                strs.push(s.into());
                e.insert(id);
                id
            }
        };
        *last = id;
        id
    }
}

/// One column's values. Offsets (`String`, `Array`) have a leading 0: row `i` is `offs[i]..offs[i + 1]`.
#[derive(Clone)]
pub(crate) enum Col {
    I64(Vec<i64>),
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    I32(Vec<i32>),
    F64(Vec<f64>),
    Str { bytes: Vec<u8>, offs: Vec<usize> },
    Lc { ids: Vec<u32>, dict: Dict },
    Arr { values: Vec<u64>, offs: Vec<usize> },
    OptU32 { nulls: Vec<u8>, values: Vec<u32> },
    OptF64 { nulls: Vec<u8>, values: Vec<f64> },
}

/// Apply one expression to the `Vec` of whichever fixed-width variant `$col` is (`$v` binds it).
macro_rules! fixed {
    ($col:expr, $v:ident => $e:expr, $other:pat => $o:expr) => {
        match $col {
            Col::I64($v) => $e,
            Col::U8($v) => $e,
            Col::U16($v) => $e,
            Col::U32($v) => $e,
            Col::U64($v) => $e,
            Col::I32($v) => $e,
            Col::F64($v) => $e,
            $other => $o,
        }
    };
}

impl Col {
    pub(crate) fn new(ty: ChType) -> Col {
        match ty {
            ChType::DateTime64Micro => Col::I64(Vec::new()),
            ChType::UInt8 => Col::U8(Vec::new()),
            ChType::UInt16 => Col::U16(Vec::new()),
            ChType::UInt32 => Col::U32(Vec::new()),
            ChType::UInt64 => Col::U64(Vec::new()),
            ChType::Int32 => Col::I32(Vec::new()),
            ChType::Float64 => Col::F64(Vec::new()),
            ChType::String => Col::Str {
                bytes: Vec::new(),
                offs: vec![0],
            },
            ChType::LowCardinalityString => Col::Lc {
                ids: Vec::new(),
                dict: Dict::default(),
            },
            ChType::ArrayUInt64 => Col::Arr {
                values: Vec::new(),
                offs: vec![0],
            },
            ChType::NullableUInt32 => Col::OptU32 {
                nulls: Vec::new(),
                values: Vec::new(),
            },
            ChType::NullableFloat64 => Col::OptF64 {
                nulls: Vec::new(),
                values: Vec::new(),
            },
        }
    }

    pub(crate) fn len(&self) -> usize {
        fixed!(self, v => v.len(), other => match other {
            Col::Str { offs, .. } | Col::Arr { offs, .. } => offs.len() - 1,
            Col::Lc { ids, .. } => ids.len(),
            Col::OptU32 { nulls, .. } | Col::OptF64 { nulls, .. } => nulls.len(),
            _ => unreachable!(),
        })
    }

    pub(super) fn append(&mut self, other: &Col) {
        match (self, other) {
            (Col::I64(a), Col::I64(b)) => a.extend_from_slice(b),
            (Col::U8(a), Col::U8(b)) => a.extend_from_slice(b),
            (Col::U16(a), Col::U16(b)) => a.extend_from_slice(b),
            (Col::U32(a), Col::U32(b)) => a.extend_from_slice(b),
            (Col::U64(a), Col::U64(b)) => a.extend_from_slice(b),
            (Col::I32(a), Col::I32(b)) => a.extend_from_slice(b),
            (Col::F64(a), Col::F64(b)) => a.extend_from_slice(b),
            (Col::Str { bytes: a, offs: ao }, Col::Str { bytes: b, offs: bo }) => {
                append_offs(a, ao, b, bo)
            }
            (
                Col::Arr {
                    values: a,
                    offs: ao,
                },
                Col::Arr {
                    values: b,
                    offs: bo,
                },
            ) => append_offs(a, ao, b, bo),
            (Col::Lc { ids: a, dict: ad }, Col::Lc { ids: b, dict: bd }) => {
                // their ids to ours, each looked up once (a batch uses few distinct values)
                let mut ours = vec![u32::MAX; bd.strs.len()];
                a.extend(b.iter().map(|&id| {
                    let slot = &mut ours[id as usize];
                    if *slot == u32::MAX {
                        *slot = ad.intern(&bd.strs[id as usize]);
                    }
                    *slot
                }));
            }
            (
                Col::OptU32 {
                    nulls: a,
                    values: av,
                },
                Col::OptU32 {
                    nulls: b,
                    values: bv,
                },
            ) => {
                a.extend_from_slice(b);
                av.extend_from_slice(bv);
            }
            (
                Col::OptF64 {
                    nulls: a,
                    values: av,
                },
                Col::OptF64 {
                    nulls: b,
                    values: bv,
                },
            ) => {
                a.extend_from_slice(b);
                av.extend_from_slice(bv);
            }
            _ => panic!("append: columns of different types"),
        }
    }

    pub(super) fn drop_front(&mut self, n: usize) {
        fixed!(self, v => { v.drain(..n); }, other => match other {
            Col::Str { bytes, offs } => drop_offs(bytes, offs, n),
            Col::Arr { values, offs } => drop_offs(values, offs, n),
            Col::Lc { ids, dict } => {
                ids.drain(..n);
                if dict.strs.len() > 1024 && dict.strs.len() > 2 * ids.len() {
                    let old = std::mem::take(dict);
                    let mut ours = vec![u32::MAX; old.strs.len()];
                    for id in ids.iter_mut() {
                        let slot = &mut ours[*id as usize];
                        if *slot == u32::MAX {
                            *slot = dict.intern(&old.strs[*id as usize]);
                        }
                        *id = *slot;
                    }
                }
            }
            Col::OptU32 { nulls, values } => {
                nulls.drain(..n);
                values.drain(..n);
            }
            Col::OptF64 { nulls, values } => {
                nulls.drain(..n);
                values.drain(..n);
            }
            _ => unreachable!(),
        })
    }

    pub(super) fn encode(&self, start: usize, end: usize, out: &mut Vec<u8>) {
        match self {
            Col::I64(v) => put_all(out, &v[start..end], i64::to_le_bytes),
            Col::U8(v) => out.extend_from_slice(&v[start..end]),
            Col::U16(v) => put_all(out, &v[start..end], u16::to_le_bytes),
            Col::U32(v) => put_all(out, &v[start..end], u32::to_le_bytes),
            Col::U64(v) => put_all(out, &v[start..end], u64::to_le_bytes),
            Col::I32(v) => put_all(out, &v[start..end], i32::to_le_bytes),
            Col::F64(v) => put_all(out, &v[start..end], f64::to_le_bytes),
            Col::Str { bytes, offs } => {
                for w in offs[start..=end].windows(2) {
                    write_bytes(out, &bytes[w[0]..w[1]]);
                }
            }
            Col::Arr { values, offs } => {
                // Array: the rows' end offsets (UInt64, counted from the block's first value), then the values
                let base = offs[start];
                out.reserve((end - start + offs[end] - base) * 8);
                offs[start + 1..=end]
                    .iter()
                    .for_each(|&o| out.extend_from_slice(&((o - base) as u64).to_le_bytes()));
                put_all(out, &values[base..offs[end]], u64::to_le_bytes);
            }
            Col::Lc { ids, dict } => encode_low_cardinality(&ids[start..end], dict, out),
            Col::OptU32 { nulls, values } => {
                // Nullable: the null map (1 = NULL), then a value per row (0 where NULL)
                out.extend_from_slice(&nulls[start..end]);
                put_all(out, &values[start..end], u32::to_le_bytes);
            }
            Col::OptF64 { nulls, values } => {
                out.extend_from_slice(&nulls[start..end]);
                put_all(out, &values[start..end], f64::to_le_bytes);
            }
        }
    }
}

/// ClickHouse's LowCardinality stream for a block without a shared dictionary: the keys version
/// (UInt64 1), then one granule: UInt64 flags (index width code | HasAdditionalKeys 1<<9 |
/// NeedUpdateDictionary 1<<10), UInt64 key count, the keys as `String`, UInt64 row count, and one
/// index per row in the width (code 0..3: UInt8..UInt64) that fits the block's own dictionary.
fn encode_low_cardinality(ids: &[u32], dict: &Dict, out: &mut Vec<u8>) {
    let mut local = vec![u32::MAX; dict.strs.len()];
    let mut keys: Vec<u32> = Vec::new();
    let mut index: Vec<u32> = Vec::with_capacity(ids.len());
    for &id in ids {
        let slot = &mut local[id as usize];
        if *slot == u32::MAX {
            *slot = keys.len() as u32;
            keys.push(id);
        }
        index.push(*slot);
    }
    let width: u64 = match keys.len() {
        0..=0x100 => 0,
        0x101..=0x1_0000 => 1,
        _ => 2,
    };
    out.extend_from_slice(&1u64.to_le_bytes());
    out.extend_from_slice(&((1u64 << 9) | (1 << 10) | width).to_le_bytes());
    out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for &k in &keys {
        write_bytes(out, dict.strs[k as usize].as_bytes());
    }
    out.extend_from_slice(&(index.len() as u64).to_le_bytes());
    match width {
        0 => out.extend(index.iter().map(|&i| i as u8)),
        1 => index
            .iter()
            .for_each(|&i| out.extend_from_slice(&(i as u16).to_le_bytes())),
        _ => put_all(out, &index, u32::to_le_bytes),
    }
}

/// Fixed-width values, little-endian, one after another.
#[inline]
fn put_all<T: Copy, const N: usize>(out: &mut Vec<u8>, values: &[T], le: fn(T) -> [u8; N]) {
    out.reserve(values.len() * N);
    values.iter().for_each(|&v| out.extend_from_slice(&le(v)));
}

/// `String` / `Array` rows: `b`'s data after `a`'s, its end offsets moved by `a`'s length.
fn append_offs<T: Copy>(a: &mut Vec<T>, ao: &mut Vec<usize>, b: &[T], bo: &[usize]) {
    let base = a.len();
    a.extend_from_slice(b);
    ao.extend(bo[1..].iter().map(|&o| o + base));
}

/// `String` / `Array` rows: the first `n` gone, offsets counted from the new first row.
fn drop_offs<T>(data: &mut Vec<T>, offs: &mut Vec<usize>, n: usize) {
    let base = offs[n];
    data.drain(..base);
    offs.drain(..n);
    offs.iter_mut().for_each(|o| *o -= base);
}

/// ClickHouse's VarUInt (LEB128).
pub(super) fn write_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A `String` value: VarUInt length, then the bytes.
pub(super) fn write_bytes(out: &mut Vec<u8>, b: &[u8]) {
    write_varint(out, b.len() as u64);
    out.extend_from_slice(b);
}
