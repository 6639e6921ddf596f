//! Digests of the prompt units the fleet holds, remembered by the native route decision so that a
//! prefix routed before is not hashed again (`decide.rs`).
//!
//! Why: a token-id request pays vLLM's SHA-256 chain over every unit of the prompt (one ~130-byte
//! message per unit, ~180 ns each at this CPU's SHA rate: ~23 µs of ~100 µs per 2 048-token request,
//! ~90 µs at 8 192 tokens). The prefixes worth routing are the ones nodes hold, and those come back
//! again and again (shared documents, system prompts, earlier turns). A unit's digest is a function
//! of its parent's digest and its token ids alone, so a remembered one is exact: it is used only
//! where the parent digest and every id are equal, byte for byte and token for token.
//!
//! What is remembered: only units inside the longest prefix some node was found to hold (the
//! decision's best `any_tokens`), so prompts nobody holds (fresh user turns, uncached prompts, a
//! flood of random ids) never enter; `reach.rs` keeps their cost low (hashing stops at the first
//! full-attention block no node holds).
//!
//! How: a *segment* per admission, the run of units a prompt added (its parent digest, its ids as
//! u32 in one slice, their digests in another), found by a hash of its parent digest and its first
//! unit's ids. A lookup takes the segment that starts where the prompt is, walks it while the ids
//! stay equal (a sequential compare), and where they part asks for a segment starting there. So a
//! prompt costs one table lookup per segment it crosses, and an admission one allocation, two copies
//! and one insert, whatever its length. (The first version kept one table entry per unit: a first
//! route of an 8 192-token prompt admitted a few hundred entries one insert at a time, and with the
//! memo on a first route cost 307–332 µs against 262–276 µs with it off; BENCHMARKS.md.) Bounded by units:
//! two generations of at most `capacity / 2` units each; when the newer one fills, the older is
//! dropped whole (an approximate LRU with no per-hit write; a prompt read partly from the older
//! generation is admitted again into the newer). Lookups share a read lock; only admissions write.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use foldhash::fast::RandomState;

use crate::generations::Generations;
use crate::tokenhash;

/// Units kept at most (both generations); 96 bytes each with 16-token units, ~6 MiB.
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// A run of consecutive units one admission added.
struct Segment {
    parent: [u8; 32],
    unit: usize,
    tokens: Box<[u32]>, // units × unit ids
    digests: Box<[[u8; 32]]>,
}

impl Segment {
    /// How many leading units of `tokens` (whole units) equal this segment's.
    fn common_units(&self, tokens: &[i64]) -> usize {
        let n = self.digests.len().min(tokens.len() / self.unit);
        let want = &tokens[..n * self.unit];
        match self
            .tokens
            .iter()
            .zip(want)
            .position(|(&s, &t)| s as i64 != t)
        {
            Some(i) => i / self.unit,
            None => n,
        }
    }
}

/// `chunk` as u32 ids, or None when one does not fit (a negative id, one past 32 bits).
fn packed_into(out: &mut Vec<u32>, chunk: &[i64]) -> bool {
    if chunk.iter().any(|&t| u32::try_from(t).is_err()) {
        return false;
    }
    out.extend(chunk.iter().map(|&t| t as u32));
    true
}

impl Segment {
    /// Whether this segment starts after `parent` with the ids `chunk`.
    fn starts(&self, parent: &[u8], chunk: &[i64]) -> bool {
        self.parent[..] == *parent
            && self.unit == chunk.len()
            && chunk
                .iter()
                .zip(&self.tokens[..])
                .all(|(&t, &x)| t == x as i64)
    }
}

/// What the memo did, for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoStats {
    pub hits: u64,
    pub misses: u64,
    pub admitted: u64,
    pub entries: u64,
    pub capacity: u64,
}

pub struct HashMemo {
    gens: RwLock<Generations<Segment>>,
    half: usize,
    seed: RandomState,
    hits: AtomicU64,
    misses: AtomicU64,
    admitted: AtomicU64,
}

