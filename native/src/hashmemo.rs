//! Digests of the prompt units the fleet holds, remembered by the native route decision so that a
//! prefix routed before is not hashed again (`decide.rs`).
//!
//! Why: a token-id request pays vLLM's SHA-256 chain over every unit of the prompt (one ~130-byte
//! message per unit, ~180 ns each at this CPU's SHA rate: ~23 µs of ~100 µs per 2 048-token request,
//! ~90 µs at 8 192 tokens). The prefixes worth routing are the ones nodes hold, and those come back
//! again and again (shared documents, system prompts, earlier turns). A unit's digest is a function
//! of its parent's digest and its token ids alone, so a remembered one is exact: an entry keeps
//! both and is used only when both are equal, byte for byte and token for token.
//!
//! What is remembered: only units inside the longest prefix some node was found to hold (the
//! decision's best `any_tokens`), so prompts nobody holds (fresh user turns, uncached prompts, a
//! flood of random ids) never enter and pay the full chain every time. Bounded: two generations of
//! at most `capacity / 2` entries each; when the newer one fills, the older is dropped whole (an
//! approximate LRU with no per-hit write). Lookups share a read lock; only admissions write.
//!
//! Where the time goes: with the table out of the cache (the index's work in between), each lookup
//! is a memory miss. Entries are keyed by a running hash of the prompt's tokens from the root, not
//! by the parent's digest, so every unit's slot is found without waiting for the one before it and
//! the misses overlap; the chain of parents is then checked entry by entry. Tokens sit in the entry
//! (no pointer to follow), which limits a unit to `MAX_UNIT` ids that fit in 32 bits; other units
//! are hashed every time.

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::RwLock;

use foldhash::fast::RandomState;
use hashbrown::HashMap;

use crate::tokenhash;

/// Entries kept at most (both generations); ~230 bytes each in the table, ~15 MiB.
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// The longest unit remembered (vLLM hashes in units of a block, 16 tokens by default).
pub const MAX_UNIT: usize = 32;

struct Entry {
    parent: [u8; 32],
    digest: [u8; 32],
    tokens: [u32; MAX_UNIT],
}

impl Entry {
    fn holds(&self, parent: &[u8], chunk: &[i64]) -> bool {
        self.parent[..] == *parent && chunk.iter().zip(&self.tokens).all(|(&t, &s)| t == s as i64)
    }
}

/// `chunk` as an entry keeps it, or None when the memo cannot (too long, or an id past 32 bits).
fn packed(chunk: &[i64]) -> Option<[u32; MAX_UNIT]> {
    if chunk.len() > MAX_UNIT {
        return None;
    }
    let mut out = [0u32; MAX_UNIT];
    for (o, &t) in out.iter_mut().zip(chunk) {
        *o = u32::try_from(t).ok()?;
    }
    Some(out)
}

#[derive(Default)]
struct Generations {
    newer: HashMap<u64, Entry>,
    older: HashMap<u64, Entry>,
}

