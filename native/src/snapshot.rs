//! A slot's snapshot record (`processors/core/snapshot.py: SlotSnap`) written straight from the store and
//! read straight back into it, so a snapshot of a million entries makes no Python object per entry.
//!
//! The bytes are the ones msgspec writes for the same `SlotSnap` (an array-like struct: `[group,
//! medium, hashes, stored_ts, dups]`, ints in their shortest form, floats as float64, `dups` a map
//! in the order of `hashes`), so snapshot format 1 is unchanged: either side reads what the other
//! wrote. Reading accepts what msgspec's decoder accepts for that type (hashes as ints or bytes, store
//! times as floats or ints, 4 fields or more, later ones ignored) and says where a record is broken.

use crate::store::Store;
use std::collections::HashMap;

/// Bytes an entry costs in `processors/core/snapshot.py`'s chunk sizing (a 64-bit hash and a float64,
/// each with its marker): the caller cuts slots into pieces with it.
pub const ENTRY_BYTES: usize = 18;

// -- writing ------------------------------------------------------------------------------------------

fn put_uint(out: &mut Vec<u8>, v: u64) {
    if v < 0x80 {
        out.push(v as u8);
    } else if v <= 0xff {
        out.extend_from_slice(&[0xcc, v as u8]);
    } else if v <= 0xffff {
        out.push(0xcd);
        out.extend_from_slice(&(v as u16).to_be_bytes());
    } else if v <= 0xffff_ffff {
        out.push(0xce);
        out.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        out.push(0xcf);
        out.extend_from_slice(&v.to_be_bytes());
    }
}

