//! vLLM's default block hash over a prompt's chain of full units (`gpu/hashing.py`: SHA-256 of
//! pickle protocol 5 of `(parent digest, tuple(token ids), None)`), built from the token ids
//! without a Python object per unit. Pickle's output for that object graph is fixed: the protocol
//! and one frame, the parent as short bytes, the tokens as a tuple of small ints (each the
//! narrowest of pickle's 1-, 2- and signed 4-byte forms), None, a 3-tuple, each container
//! memoized. Anything outside that shape (a token needing pickle's long form, a parent of 256
//! bytes or more, a frame past pickle's 64 KiB frame target) is left to the Python reference, and
//! `tests/property/test_native_token_hash.py` holds the two equal.

use sha2::{Digest, Sha256};

const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const SHORT_BINBYTES: u8 = b'C';
const MEMOIZE: u8 = 0x94;
const MARK: u8 = b'(';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const BININT: u8 = b'J';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const NONE: u8 = b'N';
const STOP: u8 = b'.';
/// Pickle ends a frame once it reaches this size; a unit's payload must stay under it.
const FRAME_TARGET: usize = 64 * 1024;

#[inline]
fn push_int(out: &mut Vec<u8>, t: i64) -> bool {
    if (0..=0xff).contains(&t) {
        out.extend_from_slice(&[BININT1, t as u8]);
    } else if (0..=0xffff).contains(&t) {
        out.push(BININT2);
        out.extend_from_slice(&(t as u16).to_le_bytes());
    } else if (i32::MIN as i64..=i32::MAX as i64).contains(&t) {
        out.push(BININT);
        out.extend_from_slice(&(t as i32).to_le_bytes());
    } else {
        return false;
    }
    true
}

/// The digests of every full `unit` of `tokens` chained from `parent`, or None when a unit falls
/// outside the shape this module writes.
pub fn sha256_chain(parent: &[u8], tokens: &[i64], unit: usize) -> Option<Vec<[u8; 32]>> {
    if unit == 0 || parent.len() >= 256 {
        return None;
    }
    let mut out = Vec::with_capacity(tokens.len() / unit);
    let mut buf: Vec<u8> = Vec::with_capacity(64 + 5 * unit);
    let mut prev: &[u8] = parent;
    for chunk in tokens.chunks_exact(unit) {
        out.push(unit_digest(&mut buf, prev, chunk)?);
        prev = out.last().expect("pushed");
    }
    Some(out)
}

/// The digest of one unit (`chunk`) chained from `prev` (under 256 bytes), written through `buf`;
/// None when the unit falls outside the shape this module writes.
pub fn unit_digest(buf: &mut Vec<u8>, prev: &[u8], chunk: &[i64]) -> Option<[u8; 32]> {
    let unit = chunk.len();
    if unit == 0 || prev.len() >= 256 {
        return None;
    }
    buf.clear();
    buf.extend_from_slice(&[PROTO, 5, FRAME]);
    buf.extend_from_slice(&[0; 8]); // the frame's length, filled in below
    buf.extend_from_slice(&[SHORT_BINBYTES, prev.len() as u8]);
    buf.extend_from_slice(prev);
    buf.push(MEMOIZE);
    if unit > 3 {
        buf.push(MARK);
    }
    for &t in chunk {
        if !push_int(buf, t) {
            return None;
        }
    }
    buf.push(match unit {
        1 => TUPLE1,
        2 => TUPLE2,
        3 => TUPLE3,
        _ => TUPLE,
    });
    buf.extend_from_slice(&[MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP]);
    let framed = buf.len() - 11;
    if framed >= FRAME_TARGET {
        return None;
    }
    buf[3..11].copy_from_slice(&(framed as u64).to_le_bytes());
    Some(Sha256::digest(&buf[..]).into())
}
