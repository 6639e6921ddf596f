//! A `POST /route` body read without serde, for the bodies routers send (`ask.rs`): one JSON
//! object whose keys are the request's fields and whose values are plain integers, arrays of them
//! and short ASCII strings.
//!
//! Why: serde_json spends ~11 ns per token id (~23 µs of a 2 048-token request, a quarter of what
//! the native route costs per request); this loop ~2 ns. It accepts a strict subset of JSON and
//! gives up (None) on everything else: whitespace other than JSON's four, a float, an exponent, a
//! number of 19 digits or more, `null`, an escape or non-ASCII byte in a string, a nested value, a
//! key it does not know, a key twice, anything after the object. The caller then reads the body
//! with serde, so what is accepted here is read exactly as serde reads it and the rest is read as
//! before. `tests` below holds the two equal on generated and mutated bodies.
//!
//! One field is read here only: `block_hashes`, an object from group index to hashes, whose keys
//! are integers written as strings (msgspec's reading of `dict[int, ...]`). Only the plain
//! spelling of a key is taken (no sign, no leading zero, at most 18 digits) and no group twice
//! (msgspec would keep the last); a body with anything else is left to Python, which reads it
//! with msgspec. tests/unit/router/test_router_native_route.py holds this reading to Python's.

use crate::ask::{Request, Semantics, TokenText, UnitKey};
use crate::idtext::IdText;

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
    /// Token-id text read before (`idtext.rs`), where the caller keeps it.
    memo: Option<&'a IdText>,
    /// How many leading token ids the memo's newer generation spelled, and where reading went on.
    ids_text: Option<TokenText>,
}

impl<'a> Reader<'a> {
    #[inline]
    fn ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    #[inline]
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    #[inline]
    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.i += 1)
    }

    /// A JSON integer that fits in 18 digits (never overflows i64); None for anything else,
    /// a fraction or exponent after it included.
    #[inline]
    fn int(&mut self) -> Option<i64> {
        let neg = self.peek()? == b'-';
        if neg {
            self.i += 1;
        }
        let start = self.i;
        let v = self.key()?;
        // 19+ digits may not fit (serde reads those); serde reads `-0` as the float -0.0, which an
        // int field refuses
        if self.i - start > 18 || (neg && v == 0) {
            return None;
        }
        Some(if neg { -(v as i64) } else { v as i64 })
    }

    /// A JSON integer in [0, 2**64) (JSON has no leading zeros): vLLM's external block hashes
    /// mostly have 19 or 20 digits, past `int`'s 18 (before, nearly every unit-chain body went to
    /// serde for them). None for a sign, a leading zero, a fraction or exponent, or a value past
    /// u64 (serde refuses those keys).
    #[inline]
    fn key(&mut self) -> Option<u64> {
        let start = self.i;
        // A hash of 17 to 23 digits (nearly all of them) with 24 bytes of body left: its three
        // words read at once, each independently of the others, and joined in one step
        if let Some(b) = self.b.get(start..start + 24) {
            let word = |k: usize| u64::from_le_bytes(b[8 * k..8 * k + 8].try_into().expect("8"));
            let (x0, x1, x2) = (word(0), word(1), word(2));
            let n2 = leading_digits(x2);
            if leading_digits(x0) == 8 && leading_digits(x1) == 8 && (1..8).contains(&n2) {
                let tail = (x2 << (8 * (8 - n2))) | ((0x30 * ONES) >> (8 * n2));
                let v = (eight_value(x0) as u128 * 100_000_000 + eight_value(x1) as u128)
                    * POW10[n2] as u128
                    + eight_value(tail) as u128;
                let after = start + 16 + n2;
                if b[0] == b'0' || v > u64::MAX as u128 {
                    return None; // a leading zero; past u64
                }
                self.i = after;
                if let Some(b'.' | b'e' | b'E') = self.peek() {
                    return None;
                }
                return Some(v as u64);
            }
        }
        let mut v: u64 = 0;
        // eight digits at a time while they last (a 20-digit hash: two words and four bytes); a
        // byte-at-a-time loop spent ~1 ns a digit, ~3 µs of a 128-hash chain's decision
        while let Some(word) = self.b.get(self.i..self.i + 8) {
            let x = u64::from_le_bytes(word.try_into().expect("eight bytes"));
            let n = leading_digits(x);
            if n < 8 {
                // the last one to seven digits in one step too, as eight with leading zeros
                if n > 0 {
                    let padded = (x << (8 * (8 - n))) | ((0x30 * ONES) >> (8 * n));
                    v = v.checked_mul(POW10[n])?.checked_add(eight_value(padded))?;
                    self.i += n;
                }
                break;
            }
            v = v.checked_mul(100_000_000)?.checked_add(eight_value(x))?;
            self.i += 8;
        }
        // near the end of the body, a byte at a time
        while let Some(&c) = self.b.get(self.i) {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            v = v.checked_mul(10)?.checked_add(d as u64)?;
            self.i += 1;
        }
        let n = self.i - start;
        if n == 0 || (n > 1 && self.b[start] == b'0') {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = self.peek() {
            return None;
        }
        Some(v)
    }

    /// A string of printable ASCII without escapes.
    fn plain_str(&mut self) -> Option<&'a str> {
        self.eat(b'"')?;
        let start = self.i;
        while let Some(&c) = self.b.get(self.i) {
            if c == b'"' {
                let s = std::str::from_utf8(&self.b[start..self.i]).ok()?;
                self.i += 1;
                return Some(s);
            }
            if !(0x20..0x7f).contains(&c) || c == b'\\' {
                return None;
            }
            self.i += 1;
        }
        None
    }

    /// `[` items `]` with `item` reading each one.
    fn array<T>(&mut self, mut item: impl FnMut(&mut Self) -> Option<T>) -> Option<Vec<T>> {
        self.eat(b'[')?;
        // room for as many items as the rest of the body could hold at ~20 bytes each (hashes), up
        // to 1 024: one allocation where growing by doubling took eight for a 128-hash chain, and a
        // body of many small arrays never reserves more than 8 KiB a array ahead of its items
        let mut out = Vec::with_capacity(((self.b.len() - self.i) / 20).min(1024));
        self.ws();
        if self.eat(b']').is_some() {
            return Some(out);
        }
        loop {
            self.ws();
            out.push(item(self)?);
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b']' => {
                    self.i += 1;
                    return Some(out);
                }
                _ => return None,
            }
        }
    }
}

