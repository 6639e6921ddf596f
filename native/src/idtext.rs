//! Token-id text the route decision read before, remembered with the ids it spells, so that a
//! prompt whose leading ids were sent before is not read digit by digit again (`askread.rs`).
//!
//! Why: once a held prefix's digests come from `hashmemo.rs`, reading the ids is the largest part
//! of a token-id decision that is not the search: ~3.5 ns an id, ~7 µs of a 2 048-id decision and
//! ~25 µs of an 8 192-id one on the bench's fleets (BENCHMARKS.md).
//!
//! Exact by construction: equal bytes spell equal ids. A segment is used only as far as the
//! body's bytes equal it byte for byte, and an id is taken only when the body has a separator
//! (`,` or `]`) right after it, as the segment does; so what is taken is what reading those bytes
//! gives, and the reader goes on from the first byte not taken.
//!
//! What is remembered: only *canonical* text (ids of 1 to 10 digits, no leading zero, each below
//! 2^32, one `,` between two ids, nothing else), and like `hashmemo.rs` only the ids of the
//! longest prefix some node was found to hold, so prompts nobody holds never enter. A segment is
//! found by a hash of its first `KEY_BYTES` bytes; where a prompt goes on past a segment, another
//! segment may start there (a later admission of a longer held prefix adds it). Bounded by ids:
//! two generations of at most half the capacity each (`generations.rs`), the older dropped whole when the newer
//! fills (no per-hit write).

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use foldhash::fast::RandomState;

use crate::generations::Generations;

/// Bytes of text a segment is found by; text shorter than this is never remembered (it reads in
/// well under a microsecond).
pub const KEY_BYTES: usize = 64;

/// Ids between two marks: a partly equal segment finds its last intact id from the nearest mark
/// below the first differing byte, a short scan.
pub(crate) const MARK_EVERY: usize = 16;

struct Segment {
    text: Box<[u8]>,
    ids: Box<[u32]>,
    /// The end (offset of the byte after its last digit) of ids MARK_EVERY - 1, 2 MARK_EVERY - 1, …
    marks: Box<[u32]>,
}

impl Segment {
    /// How many leading ids of this segment `rest` spells too, each followed there by a separator.
    fn intact(&self, rest: &[u8]) -> usize {
        let n = self.text.len();
        let m = common_prefix(&self.text, rest);
        if m == n {
            // every id up to the last; the last only where the body ends it here too
            let last_ends = matches!(rest.get(n), Some(b',' | b']'));
            return self.ids.len() - usize::from(!last_ends);
        }
        // ids whose end lies below `m` are intact (the segment's `,` after each is equal in the
        // body): whole spans of MARK_EVERY from the marks, then the commas of the next span
        let spans = self.marks.partition_point(|&e| (e as usize) < m);
        let mut ids = spans * MARK_EVERY;
        let from = if spans == 0 {
            0
        } else {
            self.marks[spans - 1] as usize
        };
        ids += self.text[from..m].iter().filter(|&&c| c == b',').count();
        // the comma at `from` (after the marked id) was counted with its span already
        if spans > 0 && self.text.get(from) == Some(&b',') && from < m {
            ids -= 1;
        }
        // the body's array ends where the segment goes on: its last id ends as the segment's does
        if self.text[m] == b',' && rest.get(m) == Some(&b']') {
            ids += 1;
        }
        ids
    }
}

impl Segment {
    /// The end of id `k - 1` (`k` ≥ 1): from the mark below it, at most MARK_EVERY ids scanned.
    fn end(&self, k: usize) -> usize {
        if k == self.ids.len() {
            return self.text.len();
        }
        let spans = k / MARK_EVERY;
        let (mut at, mut left) = if spans == 0 {
            (0, k)
        } else {
            (self.marks[spans - 1] as usize + 1, k - spans * MARK_EVERY)
        };
        if left == 0 {
            return at - 1;
        }
        while at < self.text.len() {
            if self.text[at] == b',' {
                left -= 1;
                if left == 0 {
                    return at;
                }
            }
            at += 1;
        }
        self.text.len()
    }
}