/// Array (`base` 0x90, 0xdc) or map (`base` 0x80, 0xde) header of `n` items.
fn put_len(out: &mut Vec<u8>, base: u8, wide: u8, n: usize) {
    if n < 16 {
        out.push(base | n as u8);
    } else if n <= 0xffff {
        out.push(wide);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(wide + 1);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    let n = s.len();
    if n < 32 {
        out.push(0xa0 | n as u8);
    } else if n <= 0xff {
        out.extend_from_slice(&[0xd9, n as u8]);
    } else if n <= 0xffff {
        out.push(0xda);
        out.extend_from_slice(&(n as u16).to_be_bytes());
    } else {
        out.push(0xdb);
        out.extend_from_slice(&(n as u32).to_be_bytes());
    }
    out.extend_from_slice(s.as_bytes());
}

/// The slot's entries, sorted by (store time, key) as `Store::items` gives them, written as one
/// `SlotSnap` per piece: piece `i` holds entries `cuts[i]..cuts[i + 1]` and the extra copies of
/// those keys. `cuts` starts at 0, never decreases and ends at the slot's length.
pub fn write_slot(
    store: &Store,
    id: u32,
    group: u64,
    medium: &str,
    cuts: &[usize],
) -> Result<Vec<Vec<u8>>, String> {
    let (keys, ts) = store.items(id)?;
    if cuts.first() != Some(&0)
        || cuts.last() != Some(&keys.len())
        || cuts.windows(2).any(|w| w[0] > w[1])
    {
        return Err(format!(
            "piece bounds {cuts:?} must rise from 0 to the slot's {} entries",
            keys.len()
        ));
    }
    let extra: HashMap<u64, u32> = store.dup_items(id)?.into_iter().collect();
    let mut pieces = Vec::with_capacity(cuts.len() - 1);
    for w in cuts.windows(2) {
        let (keys, ts) = (&keys[w[0]..w[1]], &ts[w[0]..w[1]]);
        let mut out = Vec::with_capacity(16 + medium.len() + keys.len() * ENTRY_BYTES);
        out.push(0x95);
        put_uint(&mut out, group);
        put_str(&mut out, medium);
        put_len(&mut out, 0x90, 0xdc, keys.len());
        for &k in keys {
            put_uint(&mut out, k);
        }
        put_len(&mut out, 0x90, 0xdc, ts.len());
        for &t in ts {
            out.push(0xcb);
            out.extend_from_slice(&t.to_bits().to_be_bytes());
        }
        let copies: Vec<(u64, u32)> = if extra.is_empty() {
            Vec::new()
        } else {
            keys.iter()
                .filter_map(|k| extra.get(k).map(|&n| (*k, n)))
                .collect()
        };
        put_len(&mut out, 0x80, 0xde, copies.len());
        for (k, n) in copies {
            put_uint(&mut out, k);
            put_uint(&mut out, n as u64);
        }
        pieces.push(out);
    }
    Ok(pieces)
}

// -- reading ------------------------------------------------------------------------------------------

/// A slot record read back: its group and medium, and (when kept) its entries and extra copies.
#[derive(Default, Debug, PartialEq)]
pub struct SlotRecord {
    pub group: i128,
    pub medium: String,
    pub entries: usize,
    pub keys: Vec<u64>,
    pub ts: Vec<f64>,
    pub extra: Vec<(u64, u32)>,
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

/// Nesting of skipped values allowed before a record is refused (a hostile record must not
/// exhaust the stack).
const MAX_DEPTH: usize = 64;

impl<'a> Reader<'a> {
    fn fail(&self, what: &str) -> String {
        format!(
            "snapshot slot record broken at byte {} of {}: {what}",
            self.pos,
            self.data.len()
        )
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.data.len() - self.pos < n {
            return Err(self.fail(&format!("truncated inside {what}")));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn byte(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn be(&mut self, n: usize, what: &str) -> Result<u64, String> {
        Ok(self
            .take(n, what)?
            .iter()
            .fold(0u64, |v, &x| (v << 8) | x as u64))
    }

    /// An int (msgpack's int forms only, as msgspec reads `int`), widened so u64 and i64 both fit.
    fn int_after(&mut self, m: u8, what: &str) -> Result<Option<i128>, String> {
        Ok(Some(match m {
            0x00..=0x7f => m as i128,
            0xe0..=0xff => (m as i8) as i128,
            0xcc => self.be(1, what)? as i128,
            0xcd => self.be(2, what)? as i128,
            0xce => self.be(4, what)? as i128,
            0xcf => self.be(8, what)? as i128,
            0xd0 => (self.be(1, what)? as u8 as i8) as i128,
            0xd1 => (self.be(2, what)? as u16 as i16) as i128,
            0xd2 => (self.be(4, what)? as u32 as i32) as i128,
            0xd3 => (self.be(8, what)? as i64) as i128,
            _ => return Ok(None),
        }))
    }

    fn int(&mut self, what: &str) -> Result<i128, String> {
        let m = self.byte(what)?;
        match self.int_after(m, what)? {
            Some(v) => Ok(v),
            None => {
                self.pos -= 1;
                Err(self.fail(&format!("{what} must be an int (marker 0x{m:02x})")))
            }
        }
    }

    /// A block hash as its 64-bit key: an int masked to 64 bits, bytes by their last 8 bytes
    /// big-endian (`processors/core/slots.py: key_of`).
    fn hash(&mut self) -> Result<u64, String> {
        let m = self.byte("a hash")?;
        if let Some(v) = self.int_after(m, "a hash")? {
            return Ok(v as u64);
        }
        let n = match m {
            0xc4 => self.be(1, "a hash")?,
            0xc5 => self.be(2, "a hash")?,
            0xc6 => self.be(4, "a hash")?,
            _ => {
                self.pos -= 1;
                return Err(self.fail(&format!(
                    "a hash must be an int or bytes (marker 0x{m:02x})"
                )));
            }
        } as usize;
        let d = self.take(n, "a hash")?;
        Ok(d[n.saturating_sub(8)..]
            .iter()
            .fold(0u64, |v, &x| (v << 8) | x as u64))
    }

    fn float(&mut self) -> Result<f64, String> {
        let m = self.byte("a store time")?;
        match m {
            0xcb => Ok(f64::from_bits(self.be(8, "a store time")?)),
            0xca => Ok(f32::from_bits(self.be(4, "a store time")? as u32) as f64),
            _ => match self.int_after(m, "a store time")? {
                Some(v) => Ok(v as f64),
                None => {
                    self.pos -= 1;
                    Err(self.fail(&format!("a store time must be a float (marker 0x{m:02x})")))
                }
            },
        }
    }

    /// Length of an array (`map` false) or map header.
    fn len(&mut self, map: bool, what: &str) -> Result<usize, String> {
        let m = self.byte(what)?;
        let (small, wide) = if map { (0x80, 0xde) } else { (0x90, 0xdc) };
        let n = match m {
            _ if m & 0xf0 == small => (m & 0x0f) as usize,
            _ if m == wide => self.be(2, what)? as usize,
            _ if m == wide + 1 => self.be(4, what)? as usize,
            _ => {
                self.pos -= 1;
                let kind = if map { "a map" } else { "an array" };
                return Err(self.fail(&format!("{what} must be {kind} (marker 0x{m:02x})")));
            }
        };
        // every item takes at least a byte: a length past the record's end is a broken record,
        // refused before anything is allocated for it
        if n > self.data.len() - self.pos {
            return Err(self.fail(&format!(
                "{what} claims {n} items, more than the record holds"
            )));
        }
        Ok(n)
    }

    fn str(&mut self, what: &str) -> Result<&'a str, String> {
        let m = self.byte(what)?;
        let n = match m {
            0xa0..=0xbf => (m & 0x1f) as u64,
            0xd9 => self.be(1, what)?,
            0xda => self.be(2, what)?,
            0xdb => self.be(4, what)?,
            _ => {
                self.pos -= 1;
                return Err(self.fail(&format!("{what} must be a str (marker 0x{m:02x})")));
            }
        } as usize;
        let at = self.pos;
        let raw = self.take(n, what)?;
        std::str::from_utf8(raw).map_err(|_| {
            self.pos = at;
            self.fail(&format!("{what} is not valid UTF-8"))
        })
    }

    /// Skip one value of any type (fields a later format adds, which this one ignores).
    fn skip(&mut self, depth: usize) -> Result<(), String> {
        if depth > MAX_DEPTH {
            return Err(self.fail("values nested too deep"));
        }
        let m = self.byte("a value")?;
        if self.int_after(m, "a value")?.is_some() {
            return Ok(());
        }
        let what = "a value";
        let (items, bytes) = match m {
            0xc0 | 0xc2 | 0xc3 => (0, 0),
            0x80..=0x8f => (2 * (m & 0x0f) as u64, 0),
            0x90..=0x9f => ((m & 0x0f) as u64, 0),
            0xa0..=0xbf => (0, (m & 0x1f) as u64),
            0xc4 | 0xd9 => (0, self.be(1, what)?),
            0xc5 | 0xda => (0, self.be(2, what)?),
            0xc6 | 0xdb => (0, self.be(4, what)?),
            0xc7 => (0, self.be(1, what)? + 1),
            0xc8 => (0, self.be(2, what)? + 1),
            0xc9 => (0, self.be(4, what)? + 1),
            0xca => (0, 4),
            0xcb => (0, 8),
            0xd4 => (0, 2),
            0xd5 => (0, 3),
            0xd6 => (0, 5),
            0xd7 => (0, 9),
            0xd8 => (0, 17),
            0xdc => (self.be(2, what)?, 0),
            0xdd => (self.be(4, what)?, 0),
            0xde => (2 * self.be(2, what)?, 0),
            0xdf => (2 * self.be(4, what)?, 0),
            _ => {
                self.pos -= 1;
                return Err(self.fail(&format!("unknown msgpack marker 0x{m:02x}")));
            }
        };
        self.take(bytes as usize, what)?;
        if items > (self.data.len() - self.pos) as u64 {
            return Err(self.fail("a value claims more items than the record holds"));
        }
        for _ in 0..items {
            self.skip(depth + 1)?;
        }
        Ok(())
    }
}

/// Read one slot record. `keep`: collect the entries (a restore); without it the record is only
/// checked and counted. Errors say where the record is broken.
pub fn read_slot(data: &[u8], keep: bool) -> Result<SlotRecord, String> {
    let mut rd = Reader { data, pos: 0 };
    let fields = rd.len(false, "a slot record")?;
    if fields < 4 {
        return Err(rd.fail(&format!(
            "a slot record has at least 4 fields, this one {fields}"
        )));
    }
    let group = rd.int("the group")?;
    let medium = rd.str("the medium")?.to_owned();
    let n = rd.len(false, "the hashes")?;
    let mut out = SlotRecord {
        group,
        medium,
        entries: n,
        ..Default::default()
    };
    if keep {
        out.keys.reserve_exact(n);
    }
    for _ in 0..n {
        let k = rd.hash()?;
        if keep {
            out.keys.push(k);
        }
    }
    let m = rd.len(false, "the store times")?;
    if m != n {
        return Err(rd.fail(&format!("{n} hashes but {m} store times")));
    }
    if keep {
        out.ts.reserve_exact(n);
    }
    for _ in 0..m {
        let t = rd.float()?;
        if keep {
            out.ts.push(t);
        }
    }
    if fields >= 5 {
        let d = rd.len(true, "the extra copies")?;
        for _ in 0..d {
            let k = rd.hash()?;
            let c = rd.int("a count of extra copies")?;
            if c > u32::MAX as i128 {
                return Err(rd.fail(&format!("{c} extra copies of one block")));
            }
            // none or fewer mean no extra copy (`processors/core/slots.py: NativeStore.load`)
            if keep && c > 0 {
                out.extra.push((k, c as u32));
            }
        }
        for _ in 5..fields {
            rd.skip(0)?;
        }
    }
    if rd.pos != data.len() {
        return Err(rd.fail("bytes after the record's end"));
    }
    Ok(out)
}

/// Load a slot record into live slot `id` (added to what it holds, as `Store::load`); returns
/// the number of entries it carried.
pub fn load_slot(store: &mut Store, id: u32, data: &[u8]) -> Result<usize, String> {
    let rec = read_slot(data, true)?;
    store.load(id, &rec.keys, &rec.ts, &rec.extra)?;
    Ok(rec.entries)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::SlotMeta;

    #[test]
    fn written_records_read_back_and_broken_ones_are_refused() {
        let mut s = Store::new();
        let a = s.new_slot(3, SlotMeta::default()).unwrap();
        s.store(a, &[1, 300, u64::MAX], 2.5, None).unwrap();
        s.store(a, &[300], 3.0, None).unwrap();
        let pieces = write_slot(&s, a, 3, "GPU", &[0, 2, 3]).unwrap();
        assert_eq!(pieces.len(), 2);
        let first = read_slot(&pieces[0], true).unwrap();
        assert_eq!((first.group, first.medium.as_str()), (3, "GPU"));
        assert_eq!(first.keys, vec![1, 300]);
        assert_eq!(first.extra, vec![(300, 1)]);
        let b = s.new_slot(3, SlotMeta::default()).unwrap();
        for p in &pieces {
            load_slot(&mut s, b, p).unwrap();
        }
        assert_eq!(s.items(b).unwrap(), s.items(a).unwrap());
        assert_eq!(s.copies(b, 300).unwrap(), 2);
        let whole = &pieces[0];
        for cut in 0..whole.len() {
            assert!(read_slot(&whole[..cut], false).is_err());
        }
        assert!(write_slot(&s, a, 3, "GPU", &[0, 2]).is_err());
    }
}