impl<'a> Reader<'a> {
    /// `{` `"key": value` pairs `}`, each value read by `field` (given its key); None where `field`
    /// gives up or the object is not plain JSON.
    fn object(&mut self, mut field: impl FnMut(&mut Self, &'a str) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.ws();
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            self.ws();
            let key = self.plain_str()?;
            self.ws();
            self.eat(b':')?;
            self.ws();
            field(self, key)?;
            self.ws();
            match self.peek()? {
                b',' => self.i += 1,
                b'}' => {
                    self.i += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }
}

const ONES: u64 = 0x0101_0101_0101_0101;

/// How many of `x`'s bytes, from the first (lowest address), are ASCII digits before another byte.
#[inline]
fn leading_digits(x: u64) -> usize {
    // a byte b is a digit when t = b ^ '0' is at most 9: no high nibble in t, none in t + 6. Bytes
    // before the first non-digit are digits, whose t + 6 carries nothing upwards, so that byte's
    // own test is exact (bytes after it may be flagged wrongly, and are not looked at)
    let t = x ^ (0x30 * ONES);
    let flagged = (t | t.wrapping_add(0x06 * ONES)) & (0xF0 * ONES);
    (flagged.trailing_zeros() / 8) as usize
}

/// 10^n for the digits of a partial word.
const POW10: [u64; 8] = [1, 10, 100, 1_000, 10_000, 100_000, 1_000_000, 10_000_000];

/// The number eight ASCII digits spell, the first one (lowest address) the most significant.
#[inline]
fn eight_value(x: u64) -> u64 {
    const MASK: u64 = 0x0000_00FF_0000_00FF;
    let v = x.wrapping_sub(0x30 * ONES);
    let v = v.wrapping_mul(10).wrapping_add(v >> 8);
    (((v & MASK).wrapping_mul(100 + (1_000_000 << 32)))
        .wrapping_add(((v >> 16) & MASK).wrapping_mul(1 + (10_000 << 32))))
        >> 32
}

impl Reader<'_> {
    /// `[` ints `]`: runs of plain ids by `plain_ints`; an id of up to 7 digits followed by `,` or
    /// `]` read 8 bytes at a time; any other item (a sign, whitespace, a longer number, near the end
    /// of the body) by `int`.
    fn int_array(&mut self) -> Option<Vec<i64>> {
        self.eat(b'[')?;
        // at least one byte per id and its comma: the body bounds the array
        let mut out = Vec::with_capacity((self.b.len() - self.i) / 2);
        self.ws();
        if self.eat(b']').is_some() {
            return Some(out);
        }
        if self.remembered_ids(&mut out) {
            return Some(out);
        }
        // items left to the loop below before the block reader is tried again (after it stopped
        // at once: a body with spaces after its commas would otherwise pay a block per item)
        let mut by_item = 0u32;
        loop {
            if by_item == 0 {
                let before = out.len();
                if self.plain_ints(&mut out) {
                    return Some(out);
                }
                by_item = if out.len() == before { 16 } else { 1 };
            }
            by_item -= 1;
            if let Some(word) = self.b.get(self.i..self.i + 8) {
                let x = u64::from_le_bytes(word.try_into().expect("8 bytes"));
                // a byte is a digit when its high nibble is 3 before and after adding 6; a carry
                // out of a byte >= 0xFA only turns the next byte's test false, never true
                let hi = 0xF0 * ONES;
                let three = 0x30 * ONES;
                let not_digit = ((x & hi) ^ three) | ((x.wrapping_add(6 * ONES) & hi) ^ three);
                let n = (not_digit.trailing_zeros() / 8) as usize;
                if (1..8).contains(&n) && (n == 1 || word[0] != b'0') {
                    let sep = word[n];
                    if sep == b',' || sep == b']' {
                        // the n digits moved to the top bytes, below them zeros: "000ddddd"
                        out.push(digits_value(
                            (x.wrapping_sub(0x30 * ONES)) << (64 - 8 * n as u32),
                        ));
                        self.i += n + 1;
                        if sep == b']' {
                            return Some(out);
                        }
                        continue;
                    }
                }
            }
            self.ws();
            out.push(self.int()?);
            self.ws();
            match self.peek()? {
                b',' => {
                    self.i += 1;
                    self.ws();
                }
                b']' => {
                    self.i += 1;
                    return Some(out);
                }
                _ => return None,
            }
        }
    }

    /// The leading ids the memo remembers the text of, into `out` (segment after segment while
    /// each gives a good run): true once the array's `]` is read. Notes how many the newer
    /// generation spelled and where the ids after them start, for the caller's admission.
    fn remembered_ids(&mut self, out: &mut Vec<i64>) -> bool {
        let mut text = TokenText {
            remembered: 0,
            resume: self.i,
        };
        let Some(memo) = self.memo else {
            self.ids_text = Some(text);
            return false;
        };
        let mut in_newer = true;
        loop {
            let t = memo.take(&self.b[self.i..], out);
            if t.ids == 0 {
                break;
            }
            self.i += t.bytes;
            in_newer &= t.newer;
            if in_newer {
                text.remembered = out.len();
                text.resume = self.i;
            }
            // a short partial run stops the lookups: each costs a hash and a compare, and a body
            // could otherwise make one per id
            if !(t.whole || t.ids >= crate::idtext::MARK_EVERY) || self.peek() == Some(b']') {
                break;
            }
        }
        self.ids_text = Some(text);
        !out.is_empty() && self.eat(b']').is_some()
    }

    /// Plain ids (1 to 7 digits, no leading zero, one `,` between them) from `self.i`, 64 bytes at
    /// a time: true once the array's `]` is read. Stops at the first item it does not take, with
    /// `self.i` at that item's first byte and every earlier id in `out`.
    ///
    /// Why: the word loop above carries each id's end into the next id's load, ~6 ns an id (52 µs
    /// of an 8 192-id body). Here the commas of a block come from one mask and each id is read from
    /// the 8 bytes ending at its comma, so the ids of a block are independent work for the core.
    fn plain_ints(&mut self, out: &mut Vec<i64>) -> bool {
        let b = self.b;
        let mut start = self.i;
        let mut base = start;
        while let Some(block) = b.get(base..base + 64) {
            let (commas, digits) = classify(block.try_into().expect("64 bytes"));
            let other = !(commas | digits);
            let stop = other.trailing_zeros() as usize;
            let mut c = if stop == 64 {
                commas
            } else {
                commas & ((1u64 << stop) - 1)
            };
            // a block ends at most 32 ids (each separator of the block but the first has a digit
            // before it in the block): written into spare capacity and counted once, so the
            // vector's length is not stored back to memory on every id
            out.reserve(32);
            let len = out.len();
            let spare = &mut out.spare_capacity_mut()[..32];
            let mut k = 0;
            let mut taken = true;
            while c != 0 {
                let p = base + c.trailing_zeros() as usize;
                c &= c - 1;
                let Some(v) = plain_int(b, start, p) else {
                    taken = false;
                    break;
                };
                spare[k].write(v);
                k += 1;
                start = p + 1;
            }
            let mut closed = false;
            if taken && stop < 64 {
                let p = base + stop;
                if let (b']', Some(v)) = (b[p], plain_int(b, start, p)) {
                    spare[k].write(v);
                    k += 1;
                    start = p + 1;
                    closed = true;
                }
            }
            // SAFETY: the first k elements of the spare capacity were written just above
            unsafe { out.set_len(len + k) };
            if !taken || stop < 64 {
                self.i = start;
                return closed;
            }
            base += 64;
        }
        self.i = start;
        false
    }
}

/// Bit k of the first mask: byte k of `block` is `,`; of the second: it is a digit.
#[cfg(target_arch = "x86_64")]
#[inline]
fn classify(block: &[u8; 64]) -> (u64, u64) {
    use std::arch::x86_64::*;
    // SAFETY: SSE2 is part of every x86_64 CPU; the four unaligned loads read inside `block`.
    unsafe {
        let comma = _mm_set1_epi8(b',' as i8);
        let zero = _mm_set1_epi8(b'0' as i8);
        let nine = _mm_set1_epi8(9);
        let (mut c, mut d) = (0u64, 0u64);
        for k in 0..4 {
            let x = _mm_loadu_si128(block.as_ptr().add(16 * k) as *const __m128i);
            let y = _mm_sub_epi8(x, zero);
            // a digit is a byte whose distance from '0', unsigned, is at most 9
            let digit = _mm_cmpeq_epi8(_mm_min_epu8(y, nine), y);
            c |= (_mm_movemask_epi8(_mm_cmpeq_epi8(x, comma)) as u16 as u64) << (16 * k);
            d |= (_mm_movemask_epi8(digit) as u16 as u64) << (16 * k);
        }
        (c, d)
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn classify(block: &[u8; 64]) -> (u64, u64) {
    let (mut c, mut d) = (0u64, 0u64);
    for (k, &x) in block.iter().enumerate() {
        c |= ((x == b',') as u64) << k;
        d |= (x.is_ascii_digit() as u64) << k;
    }
    (c, d)
}

/// The id in `b[start..p]` (digits only, `p` a separator) when it has 1 to 7 digits and no leading
/// zero.
#[inline]
fn plain_int(b: &[u8], start: usize, p: usize) -> Option<i64> {
    let n = p.wrapping_sub(start);
    if !(1..8).contains(&n) || p < 8 {
        return None;
    }
    // the 8 bytes ending at the separator: the digits in the top n bytes, most significant first,
    // as the word loop's "000ddddd" after its shift
    let x = u64::from_le_bytes(b[p - 8..p].try_into().expect("8 bytes"));
    let shift = 8 * (8 - n) as u32;
    if n > 1 && (x >> shift) as u8 == b'0' {
        return None;
    }
    Some(digits_value((x ^ (0x30 * ONES)) & (!0u64 << shift)))
}

/// The number in `v`: digit values (0-9) one a byte, the most significant in the lowest nonzero
/// byte, zeros below it (up to 7 digits).
#[inline]
fn digits_value(v: u64) -> i64 {
    let v = v.wrapping_mul(10).wrapping_add(v >> 8);
    const MASK: u64 = 0x0000_00FF_0000_00FF;
    let v = ((v & MASK)
        .wrapping_mul(100 + (1_000_000 << 32))
        .wrapping_add(((v >> 16) & MASK).wrapping_mul(1 + (10_000 << 32))))
        >> 32;
    v as u32 as i64
}

/// Groups a block-hash request may name and still be read here.
const MAX_GROUPS: usize = 64;

/// Earlier lists a block-hash list is compared with, byte for byte, before it is read (a model's
/// groups come in a few block sizes).
const SAME_LIST_TRIES: usize = 4;

/// `{"<group>": [hashes], ...}`, sorted by group; None for a key not plainly written, a group
/// twice, more than `MAX_GROUPS` groups, or a hash `unit_key` does not take.
fn group_lists(r: &mut Reader) -> Option<Vec<(u64, Vec<UnitKey>)>> {
    let mut out: Vec<(u64, Vec<UnitKey>)> = Vec::new();
    // each list's bytes (its `[` to its `]`), by its place in `out`
    let mut spans: Vec<(usize, usize)> = Vec::new();
    r.object(|r, key| {
        // more groups than any layout has: Python's to answer (the check for a group twice below
        // stays small, and so do the reasons a misfit row quotes the groups in)
        if out.len() == MAX_GROUPS {
            return None;
        }
        let key = key.as_bytes();
        let plain = !key.is_empty()
            && key.len() <= 18
            && key.iter().all(u8::is_ascii_digit)
            && (key.len() == 1 || key[0] != b'0');
        if !plain {
            return None;
        }
        let group = key.iter().fold(0u64, |v, &d| v * 10 + (d - b'0') as u64);
        let start = r.i;
        // Groups with one block size have one list (their block hashes come from one chain), so a
        // router sends the same bytes for each: a list byte for byte equal to one read before is
        // that list again, read once (~5 ns a hash). Only the first few lists are compared: a body
        // of many long lists that differ at their ends would otherwise cost a compare of each
        // against every earlier one (64 groups: ~2 000 compares), where this is a few per byte
        let same = spans.iter().take(SAME_LIST_TRIES).position(|&(s, e)| {
            let n = e - s;
            r.b.get(start..start + n) == Some(&r.b[s..e])
        });
        let keys = match same {
            Some(j) => {
                r.i += spans[j].1 - spans[j].0;
                out[j].1.iter().map(|k| UnitKey(k.0)).collect()
            }
            None => r.array(unit_key)?,
        };
        if out.iter().any(|(g, _)| *g == group) {
            return None;
        }
        spans.push((start, r.i));
        out.push((group, keys));
        Some(())
    })?;
    out.sort_unstable_by_key(|(g, _)| *g);
    Some(out)
}

fn unit_key(r: &mut Reader) -> Option<UnitKey> {
    match r.peek()? {
        b'"' => UnitKey::from_hex(r.plain_str()?),
        // a key is never negative (serde: refused)
        b'-' => None,
        _ => r.key().map(UnitKey),
    }
}

/// The request `body` holds when it is one this reader takes, else None (read it with serde).
#[cfg(test)]
pub(crate) fn read(body: &[u8]) -> Option<Request> {
    read_with(body, None)
}

/// `read`, with the token ids' leading text taken from `memo` as far as it spells them.
pub(crate) fn read_with(body: &[u8], memo: Option<&IdText>) -> Option<Request> {
    let mut r = Reader {
        b: body,
        i: 0,
        memo,
        ids_text: None,
    };
    let mut req = Request::default();
    let mut seen = 0u8;
    r.ws();
    r.object(|r, key| {
        let bit = match key {
            "token_ids" => {
                req.token_ids = Some(r.int_array()?);
                1
            }
            "unit_hashes" => {
                req.unit_hashes = Some(r.array(unit_key)?);
                2
            }
            "hash_block_size" => {
                req.hash_block_size = Some(r.int()?);
                4
            }
            "block_hashes" => {
                req.block_hashes = Some(group_lists(r)?);
                64
            }
            "num_tokens" => {
                req.num_tokens = Some(r.int()?);
                8
            }
            "top_k" => {
                req.top_k = Some(r.int()?);
                16
            }
            "semantics" => {
                req.semantics = match r.plain_str()? {
                    "hma" => Semantics::Hma,
                    "prefix-per-group" => Semantics::PrefixPerGroup,
                    _ => return None,
                };
                32
            }
            _ => return None,
        };
        if seen & bit != 0 {
            return None;
        }
        seen |= bit;
        Some(())
    })?;
    r.ws();
    req.token_text = r.ids_text;
    (r.i == body.len()).then_some(req)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `key` against Rust's own u64 parse: every length from 1 to 22 digits, the edges of u64,
    /// leading zeros, random u64s; each number followed by each kind of byte, at several distances
    /// from the body's end.
    #[test]
    fn keys_read_as_u64_parse_reads_them() {
        let mut next = crate::testrng::xorshift(0x2545_f491_4f6c_dd1d);
        let mut numbers: Vec<String> = [
            "0",
            "00",
            "01",
            "7",
            "10",
            "99999999",
            "100000000",
            "18446744073709551615",
            "18446744073709551616",
            "18446744073709551625",
            "28446744073709551615",
            "99999999999999999999",
            "10000000000000000000",
            "9999999999999999999",
            "012345678901234567",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for len in 1..=22 {
            for _ in 0..40 {
                let mut n = ((next() % 9) + 1).to_string();
                while n.len() < len {
                    n.push((b'0' + (next() % 10) as u8) as char);
                }
                numbers.push(n);
            }
        }
        for _ in 0..400 {
            numbers.push(next().to_string()); // vLLM's hashes: any u64
        }
        for num in &numbers {
            for tail in ["", ",", "]", " ", "x", ".5", "e3", "E3", ",123456789012"] {
                for filler in 0..9 {
                    let body = format!("{num}{tail}{}", "]".repeat(filler));
                    let mut r = Reader {
                        memo: None,
                        ids_text: None,
                        b: body.as_bytes(),
                        i: 0,
                    };
                    let got = r.key();
                    let fraction = tail.starts_with(['.', 'e', 'E']);
                    let want = if fraction || (num.len() > 1 && num.starts_with('0')) {
                        None
                    } else {
                        num.parse::<u64>().ok()
                    };
                    assert_eq!(got, want, "{body:?}");
                    if got.is_some() {
                        assert_eq!(r.i, num.len(), "{body:?}");
                    }
                }
            }
        }
    }

    /// What serde reads, in a comparable form (None: serde refuses the body).
    fn serde_view(body: &[u8]) -> Option<String> {
        serde_json::from_slice::<Request>(body)
            .ok()
            .map(|r| r.debug())
    }

    fn fast_view(body: &[u8]) -> Option<String> {
        read(body).map(|r| r.debug())
    }

    /// Whenever the fast reader takes a body, serde reads the same request from it.
    fn check(body: &[u8]) -> bool {
        let fast = fast_view(body);
        if fast.is_some() {
            assert_eq!(
                fast,
                serde_view(body),
                "body {:?}",
                String::from_utf8_lossy(body)
            );
        }
        fast.is_some()
    }

    #[test]
    fn common_bodies_are_taken_and_equal() {
        for body in [
            &br#"{"token_ids":[1,2,3],"top_k":1}"#[..],
            br#" { "token_ids" : [ 0 , -5 , 150000 ] , "semantics" : "prefix-per-group" } "#,
            br#"{"unit_hashes":[18446744073709551,"0x00ff","0xABCDEF0123456789ab"],"hash_block_size":16,"num_tokens":48}"#,
            br#"{"token_ids":[],"top_k":-3}"#,
            br#"{"unit_hashes":[18446744073709551615,1000000000000000000,9999999999999999999,0],"hash_block_size":16,"num_tokens":64}"#,
            b"{}",
            b"{\"token_ids\":[1]}\n",
            br#"{"semantics":"hma","token_ids":[7]}"#,
        ] {
            assert!(check(body), "{:?}", String::from_utf8_lossy(body));
        }
    }

    /// Block hashes are read here only (serde leaves them to Python): each group once, by its plain
    /// decimal key, sorted; anything else gives up.
    /// Eight digits at a time: every word of digits, and none with another byte in it.
    #[test]
    fn eight_digit_words_read_as_their_number() {
        let mut next = crate::testrng::xorshift(0x0123_4567_89ab_cdef);
        for _ in 0..20_000 {
            let n = next() % 100_000_000;
            let text = format!("{n:08}");
            let x = u64::from_le_bytes(text.as_bytes().try_into().unwrap());
            assert_eq!(leading_digits(x), 8, "{text}");
            assert_eq!(eight_value(x), n, "{text}");
            // any byte after the first non-digit, digit or not, leaves the count where it is
            let mut bytes = text.into_bytes();
            let at = (next() % 8) as usize;
            bytes[at] = loop {
                let c = (next() % 256) as u8;
                if !c.is_ascii_digit() {
                    break c;
                }
            };
            for b in &mut bytes[at + 1..] {
                *b = (next() % 256) as u8;
            }
            assert_eq!(
                leading_digits(u64::from_le_bytes(bytes.try_into().unwrap())),
                at
            );
        }
    }

    #[test]
    fn block_hashes_are_read_by_group_and_odd_keys_give_up() {
        let body =
            br#"{"num_tokens":48, "block_hashes" : { "2" : [7, "0x0a"], "0":[1,2,3],"10":[]}}"#;
        let lists = |body: &[u8]| -> Vec<(u64, Vec<u64>)> {
            read(body)
                .expect("taken")
                .block_hashes
                .expect("read")
                .into_iter()
                .map(|(g, keys)| (g, keys.into_iter().map(|k| k.0).collect()))
                .collect()
        };
        assert_eq!(
            lists(body),
            vec![(0, vec![1, 2, 3]), (2, vec![7, 10]), (10, vec![])]
        );
        assert_eq!(read(body).expect("taken").num_tokens, Some(48));
        assert!(serde_view(body).is_none(), "serde never takes them");
        // a list written as an earlier one is read as that one; one that only starts like it is not
        let body =
            br#"{"block_hashes":{"0":[1,2,3],"1":[1,2,3],"2":[1,2,3,4],"3":[1,2],"4":[1,2,3]}}"#;
        assert_eq!(
            lists(body),
            vec![
                (0, vec![1, 2, 3]),
                (1, vec![1, 2, 3]),
                (2, vec![1, 2, 3, 4]),
                (3, vec![1, 2]),
                (4, vec![1, 2, 3])
            ]
        );
        // the same group twice is refused, written alike or not
        assert!(read(br#"{"block_hashes":{"0":[1],"0":[1]}}"#).is_none());
        let many = |n: usize| {
            let groups: Vec<String> = (0..n).map(|g| format!(r#""{g}":[1]"#)).collect();
            format!(
                r#"{{"block_hashes":{{{}}},"num_tokens":16}}"#,
                groups.join(",")
            )
        };
        assert!(read(many(MAX_GROUPS).as_bytes()).is_some());
        assert!(read(many(MAX_GROUPS + 1).as_bytes()).is_none());
        for key in [
            "00",
            "-1",
            "+1",
            " 1",
            "1.0",
            "",
            "0x1",
            "1234567890123456789",
        ] {
            let odd = format!(r#"{{"block_hashes":{{"{key}":[1]}},"num_tokens":16}}"#);
            assert!(read(odd.as_bytes()).is_none(), "{key:?}");
        }
        for odd in [
            &br#"{"block_hashes":{"0":[1],"0":[2]},"num_tokens":16}"#[..],
            br#"{"block_hashes":{"0":[1]},"block_hashes":{"1":[2]}}"#,
            br#"{"block_hashes":{"0":[-1]}}"#,
            br#"{"block_hashes":{"0":1}}"#,
            br#"{"block_hashes":[[1]]}"#,
            br#"{"block_hashes":{"0":[1],}}"#,
        ] {
            assert!(read(odd).is_none(), "{:?}", String::from_utf8_lossy(odd));
        }
    }

    #[test]
    fn unusual_bodies_go_to_serde() {
        for body in [
            &br#"{"token_ids":[1.0]}"#[..],
            br#"{"token_ids":[1e3]}"#,
            br#"{"token_ids":[01]}"#,
            br#"{"token_ids":[-0]}"#,
            br#"{"token_ids":[1234567890123456789]}"#,
            br#"{"token_ids":null}"#,
            br#"{"token_ids":[1],"token_ids":[2]}"#,
            br#"{"token_ids":[1],"zz":1}"#,
            br#"{"token\u005fids":[1]}"#,
            br#"{"token_ids":[1]} x"#,
            br#"{"token_ids":[1],}"#,
            br#"{"token_ids":[1,]}"#,
            br#"{"semantics":"HMA"}"#,
            br#"{"unit_hashes":[-1]}"#,
            br#"{"unit_hashes":[-0]}"#,
            br#"{"unit_hashes":[18446744073709551616]}"#,
            br#"{"unit_hashes":[99999999999999999999]}"#,
            br#"{"unit_hashes":[1.5]}"#,
            br#"{"unit_hashes":[012]}"#,
            br#"{"unit_hashes":["0x1"]}"#,
            b"{\"token_ids\":[1]\x0c}",
            br#"[1,2]"#,
            br#"{"top_k":"1"}"#,
            b"",
        ] {
            assert!(!check(body), "{:?}", String::from_utf8_lossy(body));
        }
    }

    /// Long arrays (many 64-byte blocks, ids of 1 to 19 digits), whole and with one byte changed.
    #[test]
    fn long_arrays_read_as_serde_reads_them() {
        let mut rnd = crate::testrng::below(0x2545_f491_4f6c_dd1d);
        let alphabet = b",]0123456789 -.e\n";
        for round in 0..400 {
            let ids: Vec<String> = (0..1 + rnd(300))
                .map(|_| {
                    let digits = 1 + rnd(if round % 4 == 0 { 19 } else { 7 }) as u32;
                    (rnd(10u64.pow(digits))).to_string()
                })
                .collect();
            let body = format!("{{\"top_k\":1,\"token_ids\":[{}]}}", ids.join(","));
            let b = body.into_bytes();
            let want: Vec<i64> = ids.iter().map(|x| x.parse().unwrap_or(-1)).collect();
            if ids.iter().all(|x| x.len() <= 18) {
                assert!(check(&b));
                assert_eq!(read(&b).unwrap().token_ids.unwrap(), want);
            }
            for _ in 0..20 {
                let i = 13 + rnd(b.len() as u64 - 14) as usize;
                let mut sub = b.clone();
                sub[i] = alphabet[rnd(alphabet.len() as u64) as usize];
                check(&sub);
                let mut del = b.clone();
                del.remove(i);
                check(&del);
            }
        }
    }

    /// The block reader at every offset of the array against the 64-byte blocks, with zeros, ids
    /// of every plain width and ids it leaves to the word loop (8 digits, spaces after commas).
    #[test]
    fn ids_read_at_every_block_offset() {
        let plain: Vec<i64> = (0..300)
            .map(|i: i64| {
                [0, 7, 42, 999, 1000, 65535, 150_000, 9_999_999][(i % 8) as usize] + i % 3
            })
            .collect();
        let wide: Vec<i64> = plain.iter().map(|&x| x * 10 + 12_345_678).collect();
        for pad in 0..64 {
            let space = " ".repeat(pad);
            for (ids, sep) in [(&plain, ","), (&plain, ", "), (&wide, ",")] {
                let list: Vec<String> = ids.iter().map(|x| x.to_string()).collect();
                let body = format!(
                    "{{\"semantics\":\"hma\",\"top_k\":1,{space}\"token_ids\":[{}]}}",
                    list.join(sep)
                );
                let b = body.as_bytes();
                assert!(check(b));
                assert_eq!(&read(b).unwrap().token_ids.unwrap(), ids);
            }
        }
    }

    /// Generated bodies, then every one-byte deletion, duplication and substitution of them.
    #[test]
    fn mutated_bodies_read_as_serde_reads_them() {
        let mut rnd = crate::testrng::below(0x9e37_79b9_7f4a_7c15);
        let alphabet = b"{}[]\":,-0123456789 .eE\n\tx\\ak";
        let mut taken = 0;
        for _ in 0..300 {
            let mut body = String::from("{");
            let mut parts = Vec::new();
            if rnd(2) == 0 {
                let ids: Vec<String> = (0..rnd(6))
                    .map(|_| (rnd(300) as i64 - 20).to_string())
                    .collect();
                parts.push(format!("\"token_ids\":[{}]", ids.join(",")));
            } else {
                let ks: Vec<String> = (0..rnd(4))
                    .map(|_| {
                        if rnd(2) == 0 {
                            rnd(1 << 40).to_string()
                        } else {
                            format!("\"0x{:04x}\"", rnd(65536))
                        }
                    })
                    .collect();
                parts.push(format!("\"unit_hashes\":[{}]", ks.join(",")));
                parts.push(format!("\"hash_block_size\":{}", rnd(20)));
                parts.push(format!("\"num_tokens\":{}", rnd(100)));
            }
            if rnd(2) == 0 {
                parts.push(format!("\"top_k\":{}", rnd(5)));
            }
            if rnd(3) == 0 {
                parts.push("\"semantics\":\"prefix-per-group\"".into());
            }
            body.push_str(&parts.join(","));
            body.push('}');
            let b = body.into_bytes();
            taken += check(&b) as usize;
            for i in 0..b.len() {
                let mut del = b.clone();
                del.remove(i);
                check(&del);
                let mut dup = b.clone();
                dup.insert(i, b[i]);
                check(&dup);
                let mut sub = b.clone();
                sub[i] = alphabet[rnd(alphabet.len() as u64) as usize];
                check(&sub);
            }
        }
        assert_eq!(taken, 300);
    }

    /// With the id-text memo holding prefixes of the ids, every body reads as it does without it:
    /// the same request or the same refusal, on the plain body and on each byte deleted, doubled or
    /// replaced around the remembered text's edges (`idtext.rs` holds the memo's own rules).
    #[test]
    fn remembered_id_text_reads_as_plain_reading_does() {
        let mut rnd = crate::testrng::below(0x1d7e_c0de);
        let alphabet = b"[],0123456789 -x";
        let mut remembered = 0u64;
        for case in 0..200 {
            let n = 20 + rnd(200) as usize;
            let ids: Vec<i64> = (0..n).map(|_| rnd(200_000) as i64).collect();
            let text = ids
                .iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",");
            let memo = crate::idtext::IdText::new(1 << 14);
            // a held prefix, and a later segment starting where it ends
            let held = 1 + rnd(n as u64) as usize;
            memo.admit(text.as_bytes(), &ids[..held]);
            let cut = text
                .match_indices(',')
                .nth(held - 1)
                .map_or(text.len(), |(i, _)| i + 1);
            if cut < text.len() {
                memo.admit(&text.as_bytes()[cut..], &ids[held..]);
            }
            let body = format!(r#"{{"top_k":1,"token_ids":[{text}]}}"#).into_bytes();
            let with = |b: &[u8]| read_with(b, Some(&memo)).map(|r| r.debug());
            assert_eq!(with(&body), fast_view(&body), "case {case}");
            assert!(with(&body).is_some());
            remembered += memo.stats().taken;
            // mutations near the start, around the held prefix's end and near the array's end
            let start = body.iter().position(|&c| c == b'[').unwrap() + 1;
            let spots = [start, start + cut.saturating_sub(1), body.len() - 3];
            for &spot in &spots {
                for i in spot.saturating_sub(3)..(spot + 3).min(body.len()) {
                    let mut del = body.clone();
                    del.remove(i);
                    let mut dup = body.clone();
                    dup.insert(i, body[i]);
                    let mut sub = body.clone();
                    sub[i] = alphabet[rnd(alphabet.len() as u64) as usize];
                    for b in [del, dup, sub] {
                        assert_eq!(
                            with(&b),
                            fast_view(&b),
                            "case {case}: {:?}",
                            String::from_utf8_lossy(&b)
                        );
                    }
                }
            }
        }
        assert!(remembered > 0);
    }
}
