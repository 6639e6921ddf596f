//! vLLM's event batch (msgpack, map layout: `[ts, [event, ...], dp_rank]` with each event a map
//! tagged by "type") read straight from bytes into what the index applies: per event its kind,
//! group, medium and the range of its block keys in one flat vector. No Python object per event.
//!
//! This reader accepts a strict subset of what `schemas/codec.py: decode_vllm_batch` accepts: the
//! fields of the three event types with exactly their types, `extra_keys` and
//! `lookahead_token_ids` only when nil, no unknown or repeated keys, non-negative groups, valid
//! UTF-8, nothing after the batch. Anything else returns `None`, and the caller decodes the
//! message with the reference decoder, which either reads it or says precisely what is wrong; so
//! the DLQ reasons stay the reference's. `tests/property/test_native_batch.py` holds the two
//! readers to that contract.

use rmp::Marker;

pub const STORED: u8 = 0;
pub const REMOVED: u8 = 1;
pub const CLEARED: u8 = 2;

pub struct Ev {
    pub kind: u8,
    pub group: Option<u64>,
    /// Index into `Parsed::media`; `NO_MEDIUM` for nil or "" (both read as GPU).
    pub medium: u16,
    pub start: usize,
    pub end: usize,
    /// A BlockStored's other fields the analytics rows carry (`processors/analytics/rows.py:
    /// event_columns_of`); 0 / None on the other kinds.
    pub stored: StoredFields,
}

/// What the analytics rows take from a BlockStored besides its keys.
#[derive(Clone, Copy, Default)]
pub struct StoredFields {
    /// `parent_block_hash` as its 64-bit key; None when nil.
    pub parent: Option<u64>,
    /// `len(token_ids)`.
    pub tokens: usize,
    pub block_size: i64,
    /// Index into `Parsed::kinds`; `NO_MEDIUM` for nil or "" (the rows then take the node's group kind).
    pub spec_kind: u16,
}

pub const NO_MEDIUM: u16 = u16::MAX;

#[derive(Default)]
pub struct Parsed {
    pub ts: f64,
    pub events: Vec<Ev>,
    pub keys: Vec<u64>,
    /// The batch's distinct media, in order of first use (one allocation per medium, not per event).
    pub media: Vec<String>,
    /// The batch's distinct `kv_cache_spec_kind`s, the same way.
    pub kinds: Vec<String>,
}

impl Parsed {
    pub fn medium(&self, ev: &Ev) -> Option<&str> {
        self.media.get(ev.medium as usize).map(String::as_str)
    }

    pub fn spec_kind(&self, ev: &Ev) -> Option<&str> {
        self.kinds
            .get(ev.stored.spec_kind as usize)
            .map(String::as_str)
    }
}

pub type Rd<'a> = &'a [u8];

pub(crate) fn peek(rd: &Rd) -> Option<Marker> {
    rd.first().map(|&b| Marker::from_u8(b))
}

pub(crate) fn is_nil(rd: &mut Rd) -> bool {
    if peek(rd) == Some(Marker::Null) {
        *rd = &rd[1..];
        true
    } else {
        false
    }
}

/// `n` big-endian bytes as an unsigned value.
#[inline]
fn be(rd: &mut Rd, n: usize) -> Option<u64> {
    let b = take(rd, n)?;
    Some(b.iter().fold(0u64, |v, &x| (v << 8) | x as u64))
}

/// Any msgpack int, read straight from its bytes (this runs per token id and per block hash).
#[inline]
fn int(rd: &mut Rd) -> Option<i128> {
    let m = *rd.first()?;
    if m < 0x80 {
        *rd = &rd[1..];
        return Some(m as i128);
    }
    if m >= 0xe0 {
        *rd = &rd[1..];
        return Some((m as i8) as i128);
    }
    let (n, signed) = match m {
        0xcc => (1, false),
        0xcd => (2, false),
        0xce => (4, false),
        0xcf => (8, false),
        0xd0 => (1, true),
        0xd1 => (2, true),
        0xd2 => (4, true),
        0xd3 => (8, true),
        _ => return None,
    };
    let mut body = &rd[1..];
    let v = be(&mut body, n)?;
    *rd = body;
    Some(if signed {
        // sign-extend the n-byte two's complement value
        let shift = 64 - 8 * n as u32;
        (((v << shift) as i64) >> shift) as i128
    } else {
        v as i128
    })
}

/// Any msgpack int as its 64-bit two's complement form (`processors/core/slots.py: key_of`).
#[inline]
pub(crate) fn int_u64(rd: &mut Rd) -> Option<u64> {
    int(rd).map(|v| v as u64)
}

#[inline]
pub(crate) fn int_i64(rd: &mut Rd) -> Option<i64> {
    int(rd).and_then(|v| i64::try_from(v).ok())
}

