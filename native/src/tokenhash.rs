//! vLLM's default block hash over a prompt's chain of full units (`gpu/hashing.py`: SHA-256 of
//! pickle protocol 5 of `(parent digest, tuple(token ids), None)`), built from the token ids
//! without a Python object per unit. Pickle's output for that object graph is fixed: the protocol
//! and one frame, the parent as short bytes, the tokens as a tuple of small ints (each the
//! narrowest of pickle's 1-, 2- and signed 4-byte forms), None, a 3-tuple, each container
//! memoized. Anything outside that shape (a token needing pickle's long form, a parent of 256
//! bytes or more, a frame past pickle's 64 KiB frame target) is left to the Python reference, and
//! `tests/property/test_native_token_hash.py` holds the two equal.

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

/// Messages whose blocks fit in this many bytes are written on the stack (a 32-byte parent and up to
/// ~40 ids: the header and tail are 19 bytes, an id at most 5, SHA's padding at least 9).
const STACK_BYTES: usize = 256;
const SHA256_INIT: [u32; 8] = [
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
];

/// The digest of one unit (`chunk`) chained from `prev` (under 256 bytes); `buf` holds the message
/// when it does not fit on the stack. None when the unit falls outside the shape this module writes.
///
/// The pickle and SHA's padding are written into one buffer and compressed in place: no hasher state
/// copying the message into a block buffer of its own (about half of what the hash cost beside the
/// compression itself went to building the message and to that copy).
pub fn unit_digest(buf: &mut Vec<u8>, prev: &[u8], chunk: &[i64]) -> Option<[u8; 32]> {
    if chunk.is_empty() || prev.len() >= 256 {
        return None;
    }
    // the longest message these ids can make, padded to whole blocks
    let most = (13 + prev.len() + 2 + 5 * chunk.len() + 6 + 9).div_ceil(64) * 64;
    if most <= STACK_BYTES {
        let mut m = [0u8; STACK_BYTES];
        let w = write_unit(&mut m, prev, chunk)?;
        Some(compress_padded(&mut m, w))
    } else {
        buf.clear();
        buf.resize(most, 0);
        let w = write_unit(buf, prev, chunk)?;
        Some(compress_padded(buf, w))
    }
}

/// Pickle protocol 5 of `(prev, tuple(chunk), None)` into `m` (zeroed, long enough for 5 bytes an
/// id), returning its length; None for an id past the 4-byte form or a frame past pickle's target.
fn write_unit(m: &mut [u8], prev: &[u8], chunk: &[i64]) -> Option<usize> {
    m[..3].copy_from_slice(&[PROTO, 5, FRAME]);
    // m[3..11]: the frame's length, below
    m[11] = SHORT_BINBYTES;
    m[12] = prev.len() as u8;
    let mut w = 13 + prev.len();
    m[13..w].copy_from_slice(prev);
    m[w] = MEMOIZE;
    w += 1;
    if chunk.len() > 3 {
        m[w] = MARK;
        w += 1;
    }
    // Each id in the narrowest of pickle's 1-, 2- and signed 4-byte forms, chosen without a branch:
    // vocabularies past 65 535 ids mix 2- and 4-byte forms at random, and a test per id mispredicted
    // about every other one. All 4 bytes are written; the next id (or the tail, 6 bytes) overwrites
    // what a narrower form leaves past its end.
    const OP: [u8; 3] = [BININT1, BININT2, BININT];
    const LEN: [usize; 3] = [2, 3, 5];
    let mut outside = false;
    for &t in chunk {
        let form = usize::from(!(0..=0xff).contains(&t)) + usize::from(!(0..=0xffff).contains(&t));
        outside |= t != t as i32 as i64;
        m[w] = OP[form];
        m[w + 1..w + 5].copy_from_slice(&(t as i32).to_le_bytes());
        w += LEN[form];
    }
    if outside {
        return None;
    }
    m[w] = match chunk.len() {
        1 => TUPLE1,
        2 => TUPLE2,
        3 => TUPLE3,
        _ => TUPLE,
    };
    m[w + 1..w + 6].copy_from_slice(&[MEMOIZE, NONE, TUPLE3, MEMOIZE, STOP]);
    w += 6;
    let framed = w - 11;
    if framed >= FRAME_TARGET {
        return None;
    }
    m[3..11].copy_from_slice(&(framed as u64).to_le_bytes());
    Some(w)
}

/// SHA-256 of the first `w` bytes of `m`, padded in place (`m` zeroed past `w`, long enough for the
/// padding).
fn compress_padded(m: &mut [u8], w: usize) -> [u8; 32] {
    // 0x80, zeros, the message's length in bits (big-endian) ending a block
    m[w] = 0x80;
    let end = (w + 9).div_ceil(64) * 64;
    m[end - 8..end].copy_from_slice(&((w as u64) * 8).to_be_bytes());
    let mut state = SHA256_INIT;
    for block in m[..end].chunks_exact(64) {
        sha2::compress256(
            &mut state,
            std::slice::from_ref(sha2::digest::generic_array::GenericArray::from_slice(block)),
        );
    }
    let mut out = [0u8; 32];
    for (o, word) in out.chunks_exact_mut(4).zip(state) {
        o.copy_from_slice(&word.to_be_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha2::{Digest, Sha256};

    /// The padding and the compression in place against sha2's own hasher over the same message, on
    /// stack and heap buffers and every id width (the message itself is held to Python's pickle by
    /// `tests/property/test_native_token_hash.py`).
    #[test]
    fn the_digest_is_sha256_of_the_written_message() {
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
        let mut next = crate::testrng::xorshift(0x1234_5678_9abc_def1);
        for unit in (1..=48usize).chain([200, 1000]) {
            for round in 0..10 {
                let chunk: Vec<i64> = (0..unit)
                    .map(|_| widths[(next() % widths.len() as u64) as usize] - (round % 3) as i64)
                    .collect();
                let prev = vec![round as u8; if round % 2 == 0 { 32 } else { 7 }];
                let mut m = vec![0u8; 13 + prev.len() + 2 + 5 * unit + 6 + 72];
                let Some(w) = write_unit(&mut m, &prev, &chunk) else {
                    assert!(chunk
                        .iter()
                        .any(|&t| t < i32::MIN as i64 || t > i32::MAX as i64));
                    continue;
                };
                let want: [u8; 32] = Sha256::digest(&m[..w]).into();
                let mut buf = Vec::new();
                assert_eq!(
                    unit_digest(&mut buf, &prev, &chunk),
                    Some(want),
                    "unit {unit}"
                );
            }
        }
        assert_eq!(unit_digest(&mut Vec::new(), &[0; 32], &[1i64 << 40]), None);
    }
}
