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

use crate::ask::{Request, Semantics, UnitKey};

struct Reader<'a> {
    b: &'a [u8],
    i: usize,
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
        let mut v: i64 = 0;
        while let Some(&c) = self.b.get(self.i) {
            let d = c.wrapping_sub(b'0');
            if d > 9 {
                break;
            }
            v = v * 10 + d as i64;
            self.i += 1;
        }
        let n = self.i - start;
        // JSON has no leading zeros; 19+ digits may not fit (serde reads those)
        if n == 0 || n > 18 || (n > 1 && self.b[start] == b'0') {
            return None;
        }
        // serde reads `-0` as the float -0.0, which an int field refuses
        if neg && v == 0 {
            return None;
        }
        if let Some(b'.' | b'e' | b'E') = self.peek() {
            return None;
        }
        Some(if neg { -v } else { v })
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
        let mut out = Vec::new();
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

const ONES: u64 = 0x0101_0101_0101_0101;

impl Reader<'_> {
    /// `[` ints `]`: each id of up to 7 digits followed by `,` or `]` read 8 bytes at a time; any
    /// other item (a sign, whitespace, a longer number, near the end of the body) by `int`.
    fn int_array(&mut self) -> Option<Vec<i64>> {
        self.eat(b'[')?;
        // at least one byte per id and its comma: the body bounds the array
        let mut out = Vec::with_capacity((self.b.len() - self.i) / 2);
        self.ws();
        if self.eat(b']').is_some() {
            return Some(out);
        }
        loop {
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
                        let v = (x.wrapping_sub(0x30 * ONES)) << (64 - 8 * n as u32);
                        let v = v.wrapping_mul(10).wrapping_add(v >> 8);
                        const MASK: u64 = 0x0000_00FF_0000_00FF;
                        let v = ((v & MASK)
                            .wrapping_mul(100 + (1_000_000 << 32))
                            .wrapping_add(((v >> 16) & MASK).wrapping_mul(1 + (10_000 << 32))))
                            >> 32;
                        out.push(v as u32 as i64);
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
}

fn unit_key(r: &mut Reader) -> Option<UnitKey> {
    match r.peek()? {
        b'"' => UnitKey::from_hex(r.plain_str()?),
        // a key is never negative (serde: refused)
        b'-' => None,
        _ => r.int().map(|v| UnitKey(v as u64)),
    }
}

/// The request `body` holds when it is one this reader takes, else None (read it with serde).
pub(crate) fn read(body: &[u8]) -> Option<Request> {
    let mut r = Reader { b: body, i: 0 };
    let mut req = Request::default();
    let mut seen = 0u8;
    r.ws();
    r.eat(b'{')?;
    r.ws();
    if r.eat(b'}').is_none() {
        loop {
            r.ws();
            let key = r.plain_str()?;
            r.ws();
            r.eat(b':')?;
            r.ws();
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
            r.ws();
            match r.peek()? {
                b',' => r.i += 1,
                b'}' => {
                    r.i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    r.ws();
    (r.i == body.len()).then_some(req)
}

#[cfg(test)]
mod tests {
    use super::*;

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
            b"{}",
            b"{\"token_ids\":[1]}\n",
            br#"{"semantics":"hma","token_ids":[7]}"#,
        ] {
            assert!(check(body), "{:?}", String::from_utf8_lossy(body));
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
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
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

    /// Generated bodies, then every one-byte deletion, duplication and substitution of them.
    #[test]
    fn mutated_bodies_read_as_serde_reads_them() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
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
}