/// A prompt's chain as `HashMemo::chain` found it: every unit's digest, and how many leading ones
/// came from the memo's newer generation (those need no admission).
pub struct Chain {
    pub digests: Vec<[u8; 32]>,
    pub fresh_from: usize,
}

impl HashMemo {
    /// A memo of at most `capacity` units; 0 turns it off (every unit hashed).
    pub fn new(capacity: usize) -> Self {
        HashMemo {
            gens: RwLock::new(Generations::new(capacity / 2)),
            half: capacity / 2,
            seed: RandomState::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
        }
    }

    fn keeps(&self, root: &[u8], unit: usize) -> bool {
        self.half > 0 && root.len() == 32 && unit > 0
    }

    /// The key of a segment starting after `parent` with the ids `chunk`.
    fn key(&self, parent: &[u8], chunk: &[i64]) -> u64 {
        self.seed.hash_one((parent, chunk))
    }

    /// The digests of every full `unit` of `tokens` chained from `root` (`tokenhash::sha256_chain`),
    /// the leading units the memo holds read from it; None where `sha256_chain` gives None.
    #[cfg(test)]
    pub fn chain(&self, root: &[u8], tokens: &[i64], unit: usize) -> Option<Chain> {
        self.chain_until(root, tokens, unit, &mut |_, _| true)
    }

    /// `chain`, stopping after the first computed unit `more` (its index and digest) turns down: the
    /// caller knows no node can use the units after it (`decide.rs`). Units read from the memo are
    /// not asked about.
    pub fn chain_until(
        &self,
        root: &[u8],
        tokens: &[i64],
        unit: usize,
        more: &mut dyn FnMut(usize, &[u8; 32]) -> bool,
    ) -> Option<Chain> {
        if unit == 0 || root.len() >= 256 {
            return None;
        }
        let units = tokens.len() / unit;
        let mut digests: Vec<[u8; 32]> = Vec::with_capacity(units);
        let mut fresh_from = 0;
        if self.keeps(root, unit) {
            let gens = self.gens.read().unwrap_or_else(|e| e.into_inner());
            let mut in_newer = true;
            while digests.len() < units {
                let at = digests.len();
                let parent = digests.last().map_or(root, |d| &d[..]);
                let chunk = &tokens[at * unit..(at + 1) * unit];
                let key = self.key(parent, chunk);
                let Some((seg, newer)) = gens.find(key, |s| s.starts(parent, chunk).then_some(s))
                else {
                    break;
                };
                let n = seg.common_units(&tokens[at * unit..]);
                if n == 0 {
                    break; // never: `get` compared the first unit
                }
                digests.extend_from_slice(&seg.digests[..n]);
                in_newer &= newer;
                if in_newer {
                    fresh_from = digests.len();
                }
            }
        }
        let found = digests.len();
        let mut buf: Vec<u8> = Vec::with_capacity(64 + 5 * unit);
        for chunk in tokens[found * unit..].chunks_exact(unit) {
            let parent = digests.last().map_or(root, |d| &d[..]);
            let d = tokenhash::unit_digest(&mut buf, parent, chunk)?;
            digests.push(d);
            if !more(digests.len() - 1, &d) {
                break;
            }
        }
        self.hits.fetch_add(found as u64, Ordering::Relaxed);
        self.misses
            .fetch_add((digests.len() - found) as u64, Ordering::Relaxed);
        Some(Chain {
            digests,
            fresh_from,
        })
    }

