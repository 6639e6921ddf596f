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

use rmp::decode::{read_array_len, read_bin_len, read_int, read_map_len, read_str_len};
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
}

pub const NO_MEDIUM: u16 = u16::MAX;

pub struct Parsed {
    pub ts: f64,
    pub events: Vec<Ev>,
    pub keys: Vec<u64>,
    /// The batch's distinct media, in order of first use (one allocation per medium, not per event).
    pub media: Vec<String>,
}

impl Parsed {
    pub fn medium(&self, ev: &Ev) -> Option<&str> {
        self.media.get(ev.medium as usize).map(String::as_str)
    }
}

type Rd<'a> = &'a [u8];

fn peek(rd: &Rd) -> Option<Marker> {
    rd.first().map(|&b| Marker::from_u8(b))
}

fn is_int(m: Marker) -> bool {
    matches!(
        m,
        Marker::FixPos(_)
            | Marker::FixNeg(_)
            | Marker::U8
            | Marker::U16
            | Marker::U32
            | Marker::U64
            | Marker::I8
            | Marker::I16
            | Marker::I32
            | Marker::I64
    )
}

fn is_nil(rd: &mut Rd) -> bool {
    if peek(rd) == Some(Marker::Null) {
        *rd = &rd[1..];
        true
    } else {
        false
    }
}

/// Any msgpack int as its 64-bit two's complement form (`processors/slots.py: key_of`).
fn int_u64(rd: &mut Rd) -> Option<u64> {
    match peek(rd)? {
        Marker::FixNeg(_) | Marker::I8 | Marker::I16 | Marker::I32 | Marker::I64 => {
            read_int::<i64, _>(rd).ok().map(|v| v as u64)
        }
        m if is_int(m) => read_int::<u64, _>(rd).ok(),
        _ => None,
    }
}

fn int_i64(rd: &mut Rd) -> Option<i64> {
    match peek(rd)? {
        Marker::U64 => {
            let v = read_int::<u64, _>(rd).ok()?;
            i64::try_from(v).ok()
        }
        m if is_int(m) => read_int::<i64, _>(rd).ok(),
        _ => None,
    }
}

fn take<'a>(rd: &mut Rd<'a>, n: usize) -> Option<&'a [u8]> {
    if rd.len() < n {
        return None;
    }
    let (a, b) = rd.split_at(n);
    *rd = b;
    Some(a)
}

fn string<'a>(rd: &mut Rd<'a>) -> Option<&'a str> {
    if !matches!(
        peek(rd)?,
        Marker::FixStr(_) | Marker::Str8 | Marker::Str16 | Marker::Str32
    ) {
        return None;
    }
    let n = read_str_len(rd).ok()? as usize;
    std::str::from_utf8(take(rd, n)?).ok()
}

fn opt_string<'a>(rd: &mut Rd<'a>) -> Option<Option<&'a str>> {
    if is_nil(rd) {
        return Some(None);
    }
    string(rd).map(Some)
}

fn opt_int(rd: &mut Rd) -> Option<Option<i64>> {
    if is_nil(rd) {
        return Some(None);
    }
    int_i64(rd).map(Some)
}

/// A block hash (int or bin) as its 64-bit key.
fn hash_key(rd: &mut Rd) -> Option<u64> {
    match peek(rd)? {
        Marker::Bin8 | Marker::Bin16 | Marker::Bin32 => {
            let n = read_bin_len(rd).ok()? as usize;
            let b = take(rd, n)?;
            Some(
                b[b.len().saturating_sub(8)..]
                    .iter()
                    .fold(0u64, |v, &x| (v << 8) | x as u64),
            )
        }
        m if is_int(m) => int_u64(rd),
        _ => None,
    }
}

fn array_len(rd: &mut Rd) -> Option<usize> {
    if !matches!(
        peek(rd)?,
        Marker::FixArray(_) | Marker::Array16 | Marker::Array32
    ) {
        return None;
    }
    read_array_len(rd).ok().map(|n| n as usize)
}

fn float(rd: &mut Rd) -> Option<f64> {
    match peek(rd)? {
        Marker::F64 => rmp::decode::read_f64(rd).ok(),
        Marker::F32 => rmp::decode::read_f32(rd).ok().map(f64::from),
        m if is_int(m) => match m {
            Marker::U64 => read_int::<u64, _>(rd).ok().map(|v| v as f64),
            _ => int_i64(rd).map(|v| v as f64),
        },
        _ => None,
    }
}