/// The length of a str, bin, array or map header (`fix`: the fix-size marker range's base and
/// its mask, if the type has one; `wide`: the markers of the 8-, 16- and 32-bit lengths, 0 where there is none).
#[inline]
fn len_of(rd: &mut Rd, fix: Option<(u8, u8)>, wide: [u8; 3]) -> Option<usize> {
    let m = *rd.first()?;
    if let Some((base, mask)) = fix {
        if m & !mask == base {
            *rd = &rd[1..];
            return Some((m & mask) as usize);
        }
    }
    let n = match m {
        _ if m == wide[0] && m != 0 => 1,
        _ if m == wide[1] => 2,
        _ if m == wide[2] => 4,
        _ => return None,
    };
    let mut body = &rd[1..];
    let v = be(&mut body, n)? as usize;
    *rd = body;
    Some(v)
}

type Header = (Option<(u8, u8)>, [u8; 3]);
const STR: Header = (Some((0xa0, 0x1f)), [0xd9, 0xda, 0xdb]);
const BIN: Header = (None, [0xc4, 0xc5, 0xc6]);
const ARRAY: Header = (Some((0x90, 0x0f)), [0, 0xdc, 0xdd]);
const MAP: Header = (Some((0x80, 0x0f)), [0, 0xde, 0xdf]);

/// A str's bytes, not checked for UTF-8: for keys and tags compared with known ASCII names (a
/// match is valid UTF-8; anything else is refused whatever its bytes).
#[inline]
pub(crate) fn raw_str<'a>(rd: &mut Rd<'a>) -> Option<&'a [u8]> {
    let n = len_of(rd, STR.0, STR.1)?;
    take(rd, n)
}

pub(crate) fn map_len(rd: &mut Rd) -> Option<usize> {
    len_of(rd, MAP.0, MAP.1)
}

pub(crate) fn take<'a>(rd: &mut Rd<'a>, n: usize) -> Option<&'a [u8]> {
    if rd.len() < n {
        return None;
    }
    let (a, b) = rd.split_at(n);
    *rd = b;
    Some(a)
}

pub(crate) fn string<'a>(rd: &mut Rd<'a>) -> Option<&'a str> {
    std::str::from_utf8(raw_str(rd)?).ok()
}

pub(crate) fn opt_string<'a>(rd: &mut Rd<'a>) -> Option<Option<&'a str>> {
    if is_nil(rd) {
        return Some(None);
    }
    string(rd).map(Some)
}

pub(crate) fn opt_int(rd: &mut Rd) -> Option<Option<i64>> {
    if is_nil(rd) {
        return Some(None);
    }
    int_i64(rd).map(Some)
}

/// A block hash (int or bin) as its 64-bit key.
#[inline]
fn hash_key(rd: &mut Rd) -> Option<u64> {
    if let Some(n) = len_of(rd, BIN.0, BIN.1) {
        let b = take(rd, n)?;
        return Some(
            b[b.len().saturating_sub(8)..]
                .iter()
                .fold(0u64, |v, &x| (v << 8) | x as u64),
        );
    }
    int_u64(rd)
}

pub(crate) fn array_len(rd: &mut Rd) -> Option<usize> {
    len_of(rd, ARRAY.0, ARRAY.1)
}

pub(crate) fn float(rd: &mut Rd) -> Option<f64> {
    match peek(rd)? {
        Marker::F64 => rmp::decode::read_f64(rd).ok(),
        Marker::F32 => rmp::decode::read_f32(rd).ok().map(f64::from),
        _ => int(rd).map(|v| v as f64),
    }
}

/// A field of an event type as its bit (`None`: not a field of that type); the required ones are
/// `STORED_REQUIRED` / `REMOVED_REQUIRED`. A match, not a table scan: this runs per field per event.
fn field_bit(kind: u8, key: &[u8]) -> Option<u32> {
    Some(match (kind, key) {
        (STORED | REMOVED, b"block_hashes") => 0,
        (STORED | REMOVED, b"medium") => 1,
        (STORED | REMOVED, b"group_idx") => 2,
        (STORED | REMOVED, b"locality") => 3,
        (STORED | REMOVED, b"ownership") => 4,
        (STORED, b"parent_block_hash") => 5,
        (STORED, b"token_ids") => 6,
        (STORED, b"block_size") => 7,
        (STORED, b"lora_id") => 8,
        (STORED, b"lora_name") => 9,
        (STORED, b"extra_keys") => 10,
        (STORED, b"kv_cache_spec_kind") => 11,
        (STORED, b"kv_cache_spec_sliding_window") => 12,
        (STORED, b"session_id") => 13,
        (STORED, b"lookahead_token_ids") => 14,
        _ => return None,
    })
}