    /// Remember the first `held` units of `chain` (the prefix some node holds), from the first one
    /// the newer generation lacks, as one segment.
    pub fn admit(&self, root: &[u8], tokens: &[i64], unit: usize, chain: &Chain, held: usize) {
        let held = held
            .min(chain.digests.len())
            .min(tokens.len() / unit.max(1));
        if !self.keeps(root, unit) || chain.fresh_from >= held {
            return;
        }
        let start = chain.fresh_from;
        // at most half the capacity in one segment, so the newer generation can always take it
        let end = held.min(start + self.half);
        let mut ids: Vec<u32> = Vec::with_capacity((end - start) * unit);
        for chunk in tokens[start * unit..end * unit].chunks_exact(unit) {
            if !packed_into(&mut ids, chunk) {
                break; // a lookup stops at this unit: the ones after it would never be read
            }
        }
        let n = ids.len() / unit;
        if n == 0 {
            return;
        }
        let mut parent = [0u8; 32];
        parent.copy_from_slice(if start == 0 {
            root
        } else {
            &chain.digests[start - 1]
        });
        let key = self.key(&parent, &tokens[start * unit..(start + 1) * unit]);
        let seg = Segment {
            parent,
            unit,
            tokens: ids.into_boxed_slice(),
            digests: chain.digests[start..start + n].into(),
        };
        self.gens
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, seg, n);
        self.admitted.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn stats(&self) -> MemoStats {
        let gens = self.gens.read().unwrap_or_else(|e| e.into_inner());
        MemoStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            entries: gens.held() as u64,
            capacity: 2 * self.half as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: usize, seed: i64) -> Vec<i64> {
        (0..n as i64).map(|i| (i * 7919 + seed) % 150_000).collect()
    }

    const ROOT: [u8; 32] = [7; 32];

    /// The chain of `t` (16-id units) hashed in full.
    fn full(t: &[i64]) -> Vec<[u8; 32]> {
        tokenhash::sha256_chain(&ROOT, t, 16).unwrap()
    }

    #[test]
    fn remembered_digests_equal_the_chain() {
        let memo = HashMemo::new(1024);
        let t = tokens(16 * 20, 3);
        let want = tokenhash::sha256_chain(&ROOT, &t, 16).unwrap();
        let c = memo.chain(&ROOT, &t, 16).unwrap();
        assert_eq!(c.digests, want);
        assert_eq!(c.fresh_from, 0);
        memo.admit(&ROOT, &t, 16, &c, 12);
        let again = memo.chain(&ROOT, &t, 16).unwrap();
        assert_eq!(again.digests, want);
        assert_eq!(again.fresh_from, 12);
        let s = memo.stats();
        assert_eq!((s.hits, s.misses, s.admitted, s.entries), (12, 28, 12, 12));
    }

    #[test]
    fn a_changed_token_or_root_misses() {
        let memo = HashMemo::new(1024);
        let t = tokens(16 * 8, 5);
        let c = memo.chain(&ROOT, &t, 16).unwrap();
        memo.admit(&ROOT, &t, 16, &c, 8);
        let mut u = t.clone();
        u[16 * 3 + 5] += 1;
        let got = memo.chain(&ROOT, &u, 16).unwrap();
        assert_eq!(got.digests, full(&u));
        assert_eq!(got.fresh_from, 3);
        let other = [9u8; 32];
        let got = memo.chain(&other, &t, 16).unwrap();
        assert_eq!(got.fresh_from, 0);
        assert_eq!(
            got.digests,
            tokenhash::sha256_chain(&other, &t, 16).unwrap()
        );
        // another unit size over the same tokens never reads these entries
        let got = memo.chain(&ROOT, &t, 8).unwrap();
        assert_eq!(got.digests, tokenhash::sha256_chain(&ROOT, &t, 8).unwrap());
    }

    #[test]
    fn bounded_by_capacity_and_still_exact() {
        let memo = HashMemo::new(64);
        for s in 0..40 {
            let t = tokens(16 * 10, s);
            let c = memo.chain(&ROOT, &t, 16).unwrap();
            assert_eq!(c.digests, full(&t));
            memo.admit(&ROOT, &t, 16, &c, 10);
            assert!(memo.stats().entries <= 64);
        }
        // the last prompt is still whole in the memo; the first was dropped
        let last = memo.chain(&ROOT, &tokens(160, 39), 16).unwrap();
        assert_eq!(last.fresh_from, 10);
        assert_eq!(
            memo.chain(&ROOT, &tokens(160, 0), 16).unwrap().fresh_from,
            0
        );
    }