/// A field of an event type as its bit (`None`: not a field of that type); the required ones are
/// `STORED_REQUIRED` / `REMOVED_REQUIRED`. A match, not a table scan: this runs per field per event.
fn field_bit(kind: u8, key: &str) -> Option<u32> {
    Some(match (kind, key) {
        (STORED | REMOVED, "block_hashes") => 0,
        (STORED | REMOVED, "medium") => 1,
        (STORED | REMOVED, "group_idx") => 2,
        (STORED | REMOVED, "locality") => 3,
        (STORED | REMOVED, "ownership") => 4,
        (STORED, "parent_block_hash") => 5,
        (STORED, "token_ids") => 6,
        (STORED, "block_size") => 7,
        (STORED, "lora_id") => 8,
        (STORED, "lora_name") => 9,
        (STORED, "extra_keys") => 10,
        (STORED, "kv_cache_spec_kind") => 11,
        (STORED, "kv_cache_spec_sliding_window") => 12,
        (STORED, "session_id") => 13,
        (STORED, "lookahead_token_ids") => 14,
        _ => return None,
    })
}

const REMOVED_REQUIRED: u32 = 0b11; // block_hashes, medium
const STORED_REQUIRED: u32 = 0b11 | 0b1_1111 << 5; // and parent_block_hash .. lora_name

fn event(rd: &mut Rd, keys: &mut Vec<u64>, media: &mut Vec<String>) -> Option<Ev> {
    if !matches!(peek(rd)?, Marker::FixMap(_) | Marker::Map16 | Marker::Map32) {
        return None;
    }
    let n = read_map_len(rd).ok()? as usize;
    // The tag comes first (as vLLM's encoder writes it); a tag elsewhere is the reference's to read.
    if n == 0 || string(rd)? != "type" {
        return None;
    }
    let kind = match string(rd)? {
        "BlockStored" => STORED,
        "BlockRemoved" => REMOVED,
        "AllBlocksCleared" => CLEARED,
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
    for _ in 1..n {
        let k = string(rd)?;
        let bit = field_bit(kind, k)?;
        if seen & (1 << bit) != 0 {
            return None; // a repeated key
        }
        seen |= 1 << bit;
        match k {
            "block_hashes" => {
                for _ in 0..array_len(rd)? {
                    keys.push(hash_key(rd)?);
                }
            }
            "parent_block_hash" => {
                if !is_nil(rd) {
                    hash_key(rd)?;
                }
            }
            "token_ids" => {
                for _ in 0..array_len(rd)? {
                    int_u64(rd)?;
                }
            }
            "block_size" => {
                int_i64(rd)?;
            }
            "lora_id" | "kv_cache_spec_sliding_window" => {
                opt_int(rd)?;
            }
            "medium" => {
                medium = match opt_string(rd)? {
                    None | Some("") => NO_MEDIUM,
                    Some(m) => match media.iter().position(|x| x == m) {
                        Some(at) => at as u16,
                        None if media.len() < NO_MEDIUM as usize => {
                            media.push(m.to_owned());
                            (media.len() - 1) as u16
                        }
                        None => return None,
                    },
                };
            }
            "lora_name" | "kv_cache_spec_kind" | "locality" | "ownership" | "session_id" => {
                opt_string(rd)?;
            }
            "group_idx" => {
                group = match opt_int(rd)? {
                    None => None,
                    Some(g) if g >= 0 => Some(g as u64),
                    Some(_) => return None, // the reference says why (a negative group)
                };
            }
            "extra_keys" | "lookahead_token_ids" => {
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
    })
}

/// The batch, or None when the reference decoder must read it (see the module doc).
pub fn parse(mut buf: &[u8]) -> Option<Parsed> {
    let rd = &mut buf;
    let n = array_len(rd)?;
    if !(2..=3).contains(&n) {
        return None;
    }
    let ts = float(rd)?;
    let count = array_len(rd)?;
    let mut events = Vec::with_capacity(count.min(1 << 16));
    let mut keys = Vec::new();
    let mut media = Vec::new();
    for _ in 0..count {
        events.push(event(rd, &mut keys, &mut media)?);
    }
    if n == 3 {
        opt_int(rd)?;
    }
    if !rd.is_empty() {
        return None;
    }
    Some(Parsed {
        ts,
        events,
        keys,
        media,
    })
}