const REMOVED_REQUIRED: u32 = 0b11; // block_hashes, medium
const STORED_REQUIRED: u32 = 0b11 | 0b1_1111 << 5; // and parent_block_hash .. lora_name

/// A str interned in `names` (the batch's media or kinds): its index, `NO_MEDIUM` for nil or "".
/// A name seen before is valid UTF-8 already, so each is checked once per batch.
fn interned(rd: &mut Rd, names: &mut Vec<String>) -> Option<u16> {
    if is_nil(rd) {
        return Some(NO_MEDIUM);
    }
    let m = raw_str(rd)?;
    match names.iter().position(|x| x.as_bytes() == m) {
        _ if m.is_empty() => Some(NO_MEDIUM),
        Some(at) => Some(at as u16),
        None if names.len() < NO_MEDIUM as usize => {
            names.push(std::str::from_utf8(m).ok()?.to_owned());
            Some((names.len() - 1) as u16)
        }
        None => None,
    }
}

fn event(
    rd: &mut Rd,
    keys: &mut Vec<u64>,
    media: &mut Vec<String>,
    kinds: &mut Vec<String>,
) -> Option<Ev> {
    let n = map_len(rd)?;
    // The tag comes first (as vLLM's encoder writes it); a tag elsewhere is the reference's to read.
    if n == 0 || raw_str(rd)? != b"type" {
        return None;
    }
    let kind = match raw_str(rd)? {
        b"BlockStored" => STORED,
        b"BlockRemoved" => REMOVED,
        b"AllBlocksCleared" => CLEARED,
        _ => return None,
    };
    let required = match kind {
        STORED => STORED_REQUIRED,
        REMOVED => REMOVED_REQUIRED,
        _ => 0,
    };
    let start = keys.len();
    let mut seen = 0u32;
    let mut group = None;
    let mut medium = NO_MEDIUM;
    let mut stored = StoredFields {
        spec_kind: NO_MEDIUM,
        ..StoredFields::default()
    };
    for _ in 1..n {
        let bit = field_bit(kind, raw_str(rd)?)?;
        if seen & (1 << bit) != 0 {
            return None; // a repeated key
        }
        seen |= 1 << bit;
        // bits as `field_bit` numbers them
        match bit {
            0 => {
                for _ in 0..array_len(rd)? {
                    keys.push(hash_key(rd)?);
                }
            }
            5 => {
                if !is_nil(rd) {
                    stored.parent = Some(hash_key(rd)?);
                }
            }
            6 => {
                stored.tokens = array_len(rd)?;
                for _ in 0..stored.tokens {
                    int(rd)?;
                }
            }
            7 => {
                stored.block_size = int_i64(rd)?;
            }
            8 | 12 => {
                opt_int(rd)?;
            }
            1 => {
                medium = interned(rd, media)?;
            }
            11 => {
                stored.spec_kind = interned(rd, kinds)?;
            }
            3 | 4 | 9 | 13 => {
                opt_string(rd)?;
            }
            2 => {
                group = match opt_int(rd)? {
                    None => None,
                    Some(g) if g >= 0 => Some(g as u64),
                    Some(_) => return None, // the reference says why (a negative group)
                };
            }
            10 | 14 => {
                if !is_nil(rd) {
                    return None;
                }
            }
            _ => return None,
        }
    }
    if seen & required != required || (kind == CLEARED && n != 1) {
        return None; // a required field missing; AllBlocksCleared has none
    }
    Some(Ev {
        kind,
        group,
        medium,
        start,
        end: keys.len(),
        stored,
    })
}

/// The batch, or None when the reference decoder must read it (see the module doc).
pub fn parse(mut buf: &[u8]) -> Option<Parsed> {
    let mut out = Parsed::default();
    parse_into(&mut buf, &mut out)?;
    if !buf.is_empty() {
        return None;
    }
    Some(out)
}

/// One batch read from the front of `rd` into `out` (cleared first, so a caller reading many
/// batches reuses its allocations); `rd` is left just past the batch. None: as `parse`.
pub fn parse_into(rd: &mut Rd, out: &mut Parsed) -> Option<()> {
    out.events.clear();
    out.keys.clear();
    out.media.clear();
    out.kinds.clear();
    let n = array_len(rd)?;
    if !(2..=3).contains(&n) {
        return None;
    }
    out.ts = float(rd)?;
    let count = array_len(rd)?;
    out.events.reserve(count.min(1 << 16));
    for _ in 0..count {
        let ev = event(rd, &mut out.keys, &mut out.media, &mut out.kinds)?;
        out.events.push(ev);
    }
    if n == 3 {
        opt_int(rd)?;
    }
    Some(())
}