/// Length of the longest common prefix of `a` and `b`, eight bytes at a time.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    if a[..n] == b[..n] {
        return n;
    }
    let mut i = 0;
    while i + 8 <= n {
        let x = u64::from_le_bytes(a[i..i + 8].try_into().expect("8 bytes"));
        let y = u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if x != y {
            return i + ((x ^ y).trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// What `IdText::take` took: ids appended, bytes of the body read (the `,` after the last id
/// included, a `]` not), whether they came from the newer generation, and whether the whole
/// segment matched (another one may follow).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Taken {
    pub ids: usize,
    pub bytes: usize,
    pub newer: bool,
    pub whole: bool,
}

/// What the text memo did, for `/metrics` and the bench.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TextStats {
    pub taken: u64,
    pub admitted: u64,
    pub ids: u64,
}

pub struct IdText {
    gens: RwLock<Generations<Segment>>,
    half: usize,
    seed: RandomState,
    taken: AtomicU64,
    admitted: AtomicU64,
}

impl IdText {
    /// A memo of at most `capacity` ids; 0 turns it off.
    pub fn new(capacity: usize) -> Self {
        IdText {
            gens: RwLock::new(Generations::new(capacity / 2)),
            half: capacity / 2,
            seed: RandomState::default(),
            taken: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
        }
    }

    fn key(&self, head: &[u8]) -> u64 {
        self.seed.hash_one(head)
    }

    /// The leading ids of `rest` (an array's text from an id's first byte) that a remembered
    /// segment spells, appended to `out`.
    pub fn take(&self, rest: &[u8], out: &mut Vec<i64>) -> Taken {
        if self.half == 0 || rest.len() < KEY_BYTES {
            return Taken::default();
        }
        let head = &rest[..KEY_BYTES];
        let key = self.key(head);
        let gens = self.gens.read().unwrap_or_else(|e| e.into_inner());
        let found = gens.find(key, |s| {
            (s.text.len() >= KEY_BYTES && s.text[..KEY_BYTES] == *head)
                .then(|| s.intact(rest))
                .filter(|&k| k > 0)
                .map(|k| (s, k))
        });
        let Some(((seg, k), newer)) = found else {
            return Taken::default();
        };
        out.extend(seg.ids[..k].iter().map(|&id| id as i64));
        let end = seg.end(k);
        let bytes = end + usize::from(rest.get(end) == Some(&b','));
        self.taken.fetch_add(k as u64, Ordering::Relaxed);
        Taken {
            ids: k,
            bytes,
            newer,
            whole: k == seg.ids.len(),
        }
    }

    /// Remember `text` (from an id's first byte to the last digit of its last id) as spelling
    /// `ids`, where it is canonical and at least `KEY_BYTES` long; a text that is not, or whose ids
    /// differ from `ids`, is left out.
    pub fn admit(&self, text: &[u8], ids: &[i64]) {
        if self.half == 0 || text.len() < KEY_BYTES || ids.is_empty() {
            return;
        }
        // at most half the capacity in one segment, so the newer generation can always take it
        let ids = &ids[..ids.len().min(self.half)];
        let Some((text, packed, marks)) = canonical(text, ids) else {
            return;
        };
        if text.len() < KEY_BYTES {
            return;
        }
        let key = self.key(&text[..KEY_BYTES]);
        let n = packed.len();
        let seg = Segment {
            text: text.into(),
            ids: packed.into_boxed_slice(),
            marks: marks.into_boxed_slice(),
        };
        self.gens
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, seg, n);
        self.admitted.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn stats(&self) -> TextStats {
        let gens = self.gens.read().unwrap_or_else(|e| e.into_inner());
        TextStats {
            taken: self.taken.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            ids: gens.held() as u64,
        }
    }
}

/// `text` cut to its first `ids.len()` ids when it spells them canonically: that prefix, the ids
/// packed, and the marks. None where a byte is not a digit or a single `,`, an id has a leading
/// zero or more than 10 digits, or its value differs from `ids` or does not fit 32 bits.
fn canonical<'t>(text: &'t [u8], ids: &[i64]) -> Option<(&'t [u8], Vec<u32>, Vec<u32>)> {
    let mut packed = Vec::with_capacity(ids.len());
    let mut marks = Vec::with_capacity(ids.len() / MARK_EVERY);
    let mut at = 0usize;
    for (j, &want) in ids.iter().enumerate() {
        let start = at;
        let mut v: u64 = 0;
        while let Some(&c) = text.get(at) {
            if !c.is_ascii_digit() {
                break;
            }
            v = v * 10 + (c - b'0') as u64;
            at += 1;
            if at - start > 10 {
                return None;
            }
        }
        let len = at - start;
        if len == 0 || (len > 1 && text[start] == b'0') || v > u32::MAX as u64 || v as i64 != want {
            return None;
        }
        packed.push(v as u32);
        if (j + 1) % MARK_EVERY == 0 {
            marks.push(at as u32);
        }
        if j + 1 < ids.len() {
            if text.get(at) != Some(&b',') {
                return None;
            }
            at += 1;
        }
    }
    Some((&text[..at], packed, marks))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testrng::xorshift;

    fn spell(ids: &[i64]) -> String {
        ids.iter()
            .map(|i| i.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// What plain reading gives for the ids at the start of `rest`, up to the first non-id.
    fn read_ids(rest: &[u8]) -> Vec<i64> {
        let mut out = Vec::new();
        let mut i = 0;
        loop {
            let start = i;
            while i < rest.len() && rest[i].is_ascii_digit() {
                i += 1;
            }
            if i == start || !matches!(rest.get(i), Some(b',' | b']')) {
                return out;
            }
            out.push(
                std::str::from_utf8(&rest[start..i])
                    .unwrap()
                    .parse()
                    .unwrap(),
            );
            if rest[i] == b']' {
                return out;
            }
            i += 1;
        }
    }

    #[test]
    fn taken_ids_are_what_the_bytes_spell() {
        let mut next = xorshift(0x05ee_d1d5);
        for case in 0..5000 {
            let n = 12 + (next() % 300) as usize;
            let ids: Vec<i64> = (0..n)
                .map(|_| match next() % 8 {
                    0 => (next() % 10) as i64,
                    1 => (next() % 100) as i64,
                    2 => u32::MAX as i64 - (next() % 3) as i64,
                    _ => (next() % 200_000) as i64,
                })
                .collect();
            let memo = IdText::new(1 << 16);
            let held = (next() as usize % n) + 1;
            let text = spell(&ids);
            memo.admit(text.as_bytes(), &ids[..held]);
            // a body: the same ids, some changed, cut or lengthened, then `]` or more ids
            let mut body_ids = ids.clone();
            match case % 5 {
                0 => {}
                1 => {
                    let at = next() as usize % n;
                    body_ids[at] = (next() % 300_000) as i64;
                }
                2 => body_ids.truncate(next() as usize % n + 1),
                3 => {
                    // one id given a digit more or less
                    let at = next() as usize % n;
                    body_ids[at] = if body_ids[at] >= 10 {
                        body_ids[at] / 10
                    } else {
                        body_ids[at] * 10 + 7
                    };
                }
                _ => body_ids.extend((0..5).map(|_| (next() % 1000) as i64)),
            }
            let tail = match case % 3 {
                0 => "]".to_string(),
                1 => " ]".to_string(),
                _ => ",x]".to_string(),
            };
            let body = format!("{}{}", spell(&body_ids), tail);
            let mut out = Vec::new();
            let t = memo.take(body.as_bytes(), &mut out);
            assert_eq!(out.len(), t.ids);
            let plain = read_ids(body.as_bytes());
            assert!(t.ids <= held);
            assert_eq!(&plain[..t.ids.min(plain.len())], &out[..], "case {case}");
            assert!(
                t.ids <= plain.len(),
                "case {case}: took {} of {}",
                t.ids,
                plain.len()
            );
            // the reader goes on at the next id's first byte, or at the `]`
            let rest = &body.as_bytes()[t.bytes..];
            if t.ids > 0 {
                assert_eq!(read_ids(rest), plain[t.ids..], "case {case}");
                assert!(rest[0].is_ascii_digit() || rest[0] == b']' || rest[0] == b'x');
            } else {
                assert_eq!(t.bytes, 0);
            }
            // held ids the body spells the same, each followed by a separator, are all taken
            // (past the key's bytes: a prompt shorter than that is never looked up)
            if text.len() >= KEY_BYTES && body.len() >= KEY_BYTES {
                let same = ids[..held]
                    .iter()
                    .zip(&plain)
                    .take_while(|(a, b)| a == b)
                    .count();
                let key_ok =
                    text.as_bytes()[..KEY_BYTES.min(text.len())] == body.as_bytes()[..KEY_BYTES];
                let head = spell(&ids[..held]);
                if key_ok && head.len() >= KEY_BYTES {
                    assert_eq!(t.ids, same, "case {case}");
                }
            }
        }
    }

    #[test]
    fn text_that_is_not_canonical_or_short_is_never_kept() {
        let ids: Vec<i64> = (1000..1040).collect();
        let memo = IdText::new(1 << 12);
        memo.admit(spell(&ids).replace(",", ", ").as_bytes(), &ids);
        memo.admit(format!("0{}", spell(&ids)).as_bytes(), &ids);
        memo.admit(spell(&ids[..5]).as_bytes(), &ids[..5]);
        let mut wrong = ids.clone();
        wrong[3] += 1;
        memo.admit(spell(&ids).as_bytes(), &wrong);
        memo.admit(
            spell(&[5_000_000_000i64; 10]).as_bytes(),
            &[5_000_000_000i64; 10],
        );
        assert_eq!(memo.stats().ids, 0);
        memo.admit(spell(&ids).as_bytes(), &ids);
        assert_eq!(memo.stats().ids, 40);
    }

    #[test]
    fn segments_follow_one_another_and_stay_bounded() {
        let ids: Vec<i64> = (0..400).map(|i| 100_000 + i).collect();
        let text = spell(&ids);
        let memo = IdText::new(1000);
        memo.admit(text.as_bytes(), &ids[..100]);
        let cut = text.match_indices(',').nth(99).unwrap().0 + 1;
        memo.admit(&text.as_bytes()[cut..], &ids[100..250]);
        let body = format!("{text}]");
        let mut out = Vec::new();
        let first = memo.take(body.as_bytes(), &mut out);
        assert_eq!((first.ids, first.whole, first.bytes), (100, true, cut));
        let second = memo.take(&body.as_bytes()[first.bytes..], &mut out);
        assert_eq!((second.ids, second.whole), (150, true));
        assert_eq!(out, ids[..250]);
        // 1 000 ids: generations of 500; more admitted drops the older whole
        for k in 0..10 {
            let more: Vec<i64> = (0..100).map(|i| 300_000 + 1000 * k + i).collect();
            memo.admit(spell(&more).as_bytes(), &more);
        }
        assert!(memo.stats().ids <= 1000);
        let off = IdText::new(0);
        off.admit(text.as_bytes(), &ids);
        assert_eq!(off.take(body.as_bytes(), &mut Vec::new()), Taken::default());
    }
}
