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

/// Units up to this many tokens are written on the stack and hashed block by block (`small_unit`).
const SMALL_UNIT: usize = 32;
/// 4 SHA-256 blocks: the header (13 bytes), a 32-byte parent, 32 ids of at most 5 bytes, the tail
/// (6 bytes) and SHA's padding (at least 9 bytes) fit in 256.
const SMALL_BYTES: usize = 256;
const SHA256_INIT: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// `unit_digest` for a unit of at most `SMALL_UNIT` ids and a 32-byte parent, the common case: the
/// pickle and SHA's padding written into one stack buffer and compressed in place (no hasher state
/// copying the message into its own block buffer). Half the time this path spends outside the
/// compression itself went to building the message and to that copy.
fn small_unit(prev: &[u8; 32], chunk: &[i64]) -> Option<[u8; 32]> {
    let mut m = [0u8; SMALL_BYTES];
    m[..3].copy_from_slice(&[PROTO, 5, FRAME]);
    // m[3..11]: the frame's length, below
    m[11] = SHORT_BINBYTES;
    m[12] = 32;
    m[13..45].copy_from_slice(prev);
    m[45] = MEMOIZE;
    let mut w = 46;
    if chunk.len() > 3 {
        m[w] = MARK;
        w += 1;
    }
    for &t in chunk {
        if (0..=0xff).contains(&t) {
            m[w] = BININT1;
            m[w + 1] = t as u8;
            w += 2;
        } else if (0..=0xffff).contains(&t) {
            m[w] = BININT2;
            m[w + 1..w + 3].copy_from_slice(&(t as u16).to_le_bytes());
            w += 3;
        } else if (i32::MIN as i64..=i32::MAX as i64).contains(&t) {
            m[w] = BININT;
            m[w + 1..w + 5].copy_from_slice(&(t as i32).to_le_bytes());
            w += 5;
        } else {
            return None;
        }
    }
    m[w] = match chunk.len() {
        1 => TUPLE1,
        2 => TUPLE2,
        3 => TUPLE3,
        _ => TUPLE,
    };
    m[w + 1..w + 6].copy_from_slice(&[MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP]);
    w += 6;
    m[3..11].copy_from_slice(&((w - 11) as u64).to_le_bytes());
    // SHA-256 padding: 0x80, zeros, the message's length in bits (big-endian) ending a block
    m[w] = 0x80;
    let blocks = (w + 9).div_ceil(64);
    m[blocks * 64 - 8..blocks * 64].copy_from_slice(&((w as u64) * 8).to_be_bytes());
    let mut state = SHA256_INIT;
    for block in m[..blocks * 64].chunks_exact(64) {
        sha2::compress256(
            &mut state,
            std::slice::from_ref(sha2::digest::generic_array::GenericArray::from_slice(block)),
        );
    }
    let mut out = [0u8; 32];
    for (o, word) in out.chunks_exact_mut(4).zip(state) {
        o.copy_from_slice(&word.to_be_bytes());
    }
    Some(out)
}

/// The digest of one unit (`chunk`) chained from `prev` (under 256 bytes), written through `buf`;
/// None when the unit falls outside the shape this module writes.
pub fn unit_digest(buf: &mut Vec<u8>, prev: &[u8], chunk: &[i64]) -> Option<[u8; 32]> {
    let unit = chunk.len();
    if let (Ok(prev), 1..=SMALL_UNIT) = (<&[u8; 32]>::try_from(prev), unit) {
        return small_unit(prev, chunk);
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The stack path against the general one (the pickle in a Vec, `Sha256::digest`), on ids of
    /// every width and units of 1 to 40 tokens; the general one is held to Python's pickle by
    /// `tests/property/test_native_token_hash.py`.
    #[test]
    fn the_small_unit_path_equals_the_general_one() {
        let general = |prev: &[u8], chunk: &[i64]| -> Option<[u8; 32]> {
            let mut buf = Vec::new();
            buf.extend_from_slice(&[PROTO, 5, FRAME, 0, 0, 0, 0, 0, 0, 0, 0, SHORT_BINBYTES]);
            buf.push(prev.len() as u8);
            buf.extend_from_slice(prev);
            buf.push(MEMOIZE);
            if chunk.len() > 3 {
                buf.push(MARK);
            }
            for &t in chunk {
                if !push_int(&mut buf, t) {
                    return None;
                }
            }
            buf.push(match chunk.len() {
                1 => TUPLE1,
                2 => TUPLE2,
                3 => TUPLE3,
                _ => TUPLE,
            });
            buf.extend_from_slice(&[MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP]);
            let framed = (buf.len() - 11) as u64;
            buf[3..11].copy_from_slice(&framed.to_le_bytes());
            Some(Sha256::digest(&buf).into())
        };
        let widths = [
            0i64,
            7,
            255,
            256,
            65535,
            65536,
            150_000,
            i32::MAX as i64,
            -1,
            i32::MIN as i64,
        ];
        let mut seed = 0x1234_5678_9abc_def1u64;
        for unit in 1..=40usize {
            for round in 0..20 {
                let chunk: Vec<i64> = (0..unit)
                    .map(|_| {
                        seed ^= seed << 13;
                        seed ^= seed >> 7;
                        seed ^= seed << 17;
                        widths[(seed % widths.len() as u64) as usize] - (round % 3) as i64
                    })
                    .collect();
                let prev = [round as u8; 32];
                let mut buf = Vec::new();
                assert_eq!(
                    unit_digest(&mut buf, &prev, &chunk),
                    general(&prev, &chunk),
                    "unit {unit}"
                );
            }
        }
        assert_eq!(small_unit(&[0; 32], &[1i64 << 40]), None);
    }
}