impl Generations {
    /// The digest of the unit keyed `tag` when the entry there holds `parent` and `chunk`, and
    /// whether it is in the newer generation.
    fn get(&self, tag: u64, parent: &[u8], chunk: &[i64]) -> Option<([u8; 32], bool)> {
        let found = |m: &HashMap<u64, Entry>| {
            m.get(&tag)
                .filter(|e| e.holds(parent, chunk))
                .map(|e| e.digest)
        };
        found(&self.newer)
            .map(|d| (d, true))
            .or_else(|| found(&self.older).map(|d| (d, false)))
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
    gens: RwLock<Generations>,
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
    /// A memo of at most `capacity` entries; 0 turns it off (every unit hashed).
    pub fn new(capacity: usize) -> Self {
        HashMemo {
            gens: RwLock::new(Generations::default()),
            half: capacity / 2,
            seed: RandomState::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            admitted: AtomicU64::new(0),
        }
    }

    fn keeps(&self, root: &[u8], unit: usize) -> bool {
        self.half > 0 && root.len() == 32 && (1..=MAX_UNIT).contains(&unit)
    }

    /// The key of the first unit: the root and the unit size.
    fn root_tag(&self, root: &[u8], unit: usize) -> u64 {
        self.seed.hash_one((root, unit))
    }

    /// The key of the unit after the one keyed `prev`: a running hash of the tokens, so no lookup
    /// waits on the digest the one before it found.
    fn tag(&self, prev: u64, chunk: &[i64]) -> u64 {
        self.seed.hash_one((prev, chunk))
    }

    /// The digests of every full `unit` of `tokens` chained from `root` (`tokenhash::sha256_chain`),
    /// the leading units the memo holds read from it; None where `sha256_chain` gives None.
    pub fn chain(&self, root: &[u8], tokens: &[i64], unit: usize) -> Option<Chain> {
        if unit == 0 || root.len() >= 256 {
            return None;
        }
        let mut digests: Vec<[u8; 32]> = Vec::with_capacity(tokens.len() / unit);
        let mut fresh_from = 0;
        if self.keeps(root, unit) {
            let gens = self.gens.read().unwrap_or_else(|e| e.into_inner());
            let mut in_newer = true;
            let mut tag = self.root_tag(root, unit);
            for chunk in tokens.chunks_exact(unit) {
                tag = self.tag(tag, chunk);
                let parent = digests.last().map_or(root, |d| &d[..]);
                let Some((d, newer)) = gens.get(tag, parent, chunk) else {
                    break;
                };
                in_newer &= newer;
                fresh_from += in_newer as usize;
                digests.push(d);
            }
        }
        let found = digests.len();
        let mut buf: Vec<u8> = Vec::with_capacity(64 + 5 * unit);
        for chunk in tokens[found * unit..].chunks_exact(unit) {
            let parent = digests.last().map_or(root, |d| &d[..]);
            let d = tokenhash::unit_digest(&mut buf, parent, chunk)?;
            digests.push(d);
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
    /// the newer generation lacks.
    pub fn admit(&self, root: &[u8], tokens: &[i64], unit: usize, chain: &Chain, held: usize) {
        let held = held.min(chain.digests.len());
        if !self.keeps(root, unit) || chain.fresh_from >= held {
            return;
        }
        // the entries, made before the lock is taken
        let mut tag = self.root_tag(root, unit);
        let mut new: Vec<(u64, Entry)> = Vec::with_capacity(held - chain.fresh_from);
        for (i, chunk) in tokens.chunks_exact(unit).take(held).enumerate() {
            tag = self.tag(tag, chunk);
            if i < chain.fresh_from {
                continue;
            }
            let Some(tokens) = packed(chunk) else {
                break; // a lookup stops at this unit: the ones after it would never be read
            };
            let mut parent = [0u8; 32];
            parent.copy_from_slice(if i == 0 { root } else { &chain.digests[i - 1] });
            let digest = chain.digests[i];
            new.push((
                tag,
                Entry {
                    parent,
                    digest,
                    tokens,
                },
            ));
        }
        let mut gens = self.gens.write().unwrap_or_else(|e| e.into_inner());
        for (tag, entry) in new {
            if gens.newer.len() >= self.half {
                gens.older = std::mem::take(&mut gens.newer);
            }
            gens.newer.insert(tag, entry);
            self.admitted.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn stats(&self) -> MemoStats {
        let gens = self.gens.read().unwrap_or_else(|e| e.into_inner());
        MemoStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            admitted: self.admitted.load(Ordering::Relaxed),
            entries: (gens.newer.len() + gens.older.len()) as u64,
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
        assert_eq!(got.digests, tokenhash::sha256_chain(&ROOT, &u, 16).unwrap());
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
            assert_eq!(c.digests, tokenhash::sha256_chain(&ROOT, &t, 16).unwrap());
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
    fn units_it_cannot_keep_are_hashed_every_time() {
        let memo = HashMemo::new(1024);
        let long = tokens(40 * 4, 2);
        let c = memo.chain(&ROOT, &long, 40).unwrap();
        memo.admit(&ROOT, &long, 40, &c, 4);
        assert_eq!(memo.stats().entries, 0);
        let mut big = tokens(16 * 6, 4);
        big[16 * 2 + 1] = -5;
        let c = memo.chain(&ROOT, &big, 16).unwrap();
        memo.admit(&ROOT, &big, 16, &c, 6);
        // the units before the one with a negative id are kept, not it nor the ones after it
        assert_eq!(memo.stats().entries, 2);
        let again = memo.chain(&ROOT, &big, 16).unwrap();
        assert_eq!(again.fresh_from, 2);
        assert_eq!(
            again.digests,
            tokenhash::sha256_chain(&ROOT, &big, 16).unwrap()
        );
    }

    #[test]
    fn off_at_zero_capacity() {
        let memo = HashMemo::new(0);
        let t = tokens(64, 1);
        let c = memo.chain(&ROOT, &t, 16).unwrap();
        memo.admit(&ROOT, &t, 16, &c, 4);
        assert_eq!(memo.stats().entries, 0);
        assert_eq!(c.digests, tokenhash::sha256_chain(&ROOT, &t, 16).unwrap());
    }
}