    #[test]
    fn units_with_ids_it_cannot_pack_are_hashed_every_time() {
        let memo = HashMemo::new(1024);
        // any unit size is kept (40 ids here)
        let long = tokens(40 * 4, 2);
        let c = memo.chain(&ROOT, &long, 40).unwrap();
        memo.admit(&ROOT, &long, 40, &c, 4);
        assert_eq!(memo.stats().entries, 4);
        assert_eq!(memo.chain(&ROOT, &long, 40).unwrap().fresh_from, 4);
        let mut big = tokens(16 * 6, 4);
        big[16 * 2 + 1] = -5;
        let c = memo.chain(&ROOT, &big, 16).unwrap();
        memo.admit(&ROOT, &big, 16, &c, 6);
        // the units before the one with a negative id are kept, not it nor the ones after it
        assert_eq!(memo.stats().entries, 4 + 2);
        let again = memo.chain(&ROOT, &big, 16).unwrap();
        assert_eq!(again.fresh_from, 2);
        assert_eq!(again.digests, full(&big));
    }

    #[test]
    fn a_prompt_is_read_across_the_segments_of_its_parts() {
        // a shared system prompt, then two documents after it, then the system prompt + document B
        // + a question: read from two segments (the one of S+A up to where A starts, then B's own)
        let memo = HashMemo::new(4096);
        let s = tokens(16 * 5, 11);
        let a = tokens(16 * 7, 12);
        let b = tokens(16 * 6, 13);
        let sa: Vec<i64> = s.iter().chain(&a).copied().collect();
        let sb: Vec<i64> = s.iter().chain(&b).copied().collect();
        let c = memo.chain(&ROOT, &sa, 16).unwrap();
        memo.admit(&ROOT, &sa, 16, &c, 12);
        let c = memo.chain(&ROOT, &sb, 16).unwrap();
        assert_eq!(
            c.fresh_from, 5,
            "the system prompt's units come from S+A's segment"
        );
        memo.admit(&ROOT, &sb, 16, &c, 11);
        assert_eq!(memo.stats().admitted, 12 + 6, "only B's units were added");
        let mut sbq = sb.clone();
        sbq.extend(tokens(16 * 3 + 5, 14));
        let got = memo.chain(&ROOT, &sbq, 16).unwrap();
        assert_eq!(got.fresh_from, 11);
        assert_eq!(got.digests, full(&sbq));
        // S+A is still whole
        let got = memo.chain(&ROOT, &sa, 16).unwrap();
        assert_eq!((got.fresh_from, got.digests.len()), (12, 12));
        // a prompt shorter than a segment reads the part it has, and a changed last id misses there
        let mut short = sa[..16 * 9].to_vec();
        let got = memo.chain(&ROOT, &short, 16).unwrap();
        assert_eq!(got.fresh_from, 9);
        short[16 * 9 - 1] += 1;
        let got = memo.chain(&ROOT, &short, 16).unwrap();
        assert_eq!(got.fresh_from, 8);
        assert_eq!(got.digests, full(&short));
    }

    #[test]
    fn a_prompt_read_from_the_older_generation_is_admitted_again() {
        let memo = HashMemo::new(40); // 20 units a generation
        let first = tokens(16 * 12, 21);
        let c = memo.chain(&ROOT, &first, 16).unwrap();
        memo.admit(&ROOT, &first, 16, &c, 12);
        let other = tokens(16 * 12, 22);
        let c = memo.chain(&ROOT, &other, 16).unwrap();
        memo.admit(&ROOT, &other, 16, &c, 12); // 24 > 20: `first` moves to the older generation
        let got = memo.chain(&ROOT, &first, 16).unwrap();
        assert_eq!(got.fresh_from, 0, "read from the older generation");
        assert_eq!(memo.stats().hits, 12);
        memo.admit(&ROOT, &first, 16, &got, 12);
        let got = memo.chain(&ROOT, &first, 16).unwrap();
        assert_eq!(got.fresh_from, 12);
        assert!(memo.stats().entries <= 40);
    }

    #[test]
    fn off_at_zero_capacity() {
        let memo = HashMemo::new(0);
        let t = tokens(64, 1);
        let c = memo.chain(&ROOT, &t, 16).unwrap();
        memo.admit(&ROOT, &t, 16, &c, 4);
        assert_eq!(memo.stats().entries, 0);
        assert_eq!(c.digests, full(&t));
    }
}
